"""Shared test setup: GPU markers skip with a reason, and helpers for tests that run at any rank count.

Every test file runs under plain ``python -m pytest`` (one rank). Tests marked ``mpi`` are also run by
the test command under ``mpiexec -n 2`` and ``-n 4``: they must use only collectives every rank
reaches, and decide pass or fail collectively (``all_ranks``), so that one failing rank fails all
of them instead of leaving the others blocked in a collective.
"""

import os

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX beside CuPy: don't take 75% of the GPU

from mkernel.runtime import gpu

_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")
UNDER_MPIEXEC = any(v in os.environ for v in _SIZE_VARS)


def _hopper_missing() -> str:
    if gpu.device_count() == 0:
        return gpu.describe_missing()
    try:
        gpu.require_hopper()
    except Exception as e:
        return str(e)
    return ""


def pytest_collection_modifyitems(config, items):
    need_gpu = [i for i in items if i.get_closest_marker("gpu") or i.get_closest_marker("multi_gpu")]
    if not need_gpu:
        return
    reason = _hopper_missing()
    for item in need_gpu:
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"needs an sm_90 GPU: {reason}"))


@pytest.fixture(scope="session")
def mpi_comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def all_ranks(comm, ok: bool, timeout_s: float = 60.0) -> bool:
    """True only if ``ok`` holds on every rank (a collective: every rank must call it). Timed: a
    peer stuck elsewhere (in an op's own collective, after this rank failed) fails the test
    instead of hanging the job."""
    from mkernel.comm.collectives import allgather_bytes
    views = allgather_bytes(comm, bytes([bool(ok)]), "gathering the test's result", timeout_s)
    return views == [b"\x01"] * comm.Get_size()


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    """A private, empty kernel cache for tests that count compilations."""
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"
