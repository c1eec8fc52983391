#!/usr/bin/env python3
"""Where the time of one mkernel.allreduce launch goes, from the kernel's own trace spans (issue 26:
16-512 KiB took 20-27 us at 2 ranks under MPS against a 10 us goal).

Runs MKERNEL_TRACE on every rank (set here), ``--calls`` back-to-back calls per size, then splits
each launch (its blocks' entry spans carry the launch's epoch) into phases, medians over launches:

  entry   a block's start: epoch, entry counter, credit announce (the first block)
  credit  the wait for a destination's credit before pushing to it (own rank: immediate)
  push    a chunk's copy into a destination's slot, the system fence, its flag
  flags   the wait for every rank's flag of a chunk
  sum     the chunk's fp32 sum in rank order and its stores
  result  two-shot: the wait for a chunk's owner's result flag
  gather  two-shot: the chunk's copy from its owner's results row
  device  the launch's first span start to its last span end
  gap     one launch's last span end to the next launch's first start (launch and host work)

    mpirun -n 2 python3 tools/allreduce_phases.py [--calls 200] [--sizes 8192,131072,2097152]
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))


def phases(spans):
    """Median microseconds per phase over the launches in ``spans`` (trace.Trace.spans() tuples)."""
    entries = sorted((s for s in spans if s[4] == 5), key=lambda s: s[0])  # MK_ROLE_CONTROL, id = epoch
    starts = {}
    for s in entries:
        starts.setdefault(s[5], s[0])
    order = sorted(starts.items(), key=lambda kv: kv[1])
    bounds = [(e, t, order[i + 1][1] if i + 1 < len(order) else float("inf")) for i, (e, t) in enumerate(order)]
    per = {k: [] for k in ("entry", "credit", "push", "flags", "sum", "result", "gather", "device", "gap")}
    last_end = None
    for _epoch, lo, hi in bounds:
        mine = [s for s in spans if lo <= s[0] < hi]
        if not mine:
            continue
        first, end = min(s[0] for s in mine), max(s[1] for s in mine)
        per["device"].append(end - first)
        if last_end is not None:
            per["gap"].append(first - last_end)
        last_end = end
        for start, stop, _sm, _block, role, ident in mine:
            name = {5: "entry", 2: "push", 3: "gather", 1: "sum"}.get(role)
            if role == 4:
                name = "result" if ident >= 0x200 else "flags" if ident >= 0x100 else "credit"
            if name:
                per[name].append(stop - start)
    return {k: statistics.median(v) / 1e3 if v else None for k, v in per.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--sizes", default="8192,131072,2097152", help="bf16 elements per call")
    args = p.parse_args()
    os.environ.setdefault("MKERNEL_TRACE", os.path.join(tempfile.gettempdir(), "mk_allreduce_trace"))
    import cupy
    import ml_dtypes
    import mps_timing as mt
    import numpy as np

    import mkernel

    comm = mkernel.init()
    dt = np.dtype(ml_dtypes.bfloat16)
    for n in (int(x) for x in args.sizes.split(",")):
        x = cupy.asarray(np.random.default_rng(comm.rank).standard_normal(n).astype(dt))
        out = cupy.empty_like(x)
        mkernel.allreduce(x, comm=comm, out=out)  # the shape's first call: agreement, plan
        cupy.cuda.get_current_stream().synchronize()
        comm.trace.count.fill(0)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(args.calls):
            mkernel.allreduce(x, comm=comm, out=out)
        stop.record()
        stop.synchronize()
        comm.check()
        eager_us = cupy.cuda.get_elapsed_time(start, stop) / args.calls * 1e3
        ph = phases(comm.trace.spans())
        line = "  ".join(f"{k} {v:6.2f}" if v is not None else f"{k}      -" for k, v in ph.items())
        mt.print_by_rank(comm, f"rank {comm.rank} {n * 2 / 1024:7.1f} KiB  eager {eager_us:6.1f} us/call  {line}",
                         "phases")
    comm.close()


if __name__ == "__main__":
    main()
