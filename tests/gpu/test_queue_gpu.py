"""The queue with GPU warps as producers (a CPU thread cannot reorder writes the way GPU writes over
PCIe can), back-pressure and proxy failure as a kernel sees them, and 2 ranks as 2 nodes exchanging
tiles through the proxy (host and tcp transports; on 2 GPUs or sharing one).

GPU and 2-rank run:  mpiexec -n 2 python -m pytest tests/gpu/test_queue_gpu.py
(at one rank the 2-rank tests relaunch themselves under mpiexec -n 2)."""

import ctypes
import time

import numpy as np
import pytest
from mpi4py import MPI

from mkernel.comm.proxy import QUEUE_TEST, CommandQueue, Proxy, QueueStressArgs, TileExchangeArgs, barrier
from mkernel.core.errors import MKernelError

from tests.helpers.jobs import collectively, relaunch

cupy = pytest.importorskip("cupy", reason="cupy is not installed: the GPU tests need it")
pytestmark = pytest.mark.gpu

WORLD = MPI.COMM_WORLD
MK_ERR_TIMEOUT, MK_ERR_PEER = 1, 2
WHERE_QUEUE_SPACE = 0xFFFFFF01


def _require_gpu():
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as e:
        pytest.skip(f"no CUDA GPU: {e}")
    if n == 0:
        pytest.skip("no CUDA GPU")
    cc = cupy.cuda.Device(0).compute_capability
    if cc != "90":
        pytest.skip(f"needs compute capability 9.0, GPU 0 is {cc}")
    return n


def _function(name):
    from mkernel.runtime.compile import module
    return module(QUEUE_TEST).function(name)


def _launch(name, grid, block, args):
    from mkernel.runtime.launch import launch
    launch(_function(name), grid, block, args)


def _wait_stream(proxy, timeout_s):
    """Waits for the current stream without hanging on a kernel that never ends; raises the proxy's error."""
    event = cupy.cuda.Event()
    event.record()
    deadline = time.monotonic() + timeout_s
    while not event.done:
        if proxy is not None:
            proxy.check()
        assert time.monotonic() < deadline, "kernel did not finish"
        time.sleep(0.0005)


def _sync(rank):
    from mkernel.runtime.sync import SyncState
    return SyncState(rank)


def _null_proxy(queue, expected):
    proxy = Proxy(MPI.COMM_SELF, transport="null")
    proxy.attach_queue(queue)
    proxy.verify_commands(expected)
    return proxy


@pytest.mark.parametrize("batch", [True, False], ids=["warp-batch", "per-thread"])
def test_gpu_producers_none_lost_or_duplicated(batch):
    _require_gpu()
    blocks, warps, iters = 264, 8, 32
    total = blocks * warps * iters * 32  # 2.16 million
    queue = CommandQueue(1 << 12, gpu=True)
    sync = _sync(0)
    with _null_proxy(queue, total) as proxy:
        proxy.start()
        t = time.perf_counter()
        _launch(f"queue_stress<{'true' if batch else 'false'}>", (blocks,), (32 * warps,),
                QueueStressArgs(sync.args("queue", 30), queue.device_args(), iters, 0))
        _wait_stream(proxy, 60)
        while queue.header.tail < total:
            proxy.check()
            assert time.perf_counter() - t < 60
        rate = total / (time.perf_counter() - t)
        stats = proxy.stats()
    assert sync.host_status.code == 0
    assert stats["verify"] == {"distinct": total, "duplicates": 0, "corrupt": 0}
    assert stats["commands"] == total
    print(f"GPU producers ({'warp batches' if batch else 'one per thread'}): {rate / 1e6:.2f} M commands/s")
    sync.close()
    queue.close()


def test_gpu_back_pressure_times_out_and_keeps_what_was_published():
    _require_gpu()
    queue = CommandQueue(64, gpu=True)
    sync = _sync(0)
    with _null_proxy(queue, 128) as proxy:  # not started: nothing frees the ring
        t = time.monotonic()
        _launch("queue_stress<true>", (1,), (32,), QueueStressArgs(sync.args("queue", 0.3), queue.device_args(), 4, 0))
        _wait_stream(None, 10)
        assert 0.3 <= time.monotonic() - t < 5
        st = sync.host_status
        assert st.code == MK_ERR_TIMEOUT and st.where == WHERE_QUEUE_SPACE, (st.code, st.where)
        proxy.start()  # the two batches that fitted are intact, nothing was overwritten
        deadline = time.monotonic() + 5
        while queue.header.tail < 64:
            assert time.monotonic() < deadline
        time.sleep(0.05)
        assert proxy.stats()["verify"] == {"distinct": 64, "duplicates": 0, "corrupt": 0}
    sync.close()
    queue.close()


def test_gpu_producer_sees_proxy_failure_without_waiting_out_the_timeout():
    _require_gpu()
    queue = CommandQueue(64, gpu=True)
    sync = _sync(0)
    with _null_proxy(queue, 0) as proxy:
        proxy.start()
        t = time.monotonic()  # warp 0's first command is bad: the proxy fails and stops consuming
        _launch("queue_stress<true>", (4,), (128,), QueueStressArgs(sync.args("queue", 60), queue.device_args(), 8, 1))
        _wait_stream(None, 20)
        assert time.monotonic() - t < 10
        st = sync.host_status
        assert st.code == MK_ERR_PEER and st.where == WHERE_QUEUE_SPACE, (st.code, st.where)
        with pytest.raises(MKernelError, match="names rank 65535"):
            proxy.check()
    sync.close()
    queue.close()


def _host_array(n, dtype=np.uint32):
    ptr = cupy.cuda.runtime.hostAlloc(n * np.dtype(dtype).itemsize, 2)
    arr = np.ctypeslib.as_array((ctypes.c_uint8 * (n * np.dtype(dtype).itemsize)).from_address(ptr)).view(dtype)
    arr[:] = 0
    return ptr, arr


@pytest.mark.mpi
@pytest.mark.multi_gpu
@pytest.mark.parametrize("transport", ["host", "tcp"])
def test_two_ranks_as_two_nodes_exchange_tiles(request, transport):
    _require_gpu()
    if relaunch(request):
        return
    if WORLD.Get_size() != 2:
        pytest.skip("this test pairs exactly two ranks")
    collectively(_exchange_tiles, transport)


def _exchange_tiles(transport):
    rank = WORLD.Get_rank()
    ngpus = cupy.cuda.runtime.getDeviceCount()
    dev = rank % ngpus
    tiles, tile_bytes, epochs = 64, 256 << 10, 3
    with cupy.cuda.Device(dev):
        send = cupy.zeros(tiles * tile_bytes // 4, dtype=cupy.uint32)
        recv = cupy.zeros_like(send)
        mismatches = cupy.zeros(1, dtype=cupy.uint32)
        flags_ptr, flags = _host_array(tiles + 1)  # the last one: this rank's FLUSH completion
        queue = CommandQueue(1 << 10, gpu=True)
        sync = _sync(rank)
        with Proxy(WORLD, node_ids=[0, 1], transport=transport, cuda_device=dev, bind_address="127.0.0.1") as proxy:
            proxy.register(0, send.data.ptr, send.nbytes, "cuda")
            proxy.register(1, recv.data.ptr, recv.nbytes, "cuda")
            proxy.register_flags(2, flags_ptr, tiles + 1)
            proxy.attach_queue(queue)
            proxy.connect()
            proxy.start()
            relay = cupy.zeros(2 * (tiles + 1), dtype=cupy.uint32)
            args = TileExchangeArgs(sync.args("queue", 30), queue.device_args(flags=flags_ptr, relay=relay),
                                    send.data.ptr, recv.data.ptr,
                                    flags_ptr, mismatches.data.ptr, tiles, tile_bytes, 0, 1 - rank, 0, 1)
            for epoch in range(1, epochs + 1):
                _launch("tile_exchange", (16,), (256,), args)
                _wait_stream(proxy, 60)
                sync.check()
                assert int(mismatches.get()[0]) == 0, f"epoch {epoch}: tile words differ from the peer's pattern"
                assert (flags == epoch).all(), f"epoch {epoch}: flags {flags}"
                barrier(WORLD)  # the peer's next epoch may overwrite flags and tiles only after this check
            stats = proxy.stats()
            assert stats["peers"][1 - rank]["bytes_sent"] == epochs * tiles * tile_bytes
            assert stats["peers"][1 - rank]["bytes_received"] == epochs * tiles * tile_bytes
            barrier(WORLD)  # the peer's last FLUSH needs our proxy to answer it
            proxy.check()
        sync.close()
        queue.close()
        cupy.cuda.runtime.freeHost(flags_ptr)


@pytest.mark.mpi
@pytest.mark.multi_gpu
@pytest.mark.parametrize("transport", ["host", "tcp"])
def test_communicator_proxy_carries_tiles_between_emulated_nodes(request, transport):
    """The communicator's own proxy (comm.proxy, started on first use): 2 ranks as 2 nodes
    (gpus_per_node=1) write tiles of their symmetric workspace into the peer's, with flags in the
    communicator's flag array; comm.stats() counts the bytes; comm.close() stops the proxy.
    Twice, with a fresh communicator each time: the second proxy's host segments may be mapped where
    the first one's were, and a segment unmapped while still registered with CUDA made the driver
    copy into the old pages (every byte of the second communicator's traffic was lost).
    A third time through a sub-communicator with the ranks reversed (split(0, key=-rank)): it shares
    the root's proxy, and its commands' ranks, workspace offsets and flag ids are translated into
    the root's by the device producer."""
    _require_gpu()
    if relaunch(request):
        return
    if WORLD.Get_size() != 2:
        pytest.skip("this test pairs exactly two ranks")
    for via_split in (False, False, True):
        collectively(_comm_proxy_tiles, transport, via_split)


def _comm_proxy_tiles(transport, via_split):
    import mkernel

    root = mkernel.init(WORLD, gpus_per_node=1, transport=transport, workspace_bytes=64 << 20)
    try:
        assert root.num_nodes == 2 and root.local_size == 1
        if via_split:
            comm = root.split(0, key=-root.rank, workspace_bytes=16 << 20)
            assert comm.rank == 1 - root.rank and comm.num_nodes == 2
            assert comm.proxy is root.proxy, "a sub-communicator must use its root's proxy"
            assert comm.proxy_flags[0] != root.proxy_flags[0], "each communicator has its own proxy flags"
            assert root.heap.base < comm.heap.base < root.heap.base + root.heap.nbytes
        else:
            comm = root
            assert comm.stats()["proxy"] is None
        rank, tiles, tile_bytes, epochs = comm.rank, 32, 128 << 10, 3
        send = comm.empty(tiles * tile_bytes // 4, np.uint32)
        recv = comm.empty(tiles * tile_bytes // 4, np.uint32)
        mismatches = cupy.zeros(1, dtype=cupy.uint32)
        proxy = comm.proxy
        fptr, flags = comm.proxy_flags
        region = comm.PROXY_WORKSPACE_REGION
        for epoch in range(epochs):
            args = TileExchangeArgs(comm.sync_args("queue", 30), comm.proxy_queue_args(), send.data.ptr,
                                    recv.data.ptr, fptr, mismatches.data.ptr, tiles, tile_bytes, 0, 1 - rank,
                                    region, region, comm.offset_of(send), comm.offset_of(recv))
            _launch("tile_exchange", (16,), (256,), args)
            _wait_stream(proxy, 60)
            comm.check()
            assert int(mismatches.get()[0]) == 0, f"launch {epoch}: tile words differ from the peer's pattern"
            e = comm.sync.epoch()
            assert (flags[:tiles + 1] == e).all(), f"launch {epoch}: flags {flags[:tiles + 1]}, epoch {e}"
            barrier(WORLD)  # the peer's next launch may overwrite flags and tiles only after this check
        stats = comm.stats()
        assert stats["proxy"] == transport
        assert stats["peers"][1 - rank]["bytes_sent"] == epochs * tiles * tile_bytes
        assert stats["peers"][1 - rank]["bytes_received"] == epochs * tiles * tile_bytes
        barrier(WORLD)  # the peer's last FLUSH needs our proxy to answer it
    finally:
        root.close()  # (closes the sub-communicator first)
