"""GPU: every op's steady-state call only launches and returns (docs/ARCHITECTURE.md, "What an op may
do on the host per call").
After a shape's first call, CALLS calls are queued behind a kernel that holds the stream
(mkernel.testing.StreamHold) with the communicator's MPI communicators swapped for a guard that
fails any use: every call must return while the stream is still held (no host wait on the GPU) and
without MPI (no blocking collective: in a multi-rank job one would complete, since every rank calls,
and hide the wait). Then the held launches run, and the last result must equal the first call's
bit for bit (the same inputs; every op is deterministic).

Ops: gemm (the decode path, also with out= through its kept plan, and the engine), attention,
allreduce (LL words, also with out= through its recorded launches, and flags),
gemm_allreduce's latency path, ring_attention, moe_dispatch + moe_combine, moe_dispatch_gemm +
moe_gemm_combine (unfused and fused) in one node (the TP ops in a node: test_tp_controller_gpu.py);
from 2 ranks on also between emulated nodes (host transport): the three TP ops, ring attention and
MoE (the fused combine too). At 1 rank and in the 2- and 4-rank passes (under MPS there: the ranks run at once).
"""

import time

import numpy as np
import pytest

import mkernel
from mkernel.testing import StreamHold

from tests.helpers import collective_cases
from tests.helpers.arrays import BF16, bits
from tests.helpers.arrays import dev as _dev
from tests.helpers.jobs import WORLD

CALLS = 50
HOLD_S = 20.0  # a call that waits for the GPU returns only once the hold gives up


class _NoMpi:
    """Stands in for a communicator's MPI communicator while the calls are held: any use but its
    rank and size fails the call (a steady-state call must not talk over MPI)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        if name in ("rank", "size", "Get_rank", "Get_size"):
            return getattr(self._real, name)
        raise AssertionError(f"a steady-state call used MPI ({name})")


def _rand(shape, seed, rank=0, dt=BF16):
    return _dev(np.random.default_rng([seed, rank]).standard_normal(shape).astype(np.float32).astype(dt))


def _held(comm, call):
    """call() CALLS times behind a StreamHold, MPI guarded; returns (last result, why not, host ms)."""
    import cupy

    saved = comm.mpi, comm.node_mpi
    hold = StreamHold(timeout_s=HOLD_S)
    try:
        comm.mpi, comm.node_mpi = _NoMpi(saved[0]), _NoMpi(saved[1])
        t0 = time.monotonic()
        try:
            for _ in range(CALLS):
                out = call()
        finally:
            comm.mpi, comm.node_mpi = saved
        host_ms = (time.monotonic() - t0) * 1e3
        held = not hold.started.done
    finally:
        hold.release()
        cupy.cuda.get_current_stream().synchronize()  # the held launches run
        hold.close()
    why = None if held else f"the hold ended before the {CALLS} calls returned ({host_ms:.0f} ms on the host)"
    return out, why, host_ms


def _case(comm, call):
    """(ok, message) of one op: its first call, then the held calls, the same bits at the end."""
    import cupy

    first = call()
    cupy.cuda.get_current_stream().synchronize()
    comm.check()
    want = bits(first)
    last, why, host_ms = _held(comm, call)
    comm.check()
    if why:
        return False, why
    if not np.array_equal(bits(last), want):
        return False, "the last held call's result differs from the first call's"
    return True, f"{CALLS} calls queued in {host_ms:.1f} ms"


def _ops_in_node(comm):
    """{name: call} of the ops in one node, each call returning its output (fresh inputs per op)."""
    r = comm.rank
    ops = {}
    a, w = _rand((16, 1024), 1, r), _rand((2048, 1024), 2, r)
    ops["gemm decode"] = lambda: mkernel.gemm(a, w.T)
    y = mkernel.gemm(a, w.T)
    ops["gemm decode, out= (its kept plan)"] = lambda: mkernel.gemm(a, w.T, out=y)
    a2, b2 = _rand((300, 512), 3, r), _rand((512, 768), 4, r)
    ops["gemm engine"] = lambda: mkernel.gemm(a2, b2)
    q, k, v = (_rand((256, 4, 128), 5 + i, r) for i in range(3))
    ops["attention"] = lambda: mkernel.attention(q, k, v, causal=True)
    x_ll, x_fl = _rand((16, 1024), 8, r), _rand((1024, 1024), 9, r)
    ops["allreduce LL"] = lambda: mkernel.allreduce(x_ll, comm=comm)
    ops["allreduce flags"] = lambda: mkernel.allreduce(x_fl, comm=comm)
    s_ll = mkernel.allreduce(x_ll, comm=comm)
    ops["allreduce LL, out= (its recorded launches)"] = lambda: mkernel.allreduce(x_ll, comm=comm, out=s_ll)
    al, wl = _rand((16, 512), 10, r), _rand((1024, 512), 11, r)
    ops["gemm_allreduce latency"] = lambda: mkernel.gemm_allreduce(al, wl.T, comm=comm)
    ops["ring_attention"] = lambda: mkernel.ring_attention(q, k, v, comm=comm)
    ops.update(_moe_ops(comm))
    return ops


def _moe_ops(comm):
    import cupy

    W, r = comm.size, comm.rank
    T, H, F, E, k = 64, 256, 128, 8, 2
    rng = np.random.default_rng([12, r])
    x = _rand((T, H), 13, r)
    ids = cupy.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
    gates = cupy.asarray(rng.choice(np.array([0.5, 1.0, 2.0], np.float32), size=(T, k)))
    w1, w2 = _rand((E // W, H, F), 14, r), _rand((E // W, F, H), 15, r)

    def dispatch_combine():
        recv, h = mkernel.moe_dispatch(x, ids, gates, comm=comm, num_experts=E)
        return mkernel.moe_combine(recv, h, comm=comm)

    def layer(path):
        def call():
            y, h = mkernel.moe_dispatch_gemm(x, ids, gates, w1, comm=comm, num_experts=E)
            return mkernel.moe_gemm_combine(y, w2, h, comm=comm, path=path)
        return call

    return {"moe dispatch + combine": dispatch_combine, "moe layer (unfused combine)": layer("unfused"),
            "moe layer (fused combine)": layer("fused")}


def _ops_between_nodes(comm):
    W, r = comm.size, comm.rank
    ops = {}
    a, w = _rand((1024, 512), 16, r), _rand((1024, 512), 17, r)
    ops["gemm_reduce_scatter"] = lambda: mkernel.gemm_reduce_scatter(a, w.T, comm=comm)
    ops["gemm_allreduce"] = lambda: mkernel.gemm_allreduce(a, w.T, comm=comm)
    shard = _rand((1024 // W, 512), 18, r)
    ops["allgather_gemm"] = lambda: mkernel.allgather_gemm(shard, w.T, comm=comm)
    q, k, v = (_rand((256, 4, 128), 19 + i, r) for i in range(3))
    ops["ring_attention"] = lambda: mkernel.ring_attention(q, k, v, comm=comm)
    ops.update(_moe_ops(comm))  # the fused combine too: the default path between nodes
    return ops


def _run(comm, title, ops):
    names = list(ops)
    results = collective_cases.run_cases(comm, names, lambda n: _case(comm, ops[n]))
    collective_cases.report_and_decide(comm, title, names, results)


@collective_cases.gpu_mpi
def test_steady_state_calls_only_launch_in_a_node(comm):
    _run(comm, "steady-state calls, one node", _ops_in_node(comm))


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.multi_gpu
def test_steady_state_calls_only_launch_between_nodes():
    """Every rank its own node at 2 ranks, 2 nodes x 2 at 4 (host transport, proxy flags relayed)."""
    W = WORLD.Get_size()
    if W not in (2, 4):
        pytest.skip("2 ranks as 2 nodes, or 4 as 2 nodes x 2")
    comm = collective_cases.with_driver(mkernel.init(WORLD, gpus_per_node=W // 2, transport="host",
                                                     workspace_bytes=192 << 20))
    try:
        assert comm.num_nodes == 2
        _run(comm, "steady-state calls, 2 emulated nodes", _ops_between_nodes(comm))
    finally:
        collective_cases.close(comm)
