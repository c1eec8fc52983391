"""The runtime on real GPUs: symmetric memory, epoch flags, credits, host-memory litmus, graphs,
timeouts and a dead peer. Run at 1 rank and under ``mpirun -n 2`` (2 GPUs, or 2 ranks sharing one)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mkernel
from mkernel.diagnostics.selftest import Protocol

from tests.helpers.ranks import UNDER_MPIEXEC, all_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]
WORDS = 4096



@pytest.fixture(scope="module")
def proto(comm):
    return Protocol(comm, WORDS)


def expected_pattern(epoch, sender, words):
    i = np.arange(words, dtype=np.uint32)
    return (np.uint32((epoch * 2654435761) & 0xFFFFFFFF) ^ np.uint32(sender << 24) ^ i).astype(np.uint32)


def _sync():
    import cupy
    cupy.cuda.get_current_stream().synchronize()


def _exchange_problem(c, proto):
    """One launch of the exchange kernel (poisoned slots first): None when the epoch advanced by one
    and every node peer's pattern arrived intact through c's pointer table, else what went wrong."""
    proto.slots.fill(0xDEADBEEF)
    c.mpi.Barrier()
    e0 = c.sync.epoch()
    proto.run("exchange")
    _sync()
    c.check()
    got = proto.slots.get()
    wrong = {p: int((got[p] != expected_pattern(e0 + 1, p, WORDS)).sum()) for p in range(c.local_size)}
    if c.sync.epoch() == e0 + 1 and proto.mismatch_count() == 0 and not any(wrong.values()):
        return None
    return (f"epoch {e0} -> {c.sync.epoch()}, {proto.mismatch_count()} mismatches seen by the kernel "
            f"({proto.first_mismatch()}), wrong words by sender {wrong}")


def _exchange_arrives(c, proto):
    return _exchange_problem(c, proto) is None


def test_each_rank_writes_every_peer_through_the_pointer_table(comm, proto):
    assert all_ranks(comm.mpi, _exchange_arrives(comm, proto))


def test_split_communicators_live_in_their_parents_workspace(comm):
    """split() carves a sub-communicator's workspace from its parent's (one pool per process): an
    exchange through a rank-reversed sub-communicator's pointer table reaches the right peers; after
    arenas of different sizes on different ranks (and a rank that joins none), the parent's own
    allocations still get one offset on every rank and overlap no arena; closing hands the ranges
    back; closing a root closes its sub-communicators."""
    W, me = comm.size, comm.rank
    free_before = list(comm.heap._ranges.free)
    rev = comm.split(0, key=-me, workspace_bytes=8 << 20)
    alone = comm.split(me, workspace_bytes=(me + 2) << 20)  # a different size on every rank
    first = comm.split(0 if me == 0 else None, workspace_bytes=4 << 20)
    ok = rev.rank == W - 1 - me and rev.device_id == comm.device_id and alone.size == 1
    ok &= (first is None) == (me != 0)
    ok &= comm.heap.base < rev.heap.base < comm.heap.base + comm.heap.nbytes
    p = Protocol(rev, WORDS)
    ok &= _exchange_arrives(rev, p)
    buf = comm.empty(3 << 20, np.uint8)
    ok &= len(set(comm.mpi.allgather(comm.offset_of(buf)))) == 1
    lo, hi = buf.data.ptr, buf.data.ptr + buf.nbytes
    for sub in (rev, alone, first):
        if sub is not None:
            ok &= hi <= sub.heap.base or sub.heap.base + sub.heap.nbytes <= lo
    del p, buf
    for sub in (first, alone, rev):
        if sub is not None:
            sub.close()
    ok &= comm.heap._ranges.free == free_before
    root = mkernel.init(comm.mpi)
    child = root.split(0)
    root.close()
    with pytest.raises(mkernel.ClosedError):
        child.empty(16, np.uint8)
    assert all_ranks(comm.mpi, ok)


def test_grow_workspace_replaces_it_collectively(comm):
    """grow_workspace: refused (on every rank) while arrays from comm.empty live or for a size not
    larger; afterwards the new workspace is mapped by every peer (an exchange through the pointer
    table) and the ops' buffers come back on next use."""
    root = mkernel.init(comm.mpi, workspace_bytes=4 << 20)
    try:
        x = root.empty(1024, np.uint32)
        with pytest.raises(mkernel.ArgumentError, match="still alive"):
            root.grow_workspace(16 << 20)
        del x
        with pytest.raises(mkernel.ArgumentError, match="not more"):
            root.grow_workspace(2 << 20)
        root.grow_workspace(32 << 20)
        ok = root.heap.nbytes >= 32 << 20
        ok &= _exchange_arrives(root, Protocol(root, WORDS))  # (its arrays are freed before close)
    finally:
        root.close()
    assert all_ranks(comm.mpi, ok)


def test_workspace_grows_in_place_when_an_allocation_finds_no_room(comm):
    """comm.empty of more than is free grows a cuMem workspace in place: the arrays from before keep
    their offsets and data, the new one lies past the old end, every rank reads through its node
    peers' mappings what they wrote into both, and an op then runs on the grown workspace."""
    import cupy

    root = mkernel.init(comm.mpi, workspace_bytes=4 << 20)
    try:
        if not root.heap.growable:
            pytest.skip("the workspace is mapped through legacy CUDA IPC here (it cannot grow)")
        old = root.heap.nbytes
        a = root.empty(1 << 18, np.uint32)  # 1 MiB of the 3 MiB past the control area
        a[...] = cupy.arange(1 << 18, dtype=cupy.uint32) + root.rank
        off_a = root.offset_of(a)
        b = root.empty(3 << 20, np.uint8)  # more than is left
        b[...] = root.rank + 1
        cupy.cuda.runtime.deviceSynchronize()
        comm.mpi.Barrier()
        bad = []  # the checks that failed on this rank, by name
        if not (root.heap.nbytes >= 2 * old and root.offset_of(a) == off_a and root.offset_of(b) + b.size > old):
            bad.append(f"layout: {old} -> {root.heap.nbytes} bytes, a at {root.offset_of(a)} (was {off_a}), "
                       f"b at {root.offset_of(b)}")
        for p, base in enumerate(root.heap.peer_base):
            r = root.node_mpi.allgather(root.rank)[p]
            pa = cupy.ndarray((1 << 18,), cupy.uint32, cupy.cuda.MemoryPointer(
                cupy.cuda.UnownedMemory(base + off_a, 1 << 20, root), 0))
            pb = cupy.ndarray((b.size,), cupy.uint8, cupy.cuda.MemoryPointer(
                cupy.cuda.UnownedMemory(base + root.offset_of(b), b.size, root), 0))
            wrong_a = int((pa != cupy.arange(1 << 18, dtype=cupy.uint32) + r).sum())
            wrong_b = (pb != r + 1).nonzero()[0]
            if wrong_a or wrong_b.size:
                first = int(wrong_b[0]) if wrong_b.size else None
                bad.append(f"node rank {p}'s data through this rank's mapping: {wrong_a} words of a wrong, "
                           f"{wrong_b.size} bytes of b wrong (first at b + {first}, b at {root.offset_of(b)})")
        comm.mpi.Barrier()
        del a, b
        problem = _exchange_problem(root, Protocol(root, WORDS))  # (its arrays are freed before close)
        if problem:
            bad.append(f"an exchange on the grown workspace: {problem}")
    finally:
        root.close()
    assert all_ranks(comm.mpi, not bad), f"rank {comm.rank}: {bad}"


def test_two_thousand_launches_never_see_a_flag_without_its_data(comm, proto):
    e0 = comm.sync.epoch()
    for _ in range(2000):
        proto.run("exchange")
    _sync()
    comm.check()
    assert all_ranks(comm.mpi, proto.mismatch_count() == 0 and comm.sync.epoch() == e0 + 2000)


@pytest.mark.multi_gpu
def test_a_delayed_receiver_is_never_overwritten(comm, proto):
    if comm.local_size < 2:
        pytest.skip("needs 2 ranks in a node")
    delay = 10_000_000 if comm.local_rank == 1 else 0  # 10 ms: longer than a time slice
    before = proto.mismatch_count()
    for _ in range(10):
        proto.run("exchange", consume_delay_ns=delay)
    _sync()
    comm.check()
    clean = proto.mismatch_count() == before
    detail = proto.first_mismatch()
    comm.mpi.Barrier()  # the negative control must not start while the receiver still consumes
    # Negative control: without credits the fast sender overwrites the slow receiver's slot.
    for _ in range(10):
        proto.run("exchange", consume_delay_ns=delay, skip_credit=True)
    _sync()
    overwritten = comm.mpi.allreduce(proto.mismatch_count() - before)
    proto.mismatches.fill(0)
    proto.first.fill(0)
    for _ in range(2):  # leave the slots in a state the credit protocol accepts again
        proto.run("exchange")
    _sync()
    assert all_ranks(comm.mpi, clean), f"a credited slot was overwritten: rank {comm.rank}: {detail}"
    assert overwritten > 0, "the negative control saw no overwrite: the test cannot tell credits from luck"


@pytest.mark.multi_gpu
def test_ping_pong_progresses_between_ranks_sharing_or_not_a_gpu(comm, proto):
    if comm.local_size < 2:
        pytest.skip("needs 2 ranks in a node")
    e0 = comm.sync.epoch()
    t = time.perf_counter()
    for _ in range(3):
        proto.run("pingpong", rounds=100)
    _sync()
    comm.check()
    elapsed = time.perf_counter() - t
    assert all_ranks(comm.mpi, comm.sync.epoch() == e0 + 3), elapsed


def test_message_passing_through_mapped_host_memory(comm, proto):
    import cupy
    nbytes = (WORDS + 2) * 4
    host = cupy.cuda.runtime.hostAlloc(nbytes, 2)
    try:
        import ctypes
        ctypes.memset(host, 0, nbytes)
        before = proto.mismatch_count()
        proto.run("litmus_host", grid=2, rounds=2000, host_area=host)
        _sync()
        comm.check()
        assert proto.mismatch_count() == before
    finally:
        cupy.cuda.runtime.freeHost(host)


def test_captured_graph_replays_a_thousand_times(comm, proto):
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        proto.run("exchange", stream=stream)
        graph = stream.end_capture()
    e0 = comm.sync.epoch()
    before = proto.mismatch_count()
    for _ in range(1000):
        graph.launch(stream)
    stream.synchronize()
    comm.check()
    ok = comm.sync.epoch() == e0 + 1000 and proto.mismatch_count() == before
    got = proto.slots.get()
    for p in range(comm.local_size):
        ok &= np.array_equal(got[p], expected_pattern(e0 + 1000, p, WORDS))
    assert all_ranks(comm.mpi, ok)


def test_a_timed_out_wait_raises_timeout_error_naming_op_rank_and_peer(comm):
    from mpi4py import MPI
    solo = mkernel.init(MPI.COMM_SELF, workspace_bytes=4 << 20)
    try:
        p = Protocol(solo, 64)
        t = time.perf_counter()
        p.run("stuck_wait", timeout_s=0.2)
        _sync()
        elapsed = time.perf_counter() - t
        with pytest.raises(mkernel.TimeoutError, match=r"test on rank 0 timed out waiting for peer 0"):
            solo.check()
        with pytest.raises(mkernel.TimeoutError):  # and the next launch refuses to start
            p.run("exchange")
        assert elapsed < 5
    finally:
        solo.close()


@pytest.mark.skipif(UNDER_MPIEXEC, reason="starts its own mpirun; run from the 1-rank pass")
@pytest.mark.slow
def test_a_dead_rank_makes_the_survivor_raise_within_30_s():
    script = Path(__file__).resolve().parents[1] / "scripts" / "dead_peer.py"
    mca = ["--mca", "orte_abort_on_non_zero_status", "0"]  # Open MPI 4: keep the survivor running
    ver = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    if "Open MPI) 5" in ver or "v5." in ver:
        mca = ["--mca", "prte_abort_on_non_zero_status", "0"]
    from mkernel.testing import mpi_child_env

    env, mps = mpi_child_env(2, dict(os.environ, MKERNEL_TIMEOUT_S="10"))
    cmd = ["mpirun", "-n", "2", "--oversubscribe", *mca, *mps, "-x", "MKERNEL_TIMEOUT_S", "-x", "NCCL_NVLS_ENABLE",
           sys.executable, str(script)]
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    elapsed = time.monotonic() - t
    assert "survivor detected" in r.stdout, r.stdout + r.stderr
    detected_after = float(r.stdout.split("survivor detected after")[1].split()[0])
    assert detected_after < 30 and "peer 1" in r.stdout, r.stdout
    assert elapsed < 90


def test_trace_mode_writes_chrome_json_with_one_span_per_launch(tmp_path, monkeypatch):
    import json

    from mpi4py import MPI
    monkeypatch.setenv("MKERNEL_TRACE", str(tmp_path / "trace-{rank}.json"))
    solo = mkernel.init(MPI.COMM_SELF, workspace_bytes=4 << 20)
    p = Protocol(solo, 256)
    for _ in range(5):
        p.run("exchange")
    _sync()
    solo.close()
    events = json.loads((tmp_path / "trace-0.json").read_text())["traceEvents"]
    assert len(events) == 5 and all(e["ph"] == "X" and e["cat"] == "intra-node" and e["dur"] > 0 for e in events)
    assert sorted(e["args"]["id"] for e in events) == list(range(events[0]["args"]["id"],
                                                                 events[0]["args"]["id"] + 5))


def test_jax_arrays_come_in_through_dlpack():
    jax = pytest.importorskip("jax")
    import cupy

    from mkernel.runtime.arrays import as_cupy
    x = jax.numpy.arange(12, dtype=jax.numpy.float32).reshape(3, 4) * 2
    y = as_cupy(x, "x")
    assert isinstance(y, cupy.ndarray) and y.shape == (3, 4)
    assert np.array_equal(y.get(), np.arange(12, dtype=np.float32).reshape(3, 4) * 2)


def test_host_arrays_are_refused_with_a_clear_message():
    from mkernel.runtime.arrays import as_cupy
    with pytest.raises(mkernel.ArgumentError, match="host memory"):
        as_cupy(np.zeros(4), "x")


def test_persistent_grid_refuses_more_blocks_than_can_be_resident(proto):
    from mkernel.runtime import launch
    fn = proto.module.function("exchange")
    fit = launch.persistent_grid(fn, 256, 0, what="exchange")
    assert fit >= launch.sm_count()
    with pytest.raises(mkernel.ArgumentError, match="resident"):
        launch.persistent_grid(fn, 256, 0, blocks=fit + 1, what="exchange")
