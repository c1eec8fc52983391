#!/usr/bin/env python3
"""Fused tensor-parallel ops against their baselines, side by side in one run.

Shapes are the GEMM each rank computes, [M, N, K]: GEMM+RS / GEMM+AR: K is the rank's K_r;
AllGather+GEMM: M is the gathered row count and N the rank's N_r (issues 5 and 7).

Inside a node (issue 5; ``mpirun -n <gpus>``, one GPU per rank):
- mkernel: the fused kernel (path='fused');
- baseline: cupy.matmul then the cupy.cuda.nccl collective on the same stream;
- chunked: the hand-written overlap: the GEMM in 4 row chunks, each chunk's collective on a second
  stream as soon as the chunk is done (A's rows permuted chunk-major beforehand, outside timing);
- bound: max(cuBLAS time of this rank's GEMM, bytes each GPU sends / the two-way exchange rate
  measured in this run with NCCL send/recv between all pairs).

Between nodes (issue 7; ``--nodes N``: gpus_per_node = world / N, ``--transport``, default host):
- mkernel: the fused kernel, hierarchical;
- baseline: mkernel's unfused path over the same transport (path='unfused': cupy.matmul, then the
  op's own hierarchical collective), which isolates overlap;
- nccl: cupy.matmul then NCCL (its shared-memory or socket transport between the emulated nodes);
- bound: max(cuBLAS GEMM, the unfused run's collective: unfused minus GEMM).

    mpirun -n 2 python3 bench/tp.py --op all [--nodes 2] [--quick] [--out DIR]

Ranks sharing GPUs (under MPS: ``source tools/mps.sh; mps_start; CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
mpirun -n 2 --bind-to none -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE ...``; issue 25): NCCL cannot run,
so the baseline is the op's unfused path, timed by bench/mps_timing.py's rule, each row with
compute_ms, link_ms, path, sms_per_rank and mps; bench/results/<op>-<N>rank-mps[-<nodes>node].json.

Writes bench/results/<op>-<gpus>gpu[-<nodes>node].json per op (bench/harness.py; speedup =
baseline / mkernel, each row with its goal and whether it met it, and the max |error| against
float64 on 64 sampled rows for mkernel and the baseline) and, inside a node, a PNG of speedup
against size.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

import harness  # noqa: E402

OPS = ("gemm_reduce_scatter", "gemm_allreduce", "allgather_gemm")
# ((M, N, K) per rank, goal over the baseline): issue 5's table (one node) and its AR sweep
# (N = M, K = M / 16, at least 1.0x at every size; 32768 is in the table)
ONE_NODE = {
    "gemm_allreduce": [((8192, 8192, 4096), 1.40), ((16384, 16384, 1024), 1.35), ((32768, 32768, 2048), 1.50)]
    + [((m, m, m // 16), 1.0) for m in (4096, 8192, 16384)],
    "gemm_reduce_scatter": [((8192, 8192, 4096), 1.30), ((16384, 16384, 1024), 1.70)],
    "allgather_gemm": [((8192, 4096, 8192), 1.20), ((8192, 14336, 8192), 1.0)],
}
# issue 7's table (2 emulated nodes x 1 GPU over the host transport; baseline: the unfused path)
BETWEEN_NODES = {
    "gemm_allreduce": [((8192, 8192, 14336), 1.6), ((8192, 8192, 4096), 1.2)],
    "gemm_reduce_scatter": [((8192, 8192, 14336), 1.3)],
    "allgather_gemm": [((8192, 14336, 8192), 1.3)],
}
QUICK = [((4096, 4096, 1024), None)]
SAMPLE_ROWS = 64
AUTO_WARMUP = 20  # default calls before timing: comm_sms="auto" searches its split over the first ~10


def _f64(x):
    return harness.as_float(x, "float64")


def _nccl_dt(dt):
    from cupy.cuda import nccl
    return nccl.NCCL_BFLOAT16 if dt.name == "bfloat16" else nccl.NCCL_FLOAT16


def exchange_rate_gbs(comm, nbytes=256 << 20):
    """Bytes per second each GPU sends while every pair exchanges at once (NCCL send/recv)."""
    import cupy
    from cupy.cuda import nccl

    send = cupy.empty(nbytes, dtype=cupy.uint8)
    recv = [cupy.empty(nbytes, dtype=cupy.uint8) for _ in range(comm.size)]
    s = cupy.cuda.get_current_stream().ptr

    def run():
        nccl.groupStart()
        for p in range(comm.size):
            if p != comm.rank:
                comm.nccl.send(send.data.ptr, nbytes, nccl.NCCL_UINT8, p, s)
                comm.nccl.recv(recv[p].data.ptr, nbytes, nccl.NCCL_UINT8, p, s)
        nccl.groupEnd()

    ms = harness.median(harness.time_ms(run, reps=10))
    ms = comm.mpi.allreduce(ms, op=_max())
    return nbytes * (comm.size - 1) / (ms * 1e-3) / 1e9


def _network_bytes(comm):
    """Bytes this rank's proxy has sent so far (0 inside one node: no proxy)."""
    return sum(p["bytes_sent"] for p in comm.stats().get("peers", {}).values())


def _max():
    from mpi4py import MPI
    return MPI.MAX


def setup(op, comm, M, N, K, dt, comm_sms="auto"):
    """This rank's inputs and the three callables (mkernel, baseline, chunked); ``comm_sms`` that
    of the default call."""
    import cupy
    from cupy.cuda import nccl

    import mkernel

    W, r = comm.size, comm.rank
    s2 = cupy.cuda.Stream(non_blocking=True)
    main = cupy.cuda.get_current_stream()
    if op == "allgather_gemm":
        mb, Nr = M // W, N
        a = harness.rand((mb, K), 100 + r, dt)
        b = harness.rand((K, Nr), 200 + r, dt)
        out = cupy.empty((M, Nr), dt)
        gath = cupy.empty((M, K), dt)
        fused = lambda: mkernel.allgather_gemm(a, b, comm=comm, out=out, path="fused")  # noqa: E731

        def base():
            comm.nccl.allGather(a.data.ptr, gath.data.ptr, mb * K, _nccl_dt(dt), main.ptr)
            cupy.matmul(gath, b, out=out)

        q = mb // 4
        pieces = [a[c * q:(c + 1) * q] for c in range(4)]  # row slices: contiguous
        pg = [cupy.empty((W * q, K), dt) for _ in range(4)]
        evs = [cupy.cuda.Event() for _ in range(4)]

        def chunked():  # gather piece c on s2 while piece c-1 multiplies on the main stream
            start = cupy.cuda.Event()
            start.record(main)
            s2.wait_event(start)
            for c in range(4):
                comm.nccl.allGather(pieces[c].data.ptr, pg[c].data.ptr, q * K, _nccl_dt(dt), s2.ptr)
                evs[c].record(s2)
            for c in range(4):
                main.wait_event(evs[c])
                cupy.matmul(pg[c], b, out=out[c * W * q:(c + 1) * W * q])

        gemm_only = lambda: cupy.matmul(gath, b, out=out)  # noqa: E731
        unfused = lambda: mkernel.allgather_gemm(a, b, comm=comm, out=out, path="unfused")  # noqa: E731
        default = lambda: mkernel.allgather_gemm(a, b, comm=comm, out=out, comm_sms=comm_sms)  # noqa: E731
        sent = (W - 1) * mb * K * dt.itemsize
        return dict(fused=fused, base=base, chunked=chunked, gemm=gemm_only, unfused=unfused, default=default,
                    sent=sent, out=out,
                    ref=lambda rows: _ag_ref(comm, rows, M, K, Nr, dt))
    Kr = K
    a = harness.rand((M, Kr), 300 + r, dt)
    b = harness.rand((Kr, N), 400 + r, dt)
    ar = op == "gemm_allreduce"
    mb = M // W
    out = cupy.empty((M, N) if ar else (mb, N), dt)
    partial = cupy.empty((M, N), dt)
    fn = mkernel.gemm_allreduce if ar else mkernel.gemm_reduce_scatter
    fused = lambda: fn(a, b, comm=comm, out=out, path="fused")  # noqa: E731

    def coll(src, dst, count, stream):
        if ar:
            comm.nccl.allReduce(src, dst, count, _nccl_dt(dt), nccl.NCCL_SUM, stream)
        else:
            comm.nccl.reduceScatter(src, dst, count, _nccl_dt(dt), nccl.NCCL_SUM, stream)

    def base():
        cupy.matmul(a, b, out=partial)
        coll(partial.data.ptr, out.data.ptr, M * N if ar else mb * N, main.ptr)

    # Chunk c = quarter c of every rank's row block (chunk-major permutation of A's rows), so that
    # each chunk's collective leaves rank r's quarter c of its block in place.
    q = mb // 4
    perm = cupy.arange(M).reshape(W, 4, q).transpose(1, 0, 2).reshape(-1)
    a_perm = harness.take_rows(a, perm)
    parts = [cupy.empty((W * q, N), dt) for _ in range(4)]
    outs = [cupy.empty((W * q, N) if ar else (q, N), dt) for _ in range(4)]
    evs = [cupy.cuda.Event() for _ in range(4)]

    def chunked():
        for c in range(4):
            cupy.matmul(a_perm[c * W * q:(c + 1) * W * q], b, out=parts[c])
            evs[c].record(main)
            s2.wait_event(evs[c])
            coll(parts[c].data.ptr, outs[c].data.ptr, W * q * N if ar else q * N, s2.ptr)
        done = cupy.cuda.Event()
        done.record(s2)
        main.wait_event(done)

    gemm_only = lambda: cupy.matmul(a, b, out=partial)  # noqa: E731
    unfused = lambda: fn(a, b, comm=comm, out=out, path="unfused")  # noqa: E731
    default = lambda: fn(a, b, comm=comm, out=out, comm_sms=comm_sms)  # noqa: E731
    sent = (2 if ar else 1) * (W - 1) * mb * N * dt.itemsize
    return dict(fused=fused, base=base, chunked=chunked, gemm=gemm_only, unfused=unfused, default=default,
                sent=sent, out=out,
                ref=lambda rows: _rs_ref(comm, rows, M, Kr, N, dt, ar))


def _rs_ref(comm, rows, M, Kr, N, dt, ar):
    """float64 rows of the sum (rows: indices into this rank's output)."""
    import cupy
    mb = M // comm.size
    g_rows = rows if ar else rows + comm.rank * mb
    acc = cupy.zeros((len(rows), N), cupy.float64)
    for p in range(comm.size):
        a = _f64(harness.take_rows(harness.rand((M, Kr), 300 + p, dt), g_rows))
        acc += a @ _f64(harness.rand((Kr, N), 400 + p, dt))
    return acc


def _ag_ref(comm, rows, M, K, Nr, dt):
    import cupy
    mb = M // comm.size
    a_full = cupy.concatenate([harness.rand((mb, K), 100 + p, dt).view(cupy.uint16) for p in range(comm.size)]).view(dt)
    return _f64(harness.take_rows(a_full, rows)) @ _f64(harness.rand((K, Nr), 200 + comm.rank, dt))


def max_err(out, ref_fn, rows):
    import cupy
    return float(cupy.abs(_f64(harness.take_rows(out, rows)) - ref_fn(rows)).max())


def checked_calls(comm, op, f, mine, baseline):
    """One call of f[mine] then one of f[baseline], each synchronised and checked on 64 sampled
    rows: (this rank's bytes across the network in mine's call, the path mine took, max error of
    mine, of baseline)."""
    import cupy

    rows = cupy.asarray(np.sort(np.random.default_rng(0).choice(f["out"].shape[0], SAMPLE_ROWS, replace=False)))
    errs, network, path = [], None, None
    for name in (mine, baseline):
        sent0 = _network_bytes(comm)
        f[name]()
        cupy.cuda.get_current_stream().synchronize()
        comm.check()
        if network is None:
            network, path = _network_bytes(comm) - sent0, comm.plans.state["tp.last_path"][op]
        errs.append(max_err(f["out"], f["ref"], rows))
    return network, path, errs[0], errs[1]


def bench_op(op, comm, shapes, dt, rate_gbs):
    """Rows of one op. One node: baseline cuBLAS + NCCL, the chunked overlap beside, the bound from
    the exchange rate. Between nodes (rate_gbs None): baseline the unfused path over the same
    transport, cuBLAS + NCCL beside, the bound from the unfused run's collective."""

    nodes = comm.num_nodes
    rows_out = []
    for (M, N, K), goal in shapes:
        f = setup(op, comm, M, N, K, dt)
        baseline = "base" if nodes == 1 else "unfused"
        network, _, err_mk, err_base = checked_calls(comm, op, f, "fused", baseline)
        t = {}
        for name in ("fused", baseline, "base" if nodes > 1 else "chunked", "gemm"):  # interleaved per shape
            comm.mpi.Barrier()
            t[name] = comm.mpi.allreduce(harness.median(harness.time_ms(f[name])), op=_max())
        if nodes == 1:
            wire_ms = f["sent"] / (rate_gbs * 1e9) * 1e3
            extra = dict(chunked_ms=t["chunked"], speedup_vs_chunked=t["chunked"] / t["fused"], wire_ms=wire_ms,
                         bytes_sent_per_gpu=f["sent"])
        else:
            wire_ms = max(0.0, t["unfused"] - t["gemm"])  # the unfused run's collective over the transport
            extra = dict(nccl_ms=t["base"], speedup_vs_nccl=t["base"] / t["fused"], collective_ms=wire_ms,
                         network_bytes_per_rank=network,  # measured (comm.stats)
                         network_bytes_minimum=f["sent"] * (nodes - 1) // (comm.size - 1))
        bound = max(t["gemm"], wire_ms)
        speedup = t[baseline] / t["fused"]
        rows_out.append(harness.row((M, N, K), t["fused"], t[baseline], bound, cublas_gemm_ms=t["gemm"], goal=goal,
                                    meets_goal=None if goal is None else speedup >= goal, max_err_mkernel=err_mk,
                                    max_err_baseline=err_base, dtype=dt.name, baseline=(
                                        "cupy.matmul + NCCL" if nodes == 1 else "mkernel unfused, same transport"),
                                    **extra))
        del f
        comm.release_plans()  # every rank, same point: the next shape's buffers fit
    return rows_out


def bench_op_shared(op, comm, shapes, dt, barrier, link_gbs, comm_sms="auto"):
    """Rows of one op with ranks sharing GPUs (MPS; NCCL cannot run): the default call against the
    op's unfused path (cupy.matmul, then mkernel's own collective over the same transport), timed by
    bench/mps_timing.py's rule; compute_ms the GEMM with every rank computing at once, link_ms the
    fewest bytes a rank sends per direction over the link rate measured in this run."""
    import mps_timing as cc

    from mkernel.ops import tp as _tp

    W, nodes = comm.size, comm.num_nodes
    rows_out = []
    for (M, N, K), goal in shapes:
        f = setup(op, comm, M, N, K, dt, comm_sms)
        network, path, err_mk, err_base = checked_calls(comm, op, f, "default", "unfused")
        t = {"default": cc.batch_ms(comm, barrier, f["default"], warmup=AUTO_WARMUP)}
        split = _tp.controller_stats(comm) if path == "fused" else {}  # the timed batch's last launch
        t.update({name: cc.batch_ms(comm, barrier, f[name]) for name in ("unfused", "gemm")})
        variants = {}  # the default call with knobs changed, interleaved with the default (A/B in the same run)
        if path == "fused":
            import mkernel

            cfg = mkernel.config.get()
            changes = [{"comm_staged": not cfg.comm_staged}, cc.full_share_change(comm, op)]
            if op == "allgather_gemm":
                changes.append({"tp_ag_copy_first": not cfg.tp_ag_copy_first})
                changes.append({"tp_ag_join_gemm": not cfg.tp_ag_join_gemm})
            else:  # join flipped from what this call resolved ("auto"); joined with the staging flipped
                joins = _tp.default_join(op, comm, M=M, N=N, K=K, esize=dt.itemsize)
                changes.append({"tp_join_reduce": not joins})
                changes.append({"tp_join_reduce": True, "tp_join_staged": not (joins and cfg.tp_join_staged)})
                if nodes > 1:  # larger WRITEs between nodes (the host transport's rate grows with them)
                    changes += [{"tp_send_tiles": 2 * cfg.tp_send_tiles}, {"tp_send_tiles": 4 * cfg.tp_send_tiles}]
            arms = [("default", f["default"], {})] + [(",".join(f"{k}={v}" for k, v in c.items()), f["default"], c)
                                                      for c in changes]
            variants = cc.interleaved_ms(comm, barrier, arms, warmup=AUTO_WARMUP)
            if comm.rank == 0:
                print(f"   {M}x{N}x{K}: default {t['default']:.3f} ms alone; interleaved: " +
                      ", ".join(f"{k} {v:.3f} ms" for k, v in variants.items()), flush=True)
        minimum = f["sent"] if nodes == 1 else f["sent"] * (nodes - 1) // (W - 1)  # per rank, per direction
        link_ms = minimum / (link_gbs * 1e9) * 1e3
        bound = max(t["gemm"], link_ms)
        speedup = t["unfused"] / t["default"]
        if nodes == 1:
            goal, met = 0.98, speedup >= 0.98
        else:
            goal = 0.80 if comm.local_size == 1 else 0.70
            met = speedup >= 1.0 and bound / t["default"] >= goal
        rows_out.append(harness.row(
            (M, N, K), t["default"], t["unfused"], bound, compute_ms=t["gemm"], link_ms=link_ms, path=path,
            sms_per_rank=cc.sms_per_rank(), mps=True, link_GBps=link_gbs, bytes_per_direction=minimum,
            comm_sms=comm_sms, comm_ctas=split.get("comm_ctas"), lent_peak=split.get("lent_peak"), variants_ms=variants,
            network_bytes_per_rank=network if nodes > 1 else None, max_err_mkernel=err_mk, max_err_baseline=err_base,
            dtype=dt.name, baseline="mkernel unfused: cupy.matmul, then mkernel's collective",
            goal=(f"speedup >= {goal}" if nodes == 1 else f"fraction_of_bound >= {goal}, speedup >= 1.0"),
            meets_goal=bool(met)))
        del f
    return rows_out


def plot(op, rows, path, shared=False):
    """Against the GEMM's size: speedup over the baseline and over the chunked overlap, the goals
    marked (one node, GPUs of their own); or, ranks sharing GPUs, the fraction of the bound of
    mkernel and of the unfused baseline."""
    plt = harness.pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    flops = [2.0 * r["shape"][0] * r["shape"][1] * r["shape"][2] for r in rows]
    order = sorted(range(len(rows)), key=flops.__getitem__)
    xs = [flops[i] for i in order]
    if shared:
        curves = [("fraction_of_bound", "mkernel"), (None, "unfused")]
        ylabel, title = "fraction of bound", f"{op} (ranks sharing a GPU, MPS)"
    else:
        curves = [("speedup", "mkernel / baseline"), ("speedup_vs_chunked", "mkernel / chunked overlap")]
        ylabel, title = "speedup", op
    for (key, label), style in zip(curves, ("o-", "s--")):
        ys = [rows[i][key] if key else rows[i]["bound_ms"] / rows[i]["baseline_ms"] for i in order]
        ax.plot(xs, ys, style, label=label)
    if not shared:
        ax.scatter([flops[i] for i in order if rows[i]["goal"]], [rows[i]["goal"] for i in order if rows[i]["goal"]],
                   marker="_", s=200, color="k", label="goal")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("GEMM FLOPs per rank")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    return harness.save_plot(fig, path)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", choices=OPS + ("all",), default="all")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--nodes", type=int, default=1, help="emulated nodes (gpus_per_node = world / nodes)")
    p.add_argument("--transport", default="host", help="between nodes: host, tcp or verbs")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--out", default=None, help="results directory (default bench/results)")
    p.add_argument("--shapes", default=None, help="per-rank shapes MxNxK,... in place of the table (every op given)")
    p.add_argument("--comm-sms", default="auto", help="ranks sharing GPUs: the default call's comm_sms")
    p.add_argument("--controller", default=None, help="config.tp_controller for the run (auto, always, pattern, off)")
    args = p.parse_args()
    import ml_dtypes
    from mpi4py import MPI

    import mkernel

    if args.controller:
        mkernel.config.configure(tp_controller=args.controller)
    comm_sms = args.comm_sms if args.comm_sms == "auto" else int(args.comm_sms)
    W = MPI.COMM_WORLD.size
    if args.nodes < 1 or W % args.nodes:
        raise SystemExit(f"--nodes {args.nodes} must divide the world size {W}")
    comm = mkernel.init(workspace_bytes=6 << 30, gpus_per_node=W // args.nodes if args.nodes > 1 else None,
                        transport=args.transport if args.nodes > 1 else "auto")
    dt = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype(np.float16)
    try:  # the baseline is cupy.matmul: fall back to float16 where CuPy has no bfloat16 matmul
        import cupy
        cupy.matmul(harness.rand((16, 16), 0, dt), harness.rand((16, 16), 1, dt))
    except Exception as e:  # noqa: BLE001
        if comm.rank == 0:
            print(f"cupy.matmul cannot multiply {dt} ({type(e).__name__}); benchmarking float16")
        dt = np.dtype(np.float16)
    shared = comm.gpus_shared  # ranks share GPUs (under MPS: at once): NCCL cannot run
    if shared:
        import mps_timing as cc

        barrier = cc.DeviceBarrier(comm)
        link = cc.host_link_gbs(comm, barrier) if args.nodes > 1 else cc.device_link_gbs(comm, barrier)
        rate = None
    else:
        rate = exchange_rate_gbs(comm) if args.nodes == 1 else None
    gpus = len(set(comm.mpi.allgather(comm.device_id))) if shared else W  # every rank: a collective
    table = ONE_NODE if args.nodes == 1 else BETWEEN_NODES
    cols = [("shape", "shape", None), ("mkernel_ms", "mkernel ms", ".3f"), ("baseline_ms", "baseline ms", ".3f"),
            ("chunked_ms" if args.nodes == 1 else "nccl_ms", "chunked ms" if args.nodes == 1 else "nccl ms", ".3f"),
            ("bound_ms", "bound ms", ".3f"), ("speedup", "speedup", ".2f"), ("fraction_of_bound", "of bound", ".2f"),
            ("goal", "goal", None), ("meets_goal", "met", None), ("max_err_mkernel", "err mk", ".3g"),
            ("max_err_baseline", "err base", ".3g")]
    summary = []
    for op in (OPS if args.op == "all" else (args.op,)):
        shapes = QUICK if args.quick else table[op]
        if args.shapes:
            shapes = [(tuple(int(x) for x in s.split("x")), None) for s in args.shapes.split(",")]
        try:
            rows = (bench_op_shared(op, comm, shapes, dt, barrier, link, comm_sms) if shared
                    else bench_op(op, comm, shapes, dt, rate))
        except mkernel.ArgumentError as e:  # a layout the op refuses (allgather_gemm between nodes)
            if comm.rank == 0:
                print(f"== {op}: not benchmarked: {e}")
            summary.append(f"{op} refused")
            continue
        if comm.rank == 0:
            path = harness.write(op, rows, gpus=gpus, nodes=args.nodes, out_dir=args.out,
                                 transport=(comm.stats()["proxy"] or args.transport) if args.nodes > 1 else "nvlink",
                                 exchange_rate_gbs=rate, ranks_per_gpu=W // gpus)
            if args.nodes == 1 or shared:
                plot(op, rows, path.with_suffix(".png"), shared=shared)
            print(f"== {op} ({W} GPUs, {args.nodes} node(s)) -> {path}")
            print(harness.table(rows, cols), flush=True)
            summary.append(f"{op} " + " ".join(f"{r['speedup']:.2f}x" for r in rows))
        comm.mpi.Barrier()  # rank 0's plot may outlast the next op's 30 s agreement
    if comm.rank == 0:
        print("SUMMARY tp: " + "; ".join(summary))
    comm.close()


if __name__ == "__main__":
    main()
