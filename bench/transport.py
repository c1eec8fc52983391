#!/usr/bin/env python3
"""Transport benchmark: the command queue and proxy with GPU producers (null transport), and the host
and TCP transports between 2 ranks acting as 2 nodes, both directions at once.

    mpiexec -n 2 --bind-to none python3 bench/transport.py [--quick]

(--bind-to none: Open MPI binds each of 2 ranks to one core by default, and the proxy thread then
shares it with the rank's main thread.)

Rows (bench/results/transport-<gpus>gpu.json, or transport-2rank-mps.json for 2 ranks sharing a GPU
under MPS), one per measurement: ``transport``, ``bytes``,
``GBps`` (payload per direction per rank), ``limit_GBps`` (what the same run measures for the
underlying link) and ``peer_GBps`` (NCCL's figure for that transport); the queue rows carry
``commands_per_s``. Limits:
- host: cudaMemcpyAsync D2H and H2D at once with pinned memory by both ranks at once (per rank per
  direction: ranks sharing one GPU share its link; each rank's payload crosses D2H on the sender
  and H2D on the receiver), the slower rank's rate.
- tcp: raw loopback TCP, same number of connections, both directions at once, timed the same way.
NCCL numbers are the issue's reference measurements (NCCL refuses two ranks on one GPU).
"""

import argparse
import contextlib
import ctypes
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import harness  # noqa: E402

NCCL_SHM_GBPS, NCCL_SOCKET_GBPS = 28.9, 0.46  # the reference figures (bus bandwidth)
GOAL_HOST, GOAL_TCP, GOAL_COMMANDS = 0.8, 0.7, 2e6
HOST_RUNS = (4, 8, 2)  # host transport: most chunks per copy (MKERNEL_HOST_RUN_CHUNKS; 4 is the default)
WORLD = MPI.COMM_WORLD
MiB = 1 << 20


def host_array(nbytes):
    import cupy
    ptr = cupy.cuda.runtime.hostAlloc(nbytes, 2)
    return ptr, np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


def queue_rate(batch, blocks, warps, iters, reps):
    """Commands per second from kernel launch to the proxy's tail covering the last one (verified)."""
    import cupy

    from mkernel.comm.proxy import QUEUE_TEST, CommandQueue, Proxy, QueueStressArgs
    from mkernel.runtime.compile import module
    from mkernel.runtime.launch import launch
    from mkernel.runtime.sync import SyncState

    fn = module(QUEUE_TEST).function(f"queue_stress<{'true' if batch else 'false'}>")
    total = blocks * warps * iters * 32
    rates = []
    for _ in range(reps):
        queue, sync = CommandQueue(1 << 14, gpu=True), SyncState(WORLD.Get_rank())
        with Proxy(MPI.COMM_SELF, transport="null") as proxy:
            proxy.attach_queue(queue)
            proxy.verify_commands(total)
            proxy.start()
            t = time.perf_counter()
            launch(fn, (blocks,), (32 * warps,), QueueStressArgs(sync.args("queue", 30), queue.device_args(), iters, 0))
            while queue.header.tail < total:
                proxy.check()
                sync.check()
                if time.perf_counter() - t > 60:
                    raise TimeoutError(f"queue stalled at {queue.header.tail} of {total}")
            rates.append(total / (time.perf_counter() - t))
            cupy.cuda.get_current_stream().synchronize()
            v = proxy.stats()["verify"]
            if v != {"distinct": total, "duplicates": 0, "corrupt": 0}:
                raise AssertionError(f"commands lost or duplicated: {v}")
        sync.close()
        queue.close()
    rate = statistics.median(rates)
    return {"transport": "null", "bytes": 32, "GBps": rate * 32 / 1e9, "limit_GBps": None, "peer_GBps": None,
            "commands_per_s": rate, "producer": "warp batches" if batch else "one command per thread",
            "commands": total, "goal_commands_per_s": GOAL_COMMANDS, "meets_goal": rate >= GOAL_COMMANDS}


def pcie_rate(nbytes, reps):
    """GB/s of each direction of this rank while every rank copies D2H and H2D at once (pinned host
    memory; each repetition starts together): what one rank's payload can cross per direction."""
    import cupy

    dev_a, dev_b = cupy.empty(nbytes, cupy.uint8), cupy.empty(nbytes, cupy.uint8)
    (pa, _), (pb, _) = host_array(nbytes), host_array(nbytes)
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    times = []
    for _ in range(reps):
        cupy.cuda.runtime.deviceSynchronize()
        WORLD.Barrier()
        t = time.perf_counter()
        cupy.cuda.runtime.memcpyAsync(pa, dev_a.data.ptr, nbytes, 2, s1.ptr)  # D2H
        cupy.cuda.runtime.memcpyAsync(dev_b.data.ptr, pb, nbytes, 1, s2.ptr)  # H2D
        s1.synchronize()
        s2.synchronize()
        times.append(time.perf_counter() - t)
    cupy.cuda.runtime.freeHost(pa)
    cupy.cuda.runtime.freeHost(pb)
    return nbytes / statistics.median(times) / 1e9


def exchange_times(proxy, queue, flags, nbytes, reps, writes=1, src_region=0, dst_region=1):
    """Per rep: both ranks WRITE nbytes to each other at once, as ``writes`` WRITEs that each add 1
    to flag 0; the slower rank's time until all of its data landed."""
    from mkernel.comm.proxy import FLAG_ADD, WRITE

    peer, size, out = 1 - WORLD.Get_rank(), nbytes // writes, []
    for _ in range(reps):
        flags[0] = 0  # the peer writes only after the barrier
        WORLD.Barrier()
        t = time.perf_counter()
        for i in range(writes):
            queue.push(WRITE, peer, size, src=(src_region, i * size), dst=(dst_region, i * size), flag=(0, 1, FLAG_ADD))
        proxy.wait_flag(flags, 0, writes, timeout_s=120)
        out.append(WORLD.allreduce(time.perf_counter() - t, op=MPI.MAX))
    return out


@contextlib.contextmanager
def exchange_proxy(transport, nbytes, memory="gpu", **extra):
    """A started proxy of the 2 ranks as 2 nodes: regions 0 (source) and 1 (destination) of nbytes
    in GPU or pinned host memory, flags region 2 (pinned); yields (proxy, queue, flags).
    extra: Proxy options."""
    import cupy

    from mkernel.comm.proxy import CommandQueue, Proxy, barrier

    flags_ptr, flags_bytes = host_array(64)
    flags = flags_bytes.view(np.uint32)
    flags[:] = 0
    if memory == "gpu":
        src, dst = cupy.ones(nbytes, cupy.uint8), cupy.zeros(nbytes, cupy.uint8)
        regions, kind, dev = (src.data.ptr, dst.data.ptr), "cuda", cupy.cuda.runtime.getDevice()
    else:
        (sp, _), (dp, _) = host_array(nbytes), host_array(nbytes)
        regions, kind, dev = (sp, dp), "host", None
    queue = CommandQueue(1 << 14)
    try:
        with Proxy(WORLD, node_ids=[0, 1], transport=transport, cuda_device=dev, bind_address="127.0.0.1",
                   **extra) as proxy:
            proxy.register(0, regions[0], nbytes, kind)
            proxy.register(1, regions[1], nbytes, kind)
            proxy.register_flags(2, flags_ptr, 16)
            proxy.attach_queue(queue)
            proxy.connect()
            proxy.start()
            yield proxy, queue, flags
            barrier(WORLD)  # nobody stops its proxy while the other may still send
    finally:
        if memory != "gpu":
            for p in regions:
                cupy.cuda.runtime.freeHost(p)
        cupy.cuda.runtime.freeHost(flags_ptr)


def transport_rows(transport, sizes, reps, memory, limit, peer_gbps, goal, ranks_per_gpu=1, **extra):
    """extra: Proxy options (tcp_connections), also recorded in every row."""
    rank = WORLD.Get_rank()
    rows = []
    with exchange_proxy(transport, max(sizes), memory, **extra) as (proxy, queue, flags):
        exchange_times(proxy, queue, flags, 1 << 20, 2)  # warm-up
        for nbytes in sizes:
            exchange_times(proxy, queue, flags, nbytes, 2)  # this size's warm-up
            t = statistics.median(exchange_times(proxy, queue, flags, nbytes, reps))
            gbps = nbytes / t / 1e9
            lim = limit(nbytes)
            rows.append({"transport": transport, "bytes": nbytes, "GBps": gbps, "limit_GBps": lim,
                         "peer_GBps": peer_gbps,
                         "fraction_of_limit": gbps / lim if lim else None, "memory": memory, "directions": 2,
                         "goal": f">= {goal:.0%} of limit_GBps",
                         "meets_goal": bool(lim and gbps >= goal * lim),
                         # NCCL's figure is of 2 GPUs, each with its own PCIe link: above this run's limit
                         # when 2 ranks share one GPU's link
                         "beats_peer": gbps > peer_gbps,
                         "ranks_per_gpu": ranks_per_gpu,
                         **extra})
            if rank == 0:
                opts = " ".join(f"{k}={v}" for k, v in extra.items())
                print(f"{transport:5s} {memory:4s} {nbytes / MiB:7.0f} MiB  {gbps:7.2f} GB/s  limit {lim:7.2f}  "
                      f"NCCL {peer_gbps:5.2f}  {opts}", flush=True)
    return rows


def raw_tcp_rate(nbytes, conns, reps):
    """Loopback TCP, `conns` connections each way, both ranks sending nbytes at once (threads; the GIL
    is released in every send and receive)."""
    peer = 1 - WORLD.Get_rank()
    listener = socket.create_server(("127.0.0.1", 0), backlog=conns)
    ports = WORLD.allgather(listener.getsockname()[1])
    outgoing = [socket.create_connection(("127.0.0.1", ports[peer])) for _ in range(conns)]
    incoming = [listener.accept()[0] for _ in range(conns)]
    listener.close()
    for s in outgoing + incoming:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    part = nbytes // conns
    send_buf, recv_buf = bytearray(part), bytearray(part)

    def sender(s):
        s.sendall(memoryview(send_buf))

    def receiver(s):
        view, got = memoryview(recv_buf), 0
        while got < part:
            got += s.recv_into(view[got:], part - got)

    times = []
    for _ in range(reps):
        WORLD.Barrier()
        t = time.perf_counter()
        threads = [threading.Thread(target=sender, args=(s,)) for s in outgoing]
        threads += [threading.Thread(target=receiver, args=(s,)) for s in incoming]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        times.append(WORLD.allreduce(time.perf_counter() - t, op=MPI.MAX))
    for s in outgoing + incoming:
        s.close()
    return part * conns / statistics.median(times) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer sizes and reps (smoke run)")
    opts = ap.parse_args()
    if WORLD.Get_size() != 2:
        sys.exit("run with 2 ranks: mpiexec -n 2 python3 bench/transport.py")
    import cupy

    rank = WORLD.Get_rank()
    ngpus = cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(rank % ngpus).use()
    ranks_per_gpu = 2 if ngpus == 1 else 1
    reps = 5 if opts.quick else 21
    sizes = [16 * MiB, 64 * MiB] if opts.quick else [16 * MiB, 64 * MiB, 256 * MiB]
    rows, errors = [], {}

    def section(name, fn):
        try:
            rows.extend(fn())
        except Exception as e:  # noqa: BLE001  (report it, keep the other sections)
            errors[name] = f"{type(e).__name__}: {e}"[:500]
            print(f"rank {rank}: ERROR in {name}: {errors[name]}", flush=True)

    def queue_section():  # rank 0 alone on the GPU, rank 1 waits
        out = []
        if rank == 0:
            for batch in (True, False):
                r = queue_rate(batch, blocks=264, warps=8, iters=16 if opts.quick else 64, reps=min(reps, 5))
                print(f"queue {r['producer']:24s} {r['commands_per_s'] / 1e6:7.2f} M commands/s", flush=True)
                out.append(r)
        return out

    section("queue", queue_section)
    WORLD.Barrier()
    pcie = {}

    def host_limit(nbytes):  # the slower rank's rate with both copying at once
        if nbytes not in pcie:
            pcie[nbytes] = min(WORLD.allgather(pcie_rate(nbytes, reps)))
        return pcie[nbytes]

    for n in sizes:  # measured in the same run, before the transport's
        host_limit(n)
    for run in HOST_RUNS:  # chunks per copy: fewer, bigger copies (bench/NOTES.md)
        section(f"host run {run}", lambda: transport_rows("host", sizes, reps, "gpu", host_limit, NCCL_SHM_GBPS,
                                                          GOAL_HOST, ranks_per_gpu=ranks_per_gpu, host_run_chunks=run))
    for conns in (4,):
        raw = {n: raw_tcp_rate(n, conns, reps) for n in sizes}
        section(f"tcp x{conns}", lambda: transport_rows("tcp", sizes, reps, "host", raw.get, NCCL_SOCKET_GBPS, GOAL_TCP,
                                                        tcp_connections=conns))
        section(f"tcp x{conns} gpu", lambda: transport_rows("tcp", sizes[:1], reps, "gpu", raw.get, NCCL_SOCKET_GBPS,
                                                            GOAL_TCP, tcp_connections=conns))
    all_errors = WORLD.gather(errors)
    if rank == 0:
        merged = {f"rank {r}: {k}": v for r, e in enumerate(all_errors) for k, v in e.items()}
        path = harness.write("transport", rows, gpus=ngpus, nodes=1, transport="null,host,tcp", emulated_nodes=2,
                             ranks_per_gpu=ranks_per_gpu, peer_source="the issue's NCCL reference figures",
                             errors=merged)
        print(harness.table(rows, [("transport", "transport", ""), ("memory", "memory", ""), ("bytes", "bytes", "d"),
                                   ("GBps", "GB/s", ".2f"), ("limit_GBps", "limit", ".2f"),
                                   ("peer_GBps", "NCCL", ".2f"),
                                   ("commands_per_s", "cmd/s", ".3g"), ("meets_goal", "goal", "")]))
        print(f"wrote {path}" + (f"; {len(merged)} section(s) failed" if merged else ""))
        sys.exit(1 if merged else 0)


if __name__ == "__main__":
    main()
