"""The plans of a communicator's ops (``comm.plans``): one per (op, call shape), and the ops' state
that is not per shape.

A plan holds what every call of its shape reuses: symmetric buffers (``comm.empty``), device
counters, small per-shape state. A shape's first call builds it (agreeing and allocating: the
one call of a shape that may wait); later calls find it and only launch. The registry keeps at
most ``max_plans`` plans, least recently used out first. Every rank makes the same calls in the
same order (the communicator's rules), so every rank evicts the same plan at the same call, and
the symmetric memory it frees is freed everywhere (the heap intersects free ranges, so a rank
that still holds a view, an op's handle say, frees it later without breaking symmetry).
Evicting waits for the device (the plan's last launch must be done); it happens only while a
shape's first call builds its plan.

A call whose work is only launches may also record them by a key of its arrays and options
(:func:`mkernel.runtime.launch.call_key`): a repeated call then checks for errors and launches
them, nothing else. A record holds while no plan was released since it was made (a release may
free memory its arguments point to), the configuration object is the same and its gate, if any,
lets the call through (a fused call's split search: the record serves while the split holds).
"""

from collections import OrderedDict

from mkernel.core import config
from mkernel.core.log import get_logger

log = get_logger("plans")

MAX_PLANS = 1024  # a plan's own state is small (counters, flags); its buffers are bounded apart
MAX_CALLS = 1024  # recorded calls (argument structs of a few hundred bytes each)


class PlanRegistry:
    """Plans by key (a tuple starting with the op's name), in least-recently-used order, and
    ``state``: the ops' per-communicator state that is not per shape (by name)."""

    def __init__(self, max_plans: int = MAX_PLANS, synchronize=None):
        self.max_plans = max_plans
        self.state = {}
        self._plans = OrderedDict()
        self._synchronize = synchronize or _device_synchronize
        self.evicted = 0
        self.generation = 0  # plans released so far (evictions and clears): a record's validity
        self._calls = OrderedDict()

    def get(self, key):
        """The plan of ``key`` (now the most recently used), or None."""
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
        return plan

    def add(self, key, plan):
        """Keeps ``plan`` for ``key``; evicts the least recently used plans past ``max_plans``."""
        self._plans[key] = plan
        self._plans.move_to_end(key)
        if len(self._plans) > self.max_plans:
            self._synchronize()
            while len(self._plans) > self.max_plans:
                old, _ = self._plans.popitem(last=False)
                self.evicted += 1
                self.generation += 1
                log.debug("evicted the plan of %s", old)
        return plan

    def clear(self):
        """Drops every plan (their symmetric buffers are freed once nothing else holds them), after
        the device finished their launches. Collective in effect: every rank at the same point."""
        if self._plans:
            self._synchronize()
        self._plans.clear()
        self._calls.clear()
        self.generation += 1
        import gc
        gc.collect()  # reference cycles would free some buffers later, and unevenly across ranks

    def launches(self, key):
        """The launches recorded for call ``key`` (record_launches), or None. Uses the call's plans
        as its full call would (their order of use, hence eviction, stays the same on every rank)."""
        rec = self._calls.get(key)
        if rec is None:
            return None
        if rec[0] != self.generation or rec[1] is not config.get():
            del self._calls[key]
            return None
        if rec[5] is not None and not rec[5]():
            return None
        self._calls.move_to_end(key)
        for plan_key in rec[3]:
            self._plans.move_to_end(plan_key)
        return rec[2]

    def record_launches(self, key, launches, plans, keep=(), gate=None):
        """Records a call's launches ``(fn, grid, block, args, smem)``, made with the plans of keys
        ``plans``; ``keep`` holds what their arguments point to that no plan holds (a stream's
        workspace buffer); ``gate()``, if given, is asked before each replay (False: the full call)."""
        assert all(k in self._plans for k in plans), plans
        self._calls[key] = (self.generation, config.get(), tuple(launches), tuple(plans), keep, gate)
        self._calls.move_to_end(key)
        while len(self._calls) > MAX_CALLS:
            self._calls.popitem(last=False)

    def items(self):
        return list(self._plans.items())

    def __len__(self):
        return len(self._plans)

    def __contains__(self, key):
        return key in self._plans


def _device_synchronize():
    import cupy
    cupy.cuda.runtime.deviceSynchronize()
