"""Do two processes' copies between the GPU and host memory run at once? (bench/NOTES.md session 53:
between emulated nodes on one GPU under MPS, ring attention's two directions crossed one after the
other, and capping the host transport's copies in flight did not change that.)

Each rank copies a block in 1 MiB pieces, all ranks starting at one host instant; a host thread
polls one event per piece and stamps its completion on CLOCK_MONOTONIC (one clock for every process
of the host). Scenarios, every rank at once:
  d2h      device -> pinned host (cuMemcpyAsync on a non-blocking stream, as the proxy does)
  h2d      pinned host -> device
  ring     rank 0 sends 8 MiB (D2H) and receives 16 (H2D), rank 1 the reverse: ring attention's
           2 x 1 causal pattern, on two streams a rank (the proxy's lanes)
  kernel   device -> mapped pinned host by a copy kernel (SMs, not copy engines)
  chain    the ring pattern with one client doing both halves of each piece on the copy engines: D2H into
           its own pinned buffer, then H2D into the peer's device buffer (CUDA IPC), as one NIC would
  kchain   the same two halves by copy kernels (SMs) through mapped host memory
  proxy    the ring pattern through the host transport itself (each rank's proxy copies its sends
           out of the GPU, the peer's proxy copies them in): WRITEs of 1 MiB, each adding 1 to a
           flag, whose every step the host stamps as it lands (both halves of a transfer chained)
Every piece is queued behind a gate (a kernel on each stream spinning on a mapped host word) that
opens at the start, so the host's queueing time (~7-20 us a piece under MPS) is not measured.
Per rank and scenario: first and last completion (us from the start), GB/s, and per direction how
much the ranks' copies ran at once (1: at once, 0: one after the other).

    mpirun -n 2 python3 tools/copy_order.py [--mib 16] [--out DIR]   (under MPS: tools/mps.sh)
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import cupy
import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import transport  # noqa: E402  (bench/transport.py: pinned host arrays, the 2-rank proxy exchange)

WORLD = MPI.COMM_WORLD
MiB = 1 << 20
COPY_KERNEL = r"""
extern "C" __global__ void copy16(const uint4* src, uint4* dst, unsigned long long n) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    dst[i] = src[i];
}
extern "C" __global__ void gate(const volatile unsigned* open) {
  while (*open == 0) __nanosleep(1000);
}
"""


def start_together(lead_ns=20_000_000):
    """Every rank returns at one CLOCK_MONOTONIC instant (rank 0's now + lead_ns)."""
    t0 = WORLD.bcast(time.monotonic_ns() + lead_ns if WORLD.rank == 0 else None)
    while time.monotonic_ns() < t0:
        pass
    return t0


def issue(plan, bufs, streams, kernel):
    """Queues every piece; returns [(direction, event)] in issue order."""
    out = []
    for direction, nbytes in plan:
        dev, host, hdev = bufs[direction]
        for off in range(0, nbytes, MiB):
            n = min(MiB, nbytes - off)
            s = streams[direction]
            if direction in ("chain", "kchain"):  # the second half waits for the first, on its own stream
                s = chain_piece(direction, dev.data.ptr + off, host + off, hdev + off, n, streams, kernel)
            elif direction == "kernel":
                kernel((64,), (256,), (np.uint64(dev.data.ptr + off), np.uint64(hdev + off), np.uint64(n // 16)),
                       stream=s)
            elif direction == "d2h":
                cupy.cuda.runtime.memcpyAsync(host + off, dev.data.ptr + off, n,
                                              cupy.cuda.runtime.memcpyDeviceToHost, s.ptr)
            else:
                cupy.cuda.runtime.memcpyAsync(dev.data.ptr + off, host + off, n,
                                              cupy.cuda.runtime.memcpyHostToDevice, s.ptr)
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(s)
            out.append((direction, ev))
    return out


def chain_piece(direction, src, host, peer_dst, n, streams, kernel):
    """One piece sent by this client alone: src -> host (stage 1), host -> the peer's device (stage 2).
    Returns stage 2's stream (the piece has landed when its event completes)."""
    first, second = streams[direction]
    args = ((np.uint64(src), np.uint64(host), np.uint64(n // 16)), (np.uint64(host), np.uint64(peer_dst),
                                                                     np.uint64(n // 16)))
    for stage, (s, (a, b, words)) in enumerate(zip((first, second), args)):
        if stage:
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(first)
            s.wait_event(ev)
        if direction == "kchain":
            kernel((64,), (256,), (a, b, words), stream=s)
        else:
            kind = cupy.cuda.runtime.memcpyDeviceToHost if stage == 0 else cupy.cuda.runtime.memcpyHostToDevice
            cupy.cuda.runtime.memcpyAsync(int(b), int(a), n, kind, s.ptr)
    return second


def peer_buffer(nbytes):
    """This rank's receive buffer and the peer's, opened through CUDA IPC (2 ranks)."""
    mine = cupy.zeros(nbytes, dtype=cupy.uint8)
    handles = WORLD.allgather(cupy.cuda.runtime.ipcGetMemHandle(mine.data.ptr))
    peer = cupy.cuda.runtime.ipcOpenMemHandle(handles[1 - WORLD.rank])
    return mine, peer


class Gate:
    """Holds every stream's queued work until open(): a one-thread kernel spinning on a mapped host word."""

    def __init__(self):
        self.ptr, word = transport.host_array(64)
        self.word = word[:4].view(np.uint32)
        self.kernel = cupy.RawKernel(COPY_KERNEL, "gate")

    def close(self, streams):
        self.word[0] = 0
        for s in streams:
            self.kernel((1,), (1,), (np.uint64(self.ptr),), stream=s)

    def open(self):
        self.word[0] = 1


def every_stream(streams):
    return [s for v in streams.values() for s in (v if isinstance(v, tuple) else (v,))]


def run_scenario(name, plan, bufs, streams, kernel, gate):
    WORLD.Barrier()
    gate.close(every_stream(streams))
    q0 = time.monotonic_ns()
    pending = issue(plan, bufs, streams, kernel)
    issued = (time.monotonic_ns() - q0) / 1e3  # the host's time to queue them, before the start
    t0 = start_together()
    gate.open()
    done = [None] * len(pending)
    left = set(range(len(pending)))
    while left:  # stamp each piece's completion as soon as it is seen
        for i in sorted(left):
            if pending[i][1].done:
                done[i] = (time.monotonic_ns() - t0) / 1e3
                left.discard(i)
    nbytes = sum(b for _, b in plan)
    first, last = min(done), max(done)
    mine = {"scenario": name, "rank": WORLD.rank, "bytes": nbytes, "issued_us": issued, "first_us": first,
            "last_us": last,
            "GBps": nbytes / (last * 1e3) if last else None,
            "pieces": [{"direction": d, "done_us": t} for (d, _), t in zip(pending, done)]}
    rows = WORLD.gather(mine)
    if WORLD.rank == 0:
        for r in rows:
            print(f"{name:7s} rank {r['rank']}: {r['bytes'] / MiB:5.0f} MiB  queued in {r['issued_us']:7.1f}  "
                  f"first {r['first_us']:8.1f}  "
                  f"last {r['last_us']:8.1f} us  {r['GBps']:6.1f} GB/s")
        for direction in sorted({p["direction"] for r in rows for p in r["pieces"]}):
            print(f"{name:7s} {direction}: the ranks' copies overlap {overlap(rows, direction):.2f}")
    return rows


def overlap(rows, direction):
    """How much the ranks' pieces of one direction ran at once: the intersection of each rank's span
    from its 10th to its 90th percentile completion, over the shorter span (1: at once, 0: in turn).
    First and last alone mislead: a rank's first piece may land before the other rank's run."""
    spans = []
    for r in rows:
        done = sorted(p["done_us"] for p in r["pieces"] if p["direction"] == direction)
        if len(done) < 2:
            continue
        spans.append((float(np.percentile(done, 10)), float(np.percentile(done, 90))))
    if len(spans) < 2:
        return float("nan")
    inter = max(0.0, min(e for _, e in spans) - max(s for s, _ in spans))
    return inter / (min(e - s for s, e in spans) or 1e-9)


def run_proxy(small, large, timeout_s=60.0):
    """The ring pattern through the host transport: rank 0 WRITEs `small` bytes, rank 1 `large`, at
    once, in 1 MiB WRITEs that each add 1 to flag 0 at the receiver; the receiver stamps every
    increment. The second of two rounds is kept (the first warms the proxies)."""
    from mkernel.comm.proxy import FLAG_ADD, WRITE

    me, peer = WORLD.rank, 1 - WORLD.rank
    send, recv = (small, large) if me == 0 else (large, small)
    with transport.exchange_proxy("host", large) as (proxy, queue, flags):
        for _ in range(2):
            flags[0] = 0  # the peer writes only after the barrier
            WORLD.Barrier()
            # 2 ms, not 20: a proxy idle past 20 ms sleeps 200 us at a time (proxy.c), 50 us before
            t0 = start_together(2_000_000)
            for i in range(send // MiB):
                queue.push(WRITE, peer, MiB, src=(0, i * MiB), dst=(1, i * MiB), flag=(0, 1, FLAG_ADD))
            issued = (time.monotonic_ns() - t0) / 1e3
            done, deadline = [], t0 + int(timeout_s * 1e9)
            while len(done) < recv // MiB:
                seen = int(flags[0])
                now = time.monotonic_ns()
                done += [(now - t0) / 1e3] * (seen - len(done))
                if now > deadline:
                    proxy.check()
                    raise TimeoutError(f"rank {me}: {seen} of {recv // MiB} WRITEs landed after {timeout_s} s")
    mine = {"scenario": "proxy", "rank": me, "bytes": recv, "issued_us": issued, "first_us": done[0],
            "last_us": done[-1], "GBps": recv / (done[-1] * 1e3),
            "pieces": [{"direction": "landed", "done_us": t} for t in done]}
    rows = WORLD.gather(mine)
    if me == 0:
        for r in rows:
            print(f"proxy   rank {r['rank']}: {r['bytes'] / MiB:5.0f} MiB landed  sends queued by "
                  f"{r['issued_us']:7.1f}  first {r['first_us']:8.1f}  last {r['last_us']:8.1f} us  "
                  f"{r['GBps']:6.1f} GB/s")
        print(f"proxy   landed: the ranks' receipts overlap {overlap(rows, 'landed'):.2f}")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=16, help="MiB each rank copies per scenario (ring: 8 / 16)")
    ap.add_argument("--out", default=None, help="directory for copy_order.json (rank 0)")
    args = ap.parse_args()
    nbytes = args.mib * MiB
    cupy.cuda.runtime.setDevice(0)
    src = cupy.arange(nbytes, dtype=cupy.uint8)
    (hptr, _), (mapped, _) = transport.host_array(nbytes), transport.host_array(nbytes)
    kernel = cupy.RawKernel(COPY_KERNEL, "copy16")
    _, peer_dst = peer_buffer(nbytes)
    bufs = {"d2h": (src, hptr, 0), "h2d": (src, hptr, 0), "kernel": (src, 0, mapped),
            "chain": (src, hptr, peer_dst), "kchain": (src, mapped, peer_dst)}
    streams = {k: cupy.cuda.Stream(non_blocking=True) for k in ("d2h", "h2d", "kernel")}
    streams.update({k: (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True))
                    for k in ("chain", "kchain")})
    small, large = nbytes // 2, nbytes
    me = WORLD.rank
    mine = small if me == 0 else large
    scenarios = [("d2h", [("d2h", nbytes)]), ("h2d", [("h2d", nbytes)]),
                 ("ring", [("d2h", mine), ("h2d", large if me == 0 else small)]),
                 ("kernel", [("kernel", nbytes)]), ("chain", [("chain", mine)]), ("kchain", [("kchain", mine)])]
    issue([(d, MiB) for d in bufs], bufs, streams, kernel)  # first use outside the timing
    cupy.cuda.Device().synchronize()
    gate, results = Gate(), []
    for name, plan in scenarios:
        results += run_scenario(name, plan, bufs, streams, kernel, gate) or []
    results += run_proxy(small, large) or []
    if me == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "copy_order.json"), "w") as f:
            json.dump({"ranks": WORLD.size, "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
                       "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
