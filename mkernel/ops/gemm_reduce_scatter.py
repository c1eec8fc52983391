"""``gemm_reduce_scatter(a, b, *, comm)``: rank r's row block of the sum over ranks of ``a_r @ b_r``,
computed by one fused kernel that reduces every output tile as soon as all its partials arrived
(design: docs/TP.md). Also the shared driver of ``gemm_allreduce`` (one mechanism, two ops).

Importable without CuPy; the kernels are registered with mkernel.compile at import.
"""

from mkernel.core import config
from mkernel.core.errors import ArgumentError
from mkernel.engines import gemm as _gemm
from mkernel.ops import allreduce as _ar
from mkernel.ops import buffers, calls, tp
from mkernel.ops import gemm_allreduce_ll as _ll
from mkernel.runtime import launch
from mkernel.runtime.arrays import row_stride
from mkernel.split import search as autosplit

OP = "gemm_reduce_scatter"
KERNEL = "mk_gemm_rs_kernel"
SPEC = tp.register(OP, "gemm_reduce_scatter.cu", KERNEL)


def gemm_reduce_scatter(a, b, *, comm, out=None, stream=None, b_layout=None, comm_sms=None, deterministic=True,
                        path=None, join=None):
    """Sum over ranks of ``a_r @ b_r``, scattered by rows: returns ``[M / world, N]``, rank r's block.

    a: ``[M, K_r]`` (K sharded over ranks), b: ``[K_r, N]`` or ``[N, K_r]`` (``b_layout='nk'``, or the
    transposed view ``w.T`` of a row-major ``[N, K_r]``), bfloat16 or float16, rows contiguous;
    K_r and N multiples of 8; M a multiple of the world size (uneven M raises ArgumentError).
    Partials travel in the input dtype; each output element is the fp32 sum of the W partials in
    rank order, rounded once: bitwise reproducible run to run. ``deterministic=False`` is accepted
    and currently takes the same (deterministic) path. ``comm_sms``: ``"auto"`` (default): the split search of
    :mod:`mkernel.split.search` picks the CTAs that reduce per shape from the calls' times, and inside each
    call the controller lends GEMM CTAs to the reduction when it falls behind; an integer pins them.
    ``path``: None (automatic: fused, or the GEMM engine + NCCL for small shapes on distinct GPUs,
    or a plain GEMM at world 1), 'fused', 'fallback', 'gemm' (world 1) or 'unfused' (the GEMM engine,
    then this op's own collective: the benchmarks' baseline for overlap). ``out``: optional
    ``[M / world, N]`` of the input dtype, outside the symmetric workspace. ``join``: the GEMM
    CTAs also reduce once their tiles are done (default: ``mkernel.config.get().tp_join_reduce``,
    "auto": not for this op).

    Between nodes (node-major ranks, at most 8 in all), hierarchically: each node first sums its
    ranks' partials of every block over NVLink, and only that node partial (rounded to the input
    dtype) crosses the network, once per block and node, through the communicator's proxy: each
    rank sends ``(nodes - 1) * M / world * N`` elements, the minimum (``comm.stats()`` counts
    them). The owner adds, in node order, its own node's partials in fp32 and the other nodes'
    node partials, and rounds once: still bitwise reproducible.
    """
    return gemm_reduce(OP, SPEC, KERNEL, False, a, b, comm=comm, out=out, stream=stream, b_layout=b_layout,
                       comm_sms=comm_sms, deterministic=deterministic, path=path, join=join)


def gemm_reduce(op, spec, kernel, allreduce, a, b, *, comm, out, stream, b_layout, comm_sms, deterministic, path,
                join=None):
    """The driver of both ops: check, plan, launch (a repeated call of the latency or fused path:
    its recorded launches)."""
    key = calls.call_key(comm, op, stream, (a, b, out), (b_layout, comm_sms, deterministic, path, join))
    if calls.replay(comm, key, stream):
        return out
    c = _check(op, allreduce, comm, a, b, out, stream, b_layout, comm_sms, deterministic, path, join)
    if c.path == "gemm":
        _gemm.gemm(c.a, c.b, out=c.out, stream=stream, b_layout="kn" if c.layout == tp.B_KN else "nk")
    elif c.path == "fallback":
        _fallback(allreduce, comm, c, stream)
    elif c.path == "latency":
        record = _latency(comm, c, stream)
        if record is not None:
            calls.record_call(comm, key, op, "latency", *record)
    else:
        _launch(op, spec, kernel, allreduce, comm, _plan(op, allreduce, comm, c), c, stream, key)
    return c.out


def _check(op, allreduce, comm, a, b, out, stream, b_layout, comm_sms, deterministic, path, join):
    """Typed errors before anything launches; the path, agreed by every rank."""
    tp.check_comm(op, comm)
    a, layout, b_arr, N = tp.check_inputs(op, a, b, b_layout, stream)
    M, K = a.shape
    W = comm.size
    chosen, reason = tp.choose_path(op, comm, path, rows=M, N=N, K=K)
    if M % W and chosen != "latency":
        raise ArgumentError(f"{op}: M = {M} rows must split evenly over {W} ranks (uneven M is not supported: "
                            f"pad A to a multiple of {W} rows)")
    if not isinstance(deterministic, bool):
        raise ArgumentError(f"{op}: deterministic must be True or False")
    join = tp.default_join(op, comm, M=M, N=N, K=K, esize=a.dtype.itemsize) if join is None else join
    if not isinstance(join, bool):
        raise ArgumentError(f"{op}: join must be None, True or False")
    comm_sms = tp.check_comm_sms(op, comm_sms)
    out = calls.prepare_out(op, out, (M, N) if allreduce else (M // W, N), a.dtype, comm)
    calls.agree_call(op, comm, (op, M, N, K, a.dtype.name, layout, join, chosen), reason)  # comm_sms may differ
    return tp.Call(a=a, b=b_arr, layout=layout, M=M, N=N, K=K, mb=M // W, out=out, path=chosen, comm_sms=comm_sms,
                   join=join)


def _fallback(allreduce, comm, c, stream):
    """The GEMM engine (tp.matmul), then NCCL (ranks on distinct GPUs)."""
    cupy = tp.cupy_mod()
    out = c.out
    with calls.on_stream(stream):
        partial = tp.matmul(c.a, c.b, c.layout)
        if comm.size == 1:
            out[...] = partial
            return
        dst = out if out.flags.c_contiguous else cupy.empty(out.shape, out.dtype)
        from cupy.cuda import nccl
        if allreduce:
            comm.nccl.allReduce(partial.data.ptr, dst.data.ptr, c.M * c.N, tp.nccl_dtype(c.a.dtype), nccl.NCCL_SUM,
                                calls.stream_ptr(stream))
        else:
            comm.nccl.reduceScatter(partial.data.ptr, dst.data.ptr, c.mb * c.N, tp.nccl_dtype(c.a.dtype),
                                    nccl.NCCL_SUM, calls.stream_ptr(stream))
        if dst is not out:
            out[...] = dst


def _latency(comm, c, stream):
    """gemm_allreduce at few rows. Fewest rows (B as [N, K]): the fused latency kernels
    (gemm_allreduce_ll). Else this rank's partial by mkernel.gemm (its decode path up to 32 rows) straight into
    its slot of the all-reduce's scratch (one- or two-shot), then the all-reduce into out (through a contiguous
    copy where out's rows are strided). Nothing allocated per call. Returns (launches, plans, keep)
    where the call was only launches (out contiguous and aligned), else None."""
    fused = _ll.eligible(c)
    comm.agree(("gemm_allreduce", "latency kernels", c.M, c.N, fused), fused)  # knobs may differ by rank
    if fused:
        return _ll.run(comm, c, stream)
    slot, finish, ar_key = _ar.own_slot(comm, (c.M, c.N), c.a.dtype)
    layout = "kn" if c.layout == tp.B_KN else "nk"
    _gemm.gemm(c.a, c.b, out=slot, stream=stream, b_layout=layout)
    if c.out.flags.c_contiguous and c.out.data.ptr % 16 == 0:
        reduce = finish(c.out, stream)
        kept = _gemm.kept_plan(c.a, c.b, slot, stream=stream, b_layout=layout)
        return None if kept is None else ((kept[1], reduce), (ar_key,), (kept[0],))
    dst = _latency_out(comm, c)
    finish(dst, stream)
    with calls.on_stream(stream):
        c.out[...] = dst
    return None


def _latency_out(comm, c):
    """The latency path's contiguous output where the caller's is strided: one buffer per
    communicator, grown to the largest call (this rank's own: out's strides may differ by rank)."""
    cupy = tp.cupy_mod()
    nbytes = c.M * c.N * c.a.dtype.itemsize
    buf = comm.plans.state.get("gemm_allreduce.latency out")
    if buf is None or buf.nbytes < nbytes:
        buf = comm.plans.state["gemm_allreduce.latency out"] = cupy.empty(nbytes, cupy.uint8)
    return buf[:nbytes].view(c.a.dtype).reshape(c.M, c.N)


def _plan(op, allreduce, comm, c):
    """(plan, launch template, plan key) of this shape: buffers per (M, N, dtype), shared by layouts and K."""
    W, L, nodes, dt = comm.size, comm.local_size, comm.num_nodes, c.a.dtype
    send = config.get().tp_send_tiles  # tiles per WRITE between nodes (part of the plan)
    tiles_blk = (-(-c.mb // tp.BM)) * (-(-c.N // tp.BN))
    # recv[sender lrank][block j]: this node's partials of the blocks j * L + lrank (all W at one node)
    sizes = [("recv", (L, nodes, c.mb, c.N), dt), ("rflag", (L * nodes * tiles_blk,), "uint32")]
    if allreduce:
        sizes += [("gath", (W, c.mb, c.N), dt), ("gflag", (W * tiles_blk,), "uint32")]
    if nodes > 1:  # compact tiles: node partials to send (by destination node; AR: the reduced own block
        # at this node's index) and received (by source node); AR: reduced tiles received
        tiles = (nodes, tiles_blk, tp.TILE_BYTES // 2)
        sizes += [("stage", tiles, dt), ("xrecv", tiles, dt)] + ([("xgath", tiles, dt)] if allreduce else [])
        sizes += [("xstaged", (tp.send_groups(tiles_blk, send),), "uint32")]
    plan_key = ("buffers", op, c.M, c.N, dt.name) + ((send,) if nodes > 1 else ())
    plan = tp.plan_buffers(op, comm, plan_key, sizes)
    build = lambda: _static_args(allreduce, comm, plan, c, tiles_blk, send)  # noqa: E731
    return plan, buffers.launch_template(plan, (c.K, c.layout, c.join, c.path), build), plan_key


def _static_args(allreduce, comm, plan, c, tiles_blk, send):
    args = tp.TpArgs()
    tp.fill_static(args, comm, a_rows=c.M, K=c.K, N=c.N, mb=c.mb, counters=plan["counters"])
    args.recv_off = comm.offset_of(plan["recv"])
    args.rflag_off = comm.offset_of(plan["rflag"])
    if allreduce:
        args.gath_off = comm.offset_of(plan["gath"])
        args.gflag_off = comm.offset_of(plan["gflag"])
    nodes, L, lr, esize = comm.num_nodes, comm.local_size, comm.local_rank, c.a.dtype.itemsize
    if nodes > 1:  # arrival counters of node partials (AR: and of reduced tiles)
        tp.plan_between_nodes(comm, plan, args, tiles_blk, kinds=2 if allreduce else 1, min_group=send)
        args.xstaged = plan["xstaged"].data.ptr
        args.stage_off = comm.offset_of(plan["stage"])
        args.xrecv_off = comm.offset_of(plan["xrecv"])
        if allreduce:
            args.xgath_off = comm.offset_of(plan["xgath"])
    for o in range(comm.size):  # block o's partial goes to rank o % L of this node, slot [lr][o // L]
        slot = comm.heap.peer_base[o % L] + args.recv_off + (lr * nodes + o // L) * c.mb * c.N * esize
        args.dst[o] = tp.out_map(c.a.dtype, slot, c.mb, c.N, c.N * esize)
    args.join = int(c.join)
    return args


def _launch(op, spec, kernel, allreduce, comm, planned, c, stream, key):
    """This call's operands into a copy of the template, the split, the launch (recorded under
    ``key`` on the fused path)."""
    plan, template, plan_key = planned
    W, nodes, esize = comm.size, comm.num_nodes, c.a.dtype.itemsize
    args = tp.call_args(template, c, a_ptr=c.a.data.ptr, a_row_bytes=row_stride(c.a))
    args.out = c.out.data.ptr
    args.ldo = row_stride(c.out) // esize
    if c.path == "unfused":  # the GEMM first; the kernel's GEMM CTAs then only move its tiles
        calls.quiesced_first_use(comm, plan, ("matmul", c.K, c.layout, c.a.strides, c.b.strides))  # cuBLAS may load one
        with calls.on_stream(stream):
            partial = tp.matmul(c.a, c.b, c.layout)
        args.partial, args.ldp = partial.data.ptr, row_stride(partial) // esize
    # Items of the communication CTAs: the node's reductions of this rank's blocks; AR also the
    # copies of the other local ranks' reduced blocks and the forwards of other nodes' ones.
    tiles_blk = args.tiles_mb * args.tiles_n
    comm_items = (W + nodes - 1 if allreduce else nodes) * tiles_blk
    joined_in_node = c.join and nodes == 1  # the joined CTAs take the reduction: start at 1, lend nothing
    n, token = tp.resolve_comm_sms(op, comm, c.comm_sms, c.path, M=c.M, N=c.N, K=c.K, esize=esize,
                                   comm_items=comm_items, joined_in_node=joined_in_node)
    gemm_ctas, comm_ctas = tp.grid_split(op, n, W * tiles_blk, comm_items, launch.grid_sms(comm, op))
    mode = tp.controller_mode(op, c.comm_sms, c.path, joined_in_node=joined_in_node)
    tp.set_split(args, plan, gemm_ctas, mode, comm)
    with autosplit.timed(token, stream):
        launched = tp.launch_fused(comm, op, spec, kernel, args, c.a.dtype, c.layout, gemm_ctas + comm_ctas, stream)
    if c.path == "fused":
        calls.record_call(comm, key, op, "fused", (launched,), (plan_key,), token=token,
                          on_replay=tp.remember_ctl(comm, plan))
