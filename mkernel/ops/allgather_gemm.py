"""``allgather_gemm(a, b, *, comm)``: (every rank's row shard of A, stacked in rank order) ``@ b``, by
one fused kernel whose communication CTAs push this rank's shard to every peer in chunks of 128
rows while the GEMM runs on the chunks that have arrived (design: docs/TP.md). Importable
without CuPy; the kernels are registered at import.
"""

from mkernel.core import config
from mkernel.core.errors import ArgumentError
from mkernel.engines import gemm as _gemm
from mkernel.ops import buffers, calls, tp
from mkernel.runtime import launch
from mkernel.runtime.arrays import row_stride
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
    (:mod:`mkernel.split.search`). ``path``:
    as :func:`mkernel.gemm_reduce_scatter`.

    Between nodes, hierarchically: each shard crosses the network once per other node (to the rank
    with the same local index there, which passes it on to its node's peers over NVLink): each
    rank sends ``(nodes - 1) * M / world * K`` elements, the minimum.
    """
    key = None if return_gathered else calls.call_key(comm, OP, stream, (a, b, out), (b_layout, comm_sms, path))
    if calls.replay(comm, key, stream):  # a repeated fused call: its recorded launch
        return out
    c = _check(comm, a, b, out, stream, b_layout, comm_sms, path, return_gathered)
    if c.path == "gemm":
        _gemm.gemm(c.a, c.b, out=c.out, stream=stream, b_layout="kn" if c.layout == tp.B_KN else "nk")
        return (c.out, c.a) if return_gathered else c.out
    if c.path == "fallback":
        gathered = _fallback(comm, c, stream)
        return (c.out, gathered) if return_gathered else c.out
    plan, template, plan_key = _plan(comm, c)
    _launch(comm, plan, template, c, stream, (key, plan_key))
    if return_gathered:  # a memcpy, not CuPy's copy kernel (whose first use would load a module)
        gathered = tp.cupy_mod().empty_like(plan["ga"])
        gathered.data.copy_from_device_async(plan["ga"].data, gathered.nbytes, stream)
        return c.out, gathered
    return c.out


def _check(comm, a, b, out, stream, b_layout, comm_sms, path, return_gathered):
    """Typed errors before anything launches; the path, agreed by every rank."""
    tp.check_comm(OP, comm)
    a, layout, b_arr, N = tp.check_inputs(OP, a, b, b_layout, stream)
    mb, K = a.shape
    M = mb * comm.size
    comm_sms = tp.check_comm_sms(OP, comm_sms)
    if not isinstance(return_gathered, bool):
        raise ArgumentError(f"{OP}: return_gathered must be True or False")
    out = calls.prepare_out(OP, out, (M, N), a.dtype, comm)
    chosen, reason = tp.choose_path(OP, comm, path, rows=M, N=N, K=K)
    calls.agree_call(OP, comm, (OP, mb, N, K, a.dtype.name, layout, chosen), reason)  # comm_sms may differ
    return tp.Call(a=a, b=b_arr, layout=layout, M=M, N=N, K=K, mb=mb, out=out, path=chosen, comm_sms=comm_sms,
                   join=False)


def _fallback(comm, c, stream):
    """NCCL's all-gather, then the GEMM engine (ranks on distinct GPUs); returns the gathered A."""
    cupy = tp.cupy_mod()
    with calls.on_stream(stream):
        if comm.size == 1:
            gathered = c.a
        else:
            src = c.a if c.a.flags.c_contiguous else cupy.ascontiguousarray(c.a)
            gathered = cupy.empty((c.M, c.K), dtype=c.a.dtype)
            comm.nccl.allGather(src.data.ptr, gathered.data.ptr, c.mb * c.K, tp.nccl_dtype(c.a.dtype),
                                calls.stream_ptr(stream))
        c.out[...] = tp.matmul(gathered, c.b, c.layout)
    return gathered


def _plan(comm, c):
    """(plan, launch template, plan key): buffers per (shard rows, K, dtype), shared by N and layouts."""
    tiles_mb = -(-c.mb // tp.BM)
    sizes = [("ga", (c.M, c.K), c.a.dtype), ("aflag", (comm.size * tiles_mb,), "uint32")]
    plan_key = ("buffers", OP, c.mb, c.K, c.a.dtype.name)
    plan = tp.plan_buffers(OP, comm, plan_key, sizes)

    def build():
        args = tp.TpArgs()
        tp.fill_static(args, comm, a_rows=c.M, K=c.K, N=c.N, mb=c.mb, counters=plan["counters"])
        args.ga_off = comm.offset_of(plan["ga"])
        args.aflag_off = comm.offset_of(plan["aflag"])
        if comm.num_nodes > 1:  # arrival counters of the chunks that come through the proxy
            tp.plan_between_nodes(comm, plan, args, tiles_mb)
        return args
    return plan, buffers.launch_template(plan, (c.N, c.layout, c.path), build), plan_key


def _launch(comm, plan, template, c, stream, keys):
    """This call's operands into a copy of the template, the split, the launch (unfused: the
    gather, then the GEMM engine; fused: its copy and launch recorded under keys' call key)."""
    W, L, nodes = comm.size, comm.local_size, comm.num_nodes
    esize = c.a.dtype.itemsize
    ga = plan["ga"]
    args = tp.call_args(template, c, a_ptr=ga.data.ptr, a_row_bytes=c.K * esize)  # the GEMM reads the gathered A
    args.a_local = c.a.data.ptr
    args.lda = row_stride(c.a) // esize
    out = c.out
    loads = ("matmul", c.N, c.layout, c.b.strides, out.strides)
    if c.path == "unfused" and calls.quiesced_first_use(comm, plan, loads):
        with calls.on_stream(stream):  # cuBLAS loads its kernel for this shape now, not behind the gather
            tp.matmul(ga, c.b, c.layout, out=out)
    ldo_bytes = row_stride(out)
    dst = buffers.operand_map(template, "out", (out.data.ptr, ldo_bytes), lambda: [
        tp.out_map(c.a.dtype, out.data.ptr + o * c.mb * ldo_bytes, c.mb, c.N, ldo_bytes) for o in range(W)])
    for o in range(W):
        args.dst[o] = dst[o]
    args.out = out.data.ptr
    args.ldo = ldo_bytes // esize
    tiles_mb = args.tiles_mb
    comm_items = (L + nodes - 1) * tiles_mb
    n, token = tp.resolve_comm_sms(OP, comm, c.comm_sms, c.path, M=c.M, N=c.N, K=c.K, esize=esize,
                                   comm_items=comm_items)
    gemm_ctas, comm_ctas = tp.grid_split(OP, n, W * tiles_mb * args.tiles_n, comm_items, launch.grid_sms(comm, OP))
    if c.path == "unfused":  # the kernel only gathers; the GEMM follows it
        gemm_ctas = 0
    tp.set_split(args, plan, gemm_ctas, tp.controller_mode(OP, c.comm_sms, c.path), comm)
    args.own_copied = int(config.get().tp_ag_copy_first)
    args.join = int(config.get().tp_ag_join_gemm and gemm_ctas > 0)
    launches = ()
    with autosplit.timed(token, stream):
        if args.own_copied:  # the shard into this rank's own gathered rows (a copy, no kernel: no module load)
            launches = (calls.copy_rows(ga.data.ptr + comm.rank * c.mb * c.K * esize, c.K * esize, c.a, c.mb,
                                     c.K * esize, stream),)
        launches += (tp.launch_fused(comm, OP, SPEC, KERNEL, args, c.a.dtype, c.layout, gemm_ctas + comm_ctas,
                                     stream),)
    if c.path == "fused":
        calls.record_call(comm, keys[0], OP, "fused", launches, (keys[1],), token=token,
                          on_replay=tp.remember_ctl(comm, plan))
    if c.path == "unfused":
        with calls.on_stream(stream):
            tp.matmul(ga, c.b, c.layout, out=out)
