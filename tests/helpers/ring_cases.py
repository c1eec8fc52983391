"""What the ring attention GPU tests share (tests/gpu/test_ring_attention_gpu.py, *_errors_gpu.py,
*_worlds_gpu.py): the global inputs every rank builds from a fixed seed, this rank's shard of them, the
sharded float64 / float32 reference and its check, and the collective driver."""

import importlib
import math

from mkernel.ops.sequence import shard_sequence
from mkernel.testing import sync_or_exit

from tests.helpers import collective_cases
from tests.helpers.arrays import attention_reference as _attention_reference
from tests.helpers.arrays import compare_attention as _compare
from tests.helpers.arrays import dev as _dev
from tests.helpers.arrays import host_result as _host_result
from tests.helpers.arrays import random_qkv as _random_qkv

# The module, not the function: mkernel re-exports the function under the same name.
mra = importlib.import_module("mkernel.ops.ring_attention")

HANG_S = 45.0        # past MKERNEL_TIMEOUT_S (30): a device wait times out and is reported first


def _ring():
    return mra.ring_attention


def _sync(what, timeout_s=HANG_S):
    sync_or_exit(what, timeout_s)


def _local_reference(comm, q, k, v, causal, scale):
    """This rank's rows of the reference on the whole sequence of the global host arrays q, k, v (the
    plain causal mask of the global sequence): (out [B, S_local, H_q, D], lse [B, H_q, S_local])."""
    o, lse = _attention_reference(q, k, v, causal, scale)
    return (shard_sequence(o, comm.rank, comm.size, causal=causal, axis=1),
            shard_sequence(lse, comm.rank, comm.size, causal=causal, axis=2))


def _check_local(comm, out, q, k, v, causal, scale=None, lse=None):
    """(ok, message): a device output (and lse) of this rank against the sharded global reference of
    the global host arrays q, k, v."""
    D = q.shape[-1]
    sc = scale if scale is not None else 1.0 / math.sqrt(D)
    ref_o, ref_lse = _local_reference(comm, q, k, v, causal, sc)
    return _compare(*_host_result(out, lse), ref_o, ref_lse)


def _global_inputs(seed, dt, B, S_full, Hq, Hkv, D):
    """Host (q, k, v) of the whole sequence, [B, S_full, H, D] (B None: 3-D), standard normal; the
    same on every rank (a fixed seed)."""
    return _random_qkv(seed, dt, B, S_full, S_full, Hq, Hkv, D)


def _shard(comm, causal, *xs):
    """This rank's parts (device arrays) of global host arrays (sequence axis -3)."""
    return tuple(_dev(shard_sequence(x, comm.rank, comm.size, causal=causal, axis=-3)) for x in xs)


# --------------------------------------------------------------------- the collective driver
_run_cases = collective_cases.run_cases
_report_and_decide = collective_cases.report_and_decide
_collective = collective_cases.collective
