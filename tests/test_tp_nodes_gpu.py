"""GPU: the fused tensor-parallel ops between nodes (hierarchical GEMM+ReduceScatter and
GEMM+AllReduce, issue 7).

- 2 ranks as 2 emulated nodes (``gpus_per_node=1``), over the host transport and over TCP (the
  2-rank pass of tests/run_gpu.sh: 2 GPUs, or 2 ranks sharing GPU 0);
- 4 ranks as 2 nodes x 2 ranks (this test starts its own ``mpiexec -n 4`` from the 1-rank pass),
  so that NVLink inside a node and the proxy between nodes work together.

Checks, every output poisoned with NaN first: exact integer-valued inputs bitwise against the
float64 sum (mismatching 128 x 256 tiles named), random inputs within the per-element bound of
tests/test_tp_gpu.py against float64, off-grid shapes, fp16 and bf16, B as [K, N] and [N, K],
three launches of each shape alternating with another shape (stale flags and counters), results
bitwise equal from launch to launch (AllReduce: and on every rank), and the bytes the proxy sent
equal to the hierarchical minimum: (nodes - 1) * M / world * N elements per rank and launch for
ReduceScatter, twice that for AllReduce.
"""

import hashlib

import numpy as np
import pytest
from gpu_arrays import dev as _dev, host as _host, poisoned as _poisoned
from test_tp_gpu import DTYPES, _check_close, _check_exact, _collective, _reduce_problem, _rows
from test_transport import WORLD, _relaunch

import mkernel
from mkernel.gemm_allreduce import gemm_allreduce
from mkernel.gemm_reduce_scatter import gemm_reduce_scatter
from mkernel.testing import sync_or_exit

# (M, N, K, dtype, integer inputs, b layout): off-grid rows per rank, N and K
CASES = [(2 * 200, 264, 136, "fp16", True, "kn"), (4 * 136, 520, 256, "bf16", False, "nk"),
         (4 * 256, 512, 128, "bf16", True, "kn")]
REPEATS = 3
HANG_S = 45.0  # past MKERNEL_TIMEOUT_S (30): a device wait times out and is reported first


def _b_arg(b, layout, dt):
    return (_dev(b.astype(dt)), None) if layout == "kn" else (_dev(np.ascontiguousarray(b.T).astype(dt)), "nk")


def _sent(comm):
    """Bytes this rank's proxy has sent (0 before the first plan between nodes starts it)."""
    return sum(p["bytes_sent"] for p in comm.stats().get("peers", {}).values())


def _run_cases(comm, allreduce):
    """Every case REPEATS times, interleaved (case 0, 1, 2, 0, 1, 2, ...)."""
    fn, hops = (gemm_allreduce, 2) if allreduce else (gemm_reduce_scatter, 1)
    W, L, nodes = comm.size, comm.local_size, comm.num_nodes
    problems = []
    for i, (M, N, K, kind, integer, layout) in enumerate(CASES):
        if M % W:
            continue
        (a, b), total, absum, absprod, _ = _reduce_problem(comm, 40 + i, M, K, N, kind, integer)
        dt = DTYPES[kind]
        problems.append((M, N, K, kind, integer, _dev(a.astype(dt)), _b_arg(b, layout, dt), total, absum, absprod))

    def body():
        first = {}
        for rep in range(REPEATS):
            for i, (M, N, K, kind, integer, a, (b, bl), total, absum, absprod) in enumerate(problems):
                dt = DTYPES[kind]
                out = _poisoned((M, N) if allreduce else (M // W, N), kind)
                before = _sent(comm)
                fn(a, b, comm=comm, out=out, b_layout=bl, path="fused")
                what = f"{fn.__name__} case {i} {M}x{N}x{K} {kind} launch {rep}"
                sync_or_exit(what, HANG_S)
                comm.check()
                got = _host(out)
                want = hops * (nodes - 1) * (M // W) * N * dt.itemsize
                if _sent(comm) - before != want:
                    return False, f"{what}: the proxy sent {_sent(comm) - before} bytes, the minimum is {want}"
                pick = (lambda x: x) if allreduce else (lambda x: _rows(x, comm, M))
                row0 = 0 if allreduce else comm.rank * (M // W)
                if integer:
                    ok, msg = _check_exact(got, pick(total), dt, what, row0=row0)
                else:
                    ok, msg = _check_close(got, pick(total), pick(absum), pick(absprod), K, dt, what, row0=row0)
                if not ok:
                    return False, msg
                if allreduce:
                    digests = comm.mpi.allgather(hashlib.sha256(got.view(np.uint16).tobytes()).hexdigest())
                    if len(set(digests)) != 1:
                        return False, f"{what}: ranks hold different bits"
                if i in first and not np.array_equal(got.view(np.uint16), first[i]):
                    return False, f"{what}: not bitwise equal to launch 0"
                first.setdefault(i, got.view(np.uint16).copy())
        return True, f"{len(problems)} cases x {REPEATS} launches, {W} ranks on {nodes} nodes of {L}"

    _collective(comm, body)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.multi_gpu
@pytest.mark.parametrize("transport", ["host", "tcp"])
def test_reduce_ops_between_two_emulated_nodes(transport):
    if WORLD.Get_size() != 2:
        pytest.skip("pairs exactly two ranks")
    comm = mkernel.init(WORLD, gpus_per_node=1, transport=transport, workspace_bytes=192 << 20)
    try:
        assert comm.num_nodes == 2
        for allreduce in (False, True):
            _run_cases(comm, allreduce)
    finally:
        comm.close()


@pytest.mark.gpu
def test_reduce_ops_on_two_nodes_of_two_ranks(request):
    """4 ranks (sharing the GPUs) as 2 nodes x 2: partials summed over NVLink (IPC) inside each node,
    node partials (and, AllReduce, reduced tiles) through the host transport between them."""
    if _relaunch(request, n=4):
        return
    if WORLD.Get_size() != 4:
        pytest.skip("4 ranks as 2 nodes x 2")
    comm = mkernel.init(WORLD, gpus_per_node=2, transport="host", workspace_bytes=192 << 20)
    try:
        assert comm.num_nodes == 2 and comm.local_size == 2
        for allreduce in (False, True):
            _run_cases(comm, allreduce)
    finally:
        comm.close()


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.multi_gpu
def test_allgather_gemm_refuses_several_nodes():
    if WORLD.Get_size() != 2:
        pytest.skip("pairs exactly two ranks")
    comm = mkernel.init(WORLD, gpus_per_node=1, workspace_bytes=16 << 20)
    try:
        a = _dev(np.ones((64, 64), np.float16))
        with pytest.raises(mkernel.ArgumentError, match="between nodes only"):
            mkernel.allgather_gemm(a, a, comm=comm)
    finally:
        comm.close()
