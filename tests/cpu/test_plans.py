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


def test_a_recorded_call_is_launched_until_a_plan_is_released():
    reg, _ = _registry(2)
    reg.add(("op", 1), {})
    launches = (("fn", (1,), (32,), "args", 0),)
    reg.record_launches(("call", 1), launches, [("op", 1)], keep=("buffer",))
    assert reg.launches(("call", 1)) == launches and reg.launches(("call", 2)) is None
    reg.add(("op", 2), {})
    assert reg.launches(("call", 1)) == launches  # adding within the bound frees nothing
    assert [k for k, _ in reg.items()] == [("op", 2), ("op", 1)]  # the call used its plan, as a full call
    reg.add(("op", 3), {})  # evicts ("op", 2)
    assert reg.launches(("call", 1)) is None  # a release may have freed what the record points to
    reg.record_launches(("call", 1), launches, [("op", 1)])
    reg.clear()
    assert reg.launches(("call", 1)) is None


def test_a_recorded_call_is_not_launched_under_another_configuration():
    from mkernel import config

    reg, _ = _registry(2)
    reg.record_launches(("call", 1), (), ())
    with config.override(tp_latency_ll_max_rows=0):  # knobs may choose other kernels or paths
        assert reg.launches(("call", 1)) is None
    assert reg.launches(("call", 1)) is None  # dropped, recorded again by the next full call


def test_a_recorded_call_asks_its_gate_before_each_replay():
    reg, _ = _registry(2)
    reg.add(("op", 1), {})
    answers = [True, False, True]
    reg.record_launches(("call", 1), ("launch",), [("op", 1)], gate=lambda: answers.pop(0))
    assert reg.launches(("call", 1)) == ("launch",)
    assert reg.launches(("call", 1)) is None  # refused: the full call runs (and records again)
    assert reg.launches(("call", 1)) == ("launch",) and not answers  # kept, not dropped


def test_recorded_calls_are_bounded():
    from mkernel.comm import plans

    reg, _ = _registry(2)
    for i in range(plans.MAX_CALLS + 10):
        reg.record_launches(("call", i), (), ())
    assert reg.launches(("call", 0)) is None and reg.launches(("call", plans.MAX_CALLS + 9)) == ()
