"""The command line: the main job's no-GPU exit, info, env, and the one table of MKERNEL_* variables."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mkernel.core import env
from mkernel.runtime import gpu

ROOT = Path(__file__).resolve().parents[2]


def _run(*args):
    return subprocess.run([sys.executable, "-m", "mkernel", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(gpu.device_count() > 0, reason="a GPU is visible: the main job would run")
@pytest.mark.parametrize("args", [(), ("--quick",), ("run",)])
def test_main_job_without_gpu_says_so_in_one_line_and_exits_2(args):
    r = _run(*args)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no GPU" in lines[0]


def test_info_runs_and_reports_versions_and_cache():
    r = _run("info")
    assert r.returncode == 0, r.stderr
    for word in ("mkernel 0.", "NVRTC", "MPI", "GPUs:", "kernel cache:", "transports"):
        assert word in r.stdout, f"info lacks {word!r}:\n{r.stdout}"


def test_precompile_in_parallel_fills_the_cache(tmp_path):
    names = ("runtime_test", "split_policy_test")
    r = subprocess.run([sys.executable, "-m", "mkernel", "precompile", "--jobs", "2", *names], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "MKERNEL_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in r.stdout.splitlines()[:2]] == list(names), r.stdout
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "kernels").glob("*.cubin")) == list(names)


def test_environment_doc_is_generated_from_the_table():
    assert (ROOT / "docs" / "ENVIRONMENT.md").read_text() == env.markdown(), \
        "docs/ENVIRONMENT.md is stale: python -m mkernel env --markdown > docs/ENVIRONMENT.md"


def test_every_mkernel_variable_in_the_sources_is_registered():
    used = set()
    for path in list((ROOT / "mkernel").rglob("*.py")) + list((ROOT / "mkernel").rglob("*.c")) + \
            list((ROOT / "bench").rglob("*.py")):
        used |= set(re.findall(r"\bMKERNEL_[A-Z0-9_]+", path.read_text()))
    assert used <= set(env.VARS), f"unregistered: {sorted(used - set(env.VARS))}"


def test_version_is_exported():
    import mkernel
    assert re.fullmatch(r"\d+\.\d+\.\d+", mkernel.__version__)


def test_import_leaves_ml_dtypes_until_bfloat16_is_asked_for():
    """ml_dtypes takes ~0.6 s to import (every rank of every job paid it in ``import mkernel``)."""
    code = ("import sys, mkernel; assert 'ml_dtypes' not in sys.modules; "
            "from mkernel.runtime.arrays import BFLOAT16, HALF_TYPES; "
            "assert BFLOAT16.name == 'bfloat16' and [d.name for d in HALF_TYPES] == ['bfloat16', 'float16']")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr
