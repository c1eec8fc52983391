"""Every kernel once at a small shape, for compute-sanitizer (tools/sanitize.sh). Exits non-zero on a
wrong result, so the sanitizer run also checks the answer."""

import importlib
import sys

import cupy
from mpi4py import MPI

import mkernel
from mkernel.selftest import Protocol


def protocol():
    comm = mkernel.init(MPI.COMM_SELF, workspace_bytes=4 << 20)
    p = Protocol(comm, 1024)
    for _ in range(3):
        p.run("exchange")
    cupy.cuda.get_current_stream().synchronize()
    comm.check()
    assert p.mismatch_count() == 0
    comm.close()


TARGETS = [protocol]
# Modules that provide their own small-shape target: sanitize_target() -> None (raises on a wrong result).
for name in ("mkernel.gemm", "mkernel.proxy", "mkernel.gemm_reduce_scatter", "mkernel.gemm_allreduce",
             "mkernel.allgather_gemm", "mkernel.attention", "mkernel.moe", "mkernel.moe_gemm"):
    try:
        mod = importlib.import_module(name)
    except ImportError:
        continue
    if hasattr(mod, "sanitize_target"):
        TARGETS.append(mod.sanitize_target)

for target in TARGETS:
    target()
    print(f"{target.__module__}.{target.__name__}: ok", flush=True)
sys.exit(0)
