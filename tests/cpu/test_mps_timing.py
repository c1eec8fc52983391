"""bench/mps_timing.py's A/B timing (interleaved_ms), on the CPU with its batches faked: every arm
runs under its own config overrides, the order reverses every other round, and each arm's figure
is the median of its rounds, so that a drift over the run cannot favour the arms timed last."""

import importlib
from pathlib import Path

import mkernel

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_interleaved_arms_alternate_and_take_their_overrides(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    cc = importlib.import_module("mps_timing")
    clock = iter(range(1000))
    seen = []  # (arm, tp_send_tiles in force) per timed batch

    def batch_times(comm, barrier, fn, n, batches):
        assert batches == 1
        fn()
        return [float(next(clock))]  # a drift: every later batch is slower

    monkeypatch.setattr(cc, "batch_times", batch_times)
    base = mkernel.config.get().tp_send_tiles

    def arm(name):
        return lambda: seen.append((name, mkernel.config.get().tp_send_tiles))

    arms = [("default", arm("default"), {}), ("x2", arm("x2"), {"tp_send_tiles": 2 * base}),
            ("x4", arm("x4"), {"tp_send_tiles": 4 * base})]
    ms = cc.interleaved_ms(None, None, arms, rounds=4, warmup=1)
    tiles = {"default": base, "x2": 2 * base, "x4": 4 * base}
    assert all(t == tiles[name] for name, t in seen)  # warm-up and batches under the arm's overrides
    timed = [name for name, _ in seen[3:]]  # after one warm-up call each
    assert timed == ["default", "x2", "x4", "x4", "x2", "default"] * 2
    # batches 0..11 in that order (default 0 5 6 11, x2 1 4 7 10, x4 2 3 8 9): under a linear drift
    # every arm's median is the same, where timing the arms one after another ranks them by order
    assert ms == {"default": 5.5, "x2": 5.5, "x4": 5.5}
    assert mkernel.config.get().tp_send_tiles == base  # overrides undone
