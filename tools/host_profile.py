"""Where the host's time of one steady-state call goes: cProfile over back-to-back calls of the TP
ops (no waits between them), the functions with most own time and most cumulative time, per path.

The latency path replays recorded launches; the fused path runs check, plan and launch on every
call: this says what that costs and where (bench/tp_decode.py reported ~134 us a call).

    mpirun -n 2 python3 tools/host_profile.py [--shape 256x8192x4096] [--calls 200] [--top 25]
"""

import argparse
import cProfile
import io
import pstats
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="256x8192x4096", help="per-rank M x N x K")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--paths", default="fused,latency")
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
    out = cupy.empty((M, N), dt)
    for path in args.paths.split(","):
        def call():
            mkernel.gemm_allreduce(a, w.T, comm=comm, out=out, path=path)

        for _ in range(30):  # the first calls: plans, the split search's trials
            call()
        cupy.cuda.get_current_stream().synchronize()
        comm.mpi.Barrier()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            call()
        host = (time.perf_counter() - t0) / args.calls * 1e6
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
                print(f"== {path} {M}x{N}x{K}: {host:.1f} us a call unprofiled; by {key} over {args.calls} calls ==")
                print(s.getvalue())
        comm.mpi.Barrier()
    comm.close()


if __name__ == "__main__":
    main()
