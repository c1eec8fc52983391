"""Issue 8: the adaptive split (``comm_sms="auto"``, mkernel/split/search.py) against static splits,
for the three fused TP ops on bench/tp.py's shapes, one node or ``--nodes N`` emulated nodes.

Per (op, shape): the first call on a fresh key (the model's prior) is timed alone, the median of
FIRST_SAMPLES such calls, each on a fresh key; the search then
runs until it holds; then every static count of GRID and the held auto split run interleaved,
REPS times each (so that drift hits all variants alike), one CUDA-event time per call behind a spin
kernel that hides the host's work for the call (the first call's host time, the key's setup, is
reported apart), the max over ranks. Reported per row: the median and 95% confidence interval of each variant, the best
and worst static split, the first call, the controller's split and time; top level the geomean of
controller / best static. Differences inside the confidence intervals are not claims.

    mpirun -n 2 python3 bench/controller.py [--nodes 2] [--quick] [--out DIR]

Ranks sharing a GPU (under MPS) are timed by bench/mps_timing.py's rule instead: every variant's
figure is the median of BATCHES batches of 50 back-to-back calls, each batch started by a device
barrier, the variants interleaved batch by batch; static splits GRID_MPS (issue 25).

Writes bench/results/controller-<gpus>gpu[-<nodes>node].json (under MPS controller-<N>rank-mps
[-<nodes>node].json) and a PNG per op (time against comm CTAs, the controller's choice marked).
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tp as tp_bench  # noqa: E402  (bench/tp.py: the shapes)

import harness  # noqa: E402

GRID = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
GRID_MPS = (1, 2, 4, 8, 12, 16, 24, 32)
REPS = 50
BATCHES = 7  # under MPS: batches of mps_timing.BATCH calls per variant
FIRST_SAMPLES = 3  # first calls per row, each on a fresh key
SEARCH_CALLS = 16  # enough for the search to hold (it holds after at most 10 observations)


def op_call(op, comm, M, N, K, dt):
    """call(comm_sms) -> runs the fused op once on this rank's inputs (bench/tp.py's shapes)."""
    import cupy

    import mkernel

    W, r = comm.size, comm.rank
    if op == "allgather_gemm":
        a, b = harness.rand((M // W, K), 100 + r, dt), harness.rand((K, N), 200 + r, dt)
        out = cupy.empty((M, N), dt)
        return lambda n: mkernel.allgather_gemm(a, b, comm=comm, out=out, path="fused", comm_sms=n)
    a, b = harness.rand((M, K), 300 + r, dt), harness.rand((K, N), 400 + r, dt)
    ar = op == "gemm_allreduce"
    out = cupy.empty((M, N) if ar else (M // W, N), dt)
    fn = mkernel.gemm_allreduce if ar else mkernel.gemm_reduce_scatter
    return lambda n: fn(a, b, comm=comm, out=out, path="fused", comm_sms=n)


def one_ms(comm, fn, lead_ns, barrier=None):
    """One call's CUDA-event time, the max over ranks (the op ends when its slowest rank does), with
    the host's work for the call hidden behind a spin kernel of lead_ns (harness.hidden_launch_ms):
    the split's effect on the GPU, not Python's. Also returns the call's host time (ms, the slowest
    rank's: a host slower than lead_ns shows in the GPU time too).
    barrier (ranks sharing a GPU): the spins start together, so no rank's time counts a peer's lateness."""
    import time

    import cupy
    from mpi4py import MPI

    stream = cupy.cuda.get_current_stream()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    if barrier is not None:
        barrier()
    harness.spin(lead_ns)
    start.record(stream)
    t0 = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    stop.record(stream)
    stop.synchronize()
    comm.check()
    return comm.mpi.allreduce(cupy.cuda.get_elapsed_time(start, stop), op=MPI.MAX), \
        comm.mpi.allreduce(host_ms, op=MPI.MAX)


FIRST_LEAD_NS = 50_000_000  # the first call on a key agrees its bound and computes the prior on the host


def bench_shape(op, comm, M, N, K, dt, barrier=None, grid=None):
    from mpi4py import MPI

    from mkernel.ops import tp
    from mkernel.runtime import launch
    from mkernel.split import policy as split
    from mkernel.split import search as autosplit

    call = op_call(op, comm, M, N, K, dt)
    for n in (*GRID[:2], "auto"):  # compile, allocate the plan; a process's first "auto" call also loads
        call(n)  # the split policy's host library (first shapes measured 6.8x without it: bench/NOTES.md)
    harness.wait(f"{op} warm-up")
    lead = comm.mpi.allreduce(harness.launch_lead_ns(lambda: call(GRID[0])), op=MPI.MAX)
    firsts = []  # single first calls vary (a 5-8 ms outlier on one row in four): the median of a few
    for i in range(FIRST_SAMPLES):
        comm.plans.state["autosplit.keys"] = {}  # a fresh key: its first call runs the prior
        comm.plans.state["autosplit.memory"] = split.SplitMemory()
        firsts.append(one_ms(comm, lambda: call("auto"), FIRST_LEAD_NS, barrier))
        if i == 0:
            first_record = tp.controller_stats(comm)
    first = harness.median([f[0] for f in firsts])
    first_host_ms = harness.median([f[1] for f in firsts])
    for _ in range(SEARCH_CALLS):
        call("auto")
    harness.wait(f"{op} search")
    key = comm.plans.state["autosplit.keys"][(op, M, N, K)].key
    search = autosplit.memory(comm).search(key)
    sms = launch.sm_count()
    statics = [n for n in (grid or (GRID_MPS if barrier else GRID)) if n < sms]
    variants = statics + ["auto"]
    times = {v: [] for v in variants}
    # interleaved variant by variant, in reverse order every other round: drift falls on every variant alike
    if barrier:  # ranks at once: batches behind a device barrier
        import mps_timing as cc

        for r in range(BATCHES):
            for v in variants if r % 2 == 0 else variants[::-1]:
                times[v] += cc.batch_times(comm, barrier, lambda v=v: call(v), batches=1)
    else:
        for r in range(REPS):
            for v in variants if r % 2 == 0 else variants[::-1]:
                times[v].append(one_ms(comm, lambda v=v: call(v), lead)[0])
    record = tp.controller_stats(comm)  # the in-call controller's record of the last "auto" call
    med = {v: harness.median(t) for v, t in times.items()}
    best_n = min(statics, key=lambda n: med[n])
    worst_n = max(statics, key=lambda n: med[n])
    gemm_ms = 2.0 * M * N * K / (harness.PEAK_TFLOPS * 1e12) * 1e3
    link = autosplit._link_gbps(comm)
    bound = max(gemm_ms, autosplit.comm_bytes(op, M, N, K, comm.size, dt.itemsize, comm.num_nodes) / (link * 1e9) * 1e3)
    return harness.row(
        (M, N, K), med["auto"], med[best_n], bound,
        best_static_ms=med[best_n], best_static_sms=best_n, best_static_ci95=harness.ci95(times[best_n]),
        worst_static_ms=med[worst_n], worst_static_sms=worst_n, worst_static_ci95=harness.ci95(times[worst_n]),
        first_call_ms=first, first_call_samples_ms=[f[0] for f in firsts], first_call_host_ms=first_host_ms,
        first_call_record=first_record,
        controller_ms=med["auto"], controller_ci95=harness.ci95(times["auto"]),
        controller_sms=search.best, controller_converged=search.converged, controller_record=record,
        static_ms={str(n): med[n] for n in statics}, static_ci95={str(n): harness.ci95(times[n]) for n in statics},
        bound_note="max(GEMM at tensor peak, bytes over the modelled link)", op=op,
        reps=BATCHES if barrier else REPS, mps=bool(barrier), sms_per_rank=sms)


def plot(op, rows, path):
    plt = harness.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        ns = sorted(int(n) for n in r["static_ms"])
        ys = [r["static_ms"][str(n)] for n in ns]
        lo = [r["static_ms"][str(n)] - r["static_ci95"][str(n)][0] for n in ns]
        hi = [r["static_ci95"][str(n)][1] - r["static_ms"][str(n)] for n in ns]
        line = ax.errorbar(ns, ys, yerr=[lo, hi], marker="o", ms=3, capsize=2, label=f"{tuple(r['shape'])}")
        ax.plot([r["controller_sms"]], [r["controller_ms"]], marker="*", ms=12, color=line[0].get_color())
    ax.set_yscale("log")  # too few comm CTAs costs up to 20x: a linear axis hides the optimum
    ax.set_xlabel("communication CTAs (static)")
    ax.set_ylabel("ms per call (median, 95% CI)")
    ax.set_title(f"{op}: static splits; star = comm_sms='auto'")
    ax.legend(fontsize=7)
    harness.save_plot(fig, path)


def main():
    import ml_dtypes
    import numpy as np

    import mkernel

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", default="all", choices=("all",) + tp_bench.OPS)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--transport", default="host")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--grid", default=None, help="static comm CTA counts, e.g. 2,4,8 (default: the issue's grid)")
    p.add_argument("--shape", action="append", default=[], help="MxNxK: only these rows of the table (repeatable)")
    args = p.parse_args()
    args.grid = tuple(int(n) for n in args.grid.split(",")) if args.grid else None
    from mpi4py import MPI
    W = MPI.COMM_WORLD.Get_size()
    if args.nodes < 1 or W % args.nodes:
        raise SystemExit(f"--nodes {args.nodes} must divide the world size {W}")
    comm = mkernel.init(workspace_bytes=6 << 30, gpus_per_node=W // args.nodes if args.nodes > 1 else None,
                        transport=args.transport if args.nodes > 1 else "auto")
    dt = np.dtype(ml_dtypes.bfloat16)
    barrier = None
    if comm.gpus_shared:  # ranks share a GPU (under MPS: at once)
        import mps_timing as cc

        barrier = cc.DeviceBarrier(comm)
    table = tp_bench.QUICK if args.quick else None
    rows = []
    for op in (tp_bench.OPS if args.op == "all" else (args.op,)):
        shapes = table or (tp_bench.ONE_NODE if args.nodes == 1 else tp_bench.BETWEEN_NODES)[op]
        op_rows = []
        for (M, N, K), _goal in shapes:
            if args.shape and f"{M}x{N}x{K}" not in args.shape:
                continue
            try:
                op_rows.append(bench_shape(op, comm, M, N, K, dt, barrier, args.grid))
            except mkernel.ArgumentError as e:
                if comm.rank == 0:
                    print(f"== {op} {M}x{N}x{K}: not run: {e}")
                continue
            finally:
                comm.release_plans()  # every rank, after every shape: the next one's buffers fit
            r = op_rows[-1]
            if comm.rank == 0:
                print(f"{op:20s} {M}x{N}x{K}: best static {r['best_static_ms']:.3f} ms at {r['best_static_sms']}, "
                      f"worst {r['worst_static_ms']:.3f} at {r['worst_static_sms']}, first call "
                      f"{r['first_call_ms']:.3f}, auto {r['controller_ms']:.3f} ms at {r['controller_sms']} "
                      f"({r['best_static_ms'] / r['controller_ms']:.3f}x of best static)", flush=True)
        gpus = len(set(comm.mpi.allgather(comm.device_id)))  # every rank: a collective
        if comm.rank == 0 and op_rows:
            name = harness.result_name(f"controller-{op}", gpus, args.nodes, W // gpus)
            plot(op, op_rows, (Path(args.out or harness.RESULTS) / name).with_suffix(".png"))
        rows += op_rows
        if comm.rank == 0 and rows:  # after every op: a run cut short still leaves its rows
            write(rows, W, gpus, args, comm)
    comm.close()


def write(rows, W, gpus, args, comm):
    ratios = [r["controller_ms"] / r["best_static_ms"] for r in rows]
    geomean = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    transport = (comm.stats()["proxy"] or args.transport) if args.nodes > 1 else "nvlink" if W > 1 else "local"
    note = ("world 1: the comm CTAs reduce (copy) the GEMM's own tiles into out; the split mechanism on "
            "one GPU, not the issue's 2-GPU rows") if W == 1 else ""
    grid = args.grid or (GRID_MPS if comm.gpus_shared else GRID)
    path = harness.write("controller", rows, gpus=gpus, nodes=args.nodes, out_dir=args.out, transport=transport,
                         geomean_vs_best_static=geomean, grid=list(grid), note=note, ranks_per_gpu=W // gpus)
    print(f"SUMMARY controller: geomean controller / best static {geomean:.3f} over {len(rows)} rows -> {path}")


if __name__ == "__main__":
    main()
