#!/usr/bin/env python3
"""mkernel.gemm and cupy.matmul (cuBLAS) once each per shape inside the profiler's range, for Nsight
Compute (which flushes caches before each profiled kernel by default). Weights as [N, K] read as
w.T, as bench/gemm_decode.py. Also prints the rate of a plain read (a max over 1 GiB).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python3 tools/ncu_gemm.py 1x8192x8192 128x8192x8192
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+", help="MxNxK")
    ap.add_argument("--decode-max-m", type=int, default=None, help="config.gemm_decode_max_m for the run")
    ap.add_argument("--variant", action="append", default=[], metavar="KNOB=VALUE",
                    help="also profile mkernel.gemm under this config override, after the default (repeatable)")
    opts = ap.parse_args()
    import cupy

    from mkernel import config
    from mkernel.engines import gemm as mg

    if opts.decode_max_m is not None:
        config.configure(gemm_decode_max_m=opts.decode_max_m)

    import ast

    from harness import rand

    def value(v):
        try:
            return ast.literal_eval(v)
        except (ValueError, SyntaxError):
            return v

    variants = [{}] + [{k: value(v) for k, v in (kv.split("=", 1),)} for kv in opts.variant]

    words = cupy.ones((1 << 30) // 8, cupy.uint64)
    words.max()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(10):
        words.max()
    stop.record()
    stop.synchronize()
    ms = cupy.cuda.get_elapsed_time(start, stop)
    print(f"read rate {10 * (1 << 30) / (ms * 1e-3) / 1e12:.2f} TB/s (max over 1 GiB)")
    cases = []
    for s in opts.shapes:
        M, N, K = (int(x) for x in s.split("x"))
        a, w = rand((M, K), 10), rand((N, K), 11)
        out = cupy.empty((M, N), a.dtype)
        for knobs in variants:  # compiles, plans, allocates outside the profiled range
            with config.override(**knobs):
                mg.gemm(a, w.T, out=out)
        cupy.matmul(a, w.T, out=out)
        cases.append((s, a, w, out))
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.start()
    for _s, a, w, out in cases:
        for knobs in variants:
            with config.override(**knobs):
                mg.gemm(a, w.T, out=out)
        cupy.matmul(a, w.T, out=out)
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.stop()
    print("profiled:", " ".join(s for s, *_ in cases), "each as mkernel under", variants, "then cuBLAS")


if __name__ == "__main__":
    main()
