"""Symmetric GPU memory: one pool per process, the same size on every rank, mapped into every peer
of the node (cuMem allocations shared as file descriptors, :mod:`mkernel.comm.vmm`, which outlive a
rank that dies; legacy CUDA IPC where the driver cannot), with a device-side table of the peers'
base pointers.

The communicator made by ``mkernel.init`` owns the pool (its workspace); a sub-communicator from
``split`` gets a range of its parent's workspace as its own (an arena: no second allocation, no
second IPC mapping). Offsets are symmetric: an offset names the same buffer on every rank of a
communicator, so ``peer_base[p] + offset`` is rank p's copy of it. Every allocation takes the first
range that is free on *all* its communicator's ranks (:func:`take_symmetric`), so the ranges other
communicators hold in a shared pool never break that.
"""

import threading
import weakref

from mkernel.comm import collectives, vmm
from mkernel.core import env
from mkernel.core.errors import ArgumentError, ClosedError, MKernelError, WorkspaceError
from mkernel.core.log import get_logger

ALIGN = 1024  # TMA with 128-byte swizzle wants 1024-byte aligned shared tiles; keep global buffers so too
CONTROL_BYTES = 1 << 20  # at offset 0: the runtime's flags; words [0, MAX_LOCAL) are credits (peers.cuh)
MAX_LOCAL = 64  # MK_MAX_LOCAL: ranks per node the control area has room for


class Lease:
    """One range ``[offset, offset + size)`` of a free list (workspace bytes, proxy flags), held by
    whatever references it (arrays viewing it, an op plan); ``release(offset, size)`` hands it
    back when the last reference is gone."""

    def __init__(self, release, offset, size):
        self.offset, self.size = offset, size
        weakref.finalize(self, release, offset, size)


class SymmetricHeap:
    """A communicator's workspace: ``nbytes`` at ``base`` (zeroed when made), ``peer_base[p]`` the
    node peer p's copy, ``peer_table`` the same on the device."""

    def __init__(self, base, nbytes, device_id, peer_base, local_rank, parent_range=None):
        import cupy

        self.base, self.nbytes, self.device_id = base, nbytes, device_id
        self.peer_base, self.local_rank = peer_base, local_rank
        self.peer_table = cupy.array(peer_base, dtype=cupy.uint64)
        self._parent_range = parent_range  # an arena's range of its parent (None: owns its allocation)
        self._regions = None  # vmm.Region of every node rank's workspace (None: legacy CUDA IPC)
        self._lock = threading.Lock()
        self._ranges = FreeList(CONTROL_BYTES, nbytes - CONTROL_BYTES)
        self.live = 0
        self.in_use = 0      # bytes of live leases
        self.high_water = 0  # the most in_use was
        self.closed = False

    @classmethod
    def allocate(cls, node_mpi, nbytes: int, device_id: int) -> "SymmetricHeap":
        """The pool: an allocation of its own, IPC-mapped by every node peer. Collective over the node."""
        import cupy

        rt = cupy.cuda.runtime
        nbytes = _round_up(max(nbytes, 2 * CONTROL_BYTES), ALIGN)
        if node_mpi.size > MAX_LOCAL:
            raise ArgumentError(f"{node_mpi.size} ranks in one node; mkernel supports at most {MAX_LOCAL}")
        shared = _shareable(node_mpi, nbytes, device_id) if env.get("MKERNEL_WORKSPACE_SHARING") == "auto" else None
        if shared is not None:
            nbytes, regions = shared
            base = regions[node_mpi.rank].ptr
            rt.memset(base, 0, nbytes)
            rt.deviceSynchronize()
            node_mpi.Barrier()  # zeroed everywhere before any peer's first write
            heap = cls(base, nbytes, device_id, [r.ptr for r in regions], node_mpi.rank)
            heap._regions = regions
            return heap
        base = rt.malloc(nbytes)  # a whole allocation of its own: IPC exports allocation bases
        rt.memset(base, 0, nbytes)
        rt.deviceSynchronize()
        handles = node_mpi.allgather(rt.ipcGetMemHandle(base)) if node_mpi.size > 1 else [None]
        peer_base = [base if p == node_mpi.rank else rt.ipcOpenMemHandle(h) for p, h in enumerate(handles)]
        return cls(base, nbytes, device_id, peer_base, node_mpi.rank)

    @classmethod
    def carve(cls, parent: "SymmetricHeap", rng: "Lease", node_mpi) -> "SymmetricHeap":
        """The arena of a sub-communicator (``node_mpi``: its node) in ``parent``'s range ``rng``
        (``Communicator.split`` takes it, of :func:`carve_bytes`). Collective over the node."""
        import cupy

        cupy.cuda.runtime.memset(parent.base + rng.offset, 0, rng.size)  # flags start at 0
        cupy.cuda.runtime.deviceSynchronize()
        parent_local = node_mpi.allgather(parent.local_rank)  # this node's members, as the parent numbers them
        peer_base = [parent.peer_base[p] + rng.offset for p in parent_local]
        return cls(parent.base + rng.offset, rng.size, parent.device_id, peer_base, node_mpi.rank, rng)

    def alloc_symmetric(self, mpi, nbytes: int, what: str, agree=None) -> Lease:
        """A range at the same offset on every rank of ``mpi``: the first one free on all of them.
        Collective over ``mpi``. ``agree``: a value every rank must pass alike (shape and dtype)."""
        if self.closed:
            raise ClosedError("the communicator's workspace was closed")
        with self._lock:
            mine = list(self._ranges.free)
        views = collectives.allgather_object(mpi, (mine, agree), what)
        if len({repr(v[1]) for v in views}) != 1:
            raise ArgumentError(f"ranks disagree while {what}: " +
                                ", ".join(f"rank {r}: {v[1]!r}" for r, v in enumerate(views)))
        offset, size = take_symmetric([v[0] for v in views], nbytes, self.nbytes)
        with self._lock:
            self._ranges.take_at(offset, size)
            self.live += 1
            self.in_use += size
            self.high_water = max(self.high_water, self.in_use)
        return Lease(self._free, offset, size)

    def _free(self, offset, size):
        with self._lock:
            self._ranges.give(offset, size)
            self.live -= 1
            self.in_use -= size
            if self.closed and self.live == 0:
                self._release_base()

    @property
    def growable(self) -> bool:
        """A root workspace of cuMem allocations: it can grow in place (:meth:`grow`)."""
        return self._regions is not None and self._parent_range is None and not self.closed

    def granularity(self) -> int:
        return vmm.granularity(self.device_id)

    def device_free(self) -> int:
        """Bytes free on this heap's GPU now."""
        import cupy

        with cupy.cuda.Device(self.device_id):
            return cupy.cuda.runtime.memGetInfo()[0]

    def grow(self, node_mpi, nbytes: int, token: str):
        """Maps more memory at the end of every node rank's workspace, to ``nbytes`` in all: the base,
        the offsets and every array stay valid. Collective over the node (the caller makes every rank
        of the communicator grow to the same size); ``token`` names the node's sockets."""
        import cupy

        old = self.nbytes
        vmm.add_node_chunk(node_mpi, self._regions, nbytes - old, self.device_id, token)
        cupy.cuda.runtime.memset(self.base + old, 0, nbytes - old)
        cupy.cuda.runtime.deviceSynchronize()
        node_mpi.Barrier()  # zeroed everywhere before any peer's first write
        with self._lock:
            self.nbytes = nbytes
            self._ranges.total = nbytes - CONTROL_BYTES
            self._ranges.give(old, nbytes - old)

    def array(self, rng: Lease, shape, dtype):
        import cupy

        mem = cupy.cuda.UnownedMemory(self.base + rng.offset, rng.size, rng, self.device_id)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))

    def unmap_peers(self):
        """Closes this rank's mappings of the peers' workspaces (before the node-wide barrier); an
        arena uses its parent's mappings and has none of its own."""
        import cupy

        if self._parent_range is None:
            for p, ptr in enumerate(self.peer_base):
                if p == self.local_rank:
                    continue
                if self._regions is not None:
                    self._regions[p].close()
                else:
                    cupy.cuda.runtime.ipcCloseMemHandle(ptr)
        self.peer_base = []
        self.peer_table = None

    def close(self):
        """After every peer has unmapped it: frees the base (an arena: hands its range back to the
        parent) once no array from this heap is alive."""
        if self.closed:
            return
        if self.peer_base:
            self.unmap_peers()
        self.closed = True
        if self.live == 0:
            self._release_base()

    def _release_base(self):
        if self._parent_range is not None:
            self._parent_range = None  # its finalizer returns the range to the parent
            self.base = 0
        elif self.base:
            import cupy
            if self._regions is not None:
                self._regions[self.local_rank].close()
            else:
                cupy.cuda.runtime.free(self.base)
            self.base = 0


def take_symmetric(free_lists, nbytes: int, total: int, align: int = ALIGN):
    """(offset, size): the first ``align``-rounded range of ``nbytes`` free in every one of
    ``free_lists`` (sorted disjoint (offset, size) lists). Deterministic, so every rank computes the
    same answer."""
    size = _round_up(max(nbytes, 1), align)
    common = free_lists[0]
    for other in free_lists[1:]:
        common = _intersect(common, other)
    for off, avail in common:
        if avail >= size:
            return off, size
    raise WorkspaceError(f"symmetric workspace exhausted: {nbytes} bytes wanted, {total} in all, and no range that "
                         f"large is free on every rank")


def _intersect(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][0] + a[i][1], b[j][0] + b[j][1])
        if lo < hi:
            out.append((lo, hi - lo))
        if a[i][0] + a[i][1] < b[j][0] + b[j][1]:
            i += 1
        else:
            j += 1
    return out


class FreeList:
    """The free ranges of one rank's workspace; take_symmetric picks the offsets."""

    def __init__(self, start: int, size: int):
        self.total = size
        self.free = [(start, size)]  # (offset, size), sorted, never adjacent

    def take_at(self, offset: int, size: int):
        """Takes [offset, offset + size), which must lie inside one free range."""
        for i, (off, avail) in enumerate(self.free):
            if off <= offset and offset + size <= off + avail:
                self.free[i:i + 1] = [r for r in ((off, offset - off), (offset + size, off + avail - offset - size))
                                      if r[1] > 0]
                return
        raise MKernelError(f"workspace range [{offset}, {offset + size}) is not free on this rank (symmetric "
                           f"allocation out of step)")

    def give(self, offset: int, size: int):
        merged = []
        for off, sz in sorted(self.free + [(offset, size)]):
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + sz)
            else:
                merged.append((off, sz))
        self.free = merged


def carve_bytes(nbytes: int) -> int:
    """The range a sub-communicator of ``nbytes`` of workspace takes (room for its control words)."""
    return _round_up(max(nbytes, 2 * CONTROL_BYTES), ALIGN)


def _round_up(n, a):
    return (n + a - 1) // a * a


def check_owner(heap: SymmetricHeap, arr) -> int:
    """The offset of ``arr`` in ``heap``, or raise if it is not (any longer) symmetric memory."""
    ptr = arr.data.ptr
    if heap.closed:
        raise ClosedError("this array came from comm.empty() of a communicator that is closed")
    if not (heap.base + CONTROL_BYTES <= ptr < heap.base + heap.nbytes):
        raise ArgumentError("the array is not in this communicator's symmetric workspace (use comm.empty)")
    return ptr - heap.base


def _shareable(node_mpi, nbytes: int, device_id: int):
    """(nbytes rounded up to the allocation granularity, every node rank's vmm.Region) of a new
    workspace of cuMem allocations shared as file descriptors, each region reserving address space
    up to MKERNEL_WORKSPACE_MAX_BYTES to grow into; None where a rank of the node cannot make one
    (the node then falls back to CUDA IPC together). Collective over the node."""
    import uuid

    regions, why = [], ""
    try:
        g = vmm.granularity(device_id)
        nbytes = _round_up(nbytes, g)
        reserve = _round_up(max(nbytes, max_workspace_bytes()), g)
        regions = [vmm.Region(reserve, device_id) for _ in range(node_mpi.size)]
    except (MKernelError, OSError, AttributeError) as e:
        why = str(e)
    oks = node_mpi.allgather(not why)
    if not all(oks):
        for r in regions:
            r.close()
        get_logger("symmetric").info("workspace through legacy CUDA IPC (cuMem sharing unavailable on node ranks "
                                     "%s: %s)", [r for r, ok in enumerate(oks) if not ok], why or "a peer's")
        return None
    token = node_mpi.bcast(uuid.uuid4().hex if node_mpi.rank == 0 else None)
    vmm.add_node_chunk(node_mpi, regions, nbytes, device_id, token)
    return nbytes, regions


def max_workspace_bytes() -> int:
    """MKERNEL_WORKSPACE_MAX_BYTES, or the device's memory when it is 0: what a workspace may grow to."""
    import cupy

    cap = int(env.get("MKERNEL_WORKSPACE_MAX_BYTES"))
    return cap if cap > 0 else cupy.cuda.Device().mem_info[1]


def default_workspace_bytes(device_bytes: int, ranks_on_gpu: int) -> int:
    """MKERNEL_WORKSPACE_BYTES=auto: 1/64 of the GPU's memory shared among the ranks on it, between
    64 MiB and 1 GiB, a multiple of 2 MiB (it grows in place when an op needs more)."""
    share = device_bytes // 64 // max(1, ranks_on_gpu)
    return min(max(share, 64 << 20), 1 << 30) // (2 << 20) * (2 << 20)


def grown_size(current: int, wanted: int, granularity: int, cap: int):
    """The workspace size after growing for an allocation of ``wanted`` bytes that found no room:
    at least double (few growths over a run), at least room for it past the current end, a multiple
    of ``granularity``, at most ``cap``; None when even the minimum exceeds ``cap``."""
    need = _round_up(current + _round_up(wanted, ALIGN), granularity)
    if need > cap:
        return None
    return max(need, min(_round_up(2 * current, granularity), cap // granularity * granularity))
