#!/usr/bin/env python3
"""Where a GEMM call's time goes (issue 26: the decode kernel's ~7 us over its bytes at the copy rate
where cuBLAS has ~5, its idle SMs at 128 tokens; the engine's ~8 us beyond its k-blocks at 256 tokens
and on the odd shapes), from the kernels' trace spans, the call's kept plan relaunched in trace mode.
Each call follows an L2 flush, as in bench/gemm_decode.py. Medians over the calls, microseconds from
the earliest stamp (t0), min / median / max over the CTAs where three figures are given:

  event      the traced call's CUDA-event time (untraced: `plain`; cuBLAS: `cublas`)
  outside    event - the last CTA's last stamp: the launch's latency and the kernel's exit
  floor      the same launch (grid, block, dynamic shared memory) of an empty kernel whose CTAs
             stamp their entry and exit: its event - (last exit - first entry), the part of
             'outside' no kernel of that shape avoids; `floor0` with no shared memory (a
             difference is the SMs' shared-memory reconfiguration after the flush's kernel)
The decode kernel (stamps of warp 0's lane 0, gemm_decode_args.cuh MK_DECODE_TRACE):
  entry      CTAs' entries (a late CTA waited for an SM)
  landed     each CTA's first stage landed: the descriptor fetch and the first TMA round trip
  mma_end    the CTA's last wgmma group done: a spread is uneven shares of HBM
  partial    a shared block's slot stores and arrival (median length)
  sum        the last CTA of a shared block: its slots added and the values stored (median length)
  store      a block one CTA covers whole: its values stored (median length)
  end        the CTA's last stamp
  rate       B's bytes / (median mma_end - median landed), TB/s
The engine (gemm_mainloop.cuh's span per tile: its ring entry taken to its epilogue issued):
  start      the CTA's first tile taken (after its claim and the producer's ring entry)
  tiles      tiles (or split K's ranges) per CTA (max)
  first      the first tile's length (median): the fill, its k-blocks and epilogue
  later      a later tile's length (median)
  end        the CTA's last tile's epilogue issued

    python3 tools/gemm_phases.py [--shapes 1x8192x8192,256x8192x8192] [--calls 30] [--rows 64]
"""

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TRACE, PH_FILL, PH_MMA, PH_PARTIAL, PH_OUT = 0x20000000, 0, 1, 2, 3  # gemm_decode_args.cuh
FLUSH_BYTES = 256 << 20
EMPTY_SRC = r"""
extern "C" __global__ void empty_stamps(unsigned long long* t) {
  unsigned long long x;
  if (threadIdx.x == 0) { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(x)); t[2 * blockIdx.x] = x; }
  __syncthreads();
  if (threadIdx.x == 0) { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(x)); t[2 * blockIdx.x + 1] = x; }
}
"""
SHAPES = ("1x8192x8192,16x8192x8192,64x8192x8192,128x8192x8192,1x14336x4096,256x8192x8192,256x10240x8192,"
          "3000x1000x520,1000x3000x2000")


def per_cta(spans, decode):
    """{block: [(phase, id, start, end)] in the order written}: the decode stamps (phase, row block), or
    the engine's tile spans (phase 0, tile id), of trace.Trace.spans() tuples (in slot order: a CTA's
    one writer takes its slots in order, where equal clock readings could not order them)."""
    ctas = {}
    for start, end, _sm, block, role, ident in spans:
        if role != 0 or (ident & 0xF0000000 == TRACE) != decode or (not decode and ident & 0xF0000000):
            continue
        phase, ident = ((ident >> 24) & 0xF, ident & 0xFFFFFF) if decode else (0, ident)
        ctas.setdefault(block, []).append((phase, ident, start, end))
    return {b: ctas[b] for b in sorted(ctas)}


def decode_phases(ctas):
    """One decode call's figures (ns; see the module's docstring) from per_cta's result."""
    t0 = min(s[2] for v in ctas.values() for s in v)
    after = [(p[0], s) for v in ctas.values() for p, s in zip([(None,)] + v, v) if s[0] == PH_OUT]
    return {"entry": [min(s[2] for s in v) - t0 for v in ctas.values()],
            "landed": [min(s[3] for s in v if s[0] == PH_FILL) - t0 for v in ctas.values()],
            "mma_end": [max(s[3] for s in v if s[0] == PH_MMA) - t0 for v in ctas.values()],
            "end": [max(s[3] for s in v) - t0 for v in ctas.values()],
            "partial": [s[3] - s[2] for v in ctas.values() for s in v if s[0] == PH_PARTIAL],
            "store": [s[3] - s[2] for p, s in after if p != PH_PARTIAL],
            "sum": [s[3] - s[2] for p, s in after if p == PH_PARTIAL]}


def engine_phases(ctas):
    """One engine call's figures (ns) from per_cta's result."""
    t0 = min(s[2] for v in ctas.values() for s in v)
    return {"start": [v[0][2] - t0 for v in ctas.values()], "tiles": [len(v) for v in ctas.values()],
            "first": [v[0][3] - v[0][2] for v in ctas.values()],
            "later": [s[3] - s[2] for v in ctas.values() for s in v[1:]],
            "end": [max(s[3] for s in v) - t0 for v in ctas.values()]}


def spread(figs, key):
    """min / median / max over the CTAs, each the median over the calls, in us."""
    med = lambda f: statistics.median(f(x[key]) for x in figs)  # noqa: E731
    return f"{med(min) / 1e3:.2f}/{med(statistics.median) / 1e3:.2f}/{med(max) / 1e3:.2f}"


def pooled(figs, key):
    """The median of every CTA's value over every call, in us ('-' where there is none)."""
    xs = [v for x in figs for v in x[key]]
    return f"{statistics.median(xs) / 1e3:.2f}" if xs else "-"


def launch_floor(grid, block, smem, calls, flush):
    """The median over `calls` (each after a flush) of an empty kernel's event time less its CTAs'
    span (last exit - first entry), in ns: launch latency and exit at this grid, block and shared memory."""
    import cupy

    fn = cupy.RawKernel(EMPTY_SRC, "empty_stamps")
    fn.max_dynamic_shared_size_bytes = smem
    t = cupy.zeros(2 * grid[0], cupy.uint64)
    outs = []
    for _ in range(calls):
        flush()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn(grid, block, (t,), shared_mem=smem)
        stop.record()
        stop.synchronize()
        stamps = t.get()
        outs.append(cupy.cuda.get_elapsed_time(start, stop) * 1e6 - float(stamps[1::2].max() - stamps[0::2].min()))
    return statistics.median(outs[3:])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--rows", type=int, default=0, help="config.gemm_decode_rows (0: by shape)")
    args = p.parse_args()
    os.environ.setdefault("MKERNEL_TRACE", os.path.join(tempfile.gettempdir(), "mk_gemm_trace"))
    import cupy

    from harness import rand, require_gpu

    require_gpu("tools/gemm_phases.py")
    from gemm_decode import flushed_ms, rel_err

    from mkernel import config
    from mkernel.engines import gemm as mg
    from mkernel.engines.gemm_decode import MkDecodeArgs
    from mkernel.runtime import launch
    from mkernel.runtime.trace import Trace

    flush_words = cupy.ones(FLUSH_BYTES // 8, cupy.uint64)
    flush = lambda: flush_words.max()  # noqa: E731  (bench/gemm_decode.py's flush)
    trace = Trace(0)
    for shape in args.shapes.split(","):
        M, N, K = (int(x) for x in shape.split("x"))
        a, w = rand((M, K), 10), rand((N, K), 11)
        out, ref = cupy.empty((M, N), a.dtype), cupy.empty((M, N), a.dtype)
        with config.override(gemm_decode_rows=args.rows):
            mg.gemm(a, w.T, out=out)
            (fn, grid, block, kargs, smem, *_), _ = mg.kept_plan(a, w.T, out)
            plain = flushed_ms(lambda: mg.gemm(a, w.T, out=out), args.calls, flush)
        cublas = flushed_ms(lambda: cupy.matmul(a, w.T, out=ref), args.calls, flush)
        decode = isinstance(kargs, MkDecodeArgs)
        traced = type(kargs).from_buffer_copy(kargs)  # the same launch, its MkSync taking the trace buffer
        traced.sync.trace_events, traced.sync.trace_count, traced.sync.trace_capacity = trace.pointers()
        figs = []
        for _ in range(args.calls):
            flush()
            trace.count.fill(0)
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            launch.launch(fn, grid, block, traced, smem=smem)
            stop.record()
            stop.synchronize()
            ctas = per_cta(trace.spans(), decode)
            if len(ctas) != grid[0] and (decode or not ctas):  # an engine CTA may find no tile left
                raise RuntimeError(f"{shape}: {len(ctas)} CTAs wrote spans of {grid[0]}")
            figs.append(decode_phases(ctas) if decode else engine_phases(ctas))
            figs[-1]["event"] = cupy.cuda.get_elapsed_time(start, stop) * 1e6
        err = rel_err(out, ref)
        if not err < 1e-2:
            raise AssertionError(f"{shape}: the traced calls' relative error {err:.3g} against cuBLAS")
        figs = figs[3:]  # the first calls: clocks and caches settling
        event = statistics.median(x["event"] for x in figs)
        last = statistics.median(max(x["end"]) for x in figs)
        head = (f"{M:5d}x{N}x{K} {'decode' if decode else 'engine'} ctas {grid[0]:3d}: event {event / 1e3:.2f} "
                f"(plain {plain * 1e3:.2f}, cublas {cublas * 1e3:.2f})  outside {(event - last) / 1e3:.2f}  floor "
                f"{launch_floor(grid, block, smem, args.calls, flush) / 1e3:.2f}  floor0 "
                f"{launch_floor(grid, block, 0, args.calls, flush) / 1e3:.2f}")
        if decode:
            landed = statistics.median(statistics.median(x["landed"]) for x in figs)
            mma = statistics.median(statistics.median(x["mma_end"]) for x in figs)
            print(f"{head}  rows {(block[0] - 32) // 2}  entry {spread(figs, 'entry')}  landed {spread(figs, 'landed')}"
                  f"  mma_end {spread(figs, 'mma_end')}  partial {pooled(figs, 'partial')}  sum {pooled(figs, 'sum')}"
                  f"  store {pooled(figs, 'store')}  end {spread(figs, 'end')}  rate "
                  f"{N * K * 2 / max(mma - landed, 1) * 1e-3:.2f} TB/s", flush=True)
        else:
            print(f"{head}  start {spread(figs, 'start')}  tiles {max(max(x['tiles']) for x in figs)}  first "
                  f"{pooled(figs, 'first')}  later {pooled(figs, 'later')}  end {spread(figs, 'end')}", flush=True)


if __name__ == "__main__":
    main()
