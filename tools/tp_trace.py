"""One fused TP call traced per SM, and where its time went (issue 25: the overlap between nodes).

Run (every rank; MKERNEL_TRACE is set here, before the communicator exists):
    mpirun -n 2 python3 tools/tp_trace.py --op gemm_allreduce --nodes 2 --shape 8192x8192x14336 --out DIR
It times `--calls` calls of the op (per-rank shapes as bench/tp.py's), writes each rank's Chrome trace
(DIR/trace.rank<r>.json, Perfetto) and prints the summary of the last call. Summarise files again:
    python3 tools/tp_trace.py --summarize DIR/trace.rank0.json DIR/trace.rank1.json [--launch 0]
(every launch's length, then launch --launch summarised: 0 the first call, -1 the last).
Span ids: TP_TRACE_* in mkernel/cuda/ops/tp_epilogue.cuh; the launch starts at its announce span
(control, 0x80000000 | epoch) and ends at its last CTA's exit (control, 0x40000000 | block).
"""

import argparse
import json
import os
import sys

KINDS = {0: "reduce", 1: "forward", 2: "copy", 3: "push", 4: "tile"}
ANNOUNCE, EXIT = 0x80000000, 0x40000000


ENTRY_LEAD_US = 5.0  # a CTA stamps its entry before the announcing CTA may: up to this much earlier


def launches(events):
    """The trace's launches in start order: lists of spans (role, id, start_us, end_us, tid), each
    from its announce span (less ENTRY_LEAD_US) up to the next launch's."""
    spans = sorted(((e["cat"], e["args"]["id"], e["ts"], e["ts"] + e["dur"], e["tid"]) for e in events),
                   key=lambda s: s[2])
    starts = sorted(t0 for r, i, t0, _, _ in spans if r == "control" and i & ANNOUNCE)
    bounds = [t - ENTRY_LEAD_US for t in starts] + [float("inf")]
    return [[s for s in spans if lo <= s[2] < hi] for lo, hi in zip(bounds, bounds[1:])]


def launch_us(spans) -> float:
    """A launch's length: its first span's start to its last CTA's exit."""
    t0 = min(s[2] for s in spans)
    exits = [s[3] for s in spans if s[0] == "control" and s[1] & EXIT and not s[1] & ANNOUNCE]
    return (max(exits) if exits else max(s[3] for s in spans)) - t0


def _pct(times, fracs=(0.25, 0.5, 0.75, 1.0)):
    times = sorted(times)
    return [times[max(0, min(len(times) - 1, int(round(f * len(times))) - 1))] for f in fracs] if times else []


def summarize(spans):
    """Text lines: the launch's length, the GEMM's progress, and per kind of comm item its count,
    when its items finished (25/50/75/100%), its busy time and its wait time (summed over CTAs)."""
    if not spans:
        return ["no launch found (was MKERNEL_TRACE set before mkernel.init?)"]
    t0 = min(s[2] for s in spans)
    t_end = t0 + launch_us(spans)
    out = [f"launch {t_end - t0:9.1f} us, {len(spans)} spans, {len({s[4] for s in spans})} SMs"]
    tiles = [s[3] - t0 for s in spans if s[0] == "compute"]
    if tiles:
        q = ", ".join(f"{t:8.1f}" for t in _pct(tiles))
        out.append(f"GEMM tiles {len(tiles):6d}  done at 25/50/75/100%: {q} us  (tail after the last: "
                   f"{t_end - t0 - max(tiles):8.1f} us)")
    stalls = [s[3] - s[2] for s in spans if s[0] == "wait" and s[1] >> 24 == 4]
    if stalls:
        out.append(f"GEMM waits for A chunks: {len(stalls)} tiles, {sum(stalls):9.1f} us summed, longest "
                   f"{max(stalls):8.1f} us")
    gemm_sms = {s[4] for s in spans if s[0] == "compute"}  # SMs that ran GEMM tiles (lent or joined)
    for kind in (0, 1, 2, 3):
        work = [s for s in spans if s[1] >> 24 == kind and s[0] in ("send", "intra-node", "recv")]
        waits = [s[3] - s[2] for s in spans if s[1] >> 24 == kind and s[0] == "wait"]
        if not work:
            continue
        for role in sorted({s[0] for s in work}):
            done = [s[3] - t0 for s in work if s[0] == role]
            busy = sum(s[3] - s[2] for s in work if s[0] == role)
            q = ", ".join(f"{t:8.1f}" for t in _pct(done))
            out.append(f"{KINDS[kind]:7s} {role:10s} {len(done):6d}  done at 25/50/75/100%: {q} us  busy "
                       f"{busy:9.1f} us")
            for where, on_gemm in (("GEMM SMs", True), ("comm SMs", False)):  # an item's time by who ran it
                mine = [s for s in work if s[0] == role and (s[4] in gemm_sms) == on_gemm]
                if mine:
                    d = sorted(s[3] - s[2] for s in mine)
                    out.append(f"{'':18s} on {where}: {len(d):6d} items, median {d[len(d) // 2]:7.1f} us, "
                               f"last done at {max(s[3] for s in mine) - t0:9.1f} us")
        out.append(f"{KINDS[kind]:7s} waits      {len(waits):6d}  {sum(waits):9.1f} us summed, longest "
                   f"{max(waits, default=0):8.1f} us")
    return out


def summarize_files(paths, summarize_fn=summarize, launch=-1):
    """Each file's launches' lengths, and its launch number ``launch`` (default the last)
    summarised; where the files carry t0_ns (ranks sharing one GPU, whose %globaltimer is one
    clock), also that launch's start on each rank against the earliest of them."""
    starts = {}
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        runs = launches(data["traceEvents"])
        spans = runs[launch] if -len(runs) <= launch < len(runs) else []
        print(f"== {p}")
        if len(runs) > 1:
            print(f"{len(runs)} launches, us: " + " ".join(f"{launch_us(r):.0f}" for r in runs))
            gaps = (b[0][2] - a[0][2] - launch_us(a) for a, b in zip(runs, runs[1:]))  # idle before each
            print("gaps between them, us: " + " ".join(f"{g:.0f}" for g in gaps))
        print("\n".join(summarize_fn(spans)))
        t0_ns = data.get("otherData", {}).get("t0_ns")
        if spans and t0_ns is not None:
            starts[p] = t0_ns / 1e3 + min(s[2] for s in spans)
    if len(starts) == len(paths) > 1:
        first = min(starts.values())
        print("launch starts on one clock: " + ", ".join(f"{os.path.basename(p)} +{t - first:.1f} us"
                                                         for p, t in starts.items()))


def trace_cli(description, add_args, run_fn, summarize_fn, calls, workspace_gib=4):
    """A traced tool's command line: --summarize FILES, or a run (run_fn(args)) with --nodes,
    --transport, --calls, --workspace-gib, --out and the tool's own arguments (add_args(parser))."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--summarize", nargs="+", metavar="JSON", help="summarise these trace files and exit")
    p.add_argument("--launch", type=int, default=-1, help="with --summarize: which launch (0: the first)")
    add_args(p)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--transport", default="host")
    p.add_argument("--calls", type=int, default=calls, help="calls (the last is summarised)")
    p.add_argument("--workspace-gib", type=int, default=workspace_gib)
    p.add_argument("--out", default="trace-out")
    args = p.parse_args()
    if args.summarize:
        summarize_files(args.summarize, summarize_fn, args.launch)
    else:
        run_fn(args)


def trace_into(out):
    """Trace mode for the communicators this process makes next: rank r's Chrome trace goes to
    out/trace.rank<r>.json when its communicator closes (set before mkernel.init)."""
    os.environ["MKERNEL_TRACE"] = os.path.join(out, "trace.rank{rank}.json")
    os.makedirs(out, exist_ok=True)


def close_and_summarize(comm, out, summarize_fn=summarize):
    """Every rank: the traced calls done, close the communicator (which writes its trace); rank 0
    then summarises every rank's last launch."""
    import cupy
    from mpi4py import MPI

    cupy.cuda.runtime.deviceSynchronize()
    comm.check()
    comm.close()
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.rank == 0:
        summarize_files([os.path.join(out, f"trace.rank{i}.json") for i in range(MPI.COMM_WORLD.size)],
                        summarize_fn)


def run(args):
    trace_into(args.out)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import ml_dtypes
    import numpy as np
    from mpi4py import MPI

    import mkernel

    import harness

    W = MPI.COMM_WORLD.size
    comm = mkernel.init(workspace_bytes=args.workspace_gib << 30,
                        gpus_per_node=W // args.nodes if args.nodes > 1 else None,
                        transport=args.transport if args.nodes > 1 else "auto")
    dt = np.dtype(ml_dtypes.bfloat16)
    M, N, K = (int(x) for x in args.shape.split("x"))
    r = comm.rank
    if args.op == "allgather_gemm":
        a, b = harness.rand((M // W, K), 100 + r, dt), harness.rand((K, N), 200 + r, dt)
    else:
        a, b = harness.rand((M, K), 300 + r, dt), harness.rand((K, N), 400 + r, dt)
    fn = getattr(mkernel, args.op)
    knobs = {k: v.strip().lower() in ("1", "true", "on") for k, v in (s.split("=", 1) for s in args.knob)}
    if knobs:
        mkernel.config.configure(**knobs)
    comm_sms = args.comm_sms if args.comm_sms == "auto" else int(args.comm_sms)
    for _ in range(args.calls):
        fn(a, b, comm=comm, comm_sms=comm_sms)
    close_and_summarize(comm, args.out)


def main():
    def add_args(p):
        p.add_argument("--op", default="gemm_allreduce", choices=("gemm_allreduce", "gemm_reduce_scatter",
                                                                   "allgather_gemm"))
        p.add_argument("--shape", default="8192x8192x14336", help="per-rank MxNxK, as bench/tp.py's")
        p.add_argument("--comm-sms", default="auto")
        p.add_argument("--knob", action="append", default=[], metavar="NAME=BOOL",
                       help="a boolean mkernel.config knob for the run (e.g. comm_staged=1); repeatable")

    # 12 calls: "auto" searches in the early ones
    trace_cli(__doc__.splitlines()[0], add_args, run, summarize, calls=12, workspace_gib=6)


if __name__ == "__main__":
    main()
