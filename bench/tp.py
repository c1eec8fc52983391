#!/usr/bin/env python3
"""Fused tensor-parallel ops inside a node against cuBLAS + NCCL, side by side in one run:

- mkernel: the fused kernel (path='fused');
- baseline: cupy.matmul then the cupy.cuda.nccl collective on the same stream;
- chunked: the hand-written overlap: the GEMM in 4 row chunks, each chunk's collective on a second
  stream as soon as the chunk is done (A's rows permuted chunk-major beforehand, outside timing);
- bound: max(cuBLAS time of this rank's GEMM, bytes each GPU sends / the two-way exchange rate
  measured in this run with NCCL send/recv between all pairs).

Run under ``mpirun -n <gpus>`` with one GPU per rank (NCCL):

    mpirun -n 2 python3 bench/tp.py --op all [--quick] [--out DIR]

Writes bench/results/<op>-<gpus>gpu.json per op (bench/harness.py), speedup = baseline / mkernel,
and each row's max |error| against float64 on 64 sampled rows for mkernel and for the baseline.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

import harness  # noqa: E402

OPS = ("gemm_reduce_scatter", "gemm_allreduce", "allgather_gemm")
# (M, N, K): RS / AR: K is the total (each rank holds K / W); AG: N is the total (each rank N / W).
SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192), (8192, 14336, 4096), (16384, 16384, 8192)]
QUICK = [(4096, 4096, 4096), (8192, 8192, 8192)]
SAMPLE_ROWS = 64


def _f64(x):
    return harness.as_float(x, "float64")


def _nccl_dt(dt):
    from cupy.cuda import nccl
    return nccl.NCCL_BFLOAT16 if dt.name == "bfloat16" else nccl.NCCL_FLOAT16


def exchange_rate_gbs(comm, nbytes=256 << 20):
    """Bytes per second each GPU sends while every pair exchanges at once (NCCL send/recv)."""
    import cupy
    from cupy.cuda import nccl

    send = cupy.empty(nbytes, dtype=cupy.uint8)
    recv = [cupy.empty(nbytes, dtype=cupy.uint8) for _ in range(comm.size)]
    s = cupy.cuda.get_current_stream().ptr

    def run():
        nccl.groupStart()
        for p in range(comm.size):
            if p != comm.rank:
                comm.nccl.send(send.data.ptr, nbytes, nccl.NCCL_UINT8, p, s)
                comm.nccl.recv(recv[p].data.ptr, nbytes, nccl.NCCL_UINT8, p, s)
        nccl.groupEnd()

    ms = harness.median(harness.time_ms(run, reps=10))
    ms = comm.mpi.allreduce(ms, op=_max())
    return nbytes * (comm.size - 1) / (ms * 1e-3) / 1e9


def _max():
    from mpi4py import MPI
    return MPI.MAX


def setup(op, comm, M, N, K, dt):
    """This rank's inputs and the three callables (mkernel, baseline, chunked)."""
    import cupy
    import mkernel
    from cupy.cuda import nccl

    W, r = comm.size, comm.rank
    s2 = cupy.cuda.Stream(non_blocking=True)
    main = cupy.cuda.get_current_stream()
    if op == "allgather_gemm":
        mb, Nr = M // W, N // W
        a = harness.rand((mb, K), 100 + r, dt)
        b = harness.rand((K, Nr), 200 + r, dt)
        out = cupy.empty((M, Nr), dt)
        gath = cupy.empty((M, K), dt)
        fused = lambda: mkernel.allgather_gemm(a, b, comm=comm, out=out, path="fused")  # noqa: E731

        def base():
            comm.nccl.allGather(a.data.ptr, gath.data.ptr, mb * K, _nccl_dt(dt), main.ptr)
            cupy.matmul(gath, b, out=out)

        q = mb // 4
        pieces = [a[c * q:(c + 1) * q] for c in range(4)]  # row slices: contiguous
        pg = [cupy.empty((W * q, K), dt) for _ in range(4)]
        evs = [cupy.cuda.Event() for _ in range(4)]

        def chunked():  # gather piece c on s2 while piece c-1 multiplies on the main stream
            start = cupy.cuda.Event()
            start.record(main)
            s2.wait_event(start)
            for c in range(4):
                comm.nccl.allGather(pieces[c].data.ptr, pg[c].data.ptr, q * K, _nccl_dt(dt), s2.ptr)
                evs[c].record(s2)
            for c in range(4):
                main.wait_event(evs[c])
                cupy.matmul(pg[c], b, out=out[c * W * q:(c + 1) * W * q])

        gemm_only = lambda: cupy.matmul(gath, b, out=out)  # noqa: E731
        sent = (W - 1) * mb * K * dt.itemsize
        return dict(fused=fused, base=base, chunked=chunked, gemm=gemm_only, sent=sent, out=out,
                    ref=lambda rows: _ag_ref(comm, rows, M, K, Nr, dt))
    Kr = K // W
    a = harness.rand((M, Kr), 300 + r, dt)
    b = harness.rand((Kr, N), 400 + r, dt)
    ar = op == "gemm_allreduce"
    mb = M // W
    out = cupy.empty((M, N) if ar else (mb, N), dt)
    partial = cupy.empty((M, N), dt)
    fn = mkernel.gemm_allreduce if ar else mkernel.gemm_reduce_scatter
    fused = lambda: fn(a, b, comm=comm, out=out, path="fused")  # noqa: E731

    def coll(src, dst, count, stream):
        if ar:
            comm.nccl.allReduce(src, dst, count, _nccl_dt(dt), nccl.NCCL_SUM, stream)
        else:
            comm.nccl.reduceScatter(src, dst, count, _nccl_dt(dt), nccl.NCCL_SUM, stream)

    def base():
        cupy.matmul(a, b, out=partial)
        coll(partial.data.ptr, out.data.ptr, M * N if ar else mb * N, main.ptr)

    # Chunk c = quarter c of every rank's row block (chunk-major permutation of A's rows), so that
    # each chunk's collective leaves rank r's quarter c of its block in place.
    q = mb // 4
    perm = cupy.arange(M).reshape(W, 4, q).transpose(1, 0, 2).reshape(-1)
    a_perm = harness.take_rows(a, perm)
    parts = [cupy.empty((W * q, N), dt) for _ in range(4)]
    outs = [cupy.empty((W * q, N) if ar else (q, N), dt) for _ in range(4)]
    evs = [cupy.cuda.Event() for _ in range(4)]

    def chunked():
        for c in range(4):
            cupy.matmul(a_perm[c * W * q:(c + 1) * W * q], b, out=parts[c])
            evs[c].record(main)
            s2.wait_event(evs[c])
            coll(parts[c].data.ptr, outs[c].data.ptr, W * q * N if ar else q * N, s2.ptr)
        done = cupy.cuda.Event()
        done.record(s2)
        main.wait_event(done)

    gemm_only = lambda: cupy.matmul(a, b, out=partial)  # noqa: E731
    sent = (2 if ar else 1) * (W - 1) * mb * N * dt.itemsize
    return dict(fused=fused, base=base, chunked=chunked, gemm=gemm_only, sent=sent, out=out,
                ref=lambda rows: _rs_ref(comm, rows, M, Kr, N, dt, ar))


def _rs_ref(comm, rows, M, Kr, N, dt, ar):
    """float64 rows of the sum (rows: indices into this rank's output)."""
    import cupy
    mb = M // comm.size
    g_rows = rows if ar else rows + comm.rank * mb
    acc = cupy.zeros((len(rows), N), cupy.float64)
    for p in range(comm.size):
        a = _f64(harness.take_rows(harness.rand((M, Kr), 300 + p, dt), g_rows))
        acc += a @ _f64(harness.rand((Kr, N), 400 + p, dt))
    return acc


def _ag_ref(comm, rows, M, K, Nr, dt):
    import cupy
    mb = M // comm.size
    a_full = cupy.concatenate([harness.rand((mb, K), 100 + p, dt).view(cupy.uint16) for p in range(comm.size)]).view(dt)
    return _f64(harness.take_rows(a_full, rows)) @ _f64(harness.rand((K, Nr), 200 + comm.rank, dt))


def max_err(out, ref_fn, rows):
    import cupy
    return float(cupy.abs(_f64(harness.take_rows(out, rows)) - ref_fn(rows)).max())


def bench_op(op, comm, shapes, dt, rate_gbs):
    import cupy
    from mkernel import tp as tp_mod

    rows_out = []
    for (M, N, K) in shapes:
        f = setup(op, comm, M, N, K, dt)
        rng = np.random.default_rng(0)
        rows = cupy.asarray(np.sort(rng.choice(f["out"].shape[0], SAMPLE_ROWS, replace=False)))
        f["fused"]()
        cupy.cuda.get_current_stream().synchronize()
        comm.check()
        err_mk = max_err(f["out"], f["ref"], rows)
        f["base"]()
        cupy.cuda.get_current_stream().synchronize()
        err_base = max_err(f["out"], f["ref"], rows)
        t = {}
        for name in ("fused", "base", "chunked", "gemm"):
            comm.mpi.Barrier()
            t[name] = comm.mpi.allreduce(harness.median(harness.time_ms(f[name])), op=_max())
        wire_ms = f["sent"] / (rate_gbs * 1e9) * 1e3
        bound = max(t["gemm"], wire_ms)
        rows_out.append(harness.row((M, N, K), t["fused"], t["base"], bound, chunked_ms=t["chunked"],
                                    cublas_gemm_ms=t["gemm"], wire_ms=wire_ms, bytes_sent_per_gpu=f["sent"],
                                    speedup_vs_chunked=t["chunked"] / t["fused"], max_err_mkernel=err_mk,
                                    max_err_baseline=err_base, dtype=dt.name))
        del f
        tp_mod.release_buffers(comm)  # every rank, same point: the next shape's buffers fit
    return rows_out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", choices=OPS + ("all",), default="all")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = p.parse_args()
    import ml_dtypes
    import mkernel

    comm = mkernel.init(workspace_bytes=4 << 30)
    dt = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype(np.float16)
    try:  # the baseline is cupy.matmul: fall back to float16 where CuPy has no bfloat16 matmul
        import cupy
        cupy.matmul(harness.rand((16, 16), 0, dt), harness.rand((16, 16), 1, dt))
    except Exception as e:  # noqa: BLE001
        if comm.rank == 0:
            print(f"cupy.matmul cannot multiply {dt} ({type(e).__name__}); benchmarking float16")
        dt = np.dtype(np.float16)
    rate = exchange_rate_gbs(comm)
    shapes = QUICK if args.quick else SHAPES
    cols = [("shape", "shape", None), ("mkernel_ms", "mkernel ms", ".3f"), ("baseline_ms", "baseline ms", ".3f"),
            ("chunked_ms", "chunked ms", ".3f"), ("bound_ms", "bound ms", ".3f"), ("speedup", "speedup", ".2f"),
            ("max_err_mkernel", "err mk", ".3g"), ("max_err_baseline", "err base", ".3g")]
    summary = []
    for op in (OPS if args.op == "all" else (args.op,)):
        rows = bench_op(op, comm, shapes, dt, rate)
        if comm.rank == 0:
            path = harness.write(op, rows, gpus=comm.size, out_dir=args.out, exchange_rate_gbs=rate)
            print(f"== {op} ({comm.size} GPUs, exchange {rate:.1f} GB/s per GPU) -> {path}")
            print(harness.table(rows, cols))
            summary.append(f"{op} " + " ".join(f"{r['speedup']:.2f}x" for r in rows))
    if comm.rank == 0:
        print("SUMMARY tp: " + "; ".join(summary))
    comm.close()


if __name__ == "__main__":
    main()
