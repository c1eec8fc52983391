"""The communicator: MPI bootstrap, topology, symmetric workspace, epochs and errors, NCCL.

Rules every rank follows (ops on a communicator are collective):

- All ranks of a communicator issue the same ops, with agreeing shapes, in the same order, and the
  ops of one communicator are ordered (one stream, or streams the caller orders). The epochs that
  keep flags from going stale advance once per launch on every rank, so this order is the protocol.
- Every decision that changes what crosses the wire (fused or fallback, SM split, chunk size) is a
  function of the shapes, agreed by one collective the first time its key is seen (:meth:`agree`),
  never of per-rank timing. Later calls with the same key cost no communication.
- One thread uses a communicator at a time.
- One workspace pool and one proxy per process serve every communicator split from the one
  ``init`` made (the root): a sub-communicator's workspace is a range of its parent's, its proxy
  traffic goes through the root's proxy (its ranks, offsets and flag ids translated on the way),
  and closing the root closes its sub-communicators first.
- After a :class:`mkernel.TimeoutError` or :class:`mkernel.PeerError` the communicator is unusable:
  close it (and, usually, the job).
"""

import atexit
import hashlib
import weakref
from typing import NamedTuple

from mkernel.comm import collectives, topology
from mkernel.comm.plans import PlanRegistry
from mkernel.comm.proxy import USER_TRANSPORTS, CommandQueue, Proxy
from mkernel.comm.scratch import Scratch
from mkernel.comm.symmetric import (
    FreeList,
    Lease,
    SymmetricHeap,
    carve_bytes,
    check_owner,
    default_workspace_bytes,
    grown_size,
    max_workspace_bytes,
    take_symmetric,
)
from mkernel.core import env
from mkernel.core.errors import ArgumentError, ClosedError, MKernelError, PeerError, WorkspaceError, peer_failures
from mkernel.core.log import get_logger, set_rank
from mkernel.runtime import gpu
from mkernel.runtime.sync import SyncState
from mkernel.runtime.trace import Trace

log = get_logger("comm")

_roots = []  # weak references to the communicators init() made, in creation order
_atexit_registered = False
_finalize_unsafe = False  # a peer did not answer after a failure: MPI_Finalize would wait for it


def init(mpi_comm=None, gpus_per_node=None, transport="auto", workspace_bytes=None) -> "Communicator":
    """Create a communicator over ``mpi_comm`` (default ``MPI.COMM_WORLD``). Collective.

    ``gpus_per_node`` cuts each host into nodes of that many ranks (emulating several nodes on one
    host); ``transport`` picks the inter-node transport; ``workspace_bytes`` sizes the symmetric
    workspace (default ``MKERNEL_WORKSPACE_BYTES``)."""
    from mpi4py import MPI

    return Communicator(mpi_comm if mpi_comm is not None else MPI.COMM_WORLD, gpus_per_node=gpus_per_node,
                        transport=transport, workspace_bytes=workspace_bytes)


def _check_transport(transport):
    transport = env.get("MKERNEL_TRANSPORT") if transport is None else transport
    if transport not in USER_TRANSPORTS:
        raise ArgumentError(f"transport must be one of {USER_TRANSPORTS}, got {transport!r}")
    return transport


class ProxyService(NamedTuple):
    """The root's proxy and what it was started with (``Communicator.proxy``)."""
    proxy: object  # mkernel.comm.proxy.Proxy
    queue: object  # its CommandQueue, which the kernels enqueue into
    flags_ptr: int  # the proxy flags: mapped host memory (the same pointer on the device)
    flags: object  # ... as a NumPy uint32 view
    relay: object  # CuPy uint32 [2 * flags]: what the kernels' waiters read of each flag (queue.cuh)


class Communicator:
    """A group of ranks, one GPU each (several ranks may share one GPU).

    Attributes: ``rank``, ``size``, ``node``, ``num_nodes``, ``local_rank`` and ``local_size``
    (inside the node), ``device_id``, ``gpus_shared`` (some ranks share a GPU), ``topology``,
    ``mpi`` (the mpi4py communicator)."""

    # Regions of the root's proxy: the root's symmetric workspace (an offset names the same buffer
    # on every rank, so commands carry offsets; a sub-communicator's are shifted into it), and the
    # u32 flags peers' commands set: PROXY_FLAGS of them per communicator, PROXY_FLAG_RANGES ranges.
    PROXY_WORKSPACE_REGION, PROXY_FLAGS_REGION = 0, 1  # MK_WORKSPACE_REGION (queue_layout.cuh)
    PROXY_FLAGS = 4096
    PROXY_FLAG_RANGES = 16
    PROXY_QUEUE_CAPACITY = 1 << 14
    SPLIT_WORKSPACE_FRACTION = 4  # split()'s default workspace: this fraction of its parent's
    PEER_CHECK_S = 5.0  # close() after a failure: how long peers have to answer

    def __init__(self, mpi_comm, *, gpus_per_node=None, transport="auto", workspace_bytes=None,
                 _parent=None, _range=None):
        self.transport = _check_transport(transport)
        if workspace_bytes is None and env.get("MKERNEL_WORKSPACE_BYTES") != "auto":
            workspace_bytes = env.get_int("MKERNEL_WORKSPACE_BYTES")
        if workspace_bytes is not None and (not isinstance(workspace_bytes, int) or workspace_bytes <= 0):
            raise ArgumentError(f"workspace_bytes must be a positive integer, got {workspace_bytes!r}")
        self.mpi = mpi_comm.Dup()
        self._parent = _parent
        self._range = _range  # a sub-communicator's range of its parent's workspace (split carved it)
        self._root = self if _parent is None else _parent._root
        self._children = []  # weak references, in creation order (the order close() closes them in)
        node_of = None if _parent is None else self.mpi.allgather(_parent.node)
        self.topology = topology.discover(self.mpi, gpus_per_node, node_of)
        t = self.topology
        self.rank, self.size, self.node, self.num_nodes = t.rank, t.size, t.node, t.num_nodes
        self.local_rank, self.local_size = t.node_rank, t.node_size
        self.node_mpi = self.mpi.Split(t.node, t.node_rank)
        if mpi_comm is _world():
            set_rank(self.rank)
        self._agreed = {}
        self.plans = PlanRegistry()  # the ops' plans and state (mkernel/comm/plans.py)
        self.scratch = Scratch(self)  # the plans' transient buffers (mkernel/comm/scratch.py)
        self._closed = False
        self._nccl = None
        self._proxy = None  # root only: the ProxyService, started by .proxy
        self._gpus_per_node = gpus_per_node
        self._workspace_bytes = workspace_bytes
        global _atexit_registered
        if not _atexit_registered:  # registered after mpi4py's finalizer, so it runs before MPI_Finalize
            atexit.register(_close_all)
            _atexit_registered = True
        self._init_gpu()
        if _parent is None:
            _roots[:] = [r for r in _roots if r() is not None] + [weakref.ref(self)]

    # --- GPU state -------------------------------------------------------------------------------
    def _init_gpu(self):
        gpu.require_hopper()
        # A sub-communicator stays on its root's GPU: its workspace lies in the root's.
        self.device_id = (self.topology.host_rank % gpu.device_count() if self._parent is None
                          else self._parent.device_id)
        gpu.require_hopper(self.device_id)
        import cupy

        self.device = cupy.cuda.Device(self.device_id)
        self.device.use()
        devices = collectives.allgather_object(self.mpi, (self.topology.host, self.device_id), "comparing GPUs")
        self.gpus_shared = len(set(devices)) != len(devices)  # some ranks share a GPU (NCCL cannot run)
        if self._workspace_bytes is None:  # auto: the smallest rank's share of its GPU
            mine = default_workspace_bytes(self.device.mem_info[1], devices.count(devices[self.mpi.rank]))
            self._workspace_bytes = min(collectives.allgather_object(self.mpi, mine, "sizing the workspace"))
        # Agree on the size first: a workspace of different sizes would break symmetric offsets.
        self.agree(("workspace", "bytes"), self._workspace_bytes)
        if self._parent is None:
            self.heap = SymmetricHeap.allocate(self.node_mpi, self._workspace_bytes, self.device_id)
            self._flag_ranges_free = set(range(self.PROXY_FLAG_RANGES))  # of the root's flag array
        else:
            rng, self._range = self._range, None  # the heap holds it: closing the heap returns it
            self.heap = SymmetricHeap.carve(self._parent.heap, rng, self.node_mpi)
        self._flag_range = self._take_flag_range()
        import numpy
        self._root_ranks = numpy.array(self.mpi.allgather(self._root.rank), dtype=numpy.uint16)
        self._root_ranks_dev = None if self._parent is None else cupy.asarray(self._root_ranks)
        self.sync = SyncState(self.rank)
        self.sync.between_nodes = self.num_nodes > 1
        self._failures_at_start = peer_failures()
        self.trace = Trace(self.rank)
        log.debug("rank %d: node %d/%d, local rank %d/%d, GPU %d, workspace %d bytes", self.rank, self.node,
                  self.num_nodes, self.local_rank, self.local_size, self.device_id, self.heap.nbytes)

    def sync_args(self, op: str, timeout_s: float = None):
        """The MkSync struct of a launch of ``op`` on this communicator (raises a pending error first)."""
        self._check_open()
        self.sync.check()
        s = self.sync.args(op, timeout_s)
        s.trace_events, s.trace_count, s.trace_capacity = self.trace.pointers()
        return s

    @property
    def peer_table(self):
        """Device array (uint64, [local_size]) of every node peer's workspace base; own at local_rank."""
        self._check_open()
        return self.heap.peer_table

    # --- user-facing -----------------------------------------------------------------------------
    def empty(self, shape, dtype):
        """A CuPy array in symmetric memory: rank p's copy lies at the same offset of p's workspace.
        Its contents are undefined, as numpy.empty's (freed ranges are reused without zeroing).

        Collective over the communicator: every rank allocates the same shapes in the same order."""
        import numpy

        self._check_open()
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        dtype = numpy.dtype(dtype)
        nbytes = int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
        return self.heap.array(self._symmetric_range(nbytes, "allocating symmetric memory", (shape, dtype.str)),
                               shape, dtype)

    def _symmetric_range(self, nbytes: int, what: str, agree=None):
        """A range of the workspace at the same offset on every rank (a Lease); when none is free, the
        ops' cached plans are released, then the workspace grows in place. Collective."""
        heap = self.heap
        try:
            return heap.alloc_symmetric(self.mpi, nbytes, what, agree=agree)
        except WorkspaceError as e:  # every rank fails alike (the same free ranges were intersected)
            exhausted = e
        if len(self.plans) or self.scratch.nbytes:  # the shapes in use build their plans again
            log.info("rank %d: releasing %d cached plans and the scratch for %s (%d bytes)", self.rank,
                     len(self.plans), what, nbytes)
            self.release_plans()
            try:
                return heap.alloc_symmetric(self.mpi, nbytes, what, agree=agree)
            except WorkspaceError as e:
                exhausted = e
        self._grow_for(nbytes, exhausted)
        return heap.alloc_symmetric(self.mpi, nbytes, what, agree=agree)

    def release_plans(self):
        """Drops the ops' cached plans and the scratch (their symmetric memory is freed; each
        shape's next call builds its plan again). Collective in effect: every rank at the same point
        of its op sequence. Synchronises the device."""
        self._check_open()
        self.plans.clear()
        self.scratch.release()

    def agreed(self, key) -> bool:
        """Whether ``key`` was agreed on (:meth:`agree`) already: its next agreement costs nothing."""
        return key in self._agreed

    def _grow_for(self, nbytes: int, exhausted: Exception):
        """Grows the workspace in place so that ``nbytes`` fit, or raises WorkspaceError saying why it
        cannot. Collective: every rank of the communicator grows to the same size."""
        import uuid

        blockers, want = [], None
        if self._root is not self:
            blockers.append("a sub-communicator's workspace is a fixed range of its root's (pass a larger "
                            "workspace_bytes to split())")
        elif not self.heap.growable:
            blockers.append("the workspace is mapped through legacy CUDA IPC, which cannot grow "
                            "(MKERNEL_WORKSPACE_SHARING)")
        else:
            cap = max_workspace_bytes()
            want = grown_size(self.heap.nbytes, nbytes, self.heap.granularity(), cap)
            if want is None:
                blockers.append(f"growing past MKERNEL_WORKSPACE_MAX_BYTES ({cap}) would be needed")
            elif want - self.heap.nbytes > self.heap.device_free():
                blockers.append(self._out_of_memory(want - self.heap.nbytes))
        views = collectives.allgather_object(self.mpi, (blockers, want), "growing the workspace")
        reasons = [f"rank {r}: {'; '.join(b)}" for r, (b, _) in enumerate(views) if b]
        if reasons:
            raise WorkspaceError(f"{exhausted}, and it cannot grow: {reasons[0]}"
                                 + (f" (and {len(reasons) - 1} more ranks)" if len(reasons) > 1 else ""))
        want = max(w for _, w in views)
        token = self.node_mpi.bcast(uuid.uuid4().hex if self.node_mpi.rank == 0 else None)
        old = self.heap.nbytes
        failed = None
        try:  # a node whose allocation failed (the memory went meanwhile) fails on all of its ranks
            self.heap.grow(self.node_mpi, want, token)
        except WorkspaceError as e:
            failed = str(e)
        views = collectives.allgather_object(self.mpi, failed, "growing the workspace")
        failures = [(r, f) for r, f in enumerate(views) if f]
        if failures:
            raise WorkspaceError(f"{exhausted}, and growing it failed on rank {failures[0][0]}: {failures[0][1]}")
        if self._proxy is not None:  # every rank grows here, before any allocation can use the new range
            try:
                self._proxy.proxy.grow_region(self.PROXY_WORKSPACE_REGION, self.heap.nbytes)
            except (ArgumentError, PeerError) as e:
                raise WorkspaceError(f"{exhausted}; the workspace grew to {self.heap.nbytes} bytes, but the "
                                     f"{self._proxy.proxy.transport} transport could not take the grown range: {e} "
                                     f"(pass a larger workspace_bytes to mkernel.init)") from e
        log.info("rank %d: workspace grown in place from %d to %d bytes for an allocation of %d", self.rank, old,
                 want, nbytes)

    def _out_of_memory(self, more: int) -> str:
        """Why a growth by ``more`` bytes cannot fit on this GPU, and what holds its memory."""
        import cupy

        pool = cupy.get_default_memory_pool().total_bytes()
        return (f"growing the workspace needs {more} more bytes on GPU {self.device_id}, which has "
                f"{self.heap.device_free()} free; this rank holds a workspace of {self.heap.nbytes} bytes "
                f"({self.heap.in_use} in use by arrays and the ops' buffers, {self.scratch.nbytes} of them the "
                f"ops' scratch, {len(self.plans)} cached plans; comm.release_plans() frees them) and CuPy's "
                f"pool {pool}; other processes on the GPU hold the rest")

    def offset_of(self, arr) -> int:
        """The symmetric offset of an array from :meth:`empty` (raises if it is not one, or is closed)."""
        return check_owner(self.heap, arr)

    def split(self, color: int, key: int = 0, workspace_bytes: int = None) -> "Communicator":
        """Sub-communicators, as ``MPI_Comm_split`` (``color=None``: this rank joins none and gets
        None); they keep this communicator's node boundaries and GPU. Collective. Each has its own
        epochs and a workspace of ``workspace_bytes`` (default: 1/SPLIT_WORKSPACE_FRACTION of this
        one's) carved from this communicator's workspace; traffic between nodes goes through the
        root's proxy, which a split of a communicator spanning several nodes starts if needed."""
        self._check_open()
        from mpi4py import MPI

        if workspace_bytes is None:
            workspace_bytes = self.heap.nbytes // self.SPLIT_WORKSPACE_FRACTION
        if self._root.num_nodes > 1:
            if self._root is self:
                self.proxy  # noqa: B018  (collective over the root, which only the root can start)
            elif self._root._proxy is None:
                raise MKernelError("internal: a sub-communicator of a multi-node root exists without the root's "
                                   "proxy")
        # Carved over all of this communicator's ranks (disjoint children share the offset), so that
        # releasing plans or growing, collective here, can make room.

        ok = isinstance(workspace_bytes, int) and not isinstance(workspace_bytes, bool) and workspace_bytes > 0
        views = collectives.allgather_object(self.mpi, carve_bytes(workspace_bytes) if ok else None,
                                             "splitting the communicator")
        if None in views:
            raise ArgumentError(f"split: workspace_bytes must be a positive integer on every rank; rank "
                                f"{views.index(None)} passed an invalid one (here: {workspace_bytes!r})")
        rng = self._symmetric_range(max(views), "carving a sub-communicator's workspace")
        sub = self.mpi.Split(MPI.UNDEFINED if color is None else color, key)
        if sub == MPI.COMM_NULL:
            return None  # (rng freed)
        try:
            child = Communicator(sub, transport=self.transport, workspace_bytes=workspace_bytes, _parent=self,
                                 _range=rng)
        finally:
            sub.Free()
        self._children.append(weakref.ref(child))
        return child

    def agree(self, key, value, cache: bool = True):
        """Check that every rank passes the same ``value`` for ``key``; collective the first time a key
        is seen, free afterwards. Raises ArgumentError on every rank when they disagree."""
        if cache and key in self._agreed:
            if self._agreed[key] != value:
                raise ArgumentError(f"{key}: value changed from {self._agreed[key]!r} to {value!r}; ranks "
                                    f"agreed on it once and must keep it")
            return value
        digest = hashlib.sha256(repr((key, value)).encode()).digest()
        digests = self._allgather_bytes(digest, what=f"agreeing on {key!r}")
        if len(set(digests)) != 1:
            values = self.mpi.allgather(repr((key, value)))
            raise ArgumentError(f"ranks disagree on {key!r}: " + ", ".join(f"rank {r}: {v}" for r, v in
                                                                            enumerate(values)))
        if cache:
            self._agreed[key] = value
        return value

    def _allgather_bytes(self, data: bytes, what: str):
        return collectives.allgather_bytes(self.mpi, data, what)

    @property
    def nccl(self):
        """An NCCL communicator over the same ranks, for fallbacks and benchmarks (created on first
        use; collective). NCCL needs one GPU per rank."""
        self._check_open()
        if self._nccl is None:
            from cupy.cuda import nccl

            if self.gpus_shared:
                raise ArgumentError("NCCL needs one GPU per rank, and ranks of this communicator share a GPU")
            uid = self.mpi.bcast(nccl.get_unique_id() if self.rank == 0 else None)
            with self.device:
                self._nccl = nccl.NcclCommunicator(self.size, uid, self.rank)
        return self._nccl

    @property
    def proxy(self):
        """The host proxy (mkernel.proxy.Proxy) that carries this communicator's traffic between nodes:
        started on first use (collective), stopped by close(). Region PROXY_WORKSPACE_REGION is the
        symmetric workspace (offsets into it), PROXY_FLAGS_REGION the PROXY_FLAGS u32 flags in
        mapped host memory (``proxy_flags``: (device pointer, NumPy view)); kernels enqueue through
        ``proxy_queue_args()``. On one node it has no peer and moves nothing. A sub-communicator's is
        its root's (started by the split that made it)."""
        self._check_open()
        if self._root is not self:
            if self._root._proxy is None:
                raise MKernelError("this communicator's root spans one node: there is no proxy (no traffic "
                                   "between nodes)")
            return self._root._proxy.proxy
        if self._proxy is None:
            import ctypes

            import cupy
            import numpy as np

            node_ids = self.mpi.allgather(self.node)
            nbytes = 4 * self.PROXY_FLAGS * self.PROXY_FLAG_RANGES
            ptr = cupy.cuda.runtime.hostAlloc(nbytes, 2)  # mapped: valid on the device as it is (UVA)
            flags = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr)).view(np.uint32)
            flags[:] = 0
            queue = CommandQueue(self.PROXY_QUEUE_CAPACITY, gpu=True)
            proxy = None
            try:
                proxy = Proxy(self.mpi, node_ids, transport=self.transport, cuda_device=self.device_id)
                proxy.register(self.PROXY_WORKSPACE_REGION, self.heap.base, self.heap.nbytes, "cuda")
                proxy.register_flags(self.PROXY_FLAGS_REGION, ptr, self.PROXY_FLAGS * self.PROXY_FLAG_RANGES)
                proxy.attach_queue(queue)
                proxy.connect()
                proxy.start()
            except BaseException:
                if proxy is not None:
                    proxy.close()
                queue.close()
                cupy.cuda.runtime.freeHost(ptr)
                raise
            self._proxy = ProxyService(proxy, queue, ptr, flags, cupy.zeros(2 * flags.size, dtype=cupy.uint32))
            log.debug("rank %d: proxy started (%s transport, %d peers on other nodes)", self.rank,
                      proxy.transport, len(proxy.peers))
        return self._proxy.proxy

    def proxy_queue_args(self, flag_base: int = 0):
        """The MkQueue a kernel of this communicator enqueues through (mkernel.proxy.QueueArgs): the
        root's queue, with this communicator's ranks, workspace and flag range translated; flag ids
        in commands are relative to ``flag_base`` (a :meth:`proxy_flag_block`'s base)."""
        self.proxy  # noqa: B018  (starts the root's)
        svc = self._root._proxy
        return svc.queue.device_args(self._root_ranks_dev, self.heap.base - self._root.heap.base,
                                     self._flag_range * self.PROXY_FLAGS + flag_base, svc.flags_ptr, svc.relay)

    @property
    def proxy_flags(self):
        """(device pointer, NumPy uint32 view) of this communicator's PROXY_FLAGS flags of the root's
        proxy flag array: commands of this communicator name them 0..PROXY_FLAGS-1."""
        self.proxy  # noqa: B018
        ptr, flags = self._root._proxy.flags_ptr, self._root._proxy.flags
        base = self._flag_range * self.PROXY_FLAGS
        return ptr + 4 * base, flags[base:base + self.PROXY_FLAGS]

    def proxy_flag_block(self, count: int):
        """``count`` of this communicator's proxy flags for one op plan, zeroed: a
        :class:`symmetric.Lease` whose ``offset`` is the first one's id (the plan's commands name its
        flags relative to it: ``proxy_queue_args(flag_base=offset)``, ``proxy_flags[0] + 4 * offset``);
        they go back when it is dropped. Collective (the same ids on every rank)."""
        import cupy

        if not hasattr(self, "_pflag_free"):
            self._pflag_free = FreeList(0, self.PROXY_FLAGS)
        views = collectives.allgather_object(self.mpi, list(self._pflag_free.free), "allocating proxy flags")
        base, size = take_symmetric(views, count, self.PROXY_FLAGS, align=1)
        self._pflag_free.take_at(base, size)
        self.proxy_flags[1][base:base + size] = 0
        first = 2 * (self._flag_range * self.PROXY_FLAGS + base)
        relay = self._root._proxy.relay[first:first + 2 * size]  # the waiters' copies too, before any launch
        relay.data.memset_async(0, relay.nbytes)  # a memset, not a kernel: no module load (calls.quiesced_first_use)
        cupy.cuda.runtime.deviceSynchronize()
        # Peers SIGNAL these flags from their kernels' entry, without waiting for this rank (a
        # credit), so no rank may launch before every rank has zeroed them: a SIGNAL landing before
        # the zeroing would be wiped out, and its waiter would time out.
        collectives.barrier(self.mpi, what="zeroing proxy flags")
        return Lease(self._pflag_free.give, base, size)

    def _take_flag_range(self):
        """This communicator's range of the root's proxy flags: the lowest free on all its ranks."""
        free = self._root._flag_ranges_free
        views = collectives.allgather_object(self.mpi, sorted(free), "choosing a proxy flag range")
        common = sorted(set.intersection(*(set(v) for v in views)))
        if not common:
            raise MKernelError(f"more than {self.PROXY_FLAG_RANGES} communicators in this process use the root's "
                               f"proxy flags; close some")
        free.discard(common[0])
        return common[0]

    def stats(self) -> dict:
        """What this communicator holds and moved: ``workspace`` (its symmetric workspace's
        ``bytes``, ``in_use`` by live arrays and the ops' buffers, ``high_water``), ``scratch`` (the
        scratch area's ``bytes``, ``largest_need`` of one call, ``high_water``, times ``grown``), ``plans``
        (cached, ``evicted`` so far) and the traffic between nodes: the proxy's commands, bytes
        sent and received per peer rank (``"proxy": None`` while no proxy was started). Does not
        synchronise."""
        self._check_open()
        heap = self.heap
        out = {"workspace": {"bytes": heap.nbytes, "in_use": heap.in_use, "high_water": heap.high_water},
               "scratch": self.scratch.stats(),
               "plans": {"cached": len(self.plans), "evicted": self.plans.evicted}, "proxy": None}
        root = self._root
        if root._proxy is None:
            return out
        out.update(root._proxy.proxy.stats())
        out["proxy"] = root._proxy.proxy.transport
        out["peers"] = {r: out["peers"][int(q)] for r, q in enumerate(self._root_ranks)}  # this one's ranks
        return out

    def check(self):
        """Raise the first error any kernel of this communicator (or its proxy) recorded. Does not
        synchronise."""
        self._check_open()
        self.sync.check()
        if self._root._proxy is not None:
            self._root._proxy.proxy.check()

    def _check_open(self):
        if self._closed:
            raise ClosedError("this communicator is closed")

    def close(self):
        """Release everything. Idempotent; runs at interpreter exit before MPI finalizes."""
        if self._closed:
            return
        for ref in self._children:  # they use this one's workspace (and, for the root, its proxy)
            child = ref()
            if child is not None:
                child.close()
        self._closed = True
        failed = bool(getattr(self, "sync", None) and self.sync.host_status and self.sync.host_status.code)
        try:
            if hasattr(self, "heap"):
                import cupy
                cupy.cuda.runtime.deviceSynchronize()
                self.trace.write()
                if failed or peer_failures() > self._failures_at_start:
                    failed = not self._peers_alive()
                failed = self._stop_proxy(failed)
                failed = self._release_heap(failed)
                self.sync.close()
                if hasattr(self, "_flag_range"):
                    self._root._flag_ranges_free.add(self._flag_range)
            if self._nccl is not None:
                self._nccl.destroy()
                self._nccl = None
        finally:
            for c in (self.node_mpi, self.mpi):
                try:
                    c.Free()
                except Exception:  # MPI may already be finalizing
                    pass

    def _peers_alive(self) -> bool:
        """After a failure: one barrier that gives up after min(timeout, PEER_CHECK_S). Peers that
        answer are closing too (their kernels are done), so the usual release is safe; otherwise a
        peer is dead or stuck, and MPI_Finalize would wait for it forever: the process then leaves
        without it (:func:`_close_all`)."""
        try:
            collectives.barrier(self.mpi, min(env.get_float("MKERNEL_TIMEOUT_S"), self.PEER_CHECK_S),
                                "checking which peers are alive after a failure")
            return True
        except PeerError as e:
            log.error("rank %d: %s", self.rank, e)
            return not _peer_lost()

    def _stop_proxy(self, failed):
        """Stops and frees the proxy (root), after a timed barrier so that no peer still sends to
        this rank (skipped after a failure). Returns whether a peer failed."""
        if self._proxy is None:
            return failed
        import cupy

        svc = self._proxy
        proxy, queue, ptr = svc.proxy, svc.queue, svc.flags_ptr
        self._proxy = None
        if not failed:
            try:
                self._allgather_bytes(b"\0", "stopping the proxy")
            except PeerError:
                failed = _peer_lost()
        proxy.close()
        queue.close()
        cupy.cuda.runtime.freeHost(ptr)
        return failed

    def _release_heap(self, failed):
        """Unmaps the peers' workspaces, then (after a timed barrier: the peers must have unmapped
        ours) frees this one's. Returns whether a peer failed."""
        self.heap.unmap_peers()
        if not failed:
            try:
                self._allgather_bytes(b"\0", "releasing the workspace")
            except PeerError:
                failed = _peer_lost()
        if not failed:
            self.heap.close()
        return failed

    def grow_workspace(self, workspace_bytes: int):
        """Replaces the workspace by one of ``workspace_bytes`` (more than now). Collective: every rank
        passes the same size. Only on a root (``mkernel.init``'s) communicator without live
        sub-communicators or arrays from :meth:`empty`; the ops' cached buffers are released (they
        are allocated again on next use) and the proxy, if started, is stopped (it starts again on
        next use). Synchronises the device."""
        self._check_open()
        if not isinstance(workspace_bytes, int) or isinstance(workspace_bytes, bool) or workspace_bytes <= 0:
            raise ArgumentError(f"grow_workspace: workspace_bytes must be a positive integer, got {workspace_bytes!r}")
        self.agree(("grow_workspace", self.heap.nbytes), workspace_bytes, cache=False)
        if workspace_bytes <= self.heap.nbytes:
            raise ArgumentError(f"grow_workspace: {workspace_bytes} bytes is not more than the workspace's "
                                f"{self.heap.nbytes}")
        self.release_plans()  # (synchronises the device)
        blockers = []
        if self._root is not self:
            blockers.append("it is a sub-communicator (grow the root's workspace, then split again)")
        if any(ref() is not None and not ref()._closed for ref in self._children):
            blockers.append("sub-communicators of it are open (close them first)")
        if self.heap.live:
            blockers.append(f"{self.heap.live} arrays from comm.empty() are still alive (drop them first)")
        views = collectives.allgather_object(self.mpi, blockers, "growing the workspace")
        if any(views):
            raise ArgumentError("grow_workspace: " + "; ".join(f"rank {r}: {', '.join(b)}"
                                                                for r, b in enumerate(views) if b))
        if self._stop_proxy(False) or self._release_heap(False):  # (release_plans synchronised the device)
            raise PeerError(f"rank {self.rank}: a peer did not answer while the workspace was replaced")
        self._workspace_bytes = workspace_bytes
        self._agreed[("workspace", "bytes")] = workspace_bytes
        self.heap = SymmetricHeap.allocate(self.node_mpi, workspace_bytes, self.device_id)
        if hasattr(self, "_pflag_free"):
            del self._pflag_free  # the plans that held proxy flags were released; a new proxy starts at 0
        log.info("rank %d: workspace grown to %d bytes", self.rank, self.heap.nbytes)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._closed else f"GPU {getattr(self, 'device_id', '?')}"
        return (f"<mkernel.Communicator rank {self.rank}/{self.size}, node {self.node}/{self.num_nodes}, "
                f"local {self.local_rank}/{self.local_size}, {state}>")


def _world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def _peer_lost() -> bool:
    """A peer did not answer while closing: MPI_Finalize would wait for it (see _close_all)."""
    global _finalize_unsafe
    _finalize_unsafe = True
    return True


def _close_all():
    """At exit, in creation order on every rank (closing is collective): roots, each closing its
    sub-communicators first. If a peer died (it did not answer after a failure), MPI_Finalize,
    which mpi4py runs after this, would wait for it forever: the process leaves now, status 1."""
    for ref in list(_roots):
        c = ref()
        if c is None:
            continue
        try:
            c.close()
        except Exception as e:  # at exit, report instead of raising
            log.warning("closing %r at exit failed: %s", c, e)
    if _finalize_unsafe:
        import os
        import sys

        log.error("a peer did not answer after a failure: leaving without MPI_Finalize (it would wait for "
                  "the peer forever), exit status 1")
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001  (a closed stream at exit)
                pass
        os._exit(1)
