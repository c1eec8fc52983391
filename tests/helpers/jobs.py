"""MPI jobs of the tests: a child ``mpiexec`` job (``mpiexec``), a test relaunching itself under
``mpiexec -n N`` from the one-rank pass (``relaunch``), and a body run on every rank that fails on
all of them if it failed on any (``collectively``)."""

import os
import subprocess
import sys
from pathlib import Path

from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[2]  # the repository: child jobs run there (pytest's rootdir)
WORLD = MPI.COMM_WORLD
MPI_ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
# >1 on an emulated machine (tools/verbs_vm.sh's VM runs without KVM): every child job's limit scales
SLOWDOWN = float(os.environ.get("MKERNEL_TEST_SLOWDOWN", "1"))


def slow(seconds: float) -> float:
    """A test's wall-clock limit on this machine: ``seconds`` as measured on an unemulated one."""
    return seconds * SLOWDOWN


def mpiexec(n, args, timeout, extra=()):
    from mkernel.testing import mpi_child_env

    timeout = slow(timeout)
    env, mps = mpi_child_env(n, MPI_ENV)
    env["PYTHONUNBUFFERED"] = "1"  # a job killed at its limit still shows what it printed
    # --bind-to none: bound to one core each (Open MPI's default at 2 ranks), a rank's proxy thread
    # shares it with the main thread (docs/TRANSPORT.md)
    cmd = ["mpiexec", "-n", str(n), "--oversubscribe", "--bind-to", "none", *mps, "-x", "PYTHONUNBUFFERED", *extra,
           sys.executable, *args]
    # the job stays in the caller's process group: a caller that times out and kills its group
    # (timeout(1), tests/run_gpu.sh) ends the ranks too, where a session of their own left them on the GPU
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        proc.terminate()  # mpirun passes SIGTERM on to its ranks; a SIGKILL would leave them running
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"mpiexec -n {n} ran past {timeout} s:\n{out[-4000:]}\n{err[-4000:]}") from None


def relaunch(request, n=2):
    """At one rank, run this very test under mpiexec -n 2 (its own job); returns True if it did."""
    if WORLD.Get_size() > 1:
        return False
    # faulthandler_timeout: a test stuck past 60 s prints every thread's stack before the job's limit
    r = mpiexec(n, ["-m", "pytest", request.node.nodeid, "-v", "-x", "-p", "no:cacheprovider",
                    "-o", f"faulthandler_timeout={slow(60):g}"], timeout=90)
    assert r.returncode == 0, f"under mpiexec -n {n}:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return True


def collectively(fn, *args, **kwargs):
    """Runs fn on every rank; fails on all of them if it failed on any, so no rank is left waiting in a collective."""
    err = None
    try:
        fn(*args, **kwargs)
    except Exception as e:  # re-raised below, after every rank has reported
        err = e
    ok = WORLD.allreduce(err is None, op=MPI.LAND)
    if err is not None:
        raise err
    assert ok, "another rank failed (see its output)"
