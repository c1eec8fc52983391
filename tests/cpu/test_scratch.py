"""Scratch memory (mkernel/comm/scratch.py) with a faked communicator (host arrays): layout, growth
only at a new largest need (releasing the cached plans), the high-water mark, and the same decisions
on every rank for the same call sequence."""

import numpy as np
import pytest

from mkernel.comm.plans import PlanRegistry
from mkernel.comm.scratch import ALIGN, Scratch, layout


class FakeComm:
    def __init__(self, rank=0):
        self.rank = rank
        self.plans = PlanRegistry(synchronize=lambda: None)
        self.allocations, self.releases = [], 0

    def empty(self, shape, dtype):
        self.allocations.append(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        return np.zeros(shape, dtype)

    def release_plans(self):
        self.releases += 1
        self.plans.clear()


def test_layout_aligns_every_buffer():
    total, offs = layout([("a", (3,), np.float16), ("b", (5, 7), np.float32), ("c", 1, np.uint8)])
    assert [offs[n][0] for n in "abc"] == [0, ALIGN, ALIGN + 256]  # 6 bytes, then 140 bytes: one ALIGN each
    assert total == 3 * ALIGN
    assert offs["b"][1] == (5, 7) and offs["b"][2] == np.float32


def test_views_are_disjoint_and_start_where_asked():
    comm = FakeComm()
    scratch = Scratch(comm)
    sizes = [("x", (64, 8), np.float16), ("y", (100,), np.float32)]
    v = scratch.views("op", sizes)
    w = scratch.views("op2", [("z", (10,), np.float32)], start=layout(sizes)[0])
    v["x"][...] = 1
    v["y"][...] = 2
    w["z"][...] = 3
    assert (v["x"] == 1).all() and (v["y"] == 2).all() and (w["z"] == 3).all()
    assert v["x"].shape == (64, 8) and v["y"].dtype == np.float32
    assert scratch.nbytes == layout(sizes)[0] + ALIGN


def test_grows_only_for_a_larger_need_and_releases_the_plans_first():
    comm = FakeComm()
    scratch = Scratch(comm)
    comm.plans.add(("a",), {})
    scratch.views("op", [("x", (1000,), np.float16)])
    assert scratch.grown == 1 and comm.releases == 1 and len(comm.plans) == 0
    comm.plans.add(("b",), {})
    scratch.views("op", [("x", (500,), np.float16)])  # fits: nothing released, nothing allocated
    assert scratch.grown == 1 and comm.releases == 1 and len(comm.plans) == 1 and len(comm.allocations) == 1
    scratch.views("op", [("x", (5000,), np.float16)])
    assert scratch.grown == 2 and scratch.nbytes == layout([("x", (5000,), np.float16)])[0]
    assert scratch.high_water == scratch.largest_need == scratch.nbytes
    assert scratch.views("op", []) == {}


def _calls(seed, n_shapes=60, n_calls=300):
    rng = np.random.default_rng(seed)
    shapes = [[("recv", (int(rng.integers(1, 2048)), int(rng.integers(1, 2048)) * 8), np.float16),
               ("gath", (int(rng.integers(1, 512)), 64), np.float32)] for _ in range(n_shapes)]
    return [shapes[i] for i in rng.integers(0, n_shapes, n_calls)]


def test_memory_stays_at_the_largest_single_need_over_many_shapes():
    comm = FakeComm()
    scratch = Scratch(comm)
    record = 0
    for sizes in _calls(1):
        need = layout(sizes)[0]
        record = max(record, need)
        scratch.views("op", sizes)
        assert scratch.nbytes == record  # exactly the largest need so far: within 2x of it by far
    assert scratch.high_water == record
    assert scratch.grown <= 12  # one growth per new record: few over 300 calls (ln(60) + 1 expected)


@pytest.mark.parametrize("seed", [2, 3])
def test_every_rank_grows_at_the_same_calls(seed):
    seq = _calls(seed)
    events = []
    for rank in range(2):
        comm = FakeComm(rank)
        scratch = Scratch(comm)
        grown = []
        for i, sizes in enumerate(seq):
            before = scratch.grown
            scratch.views("op", sizes)
            if scratch.grown != before:
                grown.append(i)
        events.append((grown, comm.allocations))
    assert events[0] == events[1]
