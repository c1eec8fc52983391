"""GPU: the main job (``python -m mkernel --quick``) as a user runs it, at 1 rank and as a job of 2
ranks sharing the GPU (under MPS when a daemon runs): it exits 0, names every row, prints ``-``
where there is no figure (never nan), has a row for every op, and says last that every check passed."""

import subprocess
import sys

import pytest

from tests.helpers.jobs import MPI_ENV, WORLD, mpiexec

OPS = ("gemm (engine)", "attention (engine)", "gemm_reduce_scatter", "gemm_allreduce", "allgather_gemm",
       "ring_attention", "moe_dispatch_gemm", "moe_gemm_combine")


def _check_output(r):
    """The report is stdout (log lines go to stderr, in any order with it)."""
    text, rc = r.stdout, r.returncode
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert rc == 0, f"exit status {rc}:\n{text[-4000:]}\n{r.stderr[-2000:]}"
    assert lines and lines[-1].startswith("all ") and lines[-1].endswith(" checks passed"), text[-4000:]
    assert "nan" not in text.lower().replace("nanos", ""), text[-4000:]
    assert "<lambda>" not in text, text[-4000:]
    for op in OPS:
        assert any(ln.startswith(op) for ln in lines), f"no row for {op}:\n{text[-4000:]}"


@pytest.mark.gpu
def test_main_job_at_one_rank():
    if WORLD.Get_size() > 1:
        pytest.skip("runs its own processes: the 1-rank pass")
    r = subprocess.run([sys.executable, "-m", "mkernel", "--quick"], env=MPI_ENV, capture_output=True, text=True,
                       timeout=140)
    _check_output(r)


@pytest.mark.gpu
def test_main_job_at_two_ranks_sharing_the_gpu():
    if WORLD.Get_size() > 1:
        pytest.skip("runs its own job: the 1-rank pass")
    r = mpiexec(2, ["-m", "mkernel", "--quick"], timeout=140)
    _check_output(r)
