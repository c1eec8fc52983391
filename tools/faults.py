#!/usr/bin/env python3
"""Fault injection: a rank dies or stops inside each op, and every survivor must fail fast.

    python3 tools/faults.py [--ops rs,ar,ag,ring,moe_dispatch_gemm,moe_gemm_combine,allreduce,allreduce_ll,
                             allreduce_2shot,ar_latency]
                            [--scenarios abcde] [--logs DIR]

For every (op, scenario) a job of 2 ranks (under MPS when a daemon runs: tools/mps.sh) is started
with ``--mca orte_abort_on_non_zero_status 0`` (else Open MPI kills the survivor itself and nothing
is proven) and MKERNEL_TIMEOUT_S (default 5). Rank 1 is the victim:
  a  exits before the shape's first call       d  exits while the proxy carries its data (2
  b  exits between two calls                      emulated nodes, host transport; the ops with a
                                                  path between nodes: all but the all-reduces)
  c  exits inside the op (its kernel waits for   e  is stopped (SIGSTOP) between calls; once the
     the survivor, which calls 1 s later)           survivor raised it is resumed, and must raise too
Under MPS, (c) cannot pass: a client that dies with a kernel in flight faults every client on the
GPU (docs/ARCHITECTURE.md); run (c) time-sliced. The survivor calls the op and then comm.check()
until it raises. Passes when it raised PeerError
or TimeoutError naming the op within timeout + 5 s of its call, its comm.close() returned within
10 s, and its process ended within 10 s of that (MPI_Finalize included); in (e) the resumed rank
raised as well. Prints one row per case; exit status 1 if any failed.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = ("rs", "ar", "ag", "ring", "moe_dispatch_gemm", "moe_gemm_combine", "allreduce", "allreduce_ll",
       "allreduce_2shot", "ar_latency")
NAMES = {"rs": "gemm_reduce_scatter", "ar": "gemm_allreduce", "ag": "allgather_gemm", "ring": "ring_attention",
         "moe_dispatch_gemm": "moe_dispatch_gemm", "moe_gemm_combine": "moe_gemm_combine", "allreduce": "allreduce",
         "allreduce_ll": "allreduce", "allreduce_2shot": "allreduce", "ar_latency": "gemm_allreduce"}


# ------------------------------------------------------------------------------- the ranks
def _say(t0, *words):
    print(f"[{time.monotonic() - t0:7.2f}] rank {os.environ.get('OMPI_COMM_WORLD_RANK', '?')}:", *words, flush=True)


def _op_call(op, comm, big):
    """A call of `op` on fresh inputs of this rank: fn() -> output (launches, does not wait)."""
    import cupy
    import numpy as np

    rng = cupy.random.RandomState(1 + comm.rank)
    h = lambda *s: rng.standard_normal(s, dtype=cupy.float32).astype(cupy.float16)  # noqa: E731
    import mkernel
    if op in ("rs", "ar", "ag"):
        M, N, K = (8192, 8192, 2048) if big else (1024, 1024, 256)
        fn = {"rs": mkernel.gemm_reduce_scatter, "ar": mkernel.gemm_allreduce, "ag": mkernel.allgather_gemm}[op]
        a = h(M // comm.size if op == "ag" else M, K)
        b = h(K, N)
        return lambda: fn(a, b, comm=comm)
    if op == "ring":
        S = 4096 if big else 1024
        q, k, v = h(S, 8, 128), h(S, 8, 128), h(S, 8, 128)
        return lambda: mkernel.ring_attention(q, k, v, comm=comm)
    if op in ("allreduce", "allreduce_ll", "allreduce_2shot"):  # 4 MiB: data + flags; 256 KiB: LL words
        if op == "allreduce_2shot":  # the two-shot path, forced at 2 ranks
            mkernel.config.configure(allreduce_twoshot_min_bytes_2ranks=1, allreduce_twoshot_min_bytes=1)
        x = h(16 if op == "allreduce_ll" else 256, 8192)
        return lambda: mkernel.allreduce(x, comm=comm)
    if op == "ar_latency":  # 8 rows, weights as [N, K]: the fused latency kernels (LL words)
        a, w = h(8, 4096), h(8192, 4096)
        return lambda: mkernel.gemm_allreduce(a, w.T, comm=comm)
    T, H, F, E, k = (2048, 4096, 1024, 8, 2) if big else (256, 1024, 512, 8, 2)
    x = h(T, H)
    ids = cupy.asarray(np.argsort(np.random.default_rng(comm.rank).random((T, E)), axis=1)[:, :k].astype(np.int32))
    gates = cupy.full((T, k), 0.5, dtype=cupy.float32)
    w1, w2 = h(E // comm.size, H, F), h(E // comm.size, F, H)
    if op == "moe_dispatch_gemm":
        return lambda: mkernel.moe_dispatch_gemm(x, ids, gates, w1, comm=comm, num_experts=E)[0]
    y, handle = mkernel.moe_dispatch_gemm(x, ids, gates, w1, comm=comm, num_experts=E)
    return lambda: mkernel.moe_gemm_combine(y, w2, handle, comm=comm)


def _raises_within(t0, comm, fn, limit_s):
    """Calls fn, then polls comm.check(); (exception, seconds) or (None, seconds)."""
    import mkernel
    t = time.monotonic()
    try:
        fn()
        while time.monotonic() - t < limit_s:
            comm.check()
            time.sleep(0.02)
    except (mkernel.PeerError, mkernel.TimeoutError) as e:
        return e, time.monotonic() - t
    except Exception as e:  # noqa: BLE001  (reported as a wrong kind of failure)
        return e, time.monotonic() - t
    return None, time.monotonic() - t


def child(op, scenario):
    import cupy
    from mpi4py import MPI

    import mkernel

    t0 = time.monotonic()
    world = MPI.COMM_WORLD
    comm = mkernel.init(world, gpus_per_node=1 if scenario == "d" else None, transport="host")
    r, pids = comm.rank, world.allgather(os.getpid())
    timeout = float(os.environ.get("MKERNEL_TIMEOUT_S", "5"))
    call = _op_call(op, comm, big=scenario == "d")
    if scenario != "a":
        call()
        cupy.cuda.get_current_stream().synchronize()
        comm.check()
    world.Barrier()
    if r == 1:
        if scenario in ("a", "b"):
            os._exit(9)
        if scenario == "c":
            call()
            time.sleep(0.3)
            os._exit(9)
        if scenario == "d":
            call()
            time.sleep(0.05)
            os._exit(9)
        os.kill(os.getpid(), signal.SIGSTOP)  # (e) resumed by the survivor once it raised
        err, s = _raises_within(t0, comm, call, 3 * timeout + 10)
        _say(t0, f"RESUMED {type(err).__name__ if err else 'NONE'} after {s:.2f} s: {str(err)[:200]}")
    else:
        time.sleep(1.0 if scenario == "c" else 0.5)
        err, s = _raises_within(t0, comm, call, 3 * timeout + 10)
        _say(t0, f"RAISED {type(err).__name__ if err else 'NONE'} after {s:.2f} s: {str(err)[:300]}")
        if scenario == "e":
            os.kill(pids[1], signal.SIGCONT)
    t = time.monotonic()
    try:
        comm.close()
        _say(t0, f"CLOSED after {time.monotonic() - t:.2f} s")
    except Exception as e:  # noqa: BLE001
        _say(t0, f"CLOSE RAISED {type(e).__name__}: {e}")
    _say(t0, "EXITING")


# ------------------------------------------------------------------------------- the driver
def _mpirun(args, timeout):
    sys.path.insert(0, str(ROOT))
    from mkernel.testing import mpi_child_env

    env, mps = mpi_child_env(2, dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
    ver = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    mca = "prte_abort_on_non_zero_status" if "v5." in ver or "Open MPI) 5" in ver else "orte_abort_on_non_zero_status"
    cmd = ["mpirun", "-n", "2", "--oversubscribe", "--bind-to", "none", "--mca", mca, "0", *mps,
           "-x", "MKERNEL_TIMEOUT_S", sys.executable, str(Path(__file__).resolve()), "--child", *args]
    t = time.monotonic()
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
        text, rc = out.stdout + out.stderr, out.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"), "timeout"
    return text, rc, time.monotonic() - t


def check(op, scenario, text, wall, timeout):
    """(ok, why) of one case from the job's output."""
    m = re.search(r"\[\s*([\d.]+)\] rank 0: RAISED (\w+) after ([\d.]+) s: (.*)", text)
    if not m:
        return False, "the survivor did not report (hung, or crashed)"
    kind, after, msg = m[2], float(m[3]), m[4]
    if kind not in ("PeerError", "TimeoutError"):
        return False, f"survivor raised {kind}: {msg[:120]}"
    if after > timeout + 5:
        return False, f"survivor raised after {after:.1f} s (limit {timeout + 5:g})"
    if NAMES[op] not in msg and "proxy" not in msg and "answer" not in msg:
        return False, f"the error does not name the op: {msg[:120]}"
    c = re.search(r"\[\s*([\d.]+)\] rank 0: CLOSED after ([\d.]+) s", text)
    if not c or float(c[2]) > 10:
        return False, "close did not return within 10 s" if not c else f"close took {float(c[2]):.1f} s"
    if wall - float(c[1]) > 10 + 15:  # start-up (~10 s) is in wall, not in the child's clock
        return False, f"the job ended {wall - float(c[1]):.0f} s after close (finalize hung?)"
    if scenario == "e":
        rz = re.search(r"rank 1: RESUMED (\w+)", text)
        if not rz or rz[1] not in ("PeerError", "TimeoutError"):
            return False, f"the resumed rank did not raise ({rz[1] if rz else 'no report'})"
    return True, f"{kind} after {after:.1f} s, close {float(c[2]):.1f} s"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--scenarios", default="abcde")
    p.add_argument("--logs", metavar="DIR", help="write each job's whole output to DIR/OP-SCENARIO.log")
    opts = p.parse_args()
    if opts.logs:
        Path(opts.logs).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MKERNEL_TIMEOUT_S", "5")
    timeout = float(os.environ["MKERNEL_TIMEOUT_S"])
    failed = 0
    for op in opts.ops.split(","):
        for sc in opts.scenarios:
            if sc == "d" and op in ("allreduce", "allreduce_ll", "allreduce_2shot", "ar_latency"):  # one node only
                continue
            text, rc, wall = _mpirun([op, sc], timeout=4 * timeout + 60)
            ok, why = check(op, sc, text, wall, timeout)
            if opts.logs:
                (Path(opts.logs) / f"{op}-{sc}.log").write_text(text)
            failed += not ok
            print(f"{'OK ' if ok else 'FAIL'} {op:18s} {sc}  {why}  (job {wall:.0f} s, rc {rc})", flush=True)
            if not ok:
                print("    " + "\n    ".join(text.strip().splitlines()[-8:]), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
