"""``allgather_gemm(a, b, *, comm)``: (every rank's row shard of A, stacked in rank order) ``@ b``, by
one fused kernel whose communication CTAs push this rank's shard to every peer in chunks of 128
rows while the GEMM runs on the chunks that have arrived (design: docs/TP.md). Importable
without CuPy; the kernels are registered at import.
"""

from mkernel.core.errors import ArgumentError
from mkernel.engines import gemm as _gemm
from mkernel.ops import tp
from mkernel.split import search as autosplit

OP = "allgather_gemm"
KERNEL = "mk_allgather_gemm_kernel"
SPEC = tp.register(OP, "allgather_gemm.cu", KERNEL)


def allgather_gemm(a, b, *, comm, out=None, stream=None, return_gathered=False, b_layout=None, comm_sms=None,
                   path=None):
    """``[M, N_r]`` = (the shards of all ranks stacked in rank order) ``@ b``.

    a: this rank's row shard ``[M / world, K]`` (the same shape on every rank: uneven shards
    raise ArgumentError); b: ``[K, N_r]`` or ``[N_r, K]`` (``b_layout='nk'`` or a ``w.T`` view);
    bfloat16 or float16, K and N_r multiples of 8. ``return_gathered=True`` also returns the
    gathered A ``[M, K]`` (a fresh array). ``comm_sms``: CTAs that push A, ``"auto"`` by default, or an integer
    (:mod:`mkernel.autosplit`). ``path``:
    as :func:`mkernel.gemm_reduce_scatter`.

    Between nodes, hierarchically: each shard crosses the network once per other node (to the rank
    with the same local index there, which passes it on to its node's peers over NVLink): each
    rank sends ``(nodes - 1) * M / world * K`` elements, the minimum.
    """
    cupy = tp.cupy_mod()
    tp.check_comm(OP, comm)
    a, layout, b_arr, N = tp.check_inputs(OP, a, b, b_layout, stream)
    mb, K = a.shape
    W = comm.size
    M = mb * W
    comm_sms = tp.check_comm_sms(OP, comm_sms)
    if not isinstance(return_gathered, bool):
        raise ArgumentError(f"{OP}: return_gathered must be True or False")
    out = tp.prepare_out(OP, out, (M, N), a.dtype, comm)
    chosen, reason = tp.choose_path(OP, comm, path, rows=M, N=N, K=K)
    key = (OP, mb, N, K, a.dtype.name, layout, chosen)  # same shard shape; comm_sms may differ by rank
    tp.agree_call(OP, comm, key, reason)

    if chosen == "gemm":
        _gemm.gemm(a, b_arr, out=out, stream=stream, b_layout="kn" if layout == tp.B_KN else "nk")
        return (out, a) if return_gathered else out
    if chosen == "fallback":
        with tp.on_stream(stream):
            if W == 1:
                gathered = a
            else:
                src = a if a.flags.c_contiguous else cupy.ascontiguousarray(a)
                gathered = cupy.empty((M, K), dtype=a.dtype)
                comm.nccl.allGather(src.data.ptr, gathered.data.ptr, mb * K, tp.nccl_dtype(a.dtype),
                                    tp.stream_ptr(stream))
            out[...] = tp.matmul(gathered, b_arr, layout)
        return (out, gathered) if return_gathered else out

    tiles_mb = -(-mb // tp.BM)
    sizes = [("ga", (M, K), a.dtype), ("aflag", (W * tiles_mb,), "uint32")]
    plan = tp.plan_buffers(OP, comm, ("buffers", OP, mb, K, a.dtype.name), sizes)  # shared by N, layouts
    args = tp.TpArgs()
    esize = a.dtype.itemsize
    tiles_blk = tp.fill_common(args, comm, OP, a_ptr=plan["ga"].data.ptr, a_rows=M, a_row_bytes=K * esize,
                               dtype=a.dtype, b_arr=b_arr, layout=layout, K=K, N=N, mb=mb,
                               counters=plan["counters"])
    args.ga_off = comm.offset_of(plan["ga"])
    args.aflag_off = comm.offset_of(plan["aflag"])
    args.a_local = a.data.ptr
    args.lda = tp._row_stride(a) // esize
    L, nodes = comm.local_size, comm.num_nodes
    if nodes > 1:  # arrival counters of the chunks that come through the proxy
        tp.plan_between_nodes(comm, plan, args, tiles_mb)
    if chosen == "unfused" and tp.quiesced_first_use(comm, plan, ("matmul", N, layout, b_arr.strides, out.strides)):
        with tp.on_stream(stream):  # cuBLAS loads its kernel for this shape now, not behind the gather
            tp.matmul(plan["ga"], b_arr, layout, out=out)
    ldo_bytes = tp._row_stride(out)
    for o in range(W):
        args.dst[o] = tp.out_map(a.dtype, out.data.ptr + o * mb * ldo_bytes, mb, N, ldo_bytes)
    args.out = out.data.ptr
    args.ldo = ldo_bytes // esize
    n, token = tp.resolve_comm_sms(OP, comm, comm_sms, chosen, M=M, N=N, K=K, esize=esize,
                                   comm_items=(L + nodes - 1) * tiles_mb)
    gemm_ctas, comm_ctas = tp.grid_split(OP, n, W * tiles_blk, (L + nodes - 1) * tiles_mb, tp.sm_count())
    if chosen == "unfused":  # the kernel only gathers; the GEMM follows it
        gemm_ctas = 0
    tp.set_split(args, plan, gemm_ctas, tp.controller_mode(OP, comm_sms, chosen), comm)
    with autosplit.timed(token, stream):
        tp.launch_fused(comm, OP, SPEC, KERNEL, args, a.dtype, layout, gemm_ctas + comm_ctas, stream)
    if chosen == "unfused":
        with tp.on_stream(stream):
            tp.matmul(plan["ga"], b_arr, layout, out=out)
    if return_gathered:  # a memcpy, not CuPy's copy kernel (whose first use would load a module)
        gathered = cupy.empty_like(plan["ga"])
        gathered.data.copy_from_device_async(plan["ga"].data, gathered.nbytes, stream)
        return out, gathered
    return out
