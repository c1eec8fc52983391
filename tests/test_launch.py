"""launch.PlanCache (CPU): a hit launches the stored plan on the given stream, a miss launches
nothing, and the least recently used plan goes first."""

from mkernel import launch as ml


def test_plan_cache_hit_miss_and_eviction(monkeypatch):
    calls = []
    monkeypatch.setattr(ml, "launch", lambda *a, **k: calls.append((a, k)))
    cache = ml.PlanCache(size=2)
    assert cache.launch("a") is False and not calls
    cache.add("a", ("fa", (1,), (2,), "args-a", 10))
    cache.add("b", ("fb", (1,), (2,), "args-b", 20))
    assert cache.launch("a", stream="s") is True
    assert calls[-1] == (("fa", (1,), (2,), "args-a"), {"smem": 10, "stream": "s"})
    cache.add("c", ("fc", (1,), (2,), "args-c", 30))  # evicts b: a was used more recently
    assert cache.launch("b") is False
    assert cache.launch("a") and cache.launch("c")
    assert len(calls) == 3
