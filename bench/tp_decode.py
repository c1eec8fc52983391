#!/usr/bin/env python3
"""gemm_allreduce at decode sizes (issue 26), one node: the op against its parts, side by side in one run.
Per-rank shapes M in {1, 16, 64, 128, 256} x N 8192 x K 4096 (bf16, B as the weights [N, K], ``w.T``).
Columns: mkernel_ms (the op, its faster path for the shape: ``latency`` always, ``fused`` where M
splits over the ranks; both reported), gemm_ms (mkernel.gemm alone), allreduce_ms (mkernel.allreduce of
the [M, N] output alone), unfused_ms (the GEMM, then mkernel.allreduce: the baseline). Every figure
with all ranks doing the same at once; under MPS by bench/mps_timing.py's rule (device barrier, batches
of 50). Goals (issue 26): mkernel_ms <= gemm_ms + 8 us on every row, and unfused_ms - mkernel_ms >= 0.5
x allreduce_ms. bound_ms: :func:`bound_ms` (this rank's bytes at the copy rate measured in the run, or
its FLOPs at its SMs' share of the tensor peak). graph_ms: the device's time per call (50 calls in a
CUDA graph); host_us: the host's time to issue one call; variants_ms: the same calls under other
settings (the latency path's two-kernel, LL and LL-overlapped forms up to 128 rows, mkernel.allreduce
as LL words and as data + flags, the decode kernel's row blocks of 64 and 128). Under MPS also
gemm_synced_ms: one GEMM started on every rank at once after a device barrier (the slowest rank's
median), which a collective that synchronises every call pays (the ranks' kernels compete for SMs), and
over_synced_gemm_us.

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

MS = (1, 16, 64, 128, 256)
NK = ((8192, 4096),)


def host_us(fn, n=50):
    """Host time per call of ``fn`` (n calls issued back to back, not waited for): the launch path's
    cost, which bounds an eager call's time where it exceeds the device's."""
    import time

    import cupy

    cupy.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    cupy.cuda.get_current_stream().synchronize()
    return (t1 - t0) / n * 1e6


def bound_ms(M, N, K, W, rate, sms, full_sms=132):
    """The longer of this rank's bytes over ``rate`` (a copy's bytes read + written per second, every
    rank copying at once: reads stream at least that fast) and its FLOPs at ``sms`` / ``full_sms`` of
    the tensor peak. Bytes: the weights, the activations and the output once, and the all-reduce's
    least traffic (its output out to and the peers' outputs in from the W - 1 other ranks)."""
    nbytes = 2 * (N * K + M * K + M * N + 2 * (W - 1) * M * N)
    return max(nbytes / rate, 2.0 * M * N * K / (harness.PEAK_TFLOPS * 1e12 * sms / full_sms)) * 1e3


def copy_rate(timed):
    """Bytes read + written per second of a 1 GiB device copy, every rank copying at once."""
    import cupy

    src, dst = cupy.ones(1 << 30, cupy.uint8), cupy.empty(1 << 30, cupy.uint8)
    ms = timed(lambda: cupy.copyto(dst, src), 5)
    return 2 * src.nbytes / (ms * 1e-3)


GOAL_OVER_GEMM_US, GOAL_HIDDEN = 8.0, 0.5


def plot(result, path):
    """Per M: the op's time over the GEMM alone (goal: 8 us) and the share of the all-reduce it hides
    (goal: half), and the times of the op, the GEMM, the all-reduce and the unfused path, from a
    results dict (the JSON this script writes)."""
    plt = harness.pyplot()
    if plt is None:
        return None
    rows = sorted(result["rows"], key=lambda r: r["shape"][0])
    ms = [r["shape"][0] for r in rows]
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"wspace": 0.35})
    ax.plot(ms, [r["over_gemm_us"] for r in rows], "-o", ms=3, label="op - GEMM alone")
    ax.axhline(GOAL_OVER_GEMM_US, color="r", lw=0.8, ls="--", label=f"goal {GOAL_OVER_GEMM_US:g} us")
    ax.set_ylabel("us")
    bx.plot(ms, [r["allreduce_hidden"] for r in rows], "-o", ms=3, label="(unfused - op) / all-reduce alone")
    bx.axhline(GOAL_HIDDEN, color="r", lw=0.8, ls="--", label=f"goal {GOAL_HIDDEN:g}")
    bx.set_ylabel("share of the all-reduce hidden")
    for key, name in (("mkernel_ms", "op (best path)"), ("gemm_ms", "GEMM alone"), ("allreduce_ms", "all-reduce alone"),
                      ("unfused_ms", "GEMM, then all-reduce"), ("bound_ms", "bound")):
        cx.plot(ms, [r[key] * 1e3 for r in rows], "-o" if key != "bound_ms" else "--", ms=3, label=name)
    cx.set_ylabel("us")
    for x in (ax, bx, cx):
        x.set_xscale("log", base=2)
        x.set_xlabel("M (rows per rank)")
        x.grid(alpha=0.3)
        x.legend(fontsize=7)
    n, k = rows[0]["shape"][1:]
    fig.suptitle(f"gemm_allreduce at decode sizes, N {n}, K {k}, {result.get('gpus')} GPU(s), {rows[0]['world']} "
                 f"ranks{' under MPS' if rows[0].get('mps') else ''}, {result.get('device')}, commit "
                 f"{result.get('commit')}", fontsize=10)
    return harness.save_plot(fig, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="M 1 and 64 only")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of an earlier results file, next to it")
    args = ap.parse_args()
    if args.plot:
        return harness.replot(args.plot, plot)
    import cupy
    import ml_dtypes
    from mpi4py import MPI

    import mkernel
    from mkernel import config
    from mkernel.ops import gemm_allreduce_ll as ll
    from mkernel.runtime import launch

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
    sms = launch.device_sms()  # under MPS the client's share
    rows = []
    shapes = [(m, n, k) for n, k in NK for m in ((1, 64) if args.quick else MS)]
    for M, N, K in shapes:
        a = harness.rand((M, K), 1 + comm.rank, dt)
        w = harness.rand((N, K), 100 + comm.rank, dt)
        out, part = cupy.empty((M, N), dt), cupy.empty((M, N), dt)
        paths = ("latency", "fused") if M % W == 0 else ("latency",)
        f = {p: (lambda p=p: mkernel.gemm_allreduce(a, w.T, comm=comm, out=out, path=p)) for p in paths}
        knobs = {}  # the variants' settings, entered once around each measurement (not per call: a
        # new configuration object per call would void the recorded launches and time the full path)
        if M <= ll.M_TILES[-1]:  # the two latency forms side by side, whichever the default takes
            most = ll.M_TILES[-1]
            knobs = {"latency_2k": {"tp_latency_ll_max_rows": 0}, "latency_ll": {"tp_latency_ll_max_rows": most},
                     "latency_overlap": {"tp_latency_ll_max_rows": most, "tp_latency_ll_overlap": True}}
            for p in knobs:
                f[p] = f["latency"]
        f["gemm"] = lambda: mkernel.gemm(a, w.T, out=part)
        if M <= config.get().gemm_decode_max_m:  # the decode kernel's row blocks, side by side
            for rb in (64, 128):
                knobs[f"gemm_rows{rb}"] = {"gemm_decode_rows": rb}
                f[f"gemm_rows{rb}"] = f["gemm"]
                if M <= config.get().tp_latency_ll_max_rows:
                    knobs[f"latency_rows{rb}"] = {"gemm_decode_rows": rb}
                    f[f"latency_rows{rb}"] = f["latency"]
        f["allreduce"] = lambda: mkernel.allreduce(part, comm=comm, out=out)
        for name, most in (("allreduce_ll", 1 << 40), ("allreduce_flags", 0)):  # its two modes, side by side
            knobs[name] = {"allreduce_ll_max_bytes": most}
            f[name] = f["allreduce"]
        f["unfused"] = lambda: (mkernel.gemm(a, w.T, out=part), mkernel.allreduce(part, comm=comm, out=out))
        results = {}
        extra = tuple(p for p in ("latency_2k", "latency_ll", "latency_overlap", "latency_rows64", "latency_rows128")
                      if p in f)
        checked = paths + ("unfused",) + extra
        for p in checked:  # every path gives the same sum (partials rounded alike: the same bits)
            with config.override(**knobs.get(p, {})):
                f[p]()
            cupy.cuda.get_current_stream().synchronize()
            comm.check()
            results[p] = harness.as_float(out, "float64")
        diff = max(float(cupy.linalg.norm(results[p] - results["unfused"]) / cupy.linalg.norm(results["unfused"]))
                   for p in checked if p != "unfused")
        t, host = {}, {}
        for p, fn in f.items():
            with config.override(**knobs.get(p, {})):
                t[p], host[p] = timed(fn), host_us(fn)
        # The GEMM started on every rank at once (a device barrier, one call): what a collective that
        # synchronises every call pays for its GEMM under MPS (the ranks' kernels compete for SMs)
        synced = cc.synced_ms(comm, barrier, f["gemm"]) if shared else None
        graph = {}  # the device's time per call (n calls in one CUDA graph): what the host's launch work hides
        if shared:
            for p in ("latency", "gemm", "allreduce", "allreduce_ll", "allreduce_flags") + extra + \
                    tuple(p for p in f if p.startswith("gemm_rows")):
                try:
                    with config.override(**knobs.get(p, {})):
                        graph[p] = cc.graph_batch_ms(comm, barrier, f[p])
                except Exception as e:  # noqa: BLE001  (a capture that fails is reported, not fatal)
                    graph[p] = f"capture failed: {type(e).__name__}: {e}"[:200]
        best = min(paths, key=t.__getitem__)
        bound = bound_ms(M, N, K, W, rate, sms)
        hidden = (t["unfused"] - t[best]) / t["allreduce"]
        rows.append(harness.row((M, N, K), t[best], t["unfused"], bound, latency_ms=t["latency"],
                                fused_ms=t.get("fused"), gemm_ms=t["gemm"], allreduce_ms=t["allreduce"],
                                unfused_ms=t["unfused"], latency_two_kernels_ms=t.get("latency_2k"),
                                latency_ll_ms=t.get("latency_ll"),
                                latency_overlap_ms=t.get("latency_overlap"), best_path=best,
                                allreduce_hidden=hidden,
                                over_gemm_us=(t[best] - t["gemm"]) * 1e3, gemm_synced_ms=synced,
                                over_synced_gemm_us=None if synced is None else (t[best] - synced) * 1e3,
                                rel_diff_unfused=diff, mps=bool(shared),
                                world=W, baseline="mkernel.gemm then mkernel.allreduce", graph_ms=graph,
                                variants_ms={p: t[p] for p in knobs},
                                host_us=host))
        if comm.rank == 0:
            r = rows[-1]
            fused = f"{t['fused'] * 1e3:8.1f}" if "fused" in t else "     n/a"
            print(f"{M:4d} {N:6d} {K:6d}  latency {t['latency'] * 1e3:8.1f} us  fused {fused} us  gemm "
                  f"{t['gemm'] * 1e3:7.1f} us  allreduce {t['allreduce'] * 1e3:6.1f} us  unfused "
                  f"{t['unfused'] * 1e3:8.1f} us  over gemm {r['over_gemm_us']:6.1f} us  (over the GEMM started "
                  f"at once {r['over_synced_gemm_us'] if synced is None else round(r['over_synced_gemm_us'], 1)} us)  "
                  f"hidden {hidden:5.2f}  "
                  f"rel diff {diff:.1e}  graph {graph}  host us {({p: round(v, 1) for p, v in host.items()})}",
                  flush=True)
        comm.release_plans()
    gpus = len(set(comm.mpi.allgather(comm.device_id)))  # every rank: a collective
    if comm.rank == 0:
        path = harness.write("gemm_allreduce_decode", rows, gpus=gpus, out_dir=args.out, ranks_per_gpu=W // gpus,
                             transport="nvlink", copy_rate_TBps=rate / 1e12, sms_per_rank=sms)  # one node
        sp = [r["speedup"] for r in rows]
        met = all(r["over_gemm_us"] <= GOAL_OVER_GEMM_US and r["allreduce_hidden"] >= GOAL_HIDDEN for r in rows)
        import json

        print(f"plot: {plot(json.loads(path.read_text()), path.with_suffix('.png'))}", flush=True)
        print(f"SUMMARY tp_decode: {len(rows)} rows, geomean speedup {float(np.exp(np.mean(np.log(sp)))):.3f}, "
              f"latency best on {sum(r['best_path'] == 'latency' for r in rows)}, most over gemm "
              f"{max(r['over_gemm_us'] for r in rows):.1f} us, least hidden "
              f"{min(r['allreduce_hidden'] for r in rows):.2f}; goals met: {met}; {path}")
    comm.close()


if __name__ == "__main__":
    main()
