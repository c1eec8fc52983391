"""Symmetric GPU memory: one workspace per communicator, the same size on every rank, mapped into
every peer of the node through CUDA IPC, with a device-side table of the peers' base pointers.

Offsets are symmetric: the ranks of a communicator allocate from their workspaces in the same order
with the same sizes (every allocation is checked across ranks), so an offset names the same buffer
on every rank and ``peer_base[p] + offset`` is rank p's copy of it.
"""

import threading
import weakref

from .errors import ArgumentError, ClosedError, MKernelError

ALIGN = 1024  # TMA with 128-byte swizzle wants 1024-byte aligned shared tiles; keep global buffers so too
CONTROL_BYTES = 1 << 20  # at offset 0: the runtime's flags; words [0, MAX_LOCAL) are credits (peers.cuh)
MAX_LOCAL = 64  # MK_MAX_LOCAL: ranks per node the control area has room for


class _Range:
    """Owner of one allocation; frees it when the last array viewing it is gone."""

    def __init__(self, heap, offset, nbytes):
        self.heap, self.offset, self.nbytes = heap, offset, nbytes
        weakref.finalize(self, heap._free, offset, nbytes)


class SymmetricHeap:
    def __init__(self, node_mpi, nbytes: int, device_id: int):
        import cupy

        rt = cupy.cuda.runtime
        self.device_id = device_id
        self.nbytes = _round_up(max(nbytes, 2 * CONTROL_BYTES), ALIGN)
        self.local_rank, self.local_size = node_mpi.rank, node_mpi.size
        if self.local_size > MAX_LOCAL:
            raise ArgumentError(f"{self.local_size} ranks in one node; mkernel supports at most {MAX_LOCAL}")
        self.base = rt.malloc(self.nbytes)  # a whole allocation of its own: IPC exports allocation bases
        rt.memset(self.base, 0, self.nbytes)
        rt.deviceSynchronize()
        handles = node_mpi.allgather(rt.ipcGetMemHandle(self.base)) if self.local_size > 1 else [None]
        self.peer_base = [self.base if p == self.local_rank else rt.ipcOpenMemHandle(h)
                          for p, h in enumerate(handles)]
        self.peer_table = cupy.array(self.peer_base, dtype=cupy.uint64)
        self._lock = threading.Lock()
        self._ranges = FreeList(CONTROL_BYTES, self.nbytes - CONTROL_BYTES)
        self.live = 0
        self.closed = False

    def alloc(self, nbytes: int) -> _Range:
        if self.closed:
            raise ClosedError("the communicator's workspace was closed")
        with self._lock:
            offset, size = self._ranges.take(nbytes)
            self.live += 1
        return _Range(self, offset, size)

    def _free(self, offset, size):
        with self._lock:
            self._ranges.give(offset, size)
            self.live -= 1
            if self.closed and self.live == 0:
                self._release_base()

    def array(self, rng: _Range, shape, dtype):
        import cupy

        mem = cupy.cuda.UnownedMemory(self.base + rng.offset, rng.nbytes, rng, self.device_id)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))

    def unmap_peers(self):
        """Closes this rank's mappings of the peers' workspaces (before the node-wide barrier)."""
        import cupy

        rt = cupy.cuda.runtime
        for p, ptr in enumerate(self.peer_base):
            if p != self.local_rank:
                rt.ipcCloseMemHandle(ptr)
        self.peer_base = []
        self.peer_table = None

    def close(self):
        """After every peer has unmapped it: frees the base once no array from this heap is alive."""
        if self.closed:
            return
        if self.peer_base:
            self.unmap_peers()
        self.closed = True
        if self.live == 0:
            self._release_base()

    def _release_base(self):
        if self.base:
            import cupy
            cupy.cuda.runtime.free(self.base)
            self.base = 0


class FreeList:
    """First-fit ranges of one workspace. Deterministic: the same calls give the same offsets on
    every rank, which is what makes offsets symmetric."""

    def __init__(self, start: int, size: int):
        self.total = size
        self.free = [(start, size)]  # (offset, size), sorted, never adjacent

    def take(self, nbytes: int):
        size = _round_up(max(nbytes, 1), ALIGN)
        for i, (off, avail) in enumerate(self.free):
            if avail >= size:
                self.free[i:i + 1] = [(off + size, avail - size)] if avail > size else []
                return off, size
        raise MKernelError(f"symmetric workspace exhausted: {nbytes} bytes wanted, {self.total} in all; "
                           f"pass a larger workspace_bytes to mkernel.init (or MKERNEL_WORKSPACE_BYTES)")

    def give(self, offset: int, size: int):
        merged = []
        for off, sz in sorted(self.free + [(offset, size)]):
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + sz)
            else:
                merged.append((off, sz))
        self.free = merged


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
