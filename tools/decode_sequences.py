#!/usr/bin/env python3
"""Device time per iteration of kernel sequences at decode sizes (issue 26: gemm_allreduce's paths
cost more than their parts): n iterations captured in one CUDA graph, every rank at once, the
slowest rank's median (bench/mps_timing.py's rule). Per row count M (per-rank [M, K] x [K, N]):

  gemm         mkernel.gemm (the decode kernel up to gemm_decode_max_m rows)
  ar           mkernel.allreduce of the [M, N] result
  gemm+ar      the two, one after the other (the unfused path)
  gemm+gemm    two GEMMs (time per pair)
  gemm+empty   a GEMM, then an empty kernel
  ar+ar        two all-reduces
  latency      gemm_allreduce's default latency path
  gemm+ar16    a GEMM, then an all-reduce of 16 bytes (2 CTAs: a light cross-rank sync)
  gemm+ar(8 CTAs), gemm128(+ar)  the all-reduce on 8 CTAs; the GEMM on 128-row blocks
  gemm<R>ctas(+ar)  the decode GEMM's runs planned for R = launch.sm_count() CTAs (under MPS what
               every rank can hold at once) instead of 132 (timing only: other partial sums, other bits)
  gemm overlap, gemm+gemm overlap  the decode GEMMs launched overlapped with the kernel before
               (config.gemm_overlap: each sets up while the one before ends its CTAs' last wgmma)
and each "gemm" figure with the other ranks idle (solo: rank 0 alone, the others wait); then one
GEMM's time right after a device barrier (mps_timing.synced_ms), every rank at once and rank 0 alone.

    mpirun -n 2 python3 tools/decode_sequences.py [--rows 1,64] [--n 8192] [--k 4096]
"""

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

EMPTY = r'extern "C" __global__ void mk_empty(int x) { if (x == 12345) asm volatile("trap;"); }'


@contextlib.contextmanager
def _constants(comm, knob):
    """The all-reduce's CTAs (MAX_CTAS) and the decode runs' SMs (split_sms) set for one measurement,
    then restored; every kept plan dropped on both sides (a plan's key does not hold these: a call
    would otherwise replay a plan built with the other values)."""
    from unittest import mock

    from mkernel.engines import gemm as _gemm
    from mkernel.engines import gemm_decode as _decode
    from mkernel.ops import allreduce as _ar

    values = [(_ar, "MAX_CTAS", knob.get("MAX_CTAS")), (_decode, "SPLIT_SMS", knob.get("split_sms"))]
    with contextlib.ExitStack() as stack:
        for module, name, value in values:
            if value is not None:
                stack.enter_context(mock.patch.object(module, name, value))
        comm.release_plans()
        _gemm.release_plans()
        try:
            yield
        finally:
            comm.release_plans()
            _gemm.release_plans()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,64")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=4096)
    args = p.parse_args()
    import cupy
    import ml_dtypes
    import mps_timing as mt
    import numpy as np

    import mkernel
    from mkernel.core import config
    from mkernel.runtime import launch

    comm = mkernel.init()
    barrier = mt.DeviceBarrier(comm)
    empty = cupy.RawKernel(EMPTY, "mk_empty")
    zero = np.int32(0)
    dt = np.dtype(ml_dtypes.bfloat16)
    lines = []
    for M in (int(r) for r in args.rows.split(",")):
        rng = np.random.default_rng(comm.rank)
        a = cupy.asarray(rng.standard_normal((M, args.k)).astype(dt))
        w = cupy.asarray((rng.standard_normal((args.n, args.k)) / 64).astype(dt))
        part, out, out2 = (cupy.empty((M, args.n), dt) for _ in range(3))
        tiny, tiny_out = cupy.ones(8, dt), cupy.empty(8, dt)

        def gemm():
            mkernel.gemm(a, w.T, out=part)

        def ar():
            mkernel.allreduce(part, comm=comm, out=out)

        seqs = {"gemm": gemm, "ar": ar, "gemm+ar": lambda: (gemm(), ar()),
                "gemm+gemm": lambda: (gemm(), mkernel.gemm(a, w.T, out=out2)),
                "gemm+empty": lambda: (gemm(), empty((1,), (32,), (zero,))),
                "ar+ar": lambda: (ar(), mkernel.allreduce(part, comm=comm, out=out2)),
                "gemm+ar16": lambda: (gemm(), mkernel.allreduce(tiny, comm=comm, out=tiny_out)),
                "latency": lambda: mkernel.gemm_allreduce(a, w.T, comm=comm, out=out, path="latency")}
        resident = launch.sm_count()  # CTAs of one SM each that every rank's kernel can hold at once
        knobs = {"gemm+ar(8 CTAs)": ("gemm+ar", {"MAX_CTAS": 8}), "gemm128+ar": ("gemm+ar", {"rows": 128}),
                 "gemm128": ("gemm", {"rows": 128}), f"gemm{resident}ctas": ("gemm", {"split_sms": resident}),
                 f"gemm{resident}ctas+ar": ("gemm+ar", {"split_sms": resident}),
                 "gemm overlap": ("gemm", {"overlap": True}), "gemm+gemm overlap": ("gemm+gemm", {"overlap": True})}
        t = {name: mt.graph_batch_ms(comm, barrier, fn) * 1e3 for name, fn in seqs.items()}
        for name, (seq, knob) in knobs.items():
            with _constants(comm, knob), config.override(gemm_decode_rows=knob.get("rows", 0),
                                                         gemm_overlap=knob.get("overlap", False)):
                t[name] = mt.graph_batch_ms(comm, barrier, seqs[seq]) * 1e3
        solo = mt.graph_batch_ms(comm, barrier, gemm if comm.rank == 0 else lambda: empty((1,), (32,), (zero,))) * 1e3
        lines.append(f"rank {comm.rank} M {M}: us/iteration (graph) " + "  ".join(f"{k} {v:6.2f}" for k, v in t.items())
                     + f"  gemm solo (rank 0 alone) {solo:6.2f}")
        every = mt.synced_ms(comm, barrier, gemm) * 1e3
        alone = mt.synced_ms(comm, barrier, gemm if comm.rank == 0 else None) * 1e3
        lines.append(f"rank {comm.rank} M {M}: one GEMM from a device barrier, the slowest rank's median: every rank "
                     f"at once {every:6.2f} us, rank 0 alone {alone:6.2f} us")
    mt.print_by_rank(comm, "\n".join(lines), "sequences")
    comm.close()


if __name__ == "__main__":
    main()
