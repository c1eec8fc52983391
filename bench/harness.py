"""What every benchmark shares: CUDA-event timing, statistics, the bound, sections that fail alone,
plots, and the results file.

Results go to ``bench/results/<op>-<gpus>gpu[-<nodes>node].json`` as
``{"op", "device", "gpus", "nodes", "transport", "date", "commit", "rows": [...]}``; each row has at
least ``shape``, ``mkernel_ms``, ``baseline_ms``, ``speedup`` (baseline / mkernel) and ``bound_ms``.
"""

import datetime
import json
import math
import statistics
import subprocess
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPS = 30
WARMUP = 5
PEAK_TFLOPS = 989.4  # H100/H200 SXM dense bf16/fp16 tensor core peak


def require_gpu(script):
    """Ends the process with status 2 and one line naming ``script`` when no GPU is usable."""
    import sys

    from mkernel.runtime import gpu

    if gpu.device_count() == 0:
        print(f"{script} needs a GPU: {gpu.describe_missing()}", flush=True)
        sys.exit(2)


def wait(what, timeout_s=60.0):
    """The current stream's work finished, or the process ended naming ``what`` (a hung kernel)."""
    from mkernel.testing import sync_or_exit

    sync_or_exit(what, timeout_s)


def time_ms(fn, reps=REPS, warmup=WARMUP, stream=None):
    """CUDA-event timings (ms) of ``fn()`` on ``stream`` (default: the current stream)."""
    import cupy

    stream = stream or cupy.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    stream.synchronize()
    out = []
    for _ in range(reps):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        stop.record(stream)
        stop.synchronize()
        out.append(cupy.cuda.get_elapsed_time(start, stop))
    return out


def rand(shape, seed, dtype=None):
    """Deterministic normal values (the same on every GPU for the same seed) in ``dtype``
    (default bfloat16), rounded to nearest even on the bits where CuPy lacks bfloat16 casts."""
    import cupy
    import ml_dtypes
    import numpy as np

    dt = np.dtype(ml_dtypes.bfloat16) if dtype is None else np.dtype(dtype)
    x = cupy.random.RandomState(seed).standard_normal(shape, dtype=cupy.float32)
    if dt.name != "bfloat16":
        return x.astype(dt)
    u = x.view(cupy.uint32)
    return ((u + cupy.uint32(0x7FFF) + ((u >> 16) & cupy.uint32(1))) >> 16).astype(cupy.uint16).view(dt)


def as_float(x, dtype="float32"):
    """A 16-bit device array as float32 / float64 (bfloat16 through its bits where CuPy cannot cast)."""
    import cupy

    if x.dtype.name != "bfloat16":
        return x.astype(dtype)
    return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32).astype(dtype)


def take_rows(x, rows):
    """x[rows] for a 16-bit dtype (indexing through the bits)."""
    import cupy

    return x.view(cupy.uint16)[rows].view(x.dtype)


_spin = None


def spin(ns):
    """Keeps the current stream busy for ns nanoseconds (one thread on one SM). Its module loads at
    the first call: load_spin() first where an op between nodes may be in flight."""
    global _spin
    import cupy
    import numpy as np

    if _spin is None:
        _spin = cupy.RawKernel(r"""
extern "C" __global__ void mk_bench_spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}""", "mk_bench_spin")
    _spin((1,), (1,), (np.uint64(ns),))


def load_spin():
    """Loads spin()'s module now, the device idle: a module load blocks the proxy's copies until the
    device is idle, so one behind an op between nodes hangs it (docs/ARCHITECTURE.md)."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    spin(0)
    cupy.cuda.runtime.deviceSynchronize()


def launch_lead_ns(fn):
    """How long the stream must be kept busy so that the host has enqueued fn() before its start
    event fires: three times one call's host time, at least 100 us (synchronises the stream)."""
    import time

    import cupy

    cupy.cuda.get_current_stream().synchronize()
    t0 = time.perf_counter()
    fn()
    host_ns = (time.perf_counter() - t0) * 1e9
    cupy.cuda.get_current_stream().synchronize()
    return int(max(100e3, 3 * host_ns))


def hidden_launch_ms(fn, reps=REPS, warmup=WARMUP, timeout_s=300.0):
    """Median CUDA-event time of fn() on the current CuPy stream with the host's launch overhead
    hidden: each timed call is queued behind a spin kernel (launch_lead_ns), so the start event
    fires when the work is already in the stream. Returns (median, all timings)."""
    import cupy

    from mkernel.testing import sync_or_exit

    for _ in range(warmup):
        fn()
    pre = launch_lead_ns(fn)
    evs = []
    for _ in range(reps):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        spin(pre)
        start.record()
        fn()
        stop.record()
        evs.append((start, stop))
    sync_or_exit("timed loop", timeout_s)
    ts = [cupy.cuda.get_elapsed_time(a, b) for a, b in evs]
    return median(ts), ts


def median(xs):
    return float(statistics.median(xs))


def ci95(xs):
    """95% confidence interval of the median (order statistics; distribution-free)."""
    s = sorted(xs)
    n = len(s)
    half = 1.96 * math.sqrt(n) / 2
    lo, hi = max(0, int(math.floor(n / 2 - half))), min(n - 1, int(math.ceil(n / 2 + half)))
    return [float(s[lo]), float(s[hi])]


def device_name():
    try:
        import cupy
        p = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
        return p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
    except Exception:
        return "unknown"


def commit():
    """The commit measured: git's, or BENCH_COMMIT where the tree has no .git (the device machine
    receives a copy of the working tree without it)."""
    import os
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[1]
        rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def row(shape, mkernel_ms, baseline_ms, bound_ms, **extra):
    """One result row; baseline_ms None (no baseline measured) makes speedup None too."""
    r = {"shape": list(shape), "mkernel_ms": mkernel_ms, "baseline_ms": baseline_ms,
         "speedup": baseline_ms / mkernel_ms if mkernel_ms and baseline_ms is not None else None,
         "bound_ms": bound_ms,
         "fraction_of_bound": bound_ms / mkernel_ms if mkernel_ms and bound_ms else None}
    r.update(extra)
    return r


def sections(errors):
    """section(name, fn): fn()'s value, or None with its exception printed and kept in errors[name],
    so that one failing part of a benchmark does not lose the others' results."""
    def section(name, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001  (report it, keep the other sections)
            errors[name] = f"{type(e).__name__}: {e}"[:500]
            print(f"ERROR in {name}: {errors[name]}", flush=True)
            return None

    return section


def pyplot():
    """matplotlib.pyplot drawing into files (Agg), or None, said so, where matplotlib is not importable
    (a benchmark still writes its results)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"# matplotlib is not importable ({e}): no plot", flush=True)
        return None
    return plt


def save_plot(fig, path):
    """fig as a PNG at path (its folder made), closed; returns path."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def replot(results, plot):
    """``--plot JSON``: plot(doc, png) of an earlier results file, the PNG next to it; prints its path."""
    src = Path(results)
    print(plot(json.loads(src.read_text()), src.with_suffix(".png")))


def plot_rows(doc, path, label=None):
    """An op's results file (dict) as a PNG at path: per row (``label(row)``, default its name or
    shape) the speed over its baseline and the fraction of its bound, with 1.0 marked; for the
    benchmarks whose rows are not a curve (bench/ring_attention.py, bench/moe.py). None without
    matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    rows = [r for r in doc["rows"] if r.get("speedup")]
    label = label or (lambda r: r.get("name") or "x".join(map(str, r["shape"])))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4))
    xs = list(range(len(rows)))
    for off, key, name in ((-0.2, "speedup", "speed over the baseline"),
                           (0.2, "fraction_of_bound", "fraction of the bound")):
        vals = [r.get(key) or 0 for r in rows]
        ax.bar([x + off for x in xs], vals, width=0.4, label=name)
        for x, v in zip(xs, vals):
            ax.text(x + off, v, f"{v:.2f}", ha="center", va="bottom", fontsize=6.5)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(xs, [label(r) for r in rows], fontsize=7, rotation=30, ha="right")
    first = doc["rows"][0]
    ax.set_title(f"{doc['op']}: {doc.get('gpus')} GPU(s), {first.get('world', '')} ranks, {doc.get('nodes', 1)} "
                 f"node(s), {doc.get('transport')}{' under MPS' if first.get('mps') else ''}; "
                 f"{doc.get('device')}, commit {doc.get('commit')}", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return save_plot(fig, path)


def result_name(op, gpus, nodes=1, ranks_per_gpu=1):
    """bench/results/ file name: <op>-<N>gpu, or <op>-<N>rank-mps for ranks sharing GPUs under MPS
    (-timesliced without it: lockstep figures, kept apart), then -<nodes>node between nodes."""
    from mkernel.runtime.gpu import mps_client

    base = f"{op}-{gpus}gpu"
    if ranks_per_gpu > 1:
        base = f"{op}-{gpus * ranks_per_gpu}rank-" + ("mps" if mps_client() else "timesliced")
    return base + (f"-{nodes}node" if nodes > 1 else "") + ".json"


def write(op, rows, *, gpus, nodes=1, transport="none", out_dir=None, **extra):
    name = result_name(op, gpus, nodes, extra.get("ranks_per_gpu", 1))
    doc = {"op": op, "device": device_name(), "gpus": gpus, "nodes": nodes, "transport": transport,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit(), "rows": rows}
    doc.update(extra)
    path = Path(out_dir or RESULTS) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def table(rows, cols):
    """A fixed-width text table of ``rows`` (dicts) with ``cols`` [(key, header, format)]."""
    head = "  ".join(f"{h:>{max(len(h), 10)}s}" for _, h, _ in cols)
    lines = [head]
    for r in rows:
        cells = []
        for key, h, fmt in cols:
            v = r.get(key)
            cells.append(f"{(format(v, fmt) if v is not None and fmt else str(v)):>{max(len(h), 10)}s}")
        lines.append("  ".join(cells))
    return "\n".join(lines)
