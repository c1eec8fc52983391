#!/usr/bin/env python3
"""A tensor-parallel MLP block with mkernel's fused kernels, checked against one GPU.

    y = relu(x @ W1) @ W2,  x: [T, H], W1: [H, F], W2: [F, H]

Sequence-parallel input and output, tensor-parallel weights (Megatron-style), world W ranks:

- rank r holds the rows x_r = x[r*T/W:(r+1)*T/W], the columns W1_r = W1[:, r*F/W:(r+1)*F/W] and
  the rows W2_r = W2[r*F/W:(r+1)*F/W];
- column-parallel:  h_r = allgather_gemm(x_r, W1_r)      -> [T, F/W]  (gathers x while multiplying)
- activation:       h_r = relu(h_r)                       (local)
- row-parallel:     y_r = gemm_reduce_scatter(h_r, W2_r)  -> [T/W, H]  (rank r's rows of y)

Run:  mpirun -n 2 python3 examples/tp_mlp.py [--jax]
(``--jax`` feeds the same block with JAX arrays through DLPack and hands y back as a JAX array.)
"""

import argparse
import sys

import numpy as np


def weights(T, H, F, seed=0):
    """The full problem, generated identically on every rank (float16 values)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((T, H)) * 0.5).astype(np.float16)
    w1 = (rng.standard_normal((H, F)) / np.sqrt(H)).astype(np.float16)
    w2 = (rng.standard_normal((F, H)) / np.sqrt(F)).astype(np.float16)
    return x, w1, w2


def mlp_block(comm, x_r, w1_r, w2_r):
    """The tensor-parallel block on CuPy (or DLPack) arrays: y_r = relu(x @ W1_r) @ W2_r, reduced."""
    import cupy

    import mkernel

    h = mkernel.allgather_gemm(x_r, w1_r, comm=comm)
    h = cupy.maximum(h, 0)
    return mkernel.gemm_reduce_scatter(h, w2_r, comm=comm)


def run(comm, T=512, H=256, F=1024, use_jax=False):
    """Runs the block and checks rank r's rows of y against the single-GPU result. Returns
    (ok, max |error|). T and F are rounded up to multiples of 8 x world (every rank's share of the
    hidden dimension must be a multiple of 8)."""
    import cupy

    W, r = comm.size, comm.rank
    T, F = (-(-n // (8 * W)) * 8 * W for n in (T, F))
    x, w1, w2 = weights(T, H, F)
    tr, fr = T // W, F // W
    x_r = x[r * tr:(r + 1) * tr]
    w1_r = np.ascontiguousarray(w1[:, r * fr:(r + 1) * fr])
    w2_r = np.ascontiguousarray(w2[r * fr:(r + 1) * fr])
    if use_jax:
        import jax
        import jax.numpy as jnp
        dev = jax.devices("gpu")[comm.device_id % len(jax.devices("gpu"))]
        args = [jax.device_put(jnp.asarray(v), dev) for v in (x_r, w1_r, w2_r)]
        y_r = mlp_block(comm, *args)
        y_host = np.asarray(jax.dlpack.from_dlpack(y_r))  # back to JAX, then to the host
    else:
        y_r = mlp_block(comm, cupy.asarray(x_r), cupy.asarray(w1_r), cupy.asarray(w2_r))
        y_host = cupy.asnumpy(y_r)
    cupy.cuda.get_current_stream().synchronize()
    comm.check()
    # One GPU, the whole block in float32 on the same float16 inputs (hidden rounded to fp16 as
    # the tensor-parallel block does).
    xs, w1s, w2s = (cupy.asarray(v).astype(cupy.float32) for v in (x, w1, w2))
    hs = cupy.maximum(xs @ w1s, 0).astype(cupy.float16).astype(cupy.float32)
    y_ref = cupy.asnumpy(hs @ w2s)[r * tr:(r + 1) * tr]
    err = float(np.max(np.abs(y_host.astype(np.float32) - y_ref)))
    tol = 2e-2 * float(np.max(np.abs(y_ref))) + 1e-3
    return bool(np.isfinite(err) and err <= tol), err


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jax", action="store_true", help="feed JAX arrays through DLPack")
    args = p.parse_args()
    import mkernel

    comm = mkernel.init()
    ok, err = run(comm, use_jax=args.jax)
    oks = comm.mpi.allgather((ok, err))
    if comm.rank == 0:
        for rank, (o, e) in enumerate(oks):
            print(f"rank {rank}: max |y - y_single_gpu| = {e:.3g} {'ok' if o else 'FAIL'}")
    comm.close()
    sys.exit(0 if all(o for o, _ in oks) else 1)


if __name__ == "__main__":
    main()
