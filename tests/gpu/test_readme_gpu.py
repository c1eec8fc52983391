"""GPU: README's "Using it" example, as written, at 1 rank and as a job of 2 ranks sharing the GPU
(under MPS when a daemon runs): it exits 0 with nothing added, so it never drifts from the library."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.jobs import MPI_ENV, WORLD, mpiexec

README = str(Path(__file__).resolve().parents[2] / "README.md")


def _example(tmp_path):
    text = open(README).read()
    section = text[text.index("## Using it"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    path = tmp_path / "readme_example.py"
    path.write_text(code)
    return str(path)


def _check(r):
    assert r.returncode == 0, f"exit status {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


@pytest.mark.gpu
def test_readme_example_at_one_rank(tmp_path):
    if WORLD.Get_size() > 1:
        pytest.skip("runs its own process: the 1-rank pass")
    _check(subprocess.run([sys.executable, _example(tmp_path)], env=MPI_ENV, capture_output=True, text=True,
                          timeout=120))


@pytest.mark.gpu
def test_readme_example_at_two_ranks_sharing_the_gpu(tmp_path):
    if WORLD.Get_size() > 1:
        pytest.skip("runs its own job: the 1-rank pass")
    _check(mpiexec(2, [_example(tmp_path)], timeout=120))
