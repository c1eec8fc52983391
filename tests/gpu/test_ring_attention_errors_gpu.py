"""GPU tests of mkernel.ring_attention's argument errors, 1 rank and under mpirun (marked gpu and mpi):
bad arguments raise ArgumentError on every rank before anything is launched, and at 2 ranks (marked
multi_gpu) so do shapes and dtypes that disagree across ranks (tests/gpu/test_ring_attention_gpu.py's
docstring)."""

import numpy as np
import pytest

from tests.helpers import collective_cases
from tests.helpers.argument_errors import refused_before_launch
from tests.helpers.arrays import BF16, DTYPES
from tests.helpers.arrays import poisoned as _poisoned
from tests.helpers.ring_cases import (
    HANG_S,
    _check_local,
    _collective,
    _global_inputs,
    _report_and_decide,
    _ring,
    _run_cases,
    _shard,
    _sync,
)


# ============================================================================ argument errors
def _expect_argument_errors(comm, cases):
    """(ok, message): every callable in cases raises ArgumentError, nothing is launched, and a
    valid call afterwards is right."""
    return refused_before_launch(comm, cases, lambda: _valid_ring_call(comm), HANG_S)


def _valid_ring_call(comm):
    W = comm.size
    host = _global_inputs(61, BF16, 1, 256 * W, 4, 2, 128)
    dq, dk, dv = _shard(comm, True, *host)
    out = _poisoned(dq.shape, "bf16")
    _ring()(dq, dk, dv, comm=comm, causal=True, out=out)
    _sync("valid call after the errors")
    comm.check()
    return _check_local(comm, out, *host, True)


def _local_error_cases(comm):
    """Bad arguments every rank passes alike."""
    import cupy

    ring = _ring()
    F16 = DTYPES["fp16"]

    def z(shape, dt=BF16):
        return cupy.zeros(shape, dtype=dt)

    S = 256
    q, k, v = z((1, S, 4, 128)), z((1, S, 2, 128)), z((1, S, 2, 128))

    def r(q_, k_, v_, **kw):
        kw.setdefault("comm", comm)
        return ring(q_, k_, v_, **kw)

    return {
        "float32 inputs": lambda: r(z(q.shape, np.float32), z(k.shape, np.float32), z(v.shape, np.float32)),
        "float64 inputs": lambda: r(z(q.shape, np.float64), z(k.shape, np.float64), z(v.shape, np.float64)),
        "q bf16, k/v fp16": lambda: r(q, z(k.shape, F16), z(v.shape, F16)),
        "v dtype differs": lambda: r(q, k, z(v.shape, F16)),
        "D = 96": lambda: r(z((1, S, 4, 96)), z((1, S, 2, 96)), z((1, S, 2, 96))),
        "D = 256": lambda: r(z((1, S, 4, 256)), z((1, S, 2, 256)), z((1, S, 2, 256))),
        "D = 32": lambda: r(z((1, S, 4, 32)), z((1, S, 2, 32)), z((1, S, 2, 32))),
        "q D != k D": lambda: r(q, z((1, S, 2, 64)), z((1, S, 2, 64))),
        "v D != k D": lambda: r(q, k, z((1, S, 2, 64))),
        "H_q % H_kv": lambda: r(z((1, S, 6, 128)), z((1, S, 4, 128)), z((1, S, 4, 128))),
        "H_kv > H_q": lambda: r(z((1, S, 2, 128)), z((1, S, 4, 128)), z((1, S, 4, 128))),
        "k/v H_kv differ": lambda: r(z((1, S, 8, 128)), z((1, S, 2, 128)), z((1, S, 4, 128))),
        "rank 2": lambda: r(z((S, 128)), z((S, 128)), z((S, 128))),
        "rank 5": lambda: r(z((1, 1, S, 4, 128)), z((1, 1, S, 2, 128)), z((1, 1, S, 2, 128))),
        "q 4-D, k/v 3-D": lambda: r(q, k[0], v[0]),
        "q 3-D, k/v 4-D": lambda: r(q[0], k, v),
        "batch mismatch": lambda: r(z((2, S, 4, 128)), k, v),
        "k/v batch differ": lambda: r(z((2, S, 4, 128)), z((2, S, 2, 128)), z((1, S, 2, 128))),
        "k S_local != q S_local": lambda: r(q, z((1, S + 2, 2, 128)), z((1, S + 2, 2, 128))),
        "v S_local != k S_local": lambda: r(q, k, z((1, S - 2, 2, 128))),
        "S_local = 0": lambda: r(z((1, 0, 4, 128)), z((1, 0, 2, 128)), z((1, 0, 2, 128))),
        "causal, odd S_local": lambda: r(z((1, 255, 4, 128)), z((1, 255, 2, 128)), z((1, 255, 2, 128)), causal=True),
        "causal, odd S_local, 3-D": lambda: r(z((331, 4, 64)), z((331, 4, 64)), z((331, 4, 64)), causal=True),
        "comm=None": lambda: r(q, k, v, comm=None),
        "comm is an mpi4py communicator": lambda: r(q, k, v, comm=comm.mpi),
        "q is a numpy array": lambda: r(np.zeros(q.shape, dtype=BF16), k, v),
        "out shape": lambda: r(q, k, v, out=z((1, S, 4, 64))),
        "out shape (3-D for 4-D q)": lambda: r(q, k, v, out=z((S, 4, 128))),
        "out dtype fp16": lambda: r(q, k, v, out=z(q.shape, F16)),
        "out float32": lambda: r(q, k, v, out=z(q.shape, np.float32)),
        "out numpy": lambda: r(q, k, v, out=np.zeros(q.shape, dtype=BF16)),
        "comm_sms = 0": lambda: r(q, k, v, comm_sms=0),
        "comm_sms = -1": lambda: r(q, k, v, comm_sms=-1),
        "comm_sms = 1.5": lambda: r(q, k, v, comm_sms=1.5),
    }


@collective_cases.gpu_mpi
def test_argument_errors(comm):
    _collective(comm, "argument errors (every rank alike)",
                lambda: _expect_argument_errors(comm, _local_error_cases(comm)))


def _disagreeing_cases(comm):
    """Arguments that are valid on each rank but disagree across ranks. Every shape here is used
    nowhere else in this file (no rank can have agreed on it before)."""
    import cupy

    ring = _ring()
    r_ = comm.rank
    odd = r_ % 2

    def z(shape, dt=BF16):
        return cupy.zeros(shape, dtype=dt)

    def call(B, S, Hq, Hkv, D, dt=BF16, causal=False):
        return ring(z((B, S, Hq, D), dt), z((B, S, Hkv, D), dt), z((B, S, Hkv, D), dt), comm=comm, causal=causal)

    return {
        "S_local differs": lambda: call(1, 264 + 8 * r_, 4, 2, 64),
        "S_local differs (causal)": lambda: call(1, 272 + 16 * r_, 4, 2, 64, causal=True),
        "dtype differs": lambda: call(1, 296, 4, 2, 64, dt=DTYPES["fp16"] if odd else BF16),
        "H_q differs": lambda: call(1, 312, 4 + 4 * odd, 2, 64),
        "H_kv differs": lambda: call(1, 328, 8, 2 + 2 * odd, 64),
        "D differs": lambda: call(1, 344, 4, 2, 64 + 64 * odd),
        "batch differs": lambda: call(1 + odd, 360, 4, 2, 64),
    }


@pytest.mark.multi_gpu
@collective_cases.gpu_mpi
def test_arguments_that_disagree_across_ranks_raise_on_every_rank(comm):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    names = list(_disagreeing_cases(comm))
    # One case at a time (each decided across ranks), so that a rank that did not raise is named.
    results = _run_cases(comm, names, lambda n: _expect_argument_errors(comm, {n: _disagreeing_cases(comm)[n]}))
    _report_and_decide(comm, "arguments that disagree across ranks", names, results)
