#!/usr/bin/env python3
"""Where a call of gemm_allreduce's fused LL latency path goes beyond its GEMM (issue 26's goal: GEMM
+ 8 us), from the kernels' trace spans (MKERNEL_TRACE, set here). Ranks sharing one GPU share its
clock, so their phases line up. Per rank, medians over launches, microseconds from the push
kernel's first block entry:

  push_end   the last finished row block's credit check (its pushes follow): the GEMM's end
  credit     the longest wait of a finished row block for every rank's credit
  red_start  the reduce kernel's first block entry; gap = red_start - push_end
  red_end    its last block's sums done
  skew       this rank's push kernel start after the earliest rank's
  late       the latest rank's push_end after this rank's (the words the reduce waits for)
and the decode GEMM alone (mkernel.gemm, every rank at once, events over the calls).

    mpirun -n 2 python3 tools/ll_phases.py [--rows 1,16] [--n 8192] [--k 4096] [--calls 100]
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

PUSH_WAIT, REDUCE = 0x200, 0x40000000  # LL_TRACE_PUSH, LL_TRACE_REDUCE (gemm_allreduce_ll_args.cuh)


def per_launch(spans):
    """{epoch: (t0, push_end, credit, red_start, red_end)} in ns from trace.Trace.spans() tuples."""
    starts = {}
    for s in spans:
        if s[4] == 5 and not s[5] & REDUCE:
            starts[s[5]] = min(starts.get(s[5], s[0]), s[0])
    order = sorted(starts.items(), key=lambda kv: kv[1])
    out = {}
    for i, (epoch, t0) in enumerate(order):
        hi = order[i + 1][1] if i + 1 < len(order) else float("inf")
        mine = [s for s in spans if t0 <= s[0] < hi]
        waits = [s for s in mine if s[4] == 4 and s[5] == PUSH_WAIT]
        entries = [s[0] for s in mine if s[4] == 5 and s[5] == REDUCE | epoch]
        sums = [s[1] for s in mine if s[4] == 1]
        if waits and entries and sums:
            out[epoch] = (t0, max(s[1] for s in waits), max(s[1] - s[0] for s in waits), min(entries), max(sums))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16")
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args()
    os.environ.setdefault("MKERNEL_TRACE", os.path.join(tempfile.gettempdir(), "mk_ll_trace"))
    import cupy
    import ml_dtypes
    import mps_timing as mt
    import numpy as np

    import mkernel
    from mkernel.comm.collectives import allgather_object

    comm = mkernel.init()
    dt = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(comm.rank)
    w = cupy.asarray(rng.standard_normal((args.n, args.k)).astype(dt))
    for m in (int(r) for r in args.rows.split(",")):
        a = cupy.asarray(rng.standard_normal((m, args.k)).astype(dt))
        out, part = cupy.empty((m, args.n), dt), cupy.empty((m, args.n), dt)
        for _ in range(3):
            mkernel.gemm(a, w.T, out=part)
        comm.mpi.Barrier()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(args.calls):
            mkernel.gemm(a, w.T, out=part)
        stop.record()
        stop.synchronize()
        gemm_us = cupy.cuda.get_elapsed_time(start, stop) / args.calls * 1e3
        mkernel.gemm_allreduce(a, w.T, comm=comm, out=out, path="latency")  # the shape's first call
        cupy.cuda.get_current_stream().synchronize()
        comm.trace.count.fill(0)
        comm.mpi.Barrier()
        for _ in range(args.calls):
            mkernel.gemm_allreduce(a, w.T, comm=comm, out=out, path="latency")
        cupy.cuda.get_current_stream().synchronize()
        comm.check()
        mine = per_launch(comm.trace.spans())
        every = allgather_object(comm.mpi, mine, "ll phases", 60)
        common = set.intersection(*(set(d) for d in every))
        ph = {k: [] for k in ("push_end", "credit", "red_start", "gap", "red_end", "skew", "late")}
        for e in sorted(common)[3:]:  # the first launches: ranks still lining up
            t0, push_end, credit, red_start, red_end = mine[e]
            ph["push_end"].append(push_end - t0)
            ph["credit"].append(credit)
            ph["red_start"].append(red_start - t0)
            ph["gap"].append(red_start - push_end)
            ph["red_end"].append(red_end - t0)
            ph["skew"].append(t0 - min(d[e][0] for d in every))
            ph["late"].append(max(d[e][1] for d in every) - push_end)
        line = "  ".join(f"{k} {statistics.median(v) / 1e3:6.2f}" for k, v in ph.items() if v)
        mt.print_by_rank(comm, f"rank {comm.rank} rows {m:3}: gemm alone {gemm_us:6.2f} us  "
                         f"launches {len(ph['gap'])}  {line}", "ll phases")
    comm.close()


if __name__ == "__main__":
    main()
