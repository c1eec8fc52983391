"""Where gemm_reduce_scatter between emulated nodes goes wrong (session 13: the unfused path at 3
nodes x 1 rank, first launch after the scratch grew, gave wrong tiles under MPS). Runs one call
sequence on integer inputs (exact) and prints, per call, the wrong elements by tile and the proxy's
byte counts. Sequences (--seq):

  grown   fused c0, c1, c2, then unfused c0 (the failing one: c1 grows the scratch, c0's plan is rebuilt)
  first   unfused c0 first, in a fresh process
  pregrow c2 first (the scratch at its largest), then fused c0, unfused c0

    mpirun -n 3 --oversubscribe --bind-to none python3 tools/nodes_diag.py --seq grown
"""

import argparse

import numpy as np

CASES = {"c0": (200, 264, 136), "c1": (136, 520, 256), "c2": (256, 512, 128)}  # rows per rank, N, K
SEQS = {"grown": [("c0", "fused"), ("c1", "fused"), ("c2", "fused"), ("c0", "unfused")],
        "first": [("c0", "unfused"), ("c0", "fused")],
        "pregrow": [("c2", "fused"), ("c0", "fused"), ("c0", "unfused")]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", choices=tuple(SEQS), default="grown")
    p.add_argument("--nodes", type=int, default=None, help="default: one rank per node")
    args = p.parse_args()
    import cupy
    from mpi4py import MPI

    import mkernel
    from mkernel.comm.collectives import allgather_object

    world = MPI.COMM_WORLD
    W = world.size
    comm = mkernel.init(world, gpus_per_node=W // (args.nodes or W), transport="host", workspace_bytes=192 << 20)
    for name, path in SEQS[args.seq]:
        mb, N, K = CASES[name]
        M = mb * W
        parts = [np.random.default_rng([7, r]).integers(-1, 2, (M, K)).astype(np.float16) for r in range(W)]
        b = np.random.default_rng(8).integers(-1, 2, (K, N)).astype(np.float16)
        want = sum(p.astype(np.float64) for p in parts) @ b.astype(np.float64)
        want = want[comm.rank * mb:(comm.rank + 1) * mb]
        out = cupy.full((mb, N), np.nan, dtype=np.float16)
        sent0 = sum(s["bytes_sent"] for s in comm.stats().get("peers", {}).values())
        mkernel.gemm_reduce_scatter(cupy.asarray(parts[comm.rank]), cupy.asarray(b), comm=comm, out=out, path=path)
        cupy.cuda.get_current_stream().synchronize()
        comm.check()
        got = out.get().astype(np.float64)
        bad = ~(got == want)
        tiles = {(int(r // 128), int(c // 256)): 0 for r, c in zip(*np.nonzero(bad))}
        for r, c in zip(*np.nonzero(bad)):
            tiles[int(r // 128), int(c // 256)] += 1
        sent = sum(s["bytes_sent"] for s in comm.stats().get("peers", {}).values()) - sent0
        lines = allgather_object(world, f"rank {comm.rank}: {name} {path}: {int(bad.sum())} of {bad.size} wrong, "
                                 f"by tile {tiles}, sent {sent} B", "reporting", 60)
        if comm.rank == 0:
            print("\n".join(lines), flush=True)
    comm.close()


if __name__ == "__main__":
    main()
