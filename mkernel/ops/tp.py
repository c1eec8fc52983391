"""Planning, launch and fallback of the fused tensor-parallel ops ``gemm_reduce_scatter``,
``gemm_allreduce`` and ``allgather_gemm`` (design: docs/TP.md), on the call path every op shares
(mkernel/ops/calls.py, mkernel/ops/buffers.py).

Paths (one per call, a function of the shapes and the topology, agreed by every rank through
``comm.agree`` before anything is launched):

- ``"fused"``: one persistent kernel (``mkernel/cuda/ops/gemm_reduce_scatter.cu`` etc.): GEMM CTAs and
  communication CTAs, per-tile flags in the symmetric workspace.
- ``"fallback"``: the GEMM engine (``matmul``) then the NCCL collective (ranks on distinct GPUs, shapes too small
  for fusion to win). Needs NCCL, so it is never chosen when ranks share a GPU.
- ``"gemm"``: world 1: the GEMM engine (``mkernel.gemm``), nothing to communicate.
- ``"latency"`` (gemm_allreduce inside a node): the GEMM (the decode path at few rows), then the
  one-shot all-reduce (mkernel.allreduce): one round of pushes for small outputs. Chosen by
  ``config.tp_latency_max_rows`` (256 rows, measured) or when asked for.
- ``"unfused"`` (only when asked for: the baseline that isolates overlap, between nodes above all):
  the GEMM engine, then the fused kernel's own collective with no GEMM in it (RS / AR: its CTAs
  move the finished partial's tiles where the epilogue would store them; AG: the gather, then the
  GEMM), over the same NVLink and transport paths.

CuPy is imported inside functions, so that importing this module (and registering the kernels)
needs neither a GPU nor CuPy.
"""

import ctypes

from mkernel.comm import proxy as _proxy
from mkernel.core import config
from mkernel.core.errors import ArgumentError
from mkernel.engines import gemm as _gemm
from mkernel.ops import buffers as _buffers
from mkernel.ops import calls as _calls
from mkernel.runtime import compile as _compile
from mkernel.runtime import launch as _launch
from mkernel.runtime import tma as _tma
from mkernel.runtime.arrays import DT, as_cupy, check_matrix, cupy_mod
from mkernel.runtime.launch import launch_persistent, persistent_grid
from mkernel.split import search as autosplit
from mkernel.split.policy import MkSplitCtl

BM, BN, BK = _gemm.BM, _gemm.BN, _gemm.BK  # the engine's tile: TP kernels run its mainloop
THREADS = 384
MAX_WORLD = 8  # TP_MAX_WORLD
OP_RS, OP_AR, OP_AG = 0, 1, 2
CNT_WORDS = 8  # TP_CNT_WORDS (reset by the kernel), then TP_CNT_LAUNCHES
TILE_BYTES = BM * BN * 2  # TP_TILE_BYTES: one node partial tile between nodes (compact)
PF_ARRIVED = 2 * MAX_WORLD  # TP_PF_ARRIVED: the first arrival counter of a plan's proxy flags
ARRIVAL_FLAGS = 1024  # arrival counters of one plan (source nodes x tile or chunk groups)


def send_groups(items, min_group):
    """RS / AR: the staged-tile counters' length, [2 kinds][nodes][groups] for any node count: groups
    of at least ``min_group`` tiles (config.tp_send_tiles; plan_between_nodes's xgroup is at least that)."""
    return 2 * MAX_WORLD * -(-items // min_group)


def plan_between_nodes(comm, plan, args, items, kinds=1, min_group=1):
    """Between nodes: the plan's proxy flags (once per plan, collective like its buffers): arrival
    counters for ``kinds`` x nodes x ``items`` (tiles, or A chunks) in groups of at least
    ``min_group`` (items sent in one WRITE), small enough to fit ARRIVAL_FLAGS; and the proxy fields
    of ``args``."""
    nodes = comm.num_nodes
    if "pflags" not in plan:
        xgroup = max(min_group, -(-kinds * nodes * items // ARRIVAL_FLAGS))
        plan["xgroup"] = xgroup
        plan["pflags"] = comm.proxy_flag_block(PF_ARRIVED + kinds * nodes * -(-items // xgroup))
    base = plan["pflags"].offset
    args.queue = comm.proxy_queue_args(flag_base=base)
    args.pflags = comm.proxy_flags[0] + 4 * base
    args.xgroup = plan["xgroup"]
    args.xgroups = -(-items // plan["xgroup"])
SMEM_BYTES = 230736  # TP_SMEM_BYTES (static_assert in every .cu)
PATHS = ("fused", "fallback", "gemm", "unfused", "latency")
CTL_OFF, CTL_ADAPT, CTL_PATTERN = 0, 1, 2  # TP_CTL_*
B_NK, B_KN = _gemm.B_NK, _gemm.B_KN
# The knobs (fusion crossovers, controller mode, join, default comm CTAs) are mkernel.config's.


class TpArgs(ctypes.Structure):
    """Mirror of ``TpArgs`` (mkernel/cuda/ops/tp_args.cuh)."""
    _fields_ = [("g", _gemm.MkGemmArgs), ("dst", _tma.TensorMap * MAX_WORLD),
                ("peer_base", ctypes.c_void_p), ("recv_off", ctypes.c_uint64), ("rflag_off", ctypes.c_uint64),
                ("gath_off", ctypes.c_uint64), ("gflag_off", ctypes.c_uint64), ("ga_off", ctypes.c_uint64),
                ("aflag_off", ctypes.c_uint64), ("out", ctypes.c_void_p), ("a_local", ctypes.c_void_p),
                ("counters", ctypes.c_void_p), ("ldo", ctypes.c_int64), ("lda", ctypes.c_int64),
                ("world", ctypes.c_int32), ("me", ctypes.c_int32), ("mb", ctypes.c_int32),
                ("tiles_mb", ctypes.c_int32), ("tiles_n", ctypes.c_int32), ("gemm_ctas", ctypes.c_int32),
                ("join", ctypes.c_int32), ("nodes", ctypes.c_int32), ("local", ctypes.c_int32),
                ("lrank", ctypes.c_int32), ("node", ctypes.c_int32), ("xgroup", ctypes.c_uint32),
                ("xgroups", ctypes.c_uint32), ("xstaged", ctypes.c_void_p), ("queue", _proxy.QueueArgs),
                ("pflags", ctypes.c_void_p),
                ("stage_off", ctypes.c_uint64), ("xrecv_off", ctypes.c_uint64), ("xgath_off", ctypes.c_uint64),
                ("partial", ctypes.c_void_p), ("ldp", ctypes.c_int64), ("ctl", ctypes.c_void_p),
                ("ctl_mode", ctypes.c_int32), ("ctl_lend_max", ctypes.c_int32),
                ("own_copied", ctypes.c_int32), ("comm_staged", ctypes.c_int32),
                ("join_staged", ctypes.c_int32), ("pad", ctypes.c_int32 * 5)]


class TpCtlStats(ctypes.Structure):
    """Mirror of ``TpCtlStats`` (tp_args.cuh): one launch's controller record."""
    _fields_ = [(f, ctypes.c_uint32) for f in ("turns", "steps", "windows", "gemm_windows", "lent_peak", "lent_last",
                                              "gemm_ctas", "comm_ctas", "launches")] + [("pad", ctypes.c_uint32 * 3)]


class TpCtl(ctypes.Structure):
    """Mirror of ``TpCtl`` (tp_args.cuh): a plan's controller state in device memory."""
    _fields_ = [("lock", ctypes.c_uint32), ("lent", ctypes.c_uint32), ("tiles_at", ctypes.c_uint32),
                ("items_at", ctypes.c_uint32), ("window_start", ctypes.c_uint64), ("turn_ns", ctypes.c_uint64),
                ("comm_stall_ns", ctypes.c_uint64), ("gemm_stall_ns", ctypes.c_uint64), ("turns", ctypes.c_uint32),
                ("steps", ctypes.c_uint32), ("windows", ctypes.c_uint32), ("gemm_windows", ctypes.c_uint32),
                ("lent_peak", ctypes.c_uint32), ("ctl", MkSplitCtl), ("pad", ctypes.c_uint32 * 5),
                ("last", TpCtlStats)]


def register(op: str, source: str, kernel: str):
    """Registers the 4 instantiations (bf16/fp16 x B [N,K]/[K,N]) of one op's kernel."""
    exprs = tuple(kernel_expr(kernel, dt, bl) for dt in (0, 1) for bl in (B_NK, B_KN))
    return _compile.register(op, source, exprs, hot=True)


def kernel_expr(kernel: str, dt: int, layout: int) -> str:
    return f"{kernel}<{dt},{layout}>"


# ------------------------------------------------------------------------------- arguments


def check_inputs(op, a, b, b_layout, stream):
    """(a, layout, b_arr, N): a and b on this GPU, 16-bit, rows contiguous; b as [K, N] or [N, K]."""
    a = check_matrix(as_cupy(a, "a", stream=stream), "a")
    b = as_cupy(b, "b", stream=stream)
    if b.dtype != a.dtype:
        raise ArgumentError(f"{op}: a and b must have the same dtype; got {a.dtype} and {b.dtype}")
    if b.ndim != 2:
        raise ArgumentError(f"{op}: b must be 2-D; got shape {tuple(b.shape)}")
    K = a.shape[1]
    if b_layout is None:
        if b.shape[0] != K:
            raise ArgumentError(f"{op}: b has shape {tuple(b.shape)}; expected [K={K}, N] (or pass "
                                f"b_layout='nk' for [N, K])")
        if b.shape[1] > 1 and b.strides[1] != b.itemsize and b.strides[0] == b.itemsize:
            layout, b_arr = B_NK, b.T  # the transposed view of a row-major [N, K] (weights: w.T)
        else:
            layout, b_arr = B_KN, b
    elif b_layout == "kn":
        if b.shape[0] != K:
            raise ArgumentError(f"{op}: b_layout='kn' needs b of shape [K={K}, N]; got {tuple(b.shape)}")
        layout, b_arr = B_KN, b
    elif b_layout == "nk":
        if b.shape[1] != K:
            raise ArgumentError(f"{op}: b_layout='nk' needs b of shape [N, K={K}]; got {tuple(b.shape)}")
        layout, b_arr = B_NK, b
    else:
        raise ArgumentError(f"{op}: b_layout must be None, 'kn' or 'nk'; got {b_layout!r}")
    check_matrix(b_arr, "b")
    N = b_arr.shape[1] if layout == B_KN else b_arr.shape[0]
    if K % 8 or N % 8:
        raise ArgumentError(f"{op}: K = {K} and N = {N} must be multiples of 8 (TMA rows are multiples of "
                            f"16 bytes)")
    if K == 0 or N == 0 or a.shape[0] == 0:
        raise ArgumentError(f"{op}: empty operand (a {tuple(a.shape)}, b {tuple(b.shape)})")
    return a, layout, b_arr, N


def check_comm(op, comm):
    """Any number of nodes of equal size (the hierarchical paths); ranks must be node-major."""
    if comm is None:
        raise ArgumentError(f"{op} needs comm= (mkernel.init())")
    _calls.check_node_major(op, comm)
    if comm.size > MAX_WORLD:
        raise ArgumentError(f"{op}: at most {MAX_WORLD} ranks; this communicator has {comm.size}")


def gpus_distinct(comm) -> bool:
    """True when every rank has a GPU of its own."""
    return not comm.gpus_shared


def choose_path(op, comm, path, *, rows, N, K):
    """The path of one call and why (before agreement): a function of shapes and topology only."""
    if path is not None and path not in PATHS:
        raise ArgumentError(f"{op}: path must be None or one of {PATHS}; got {path!r}")
    W = comm.size
    if path == "gemm" and W != 1:
        raise ArgumentError(f"{op}: path='gemm' is the world-1 path; this communicator has {W} ranks")
    latency_ok = lambda: op == "gemm_allreduce" and W > 1 and comm.num_nodes == 1  # noqa: E731
    if path == "latency" and not latency_ok():
        raise ArgumentError(f"{op}: path='latency' is gemm_allreduce's, inside one node of 2 or more ranks")
    if path is not None:
        return path, "requested"
    if W == 1:
        return "gemm", "world 1: a plain GEMM"
    if rows <= config.get().tp_latency_max_rows and latency_ok():
        return "latency", f"{rows} rows: at most tp_latency_max_rows"
    if not gpus_distinct(comm):
        return "fused", "ranks share a GPU (NCCL cannot run)"
    tiles = -(-rows // BM) * -(-N // BN)
    cfg = config.get()
    if tiles < cfg.tp_fuse_min_tiles or K < cfg.tp_fuse_min_k:
        return "fallback", (f"{tiles} output tiles, K {K}: below the fusion crossover ({cfg.tp_fuse_min_tiles}, "
                            f"{cfg.tp_fuse_min_k})")
    return "fused", f"{tiles} output tiles, K {K}"


# ------------------------------------------------------------------------------- buffers
def plan_buffers(op, comm, key, sizes):
    """A fused TP op's plan (buffers.plan_buffers): its ``counters`` and controller state ``ctl``
    (TpCtl) beside the buffers of ``sizes``."""
    if comm.plans.get(key) is None:
        autosplit.preload()  # at a plan's first call, not in a key's first "auto" call
    return _buffers.plan_buffers(op, comm, key, sizes, {"counters": CNT_WORDS + 1, "ctl": ctypes.sizeof(TpCtl) // 4})


def remember_ctl(comm, plan):
    """A callable that makes ``plan``'s controller record the one :func:`controller_stats` reads
    (calls.record_call's on_replay)."""
    ctl = plan["ctl"]

    def note():
        comm.plans.state["tp.last_ctl"] = ctl
    return note


# ------------------------------------------------------------------------------- launch

def out_map(dtype, ptr, rows, N, row_bytes):
    """A TMA store map of a [rows, N] block (box 64 columns x 16 rows, 128B swizzle)."""
    tdt = _tma.DTYPE_BFLOAT16 if dtype.name == "bfloat16" else _tma.DTYPE_FLOAT16
    return _tma.encode_tiled(tdt, ptr, (N, rows), (row_bytes,), (64, 16))


def grid_split(op, comm_sms, total_tiles, comm_items, sms):
    """(gemm_ctas, comm_ctas) of a fused launch."""
    comm_ctas = max(1, min(int(comm_sms), comm_items))
    if int(comm_sms) >= sms:
        raise ArgumentError(f"{op}: comm_sms={comm_sms} leaves no SM for the GEMM ({sms} SMs)")
    gemm_ctas = max(1, min(total_tiles, sms - comm_ctas))
    return gemm_ctas, comm_ctas


def check_comm_sms(op, comm_sms):
    """An integer pins the split; "auto" (the default, None) lets the key's split search choose it
    (mkernel.split.search) and the in-call controller adapt it."""
    if comm_sms is None or comm_sms == "auto":
        return "auto"
    if not isinstance(comm_sms, int) or isinstance(comm_sms, bool) or comm_sms < 1:
        raise ArgumentError(f"{op}: comm_sms must be a positive integer or 'auto'; got {comm_sms!r}")
    return comm_sms


def resolve_comm_sms(op, comm, comm_sms, chosen, *, M, N, K, esize, comm_items, joined_in_node=False):
    """(comm CTAs of this launch, the token for ``autosplit.timed``): an integer as given; "auto"
    asks the key's split search on the fused path (the unfused baseline runs the default).
    ``joined_in_node``: the GEMM CTAs join the reduction and the world is one node."""
    if comm_sms != "auto":
        return comm_sms, None
    if chosen != "fused":
        return config.get().tp_comm_sms[op], None
    return autosplit.choose(comm, op, M=M, N=N, K=K, esize=esize, comm_items=comm_items, sms=_launch.grid_sms(comm, op),
                            joined_in_node=joined_in_node)


def controller_mode(op, comm_sms, chosen, *, joined_in_node=False):
    """TP_CTL_* of a launch: the controller adapts the calls whose comm_sms is "auto"
    (config.tp_controller), except those whose GEMM CTAs join the reduction inside one node: the
    joined CTAs already take its items, and lending on top measured 10-20% slower (bench/NOTES.md)."""
    setting = config.get().tp_controller
    if chosen != "fused" or setting == "off":
        return CTL_OFF
    if setting == "pattern":
        return CTL_PATTERN
    if setting == "always":
        return CTL_ADAPT
    return CTL_ADAPT if comm_sms == "auto" and not joined_in_node else CTL_OFF


def set_split(args, plan, gemm_ctas, mode, comm):
    """The launch's static split and its controller (mode TP_CTL_*); remembers the plan for
    :func:`controller_stats`."""
    args.gemm_ctas = gemm_ctas
    args.ctl = plan["ctl"].data.ptr
    args.ctl_mode = mode
    args.ctl_lend_max = gemm_ctas // config.get().tp_lend_share
    comm.plans.state["tp.last_ctl"] = plan["ctl"]


def controller_stats(comm) -> dict:
    """The controller's record of the last completed fused launch on ``comm`` (synchronises the
    device): turns (comm items GEMM CTAs took between tiles), steps, windows, gemm_windows (windows
    with GEMM tiles left, where a move is possible), lent_peak, lent_last, gemm_ctas, comm_ctas,
    launches (of that plan so far). Empty before any fused launch. The plan is the one the last
    fused call on ``comm`` planned (its record is the previous launch's if that call raised before
    launching); in the "pattern" mode the lent counts stay 0 (no windows)."""
    ctl = comm.plans.state.get("tp.last_ctl")
    if ctl is None:
        return {}
    cupy_mod().cuda.runtime.deviceSynchronize()
    words = ctl.get()
    state = TpCtl.from_buffer_copy(words.tobytes())
    return {f: int(getattr(state.last, f)) for f, _ in TpCtlStats._fields_ if f != "pad"}


class Call:
    """One call's checked arguments: ``a`` [M or M / world, K], ``b`` as ``layout`` with N, ``out``,
    the agreed ``path``, ``comm_sms`` ("auto" or an integer), ``join``."""
    __slots__ = ("a", "b", "layout", "M", "N", "K", "mb", "out", "path", "comm_sms", "join")

    def __init__(self, **fields):
        for k, v in fields.items():
            setattr(self, k, v)


def fill_static(args, comm, *, a_rows, K, N, mb, counters):
    """The fields of a launch template that hold for every call of one plan and key."""
    W = comm.size
    g = args.g
    tiles_n = -(-N // BN)
    tiles_mb = -(-mb // BM)
    g.sched.tiles_n, g.sched.group_m, g.sched.num_tiles = tiles_n, 16, W * tiles_mb * tiles_n
    g.m, g.n, g.k, g.num_groups, g.epi_op, g.ldc = a_rows, N, K, 1, 0, N
    args.peer_base = comm.peer_table.data.ptr
    args.counters = counters.data.ptr
    args.world, args.me, args.mb = W, comm.rank, mb
    args.nodes, args.local, args.lrank, args.node = comm.num_nodes, comm.local_size, comm.local_rank, comm.node
    args.tiles_mb, args.tiles_n = tiles_mb, tiles_n
    return tiles_mb * tiles_n


def call_args(template, c, *, a_ptr, a_row_bytes):
    """A copy of ``template``'s TpArgs with this call's A (``a_ptr``: the rows the GEMM reads) and B maps."""
    args = TpArgs.from_buffer_copy(template["args"])
    dtype, g = c.a.dtype, args.g
    g.a = _buffers.operand_map(template, "a", (a_ptr, a_row_bytes),
                               lambda: _gemm.a_map(dtype.name, a_ptr, g.m, c.K, a_row_bytes))
    b = c.b
    g.b = _buffers.operand_map(template, "b", (b.data.ptr, b.strides), lambda: _gemm.b_map(b, c.layout, c.K, c.N))
    return args


def launch_fused(comm, op, spec, kernel, args, dtype, layout, grid, stream):
    fn = _compile.module(spec).function(kernel_expr(kernel, DT[dtype.name], layout))
    persistent_grid(fn, THREADS, SMEM_BYTES, blocks=grid, what=op,  # checked once per grid (cached)
                    full_share=_launch.full_share(comm, op))
    args.g.sync = comm.sync_args(op)
    args.g.c = args.dst[0]
    args.comm_staged = int(config.get().comm_staged)
    args.join_staged = int(config.get().tp_join_staged)
    return launch_persistent(fn, (grid,), (THREADS,), args, smem=SMEM_BYTES, stream=stream)


def matmul(a, b_arr, layout, out=None):
    """The unfused paths' GEMM of a with B given as [K, N] or [N, K] (into out when given), by the
    library's engine: cuBLAS (cupy.matmul) gives wrong fp16 tiles under some MPS shares (bench/NOTES.md)."""
    return _gemm.gemm(a, b_arr, out=out, b_layout="kn" if layout == B_KN else "nk")


def nccl_dtype(dtype):
    from cupy.cuda import nccl
    return nccl.NCCL_BFLOAT16 if dtype.name == "bfloat16" else nccl.NCCL_FLOAT16


def default_join(op, comm, *, M, N, K, esize) -> bool:
    """Whether the GEMM CTAs join the reduction of a call of ``a: [M, K]`` that leaves ``join`` to
    the config (the same on every rank: the model's inputs are the agreed shape and topology)."""
    cfg = config.get()
    if cfg.tp_join_reduce != "auto":
        return cfg.tp_join_reduce
    if comm.num_nodes == 1 or comm.local_size > 1:
        return True
    shares = comm.plans.state.setdefault("tp.gemm_share", {})  # the shape's first call decides: its transport
    share = shares.get((op, M, N, K, esize))
    if share is None:
        sms = _launch.grid_sms(comm, op)
        share = shares[(op, M, N, K, esize)] = autosplit.gemm_share(op, M, N, K, comm, esize, sms)
    return share >= cfg.tp_join_min_gemm_share
