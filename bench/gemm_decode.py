#!/usr/bin/env python3
"""Decode-size GEMM benchmark (issue 26): mkernel.gemm against cupy.matmul (cuBLAS) at small M and odd
shapes, and the grouped GEMM of MoE decode against one cupy.matmul per expert (queued while a hold kernel
keeps the GPU busy, so the 64 host launches do not count: CuPy's cuBLAS cannot be graph-captured);
one GPU, one process.

Every timed call of either library follows an L2 flush (a read of 256 MiB, outside the events), so
weights are read from HBM as in a decode step. A read, not a fill: a fill leaves L2 full of dirty
lines whose write-back then runs inside the timed call (~50 MB on the H200, a third more traffic
than a 1 x 8192 x 8192 call's weights; bench/NOTES.md session 25). Per row: ``speedup`` (cuBLAS
time / mkernel time) and ``fraction_of_bound`` (bound / mkernel time), the bound being max(bytes of A, B and C over the
copy rate, FLOPs at the tensor peak), the copy rate (bytes read + written per second) of a 1 GiB
device-to-device copy measured in the same run. Results are checked against cuBLAS before timing.
Writes bench/results/gemm_decode-1gpu.json.

    python3 bench/gemm.py --decode [--quick]     (or python3 bench/gemm_decode.py)
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

import harness  # noqa: E402
from harness import PEAK_TFLOPS, rand, wait  # noqa: E402

DECODE_M = (1, 8, 16, 32, 64, 128, 256)
DECODE_NK = ((8192, 8192), (4096, 14336), (14336, 4096), (10240, 8192), (8192, 28672))
ODD_SHAPES = ((8191, 8200, 1032), (4000, 7000, 3000), (1000, 3000, 2000), (3000, 1000, 520))
MOE_EXPERTS, MOE_ROWS, MOE_H, MOE_F = 64, (1, 32), 7168, 2048
FLUSH_BYTES = 256 << 20  # > 60 MiB of L2
COPY_BYTES = 1 << 30
HOLD_NS = 5_000_000  # a timed call queued behind this much GPU time starts with no host gap
HOLD_SRC = r"""extern "C" __global__ void hold(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}"""
GOAL_SPEEDUP, GOAL_GEOMEAN, GOAL_FRACTION, GOAL_FRACTION_MAX_M = 0.97, 1.03, 0.85, 64


def copy_rate(reps):
    """Bytes read + written per second of a device-to-device copy of COPY_BYTES (median of reps)."""
    import cupy

    src, dst = cupy.ones(COPY_BYTES, cupy.uint8), cupy.empty(COPY_BYTES, cupy.uint8)
    ms = flushed_ms(lambda: cupy.copyto(dst, src), reps, flush=None)
    return 2.0 * COPY_BYTES / (ms * 1e-3)


def flushed_ms(fn, reps, flush):
    """Median CUDA-event time of fn(), each call after flush() (outside the events) when given."""
    import cupy

    fn()
    events = []
    for _ in range(reps):
        if flush is not None:
            flush()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        events.append((start, stop))
    wait("timed calls")
    return harness.median([cupy.cuda.get_elapsed_time(a, b) for a, b in events])


def bound_ms(flops, nbytes, rate):
    return max(flops / (PEAK_TFLOPS * 1e12), nbytes / rate) * 1e3


def rel_err(x, ref):
    import cupy

    x32, r32 = x.astype(cupy.float32), ref.astype(cupy.float32)
    return float(cupy.linalg.norm(x32 - r32) / (cupy.linalg.norm(r32) + 1e-30))


def plot(result, path):
    """Speed against cuBLAS and fraction of the bound against tokens (M) per (N, K) of the decode
    rows, with the goals; the odd and MoE rows' speed beside them, from a results dict (the JSON
    this script writes)."""
    plt = harness.pyplot()
    if plt is None:
        return None
    rows = [r for r in result["rows"] if r.get("speedup")]
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [1.3, 1.3, 1],
                                                                            "wspace": 0.55})
    for N, K in DECODE_NK:
        fam = sorted((r["shape"][0], r) for r in rows if r["kind"] == "decode" and r["shape"][1:] == [N, K])
        if fam:
            ms = [m for m, _ in fam]
            ax.plot(ms, [r["speedup"] for _, r in fam], "-o", ms=3, label=f"N {N}, K {K}")
            bx.plot(ms, [r["fraction_of_bound"] for _, r in fam], "-o", ms=3, label=f"N {N}, K {K}")
    ax.axhline(GOAL_SPEEDUP, color="r", lw=0.8, ls="--", label=f"goal {GOAL_SPEEDUP}")
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_ylabel("cuBLAS time / mkernel time")
    bx.hlines(GOAL_FRACTION, 1, GOAL_FRACTION_MAX_M, color="r", lw=0.8, ls="--",
              label=f"goal {GOAL_FRACTION} (M <= {GOAL_FRACTION_MAX_M})")
    bx.set_ylabel("bound / mkernel time")
    for x, title in ((ax, "speed against cuBLAS"), (bx, "fraction of the bound")):
        x.set_xscale("log", base=2)
        x.set_xlabel("M (tokens)")
        x.set_title(title, fontsize=9)
        x.grid(alpha=0.3)
        x.legend(fontsize=6.5)
    other = [r for r in rows if r["kind"] != "decode"]
    cx.barh(range(len(other)), [r["speedup"] for r in other])
    cx.set_yticks(range(len(other)), [("x".join(map(str, r["shape"])) + (f" moe {r['name']}" if r["kind"] == "moe"
                                                                           else "")) for r in other], fontsize=6.5)
    for i, r in enumerate(other):
        cx.text(r["speedup"], i, f" {r['speedup']:.2f}", va="center", fontsize=6.5)
    cx.axvline(GOAL_SPEEDUP, color="r", lw=0.8, ls="--")
    cx.set_xlabel("cuBLAS time / mkernel time")
    cx.set_title("odd shapes and MoE decode (grouped)", fontsize=9)
    fig.suptitle(f"decode-size GEMM (bf16, w.T, L2 flushed), {result.get('device')}, commit {result.get('commit')}",
                 fontsize=10)
    return harness.save_plot(fig, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few shapes, fewer reps (smoke run)")
    ap.add_argument("--reps", type=int, default=harness.REPS)
    ap.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)  # as passed on by bench/gemm.py
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of an earlier results file, next to it")
    opts = ap.parse_args()
    if opts.plot:
        return harness.replot(opts.plot, plot)

    import cupy

    from mkernel.engines import gemm as mg
    from mkernel.engines import gemm_plan as plan

    reps = 5 if opts.quick else max(20, opts.reps)
    flush_words = cupy.ones(FLUSH_BYTES // 8, cupy.uint64)
    flush = lambda: flush_words.max()  # noqa: E731  (reads every byte, writes one word)
    hold_fn = cupy.RawKernel(HOLD_SRC, "hold")
    hold = lambda: hold_fn((1,), (1,), (np.uint64(HOLD_NS),))  # noqa: E731
    rate = copy_rate(reps)
    print(f"# {harness.device_name()}: copy rate {rate / 1e12:.2f} TB/s (read + write, 1 GiB D2D)", flush=True)
    errors = {}
    section = harness.sections(errors)
    rows = []

    def dense_row(M, N, K, kind):
        a, w = rand((M, K), 10), rand((N, K), 11)  # weights row-major [N, K], read as w.T
        b = w.T
        out, ref = cupy.empty((M, N), a.dtype), cupy.matmul(a, b)
        mg.gemm(a, b, out=out)
        err = rel_err(out, ref)
        if not err < 1e-2:
            raise AssertionError(f"{M}x{N}x{K}: relative error {err:.3g} against cuBLAS")
        t_mk = flushed_ms(lambda: mg.gemm(a, b, out=out), reps, flush)
        t_cb = flushed_ms(lambda: cupy.matmul(a, b, out=ref), reps, flush)
        flops, nbytes = 2.0 * M * N * K, 2.0 * (M * K + N * K + M * N)
        variants = {}  # other settings at this shape (which defaults to take)
        from mkernel import config

        settings = {}
        if kind == "decode":  # the decode path's knobs (taking up to 256 rows)
            settings = {"rows64": {"gemm_decode_rows": 64}, "rows128": {"gemm_decode_rows": 128},
                        "stream": {"gemm_decode_split": "stream"}, "overlap": {"gemm_overlap": True}}
            settings = {k: dict(v, gemm_decode_max_m=256) for k, v in settings.items()}
        if M > config.get().gemm_decode_max_m and plan.split_k(M, N, K) > 1:
            settings["nosplit"] = {"gemm_split_k": False}  # the engine with one CTA per tile
        elif kind == "decode":
            settings["engine"] = {"gemm_decode_max_m": 0}  # the engine (split K) at the decode path's rows
        if M > config.get().gemm_decode_max_m:  # the engine's rows: both tile widths (128 x 192 and 256)
            settings.update(tile192={"gemm_tile_n": 192}, tile256={"gemm_tile_n": 256})
        calls = {name: (knobs, {}) for name, knobs in settings.items()}
        if kind == "odd" or (plan.use_cluster(M, N, K) and plan.split_k(M, N, K, cluster=True) > 1):
            # the clustered kernel (CTA pairs sharing B by multicast) against the default
            forced = not plan.use_cluster(M, N, K, aligned=2 * K % plan.ROW_LINE == 0)  # rows of a and w: K elements
            calls["cluster" if forced else "nocluster"] = ({}, {"cluster": forced})
        for name, (knobs, kw) in calls.items():
            with config.override(**knobs):
                mg.gemm(a, b, out=out, **kw)
                e = rel_err(out, ref)
                variants[name] = flushed_ms(lambda: mg.gemm(a, b, out=out, **kw), reps, flush) if e < 1e-2 else \
                    f"wrong (relative error {e:.3g})"
        r = harness.row([M, N, K], t_mk, t_cb, bound_ms(flops, nbytes, rate), kind=kind, layout="w.T",
                        dtype="bfloat16", rel_err=err, copy_rate_TBps=rate / 1e12, decode_variants_ms=variants,
                        tile_n=plan.tile_width(M, N, K))  # the default's width where the engine runs
        rows.append(r)
        alt = "  ".join(f"{k} {v * 1e3:.1f} us" if isinstance(v, float) else f"{k} {v}" for k, v in variants.items())
        print(f"{kind:5s} {M:6d} {N:6d} {K:6d}  mkernel {t_mk * 1e3:8.1f} us  cuBLAS {t_cb * 1e3:8.1f} us  "
              f"speedup {r['speedup']:.3f}  of bound {r['fraction_of_bound']:.2f}  {alt}", flush=True)

    def moe_row(N, K, name):
        rng = np.random.default_rng(5)
        counts = rng.integers(MOE_ROWS[0], MOE_ROWS[1] + 1, MOE_EXPERTS)
        M = int(counts.sum())
        a, bs = rand((M, K), 12), rand((MOE_EXPERTS, K, N), 13)
        d_counts = cupy.asarray(counts.astype(np.int32))
        out, ref = cupy.empty((M, N), a.dtype), cupy.empty((M, N), a.dtype)
        starts = np.concatenate([[0], np.cumsum(counts)])

        def per_expert():
            for g in range(MOE_EXPERTS):
                cupy.matmul(a[starts[g]:starts[g + 1]], bs[g], out=ref[starts[g]:starts[g + 1]])

        mg.grouped_gemm(a, bs, d_counts, out=out)
        per_expert()
        err = rel_err(out, ref)
        if not err < 1e-2:
            raise AssertionError(f"grouped {name}: relative error {err:.3g} against cuBLAS")
        held = lambda: (hold(), flush())  # noqa: E731  (the host queues the 64 matmuls meanwhile)
        t_mk = flushed_ms(lambda: mg.grouped_gemm(a, bs, d_counts, out=out), reps, held)
        t_cb = flushed_ms(per_expert, reps, held)
        flops, nbytes = 2.0 * M * N * K, 2.0 * (M * K + MOE_EXPERTS * K * N + M * N)
        r = harness.row([M, N, K], t_mk, t_cb, bound_ms(flops, nbytes, rate), kind="moe", groups=MOE_EXPERTS,
                        rows_per_group=list(MOE_ROWS), name=name, dtype="bfloat16", rel_err=err,
                        copy_rate_TBps=rate / 1e12, baseline="one cupy.matmul per expert, queued behind a hold")
        rows.append(r)
        print(f"moe   {name}: {M} rows  mkernel {t_mk * 1e3:8.1f} us  "
              f"{MOE_EXPERTS} x cuBLAS {t_cb * 1e3:8.1f} us  "
              f"speedup {r['speedup']:.3f}  of bound {r['fraction_of_bound']:.2f}", flush=True)

    t0 = time.time()
    ms = (1, 64) if opts.quick else DECODE_M
    for N, K in (DECODE_NK[:1] if opts.quick else DECODE_NK):
        for M in ms:
            section(f"decode {M}x{N}x{K}", lambda: dense_row(M, N, K, "decode"))
    for shape in (ODD_SHAPES[:1] if opts.quick else ODD_SHAPES):
        section(f"odd {shape}", lambda: dense_row(*shape, "odd"))
    for N, K, name in ((MOE_F, MOE_H, "up: N=F, K=H"), (MOE_H, MOE_F, "down: N=H, K=F")):
        section(f"moe {name}", lambda: moe_row(N, K, name))

    dense = [r for r in rows if r.get("speedup") and r["kind"] != "moe"]
    speedups = [r["speedup"] for r in rows if r.get("speedup")]
    geomean = float(np.exp(np.mean(np.log(speedups)))) if speedups else None
    small = [r["fraction_of_bound"] for r in dense if r["kind"] == "decode" and r["shape"][0] <= GOAL_FRACTION_MAX_M]
    goals = {"speedup_min": min(speedups) if speedups else None, "geomean": geomean,
             "fraction_min_small_m": min(small) if small else None,
             "meets": bool(speedups and min(speedups) >= GOAL_SPEEDUP and geomean >= GOAL_GEOMEAN
                           and small and min(small) >= GOAL_FRACTION),
             "goal": f"speedup >= {GOAL_SPEEDUP} every row, geomean >= {GOAL_GEOMEAN}, "
                     f"fraction_of_bound >= {GOAL_FRACTION} at M <= {GOAL_FRACTION_MAX_M}"}
    path = harness.write("gemm_decode", rows, gpus=1, copy_rate_TBps=rate / 1e12, l2_flush_bytes=FLUSH_BYTES,
                         reps=reps, goals=goals, errors=errors, seconds=time.time() - t0)
    print(f"geomean speedup {geomean}, slowest {goals['speedup_min']}, least fraction of bound at M <= 64 "
          f"{goals['fraction_min_small_m']}; goals met: {goals['meets']}; wrote {path}", flush=True)
    import json

    print(f"plot: {plot(json.loads(path.read_text()), path.with_suffix('.png'))}", flush=True)
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
