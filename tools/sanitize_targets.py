"""Every kernel once at a small shape, for compute-sanitizer (tools/sanitize.sh). Exits non-zero on a
wrong result, so the sanitizer run also checks the answer."""

import faulthandler
import os
import sys

import cupy
from mpi4py import MPI

import mkernel
from mkernel.diagnostics import sanitize
from mkernel.diagnostics.selftest import Protocol


def protocol():
    comm = mkernel.init(MPI.COMM_SELF, workspace_bytes=4 << 20)
    p = Protocol(comm, 1024)
    for _ in range(3):
        p.run("exchange")
    cupy.cuda.get_current_stream().synchronize()
    comm.check()
    assert p.mismatch_count() == 0
    comm.close()


TARGETS = [protocol, *sanitize.WORLD1]
names = sys.argv[1:]  # target names to run (default: all); "-name" leaves one out
skip = {n[1:] for n in names if n.startswith("-")}
only = {n for n in names if not n.startswith("-")}
unknown = (skip | only) - {t.__name__ for t in TARGETS}
if unknown:
    sys.exit(f"unknown targets {sorted(unknown)}; known: {[t.__name__ for t in TARGETS]}")
stacks_s = float(os.environ.get("MKERNEL_SANITIZE_STACKS_S", 0))
if stacks_s:  # where the host waits if a target outlasts its limit
    faulthandler.dump_traceback_later(stacks_s, exit=False)
for target in TARGETS:
    if target.__name__ in skip or (only and target.__name__ not in only):
        continue
    if target is sanitize.target_moe_gemm and stacks_s:
        target(watch_s=stacks_s / 8)  # its stages and the error word logged on the way
    else:
        target()
    print(f"{target.__module__}.{target.__name__}: ok", flush=True)
sys.exit(0)
