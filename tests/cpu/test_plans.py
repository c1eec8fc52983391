"""The plan registry (mkernel/comm/plans.py): least recently used plans leave first, the same ones on
every rank for the same call sequence, and only after the device finished their launches."""

import random

from mkernel.comm.plans import PlanRegistry


def _registry(n):
    syncs = []
    return PlanRegistry(max_plans=n, synchronize=lambda: syncs.append(1)), syncs


def test_the_least_recently_used_plan_leaves_first():
    reg, syncs = _registry(3)
    for k in "abc":
        reg.add(("op", k), {"k": k})
    assert not syncs and len(reg) == 3
    assert reg.get(("op", "a")) == {"k": "a"}  # a is now the most recent
    reg.add(("op", "d"), {"k": "d"})
    assert ("op", "b") not in reg and [k for k, _ in reg.items()] == [("op", "c"), ("op", "a"), ("op", "d")]
    assert syncs == [1] and reg.evicted == 1  # one wait for the device, before the eviction
    assert reg.get(("op", "b")) is None


def test_eviction_is_a_function_of_the_call_sequence():
    """Two registries (two ranks) fed the same sequence of calls hold the same plans after each."""
    rng = random.Random(5)
    calls = [("op", rng.randrange(40)) for _ in range(2000)]
    ranks = [_registry(16)[0] for _ in range(2)]
    for key in calls:
        seen = []
        for reg in ranks:
            if reg.get(key) is None:
                reg.add(key, {})
            seen.append([k for k, _ in reg.items()])
        assert seen[0] == seen[1]
    assert all(len(r) == 16 for r in ranks) and ranks[0].evicted == ranks[1].evicted > 0


def test_clear_waits_for_the_device_once_and_keeps_the_state():
    reg, syncs = _registry(4)
    reg.state["x"] = 1
    reg.clear()
    assert not syncs  # nothing to wait for
    reg.add(("op", 1), {})
    reg.clear()
    assert syncs == [1] and len(reg) == 0 and reg.state == {"x": 1}


def test_a_thousand_plans_fit_by_default():
    reg = PlanRegistry(synchronize=lambda: None)
    for i in range(1024):
        reg.add(("op", i), {})
    assert len(reg) == 1024 and reg.evicted == 0
