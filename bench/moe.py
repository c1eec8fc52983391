#!/usr/bin/env python3
"""MoE benchmark: mkernel dispatch+GEMM1 and GEMM2+combine against NCCL all-to-all + cuBLAS.

mkernel's fused MoE ops against NCCL all-to-all + cuBLAS, and against mkernel's own unfused
building blocks, side by side in one run, one process per rank.

Per (shape, routing), shape = [T, H, F, E, k] per rank ([4096, 7168, 2048, 64, 8] and
[4096, 4096, 14336, 8, 2]), routing "uniform" (k distinct experts per token, uniformly) and
"zipf1.2" (k distinct experts per token drawn without replacement with probabilities ~ 1 / i^1.2
over a fixed random permutation of the experts, the same on every rank: the ranks owning the hot
experts receive more rows). Deterministic seeds; bf16 inputs, weights scaled by 1/sqrt(K) so that
every value stays O(1). Experts are owned in contiguous blocks of E / W.

Timed (CUDA events, the median of >= 20 repetitions after warm-up; every repetition starts behind
an MPI barrier and a spin kernel long enough for the host to have queued the whole call, so host
launch time is not timed; the time of a repetition is the max over ranks; all variants interleaved
A B C ... A B C ... so that clock drift spreads over all of them):

- mkernel: the fused kernels, ``moe_dispatch_gemm`` (y = dispatch(x) @ w1[expert]) and
  ``moe_gemm_combine`` on y2 = y (no activation: it is not part of either op), both with
  ``path="fused"`` (moe_gemm_combine's default path between nodes; inside a node its default is the
  unfused one, while its fused kernel there is the slower: bench/NOTES.md);
- unfused: ``moe_dispatch`` then ``grouped_gemm``; ``grouped_gemm`` then ``moe_combine`` (the
  building blocks back to back);
- join, last for each routing: ``moe_dispatch_gemm`` with and without its dispatch CTAs taking
  GEMM tiles after their sends (config ``moe_join_gemm``, on by default); the two y must be equal bit
  for bit (``join_bits_match``), then both are timed interleaved (``join_ms``, ``nojoin_ms``);
- baseline: the pairs sorted by expert on the device (cupy.argsort of expert * P + pair index, so
  the order is (destination rank, local expert, pair)), the token rows gathered (cupy.take), NCCL
  all-to-all through cupy.cuda.nccl (ncclGroupStart, send / recv per peer, self included,
  ncclGroupEnd), then one cupy.matmul per local expert; combine: one cupy.matmul per local expert,
  the all-to-all back, and the weighted sum of every token's k rows in fp32 (one CuPy elementwise
  kernel: gather by pair position, j ascending, one rounding). The per-(source, expert) row counts
  are exchanged once on the host outside timing (routing is fixed across repetitions), as a
  capacity-planned all-to-all would. Two receive layouts, both timed, the faster is baseline_ms:
  'gather' (one contiguous message per peer, then a cupy.take into expert-major order; the reverse
  before the way back) and 'segments' (one message per (peer, local expert), received directly in
  expert-major order: no regrouping copy). NCCL needs one GPU per rank: where ranks share a GPU the
  baseline is not timed (baseline_ms / speedup null) and results are checked against the same
  pipeline with the exchange done through MPI on host copies.

Checked before timing: mkernel's rows after dispatch + GEMM1 against the baseline's (the same
per-expert row sets in the same documented order: local expert, source rank, pair order; between
nodes, where an expert's rows are ordered by forwarding rank, through the layer's output only), the
full layer's output [T, H] (dispatch -> GEMM1 -> GEMM2 -> combine) against the baseline's
(relative Frobenius norm, max over ranks, < 1e-2), the unfused blocks' output against the fused
ops', and handle.counts() against the host's counts.

bound_ms = max over ranks of max(GEMM flops (2 * rows received * H * F) at 990 TFLOP/s, bytes this
rank sends to / receives from other ranks (the larger) at LINK_GBS).

Goals (the issue): dispatch+GEMM and GEMM+combine >= 1.3x the baseline at H 7168 / F 2048 / 64
experts / top-8 and >= 1.1x the unfused building blocks there; >= 1.05x the baseline at H 4096 /
F 14336 / 8 experts / top-2 (T 4096). Rank 0 writes bench/results/moe_dispatch_gemm-<W>gpu.json and
moe_gemm_combine-<W>gpu.json (bench/harness.py), prints tables, the goals and a SUMMARY line last.

``--nodes N`` emulates N nodes (``gpus_per_node = W / N``) over ``--transport`` (default host).
There the issue's baseline is mkernel's unfused building blocks over the same transport
(baseline_ms = unfused_ms; goal: dispatch+GEMM >= 1.4x at H 7168 / F 2048 / 64 experts / top-8),
and both fused ops are timed (the fused GEMM + combine sends the node sums itself between nodes).
Results: ``...-<W>gpu-<N>node.json``.

    mpirun -n 2 python3 bench/moe.py [--quick] [--reps N] [--nodes 2 [--transport host]]
"""

import argparse
import functools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

from mkernel.ops import moe_gemm, moe_nodes  # noqa: E402
from mkernel.runtime import launch  # noqa: E402
from mkernel.runtime.gpu import mps_client  # noqa: E402
from mkernel.testing import sync_or_exit  # noqa: E402

import harness  # noqa: E402

# [T, H, F, E, k] per rank
SHAPES = [(4096, 7168, 2048, 64, 8), (4096, 4096, 14336, 8, 2)]
ROUTINGS = ("uniform", "zipf1.2")
QUICK_SHAPE = (1024, 7168, 2048, 64, 8)
QUICK_REPS = 5
OPS = ("moe_dispatch_gemm", "moe_gemm_combine")
PEAK_TFLOPS = 990.0  # H100/H200 SXM dense bf16 tensor-core peak
# NVLink rate per GPU and direction for the bound: ../shared/device/README.md measured GPU0 -> GPU1
# peer copies at 391 GB/s on the H200 pair (NVLink push from SMs saturates near 365 GB/s; NCCL
# send/recv both ways at once 296 GB/s each way). The highest measured one-way rate keeps the bound a
# lower bound. Where no measurement exists, NVLink 4's nominal 450 GB/s per direction is the figure
# to use (--link-gbs 450).
LINK_GBS = 391.0
MAX_REL_ERR = 1e-2
HANG_S = 120.0
WORKSPACE_MARGIN = 64 << 20
# (name, (H, F, E, k), T, compared with, at least)
GOALS = [("vs baseline at H 7168/F 2048/64 experts/top-8", (7168, 2048, 64, 8), 4096, "speedup", 1.30),
         ("vs unfused at H 7168/F 2048/64 experts/top-8", (7168, 2048, 64, 8), 4096, "vs_unfused", 1.10),
         ("vs baseline at H 4096/F 14336/8 experts/top-2", (4096, 14336, 8, 2), 4096, "speedup", 1.05)]
# between emulated nodes (--nodes): against the unfused blocks over the same transport, dispatch+GEMM only
NODE_GOALS = [("vs unfused between nodes at H 7168/F 2048/64 experts/top-8", (7168, 2048, 64, 8), 4096, "speedup",
               1.40)]


# ------------------------------------------------------------------------------------ helpers
def _max_op():
    from mpi4py import MPI

    return MPI.MAX


def wait(what, timeout_s=HANG_S):
    sync_or_exit(what, timeout_s)


def rand_scaled(shape, seed, scale, dt):
    """harness.rand's deterministic normals times ``scale``, rounded to ``dt`` (nearest even)."""
    import cupy

    x = cupy.random.RandomState(seed).standard_normal(shape, dtype=cupy.float32)
    x *= np.float32(scale)
    if dt.name != "bfloat16":
        return x.astype(dt)
    u = x.view(cupy.uint32)
    del x
    return ((u + cupy.uint32(0x7FFF) + ((u >> 16) & cupy.uint32(1))) >> 16).astype(cupy.uint16).view(dt)


def _u16(a):
    import cupy

    return a.view(cupy.uint16)


def _rel(a, b):
    """Relative Frobenius error of a against b (16-bit or float arrays), float64 norms."""
    import cupy

    fa, fb = harness.as_float(a), harness.as_float(b)
    num = float(cupy.linalg.norm((fa - fb).ravel().astype(cupy.float64)))
    den = float(cupy.linalg.norm(fb.ravel().astype(cupy.float64)))
    return num / max(den, 1e-30)


def routing(kind, T, E, k, seed):
    """(topk_ids int32 [T, k], topk_weights float32 [T, k]) on the host, deterministic."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        scores = rng.random((T, E))
    elif kind.startswith("zipf"):
        s = float(kind[4:])
        perm = np.random.default_rng(4242).permutation(E)  # fixed, the same on every rank
        p = np.empty(E)
        p[perm] = 1.0 / np.arange(1, E + 1, dtype=np.float64) ** s  # expert perm[i] is the i-th hottest
        # Gumbel top-k: k distinct experts, drawn one after the other with probability ~ p
        scores = np.log(p / p.sum())[None, :] + rng.gumbel(size=(T, E))
    else:
        raise ValueError(f"unknown routing {kind!r}")
    ids = np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int32)
    w = rng.random((T, k)) + 0.5
    w /= w.sum(axis=1, keepdims=True)
    return np.ascontiguousarray(ids), np.ascontiguousarray(w.astype(np.float32))


def routing_seed(si, ri, rank):
    """The seed of rank ``rank``'s routing ``ri`` of shape ``si`` (every rank can draw every rank's)."""
    return 7919 * (si + 1) + 101 * ri + rank


def tight_capacity(shape, si, routings, W, nodes=1):
    """The rows every routing of this shape needs at W ranks (every rank's routing drawn here): the
    most any owner receives, and between nodes the most virtual pairs (own tokens and those forwarded
    from the same-index ranks of the other nodes) any rank sends; rounded up to 1024."""
    T, H, F, E, k = shape
    El, L, epn = E // W, W // nodes, E // nodes
    need = 0
    for ri, rt in enumerate(routings):
        ids = [routing(rt, T, E, k, routing_seed(si, ri, r))[0] for r in range(W)]
        owners = sum(np.bincount(i.ravel(), minlength=E) for i in ids).reshape(W, El).sum(axis=1)
        need = max(need, int(owners.max()))
        on_node = [[(i // epn == n).any(axis=1).sum() for n in range(nodes)] for i in ids]  # tokens per node
        for r in range(W):
            n, lr = divmod(r, L)
            need = max(need, k * (T + sum(int(on_node[j * L + lr][n]) for j in range(nodes) if j != n)))
    return -(-need // 1024) * 1024


def bench_capacity(shape, si, routings, W, nodes=1):
    """moe_capacity (W T k rows) at up to 2 ranks; beyond, the routings' need (tight_capacity), as a user
    would pass it: 4 ranks' buffers at the default do not fit one 80 GB GPU."""
    import mkernel

    T, _, _, _, k = shape
    return mkernel.moe_capacity(T, k, W) if W <= 2 else tight_capacity(shape, si, routings, W, nodes)


def plan_bytes(T, H, E, k, W, itemsize, nodes=1, cap=None):
    """Symmetric workspace the MoE plan of one shape takes (mkernel/ops/moe.py _plan, and between nodes
    mkernel/ops/moe_nodes.py plan) at capacity ``cap`` (default moe_capacity), allocation by allocation
    rounded up as the heap does."""
    import mkernel
    from mkernel.comm.symmetric import ALIGN
    from mkernel.ops import moe, moe_nodes

    cap = cap or mkernel.moe_capacity(T, k, W)
    sizes = [W * moe.row_words(E) * 4, W * 4, W * 4, W * 4, 2 * E * 4, cap * 4, cap * H * itemsize,
             cap * H * itemsize]
    if nodes > 1:
        dt = np.dtype(f"f{itemsize}")  # only the item size matters here
        sizes += [int(np.prod(shape)) * d.itemsize
                  for _, shape, d in moe_nodes.buffer_sizes(W, nodes, H, dt, k, E, cap)]
    return sum(-(-s // ALIGN) * ALIGN for s in sizes)


# ---------------------------------------------------------------------------------- the layout
class Layout:
    """Where every row goes, from every rank's per-expert pair counts (host; exchanged once).

    Pairs i = t * k + j of this rank, sorted by (expert, i): the send buffer is destination-major,
    local-expert-minor. Received rows, expert-major: local expert, then source rank, then the
    source's pair order (mkernel's documented order)."""

    def __init__(self, ids, counts, E, W, me):
        T, k = ids.shape
        P = T * k
        El = E // W
        self.T, self.k, self.P, self.E, self.El, self.W, self.me = T, k, P, E, El, W, me
        C = np.asarray(counts, dtype=np.int64)  # [W source, E]
        self.C = C
        cnt = C[me]
        gstart = np.concatenate([[0], np.cumsum(cnt)])  # first row of global expert e in the send buffer
        self.send_rank = [(d, int(gstart[d * El]), int(gstart[(d + 1) * El] - gstart[d * El])) for d in range(W)]
        self.send_seg = [(d, int(gstart[d * El + e]), int(cnt[d * El + e])) for d in range(W) for e in range(El)]
        mine = C[:, me * El:(me + 1) * El]  # [W, El]: rows from source s for local expert e
        self.group_rows = mine.sum(axis=0)
        self.R = int(mine.sum())
        self.ebase = np.concatenate([[0], np.cumsum(self.group_rows)])
        exp_off = self.ebase[:-1][None, :] + np.cumsum(mine, axis=0) - mine  # (s, e) in expert-major order
        src_tot = mine.sum(axis=1)
        sbase = np.concatenate([[0], np.cumsum(src_tot)])
        src_off = sbase[:-1][:, None] + np.cumsum(mine, axis=1) - mine       # (s, e) in source-major order
        self.recv_rank = [(s, int(sbase[s]), int(src_tot[s])) for s in range(W)]
        self.recv_seg = [(s, int(exp_off[s, e]), int(mine[s, e])) for s in range(W) for e in range(El)]
        gidx = np.empty(self.R, dtype=np.int64)  # expert-major row r = source-major row gidx[r]
        for s in range(W):
            for e in range(El):
                n = int(mine[s, e])
                gidx[exp_off[s, e]:exp_off[s, e] + n] = src_off[s, e] + np.arange(n)
        self.gidx, self.inv_gidx = gidx, np.argsort(gidx)

    def rank_traffic(self, r):
        """(rows rank r receives, rows it sends to other ranks, rows it receives from other ranks)."""
        El = self.El
        own = self.C[:, r * El:(r + 1) * El]
        recv = int(own.sum())
        self_rows = int(own[r].sum())
        return recv, int(self.C[r].sum()) - self_rows, recv - self_rows


def bound(L, H, F, itemsize, link_gbs):
    """(bound_ms, gemm_ms, link_ms) of either op: the slowest rank's max(GEMM at peak, NVLink bytes)."""
    worst = (0.0, 0.0, 0.0)
    for r in range(L.W):
        recv, sent_off, recv_off = L.rank_traffic(r)
        g = 2.0 * recv * H * F / (PEAK_TFLOPS * 1e12) * 1e3
        ln = max(sent_off, recv_off) * H * itemsize / (link_gbs * 1e9) * 1e3
        if max(g, ln) > worst[0]:
            worst = (max(g, ln), g, ln)
    return worst


def network_rows(comm, ids, El, nodes):
    """Rows the most loaded rank sends or receives per direction between nodes (the hierarchical
    minimum): a token crosses once to each other node holding one of its experts, to the rank of the
    same local index there (docs/MOE.md, "Between nodes"); its node sums come back the same way (16-bit)."""
    L = comm.size // nodes
    node_of = np.arange(El * comm.size) // El // L
    hit = np.zeros((ids.shape[0], nodes), dtype=bool)
    hit[np.arange(ids.shape[0])[:, None], node_of[ids]] = True
    hits = np.asarray(comm.bench_mpi.allgather(hit.sum(axis=0)))  # [rank, node]: tokens with a pair there
    worst = 0
    for r in range(comm.size):
        n, lr = divmod(r, L)
        sent = sum(int(hits[r, j]) for j in range(nodes) if j != n)
        recv = sum(int(hits[j * L + lr, n]) for j in range(nodes) if j != n)
        worst = max(worst, sent, recv)
    return worst


# -------------------------------------------------------------------------------- the baseline
_K = {}


def _combine_kernel(dt):
    """out[t, h] = sum_j w[t, j] * back[pos[t * k + j], h] in fp32, j ascending, one rounding
    (back, pos, w passed flat)."""
    import cupy

    name = "bf16" if dt.name == "bfloat16" else "fp16"
    if name not in _K:
        head = r"""
            const long long t = i / H, h = i - t * H;
            float acc = 0.f;
            for (long long j = 0; j < k; ++j) {
              const long long p = t * k + j;
        """
        if name == "bf16":
            _K[name] = cupy.ElementwiseKernel(
                "raw uint16 back, raw int64 pos, raw float32 w, int64 k, int64 H", "uint16 out", head + r"""
              acc = fmaf(w[p], __uint_as_float(((unsigned int)back[pos[p] * H + h]) << 16), acc);
            }
            const unsigned int u = __float_as_uint(acc);
            out = (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
            """, "mk_bench_moe_combine_bf16")
        else:
            _K[name] = cupy.ElementwiseKernel(
                "raw float16 back, raw int64 pos, raw float32 w, int64 k, int64 H", "float16 out", head + r"""
              acc = fmaf(w[p], (float)back[pos[p] * H + h], acc);
            }
            out = acc;
            """, "mk_bench_moe_combine_fp16")
    return _K[name]


class Baseline:
    """Sort + gather (CuPy), all-to-all (NCCL, or MPI through the host for the check where NCCL
    cannot run), one cupy.matmul per local expert; and the reverse. See the module docstring."""

    def __init__(self, comm, L, x, ids_d, w_d, w1, w2, exchange):
        import cupy

        self.comm, self.L, self.x, self.ids, self.w, self.w1, self.w2 = comm, L, x, ids_d.ravel(), w_d, w1, w2
        self.exchange = exchange  # "nccl" or "mpi"
        T, H = x.shape
        F = w1.shape[2]
        P, R, dt = L.P, L.R, x.dtype
        self.H, self.F, self.dt = H, F, dt
        self.ar = cupy.arange(P, dtype=cupy.int64)
        self.pos = cupy.empty(P, dtype=cupy.int64)
        self.send = cupy.empty((P, H), dt)
        self.recv = cupy.empty((max(R, 1), H), dt)     # expert-major
        self.recv_src = cupy.empty((max(R, 1), H), dt)  # source-major ('gather' layout)
        self.h = cupy.empty((max(R, 1), F), dt)
        self.z = cupy.empty((max(R, 1), H), dt)
        self.z_src = cupy.empty((max(R, 1), H), dt)
        self.back = cupy.empty((P, H), dt)
        self.out = cupy.empty((T, H), dt)
        self.gidx = cupy.asarray(L.gidx)
        self.inv_gidx = cupy.asarray(L.inv_gidx)
        self.kern = _combine_kernel(dt)

    # the all-to-all of 16-bit rows: sends / recvs are [(peer, first row, rows)], in per-peer order
    def _a2a(self, src, dst, sends, recvs):
        if self.exchange == "mpi":
            return self._a2a_mpi(src, dst, sends, recvs)
        import cupy
        from cupy.cuda import nccl

        from mkernel.ops import tp

        nc, H = self.comm.nccl, self.H
        rb = H * src.itemsize
        s = cupy.cuda.get_current_stream().ptr
        dtc = tp.nccl_dtype(self.dt)
        nccl.groupStart()
        for p, a, n in sends:
            if n:
                nc.send(src.data.ptr + a * rb, n * H, dtc, p, s)
        for p, a, n in recvs:
            if n:
                nc.recv(dst.data.ptr + a * rb, n * H, dtc, p, s)
        nccl.groupEnd()

    def _a2a_mpi(self, src, dst, sends, recvs):
        """Check-only exchange through the host (one message per peer: the 'gather' layout)."""
        from mpi4py import MPI

        H = self.H
        sbuf = _u16(src).get()
        rbuf = np.empty(_u16(dst).shape, dtype=np.uint16)
        sc = [n * H for _, _, n in sends]
        sd = [a * H for _, a, _ in sends]
        rc = [n * H for _, _, n in recvs]
        rd = [a * H for _, a, _ in recvs]
        self.comm.bench_mpi.Alltoallv([sbuf, (sc, sd), MPI.UINT16_T], [rbuf, (rc, rd), MPI.UINT16_T])
        _u16(dst).set(rbuf)

    def dispatch_gemm(self, mode):
        import cupy

        L = self.L
        key = self.ids.astype(cupy.int64) * L.P + self.ar
        order = cupy.argsort(key)
        self.pos[order] = self.ar
        cupy.take(_u16(self.x), order // L.k, axis=0, out=_u16(self.send))
        if mode == "segments":
            self._a2a(self.send, self.recv, L.send_seg, L.recv_seg)
        else:
            self._a2a(self.send, self.recv_src, L.send_rank, L.recv_rank)
            if L.R:
                cupy.take(_u16(self.recv_src[:L.R]), self.gidx, axis=0, out=_u16(self.recv[:L.R]))
        for e in range(L.El):
            a, b = int(L.ebase[e]), int(L.ebase[e + 1])
            if b > a:
                cupy.matmul(self.recv[a:b], self.w1[e], out=self.h[a:b])

    def gemm_combine(self, mode):
        import cupy

        L = self.L
        for e in range(L.El):
            a, b = int(L.ebase[e]), int(L.ebase[e + 1])
            if b > a:
                cupy.matmul(self.h[a:b], self.w2[e], out=self.z[a:b])
        if mode == "segments":
            self._a2a(self.z, self.back, L.recv_seg, L.send_seg)
        else:
            if L.R:
                cupy.take(_u16(self.z[:L.R]), self.inv_gidx, axis=0, out=_u16(self.z_src[:L.R]))
            self._a2a(self.z_src, self.back, L.recv_rank, L.send_rank)
        if self.dt.name == "bfloat16":
            self.kern(_u16(self.back).ravel(), self.pos, self.w.ravel(), np.int64(L.k), np.int64(self.H),
                      _u16(self.out))
        else:
            self.kern(self.back.ravel(), self.pos, self.w.ravel(), np.int64(L.k), np.int64(self.H), self.out)


# -------------------------------------------------------------------------------------- timing
MPS_ROUNDS = 6  # under MPS: batches per variant (mps_timing.BATCH calls each), interleaved
# under MPS: the fused kernels also timed with these many comm CTAs (comm_sms=), per kernel
COMM_SMS_VARIANTS = {"dg": (4, 8, 16), "gc": (2, 4, 8)}


def combine_tile_ids(handle, N):
    """Between nodes, the fused combine's claim order as engine tile ids (tile_order backward): the
    grouped GEMM alone timed in that order tells the order's cost from the fusion's."""
    import cupy

    g = moe_gemm._gemm
    mtiles = int(sum(-(-int(r) // g.BM) for r in handle.counts()))
    ids = moe_nodes.claim_order(cupy.asnumpy(handle._nodes["tile_order"][:mtiles]), -(-N // g.BN), backward=True)
    bound = g.grouped_tiles_bound(handle.capacity, N, len(handle.counts()))  # the engine's array size
    return cupy.asarray(np.array(ids + [0] * (bound - len(ids)), dtype=np.uint32))


def timed_interleaved(comm, fns, reps, warmup=harness.WARMUP):
    """{name: per-repetition times (ms), the max over ranks} of every fn, interleaved: each round
    runs every fn once, in order. Each call starts behind a barrier and a spin kernel long enough for
    the host to have queued it (harness.launch_lead_ns, the max over ranks)."""
    import cupy

    for _ in range(warmup):
        for f in fns.values():
            f()
    wait("warm-up")
    comm.bench_mpi.Barrier()
    lead = {n: int(comm.bench_mpi.allreduce(harness.launch_lead_ns(f), op=_max_op())) for n, f in fns.items()}
    ts = {n: [] for n in fns}
    for _ in range(reps):
        for n, f in fns.items():
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            comm.bench_mpi.Barrier()
            harness.spin(lead[n])
            start.record()
            f()
            stop.record()
            wait(f"timed call of {n}")
            ts[n].append(cupy.cuda.get_elapsed_time(start, stop))
    every = comm.bench_mpi.allgather(ts)
    return {n: [max(r[n][i] for r in every) for i in range(reps)] for n in fns}


# ------------------------------------------------------------------------------------- stages
class Stop(Exception):
    """The ranks may be out of step: nothing more can run."""


def stage(comm, name, fn, errors, fatal):
    """Runs fn on every rank and agrees on the outcome: (ok, result). Records every rank's error;
    raises Stop where a failure may have left the ranks out of step (one rank failed and not the
    other, or an mkernel timeout / peer failure)."""
    err, is_fatal, res = None, False, None
    try:
        res = fn()
    except Exception as e:  # noqa: BLE001  (report it; the rest runs if the ranks are in step)
        err, is_fatal = f"{type(e).__name__}: {e}"[:500], isinstance(e, fatal)
    status = comm.bench_mpi.allgather((err, is_fatal))
    failed = [(rk, e) for rk, (e, _) in enumerate(status) if e is not None]
    for rk, e in failed:
        errors[f"{name} (rank {rk})"] = e
    if failed and comm.rank == 0:
        print(f"ERROR in {name}: " + "; ".join(f"rank {rk}: {e}" for rk, e in failed), flush=True)
    if failed and (any(f for _, f in status) or len(failed) != len(status)):
        raise Stop(name)
    return not failed, res


# ----------------------------------------------------------------------------------- one shape
def bench_shape(comm, si, shape, routings, dt, reps, have_baseline, link_gbs, errors, fatal, nodes=1, mps=None,
                cap=None):
    """Rows of one shape. ``mps`` (ranks sharing a GPU under MPS, one node: a DeviceBarrier) times by
    bench/mps_timing.py's rule, the baseline the unfused blocks, compute_ms the grouped GEMM alone
    with every rank at once."""
    import cupy

    import mkernel

    T, H, F, E, k = shape
    W, me = comm.size, comm.rank
    El = E // W
    cap = cap or mkernel.moe_capacity(T, k, W)
    rows = []
    sname = "x".join(str(v) for v in shape)

    def setup():
        x = rand_scaled((T, H), 1000 + 16 * si + me, 1.0, dt)
        w1 = rand_scaled((El, H, F), 2000 + 16 * si + me, 1.0 / np.sqrt(H), dt)
        w2 = rand_scaled((El, F, H), 3000 + 16 * si + me, 1.0 / np.sqrt(F), dt)
        bufs = dict(y_mk=cupy.empty((cap, F), dt), out_mk=cupy.empty((T, H), dt), recv_uf=cupy.empty((cap, H), dt),
                    y_uf=cupy.empty((cap, F), dt), z_uf=cupy.empty((cap, H), dt), out_uf=cupy.empty((T, H), dt))
        wait(f"setup {sname}")
        return x, w1, w2, bufs

    ok, res = stage(comm, f"setup {sname}", setup, errors, fatal)
    if not ok:
        return rows
    x, w1, w2, B = res

    for ri, rt in enumerate(routings):
        name = f"{sname} {rt}"
        ids_h, w_h = routing(rt, T, E, k, routing_seed(si, ri, me))
        counts = comm.bench_mpi.allgather(np.bincount(ids_h.ravel(), minlength=E).astype(np.int64))
        L = Layout(ids_h, counts, E, W, me)
        ids_d, w_d = cupy.asarray(ids_h), cupy.asarray(w_h)
        st = {}

        def mk_dg(comm_sms=None):
            _, st["h"] = mkernel.moe_dispatch_gemm(x, ids_d, w_d, w1, comm=comm, num_experts=E, capacity=cap,
                                                   out=B["y_mk"], path="fused", comm_sms=comm_sms)

        def mk_dg_with(join):  # the dispatch CTAs join the GEMM after their sends, or not (config moe_join_gemm)
            with mkernel.config.override(moe_join_gemm=join):
                mk_dg()

        def mk_gc(comm_sms=None):  # the fused kernel (the default path between nodes; inside a node the blocks are)
            mkernel.moe_gemm_combine(B["y_mk"], w2, st["h"], comm=comm, out=B["out_mk"], path="fused",
                                     comm_sms=comm_sms)

        def uf_dg():
            recv, st["h"] = mkernel.moe_dispatch(x, ids_d, w_d, comm=comm, num_experts=E, capacity=cap,
                                                 out=B["recv_uf"])
            mkernel.grouped_gemm(recv, w1, st["h"].group_rows, out=B["y_uf"])

        def uf_gc():
            mkernel.grouped_gemm(B["y_uf"], w2, st["h"].group_rows, out=B["z_uf"])
            mkernel.moe_combine(B["z_uf"], st["h"], comm=comm, out=B["out_uf"])

        def check_mkernel():
            mk_dg()
            mk_gc()
            wait(f"mkernel first layer {name}")
            comm.check()
            got = st["h"].counts()
            counts_ok = bool(np.array_equal(np.asarray(got, dtype=np.int64), L.group_rows))
            uf_dg()
            uf_gc()
            wait(f"unfused first layer {name}")
            comm.check()
            return counts_ok, _rel(B["out_uf"], B["out_mk"])

        ok, res = stage(comm, f"mkernel {name}", check_mkernel, errors, fatal)
        if not ok:
            continue
        counts_ok, err_uf = res

        def check_baseline():
            bl = Baseline(comm, L, x, ids_d, w_d, w1, w2, "nccl" if have_baseline else "mpi")
            errs = {}
            for mode in (("gather", "segments") if have_baseline else ("gather",)):
                bl.dispatch_gemm(mode)
                bl.gemm_combine(mode)
                wait(f"baseline ({mode}) first layer {name}")
                errs[mode] = (_rel(B["y_mk"][:L.R], bl.h[:L.R]) if L.R else 0.0, _rel(B["out_mk"], bl.out))
            return bl, errs

        ok_b, res = stage(comm, f"baseline {name}", check_baseline, errors, fatal)
        base, errs = res if ok_b else (None, None)
        if ok_b:
            every = comm.bench_mpi.allgather(errs)
            err_rows = max(e[m][0] for e in every for m in e)
            err_layer = max(e[m][1] for e in every for m in e)
        else:
            err_rows = err_layer = None
        every = comm.bench_mpi.allgather((counts_ok, err_uf))
        counts_ok = all(c for c, _ in every)
        err_uf = max(e for _, e in every)

        # the timed variants, interleaved (under MPS in rounds of one batch each); each combine after its dispatch
        fns = {"mk_dg": mk_dg, "mk_gc": mk_gc, "uf_dg": uf_dg, "uf_gc": uf_gc}
        if mps is not None:  # the GEMMs alone (the routing of the last unfused dispatch), every rank at once
            fns.update(gemm_dg=lambda: mkernel.grouped_gemm(B["recv_uf"], w1, st["h"].group_rows, out=B["y_uf"]),
                       gemm_gc=lambda: mkernel.grouped_gemm(B["y_uf"], w2, st["h"].group_rows, out=B["z_uf"]))
            import mps_timing as cc

            share = cc.full_share_change(comm, "moe_dispatch_gemm")  # every MoE kernel on the other grid size (A/B)

            def configured(f, **knobs):  # f with config knobs changed (an A/B in the same run)
                def call():
                    with mkernel.config.override(**knobs):
                        f()
                return call
            fns.update({f"sms{n}_{sfx}": functools.partial(f, n)  # at every rank count: the defaults cap with the grid
                        for sfx, f in (("dg", mk_dg), ("gc", mk_gc)) for n in COMM_SMS_VARIANTS[sfx]})
            ab = W <= 2  # the knobs' A/B at 2 ranks only (a 300 s device step, 4 ranks' memory)
            if ab:
                fns.update(flip_dg=configured(mk_dg, **share), flip_gc=configured(mk_gc, **share),
                           flipuf_dg=configured(uf_dg, **share), flipuf_gc=configured(uf_gc, **share))  # the blocks
            if ab and nodes > 1:  # the forwarded sums chunk by chunk (moe_sums_group=1) against the default groups;
                # each bundle in one piece (moe_bundle_pieces=1: its forwarded rows wait for all of it), four
                fns.update(group1_gc=configured(mk_gc, moe_sums_group=1),
                           pieces1_dg=configured(mk_dg, moe_bundle_pieces=1),
                           pieces1_gc=configured(mk_gc, moe_bundle_pieces=1),
                           pieces4_dg=configured(mk_dg, moe_bundle_pieces=4))
                # the combine's GEMM alone on its CTAs: in the engine's order, and in the fused kernel's
                ctas = launch.grid_sms(comm, "moe_gemm_combine") - moe_gemm._check_path(
                    "moe_gemm_combine", "fused", None, comm)[1]
                def gemm_in(order=None, flags=None):
                    return lambda: mkernel.grouped_gemm(B["y_uf"], w2, st["h"].group_rows, out=B["z_uf"], sms=ctas,
                                                        tile_order=order, tile_flags=flags)
                flags = cupy.zeros(moe_gemm._gemm.grouped_tiles_bound(cap, H, El), dtype=cupy.uint32)
                ids = combine_tile_ids(st["h"], H)
                fns.update(gemmsms_gc=gemm_in(), gemmord_gc=gemm_in(ids), gemmflags_gc=gemm_in(ids, flags))
        if have_baseline and base is not None:
            fns.update(bg_dg=lambda: base.dispatch_gemm("gather"), bg_gc=lambda: base.gemm_combine("gather"),
                       bs_dg=lambda: base.dispatch_gemm("segments"), bs_gc=lambda: base.gemm_combine("segments"))

        def timing():
            if mps is not None:  # per variant: batches of back-to-back calls behind a device barrier
                import mps_timing as cc

                # rounds of one batch per variant, the families (a dispatch, then its combine) in
                # reverse order every other round: a drift over the run falls on every variant alike
                families = list(dict.fromkeys(n.rsplit("_", 1)[0] for n in fns))
                t = {n: [] for n in fns}
                for r in range(MPS_ROUNDS):
                    for fam in (families if r % 2 == 0 else families[::-1]):
                        for n in (n for n in fns if n.rsplit("_", 1)[0] == fam):
                            t[n].append(cc.batch_ms(comm, mps, fns[n], batches=1))
            else:
                t = timed_interleaved(comm, fns, reps)
            comm.check()
            return t

        ok, ts = stage(comm, f"timing {name}", timing, errors, fatal)
        if not ok:
            continue
        b_ms, g_ms, l_ms = bound(L, H, F, dt.itemsize, link_gbs)
        traffic = [L.rank_traffic(r) for r in range(W)]
        recv_rows = [t[0] for t in traffic]
        net_rows = network_rows(comm, ids_h, El, nodes) if nodes > 1 else None
        for op, sfx in zip(OPS, ("dg", "gc")):
            if nodes > 1 and op != "moe_dispatch_gemm" and mps is None:
                continue
            mk, uf = ts[f"mk_{sfx}"], ts[f"uf_{sfx}"]
            t_mk, t_uf = harness.median(mk), harness.median(uf)
            t_bg = harness.median(ts[f"bg_{sfx}"]) if f"bg_{sfx}" in ts else None
            t_bs = harness.median(ts[f"bs_{sfx}"]) if f"bs_{sfx}" in ts else None
            mode = None if t_bg is None else ("gather" if t_bg <= t_bs else "segments")
            t_b = None if mode is None else min(t_bg, t_bs)
            b_key = None if mode is None else ("bg_" if mode == "gather" else "bs_") + sfx
            # between nodes an expert's rows are ordered by forwarding rank, not as the baseline's
            # (docs/MOE.md): its y is then checked through the whole layer's output
            rel = err_rows if op == "moe_dispatch_gemm" and nodes == 1 else err_layer
            r = harness.row(list(shape), t_mk, t_b or 0.0, b_ms, routing=rt, op=op, unfused_ms=t_uf,
                            vs_unfused=t_uf / t_mk if t_mk else None,
                            mkernel_ci95=harness.ci95(mk), unfused_ci95=harness.ci95(uf),
                            baseline_ci95=harness.ci95(ts[b_key]) if b_key else None,
                            baseline_mode=mode, baseline_gather_ms=t_bg, baseline_segments_ms=t_bs,
                            baseline_gather_ci95=harness.ci95(ts[f"bg_{sfx}"]) if t_bg is not None else None,
                            baseline_segments_ci95=harness.ci95(ts[f"bs_{sfx}"]) if t_bs is not None else None,
                            rel_err=rel, rel_err_rows=err_rows, rel_err_layer=err_layer,
                            rel_err_unfused_vs_fused=err_uf, counts_match=counts_ok,
                            reference="nccl baseline" if have_baseline else "same pipeline, MPI host exchange",
                            correct=bool(rel is not None and rel < MAX_REL_ERR and err_uf < MAX_REL_ERR and counts_ok),
                            gemm_bound_ms=g_ms, link_bound_ms=l_ms, capacity=cap, rows_received=recv_rows,
                            rows_imbalance=max(recv_rows) / max(1e-9, sum(recv_rows) / W),
                            bytes_off_rank_per_gpu=[max(s, rv) * H * dt.itemsize for _, s, rv in traffic],
                            world=W, dtype=dt.name, samples=len(mk), name=f"{sname} {rt}")
            if mps is not None:  # ranks sharing a GPU under MPS: NCCL cannot run; the bound from this run's rates
                import mps_timing as cc

                compute = harness.median(ts[f"gemm_{sfx}"])
                link, net = l_ms, {}
                if nodes > 1:  # the network's share only: token rows out, node sums back
                    nbytes = net_rows * H * dt.itemsize  # rows out, node sums back: 16-bit both
                    link = nbytes / (link_gbs * 1e9) * 1e3
                    net = dict(network_rows=net_rows, bytes_per_direction=nbytes, link_GBps=link_gbs)
                bnd = max(compute, link)
                # the default call (path=None) is the fused kernel or the blocks themselves (then 1.0: one call)
                default = moe_gemm.default_path(op, comm)
                r.update(baseline_ms=t_uf, speedup=r["vs_unfused"], baseline_mode="unfused blocks", compute_ms=compute,
                         link_ms=link, bound_ms=bnd, fraction_of_bound=bnd / t_mk, mps=True, path="fused",
                         default_path=default, default_speedup=r["vs_unfused"] if default == "fused" else 1.0,
                         sms_per_rank=cc.sms_per_rank(), **net)
                knob = f"mps_full_share={share['mps_full_share']}"
                r["variants_ms"] = {name: harness.median(ts[key]) for name, key in
                                    ((knob, f"flip_{sfx}"), (f"unfused {knob}", f"flipuf_{sfx}"),
                                     *((f"comm_sms={n}", f"sms{n}_{sfx}") for n in COMM_SMS_VARIANTS[sfx]),
                                     ("moe_sums_group=1", f"group1_{sfx}"),
                                     ("moe_bundle_pieces=1", f"pieces1_{sfx}"),
                                     ("moe_bundle_pieces=4", f"pieces4_{sfx}"),
                                     ("gemm alone, the fused kernel's GEMM CTAs", f"gemmsms_{sfx}"),
                                     ("gemm alone, those CTAs, the fused order", f"gemmord_{sfx}"),
                                     ("gemm alone, those CTAs, the fused order, tile flags", f"gemmflags_{sfx}"))
                                    if key in ts}
                if nodes > 1:
                    least = 0.80 if comm.local_size == 1 else 0.70
                    r.update(goal=f"fraction_of_bound >= {least}, speedup >= 1.0",
                             meets_goal=bool(r["speedup"] >= 1.0 and r["fraction_of_bound"] >= least))
            elif nodes > 1:  # the baseline between nodes: the unfused blocks over the same transport
                r.update(baseline_ms=t_uf, speedup=r["vs_unfused"], baseline_mode="unfused blocks")
            elif t_b is None:
                r["speedup"] = r["baseline_ms"] = None
            rows.append(r)
            if me == 0:
                bl = "n/a" if t_b is None else f"{t_b:8.3f} ms ({mode})"
                sp = "n/a" if r["speedup"] is None else f"{r['speedup']:.3f}x"
                print(f"{name:28s} {op:18s} mkernel {t_mk:8.3f} ms  unfused {t_uf:8.3f} ms ({r['vs_unfused']:.3f}x)  "
                      f"baseline {bl} {sp}  bound {r['bound_ms']:7.3f} ms  "
                      f"rel err {rel if rel is None else format(rel, '.1e')}",
                      flush=True)

        def join_stage():  # last: a variant must not cost the rows above
            mk_dg_with(False)
            wait(f"no join {name}")
            y_nojoin = B["y_mk"].copy()
            mk_dg_with(True)
            wait(f"join {name}")
            comm.check()
            n = int(sum(st["h"].counts()))
            match = bool((y_nojoin[:n].view(cupy.uint16) == B["y_mk"][:n].view(cupy.uint16)).all())
            if not all(comm.bench_mpi.allgather(match)):
                return False, None
            t = timed_interleaved(comm, {"join": lambda: mk_dg_with(True), "nojoin": lambda: mk_dg_with(False)},
                                  reps)
            comm.check()
            return True, t

        ok, res = stage(comm, f"join {name}", join_stage, errors, fatal)
        r_dg = next(r for r in reversed(rows) if r["op"] == "moe_dispatch_gemm")
        r_dg["join_bits_match"] = bool(ok and res[0])
        if ok and res[0]:
            tj = res[1]
            r_dg.update(join_ms=harness.median(tj["join"]), join_ci95=harness.ci95(tj["join"]),
                        nojoin_ms=harness.median(tj["nojoin"]), nojoin_ci95=harness.ci95(tj["nojoin"]))
            if me == 0:
                print(f"{name:28s} join: {r_dg['join_ms']:.3f} ms, without it {r_dg['nojoin_ms']:.3f} ms "
                      f"in the same run", flush=True)
        base = fns = st = None  # the baseline's buffers go before the next routing's
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


# ------------------------------------------------------------------------------------ reporting
TABLE = [("name", "T x H x F x E x k routing", None), ("mkernel_ms", "mkernel ms", ".3f"),
         ("unfused_ms", "unfused ms", ".3f"), ("vs_unfused", "vs unfused", ".3f"),
         ("baseline_ms", "baseline ms", ".3f"), ("speedup", "speedup", ".3f"), ("bound_ms", "bound ms", ".3f"),
         ("fraction_of_bound", "of bound", ".3f"), ("rel_err", "rel err", ".1e")]


def goal_verdicts(rows, W, shared, baseline_note, nodes=1):
    """[(text, verdict)] of every goal for both ops (between nodes: the dispatch+GEMM goal)."""
    out = []
    for gname, (H, F, E, k), T, key, least in (GOALS if nodes == 1 else NODE_GOALS):
        for op in (OPS if nodes == 1 else OPS[:1]):
            rs = [r for r in rows if r["op"] == op and tuple(r["shape"]) == (T, H, F, E, k)]
            label = f"{op} {gname} >= {least:.2f}x"
            if shared:
                v = "not measurable (ranks share a GPU: speed claims need one GPU per rank)"
            elif W == 1:
                v = "not measurable (world 1: nothing crosses NVLink)"
            elif not rs:
                v = f"not measurable (no row at T {T})"
            elif any(r[key] is None for r in rs):
                v = f"not measurable ({baseline_note or 'no baseline'})"
            else:
                vals = ", ".join(f"{r['routing']} {r[key]:.2f}x" for r in rs)
                v = f"{'met' if all(r[key] >= least for r in rs) else 'NOT met'} ({vals})"
            out.append((label, v))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"one shape {list(QUICK_SHAPE)}, uniform routing, {QUICK_REPS} reps (smoke run)")
    ap.add_argument("--reps", type=int, default=None,
                    help=f"timed repetitions per variant (default {harness.REPS}; at least 20 without --quick)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--link-gbs", type=float, default=LINK_GBS, help="NVLink GB/s per GPU and direction for the bound")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    ap.add_argument("--nodes", type=int, default=1, help="emulated nodes (gpus_per_node = ranks / nodes)")
    ap.add_argument("--transport", default="host", choices=("host", "tcp"), help="between emulated nodes")
    args = ap.parse_args()

    harness.require_gpu("bench/moe.py")

    import cupy
    import ml_dtypes
    from mpi4py import MPI

    import mkernel
    from mkernel.comm.symmetric import CONTROL_BYTES
    from mkernel.ops import tp

    t_start = time.time()
    dt = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype(np.float16)
    shapes = [QUICK_SHAPE] if args.quick else SHAPES
    routings = ROUTINGS[:1] if args.quick else ROUTINGS
    reps = (args.reps or QUICK_REPS) if args.quick else max(20, args.reps or harness.REPS)
    W0 = MPI.COMM_WORLD.Get_size()
    nodes = args.nodes
    if nodes < 1 or W0 % nodes:
        sys.exit(f"bench/moe.py: --nodes {nodes} does not divide the {W0} ranks")
    caps = [bench_capacity(s, si, routings, W0, nodes) for si, s in enumerate(shapes)]
    ws = (CONTROL_BYTES + max(plan_bytes(T, H, E, k, W0, dt.itemsize, nodes, cap)
                              for (T, H, F, E, k), cap in zip(shapes, caps)) + WORKSPACE_MARGIN)
    comm = (mkernel.init(workspace_bytes=ws) if nodes == 1 else
            mkernel.init(workspace_bytes=ws, gpus_per_node=W0 // nodes, transport=args.transport))
    # the benchmark's own collectives on a duplicate: never matched against one inside an op
    comm.bench_mpi = comm.mpi.Dup()
    W, me = comm.size, comm.rank
    try:  # the baseline is cupy.matmul: fall back to float16 where CuPy has no bfloat16 matmul
        cupy.matmul(harness.rand((16, 16), 0, dt), harness.rand((16, 16), 1, dt))
    except Exception as e:  # noqa: BLE001
        if me == 0:
            print(f"cupy.matmul cannot multiply {dt} ({type(e).__name__}); benchmarking float16", flush=True)
        dt = np.dtype(np.float16)

    shared = not tp.gpus_distinct(comm)
    physical = len(set(comm.bench_mpi.allgather((comm.topology.host, comm.device_id))))
    baseline_note = None
    if nodes > 1:
        baseline_note = (f"between {nodes} emulated nodes ({args.transport} transport) the baseline is mkernel's "
                         "unfused blocks over the same transport (baseline_ms = unfused_ms); results checked "
                         "against the same pipeline with an MPI host exchange")
    elif shared:
        baseline_note = (f"the {W} ranks share {physical} GPU(s): NCCL needs one GPU per rank, so the NCCL baseline "
                         "was skipped (baseline_ms and speedup are null; results checked against the same pipeline "
                         "with an MPI host exchange); timings of ranks sharing a GPU are not meaningful for speed")
    else:
        err = None
        try:
            comm.nccl  # noqa: B018  (created collectively on first use)
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"[:300]
        errs = [e for e in comm.bench_mpi.allgather(err) if e]
        if errs:
            baseline_note = f"NCCL is not usable ({errs[0]}); baseline skipped"
    have_baseline = baseline_note is None
    mps, link_gbs = None, args.link_gbs
    if shared and mps_client():  # issue 25's rule; the bound's link is this GPU's copy rate, or PCIe's between nodes
        import mps_timing as cc

        mps = cc.DeviceBarrier(comm)
        link_gbs = (cc.host_link_gbs if nodes > 1 else cc.device_link_gbs)(comm, mps)
        baseline_note = "ranks sharing a GPU under MPS: the baseline is the unfused blocks (NCCL cannot run)"
    if me == 0:
        nsm = cupy.cuda.Device().attributes["MultiProcessorCount"]
        print(f"# {W} ranks, {physical} GPU(s) ({harness.device_name()}, {nsm} SMs), {dt.name}, median of {reps}, "
              f"workspace {ws / 2**30:.2f} GiB, link {link_gbs:.0f} GB/s, setup {time.time() - t_start:.1f} s",
              flush=True)
        print("# NO BASELINE: " + baseline_note if baseline_note else
              "# baseline: cupy sort + gather, NCCL grouped send/recv all-to-all, cupy.matmul per expert; reverse "
              "+ fp32 weighted sum (CuPy kernel)", flush=True)

    fatal = (mkernel.TimeoutError, mkernel.PeerError, mkernel.ClosedError)
    rows, errors, stopped = [], {}, None
    for si, shape in enumerate(shapes):
        try:
            rows += bench_shape(comm, si, shape, routings, dt, reps, have_baseline, link_gbs, errors, fatal,
                                nodes, mps=mps, cap=caps[si])
        except Stop as e:
            stopped = str(e)
            if me == 0:
                print(f"# stopping after {stopped}: the ranks may be out of step", flush=True)
            break
        cupy.get_default_memory_pool().free_all_blocks()
        comm.release_plans()  # every rank, same point (synchronises)

    if me == 0:
        n_rows = len(shapes) * len(routings)
        common = dict(gpus=physical, ranks_per_gpu=W // physical,
                      nodes=nodes, transport="nvlink" if nodes == 1 else f"nvlink+{args.transport}",
                      out_dir=args.out, reps=reps, errors=errors,
                      stopped_after=stopped, physical_gpus=physical, shared_gpu=shared, baseline_note=baseline_note,
                      workspace_bytes=ws, link_gbs=link_gbs, peak_tflops=PEAK_TFLOPS,
                      capacity_rule="moe_capacity (W T k rows) at up to 2 ranks; beyond, the routings' need "
                                    "rounded up to 1024 (bench/moe.py tight_capacity)",
                      baseline="device sort (cupy.argsort of expert * P + pair) + cupy.take of the token rows, NCCL "
                               "grouped send/recv all-to-all (self included; counts exchanged once on the host, "
                               "outside timing), cupy.matmul per local expert; reverse: cupy.matmul per local expert, "
                               "all-to-all back, fp32 weighted sum in one CuPy elementwise kernel. Layouts 'gather' "
                               "(a message per peer + cupy.take regrouping) and 'segments' (a message per (peer, "
                               "expert)); baseline_ms is the faster",
                      unfused="moe_dispatch + grouped_gemm; grouped_gemm + moe_combine",
                      bound_definition=(
                          f"max over ranks of max(2 * rows received * H * F at {PEAK_TFLOPS} TFLOP/s, max(bytes "
                          f"sent to, received from other ranks) at {link_gbs:.1f} GB/s)" if mps is None else
                          "max(compute_ms: the grouped GEMM alone, every rank at once; link_ms: " + (
                              "the rows a rank sends or receives between nodes (16-bit sums back) over the PCIe copy "
                              "rate, every rank at once)" if nodes > 1 else
                              "bytes to and from other ranks over the device copy rate)")),
                      goals=[{"name": g[0], "H_F_E_k": list(g[1]), "T": g[2], "metric": g[3], "at_least": g[4]}
                             for g in (GOALS if nodes == 1 else NODE_GOALS)])
        paths = []
        for op in (OPS if nodes == 1 or mps is not None else OPS[:1]):
            op_rows = [r for r in rows if r["op"] == op]
            paths.append(harness.write(op, op_rows, **common))
            harness.plot_rows(json.loads(paths[-1].read_text()), paths[-1].with_suffix(".png"))
            print(f"\n== {op} ({W} ranks) -> {paths[-1]}")
            print(harness.table(op_rows, TABLE))
        verdicts = goal_verdicts(rows, W, shared, baseline_note, nodes)
        if mps is not None and rows and nodes > 1:  # issue 25 between nodes
            met = "met" if all(r["meets_goal"] for r in rows) else "NOT met"
            low_f, low_s = min(r["fraction_of_bound"] for r in rows), min(r["speedup"] for r in rows)
            verdicts = [(f"fraction_of_bound >= {0.8 if comm.local_size == 1 else 0.7} and speedup >= 1.0 on every "
                         f"row (MPS, {args.transport})", f"{met} (min fraction {low_f:.2f}, min speedup {low_s:.3f})")]
        elif mps is not None and rows:  # issue 25 inside a node: the default call never costs time
            sp = [r["default_speedup"] for r in rows]
            geo = float(np.exp(np.mean(np.log(sp))))
            paths_used = ", ".join(f"{op} {moe_gemm.default_path(op, comm)}" for op in OPS)
            verdicts.append((f"the default call ({paths_used}) >= 0.98x the unfused blocks on every row, "
                             f"geomean >= 1.0 (MPS)",
                             f"{'met' if min(sp) >= 0.98 and geo >= 1.0 else 'NOT met'} (min {min(sp):.3f}, "
                             f"geomean {geo:.3f})"))
        print()
        for label, v in verdicts:
            print(f"goal {label}: {v}")
        parts = [f"{W} ranks" + ("" if not shared else f" sharing {physical} GPU(s) under MPS" if mps is not None else
                                 f" sharing {physical} GPU(s): speed claims need one GPU per rank"),
                 f"{len(rows) // (len(OPS) if nodes == 1 or mps is not None else 1)}/{n_rows} rows"]
        for label, v in verdicts:
            parts.append(f"{label}: {v}")
        if rows:
            wrong = [r for r in rows if not r["correct"]]
            errs_ = [r["rel_err"] for r in rows if r["rel_err"] is not None]
            parts.append(("results correct" if not wrong else f"results WRONG on {len(wrong)} rows")
                         + (f" (max rel err {max(errs_):.1e} vs {rows[0]['reference']})" if errs_ else ""))
        if errors:
            parts.append(f"{len(errors)} errors: {', '.join(errors)}")
        rel = [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in paths]
        parts.append(f"{', '.join(rel)}, {time.time() - t_start:.0f} s")
        print("SUMMARY moe: " + "; ".join(parts), flush=True)
    comm.bench_mpi.Free()
    comm.close()


if __name__ == "__main__":
    main()
