#!/usr/bin/env python3
"""Attention benchmark: mkernel.attention against PyTorch SDPA's cuDNN backend, one GPU, one process.

Rows (batch 1, bf16, S_q = S_kv = tokens, H_kv = H_q): 32 heads x D 128 and 64 heads x D 64, at
4096, 8192 and 32768 tokens, causal and not (12 rows), plus a grouped-query row pair (32 query /
8 kv heads, 8192 tokens). Both libraries read the SAME device arrays: built with CuPy as
[B, S, H, D], handed to torch through DLPack and permuted to the [B, H, S, D] view SDPA takes
(strided; nothing is copied), on one shared CUDA stream. mkernel's output is compared with
cuDNN's before anything is timed. Median of at least 20 CUDA-event timings after warm-up, each
queued behind a spin kernel so that host launch overhead is not timed (as bench/gemm.py).

FLOPs = 4 * S_q * S_kv * H_q * D, halved for causal (the FlashAttention convention); bound_ms is
that at the dense bf16 peak (989.4 TFLOP/s). Goal: fraction_of_cudnn (mkernel TFLOP/s / cuDNN
TFLOP/s) >= 0.80 on every row. Writes bench/results/attention-1gpu.json (and a PNG of TFLOP/s
against tokens where matplotlib is importable); prints a table, and a one-line summary last.
Without torch the baseline is recorded as null (and said so).

    python3 bench/attention.py [--quick] [--reps N] [--no-gqa]
"""

import argparse
import contextlib
import importlib
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


import harness  # noqa: E402
from harness import PEAK_TFLOPS, rand, wait  # noqa: E402  (rand: bf16)
from harness import hidden_launch_ms as gpu_time_ms  # noqa: E402

GOAL = 0.80          # fraction of cuDNN's TFLOP/s, every row
MAX_REL_ERR = 1e-2   # mkernel vs cuDNN, relative Frobenius norm
TOKENS = (4096, 8192, 32768)
HEADS = ((32, 128), (64, 64))  # (H_q = H_kv, D)
# (S, H_q, H_kv, D, causal)
MAIN_SHAPES = [(S, H, H, D, c) for (H, D) in HEADS for S in TOKENS for c in (False, True)]
GQA_SHAPES = [(8192, 32, 8, 128, False), (8192, 32, 8, 128, True)]
QUICK_SHAPES = [(4096, 32, 32, 128, False), (4096, 32, 32, 128, True)]
QUICK_REPS = 20


def flops(S_q, S_kv, H_q, D, causal):
    return 4.0 * S_q * S_kv * H_q * D * (0.5 if causal else 1.0)


def bound_ms(fl):
    return fl / (PEAK_TFLOPS * 1e12) * 1e3


# --------------------------------------------------------------------------- torch (baseline)
class Torch:
    """PyTorch SDPA restricted to the cuDNN backend, on the benchmark's CuPy stream."""

    def __init__(self, cupy_stream):
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        self.torch, self.F = torch, F
        self.stream = torch.cuda.ExternalStream(cupy_stream.ptr)
        self._backend = lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION])
        self.version = torch.__version__
        self.cudnn = torch.backends.cudnn.version()

    @contextlib.contextmanager
    def context(self):
        """torch work on the CuPy stream, SDPA limited to cuDNN (it raises rather than falls back)."""
        with self.torch.cuda.stream(self.stream), self._backend():
            yield

    def tensor(self, x):
        """A torch view of a CuPy bf16 array (DLPack; no copy)."""
        import cupy

        torch = self.torch
        try:
            t = torch.from_dlpack(x)
            if t.dtype == torch.bfloat16:
                return t
        except Exception:  # noqa: BLE001, S110  (a CuPy that exports no bfloat16: go through the bits)
            pass
        return torch.from_dlpack(x.view(cupy.int16)).view(torch.bfloat16)

    def sdpa(self, qt, kt, vt, causal, gqa):
        kw = {"is_causal": causal}
        if gqa:
            kw["enable_gqa"] = True
        return self.F.scaled_dot_product_attention(qt, kt, vt, **kw)

    def rel_err(self, x, ref):
        x32, r32 = x.float(), ref.float()
        return float((x32 - r32).norm() / r32.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------- plot
def plot(rows, path, device):
    plt = harness.pyplot()
    if plt is None:
        return None
    groups = sorted({tuple(r["shape"][1:]) for r in rows})
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (Hq, Hkv, D, causal) in enumerate(groups):
        rs = sorted((r for r in rows if tuple(r["shape"][1:]) == (Hq, Hkv, D, causal)), key=lambda r: r["shape"][0])
        xs = [r["shape"][0] for r in rs]
        name = f"H {Hq}/{Hkv} D {D} {'causal' if causal else 'full'}"
        ax.plot(xs, [r["tflops"] for r in rs], "-o", color=f"C{i}", label=f"mkernel {name}")
        cd = [r["cudnn_tflops"] if r["cudnn_tflops"] is not None else math.nan for r in rs]
        if not all(math.isnan(c) for c in cd):
            ax.plot(xs, cd, "--s", color=f"C{i}", alpha=0.7, label=f"cuDNN {name}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("tokens (S_q = S_kv, batch 1)")
    ax.set_ylabel("TFLOP/s (causal: half the FLOPs)")
    ax.set_title(f"attention forward, bf16: mkernel (solid) vs cuDNN SDPA (dashed), {device}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return harness.save_plot(fig, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help=f"two rows, {QUICK_REPS} reps (smoke run)")
    ap.add_argument("--reps", type=int, default=harness.REPS)
    ap.add_argument("--no-gqa", action="store_true", help="leave out the grouped-query rows")
    opts = ap.parse_args()

    harness.require_gpu("bench/attention.py")
    import cupy

    ma = importlib.import_module("mkernel.engines.attention")  # the module (mkernel.attention is also the function)

    reps = QUICK_REPS if opts.quick else max(20, opts.reps)
    shapes = QUICK_SHAPES if opts.quick else MAIN_SHAPES + ([] if opts.no_gqa else GQA_SHAPES)
    t_start = time.time()
    errors = {}
    section = harness.sections(errors)
    stream = cupy.cuda.Stream(non_blocking=True)  # mkernel, torch, the spin kernel and the events
    with stream:
        # Compile / load once, and prove the kernel finishes before anything is timed.
        q0, k0 = rand((1, 256, 4, 128), 1), rand((1, 256, 4, 128), 2)
        ma.attention(q0, k0, k0)
        ma.attention(q0, k0, k0, causal=True)
        wait("first launch")
        nsm = cupy.cuda.Device().attributes["MultiProcessorCount"]
        print(f"# device {harness.device_name()} ({nsm} SMs), setup {time.time() - t_start:.1f} s", flush=True)

        try:
            tb = Torch(stream)
            print(f"# baseline: torch {tb.version} SDPA, cuDNN backend only (cuDNN {tb.cudnn})", flush=True)
            baseline_note = None
        except Exception as e:  # noqa: BLE001  (no torch: mkernel is still timed)
            tb = None
            baseline_note = f"torch is not usable ({type(e).__name__}: {e})"
            print(f"# NO BASELINE: {baseline_note}; baseline_ms / cudnn_tflops recorded as null", flush=True)
        print(f"# goal: fraction_of_cudnn >= {GOAL:.2f} on every row; median of {reps} timings", flush=True)
        rows = []

        def shape_row(i, S, Hq, Hkv, D, causal):
            q = rand((1, S, Hq, D), 10 * i + 1)
            k = rand((1, S, Hkv, D), 10 * i + 2)
            v = rand((1, S, Hkv, D), 10 * i + 3)
            out = cupy.empty_like(q)

            def mk():
                ma.attention(q, k, v, causal=causal, out=out)

            mk()
            wait(f"mkernel {S} {Hq}/{Hkv} {D} {causal}")
            fl = flops(S, S, Hq, D, causal)
            err, t_cd = None, None
            if tb is not None:
                try:  # cuDNN's result and time (if it cannot run this shape, mkernel is still timed)
                    with tb.context():
                        qt, kt, vt = (tb.tensor(x).permute(0, 2, 1, 3) for x in (q, k, v))  # [B, H, S, D] views

                        def cd():
                            return tb.sdpa(qt, kt, vt, causal, Hkv != Hq)

                        ref = cd()
                        wait(f"cudnn {S} {Hq}/{Hkv} {D} {causal}")
                        err = tb.rel_err(tb.tensor(out).permute(0, 2, 1, 3), ref)
                        del ref
                        t_cd = gpu_time_ms(cd, reps=reps)[0]
                except Exception as e:  # noqa: BLE001
                    name = f"cudnn {[S, Hq, Hkv, D, causal]}"
                    errors[name] = f"{type(e).__name__}: {e}"[:300]
                    print(f"ERROR in {name}: {errors[name]}", flush=True)
                    err, t_cd = None, None
            t_mk = gpu_time_ms(mk, reps=reps)[0]
            tf = fl / t_mk * 1e-9
            tf_cd = fl / t_cd * 1e-9 if t_cd else None
            r = harness.row([S, Hq, Hkv, D, causal], t_mk, t_cd, bound_ms(fl), tflops=tf, cudnn_tflops=tf_cd,
                            fraction_of_cudnn=tf / tf_cd if tf_cd else None, rel_err=err, flops=fl,
                            main=(S, Hq, Hkv, D, causal) in MAIN_SHAPES, dtype="bfloat16",
                            name=f"{S} {Hq}/{Hkv} {D} {'causal' if causal else 'full'}")
            rows.append(r)
            cds = f"{t_cd:8.3f} ms {tf_cd:6.1f} TF/s" if t_cd else "n/a"
            frac = f"{r['fraction_of_cudnn']:.3f}" if r["fraction_of_cudnn"] else "n/a"
            print(f"{S:6d} H {Hq:2d}/{Hkv:<2d} D {D:3d} {'causal' if causal else 'full  '}  mkernel {t_mk:8.3f} ms "
                  f"{tf:6.1f} TF/s  cudnn {cds}  of cudnn {frac}  err {err if err is None else format(err, '.1e')}",
                  flush=True)

        for i, shape in enumerate(shapes):
            section(f"shape {list(shape)}", lambda i=i, shape=shape: shape_row(i, *shape))
            cupy.get_default_memory_pool().free_all_blocks()  # this row's arrays, before the next row's
            if tb is not None:
                tb.torch.cuda.empty_cache()

    png = None
    if rows:
        png = section("plot", lambda: plot(rows, harness.RESULTS / "attention-1gpu.png", harness.device_name()))
    path = harness.write("attention", rows, gpus=1, reps=reps, errors=errors, goal_fraction_of_cudnn=GOAL,
                         peak_tflops=PEAK_TFLOPS, baseline="torch SDPA, cuDNN backend (SDPBackend.CUDNN_ATTENTION)",
                         baseline_note=baseline_note, torch=tb.version if tb else None,
                         cudnn=tb.cudnn if tb else None, plot=os.path.relpath(png, ROOT) if png else None)

    print()
    print(report(rows, len(shapes), errors, baseline_note, path, time.time() - t_start), flush=True)

TABLE = [("name", "shape (S H_q/H_kv D mask)", None), ("mkernel_ms", "mkernel ms", ".3f"),
         ("baseline_ms", "cudnn ms", ".3f"),
         ("tflops", "TF/s", ".1f"), ("cudnn_tflops", "cudnn TF/s", ".1f"), ("fraction_of_cudnn", "of cudnn", ".3f"),
         ("speedup", "speedup", ".3f"), ("fraction_of_bound", "of peak", ".2f"), ("rel_err", "rel err", ".1e")]


def report(rows, n_shapes, errors, baseline_note, path, seconds):
    """The table, then the one-line SUMMARY (last)."""
    parts = [f"{len(rows)}/{n_shapes} rows"]
    compared = [r for r in rows if r["fraction_of_cudnn"] is not None]
    if compared:
        worst = min(compared, key=lambda r: r["fraction_of_cudnn"])
        below = [r for r in compared if r["fraction_of_cudnn"] < GOAL]
        verdict = f"NOT met on {len(below)} rows" if below else "met" if len(compared) == n_shapes else \
            f"unknown on {n_shapes - len(compared)} rows"
        parts.append(f"fraction of cuDNN min {worst['fraction_of_cudnn']:.3f} at {worst['shape']} "
                     f"(goal >= {GOAL:.2f} on every row: {verdict})")
    else:
        parts.append(f"no cuDNN baseline ({baseline_note or 'every cuDNN row failed'})")
    if rows:
        best = max(rows, key=lambda r: r["tflops"])
        parts.append(f"mkernel max {best['tflops']:.0f} TF/s at {best['shape']}")
    checked = [r for r in rows if r["rel_err"] is not None]
    if not checked:
        parts.append("results unchecked (no baseline)")
    else:
        ok = all(r["rel_err"] < MAX_REL_ERR for r in checked)
        parts.append(f"results {'correct' if ok else 'WRONG'} vs cuDNN ({len(checked)} rows, max rel err "
                     f"{max(r['rel_err'] for r in checked):.1e})")
    if errors:
        parts.append(f"{len(errors)} sections FAILED: {', '.join(errors)}")
    parts.append(f"{os.path.relpath(path, ROOT)}, {seconds:.0f} s")
    return harness.table(rows, TABLE) + "\n\nSUMMARY attention: " + "; ".join(parts)

if __name__ == "__main__":
    main()
