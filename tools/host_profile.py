"""Where the host's time of one steady-state call goes: cProfile over back-to-back calls of the TP
ops (no waits between them), the functions with most own time and most cumulative time, per op; each
call's host time too (mean, median, the first 16 after a synchronisation: a launch queue the device
fills makes later calls wait in the driver).

Ops: gemm_allreduce on its fused and latency paths (``ar:fused``, ``ar:latency``), gemm_reduce_scatter
and allgather_gemm fused (``rs:fused``, ``ag:fused``), mkernel.allreduce and mkernel.gemm of the
output (``allreduce``, ``gemm``). A repeated call with ``out`` replays its recorded launches; the
split search's timed calls (every HOLD_SAMPLE-th) run whole.

    mpirun -n 2 python3 tools/host_profile.py [--shape 256x8192x4096] [--calls 200] [--top 25]
"""

import argparse
import cProfile
import io
import pstats
import statistics
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="256x8192x4096", help="per-rank M x N x K")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--ops", default="ar:fused,ar:latency,rs:fused,ag:fused,allreduce,gemm")
    args = p.parse_args()
    import cupy
    import ml_dtypes
    import numpy as np

    import mkernel

    comm = mkernel.init()
    M, N, K = (int(x) for x in args.shape.split("x"))
    dt = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(comm.rank)
    a = cupy.asarray(rng.standard_normal((M, K)).astype(dt))
    w = cupy.asarray((rng.standard_normal((N, K)) / 64).astype(dt))
    W = comm.size
    out, rs_out, ag_out = cupy.empty((M, N), dt), cupy.empty((M // W, N), dt), cupy.empty((M * W, N), dt)
    calls = {"ar:fused": lambda: mkernel.gemm_allreduce(a, w.T, comm=comm, out=out, path="fused"),
             "ar:latency": lambda: mkernel.gemm_allreduce(a, w.T, comm=comm, out=out, path="latency"),
             "rs:fused": lambda: mkernel.gemm_reduce_scatter(a, w.T, comm=comm, out=rs_out, path="fused"),
             "ag:fused": lambda: mkernel.allgather_gemm(a, w.T, comm=comm, out=ag_out, path="fused"),
             "allreduce": lambda: mkernel.allreduce(out, comm=comm, out=out),
             "gemm": lambda: mkernel.gemm(a, w.T, out=out)}
    summary = {}
    for path in args.ops.split(","):
        call = calls[path]

        for _ in range(30):  # the first calls: plans, the split search's trials
            call()
        cupy.cuda.get_current_stream().synchronize()
        comm.mpi.Barrier()
        times = []
        for _ in range(args.calls):  # each call timed: a launch queue the device fills shows as late calls' waits
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e6)
        host = sum(times) / len(times)
        summary[path] = (host, statistics.median(times), sum(times[:16]) / min(16, len(times)))
        cupy.cuda.get_current_stream().synchronize()
        comm.mpi.Barrier()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            call()
        prof.disable()
        cupy.cuda.get_current_stream().synchronize()
        comm.check()
        if comm.rank == 0:
            for key in ("tottime", "cumulative"):
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats(key).print_stats(args.top)
                _, med, first = summary[path]
                print(f"== {path} {M}x{N}x{K}: {host:.1f} us a call unprofiled (median {med:.1f}, "
                      f"first 16 {first:.1f}); by {key} over {args.calls} calls ==")
                print(s.getvalue())
        comm.mpi.Barrier()
    if comm.rank == 0:
        print(f"SUMMARY host us a call at {M}x{N}x{K}, {W} ranks (mean / median / first 16): "
              + ", ".join(f"{k} {v[0]:.1f} / {v[1]:.1f} / {v[2]:.1f}" for k, v in summary.items()))
    comm.close()


if __name__ == "__main__":
    main()
