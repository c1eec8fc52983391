"""The workspace allocator: offsets are a pure function of every rank's free ranges (so symmetric
across ranks), even when ranks' free ranges differ (ranges other communicators of a shared pool hold)."""

import random

import pytest

import mkernel
from mkernel.symmetric import ALIGN, FreeList, take_symmetric

TOTAL = 1 << 24


def _take(lists, nbytes):
    off, size = take_symmetric([fl.free for fl in lists], nbytes, TOTAL)
    for fl in lists:
        fl.take_at(off, size)
    return off, size


def test_same_calls_same_offsets_and_no_overlap():
    def replay(seed):
        rng, fl, live, offsets = random.Random(seed), FreeList(4096, TOTAL), [], []
        for _ in range(2000):
            if live and rng.random() < 0.45:
                fl.give(*live.pop(rng.randrange(len(live))))
            else:
                off, size = _take([fl], rng.randrange(1, 1 << 16))
                assert off % ALIGN == 0 and size % ALIGN == 0
                assert all(off + size <= o or o + s <= off for o, s in live), "overlapping ranges"
                live.append((off, size))
                offsets.append(off)
        for r in live:
            fl.give(*r)
        assert fl.free == [(4096, TOTAL)], "freeing everything must give back one range"
        return offsets
    assert replay(7) == replay(7)


def test_ranks_with_different_holdings_get_a_range_free_on_all():
    """Three ranks; each also holds ranges only it has (a sub-communicator's arena on some ranks
    only). Shared allocations must land where all three are free, and never overlap anyone's."""
    rng = random.Random(3)
    lists = [FreeList(4096, TOTAL) for _ in range(3)]
    own = [[] for _ in lists]
    shared = []
    for _ in range(600):
        r = rng.randrange(3)
        if rng.random() < 0.3:  # a range only rank r takes (its own communicator's)
            off, size = _take([lists[r]], rng.randrange(1, 1 << 15))
            own[r].append((off, size))
        elif rng.random() < 0.3 and own[r]:
            lists[r].give(*own[r].pop(rng.randrange(len(own[r]))))
        elif shared and rng.random() < 0.4:
            off, size = shared.pop(rng.randrange(len(shared)))
            for fl in lists:
                fl.give(off, size)
        else:
            off, size = _take(lists, rng.randrange(1, 1 << 15))
            for held in own + [shared]:
                assert all(off + size <= o or o + s <= off for o, s in held), "overlapping ranges"
            shared.append((off, size))


def test_exhaustion_is_an_actionable_error():
    fl = FreeList(0, 4 * ALIGN)
    _take([fl], 3 * ALIGN)
    with pytest.raises(mkernel.MKernelError, match="workspace_bytes"):
        _take([fl], 2 * ALIGN)


def test_taking_a_range_that_is_not_free_is_an_error():
    fl = FreeList(0, 4 * ALIGN)
    fl.take_at(ALIGN, ALIGN)
    with pytest.raises(mkernel.MKernelError, match="out of step"):
        fl.take_at(0, 2 * ALIGN)
