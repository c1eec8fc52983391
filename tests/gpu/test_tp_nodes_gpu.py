"""GPU: the fused tensor-parallel ops between nodes (hierarchical GEMM+ReduceScatter,
GEMM+AllReduce and AllGather+GEMM, issue 7).

- 2 ranks as 2 emulated nodes (``gpus_per_node=1``), over the host transport and over TCP (the
  2-rank pass of tests/run_gpu.sh: 2 GPUs, or 2 ranks sharing GPU 0);
- 4 ranks as 2 nodes x 2 ranks (this test starts its own ``mpiexec -n 4`` from the 1-rank pass),
  so that NVLink inside a node and the proxy between nodes work together.

Checks, every output poisoned with NaN first: exact integer-valued inputs bitwise against the
float64 sum (mismatching 128 x 256 tiles named), random inputs within the per-element bound of
tests/helpers/tp_cases.py against float64, off-grid shapes, fp16 and bf16, B as [K, N] and [N, K],
three launches of each shape alternating with another shape (stale flags and counters), results
bitwise equal from launch to launch (AllReduce: and on every rank), and the bytes the proxy sent
equal to the hierarchical minimum: (nodes - 1) * M / world * N elements per rank and launch for
ReduceScatter, twice that for AllReduce, (nodes - 1) * M / world * K for AllGather (whose
gathered A is also compared bitwise). A caller's copies queued right behind an op on its stream
must not hold up the proxy (each launch on a new stream).
"""

import hashlib
import itertools

import numpy as np
import pytest

import mkernel
from mkernel import config
from mkernel.ops.allgather_gemm import allgather_gemm
from mkernel.ops.gemm_allreduce import gemm_allreduce
from mkernel.ops.gemm_reduce_scatter import gemm_reduce_scatter
from mkernel.testing import bytes_sent, bytes_sent_since, sync_or_exit

from tests.helpers.arrays import dev as _dev
from tests.helpers.arrays import host as _host
from tests.helpers.arrays import poisoned as _poisoned
from tests.helpers.jobs import WORLD, relaunch
from tests.helpers.tp_cases import (
    DTYPES,
    _b_arg,
    _check_close,
    _check_exact,
    _collective,
    _rank_inputs,
    _reduce_problem,
    _rows,
)

# (rows per rank, N, K, dtype, integer inputs, b layout): M = rows x world, so every case runs at
# any world size; off-grid rows per rank, N and K
CASES = [(200, 264, 136, "fp16", True, "kn"), (136, 520, 256, "bf16", False, "nk"),
         (256, 512, 128, "bf16", True, "kn")]
REPEATS = 3
# "unfused": cupy.matmul then the op's own collective over the same paths (the benchmarks' baseline;
# written in session 4, not yet run on a GPU)
PATHS = ("fused", "unfused")
HANG_S = 45.0  # past MKERNEL_TIMEOUT_S (30): a device wait times out and is reported first


def _run_cases(comm, allreduce):
    """Every case REPEATS times, interleaved (case 0, 1, 2, 0, 1, 2, ...)."""
    fn, hops = (gemm_allreduce, 2) if allreduce else (gemm_reduce_scatter, 1)
    W, L, nodes = comm.size, comm.local_size, comm.num_nodes
    problems = []
    for i, (mb, N, K, kind, integer, layout) in enumerate(CASES):
        M = mb * W
        (a, b), total, absum, absprod, _ = _reduce_problem(comm, 40 + i, M, K, N, kind, integer)
        dt = DTYPES[kind]
        problems.append((M, N, K, kind, integer, _dev(a.astype(dt)), _b_arg(b, layout, dt), total, absum, absprod))

    digests = []  # AllReduce: compared across ranks after the loop, where every rank arrives

    def body():
        first = {}
        for rep, path, (i, problem) in itertools.product(range(REPEATS), PATHS, enumerate(problems)):
            M, N, K, kind, integer, a, (b, bl), total, absum, absprod = problem
            dt = DTYPES[kind]
            out = _poisoned((M, N) if allreduce else (M // W, N), kind)
            before = bytes_sent(comm)
            staged = rep >= 1  # config.comm_staged from the second launch on: the same bits
            join = rep >= 1  # the GEMM CTAs join the reduction and forwards; the third launch stages theirs
            share = (True, "always", False)[rep % 3]  # both grid sizes (7/8 or all of the MPS share) for every op
            what = f"{fn.__name__} {path} case {i} {M}x{N}x{K} {kind} launch {rep} staged {staged} join {join} " \
                   f"share {share}"
            try:
                with config.override(comm_staged=staged, tp_join_staged=rep == 2, mps_full_share=share):
                    fn(a, b, comm=comm, out=out, b_layout=bl, path=path, join=join)
                sync_or_exit(what, HANG_S)
                comm.check()
            except mkernel.MKernelError as e:
                return False, f"{what}: {type(e).__name__}: {e}"
            got = _host(out)
            want = hops * (nodes - 1) * (M // W) * N * dt.itemsize
            sent = bytes_sent_since(comm, before, want)
            if sent != want:
                return False, f"{what}: the proxy sent {sent} bytes, the minimum is {want}"
            pick = (lambda x: x) if allreduce else (lambda x: _rows(x, comm, M))
            row0 = 0 if allreduce else comm.rank * (M // W)
            if integer:
                ok, msg = _check_exact(got, pick(total), dt, what, row0=row0)
            else:
                ok, msg = _check_close(got, pick(total), pick(absum), pick(absprod), K, dt, what, row0=row0)
            if not ok:
                return False, msg
            if allreduce:
                digests.append((what, hashlib.sha256(got.view(np.uint16).tobytes()).hexdigest()))
            if (i, path) in first and not np.array_equal(got.view(np.uint16), first[i, path]):
                return False, f"{what}: not bitwise equal to launch 0"
            first.setdefault((i, path), got.view(np.uint16).copy())
        return True, f"{len(problems)} cases x {REPEATS} launches, {W} ranks on {nodes} nodes of {L}"

    _collective(comm, _with_state(comm, fn.__name__, body))
    views = comm.mpi.allgather(digests)  # a rank that failed above raised on every rank: none gets here
    differ = [what for k, (what, _) in enumerate(digests) if len({v[k][1] for v in views}) != 1]
    assert not differ, f"ranks hold different bits: {differ}"


# AllGather+GEMM: (rows per rank, N, K, dtype, integer inputs)
AG_CASES = [(200, 264, 136, "fp16", True), (136, 520, 512, "bf16", False), (256, 256, 256, "bf16", True)]


def _proxy_state(comm, op):
    """For failure messages: per peer (writes, signals, bytes sent, received), and each plan of op's
    proxy flags (credits, flushes, first arrival counters)."""
    peers = {p: (s["writes"], s["signals"], s["bytes_sent"], s["bytes_received"])
             for p, s in comm.stats().get("peers", {}).items() if s["writes"] or s["signals"]}
    flags = [comm.proxy_flags[1][v["pflags"].offset:v["pflags"].offset + 24].tolist()
             for k, v in comm.plans.items()
             if isinstance(k, tuple) and k[:2] == ("buffers", op) and "pflags" in v]
    try:
        comm.proxy.check()
        proxy_error = "none"
    except Exception as e:  # noqa: BLE001  (what the device timeout may hide)
        proxy_error = f"{type(e).__name__}: {e}"
    return f"proxy {peers}, proxy error: {proxy_error}, plan flags {flags}"


def _with_state(comm, op, body):
    def run():
        try:
            ok, msg = body()
        except Exception as e:  # noqa: BLE001  (reported with the proxy's state)
            ok, msg = False, f"{type(e).__name__}: {e}"
        return ok, msg if ok else f"{msg} [{_proxy_state(comm, op)}]"
    return run


def _run_ag_cases(comm):
    W, nodes = comm.size, comm.num_nodes
    problems = []
    for i, (mb, N, K, kind, integer) in enumerate(AG_CASES):
        dt = DTYPES[kind]
        shards = [_rank_inputs(60 + i, r, (mb, K), (K, N), dt, integer) for r in range(W)]
        a, b = shards[comm.rank]
        full = np.vstack([s[0] for s in shards])
        problems.append((mb, N, K, kind, integer, _dev(a.astype(dt)), _dev(b.astype(dt)), full, full @ b,
                         np.abs(full) @ np.abs(b)))

    def body():
        first = {}
        for rep, path, (i, problem) in itertools.product(range(REPEATS), PATHS, enumerate(problems)):
            mb, N, K, kind, integer, a, b, full, ref, absprod = problem
            dt = DTYPES[kind]
            before = bytes_sent(comm)
            copy_first = rep % 2 == 1  # launches alternate who copies the shard into its own rows
            staged = rep >= 1  # config.comm_staged from the second launch on: the same bits
            join = rep == REPEATS - 1  # config.tp_ag_join_gemm on the last launch
            share = (True, "always", False)[rep % 3]  # both grid sizes (7/8 or all of the MPS share) for every op
            what = f"allgather_gemm {path} case {i} {mb}x{N}x{K} {kind} launch {rep} copy_first {copy_first} " \
                   f"staged {staged} join {join} share {share}"
            try:
                with config.override(tp_ag_copy_first=copy_first, comm_staged=staged, tp_ag_join_gemm=join,
                                     mps_full_share=share):
                    out, gathered = allgather_gemm(a, b, comm=comm, out=_poisoned((W * mb, N), kind), path=path,
                                                   return_gathered=True)
                sync_or_exit(what, HANG_S)
                comm.check()
            except mkernel.MKernelError as e:
                return False, f"{what}: {type(e).__name__}: {e}"
            got = _host(out)
            want = (nodes - 1) * mb * K * dt.itemsize
            sent = bytes_sent_since(comm, before, want)
            if sent != want:
                return False, f"{what}: the proxy sent {sent} bytes, the minimum is {want}"
            if not np.array_equal(_host(gathered).view(np.uint16), full.astype(dt).view(np.uint16)):
                return False, f"{what}: the gathered A differs"
            ok, msg = (_check_exact(got, ref, dt, what) if integer else
                       _check_close(got, ref, 0.0, absprod, K, dt, what))
            if not ok:
                return False, msg
            if (i, path) in first and not np.array_equal(got.view(np.uint16), first[i, path]):
                return False, f"{what}: not bitwise equal to launch 0"
            first.setdefault((i, path), got.view(np.uint16).copy())
        return True, ""

    _collective(comm, _with_state(comm, "allgather_gemm", body))


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.multi_gpu
@pytest.mark.parametrize("transport", ["host", "tcp"])
def test_reduce_ops_between_two_emulated_nodes(transport):
    """GEMM+RS and GEMM+AR as 2 emulated nodes x 1 rank."""
    def run(comm):
        for allreduce in (False, True):
            _run_cases(comm, allreduce)
    _two_emulated_nodes(transport, run)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.multi_gpu
@pytest.mark.parametrize("transport", ["host", "tcp"])
def test_allgather_gemm_between_two_emulated_nodes(transport):
    """The first use of a CuPy or cuBLAS kernel behind a launch once stalled it (calls.quiesced_first_use);
    the 4-rank test below runs in a fresh job, where every use is a first one."""
    _two_emulated_nodes(transport, _run_ag_cases)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.multi_gpu
@pytest.mark.parametrize("transport", ["host", "tcp"])
def test_caller_copies_queued_behind_an_op_between_nodes(transport):
    """A caller's copies queued on its stream right behind an op between nodes (``cupy.asarray`` of
    host data, a copy of the output into pinned memory) must not hold up the proxy's copies the op
    waits for (docs/ARCHITECTURE.md, known debts). Each launch on a new stream, kept alive, so the
    streams' hardware queues move from launch to launch; exact integer results, the copies' too."""
    def run(comm):
        _collective(comm, lambda: _copies_behind_body(comm))
    _two_emulated_nodes(transport, run)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.multi_gpu
def test_first_launches_of_fresh_plans_between_nodes():
    """A fused AR's first launch on a fresh plan, FRESH_PLANS times (the plans released before each),
    each behind an RS with "auto" comm CTAs: fresh flag blocks and launch counts every round."""
    def run(comm):
        _collective(comm, _with_state(comm, "gemm_allreduce", lambda: _fresh_plans_body(comm)))
    _two_emulated_nodes("host", run)


FRESH_PLANS = 40


def _fresh_plans_body(comm):
    W = comm.size
    dt = DTYPES["fp16"]
    shapes = {"ar": (128 * W, 256, 64), "rs": (512 * W, 1024, 256)}
    problems = {}
    for i, (name, (M, N, K)) in enumerate(shapes.items()):
        (a, b), total, _, _, _ = _reduce_problem(comm, 80 + i, M, K, N, "fp16", True)
        problems[name] = (M, N, _dev(a.astype(dt)), _dev(b.astype(dt)), total)
    for it in range(FRESH_PLANS):
        comm.release_plans()
        for name, fn in (("rs", gemm_reduce_scatter), ("ar", gemm_allreduce)):
            M, N, a, b, total = problems[name]
            out = _poisoned((M, N) if name == "ar" else (M // W, N), "fp16")
            what = f"{fn.__name__} {M}x{N} on fresh plans, round {it}"
            try:
                fn(a, b, comm=comm, out=out, path="fused", comm_sms="auto")
                sync_or_exit(what, HANG_S)
                comm.check()
            except mkernel.MKernelError as e:
                return False, f"{what}: {type(e).__name__}: {e}"
            pick = total if name == "ar" else _rows(total, comm, M)
            ok, msg = _check_exact(_host(out), pick, dt, what, row0=0 if name == "ar" else comm.rank * (M // W))
            if not ok:
                return False, msg
    return True, f"{FRESH_PLANS} rounds of fresh plans"


def _copies_behind_body(comm, launches=8):
    import cupy

    M, K, N = 256, 128, 512
    dt = DTYPES["bf16"]
    (a, b), total, _, _, _ = _reduce_problem(comm, 77, M, K, N, "bf16", True)
    da, db = _dev(a.astype(dt)), _dev(b.astype(dt))
    host_in = np.arange(1 << 18, dtype=np.float32) + comm.rank
    pinned = cupy.cuda.alloc_pinned_memory(M * N * dt.itemsize)
    copied = np.frombuffer(pinned, dtype=np.uint16, count=M * N).reshape(M, N)
    streams = []
    for i in range(launches):
        what = f"gemm_allreduce {M}x{N}x{K} launch {i} with copies behind it"
        s = cupy.cuda.Stream(non_blocking=True)
        streams.append(s)
        out = _poisoned((M, N), "bf16")
        cupy.cuda.get_current_stream().synchronize()  # the poison lands before s runs
        copied[...] = 0xFFFF
        try:
            with s:
                gemm_allreduce(da, db, comm=comm, out=out)
                arrived = cupy.asarray(host_in)  # host to device, queued behind the op
                cupy.cuda.runtime.memcpyAsync(pinned.ptr, out.data.ptr, out.nbytes, 2, s.ptr)  # and back
            sync_or_exit(what, HANG_S, stream=s)
            comm.check()
        except mkernel.MKernelError as e:
            return False, f"{what}: {type(e).__name__}: {e}"
        got = _host(out)
        ok, msg = _check_exact(got, total, dt, what)
        if not ok:
            return False, msg
        if not np.array_equal(copied, got.view(np.uint16)):
            return False, f"{what}: the copy behind the op does not hold its output"
        if not np.array_equal(_host(arrived), host_in):
            return False, f"{what}: the host-to-device copy behind the op lost data"
    return True, f"{launches} launches on {len(streams)} streams"


def _two_emulated_nodes(transport, run):
    if WORLD.Get_size() != 2:
        pytest.skip("pairs exactly two ranks")
    comm = mkernel.init(WORLD, gpus_per_node=1, transport=transport, workspace_bytes=192 << 20)
    try:
        assert comm.num_nodes == 2
        run(comm)
    finally:
        comm.close()


def _emulated_nodes(request, run, nodes, per_node):
    """run(comm) in a child job of nodes x per_node ranks (sharing the GPUs) over the host transport."""
    if relaunch(request, n=nodes * per_node):
        return
    if WORLD.Get_size() != nodes * per_node:
        pytest.skip(f"{nodes * per_node} ranks as {nodes} nodes x {per_node}")
    comm = mkernel.init(WORLD, gpus_per_node=per_node, transport="host", workspace_bytes=192 << 20)
    try:
        assert comm.num_nodes == nodes and comm.local_size == per_node
        run(comm)
    finally:
        comm.close()


@pytest.mark.gpu
def test_tp_ops_on_three_emulated_nodes(request):
    """3 ranks as 3 nodes (a child job sharing the GPU): every rank sends to and receives from two
    other nodes (arrival counters per source node, FLUSHes to several destinations, the owner
    adding node partials in node order)."""
    def run(comm):
        for allreduce in (False, True):
            _run_cases(comm, allreduce)
        _run_ag_cases(comm)
    _emulated_nodes(request, run, nodes=3, per_node=1)


@pytest.mark.gpu
def test_reduce_ops_on_two_nodes_of_two_ranks(request):
    """4 ranks (sharing the GPUs) as 2 nodes x 2: partials summed over NVLink (IPC) inside each node,
    node partials (and, AllReduce, reduced tiles) through the host transport between them."""
    def run(comm):
        for allreduce in (False, True):
            _run_cases(comm, allreduce)
    _emulated_nodes(request, run, nodes=2, per_node=2)


@pytest.mark.gpu
def test_allgather_gemm_on_two_nodes_of_two_ranks(request):
    """A fresh 4-rank job: each shard crosses the network once per other node, then NVLink."""
    _emulated_nodes(request, _run_ag_cases, nodes=2, per_node=2)
