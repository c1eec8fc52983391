"""Ring attention traced per SM, and where its time went (issue 25: the overlap between nodes): when
each step's chunks were sent and landed, when its block was all here, and when its tiles merged.

Run (every rank; MKERNEL_TRACE is set here, before the communicator exists):
    mpirun -n 2 python3 tools/ring_trace.py --nodes 2 --seq 4096 --causal --out DIR
It makes `--calls` calls (bench/ring_attention.py's heads: 32 query / 8 key-value heads x 128, bf16),
each behind a device barrier (bench/mps_timing.py), and summarises each rank's last launch. Again from files:
    python3 tools/ring_trace.py --summarize DIR/trace.rank0.json DIR/trace.rank1.json
Span ids: RING_TRACE_* in mkernel/cuda/ops/ring_args.cuh.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_trace import close_and_summarize, trace_cli, trace_into  # noqa: E402

KINDS = {1: "chunk sent (copied or queued)", 2: "chunk landed (receiver)", 3: "block all here (ARRIVED)",
         4: "WRITEs landed there (FLUSH)", 5: "half tile merged"}
ANNOUNCE, EXIT = 0x80000000, 0x40000000


def summarize(spans):
    """Text lines: the launch's length; per kind of span and step, its count, its first start and
    when its spans ended (first, 25/50/75%, last), relative to the announce; merges' summed time."""
    if not spans:
        return ["no launch found (was MKERNEL_TRACE set before mkernel.init?)"]
    t0 = min(s[2] for s in spans if s[0] == "control" and s[1] & ANNOUNCE)
    exits = [s[3] - t0 for s in spans if s[0] == "control" and s[1] & EXIT and not s[1] & ANNOUNCE]
    out = [f"launch: last CTA exit at {max(exits, default=0):9.1f} us ({len(exits)} CTAs)"]
    body = [s for s in spans if not s[1] & (ANNOUNCE | EXIT)]
    for kind, name in KINDS.items():
        for step in sorted({(s[1] >> 16) & 0xFF for s in body if s[1] >> 24 == kind}):
            mine = [s for s in body if s[1] >> 24 == kind and (s[1] >> 16) & 0xFF == step]
            ends = sorted(s[3] - t0 for s in mine)
            q = [ends[min(len(ends) - 1, int(f * len(ends)))] for f in (0.25, 0.5, 0.75)]
            busy = sum(s[3] - s[2] for s in mine)
            out.append(f"step {step} {name:30s} {len(ends):5d}  start {min(s[2] for s in mine) - t0:8.1f}  "
                       f"end first {ends[0]:8.1f}  25/50/75% {q[0]:8.1f} {q[1]:8.1f} {q[2]:8.1f}  "
                       f"last {ends[-1]:8.1f} us" + (f"  (summed {busy:9.1f} us)" if kind == 5 else ""))
    return out


def run(args):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    trace_into(args.out)
    import cupy
    import ml_dtypes
    import numpy as np
    from mpi4py import MPI

    import mkernel

    W = MPI.COMM_WORLD.size
    comm = mkernel.init(workspace_bytes=args.workspace_gib << 30, gpus_per_node=W // args.nodes,
                        transport=args.transport)
    rng = np.random.default_rng(23 + comm.rank)
    dt = ml_dtypes.bfloat16
    S, Hq, Hkv, D = args.seq, 32, args.kv_heads, 128
    q = cupy.asarray(rng.standard_normal((S, Hq, D)).astype(dt))
    k, v = (cupy.asarray(rng.standard_normal((S, Hkv, D)).astype(dt)) for _ in range(2))
    out = cupy.empty_like(q)
    import mps_timing

    barrier = mps_timing.DeviceBarrier(comm)  # each call starts on every rank at once (no launch skew)
    for _ in range(args.calls):
        barrier()
        mkernel.ring_attention(q, k, v, comm=comm, causal=args.causal, out=out)
    close_and_summarize(comm, args.out, summarize)


def main():
    def add_args(p):
        p.add_argument("--seq", type=int, default=4096, help="S_local: rows per rank")
        p.add_argument("--kv-heads", type=int, default=8)
        p.add_argument("--causal", action="store_true")

    trace_cli(__doc__.splitlines()[0], add_args, run, summarize, calls=4)


if __name__ == "__main__":
    main()
