"""The GEMM-carrying expert-parallel ops (design: docs/MOE.md).

``moe_dispatch_gemm``: one persistent kernel (``mkernel/cuda/ops/moe_dispatch_gemm.cu``) whose
communication CTAs dispatch (rows leave local expert by local expert) while its GEMM CTAs run the
experts' grouped GEMM straight on the receive buffer, each tile once the rows it holds have arrived.

``moe_gemm_combine``: one persistent kernel (``mkernel/cuda/ops/moe_gemm_combine.cu``) whose GEMM CTAs
run the experts' second grouped GEMM, their epilogue storing every row straight back at its source,
while its communication CTAs count the rows of every finished M-tile; then every CTA sums its share of
the tokens (between nodes: this rank's; the forwarded tokens' node sums go back in chunks as they are done).

``path="unfused"`` runs the building blocks instead (``moe_dispatch`` then ``grouped_gemm``;
``grouped_gemm`` then ``moe_combine``), the comparison the benchmark reports. Default paths
(``default_path``): fused for ``moe_dispatch_gemm``; for ``moe_gemm_combine`` fused between nodes and
unfused inside one node, where its fused kernel is still the slower.
"""

import ctypes
import types

from mkernel.core import config
from mkernel.core.errors import ArgumentError
from mkernel.engines import gemm as _gemm
from mkernel.ops import buffers as _buffers
from mkernel.ops import calls as _calls
from mkernel.ops import moe as _moe
from mkernel.ops import moe_nodes as _nodes
from mkernel.runtime import compile as _compile
from mkernel.runtime import launch
from mkernel.runtime.arrays import as_cupy, check_matrix, row_stride
from mkernel.runtime.launch import launch_persistent, persistent_grid

KERNEL = "mk_moe_dispatch_gemm_kernel"
THREADS = 384            # MOE_GEMM_THREADS (the GEMM engine's CTA)
PATHS = ("fused", "unfused")
# path=None, by (op, between nodes): the fused combine beats its blocks between nodes (it sends the node
# sums while it computes), not inside one node (docs/MOE.md "Status")
DEFAULT_PATH = types.MappingProxyType({("moe_dispatch_gemm", False): "fused", ("moe_dispatch_gemm", True): "fused",
                                       ("moe_gemm_combine", False): "unfused", ("moe_gemm_combine", True): "fused"})
MAX_EXPERTS_LOCAL = _gemm.MAX_GROUPS  # one GEMM group per local expert
# by default an op's comm CTAs take at most 1/n of the grid, the GEMM the rest (bench/NOTES.md session 66)
COMM_GRID_SHARE = types.MappingProxyType({"moe_dispatch_gemm": 4, "moe_gemm_combine": 8})

COMBINE_KERNEL = "mk_moe_gemm_combine_kernel"
CNT_TILE, CNT_GEMM_DONE = 5, 7  # MOE_CNT_TILE, MOE_CNT_GEMM_DONE: the combine GEMM's scheduler words


def _register(name, source, kernel):
    return _compile.register(name, source, tuple(f"{kernel}<{dt},{bl}>" for dt in (0, 1)
                                                 for bl in (_gemm.B_NK, _gemm.B_KN)), hot=True)


SPEC = _register("moe_gemm", "moe_dispatch_gemm.cu", KERNEL)
COMBINE_SPEC = _register("moe_gemm_combine", "moe_gemm_combine.cu", COMBINE_KERNEL)




class MkMoeGemmArgs(ctypes.Structure):
    """Mirror of ``MkMoeGemmArgs`` (mkernel/cuda/ops/moe_gemm_args.cuh), 1088 bytes (64-byte aligned)."""
    _fields_ = [("g", _gemm.MkGemmArgs), ("m", _moe.MkMoeArgs), ("gemm_ctas", ctypes.c_int32),
                ("join", ctypes.c_int32), ("tail", ctypes.c_uint8 * 32)]


def _expert_weights(op, w, E_local, K, dtype, w_layout):
    """(w, layout code, N) of expert weights [E_local, K, N] ('kn') or [E_local, N, K] ('nk')."""
    if w.ndim != 3 or w.shape[0] != E_local or w.dtype != dtype:
        raise ArgumentError(f"{op}: expert weights must be [{E_local}, ...] of {dtype}; got {w.dtype} {tuple(w.shape)}")
    if w_layout is None:
        w_layout = "kn" if w.shape[1] == K else "nk" if w.shape[2] == K else None
    if w_layout == "kn" and w.shape[1] == K:
        layout, N = _gemm.B_KN, w.shape[2]
    elif w_layout == "nk" and w.shape[2] == K:
        layout, N = _gemm.B_NK, w.shape[1]
    else:
        raise ArgumentError(f"{op}: expert weights {tuple(w.shape)} are neither [E, K={K}, N] nor [E, N, K={K}] "
                            f"(w_layout={w_layout!r})")
    if N % 8:
        raise ArgumentError(f"{op}: the experts' output width {N} must be a multiple of 8")
    if not 1 <= E_local <= MAX_EXPERTS_LOCAL:
        raise ArgumentError(f"{op}: at most {MAX_EXPERTS_LOCAL} experts per rank (one GEMM group each); "
                            f"this call has {E_local}")
    _gemm.check_grouped_b(w, f"{op}: expert weights")
    return w, layout, N


def _b_layout_name(layout):
    return "kn" if layout == _gemm.B_KN else "nk"


def moe_dispatch_gemm(x, topk_ids, topk_weights, w, *, comm, num_experts, capacity=None, out=None, stream=None,
                      w_layout=None, comm_sms=None, path=None):
    """Dispatch, then every local expert's GEMM on the rows it received: returns ``(y, handle)``,
    y [capacity, F] = received rows @ w[expert] (rows grouped as moe_dispatch receives them; rows past
    handle.received() untouched). x, topk_ids, topk_weights, capacity: as :func:`mkernel.moe_dispatch`.
    w: [E_local, H, F] (or [E_local, F, H]; w_layout 'kn' / 'nk' says which when H == F), at most 128
    local experts, F a multiple of 8.

    path: "fused" (default): one kernel, the GEMM of each tile starting once its rows arrived;
    ``comm_sms`` CTAs dispatch (default 16), the others run the GEMM. "unfused": moe_dispatch, then
    grouped_gemm on its output, back to back on the stream. Nothing synchronises with the host.
    """
    import cupy

    op = "moe_dispatch_gemm"
    d = _moe.check_dispatch(op, x, topk_ids, topk_weights, comm, num_experts, capacity, stream)
    path, comm_sms = _check_path(op, path, comm_sms, comm)
    El = num_experts // comm.size
    wb, layout, F = _expert_weights(op, as_cupy(w, "w", stream=stream), El, d.H, d.x.dtype, w_layout)
    out = _calls.prepare_out(op, out, (d.capacity, F), d.x.dtype, comm)
    if path == "unfused":
        with _calls.on_stream(stream):
            recv = cupy.empty((d.capacity, d.H), dtype=d.x.dtype)
        handle = _moe.launch_dispatch(d, recv, stream)
        _gemm.grouped_gemm(recv, wb, handle.group_rows, out=out, stream=stream, b_layout=_b_layout_name(layout))
        return out, handle

    args = MkMoeGemmArgs()
    args.m = d.plan_args()
    _gemm_args(args.g, d.plan["recv"], wb, layout, out, d.plan["group_rows"], d.capacity, d.H, F, El, args.m.sync,
               d.plan, op)
    sms = launch.grid_sms(comm, op)
    args.gemm_ctas = sms - comm_sms
    args.join = 1 if config.get().moe_join_gemm else 0
    d.exchange()
    _launch(op, SPEC, KERNEL, layout, d.x.dtype, args, sms, stream, launch.full_share(comm, op))
    return out, d.handle()


def default_path(op, comm):
    """The path a call of op with path=None takes on comm."""
    return DEFAULT_PATH[op, comm.num_nodes > 1]


def _check_path(op, path, comm_sms, comm):
    path = default_path(op, comm) if path is None else path
    if path not in PATHS:
        raise ArgumentError(f"{op}: path must be one of {PATHS}; got {path!r}")
    if comm_sms is None:  # the op's knob, at most its share of the grid (4 ranks under MPS: 8 and 4 of 33)
        cfg = config.get()
        knob = cfg.moe_combine_comm_sms if op == "moe_gemm_combine" else cfg.moe_comm_sms
        comm_sms = max(1, min(knob, launch.grid_sms(comm, op) // COMM_GRID_SHARE[op]))
    if not isinstance(comm_sms, int) or isinstance(comm_sms, bool) or not 1 <= comm_sms < launch.sm_count():
        raise ArgumentError(f"{op}: comm_sms must be an integer in 1..{launch.sm_count() - 1}; got {comm_sms!r}")
    return path, comm_sms


def _gemm_args(g, a_arr, wb, layout, out, group_rows, capacity, K, N, El, sync, plan, op):
    """The engine's arguments of a fused op's grouped GEMM: A [capacity, K] (a_arr), B the experts'
    weights, C out [capacity, N] (None: the kernel's epilogue puts the rows elsewhere), one group per
    local expert. The TMA maps are the plan's, encoded again only when an operand's pointer or strides
    changed (buffers.operand_map)."""
    dt = a_arr.dtype.name
    maps = _buffers.launch_template(plan, ("gemm maps", op, K, N, El, layout, dt), lambda: None)
    g.a = _buffers.operand_map(maps, "a", (a_arr.data.ptr, a_arr.strides), lambda: _gemm.a_map(
        dt, a_arr.data.ptr, capacity, K, row_stride(a_arr)))
    g.b = _buffers.operand_map(maps, "b", (wb.data.ptr, wb.strides), lambda: _gemm.b_map(wb, layout, K, N, El))
    if out is not None:
        g.c = _buffers.operand_map(maps, "c", (out.data.ptr, out.strides), lambda: _gemm.c_map(out, _gemm.DT[dt]))
        g.c_ptr, g.ldc = out.data.ptr, row_stride(out) // out.itemsize
    g.sync = sync
    g.sched.tiles_n, g.sched.group_m = -(-N // _gemm.BN), _gemm.DEFAULT_GROUP_M
    g.group_rows = group_rows.data.ptr
    g.m, g.n, g.k, g.num_groups, g.epi_op = capacity, N, K, El, _gemm.EPI_STORE


def _tile_flags(comm, cap, H, El, stream):
    """The fused combine's tile flags (epoch-valued: never reset), one array per communicator grown
    to the largest call (not one per plan)."""
    import cupy

    need = _gemm.grouped_tiles_bound(cap, H, El)
    flags = comm.plans.state.get("moe.combine tile flags")
    if flags is None or flags.size < need:
        with _calls.on_stream(stream):  # stream-ordered: the old array is freed behind its last use
            flags = cupy.zeros(need, dtype=cupy.uint32)
        comm.plans.state["moe.combine tile flags"] = flags
    return flags


def _launch(op, spec, kernel, layout, dtype, args, grid, stream, full_share):
    fn = _compile.module(spec).function(f"{kernel}<{_gemm.DT[dtype.name]},{layout}>")
    persistent_grid(fn, THREADS, _gemm.SMEM_GROUPED, blocks=grid, what=op, full_share=full_share)
    # roles by arrival, work claimed: any resident part of the grid finishes (docs/MOE.md "Residency")
    launch_persistent(fn, (grid,), (THREADS,), args, smem=_gemm.SMEM_GROUPED, stream=stream)


def moe_gemm_combine(y2, w2, handle, *, comm, out=None, stream=None, w_layout=None, comm_sms=None, path=None):
    """Every local expert's second GEMM (y2 [capacity, F] @ w2[expert] [F, H], or w2 [E_local, H, F])
    on its rows, each row back to its token's rank, and every token's rows summed weighted by its
    routing weights: out [T, H], the same bits as ``moe_combine(grouped_gemm(y2, w2))``.

    path: "unfused": grouped_gemm, then moe_combine, back to back on the stream. "fused": one kernel;
    the GEMM's epilogue stores each row at its source, ``comm_sms`` CTAs (default 8: config
    moe_combine_comm_sms) count the rows of every M-tile once its N-tiles are stored; between nodes
    it computes the M-tiles with forwarded rows first and sends their tokens' node sums in chunks
    while it computes the rest (docs/MOE.md "Overlap"). Both give the same bits. Default (None):
    fused between nodes, unfused inside one node, where the fused kernel is still the slower
    (0.89-0.95x its blocks at world 1 on the H200; bench/NOTES.md).
    """
    import cupy

    op = "moe_gemm_combine"
    _moe._check_comm(op, comm)
    path, comm_sms = _check_path(op, path, comm_sms, comm)
    if not isinstance(handle, _moe.MoeHandle):
        raise ArgumentError(f"{op}: handle must be the MoeHandle of moe_dispatch; got {type(handle).__name__}")
    handle._check()
    y2 = as_cupy(y2, "y2", stream=stream)
    if y2.ndim != 2 or y2.shape[0] != handle.capacity:
        raise ArgumentError(f"{op}: y2 must be [capacity={handle.capacity}, F]; got {tuple(y2.shape)}")
    wb, layout, H = _expert_weights(op, as_cupy(w2, "w2", stream=stream), handle.group_rows.size, y2.shape[1],
                                    handle.dtype, w_layout)
    if H != handle.H:
        raise ArgumentError(f"{op}: w2 maps F={y2.shape[1]} to {H} columns, not the tokens' H={handle.H}")
    y2 = check_matrix(y2, "y2", dtypes=(handle.dtype,))
    if y2.shape[1] % 8:
        raise ArgumentError(f"{op}: y2's width F = {y2.shape[1]} must be a multiple of 8")
    out = _calls.prepare_out(op, out, (handle.T, H), handle.dtype, comm)
    comm.check()
    if path == "unfused":
        with _calls.on_stream(stream):
            z = cupy.empty((handle.capacity, H), dtype=handle.dtype)
        _gemm.grouped_gemm(y2, wb, handle.group_rows, out=z, stream=stream, b_layout=_b_layout_name(layout))
        return _moe.combine(op, z, handle, comm=comm, out=out, stream=stream)

    plan, cap, El = handle._plan, handle.capacity, handle.group_rows.size
    tile_flags = _tile_flags(comm, cap, H, El, stream)
    args = MkMoeGemmArgs()
    args.m = _moe._args(comm, plan, op, handle.T, handle.k, plan["E"], H)
    nodes = handle._nodes
    if nodes is None:
        args.m.topk_w = handle.topk_weights.data.ptr
        args.m.out = out.data.ptr
        args.m.ldo = row_stride(out) // out.itemsize
    else:  # the node's sums (as moe.combine's), the forwarded ones sent by the kernel
        _nodes.set_virtual(args.m, nodes, comm)
        _nodes.set_sums(args.m, nodes, comm)
        args.m.topk_w, args.m.out, args.m.ldo, args.m.partial_out = nodes["vw"].data.ptr, nodes["part"].data.ptr, H, 1
    _gemm_args(args.g, y2, wb, layout, None, handle.group_rows, cap, y2.shape[1], H, El, args.m.sync, plan, op)
    args.g.tile_flags = tile_flags.data.ptr
    counters = plan["counters"].data.ptr
    args.g.sched.tile_counter, args.g.sched.done_count = counters + 4 * CNT_TILE, counters + 4 * CNT_GEMM_DONE
    sms = launch.grid_sms(comm, op)
    args.gemm_ctas = sms - comm_sms
    _launch(op, COMBINE_SPEC, COMBINE_KERNEL, layout, handle.dtype, args, sms, stream, launch.full_share(comm, op))
    if nodes is not None:
        _nodes.partials(op, comm, handle, out, stream, sent=True)
    return out
