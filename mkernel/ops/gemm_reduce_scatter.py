"""``gemm_reduce_scatter(a, b, *, comm)``: rank r's row block of the sum over ranks of ``a_r @ b_r``,
computed by one fused kernel that reduces every output tile as soon as all its partials arrived
(design: docs/TP.md). Also the shared driver of ``gemm_allreduce`` (one mechanism, two ops).

Importable without CuPy; the kernels are registered with mkernel.compile at import.
"""

from mkernel.core import config
from mkernel.core.errors import ArgumentError
from mkernel.engines import gemm as _gemm
from mkernel.ops import tp
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
    :mod:`mkernel.autosplit` picks the CTAs that reduce per shape from the calls' times, and inside each
    call the controller lends GEMM CTAs to the reduction when it falls behind; an integer pins them.
    ``path``: None (automatic: fused, or cupy.matmul + NCCL for small shapes on distinct GPUs,
    or a plain GEMM at world 1), 'fused', 'fallback', 'gemm' (world 1) or 'unfused' (cupy.matmul,
    then this op's own collective: the benchmarks' baseline for overlap). ``out``: optional
    ``[M / world, N]`` of the input dtype, outside the symmetric workspace. ``join``: the GEMM
    CTAs also reduce once their tiles are done (default ``mkernel.config.get().tp_join_reduce``).

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
    cupy = tp.cupy_mod()
    tp.check_comm(op, comm)
    a, layout, b_arr, N = tp.check_inputs(op, a, b, b_layout, stream)
    M, K = a.shape
    W = comm.size
    if M % W:
        raise ArgumentError(f"{op}: M = {M} rows must split evenly over {W} ranks (uneven M is not supported: "
                            f"pad A to a multiple of {W} rows)")
    if not isinstance(deterministic, bool):
        raise ArgumentError(f"{op}: deterministic must be True or False")
    join = config.get().tp_join_reduce if join is None else join
    if not isinstance(join, bool):
        raise ArgumentError(f"{op}: join must be None, True or False")
    mb = M // W
    comm_sms = tp.check_comm_sms(op, comm_sms)
    out = tp.prepare_out(op, out, (M, N) if allreduce else (mb, N), a.dtype, comm)
    chosen, reason = tp.choose_path(op, comm, path, rows=M, N=N, K=K)
    key = (op, M, N, K, a.dtype.name, layout, join, chosen)  # comm_sms may differ by rank
    tp.agree_call(op, comm, key, reason)

    if chosen == "gemm":
        _gemm.gemm(a, b_arr, out=out, stream=stream, b_layout="kn" if layout == tp.B_KN else "nk")
        return out
    if chosen == "fallback":
        with tp.on_stream(stream):
            partial = tp.matmul(a, b_arr, layout)
            if W == 1:
                out[...] = partial
                return out
            dst = out if out.flags.c_contiguous else cupy.empty(out.shape, out.dtype)
            from cupy.cuda import nccl
            if allreduce:
                comm.nccl.allReduce(partial.data.ptr, dst.data.ptr, M * N, tp.nccl_dtype(a.dtype), nccl.NCCL_SUM,
                                    tp.stream_ptr(stream))
            else:
                comm.nccl.reduceScatter(partial.data.ptr, dst.data.ptr, mb * N, tp.nccl_dtype(a.dtype),
                                        nccl.NCCL_SUM, tp.stream_ptr(stream))
            if dst is not out:
                out[...] = dst
        return out

    tiles_blk = (-(-mb // tp.BM)) * (-(-N // tp.BN))
    L, nodes = comm.local_size, comm.num_nodes
    # recv[sender lrank][block j]: this node's partials of the blocks j * L + lrank (all W at one node)
    sizes = [("recv", (L, nodes, mb, N), a.dtype), ("rflag", (L * nodes * tiles_blk,), "uint32")]
    if allreduce:
        sizes += [("gath", (W, mb, N), a.dtype), ("gflag", (W * tiles_blk,), "uint32")]
    if nodes > 1:  # compact tiles: node partials to send (by destination node; AR: the reduced own block
        # at this node's index) and received (by source node); AR: reduced tiles received
        tiles = (nodes, tiles_blk, tp.TILE_BYTES // 2)
        sizes += [("stage", tiles, a.dtype), ("xrecv", tiles, a.dtype)] + (
            [("xgath", tiles, a.dtype)] if allreduce else [])
    plan = tp.plan_buffers(op, comm, ("buffers", op, M, N, a.dtype.name), sizes)  # shared by layouts
    args = tp.TpArgs()
    tp.fill_common(args, comm, op, a_ptr=a.data.ptr, a_rows=M, a_row_bytes=tp._row_stride(a), dtype=a.dtype,
                   b_arr=b_arr, layout=layout, K=K, N=N, mb=mb, counters=plan["counters"])
    esize = a.dtype.itemsize
    args.recv_off = comm.offset_of(plan["recv"])
    args.rflag_off = comm.offset_of(plan["rflag"])
    if allreduce:
        args.gath_off = comm.offset_of(plan["gath"])
        args.gflag_off = comm.offset_of(plan["gflag"])
    if nodes > 1:  # arrival counters of node partials (AR: and of reduced tiles)
        tp.plan_between_nodes(comm, plan, args, tiles_blk, kinds=2 if allreduce else 1)
        args.stage_off = comm.offset_of(plan["stage"])
        args.xrecv_off = comm.offset_of(plan["xrecv"])
        if allreduce:
            args.xgath_off = comm.offset_of(plan["xgath"])
    lr = comm.local_rank
    for o in range(W):  # block o's partial goes to rank o % L of this node, slot [lr][o // L]
        slot = comm.heap.peer_base[o % L] + args.recv_off + (lr * nodes + o // L) * mb * N * esize
        args.dst[o] = tp.out_map(a.dtype, slot, mb, N, N * esize)
    args.out = out.data.ptr
    args.ldo = tp._row_stride(out) // esize
    if chosen == "unfused":  # the GEMM first; the kernel's GEMM CTAs then only move its tiles
        tp.quiesced_first_use(comm, plan, ("matmul", K, layout, a.strides, b_arr.strides))  # cuBLAS may load a kernel
        with tp.on_stream(stream):
            partial = tp.matmul(a, b_arr, layout)
        args.partial, args.ldp = partial.data.ptr, tp._row_stride(partial) // esize
    # Items of the communication CTAs: the node's reductions of this rank's blocks; AR also the
    # copies of the other local ranks' reduced blocks and the forwards of other nodes' ones.
    comm_items = (W + nodes - 1 if allreduce else nodes) * tiles_blk
    n, token = tp.resolve_comm_sms(op, comm, comm_sms, chosen, M=M, N=N, K=K, esize=esize, comm_items=comm_items)
    gemm_ctas, comm_ctas = tp.grid_split(op, n, W * tiles_blk, comm_items, tp.sm_count())
    tp.set_split(args, plan, gemm_ctas, tp.controller_mode(op, comm_sms, chosen), comm)
    args.join = int(join)
    with autosplit.timed(token, stream):
        tp.launch_fused(comm, op, spec, kernel, args, a.dtype, layout, gemm_ctas + comm_ctas, stream)
    return out
