"""Where fused tensor-parallel results go wrong: for a few shapes, the engine GEMM and the fused
AllGather+GEMM / GEMM+ReduceScatter at world 1 on integer inputs (exact), with the wrong elements'
row and column pattern (mod the 128 x 256 tile). Prints one line per case."""

import importlib
import sys

import cupy
import numpy as np
from mpi4py import MPI

import mkernel

comm = mkernel.init(MPI.COMM_SELF, workspace_bytes=256 << 20)
gemm_mod = importlib.import_module("mkernel.engines.gemm")
SHAPES = [(256, 64, 512), (256, 128, 512), (256, 64, 264), (136, 64, 512), (128, 64, 256), (512, 64, 512),
          (256, 192, 512), (1024, 64, 1024)]


def report(name, got, want):
    bad = got.astype(np.float64) != want
    if not bad.any():
        return f"{name}: exact"
    r, c = np.nonzero(bad)
    ex = (int(r[0]), int(c[0]), float(got[r[0], c[0]]), float(want[r[0], c[0]]))
    return (f"{name}: {bad.sum()} wrong of {bad.size}; rows%128 {np.unique(r % 128)[:12]} cols%256 "
            f"{np.unique(c % 256)[:12]} (#{len(np.unique(c % 256))}); first (r,c,got,want)={ex}")


fails = 0
for (M, K, N) in SHAPES:
    rng = np.random.default_rng([M, K, N])
    a = rng.integers(-1, 2, size=(M, K)).astype(np.float16)
    b = rng.integers(-1, 2, size=(K, N)).astype(np.float16)
    want = a.astype(np.float64) @ b.astype(np.float64)
    a_d, b_d = cupy.asarray(a), cupy.asarray(b)
    lines = []
    out = cupy.full((M, N), np.nan, dtype=np.float16)
    gemm_mod.gemm(a_d, b_d, out=out)
    lines.append(report("engine", out.get(), want))
    for op, fn in (("ag", mkernel.allgather_gemm), ("rs", mkernel.gemm_reduce_scatter),
                   ("ar", mkernel.gemm_allreduce)):
        out = cupy.full((M, N), np.nan, dtype=np.float16)
        try:
            fn(a_d, b_d, comm=comm, out=out, path="fused")
            cupy.cuda.get_current_stream().synchronize()
            lines.append(report(op, out.get(), want))
        except Exception as e:  # noqa: BLE001  (a diagnostic: report and go on)
            lines.append(f"{op}: {type(e).__name__}: {e}")
    fails += sum("wrong" in line for line in lines)
    print(f"M={M} K={K} N={N}: " + " | ".join(lines), flush=True)
comm.close()
sys.exit(1 if fails else 0)
