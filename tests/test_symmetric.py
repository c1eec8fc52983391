"""The workspace allocator's offsets are a pure function of the calls (so symmetric across ranks)."""

import random

import pytest

import mkernel
from mkernel.symmetric import ALIGN, FreeList


def test_same_calls_same_offsets_and_no_overlap():
    def replay(seed):
        rng, fl, live, offsets = random.Random(seed), FreeList(4096, 1 << 24), [], []
        for _ in range(2000):
            if live and rng.random() < 0.45:
                fl.give(*live.pop(rng.randrange(len(live))))
            else:
                off, size = fl.take(rng.randrange(1, 1 << 16))
                assert off % ALIGN == 0 and size % ALIGN == 0
                assert all(off + size <= o or o + s <= off for o, s in live), "overlapping ranges"
                live.append((off, size))
                offsets.append(off)
        for r in live:
            fl.give(*r)
        assert fl.free == [(4096, 1 << 24)], "freeing everything must give back one range"
        return offsets
    assert replay(7) == replay(7)


def test_exhaustion_is_an_actionable_error():
    fl = FreeList(0, 4 * ALIGN)
    fl.take(3 * ALIGN)
    with pytest.raises(mkernel.MKernelError, match="workspace_bytes"):
        fl.take(2 * ALIGN)
