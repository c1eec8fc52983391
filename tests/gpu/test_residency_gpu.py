"""GPU: every persistent kernel finishes with only part of its grid resident.

A kernel on another stream holds all but FREE_SMS of the SMs this rank's persistent grids count on
(mkernel.runtime.launch.sm_count: all of them, or under MPS the part of the client's share that two clients
were measured to get at once; mkernel.testing.StreamHold);
then each op is called on the default stream. Its grid (sized for the whole GPU, or the MPS share)
can only run a few CTAs at a time, as when a peer's kernel holds SMs under MPS: the call must finish
while the hold lasts, with the same bits as an unhindered call of the same inputs. A kernel whose
CTAs waited for CTAs that never became resident (fixed roles by block index, grid barriers) would
time out instead (docs/ARCHITECTURE.md, "Residency"). Runs at any rank count (1-rank pass and, under
MPS, the 2- and 4-rank passes).
"""

import time

import numpy as np
import pytest

import mkernel

from tests.helpers import collective_cases
from tests.helpers import moe_cases as tm
from tests.helpers.arrays import DTYPES, bits, dev, poisoned
from tests.helpers.tp_cases import _controller_problem

FREE_SMS = 3
HOLD_SMEM = 200 * 1024  # one holding block per SM

WORKSPACE = tm.WORKSPACE  # the module communicator's (tests/gpu/conftest.py)



def _tp(comm, op):
    call, _, _, shape = _controller_problem(comm, op, 61, 1024 * comm.size, 512, 768)
    return lambda: bits(call(poisoned(shape, "fp16")))


def _moe(comm, fused):
    P = tm._problem(f"residency {fused}", comm.size, "bf16", 256, 4, 2, "zipf", 500, values="unit")
    me, W1 = comm.rank, tm._weights(P, 264)
    if fused:
        def run():
            _, y, h = tm._run(P, me, W1, 264, "kn", comm, path="fused")
            return np.concatenate([bits(y).ravel(), bits(tm._combine(P, me, y, h, "kn", comm)[1]).ravel()])
        return run
    x, ids, w = tm._inputs(P, me)

    def run():
        recv, h = mkernel.moe_dispatch(x, ids, w, comm=comm, num_experts=P.E, capacity=P.capacity)
        return np.concatenate([bits(recv).ravel(), bits(mkernel.moe_combine(recv, h, comm=comm)).ravel()])
    return run


def _ring(comm):
    rng = np.random.default_rng(7 + comm.rank)
    q, k, v = (dev(rng.standard_normal((512, 4, 64)).astype(DTYPES["bf16"])) for _ in range(3))
    return lambda: bits(mkernel.ring_attention(q, k, v, comm=comm, causal=True))


CALLS = {"rs": lambda c: _tp(c, "rs"), "ar": lambda c: _tp(c, "ar"), "ag": lambda c: _tp(c, "ag"),
         "ring_attention": _ring, "moe_fused": lambda c: _moe(c, True), "moe": lambda c: _moe(c, False)}


def _body(comm, name):
    import cupy

    from mkernel.runtime.launch import sm_count
    from mkernel.testing import StreamHold

    run = CALLS[name](comm)
    want = run()  # the shape's first call (agreement, allocation) and the reference bits
    comm.check()
    comm.test_mpi.Barrier()
    # Every rank's hold is resident before any rank's op starts: under MPS an op launched early
    # takes SMs a peer's hold then waits for (seen at 4 ranks), and that peer's op never starts.
    try:
        hold, why = StreamHold(cupy.cuda.Stream(non_blocking=True), timeout_s=120, ctas=sm_count() - FREE_SMS,
                               smem=HOLD_SMEM), ""
    except RuntimeError as e:
        hold, why = None, str(e)
    holds = comm.test_mpi.allgather(why)
    if any(holds):
        if hold:
            hold.close()
        return False, "no op launched: a rank's hold did not become resident: " + "; ".join(h for h in holds if h)
    try:
        t0 = time.monotonic()
        got = run()  # its copies to the host wait on the default stream: for the op, not the hold
        secs = time.monotonic() - t0
        held = not hold.started.done  # recorded behind the holding kernel
    finally:
        hold.release()
    tm._sync(f"{name} after the hold")
    hold.close()
    comm.check()
    same = got.shape == want.shape and bool((got == want).all())
    msg = f"{secs:.2f} s with {FREE_SMS} SMs free, bits {'equal' if same else 'DIFFER'}"
    if not held:
        return False, msg + "; the hold had ended (timed out) before the op finished"
    return same, msg


@collective_cases.gpu_mpi
@pytest.mark.parametrize("name", list(CALLS))
def test_finishes_with_part_of_the_grid_resident(comm, name):
    collective_cases.collective(comm, f"{name} with all but {FREE_SMS} SMs held", lambda: _body(comm, name))
