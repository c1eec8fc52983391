#!/usr/bin/env python3
"""GEMM benchmark: mkernel.gemm against cupy.matmul (cuBLAS), one GPU, one process.

Rows: the issue's shapes (M, N, K), B as [K, N] (the layout cupy.matmul takes) and as the
transposed view of a row-major [N, K] weight (w.T, both libraries read it in place); time against
the number of SMs given to the GEMM (132 down to 66); the cost of per-tile flags; grouped mode
(32 groups of ~1024 rows, H 7168 / F 2048) against one cupy.matmul per group. Median of 30
CUDA-event timings after warm-up; each main row times the clustered kernel, the unclustered one and
cuBLAS interleaved in 3 rounds, and mkernel_ms is the kernel gemm() picks by default. Writes
bench/results/gemm-1gpu.json; prints a table, and a compact summary last. Every mkernel result is
checked against cuBLAS's before it is timed.

    python3 bench/gemm.py [--quick]
    python3 bench/gemm.py --decode [--quick]    (small M and odd shapes: bench/gemm_decode.py)
"""

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

import harness  # noqa: E402
from harness import PEAK_TFLOPS, rand, wait  # noqa: E402  (rand: bf16)
from harness import hidden_launch_ms as gpu_time_ms  # noqa: E402

PEAK_TBS = 4.8  # H200 HBM3e
MAIN_SHAPES = [(4096, 8192, 4096), (8192, 8192, 4096), (8192, 8192, 14336), (16384, 8192, 14336),
               (8192, 14336, 8192), (16384, 16384, 1024)]
EXTRA_SHAPES = [(2048, 2048, 2048), (4000, 7000, 3000)]  # the second is off the tile grid
SWEEP_SHAPE = (8192, 8192, 4096)
SWEEP_SMS = list(range(132, 65, -6))
GROUPS, GROUP_ROWS_MEAN = 32, 1024
ROUNDS = 3  # interleaved rounds per main-table row (reps split between them)
GROUPED_SHAPES = [(2048, 7168, "up: N=F=2048, K=H=7168"), (7168, 2048, "down: N=H=7168, K=F=2048")]


def bound_ms(M, N, K, G=1):
    flops = 2.0 * M * N * K
    bytes_ = 2.0 * (M * K + G * K * N + M * N)
    return max(flops / (PEAK_TFLOPS * 1e12), bytes_ / (PEAK_TBS * 1e12)) * 1e3


def rel_err(x, ref):
    import cupy

    x32, r32 = x.astype(cupy.float32), ref.astype(cupy.float32)
    return float(cupy.linalg.norm(x32 - r32) / (cupy.linalg.norm(r32) + 1e-30))


def plot(result, path):
    """Speed against cuBLAS per main row (default, clustered, unclustered kernels) and time against
    the SMs given to the GEMM, from a results dict (the JSON this script writes)."""
    plt = harness.pyplot()
    if plt is None:
        return None
    rows = [r for r in result["rows"] if r.get("speedup")]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [2.2, 1]})
    xs = np.arange(len(rows))
    for off, key, name in ((-0.27, "speedup", "mkernel.gemm (default kernel)"), (0.0, "clustered_speedup", "clustered"),
                           (0.27, "unclustered_speedup", "unclustered")):
        ax.bar(xs + off, [r.get(key) or 0 for r in rows], width=0.26, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.95, color="r", lw=0.8, ls="--", label="goal 0.95 (main shapes)")
    ax.set_xticks(xs, [f"{'x'.join(map(str, r['shape']))}\n{r['layout']}{'' if r['main'] else ' (extra)'}"
                       for r in rows],
                  fontsize=6.5, rotation=60, ha="right")
    ax.set_ylim(0.5, 1.2)
    ax.set_ylabel("cuBLAS time / mkernel time")
    ax.set_title(f"bf16 GEMM vs cupy.matmul, {result.get('device')}, commit {result.get('commit')}")
    ax.legend(fontsize=7, loc="upper left", ncol=4)
    ax.grid(axis="y", alpha=0.3)
    sw = result.get("sm_sweep", {}).get("rows", [])
    if sw:
        bx.plot([r["sms"] for r in sw], [r["mkernel_ms"] for r in sw], "-o")
        bx.set_xlabel("SMs given to the GEMM (unclustered kernel)")
        bx.set_ylabel("ms")
        bx.set_title(f"time against SMs, {'x'.join(map(str, result['sm_sweep']['shape']))}")
        bx.grid(alpha=0.3)
    return harness.save_plot(fig, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes and reps (smoke run)")
    ap.add_argument("--reps", type=int, default=harness.REPS)
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of an earlier results file, next to it")
    ap.add_argument("--decode", action="store_true", help="the decode-size rows instead (bench/gemm_decode.py)")
    opts = ap.parse_args()
    if opts.decode:
        import gemm_decode

        return gemm_decode.main()
    if opts.plot:
        return harness.replot(opts.plot, plot)

    import importlib

    import cupy

    mg = importlib.import_module("mkernel.engines.gemm")  # the module (mkernel.gemm is also the function)
    plan = importlib.import_module("mkernel.engines.gemm_plan")

    reps = 5 if opts.quick else opts.reps
    t_start = time.time()
    nsm = mg._num_sms()
    # Compile / load once, and prove the kernel finishes before anything is timed.
    a0, b0 = rand((256, 256), 1), rand((256, 256), 2)
    mg.gemm(a0, b0)
    wait("first launch")
    print(f"# device {harness.device_name()} ({nsm} SMs), setup {time.time() - t_start:.1f} s", flush=True)

    errors = {}
    section = harness.sections(errors)
    rows = []

    def shape_rows(M, N, K):
        a, b = rand((M, K), 10), rand((K, N), 11)
        w = cupy.ascontiguousarray(b.T)  # [N, K] row-major: the weights layout
        out = cupy.empty((M, N), dtype=a.dtype)
        flops = 2.0 * M * N * K
        for layout, bb in (("kn", b), ("nk", w.T)):
            mg.gemm(a, bb, out=out)
            wait(f"gemm {M}x{N}x{K} {layout}")
            one = cupy.empty_like(out)
            mg.gemm(a, bb, out=one, cluster=not plan.use_cluster(M, N, K))  # the kernel the default does not pick
            wait(f"gemm {M}x{N}x{K} {layout} other kernel")
            try:  # cuBLAS's result and time (if this CuPy cannot multiply bfloat16, mkernel is still timed)
                ref = cupy.matmul(a, bb)
                err = max(rel_err(out, ref), rel_err(one, ref))
                del ref
                cublas = lambda: cupy.matmul(a, bb, out=one)  # noqa: E731
                cublas()
            except Exception as e:  # noqa: BLE001
                errors[f"cupy.matmul {M}x{N}x{K} {layout}"] = f"{type(e).__name__}: {e}"[:300]
                err, cublas = None, None
            # The three interleaved (A B C A B C ...): clocks drift by several percent over a run at
            # these shapes (bench/NOTES.md), and interleaving spreads the drift over all three.
            variants = {"cl": lambda: mg.gemm(a, bb, out=out, cluster=True),
                        "one": lambda: mg.gemm(a, bb, out=one, cluster=False)}
            if cublas:
                variants["cublas"] = cublas
            ts = {k: [] for k in variants}
            for _ in range(ROUNDS):
                for k, fn in variants.items():
                    ts[k] += gpu_time_ms(fn, reps=max(1, reps // ROUNDS))[1]
            t_cl, t_one = harness.median(ts["cl"]), harness.median(ts["one"])
            clustered = plan.use_cluster(M, N, K)
            t_mk = t_cl if clustered else t_one  # what mkernel.gemm runs by default
            t_cb = harness.median(ts["cublas"]) if cublas else None
            r = harness.row([M, N, K], t_mk, t_cb, bound_ms(M, N, K), layout=layout,
                            tflops=flops / t_mk * 1e-9, cublas_tflops=flops / t_cb * 1e-9 if t_cb else None,
                            rel_err=err, main=(M, N, K) in MAIN_SHAPES, dtype="bfloat16",
                            clustered=clustered, clustered_ms=t_cl, unclustered_ms=t_one,
                            clustered_speedup=t_cb / t_cl if t_cb else None,
                            unclustered_speedup=t_cb / t_one if t_cb else None, samples=len(ts["cl"]))
            rows.append(r)
            sp = f"{r['speedup']:.3f}" if r["speedup"] else "n/a"
            cb = f"{t_cb:8.3f} ms {r['cublas_tflops']:6.1f} TF/s" if t_cb else "n/a"
            sp_cl = f"{r['clustered_speedup']:.3f}" if t_cb else "n/a"
            sp_one = f"{r['unclustered_speedup']:.3f}" if t_cb else "n/a"
            print(f"{M:6d} {N:6d} {K:6d} {layout}  mkernel {t_mk:8.3f} ms {r['tflops']:6.1f} TF/s  cublas {cb}  "
                  f"speedup {sp} (clustered {t_cl:.3f} ms {sp_cl}, unclustered {t_one:.3f} ms {sp_one}"
                  f"{'' if clustered else '; default unclustered'})  "
                  f"err {err if err is None else format(err, '.1e')}", flush=True)

    for shape in (MAIN_SHAPES[:2] if opts.quick else MAIN_SHAPES + EXTRA_SHAPES):
        section(f"shape {shape}", lambda: shape_rows(*shape))

    sweep, tuning, flags_cost = [], [], {}

    def sweep_and_knobs():
        # Time against the number of SMs given to the GEMM.
        M, N, K = SWEEP_SHAPE
        a, b = rand((M, K), 20), rand((K, N), 21)
        out = cupy.empty((M, N), dtype=a.dtype)
        for s in (SWEEP_SMS[:3] if opts.quick else SWEEP_SMS):
            s = min(s, nsm)
            t = gpu_time_ms(lambda: mg.gemm(a, b, out=out, sms=s), reps=reps)[0]
            sweep.append({"sms": s, "mkernel_ms": t, "tflops": 2.0 * M * N * K / t * 1e-9})
            print(f"sms {s:4d}  {t:8.3f} ms  {sweep[-1]['tflops']:6.1f} TF/s", flush=True)
        # Knobs, for the next version: L2 grouping of the built-in order, all SMs vs the default CTAs.
        for kw in ({"group_m": 4}, {"group_m": 8}, {"group_m": 16}, {"group_m": 32}, {"sms": nsm}):
            t = gpu_time_ms(lambda: mg.gemm(a, b, out=out, **kw), reps=reps)[0]
            tuning.append({**kw, "mkernel_ms": t, "tflops": 2.0 * M * N * K / t * 1e-9})
            print(f"tuning {kw}: {t:.3f} ms {tuning[-1]['tflops']:.1f} TF/s", flush=True)
        # Cost of publishing per-tile flags (store completion + release store after every tile).
        flags = cupy.zeros(plan.tiles(M, N), dtype=cupy.uint32)
        t_plain = gpu_time_ms(lambda: mg.gemm(a, b, out=out), reps=reps)[0]
        t_flags = gpu_time_ms(lambda: mg.gemm(a, b, out=out, tile_flags=flags), reps=reps)[0]
        flags_cost.update(shape=[M, N, K], plain_ms=t_plain, flags_ms=t_flags, overhead=t_flags / t_plain - 1)
        print(f"flags: {t_plain:.3f} ms -> {t_flags:.3f} ms ({flags_cost['overhead'] * 100:+.1f}%)", flush=True)

    section("sm sweep / knobs / flags", sweep_and_knobs)

    def cluster_knobs():
        # The clustered kernel's built-in orders on every main shape and layout: M-tiles grouped by
        # 4 / 8 (the default) / 16, and N-tiles grouped by 8 (order='n').
        for (M, N, K) in MAIN_SHAPES:
            a = rand((M, K), 40)
            out = cupy.empty((M, N), dtype=a.dtype)
            for layout in ("kn", "nk"):
                b = rand((K, N), 41) if layout == "kn" else rand((N, K), 41).T
                for order, g in (("m", 4), ("m", 8), ("m", 16), ("n", 8)):
                    t = gpu_time_ms(lambda: mg.gemm(a, b, out=out, order=order, group_m=g, cluster=True),
                                    reps=reps)[0]
                    tuning.append({"shape": [M, N, K], "layout": layout, "variant": f"cluster order={order} group={g}",
                                   "mkernel_ms": t, "tflops": 2.0 * M * N * K / t * 1e-9})
                    print(f"cluster order {M}x{N}x{K} {layout} {order}{g}: {t:.3f} ms "
                          f"{tuning[-1]['tflops']:.1f} TF/s", flush=True)

    if not opts.quick:
        section("clustered kernel's tile orders", cluster_knobs)

    # Grouped mode: 32 groups, rows drawn around 1024.
    grouped = []
    rng = np.random.default_rng(7)
    counts = np.clip(rng.normal(GROUP_ROWS_MEAN, GROUP_ROWS_MEAN / 4, size=GROUPS).round(), 0,
                     2 * GROUP_ROWS_MEAN).astype(np.int32)
    total = int(counts.sum())
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])

    def grouped_row(N, K, name):
        G = len(counts)
        a, bs = rand((total, K), 30), rand((G, K, N), 31)
        out = cupy.empty((total, N), dtype=a.dtype)
        ref = cupy.empty_like(out)
        d_counts = cupy.asarray(counts)

        def per_group():
            for g in range(G):
                s, r = int(starts[g]), int(counts[g])
                if r:
                    cupy.matmul(a[s:s + r], bs[g], out=ref[s:s + r])

        per_group()
        mg.grouped_gemm(a, bs, d_counts, out=out)
        wait(f"grouped {name}")
        err = rel_err(out, ref)
        t_mk = gpu_time_ms(lambda: mg.grouped_gemm(a, bs, d_counts, out=out), reps=reps)[0]
        t_cb = gpu_time_ms(per_group, reps=reps)[0]
        flops = 2.0 * total * N * K
        r = harness.row([total, N, K], t_mk, t_cb, bound_ms(total, N, K, G), groups=G, name=name,
                        tflops=flops / t_mk * 1e-9, cublas_tflops=flops / t_cb * 1e-9, rel_err=err)
        grouped.append(r)
        print(f"grouped {name}: mkernel {t_mk:.3f} ms ({r['tflops']:.1f} TF/s), {G} x cupy.matmul {t_cb:.3f} ms "
              f"({r['cublas_tflops']:.1f} TF/s), speedup {r['speedup']:.2f}, err {err:.1e}", flush=True)

    for (N, K, name) in GROUPED_SHAPES:
        section(f"grouped {name}", lambda: grouped_row(N, K, name))

    png = harness.RESULTS / "gemm-1gpu.png"
    path = harness.write("gemm", rows, gpus=1, sm_sweep={"shape": list(SWEEP_SHAPE), "rows": sweep},
                         flags_cost=flags_cost, tuning=tuning, grouped=grouped, group_rows=counts.tolist(),
                         reps=reps, errors=errors, plot=os.path.relpath(png, ROOT))
    import json

    section("plot", lambda: plot(json.loads(Path(path).read_text()), png))

    print()
    print(harness.table(rows, [("shape", "shape", None), ("layout", "B", None), ("mkernel_ms", "mkernel ms", ".3f"),
                               ("baseline_ms", "cublas ms", ".3f"), ("tflops", "TF/s", ".1f"),
                               ("cublas_tflops", "cublas TF/s", ".1f"), ("speedup", "speedup", ".3f"),
                               ("clustered", "clustered", None), ("clustered_speedup", "cl speedup", ".3f"),
                               ("unclustered_speedup", "1-CTA speedup", ".3f"),
                               ("fraction_of_bound", "of bound", ".2f"), ("rel_err", "rel err", ".1e")]))
    main_rows = [r for r in rows if r["main"] and r["speedup"]]
    ok = all(r["rel_err"] is not None and r["rel_err"] < 1e-2 for r in rows + grouped)
    parts = [f"{len(main_rows)} main rows (6 shapes x 2 B layouts)"]
    for layout in ("kn", "nk"):
        sel = [r for r in main_rows if r["layout"] == layout]
        if sel:
            worst = min(sel, key=lambda r: r["speedup"])
            parts.append(f"B [{layout[0].upper()}, {layout[1].upper()}] speedup vs cuBLAS {worst['speedup']:.3f}-"
                         f"{max(r['speedup'] for r in sel):.3f}, min at {worst['shape']} (goal 0.95 "
                         f"{'met' if worst['speedup'] >= 0.95 else 'NOT met'}; clustered min "
                         f"{min(r['clustered_speedup'] for r in sel):.3f}, unclustered min "
                         f"{min(r['unclustered_speedup'] for r in sel):.3f})")
    if sweep:
        parts.append(f"sms {sweep[0]['sms']}->{sweep[-1]['sms']}: {sweep[0]['mkernel_ms']:.3f}->"
                     f"{sweep[-1]['mkernel_ms']:.3f} ms")
    if flags_cost:
        parts.append(f"flags {flags_cost['overhead'] * 100:+.1f}%")
    if grouped:
        parts.append("grouped speedup " + ", ".join(format(g["speedup"], ".2f") for g in grouped))
    parts.append("results " + ("correct" if ok else "WRONG"))
    if errors:
        parts.append(f"{len(errors)} sections FAILED: {', '.join(errors)}")
    parts.append(f"{os.path.relpath(path, ROOT)}, {time.time() - t_start:.0f} s")
    print("\nSUMMARY gemm: " + "; ".join(parts), flush=True)


if __name__ == "__main__":
    main()
