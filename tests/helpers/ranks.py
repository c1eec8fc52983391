"""For tests that run at any rank count: whether this process runs under mpiexec, and a collective
pass / fail decision (tests/conftest.py says how the MPI passes run)."""

import os

_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")
UNDER_MPIEXEC = any(v in os.environ for v in _SIZE_VARS)


def all_ranks(comm, ok: bool, timeout_s: float = 60.0) -> bool:
    """True only if ``ok`` holds on every rank (a collective: every rank must call it). Timed: a
    peer stuck elsewhere (in an op's own collective, after this rank failed) fails the test
    instead of hanging the job."""
    from mkernel.comm.collectives import allgather_bytes
    views = allgather_bytes(comm, bytes([bool(ok)]), "gathering the test's result", timeout_s)
    return views == [b"\x01"] * comm.Get_size()
