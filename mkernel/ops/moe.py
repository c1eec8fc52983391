"""Expert parallelism: ``moe_dispatch`` / ``moe_combine`` and the GEMM-carrying
``moe_dispatch_gemm`` / ``moe_gemm_combine`` (design: docs/MOE.md).

Experts are owned in contiguous blocks of ``num_experts / world``. Dispatch sends every (token,
expert) pair of this rank to the expert's owner; the owner receives one row per pair, grouped by
local expert, then by source rank, then in the source's pair order (``t * k + j``), in a buffer of
``capacity`` rows. Per-expert counts stay on the device (``handle.group_rows``, the grouped GEMM's
``group_rows``): nothing on this path synchronises with the host. Combine sends each row back to its
token's rank and sums a token's rows weighted by its routing weights in fp32, in pair order, with
one rounding: bitwise reproducible. Between nodes the order of an expert's rows is by origin (the
forwarding ranks' own tokens first, then the tokens they forward), then forwarding rank of the
owner's node, then pair order of its virtual tokens, and combine adds the nodes' fp32 sums in node
order: a fixed order too, not the one-node bits (docs/MOE.md "Between nodes").

Status (docs/MOE.md): dispatch and combine are one persistent kernel each (``mkernel/cuda/ops/moe.cu``);
the GEMM-carrying ops and their fused kernels are in :mod:`mkernel.ops.moe_gemm`. Between nodes
(node-major ranks) an exchange kernel before the dispatch and a partial-sum kernel after the combine
(:mod:`mkernel.ops.moe_nodes`) send each token once per destination node; inside a node the kernels
above run over the tokens a rank owns and forwards.
"""

import ctypes

from mkernel.comm import proxy as _proxy
from mkernel.comm.communicator import Communicator
from mkernel.core.errors import ArgumentError
from mkernel.ops import buffers as _buffers
from mkernel.ops import calls as _calls
from mkernel.ops import moe_nodes as _nodes
from mkernel.runtime import compile as _compile
from mkernel.runtime import launch
from mkernel.runtime.arrays import DT, as_cupy, check_matrix, row_stride
from mkernel.runtime.launch import launch_persistent, persistent_grid
from mkernel.runtime.sync import MkSync

MAX_WORLD = 8          # MOE_MAX_WORLD
MAX_EXPERTS = 512      # MOE_MAX_EXPERTS
MAX_TOPK = 8           # MOE_MAX_TOPK
MAX_ROWS = 1 << 24     # meta words hold t * k + j in 24 bits
THREADS = 512          # MOE_THREADS
# MOE_CNT_* in order (moe_args.cuh): the kernels' counter words, named for diagnostics
CNT_NAMES = ("hist", "sent", "done", "order", "plan", "tile", "ret", "gemm_done", "arrive", "claim_hist",
             "claim_order", "run", "returned", "fwd_claim")
CNT_WORDS = len(CNT_NAMES)  # MOE_CNT_WORDS
PAIRS_PER_CTA = 256    # dispatch: pairs each CTA routes (its grid: ceil(pairs / this), at most the SMs)
ROWS_PER_CTA = 64      # combine: rows each CTA returns
DISPATCH_SMEM = 16 * 2 * 4096  # the dispatch copiers' buffers (MoeShared<512>::STAGE_BYTES)

SPEC = _compile.register("moe", "moe.cu", ("mk_moe_dispatch_kernel", "mk_moe_combine_kernel<0>",
                                          "mk_moe_combine_kernel<1>"))


class MkMoeArgs(ctypes.Structure):
    """Mirror of ``MkMoeArgs`` (mkernel/cuda/ops/moe_args.cuh), 472 bytes."""
    _fields_ = [("sync", MkSync), ("peer_base", ctypes.c_void_p), ("counts_off", ctypes.c_uint64),
                ("cflag_off", ctypes.c_uint64), ("recv_off", ctypes.c_uint64), ("meta_off", ctypes.c_uint64),
                ("rflag_off", ctypes.c_uint64), ("ret_off", ctypes.c_uint64), ("retflag_off", ctypes.c_uint64),
                ("eflag_off", ctypes.c_uint64),
                ("x", ctypes.c_void_p), ("topk_ids", ctypes.c_void_p), ("topk_w", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("y", ctypes.c_void_p), ("send_order", ctypes.c_void_p),
                ("esent", ctypes.c_void_p), ("hist", ctypes.c_void_p), ("group_rows", ctypes.c_void_p),
                ("received", ctypes.c_void_p),
                ("counters", ctypes.c_void_p), ("ldx", ctypes.c_int64), ("ldo", ctypes.c_int64),
                ("ldy", ctypes.c_int64), ("T", ctypes.c_int32), ("H", ctypes.c_int32), ("k", ctypes.c_int32),
                ("E", ctypes.c_int32), ("e_local", ctypes.c_int32), ("world", ctypes.c_int32),
                ("me", ctypes.c_int32), ("capacity", ctypes.c_int32), ("vseg", ctypes.c_void_p),
                ("xfwd", ctypes.c_void_p), ("fwd_rows", ctypes.c_int64), ("nseg", ctypes.c_int32),
                ("partial_out", ctypes.c_int32), ("vown", ctypes.c_void_p), ("xepoch", ctypes.c_void_p),
                ("tile_order", ctypes.c_void_p), ("queue", _proxy.QueueArgs), ("pflags", ctypes.c_void_p),
                ("node", ctypes.c_int32), ("tile_m", ctypes.c_int32), ("part_off", ctypes.c_uint64),
                ("precv_off", ctypes.c_uint64), ("fwdret_off", ctypes.c_uint64), ("send_sums", ctypes.c_int32),
                ("sums_group", ctypes.c_int32), ("fwdgrp", ctypes.c_void_p), ("pieces", ctypes.c_int32)]


def moe_capacity(max_tokens: int, top_k: int, world: int) -> int:
    """Receive rows per rank that can never overflow: every pair of every rank on one rank
    (``world * max_tokens * top_k``). A smaller capacity saves memory; a dispatch that would exceed it
    raises :class:`mkernel.CapacityError` on every rank (nothing is dropped)."""
    for name, v in (("max_tokens", max_tokens), ("top_k", top_k), ("world", world)):
        if not isinstance(v, int) or v < (0 if name == "max_tokens" else 1):
            raise ArgumentError(f"moe_capacity: {name} must be a non-negative integer; got {v!r}")
    return max(1, world * max_tokens * top_k)


class MoeHandle:
    """What combine needs from its dispatch: where every received row came from (on the device),
    the routing weights, the per-expert counts. Valid until the next dispatch on the communicator
    (which reuses the buffers); ``group_rows`` (device int32 [E_local]) feeds ``grouped_gemm``."""

    def __init__(self, plan, generation, topk_weights, T, k, H, dtype, E, nodes=None):
        self._plan, self._generation, self._nodes = plan, generation, nodes
        self.topk_weights, self.T, self.k, self.H, self.dtype, self.E = topk_weights, T, k, H, dtype, E
        self.group_rows = plan["group_rows"]
        self.capacity = plan["capacity"]

    def valid(self) -> bool:
        return self._plan["generation"] == self._generation

    def counts(self):
        """Rows received per local expert (NumPy int array; synchronises with the device)."""
        import cupy

        self._check()
        cupy.cuda.runtime.deviceSynchronize()  # the dispatch may have run on another stream
        return self.group_rows.get()

    def received(self) -> int:
        """Rows received in all (synchronises with the device)."""
        import cupy

        self._check()
        cupy.cuda.runtime.deviceSynchronize()
        return int(self._plan["received"].get()[0])

    def _check(self):
        if not self.valid():
            raise ArgumentError("this MoE handle is stale: a later moe_dispatch of the same shape on the "
                                "communicator reused its buffers (combine each dispatch before the next one)")


def _check_comm(op, comm):
    if not isinstance(comm, Communicator):
        raise ArgumentError(f"{op} needs comm=, an mkernel.Communicator (mkernel.init()); got {type(comm).__name__}")
    _calls.check_node_major(op, comm)  # between nodes, node j owns the experts of its ranks
    if comm.size > MAX_WORLD:
        raise ArgumentError(f"{op}: at most {MAX_WORLD} ranks; this communicator has {comm.size}")


def _check_routing(op, x, topk_ids, topk_weights, num_experts, world, stream):
    import cupy

    x = check_matrix(as_cupy(x, "x", stream=stream), "x")
    T, H = x.shape
    ids = as_cupy(topk_ids, "topk_ids", stream=stream)
    w = as_cupy(topk_weights, "topk_weights", stream=stream)
    if ids.dtype != cupy.int32 or ids.ndim != 2 or ids.shape[0] != T or not ids.flags.c_contiguous:
        raise ArgumentError(f"{op}: topk_ids must be a contiguous int32 [T={T}, k] array; got {ids.dtype} "
                            f"{tuple(ids.shape)}")
    k = ids.shape[1]
    if not 1 <= k <= MAX_TOPK:
        raise ArgumentError(f"{op}: top-k must be 1..{MAX_TOPK}; got {k}")
    if w.dtype != cupy.float32 or tuple(w.shape) != (T, k) or not w.flags.c_contiguous:
        raise ArgumentError(f"{op}: topk_weights must be a contiguous float32 [T={T}, k={k}] array; got "
                            f"{w.dtype} {tuple(w.shape)}")
    if H % 8:
        raise ArgumentError(f"{op}: the hidden size H = {H} must be a multiple of 8 (rows of 16-byte vectors)")
    if not isinstance(num_experts, int) or not 1 <= num_experts <= MAX_EXPERTS or num_experts % world:
        raise ArgumentError(f"{op}: num_experts must be 1..{MAX_EXPERTS} and a multiple of the world size "
                            f"{world}; got {num_experts!r}")
    return x, ids, w, T, H, k


def row_words(E):
    """Words of a count row (MOE_ROW_WORDS): pairs per expert, T, ids out of range, own-origin pairs per expert."""
    return 2 * E + 2


def _plan(op, comm, H, dtype, k, E, capacity, stream):
    import cupy

    W, E = comm.local_size, E // comm.num_nodes  # the node's ranks and experts (between nodes: moe_nodes.py)
    key = ("buffers", "moe", H, dtype.name, k, E, capacity)
    _calls.agree_call(op, comm, key + ("moe",), f"capacity {capacity} rows")
    sizes = [("counts", (W * row_words(E),), cupy.uint32), ("cflag", (W,), cupy.uint32),
             ("rflag", (W,), cupy.uint32), ("retflag", (W,), cupy.uint32), ("eflag", (2 * E,), cupy.uint32),
             ("meta", (capacity,), cupy.uint32), ("recv", (capacity, H), dtype), ("ret", (capacity, H), dtype)]
    plan = _buffers.plan_buffers(op, comm, key, sizes, {"counters": CNT_WORDS})
    if "generation" not in plan:
        sms = launch.sm_count(full_share=True)  # hist's rows: the most CTAs a launch takes (launch.grid_sms)
        with _calls.on_stream(stream):  # zeroed on the stream the kernels run on, before them
            plan.update(generation=0, capacity=capacity, E=E, k=k, H=H,
                        send_order=cupy.empty(capacity, dtype=cupy.int32),
                        esent=cupy.zeros(2 * E, dtype=cupy.uint32), hist=cupy.empty(sms * E, dtype=cupy.uint32),
                        group_rows=cupy.zeros(E // W, dtype=cupy.int32), received=cupy.zeros(1, dtype=cupy.int32))
    return plan


def _args(comm, plan, op, T, k, E, H):
    """The node's kernels' arguments (E: the node's experts, plan["E"])."""
    a = MkMoeArgs()
    a.sync = comm.sync_args(op)
    a.peer_base = comm.peer_table.data.ptr
    for name in ("counts", "meta", "recv", "ret"):
        setattr(a, f"{name}_off", comm.offset_of(plan[name]))
    a.cflag_off, a.rflag_off, a.retflag_off, a.eflag_off = (comm.offset_of(plan[n])
                                                            for n in ("cflag", "rflag", "retflag", "eflag"))
    a.send_order, a.esent, a.hist = plan["send_order"].data.ptr, plan["esent"].data.ptr, plan["hist"].data.ptr
    a.group_rows, a.received = plan["group_rows"].data.ptr, plan["received"].data.ptr
    a.counters = plan["counters"].data.ptr
    a.T, a.H, a.k, a.E = T, H, k, E
    a.e_local, a.world, a.me, a.capacity = E // comm.local_size, comm.local_size, comm.local_rank, plan["capacity"]
    return a


def _launch(op, expr, args, ctas, stream, smem=0, full_share=False):
    fn = _compile.module(SPEC).function(expr)
    persistent_grid(fn, THREADS, smem, blocks=ctas, what=op, full_share=full_share)
    # roles by arrival, work claimed: any resident part of the grid finishes (docs/MOE.md "Residency")
    launch_persistent(fn, (ctas,), (THREADS,), args, smem=smem, stream=stream)


def moe_dispatch(x, topk_ids, topk_weights, *, comm, num_experts, capacity=None, out=None, stream=None):
    """Routes this rank's tokens to the experts' owners.

    x: [T, H] bfloat16 or float16 (this rank's tokens; T may differ across ranks, then pass the
    same ``capacity`` everywhere). topk_ids: int32 [T, k] global expert ids (k <= 8). topk_weights:
    float32 [T, k] (kept in the handle for combine). Returns ``(recv, handle)``: recv [capacity, H],
    the rows this rank received (one per (token, local expert) pair; rows past handle.received()
    untouched), grouped by local expert; the handle for combine. capacity defaults to
    ``moe_capacity(T, k, world)``; every rank must use the same. Errors found on the device (a
    capacity exceeded, an expert id out of range) are raised by the next ``comm.check()`` or mkernel
    op on the communicator, on every rank: nothing is dropped silently. Between nodes the capacity
    also bounds the pairs a rank forwards (its tokens and the ones it forwards, times k), and the
    bundle buffers hold capacity / k tokens per other node: pass a capacity near the need.
    """
    op = "moe_dispatch"
    d = check_dispatch(op, x, topk_ids, topk_weights, comm, num_experts, capacity, stream)
    out = _calls.prepare_out(op, out, (d.capacity, d.H), d.x.dtype, comm)
    return out, launch_dispatch(d, out, stream)


def launch_dispatch(d, out, stream):
    """The standalone dispatch of a checked call into out [capacity, H]; returns its handle."""
    a = d.plan_args()
    a.out = out.data.ptr
    a.ldo = row_stride(out) // out.itemsize
    pairs = d.capacity if d.nodes is not None else d.T * d.k  # between nodes: counted on the device
    ctas = max(1, min(launch.grid_sms(d.comm, d.op), -(-pairs // PAIRS_PER_CTA)))
    d.exchange()
    _launch(d.op, "mk_moe_dispatch_kernel", a, ctas, stream, smem=DISPATCH_SMEM,
            full_share=launch.full_share(d.comm, d.op))
    return d.handle()


class Dispatch:
    """A checked dispatch call (inputs, capacity), then its plan and argument struct (plan_args:
    collective), then the handle of its launch (handle: after the launch)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)
        self.plan = self.nodes = None

    def plan_args(self) -> MkMoeArgs:
        """Agrees the call across ranks, plans the buffers (collective) and fills the arguments of the
        node's dispatch (between nodes: over the virtual tokens the exchange leaves)."""
        self.plan = _plan(self.op, self.comm, self.H, self.x.dtype, self.k, self.E, self.capacity, self.stream)
        a = _args(self.comm, self.plan, self.op, self.T, self.k, self.plan["E"], self.H)
        a.x, a.ldx = self.x.data.ptr, row_stride(self.x) // self.x.itemsize
        a.topk_ids = self.ids.data.ptr
        if self.comm.num_nodes > 1:
            self.nodes = _nodes.plan(self.op, self.comm, self.H, self.x.dtype, self.k, self.E, self.capacity,
                                     self.plan["scratch_end"])
            _nodes.set_virtual(a, self.nodes, self.comm)
        return a

    def exchange(self):
        """Between nodes, the exchange kernel, launched just before the node's dispatch (after plan_args)."""
        if self.nodes is not None:
            _nodes.exchange(self, self.nodes, self.stream)

    def handle(self) -> "MoeHandle":
        """The launched dispatch's handle: the plan's next generation (earlier handles of the plan go stale)."""
        self.plan["generation"] += 1
        return MoeHandle(self.plan, self.plan["generation"], self.w, self.T, self.k, self.H, self.x.dtype, self.E,
                         self.nodes)


def check_dispatch(op, x, topk_ids, topk_weights, comm, num_experts, capacity, stream) -> Dispatch:
    """The routing inputs and the capacity, checked on this rank (nothing collective, nothing launched)."""
    _check_comm(op, comm)
    comm.check()
    x, ids, w, T, H, k = _check_routing(op, x, topk_ids, topk_weights, num_experts, comm.size, stream)
    capacity = moe_capacity(T, k, comm.size) if capacity is None else capacity
    if not isinstance(capacity, int) or isinstance(capacity, bool) or not 1 <= capacity <= MAX_ROWS:
        raise ArgumentError(f"{op}: capacity must be 1..{MAX_ROWS} rows; got {capacity!r}")
    if comm.num_nodes > 1:
        _nodes.check_sizes(op, H, k, capacity)
    return Dispatch(op=op, comm=comm, stream=stream, x=x, ids=ids, w=w, T=T, H=H, k=k, E=num_experts,
                    capacity=capacity)


def moe_combine(y, handle, *, comm, out=None, stream=None):
    """Returns each row of ``y`` ([capacity, H], rows as dispatch received them: after the experts)
    to its token's rank and sums a token's rows weighted by its routing weights: out [T, H] (the
    dispatch's dtype), ``out[t] = sum_j topk_weights[t, j] * row(t, j)`` in fp32, j ascending, one
    rounding (bitwise reproducible). Between nodes: each node's pairs summed so (in fp32), then the
    nodes' sums in node order, one rounding; the weights are the ones dispatch was given."""
    return combine("moe_combine", y, handle, comm=comm, out=out, stream=stream)


def combine(op, y, handle, *, comm, out, stream):
    """moe_combine on behalf of ``op`` (the name its errors and timeouts carry)."""
    _check_comm(op, comm)
    comm.check()
    if not isinstance(handle, MoeHandle):
        raise ArgumentError(f"{op}: handle must be the MoeHandle of moe_dispatch; got {type(handle).__name__}")
    handle._check()
    plan = handle._plan
    y = check_matrix(as_cupy(y, "y", stream=stream), "y", dtypes=(handle.dtype,), shape=(handle.capacity, handle.H))
    out = _calls.prepare_out(op, out, (handle.T, handle.H), handle.dtype, comm)
    a = _args(comm, plan, op, handle.T, handle.k, plan["E"], handle.H)
    a.y, a.ldy = y.data.ptr, row_stride(y) // y.itemsize
    nodes = handle._nodes
    if nodes is None:
        a.topk_w = handle.topk_weights.data.ptr
        a.out, a.ldo = out.data.ptr, row_stride(out) // out.itemsize
        tokens = handle.T
    else:  # the node's sums of the virtual tokens (fp32), then the nodes' sums of this rank's tokens
        _nodes.set_virtual(a, nodes, comm)
        a.topk_w, a.out, a.ldo, a.partial_out = nodes["vw"].data.ptr, nodes["part"].data.ptr, handle.H, 1
        tokens = nodes["fwd_rows"]
    ctas = max(1, min(launch.grid_sms(comm, op), -(-handle.capacity // ROWS_PER_CTA), max(1, tokens)))
    _launch(op, f"mk_moe_combine_kernel<{DT[handle.dtype.name]}>", a, ctas, stream,
            full_share=launch.full_share(comm, op))
    if nodes is not None:
        _nodes.partials(op, comm, handle, out, stream)
    return out
