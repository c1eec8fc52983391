#!/usr/bin/env python3
"""Do two ranks' persistent grids run at once on a GPU shared under MPS? (see bench/NOTES.md)

    source tools/mps.sh; mps_start
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 mpirun -n 2 -x CUDA_MPS_PIPE_DIRECTORY \\
        -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE python3 tools/mps_residency.py [--grids 33,57,66]

Every rank launches, at the same moment, GRID CTAs of 200 KB shared memory (one per SM) that each
spin 200 ms and record %smid and their start and end (globaltimer), plainly and cooperatively.
Rank 0 prints each case's time windows, their overlap and the SM ids: a cooperative grid that
waits for the other rank's to end shows an overlap of 0 ms.
"""

import argparse
import ctypes

import cupy
from mpi4py import MPI

from mkernel.runtime.launch import launch

SRC = r'''
struct Args { unsigned long long* out; unsigned long long spin_ns; };
extern "C" __global__ void mk_residency_probe(const Args a) {
  extern __shared__ unsigned char sm[];
  unsigned long long t0, t;
  unsigned int id;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    sm[threadIdx.x] = (unsigned char)t;
  } while (t - t0 < a.spin_ns);
  if (threadIdx.x == 0) { a.out[3 * blockIdx.x] = id; a.out[3 * blockIdx.x + 1] = t0; a.out[3 * blockIdx.x + 2] = t; }
}'''


class Args(ctypes.Structure):
    _fields_ = [("out", ctypes.c_void_p), ("spin_ns", ctypes.c_uint64)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grids", default="33,57,66")
    grids = [int(g) for g in ap.parse_args().grids.split(",")]
    world = MPI.COMM_WORLD
    fn = cupy.RawKernel(SRC, "mk_residency_probe").kernel
    runs = []
    for grid in grids:
        for coop in (False, True):
            out = cupy.zeros(3 * grid, dtype=cupy.uint64)
            world.Barrier()
            launch(fn, (grid,), (128,), Args(out.data.ptr, 200_000_000), smem=200 * 1024, cooperative=coop)
            cupy.cuda.runtime.deviceSynchronize()
            o = out.get().reshape(grid, 3)
            runs.append((grid, coop, {int(x) for x in o[:, 0]}, int(o[:, 1].min()), int(o[:, 2].max())))
    every = world.gather(runs)
    if world.rank:
        return
    print(f"{cupy.cuda.Device().attributes['MultiProcessorCount']} SMs per client, {world.size} clients")
    for case in zip(*every):
        grid, coop = case[0][:2]
        t0 = min(c[3] for c in case)
        windows = ", ".join(f"r{r} [{(c[3] - t0) / 1e6:.0f}, {(c[4] - t0) / 1e6:.0f}] ms" for r, c in enumerate(case))
        overlap = max(0, min(c[4] for c in case) - max(c[3] for c in case)) / 1e6
        shared = len(set.intersection(*(c[2] for c in case)))
        print(f"grid {grid:4d} {'cooperative' if coop else 'plain      '}: {windows}; "
              f"all at once for {overlap:.0f} ms; "
              f"SM ids seen by every client: {shared}")


if __name__ == "__main__":
    main()
