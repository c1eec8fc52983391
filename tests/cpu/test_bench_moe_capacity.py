"""bench/moe.py's capacity beyond 2 ranks (tight_capacity): the rows every routing needs, checked
token by token against the library's two capacity rules (rows an owner receives; a rank's virtual
pairs between nodes), so that the 2 x 2 run neither overflows nor keeps the W T k default's memory."""

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("W,nodes", [(4, 1), (4, 2), (2, 2)])
def test_tight_capacity_covers_every_rank_and_owner(W, nodes, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    bm = importlib.import_module("moe")
    shape, routings = (256, 64, 32, 16, 4), ("uniform", "zipf1.2")
    T, _, _, E, k = shape
    L, El, epn = W // nodes, E // W, E // nodes
    need = 0
    for ri, rt in enumerate(routings):
        ids = [bm.routing(rt, T, E, k, bm.routing_seed(1, ri, r))[0] for r in range(W)]
        rows = [0] * W  # pairs each owner receives, pair by pair
        virtual = [T] * W  # tokens each rank routes in its node: its own, then those it forwards
        for r, i in enumerate(ids):
            for t in range(T):
                for e in i[t]:
                    rows[int(e) // El] += 1
                for n in {int(e) // epn for e in i[t]} - {r // L}:
                    virtual[n * L + r % L] += 1
        need = max(need, *rows, *(v * k for v in virtual))
    cap = bm.tight_capacity(shape, 1, routings, W, nodes)
    assert need <= cap < need + 1024 and cap % 1024 == 0
    assert bm.bench_capacity(shape, 1, routings, W, nodes) == (cap if W > 2 else W * T * k)
    sys.modules.pop("moe", None)
