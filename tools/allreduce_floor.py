#!/usr/bin/env python3
"""What bounds one small mkernel.allreduce (issue 26's goal: <= 256 KiB under 10 us), at any rank count:

device, per call from 50 calls captured in a CUDA graph (bench/mps_timing.py's rule):
  empty       a kernel of one block that does nothing (the stream's launch-to-launch floor)
  ar <bytes>  mkernel.allreduce of that many bf16 bytes (16 bytes: its protocol alone)
host, per steady-state call, microseconds (the GPU kept busy, so no wait is counted):
  key         calls.call_key (pointers, shapes, stream, device)
  lookup      comm.plans.launches (the recorded launch)
  check       comm.check (the error words)
  launch      launch.launch_all of the recorded launch (cuLaunchKernel through CuPy)
  bare        CuPy's driver.launchKernel of the empty kernel, parameters built once (bare_own: on
              a non-blocking stream instead of the legacy default one)
  call        the whole mkernel.allreduce call (call_own: on a non-blocking stream)
and the device time per call with other chunk sizes (elements per push / reduce item: --chunks),
moving LL words and data + flags; and at larger sizes (--big) one-shot against two-shot (forced at
any rank count), interleaved, device time per call from graphs.

    mpirun -n 4 python3 tools/allreduce_floor.py [--sizes 16,16384,262144] [--big 1048576,16777216]
"""

import argparse
import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

EMPTY = r'extern "C" __global__ void mk_empty(int x) { if (x == 12345) asm volatile("trap;"); }'
# One thread's serial costs (ns each, N in a row) and a ping-pong with the next rank through its
# symmetric word (one hop = half a round trip): what the all-reduce's protocol is made of.
COSTS = r"""
typedef unsigned long long u64; typedef unsigned int u32;
#define ASMV asm volatile
__device__ u64 now() { u64 t; ASMV("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ void st_rel_sys(u32* p, u32 v) { ASMV("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ void st_rel_gpu(u32* p, u32 v) { ASMV("st.release.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ void st_rlx_sys(u32* p, u32 v) { ASMV("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ u32 ld_acq_sys(u32* p) {
  u32 v; ASMV("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ u32 ld_rlx_sys(u32* p) {
  u32 v; ASMV("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
extern "C" __global__ void mk_costs(u32* w, const u64* peers, u64 off, int me, int peer, int N, u64* out) {
  u32 acc = 0;
  u64 t = now();
  for (int i = 0; i < N; ++i) acc += atomicAdd(w, 1u);
  out[0] = (now() - t) / N; t = now();
  for (int i = 0; i < N; ++i) acc += ld_rlx_sys(w + 1 + (acc & 1));
  out[1] = (now() - t) / N; t = now();
  for (int i = 0; i < N; ++i) st_rel_sys(w + 4, acc + i);
  out[2] = (now() - t) / N; t = now();
  for (int i = 0; i < N; ++i) st_rel_gpu(w + 4, acc + i);
  out[3] = (now() - t) / N; t = now();
  for (int i = 0; i < N; ++i) { __threadfence(); w[5] = acc + i; }
  out[4] = (now() - t) / N; t = now();
  for (int i = 0; i < N; ++i) acc += (u32)now();
  out[5] = (now() - t) / N;
  w[6] = acc;
  for (int rlx = 0; rlx < 2; ++rlx) {  // release / acquire, then relaxed, at sys scope
    u32* mine = (u32*)(peers[me] + off) + rlx; u32* theirs = (u32*)(peers[peer] + off) + rlx;
    const u64 t0 = now(); bool ok = true;
    for (u32 i = 1; i <= (u32)N && ok; ++i) {
      if (me == 0) rlx ? st_rlx_sys(theirs, i) : st_rel_sys(theirs, i);
      while ((rlx ? ld_rlx_sys(mine) : ld_acq_sys(mine)) < i)
        if (now() - t0 > 2000000000ull) { ok = false; break; }
      if (me != 0) rlx ? st_rlx_sys(theirs, i) : st_rel_sys(theirs, i);
    }
    out[6 + rlx] = ok ? (now() - t0) / (2 * (u64)N) : 0;
  }
}
"""
COST_NAMES = ("atomic", "load", "st.release.sys", "st.release.gpu", "fence+st", "clock", "hop rel/acq", "hop relaxed")
REPS = 400


def host_us(fn, reps=REPS):
    """Median over 5 rounds of the mean microseconds of fn() over reps calls."""
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            fn()
        rounds.append((time.perf_counter_ns() - t0) / reps / 1e3)
    return statistics.median(rounds)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="16,16384,262144", help="bytes of bf16 per call")
    p.add_argument("--chunks", default="8192,4096,2048", help="elements per item to try (device time only)")
    p.add_argument("--big", default="1048576,4194304,16777216,67108864",
                   help="bytes of bf16 per call: one-shot against two-shot")
    args = p.parse_args()
    import cupy
    import ml_dtypes
    import mps_timing as mt
    import numpy as np
    from cupy.cuda import driver

    import mkernel
    from mkernel.core import config
    from mkernel.ops import allreduce as _ar
    from mkernel.ops import calls as op_calls
    from mkernel.runtime import launch

    chunk_of = _ar.chunk_of  # --chunks patches it; --big runs with the library's own
    comm = mkernel.init()
    barrier = mt.DeviceBarrier(comm)
    empty = cupy.RawKernel(EMPTY, "mk_empty")
    arg = ctypes.c_int(0)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    empty((1,), (32,), (np.int32(0),))  # loads the module

    def bare():
        driver.launchKernel(empty.kernel.ptr, 1, 1, 1, 32, 1, 1, 0, cupy.cuda.get_current_stream().ptr,
                            ctypes.addressof(params), 0)

    own = cupy.cuda.Stream(non_blocking=True)  # a user's stream: launches skip the legacy stream's rules

    def bare_own():
        driver.launchKernel(empty.kernel.ptr, 1, 1, 1, 32, 1, 1, 0, own.ptr, ctypes.addressof(params), 0)

    costs = cupy.RawKernel(COSTS, "mk_costs")
    sym = comm.empty((64,), "uint32")
    sym.fill(0)
    word = cupy.zeros(64, cupy.uint32)
    res = cupy.zeros(8, cupy.uint64)
    cupy.cuda.get_current_stream().synchronize()
    comm.mpi.Barrier()
    peer = (comm.rank + 1) % comm.size if comm.rank == 0 else 0
    costs((1,), (1,), (word, comm.peer_table, np.uint64(comm.offset_of(sym)), np.int32(comm.rank), np.int32(peer),
                       np.int32(1000), res))
    ns = res.get()
    cost_line = f"rank {comm.rank} ns each: " + "  ".join(f"{k} {int(v)}" for k, v in zip(COST_NAMES, ns))
    lines = [cost_line]
    dev = {"empty": mt.graph_batch_ms(comm, barrier, bare) * 1e3}
    host = {"bare": host_us(bare), "bare_own": host_us(bare_own)}
    own.synchronize()
    cupy.cuda.get_current_stream().synchronize()
    dt = np.dtype(ml_dtypes.bfloat16)
    for nbytes in (int(s) for s in args.sizes.split(",")):
        x = cupy.asarray(np.random.default_rng(comm.rank).standard_normal(nbytes // 2).astype(dt))
        out = cupy.empty_like(x)

        def call():
            mkernel.allreduce(x, comm=comm, out=out)

        call()
        cupy.cuda.get_current_stream().synchronize()
        key = op_calls.call_key(comm, "allreduce", None, (x, out), ())
        launches = comm.plans.launches(key)
        assert launches is not None, "the call was not recorded"
        h = {"key": host_us(lambda: op_calls.call_key(comm, "allreduce", None, (x, out), ())),
             "lookup": host_us(lambda: comm.plans.launches(key)),
             "check": host_us(comm.check)}
        barrier()
        h["launch"] = host_us(lambda: launch.launch_all(launches, None))  # the same count on every rank
        cupy.cuda.get_current_stream().synchronize()
        barrier()
        h["call"] = host_us(call)
        cupy.cuda.get_current_stream().synchronize()
        with own:  # ops of one communicator stay ordered: the barrier (an op) on the same stream
            mkernel.allreduce(x, comm=comm, out=out, stream=own)
            barrier()
            h["call_own"] = host_us(lambda: mkernel.allreduce(x, comm=comm, out=out, stream=own))
        own.synchronize()
        comm.check()
        d = mt.graph_batch_ms(comm, barrier, call) * 1e3
        eager = mt.batch_ms(comm, barrier, call) * 1e3
        lines.append(f"rank {comm.rank} ar {nbytes:>7} B ({_ar.path_of(comm.size, nbytes)}): device "
                     f"{d:6.2f} us/call (graph), eager {eager:6.2f}  host us " +
                     "  ".join(f"{k} {v:5.2f}" for k, v in h.items()))
    for chunk in (int(c) for c in args.chunks.split(",") if c):
        _ar.chunk_of = lambda count, ll, chunk=chunk: chunk  # read when a shape's plan is built
        for ll in (True, False):
            comm.release_plans()
            times = []
            for nbytes in (int(s) for s in args.sizes.split(",")):
                x = cupy.asarray(np.random.default_rng(comm.rank).standard_normal(nbytes // 2).astype(dt))
                out = cupy.empty_like(x)
                with config.override(allreduce_ll_max_bytes=(1 << 40) if ll else 0):
                    us = mt.graph_batch_ms(comm, barrier,
                                           lambda x=x, out=out: mkernel.allreduce(x, comm=comm, out=out)) * 1e3
                times.append(f"{nbytes} B {us:6.2f}")
            lines.append(f"rank {comm.rank} chunk {chunk:5} {'LL   ' if ll else 'flags'}: device us/call (graph) " +
                         "  ".join(times))
    comm.release_plans()
    _ar.chunk_of = chunk_of
    flags = {"allreduce_ll_max_bytes": 0}
    paths = {"oneshot": {**flags, "allreduce_twoshot_min_bytes": 0, "allreduce_twoshot_min_bytes_2ranks": 0},
             "twoshot": {**flags, "allreduce_twoshot_min_bytes": 1, "allreduce_twoshot_min_bytes_2ranks": 1}}
    for nbytes in (int(s) for s in args.big.split(",") if s):
        x = cupy.asarray(np.random.default_rng(comm.rank).standard_normal(nbytes // 2).astype(dt))
        out = cupy.empty_like(x)
        us = {}
        for _ in range(2):  # interleaved: one-shot, two-shot, one-shot, two-shot; the later of each kept
            for name, knobs in paths.items():
                with config.override(**knobs):
                    us[name] = mt.graph_batch_ms(comm, barrier,
                                                 lambda x=x, out=out: mkernel.allreduce(x, comm=comm, out=out)) * 1e3
        lines.append(f"rank {comm.rank} ar {nbytes:>9} B: one-shot {us['oneshot']:8.2f} us, two-shot "
                     f"{us['twoshot']:8.2f} us (graph), two-shot / one-shot {us['twoshot'] / us['oneshot']:.3f}")
        comm.release_plans()
    if comm.rank == 0:
        print(f"world {comm.size}, {os.environ.get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE', 'no MPS share set')}")
    mt.print_by_rank(comm, f"rank {comm.rank} empty kernel: device {dev['empty']:5.2f} us/call (graph), "
                     f"bare launch host {host['bare']:5.2f} us\n" + "\n".join(lines), "floor")
    comm.close()


if __name__ == "__main__":
    main()
