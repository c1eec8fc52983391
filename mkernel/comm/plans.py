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
"""

from collections import OrderedDict

from mkernel.core.log import get_logger

log = get_logger("plans")

MAX_PLANS = 1024  # a plan's own state is small (counters, flags); its buffers are bounded apart


class PlanRegistry:
    """Plans by key (a tuple starting with the op's name), in least-recently-used order, and
    ``state``: the ops' per-communicator state that is not per shape (by name)."""

    def __init__(self, max_plans: int = MAX_PLANS, synchronize=None):
        self.max_plans = max_plans
        self.state = {}
        self._plans = OrderedDict()
        self._synchronize = synchronize or _device_synchronize
        self.evicted = 0

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
                log.debug("evicted the plan of %s", old)
        return plan

    def clear(self):
        """Drops every plan (their symmetric buffers are freed once nothing else holds them), after
        the device finished their launches. Collective in effect: every rank at the same point."""
        if self._plans:
            self._synchronize()
        self._plans.clear()
        import gc
        gc.collect()  # reference cycles would free some buffers later, and unevenly across ranks

    def items(self):
        return list(self._plans.items())

    def __len__(self):
        return len(self._plans)

    def __contains__(self, key):
        return key in self._plans


def _device_synchronize():
    import cupy
    cupy.cuda.runtime.deviceSynchronize()
