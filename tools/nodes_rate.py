"""Where the time of the TP ops between 2 emulated nodes goes (issue 25: gemm_allreduce's unfused
path crawled at 0.3 GB/s, the fused one at 3.6 GB/s, against a 25 GB/s host link).

1. The host transport with many small WRITEs: both ranks send 64 MiB to each other as WRITEs of
   64 KiB (one output tile) to 64 MiB, each adding 1 to a counter; the time until the counter is full.
2. The same with GPU threads polling a word of mapped host memory meanwhile (as waits on the
   proxy's flags do): pollers x pause between polls.
3. gemm_allreduce / gemm_reduce_scatter, fused and unfused, at several comm_sms: ms per call (the
   slower rank, events after a barrier) and the proxy's commands and bytes per call.

    mpirun -n 2 --bind-to none python3 tools/nodes_rate.py [--shape 8192,8192,4096]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import transport  # noqa: E402  (bench/transport.py: the proxy exchange it measures with)

WORLD = MPI.COMM_WORLD
MiB = 1 << 20


POLL = r"""
extern "C" __global__ void poll(const unsigned* flag, const unsigned* stop, unsigned pause, unsigned long long* n) {
  unsigned long long i = 0;
  for (;;) {
    unsigned v, s;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
    if (++i % 8 == 0) {
      asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(s) : "l"(stop) : "memory");
      if (s) break;
    }
    if (pause) __nanosleep(pause);
  }
  atomicAdd(n, i);
}
"""


class Pollers:
    """``ctas`` single-thread CTAs polling a word of mapped host memory every ``pause_ns`` until the
    block ends (word 8 set)."""

    def __init__(self, ctas, pause_ns):
        import cupy

        self.ctas, self.pause = ctas, pause_ns
        self.ptr, raw = transport.host_array(64)
        self.words = raw.view(np.uint32)
        self.words[:] = 0
        self.count = cupy.zeros(1, cupy.uint64)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.fn = cupy.RawKernel(POLL, "poll")

    def __enter__(self):
        if self.ctas:
            args = (self.ptr, self.ptr + 32, np.uint32(self.pause), self.count)
            self.fn((self.ctas,), (1,), args, stream=self.stream)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import cupy

        self.words[8] = 1
        self.stream.synchronize()
        self.rate = int(self.count.get()[0]) / (time.perf_counter() - self.t0)  # polls per second
        cupy.cuda.runtime.freeHost(self.ptr)


def small_writes(total, sizes, reps, pollers=((0, 0),)):
    with transport.exchange_proxy("host", total) as (proxy, queue, flags):
        for (ctas, pause), size in [(p, z) for p in pollers for z in sizes]:
            n = total // size
            with Pollers(ctas, pause) as poll:
                t = statistics.median(transport.exchange_times(proxy, queue, flags, total, reps + 1, writes=n)[1:])
            if WORLD.Get_rank() == 0:
                print(f"host transport: {n:5d} WRITEs of {size >> 10:6d} KiB  {t * 1e3:8.2f} ms  "
                      f"{total / t / 1e9:6.2f} GB/s  {t / n * 1e6:7.2f} us per WRITE  "
                      f"pollers {ctas} every {pause} ns ({poll.rate / 1e6:.1f} M polls/s)", flush=True)


def ops(shape, reps):
    import cupy

    import mkernel

    comm = mkernel.init(workspace_bytes=4 << 30, gpus_per_node=1, transport="host")
    M, N, K = shape
    rng = np.random.default_rng(comm.rank)
    a = cupy.asarray(rng.standard_normal((M, K), dtype=np.float32)).astype(cupy.float16)
    b = cupy.asarray(rng.standard_normal((K, N), dtype=np.float32)).astype(cupy.float16)
    cases = [(op, path, sms) for op in ("gemm_allreduce", "gemm_reduce_scatter") for path in ("fused", "unfused")
             for sms in (None, 8, 32)]
    for op, path, sms in cases:
        fn = getattr(mkernel, op)
        kw = {"path": path} | ({"comm_sms": sms} if sms else {})
        fn(a, b, comm=comm, **kw)
        cupy.cuda.runtime.deviceSynchronize()
        before = comm.stats()
        times = []
        for _ in range(reps):
            WORLD.Barrier()
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            e0.record()
            fn(a, b, comm=comm, **kw)
            e1.record()
            e1.synchronize()
            times.append(WORLD.allreduce(cupy.cuda.get_elapsed_time(e0, e1), op=MPI.MAX))
        after = comm.stats()
        peer = 1 - comm.rank
        per_call = {k: (after["peers"][peer][k] - before["peers"][peer][k]) / reps for k in ("writes", "bytes_sent")}
        per_call["commands"] = (after["commands"] - before["commands"]) / reps
        ms = statistics.median(times)
        if comm.rank == 0:
            print(f"{op:20s} {path:8s} comm_sms {sms or 'default':>7}  {ms:8.2f} ms  "
                  f"{per_call['bytes_sent'] / ms / 1e6:6.2f} GB/s sent  per call {per_call}", flush=True)
    comm.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8192,8192,4096")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--transport-only", action="store_true")
    args = p.parse_args()
    small_writes(64 * MiB, (64 << 10, 1 * MiB, 64 * MiB), args.reps)
    polled = [(c, p) for c in (8, 32, 64) for p in (0, 1000, 4000, 16000)]
    small_writes(64 * MiB, (1 * MiB,), args.reps, pollers=polled)
    if not args.transport_only:
        ops(tuple(int(x) for x in args.shape.split(",")), args.reps)


if __name__ == "__main__":
    main()
