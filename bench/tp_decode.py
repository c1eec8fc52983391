#!/usr/bin/env python3
"""gemm_allreduce at decode sizes (issue 26): the latency path (the decode GEMM, then the one-shot
mkernel.allreduce) against the fused kernel and the unfused baseline, side by side in one run, one
node.

Rows: M in {1, 8, 16, 32, 64} x (N, K_r) in {(8192, 8192), (4096, 14336), (14336, 4096)} per rank,
bf16, B as the weights [N, K_r] (``w.T``). Baseline: cupy.matmul then NCCL's all-reduce where every
rank has its GPU; where ranks share a GPU (under MPS) the op's unfused path (cupy.matmul, then its
own collective), timed by bench/mps_timing.py's rule. mkernel_ms is the faster of the latency and
fused paths (both reported: ``latency_ms``, ``fused_ms``; ``best_path``); bound_ms = reading this
rank's weights once at the device copy rate measured in the run. The rows tell the crossover for
``config.tp_latency_max_rows``.

    mpirun -n 2 python3 bench/tp_decode.py [--quick]
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

import harness  # noqa: E402

MS = (1, 8, 16, 32, 64)
NK = ((8192, 8192), (4096, 14336), (14336, 4096))


def copy_rate(timed):
    """Bytes read + written per second of a 1 GiB device copy, every rank copying at once."""
    import cupy

    src, dst = cupy.ones(1 << 30, cupy.uint8), cupy.empty(1 << 30, cupy.uint8)
    ms = timed(lambda: cupy.copyto(dst, src), 5)
    return 2 * src.nbytes / (ms * 1e-3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="M 1 and 64, (8192, 8192) only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import cupy
    import ml_dtypes
    from mpi4py import MPI

    import mkernel

    comm = mkernel.init()
    W = comm.size
    shared = comm.gpus_shared
    dt = np.dtype(ml_dtypes.bfloat16)
    if shared:
        import mps_timing as cc

        barrier = cc.DeviceBarrier(comm)

        def timed(fn, n=50):
            return cc.batch_ms(comm, barrier, fn, n=n)
    else:
        def timed(fn, n=None):
            comm.mpi.Barrier()
            return comm.mpi.allreduce(harness.median(harness.time_ms(fn)), op=MPI.MAX)
    rate = copy_rate(timed)
    rows = []
    shapes = [(m, 8192, 8192) for m in (1, 64)] if args.quick else [(m, n, k) for n, k in NK for m in MS]
    for M, N, K in shapes:
        a = harness.rand((M, K), 1 + comm.rank, dt)
        w = harness.rand((N, K), 100 + comm.rank, dt)
        out = cupy.empty((M, N), dt)
        f = {p: (lambda p=p: mkernel.gemm_allreduce(a, w.T, comm=comm, out=out, path=p))
             for p in ("latency", "fused", "unfused")}
        if not shared:
            from cupy.cuda import nccl

            def base():
                part = cupy.matmul(a, w.T)
                comm.nccl.allReduce(part.data.ptr, out.data.ptr, M * N, nccl.NCCL_BFLOAT16, nccl.NCCL_SUM,
                                    cupy.cuda.get_current_stream().ptr)
            f["baseline"] = base
        else:
            f["baseline"] = f["unfused"]
        results = {}
        for p in ("latency", "fused"):  # the two paths agree (partials rounded after different K orders)
            f[p]()
            cupy.cuda.get_current_stream().synchronize()
            comm.check()
            results[p] = harness.as_float(out, "float64")
        diff = float(cupy.linalg.norm(results["latency"] - results["fused"]) / cupy.linalg.norm(results["fused"]))
        t = {p: timed(fn) for p, fn in f.items()}
        best = min(("latency", "fused"), key=t.__getitem__)
        bound = N * K * 2 / rate * 2 * 1e3  # this rank's weights read once (read bytes = half the copy's)
        rows.append(harness.row((M, N, K), t[best], t["baseline"], bound, latency_ms=t["latency"],
                                fused_ms=t["fused"], unfused_ms=t["unfused"], best_path=best,
                                latency_rel_diff_fused=diff, mps=bool(shared), world=W,
                                baseline="mkernel unfused" if shared else "cupy.matmul + NCCL all-reduce"))
        if comm.rank == 0:
            r = rows[-1]
            print(f"{M:4d} {N:6d} {K:6d}  latency {t['latency'] * 1e3:8.1f} us  fused {t['fused'] * 1e3:8.1f} us  "
                  f"baseline {t['baseline'] * 1e3:8.1f} us  speedup {r['speedup']:.2f}  of bound "
                  f"{r['fraction_of_bound']:.2f}  rel diff {diff:.1e}", flush=True)
        comm.release_plans()
    gpus = len(set(comm.mpi.allgather(comm.device_id)))  # every rank: a collective
    if comm.rank == 0:
        path = harness.write("gemm_allreduce_decode", rows, gpus=gpus, out_dir=args.out, ranks_per_gpu=W // gpus,
                             copy_rate_TBps=rate / 1e12)
        sp = [r["speedup"] for r in rows]
        print(f"SUMMARY tp_decode: {len(rows)} rows, geomean speedup {float(np.exp(np.mean(np.log(sp)))):.3f}, "
              f"latency best on {sum(r['best_path'] == 'latency' for r in rows)}; {path}")
    comm.close()


if __name__ == "__main__":
    main()
