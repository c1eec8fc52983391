"""Scratch memory (``comm.scratch``): one symmetric region that every plan's transient buffers
share, so that cached plans hold only their small state (flags, counters) and memory stays near
the largest single call's need, however many shapes are cached.

Why sharing is safe: a communicator's ops run in order on every rank, each launch in its own
epoch. A buffer is transient: written and read within one call (whose launches run back to back;
plans used in the same call lie one after the other: ``start``). A rank writes into a peer's
buffers only after that peer announced the launch's epoch (``credits_wait`` in every kernel), so
after the peer's previous launch, whichever op it was, finished reading its scratch.

Growth: at a shape's first call (where the ranks already agree on the call) the scratch is
replaced by one of exactly that call's need, after the cached plans are released (they point
into the old one; each shape's next call builds its plan again). Every rank grows at the same
call: the need is a function of the agreed call.
"""

import numpy

from mkernel.core.log import get_logger

log = get_logger("scratch")

ALIGN = 256  # each buffer's start: TMA and 16-byte vector accesses need far less


def layout(sizes) -> tuple:
    """(total bytes, {name: (offset, shape, dtype)}) of buffers [(name, shape, dtype)], each aligned."""
    offsets, total = {}, 0
    for name, shape, dtype in sizes:
        dtype = numpy.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        offsets[name] = (total, shape, dtype)
        total += -(-_count(shape) * dtype.itemsize // ALIGN) * ALIGN
    return total, offsets


def _count(shape) -> int:
    return int(numpy.prod(shape, dtype=numpy.int64))


class Scratch:
    """One communicator's scratch. ``views(sizes)`` gives the buffers of one plan, growing first if
    needed (collective, at a shape's first call only)."""

    def __init__(self, comm):
        self._comm = comm
        self._buf = None
        self.high_water = 0  # the largest scratch held
        self.largest_need = 0  # the largest single call's need seen
        self.grown = 0

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else int(self._buf.nbytes)

    def views(self, op: str, sizes, start: int = 0) -> dict:
        """{name: CuPy array} laid out from byte ``start`` (past the buffers of a plan used in the same
        call); ``sizes``: [(name, shape, dtype)]."""
        total, offsets = layout(sizes)
        if not total:
            return {}
        need = start + total
        self.largest_need = max(self.largest_need, need)
        if need > self.nbytes:
            self._grow(op, need)
        base = self._buf
        return {name: base[start + off:start + off + _count(shape) * dt.itemsize].view(dt).reshape(shape)
                for name, (off, shape, dt) in offsets.items()}

    def _grow(self, op, need):
        comm, old = self._comm, self.nbytes
        if len(comm.plans):  # they point into the old scratch (a MoE handle may keep it alive a while)
            comm.release_plans()
        self._buf = None
        self._buf = comm.empty((need,), numpy.uint8)
        self.high_water = max(self.high_water, need)
        self.grown += 1
        log.info("rank %d: scratch %d -> %d bytes for %s", comm.rank, old, need, op)

    def release(self):
        """Drops the scratch (the plans pointing into it must be released first)."""
        self._buf = None

    def stats(self) -> dict:
        return {"bytes": self.nbytes, "largest_need": self.largest_need, "high_water": self.high_water,
                "grown": self.grown}
