"""The collective driver of multi-rank GPU tests (ring attention, MoE): every rank runs the same
cases in the same order, each case guarded (an exception is a failure), outcomes exchanged after
each case on the test's own MPI communicator (``comm.test_mpi``); when a rank raised and another did
not, or a peer error or timeout was raised, the ranks may be out of step, so all of them stop
running cases (the rest is recorded as not run). Then a per-case table and a collective decision."""

import pytest

from mkernel.comm.collectives import allgather_object
from mkernel.core.errors import ClosedError, PeerError, TimeoutError

from tests.helpers.ranks import all_ranks

# Errors after which a communicator is unusable (the ranks may be out of step): stop running cases.
FATAL = (TimeoutError, PeerError, ClosedError)


def gpu_mpi(fn):
    """The marks of a test that runs at 1 rank and in the 2-rank pass (tests/run_gpu.sh)."""
    return pytest.mark.gpu(pytest.mark.mpi(fn))


def with_driver(c):
    """Gives the communicator a duplicate of its MPI communicator for the tests' own collectives
    (outcomes, decisions), so that they can never be matched against the op's internal ones."""
    c.test_mpi = c.mpi.Dup()
    return c


def close(c):
    try:
        c.test_mpi.Free()
    finally:
        c.close()



def run_cases(comm, names, body, after=None):
    """Runs body(name) -> (ok, message) for every name on every rank; calls ``after()`` when no case
    stopped the run (every rank then reaches it). Returns {name: [(ok, message) per rank]}."""
    results, stopped = {}, None
    for name in names:
        if stopped is not None:
            results[name] = [(False, f"not run ({stopped})")] * comm.size
            continue
        raised, fatal = False, False
        try:
            ok, msg = body(name)
        except Exception as e:  # noqa: BLE001  (an error on one rank must not leave the others waiting)
            ok, msg, raised, fatal = False, f"{type(e).__name__}: {str(e)[:400]}".replace("\n", " "), True, \
                isinstance(e, FATAL)
        gathered = allgather_object(comm.test_mpi, (bool(ok), str(msg), raised, fatal), f"reporting {name!r}",
                                    timeout_s=120)  # timed: a peer stuck elsewhere fails the test, no hang
        results[name] = [(o, m) for o, m, _, _ in gathered]
        raisers = [r for r, g in enumerate(gathered) if g[2]]
        if any(g[3] for g in gathered) or 0 < len(raisers) < comm.size:
            stopped = f"after {name!r} raised on rank(s) {raisers}"
    if stopped is None and after is not None:
        after()
    return results


def report_and_decide(comm, title, names, results):
    """Prints the per-case table (every rank prints the gathered table), then decides collectively."""
    print(f"\n==== {title} (world {comm.size}, rank {comm.rank}) ====")
    width = max(len(n) for n in names)
    for n in names:
        per = results[n]
        status = "OK" if all(o for o, _ in per) else "FAIL"
        if len(per) == 1:
            print(f"{status:5s} {n:{width}s} {per[0][1]}")
        else:
            print(f"{status:5s} {n:{width}s} " + " | ".join(f"r{r}: {m}" for r, (_, m) in enumerate(per)))
    bad = [n for n in names if not all(o for o, _ in results[n])]
    print(f"==== {len(names) - len(bad)}/{len(names)} OK ====", flush=True)
    mine = all(results[n][comm.rank][0] for n in names)
    everywhere = all_ranks(comm.test_mpi, mine)
    assert everywhere and not bad, f"{len(bad)} failing: " + "; ".join(
        f"{n}: " + " | ".join(f"r{r}: {m}" for r, (o, m) in enumerate(results[n]) if not o) for n in bad[:4])


def collective(comm, name, body, after=None):
    """One guarded case, decided on every rank."""
    report_and_decide(comm, name, [name], run_cases(comm, [name], lambda _: body(), after))
