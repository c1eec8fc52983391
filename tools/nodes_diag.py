"""gemm_reduce_scatter between 3 emulated nodes x 1 rank, call by call (sessions 13-14: the unfused
path gave wrong tiles under MPS at 33%; the cause was cuBLAS itself at 42 SMs, bench/NOTES.md).
Runs one call sequence on integer inputs (exact) and prints, per call, the wrong elements by tile,
which node partials they lack, and the proxy's byte counts. Sequences (--seq):

  grown    fused c0, c1, c2, then unfused c0 (c1 grows the scratch, c0's plan is rebuilt)
  first    unfused c0 first, in a fresh process
  pregrow  c2 first (the scratch at its largest), then fused c0, unfused c0
  unfused  every case unfused
  matmul   cupy.matmul alone against float64, then the op unfused
  sms      unfused c0 with 1, 2 and 16 comm CTAs, fused with 1

    mpirun -n 3 --oversubscribe --bind-to none python3 tools/nodes_diag.py --seq grown
"""

import argparse

import numpy as np

CASES = {"c0": (200, 264, 136), "c1": (136, 520, 256), "c2": (256, 512, 128)}  # rows per rank, N, K
SEQS = {"grown": [("c0", "fused"), ("c1", "fused"), ("c2", "fused"), ("c0", "unfused")],
        "first": [("c0", "unfused"), ("c0", "fused")],
        "pregrow": [("c2", "fused"), ("c0", "fused"), ("c0", "unfused")],
        "unfused": [("c2", "unfused"), ("c1", "unfused"), ("c0", "unfused"), ("c0", "unfused")],
        "matmul": [("c0", "matmul"), ("c0", "unfused"), ("c0", "matmul")],
        "sms": [("c0", "unfused", 1), ("c0", "unfused", 2), ("c0", "unfused", 16), ("c0", "fused", 1)]}


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
    for name, path, *sms in SEQS[args.seq]:
        mb, N, K = CASES[name]
        M = mb * W
        parts = [np.random.default_rng([7, r]).integers(-1, 2, (M, K)).astype(np.float16) for r in range(W)]
        b = np.random.default_rng(8).integers(-1, 2, (K, N)).astype(np.float16)
        rows = slice(comm.rank * mb, (comm.rank + 1) * mb)
        contrib = [p[rows].astype(np.float64) @ b.astype(np.float64) for p in parts]  # node j's partial
        want = sum(contrib)
        if path == "matmul":  # cuBLAS alone: this rank's whole partial
            got = cupy.matmul(cupy.asarray(parts[comm.rank]), cupy.asarray(b)).get().astype(np.float64)
            bad = ~(got == parts[comm.rank].astype(np.float64) @ b.astype(np.float64))
            r, c = np.nonzero(bad)
            where = f", rows {r.min()}..{r.max()}, cols {c.min()}..{c.max()}" if bad.any() else ""
            print(f"rank {comm.rank}: cupy.matmul {M}x{N}x{K}: {int(bad.sum())} wrong{where}", flush=True)
            continue
        out = cupy.full((mb, N), np.nan, dtype=np.float16)
        sent0 = sum(s["bytes_sent"] for s in comm.stats().get("peers", {}).values())
        mkernel.gemm_reduce_scatter(cupy.asarray(parts[comm.rank]), cupy.asarray(b), comm=comm, out=out, path=path,
                                   **({"comm_sms": sms[0]} if sms else {}))
        cupy.cuda.get_current_stream().synchronize()
        comm.check()
        got = out.get().astype(np.float64)
        bad = ~(got == want)
        tiles = {(int(r // 128), int(c // 256)): 0 for r, c in zip(*np.nonzero(bad))}
        for r, c in zip(*np.nonzero(bad)):
            tiles[int(r // 128), int(c // 256)] += 1
        explain = _explain(got, want, contrib, bad)
        sent = sum(s["bytes_sent"] for s in comm.stats().get("peers", {}).values()) - sent0
        lines = allgather_object(world, f"rank {comm.rank}: {name} {path}: {int(bad.sum())} of {bad.size} wrong, "
                                 f"by tile {tiles}, sent {sent} B{explain}", "reporting", 60)
        if comm.rank == 0:
            print("\n".join(lines), flush=True)
    comm.close()


def _explain(got, want, contrib, bad):
    """Which node partials the wrong elements lack (or hold twice), and where they lie."""
    if not bad.any():
        return ""
    d = (got - want)[bad]
    parts = [f"missing node {j}: {int((d == -c[bad]).sum())}, doubled {j}: {int((d == c[bad]).sum())}"
             for j, c in enumerate(contrib)]
    r, c = np.nonzero(bad)
    first = list(zip(r[:4].tolist(), c[:4].tolist()))
    return (f"; {'; '.join(parts)}; wrong rows {r.min()}..{r.max()} ({len(set(r.tolist()))} distinct), "
            f"cols {c.min()}..{c.max()} ({len(set(c.tolist()))} distinct), first {first}")


if __name__ == "__main__":
    main()
