"""The fused MoE kernels between emulated nodes traced per SM: the dispatch + GEMM's dispatch
CTAs' rows sent and each sending warp's wait for a bundle; the GEMM + combine's GEMM CTAs,
M-tiles returned, forwarded rows back, their sums done and WRITten, and when the partials kernel
has the other nodes' sums (issue 25: the overlap between nodes).

Run (every rank; MKERNEL_TRACE is set here, before the communicator exists):
    mpirun -n 2 python3 tools/moe_trace.py --nodes 2 --shape 4096x7168x2048x64x8 --out DIR
Each call is the fused dispatch + GEMM, then the fused GEMM + combine on its output (a launch each);
the last call starts behind a device barrier (bench/mps_timing.py), and its two launches are
summarised (span ids: MOE_TRACE_* in mkernel/cuda/ops/moe_dispatch.cuh); --combines N runs that
call's combine N times back to back. Again from files (--launch -2, or -1 - N after --combines N:
the last dispatch + GEMM):
    python3 tools/moe_trace.py --summarize DIR/trace.rank0.json DIR/trace.rank1.json
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from tp_trace import close_and_summarize, summarize_files, trace_cli, trace_into  # noqa: E402

KINDS = {1: "GEMM CTA done", 2: "M-tile returned", 3: "forwarded rows back", 4: "forwarded chunk sent",
         5: "final sums (CTA)", 6: "partials: other nodes' sums in", 7: "dispatch CTA's rows sent",
         8: "dispatch: a warp's bundle in", 9: "partials: a CTA's sums added", 10: "partials: WRITEs flushed"}
ANNOUNCE, EXIT = 0x80000000, 0x40000000


def summarize(spans):
    """Text lines: per kind of span, its count and when its spans end (first, 50%, last), relative
    to the launch's announce (a dispatch + GEMM's or a GEMM + combine's)."""
    if not spans:
        return ["no launch found (was MKERNEL_TRACE set before mkernel.init?)"]
    t0 = min(s[2] for s in spans if s[0] == "control" and s[1] & ANNOUNCE)
    exits = [s[3] - t0 for s in spans if s[0] == "control" and s[1] & EXIT and not s[1] & ANNOUNCE]
    which = "dispatch + GEMM" if any(s[1] >> 24 in (7, 8) for s in spans if not s[1] & (ANNOUNCE | EXIT)) else "kernel"
    out = [f"{which}: last CTA exit at {max(exits, default=0):9.1f} us ({len(exits)} CTAs)"]
    for kind, name in KINDS.items():
        ends = sorted(s[3] - t0 for s in spans if not s[1] & (ANNOUNCE | EXIT) and s[1] >> 24 == kind)
        starts = sorted(s[2] - t0 for s in spans if not s[1] & (ANNOUNCE | EXIT) and s[1] >> 24 == kind)
        if ends:
            out.append(f"{name:32s} {len(ends):6d}  start {starts[0]:9.1f}  end first {ends[0]:9.1f}  "
                       f"median {ends[len(ends) // 2]:9.1f}  last {ends[-1]:9.1f} us")
    return out


def run(args):
    trace_into(args.out)
    import cupy
    import ml_dtypes
    import numpy as np
    from mpi4py import MPI

    import mkernel

    W = MPI.COMM_WORLD.size
    comm = mkernel.init(workspace_bytes=args.workspace_gib << 30, gpus_per_node=W // args.nodes,
                        transport=args.transport)
    T, H, F, E, k = (int(x) for x in args.shape.split("x"))
    rng = np.random.default_rng(17 + comm.rank)
    dt = ml_dtypes.bfloat16
    x = cupy.asarray(rng.standard_normal((T, H)).astype(dt))
    ids = cupy.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
    w = cupy.asarray(rng.random((T, k)).astype(np.float32))
    El = E // W
    w1 = cupy.asarray((rng.standard_normal((El, H, F)) * H ** -0.5).astype(dt))
    w2 = cupy.asarray((rng.standard_normal((El, F, H)) * F ** -0.5).astype(dt))
    cap = args.capacity or mkernel.moe_capacity(T, k, W)
    knobs = {"moe_comm_sms": args.dispatch_sms} if args.dispatch_sms else {}
    knobs.update({"moe_bundle_pieces": args.pieces} if args.pieces else {})
    import mps_timing

    barrier = mps_timing.DeviceBarrier(comm)
    for i in range(args.calls):
        if i == args.calls - 1:  # the traced call starts on every rank at once (calls drift apart)
            cupy.cuda.runtime.deviceSynchronize()
            MPI.COMM_WORLD.Barrier()
            barrier()
        with mkernel.config.override(**knobs):
            y, h = mkernel.moe_dispatch_gemm(x, ids, w, w1, comm=comm, num_experts=E, capacity=cap)
        for _ in range(args.combines if i == args.calls - 1 else 1):  # back to back, as a benchmark's batch
            mkernel.moe_gemm_combine(y, w2, h, comm=comm, path="fused", comm_sms=args.comm_sms)
    close_and_summarize(comm, args.out, summarize)  # the last combine
    if MPI.COMM_WORLD.rank == 0:  # and the last dispatch + GEMM
        summarize_files([os.path.join(args.out, f"trace.rank{i}.json") for i in range(W)], summarize,
                        -1 - args.combines)


def main():
    def add_args(p):
        p.add_argument("--shape", default="4096x7168x2048x64x8", help="T x H x F x experts x top-k (per rank)")
        p.add_argument("--capacity", type=int, default=0, help="rows per rank (default moe_capacity: bench/moe.py's)")
        p.add_argument("--comm-sms", type=int, default=None, help="the combine's comm CTAs (moe_combine_comm_sms)")
        p.add_argument("--dispatch-sms", type=int, default=0, help="dispatch CTAs (moe_comm_sms; 0: default)")
        p.add_argument("--pieces", type=int, default=0, help="WRITEs per bundle (moe_bundle_pieces; 0: default)")
        p.add_argument("--combines", type=int, default=1, help="the last call's combine, back to back (last traced)")

    trace_cli(__doc__.splitlines()[0], add_args, run, summarize, calls=4)


if __name__ == "__main__":
    main()
