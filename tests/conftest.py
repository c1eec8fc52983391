"""Shared test setup: GPU markers skip with a reason, and the fixtures the test files share.

Every test file runs under plain ``python -m pytest`` (one rank). Tests marked ``mpi`` are also run by
the test command under ``mpiexec -n 2`` and ``-n 4``: they must use only collectives every rank
reaches, and decide pass or fail collectively (``all_ranks``), so that one failing rank fails all
of them instead of leaving the others blocked in a collective. ``all_ranks`` and ``UNDER_MPIEXEC``
are in tests/helpers/ranks.py.
"""

import os

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX beside CuPy: don't take 75% of the GPU

from mkernel.runtime import gpu


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


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    """A private, empty kernel cache for tests that count compilations."""
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"
