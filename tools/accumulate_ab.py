"""mkernel.gemm(accumulate=True) against accumulate=False at decode shapes (bf16, weights as [N, K]):
medians of 50 CUDA-event timings each, and both results against float64. Times whichever mkernel
is imported: an A/B of two trees runs it twice,
    PYTHONPATH=$PWD python3 -P tools/accumulate_ab.py                  (this tree)
    PYTHONPATH=$PWD/scratch/branch python3 -P tools/accumulate_ab.py   (another)"""

import sys
from pathlib import Path

import cupy
import ml_dtypes
import numpy as np

import mkernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import harness  # noqa: E402  (bench/harness.py: CUDA-event timing)

BF16 = ml_dtypes.bfloat16


def timed_us(fn):
    return 1e3 * harness.median(harness.time_ms(fn, reps=50, warmup=10))


def main():
    print("# mkernel from", mkernel.__file__, flush=True)
    for N, K in ((8192, 8192), (4096, 14336)):
        for M in (1, 16, 64, 128):
            rng = np.random.default_rng(M)
            a = cupy.asarray(rng.standard_normal((M, K)).astype(BF16))
            w = cupy.asarray((rng.standard_normal((N, K)) / np.sqrt(K)).astype(BF16))
            c0 = rng.standard_normal((M, N)).astype(BF16)
            prod = a.get().astype(np.float64) @ w.get().astype(np.float64).T
            res = {}
            for acc in (False, True):
                out = cupy.asarray(c0)
                mkernel.gemm(a, w.T, out=out, accumulate=acc)
                got = cupy.asnumpy(out.view(cupy.uint16)).view(BF16).astype(np.float64)
                ref = prod + (c0.astype(np.float64) if acc else 0.0)
                err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
                res[acc] = (timed_us(lambda: mkernel.gemm(a, w.T, out=out, accumulate=acc)), err)
            (tp, ep), (ta, ea) = res[False], res[True]
            print(f"M {M:4d} N {N:5d} K {K:5d}: plain {tp:7.1f} us  accumulate {ta:7.1f} us (+{ta - tp:5.1f})  "
                  f"err {ep:.1e} / {ea:.1e}", flush=True)


if __name__ == "__main__":
    main()
