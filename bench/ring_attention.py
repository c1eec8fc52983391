#!/usr/bin/env python3
"""Ring attention benchmark: mkernel.ring_attention against the same attention engine run block by
block with NCCL between the blocks (no overlap), one process per rank, side by side in one run.

- mkernel: ``mkernel.ring_attention(q, k, v, comm=comm, causal=c, out=out)`` (one fused kernel:
  attention CTAs and forwarding CTAs overlapped).
- baseline (isolates the overlap): for step s = 0 .. W-1, the partial attention of the local
  queries against the key/value block held now (rank (me - s) mod W's) with
  ``mkernel.attention(..., return_lse=True)``, merged into an fp32 accumulator by the log-sum-exp
  rule (CuPy elementwise kernels), then the block sent to rank (me + 1) mod W and the next one
  received from (me - 1) mod W with NCCL send/recv (``comm.nccl``; groupStart / groupEnd), all on
  one stream, so nothing overlaps. Causal (zigzag layout, mkernel.sequence): the local queries are
  global chunks i in (me, 2W-1-me), the block's keys chunks j in (src, 2W-1-src); each pair is
  computed full if j < i, causal with offset 0 if j == i, skipped if j > i. The fp32 result is
  rounded to the input dtype at the end (part of the timed work). NCCL needs one GPU per rank:
  where ranks share a GPU in one node under MPS the ring step is a device copy into the next
  rank's symmetric slot and a device barrier instead (SymmetricExchange); otherwise skipped.
- between emulated nodes (``--nodes N``, over ``--transport``, default host): the best unfused
  path over the same transport (GatherBaseline): every rank's K and V gathered by the library's
  own hierarchical all-gather (allgather_gemm's unfused path; its GEMM against an [2 H_kv D, 8]
  matrix is the only extra work), then the engine over the whole gathered sequence in one call
  (causal: one call per local query chunk over the global keys up to it).
- bound_ms = the engine's time for this rank's work without communication, the less of two ways:
  W calls on one local block (``mkernel.attention(q, k, v)``, causal: ``causal=True``; under the
  zigzag every step of the ring is S_local^2 / 2 of score work, what causal attention on one
  S_local block does) and the gathered baseline's engine calls alone (the keys of every rank
  already in place: one call over W x S_local keys, causal one per local query chunk), which skip
  W - 1 calls' start and end as the fused kernel does. It assumes communication fully hidden and
  every SM computing, so fraction_of_bound = bound / mkernel <= ~1.

Before timing, mkernel's output is compared with the baseline's (relative Frobenius error, the
whole local output), and both with a float32 reference on sampled rows (the global keys and values
regenerated from every rank's seed, masked by global position). Timing: CUDA events, warm-up, the
median of >= 20 per rank, each repetition started behind an MPI barrier and a spin kernel (so host
launch time is not timed), then the max over ranks.

Shapes: 32 heads x 128 (H_q = H_kv), batch 1, bf16, S_local 4096 and 8192 (plus 16384 and 32768
without --quick), causal and not. Goals: speedup (baseline / mkernel) >= 1.25 at 4096 and >= 1.10
at 8192; fraction_of_bound >= 0.9 on every row. Rank 0 writes
bench/results/ring_attention-<W>gpu.json (bench/harness.py), prints a table, the goals, and a
SUMMARY line last.

    mpirun -n <gpus> python3 bench/ring_attention.py [--quick] [--reps N] [--seq 4096,8192] [--comm-sms N]
                                                   [--nodes N [--transport host]]
"""

import argparse
import importlib
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

from mkernel.ops.sequence import global_positions  # noqa: E402
from mkernel.runtime.gpu import mps_client  # noqa: E402
from mkernel.testing import sync_or_exit  # noqa: E402

import harness  # noqa: E402

HEADS, DIM = 32, 128
SEQ_QUICK = (4096, 8192)
SEQ_FULL = (4096, 8192, 16384, 32768)
GOAL_SPEEDUP = {4096: 1.25, 8192: 1.10}
GOAL_FRACTION = 0.90
SHARED_GOAL_SPEEDUP = 0.98  # ranks sharing a GPU in one node under MPS (issue 25): fusion never costs time
MAX_REL_ERR = 1e-2
SAMPLE_ROWS = 32
QUICK_REPS = 20
HANG_S = 120.0


# ------------------------------------------------------------------------------------ helpers
def _seed(row, rank, which):
    """Seed of rank's q (0), k (1) or v (2) in benchmark row ``row``: any rank can regenerate them."""
    return (row * 64 + rank) * 4 + which + 1


def _rel(a, b):
    import cupy

    return float(cupy.linalg.norm((a - b).ravel()) / max(float(cupy.linalg.norm(b.ravel())), 1e-30))


def _max_op():
    from mpi4py import MPI

    return MPI.MAX


def wait(what, timeout_s=HANG_S):
    sync_or_exit(what, timeout_s)


def timed(comm, fn, reps, warmup=harness.WARMUP):
    """(max over ranks of the median, this rank's timings) of fn() in ms. Each repetition starts
    behind a barrier (ranks aligned) and a spin kernel long enough for the host to enqueue fn, so
    the start event fires when the work is already queued."""
    import cupy

    for _ in range(warmup):
        fn()
    wait("warm-up")
    comm.bench_mpi.Barrier()
    pre = int(comm.bench_mpi.allreduce(harness.launch_lead_ns(fn), op=_max_op()))
    ts = []
    for _ in range(reps):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        comm.bench_mpi.Barrier()
        harness.spin(pre)
        start.record()
        fn()
        stop.record()
        wait("timed call")
        ts.append(cupy.cuda.get_elapsed_time(start, stop))
    return comm.bench_mpi.allreduce(harness.median(ts), op=_max_op()), ts


# ----------------------------------------------------------------- the baseline's merge kernels
_K = {}

_MERGE = r"""
    const float NEG = __int_as_float((int)0xff800000u);
    long long t = i / D;
    long long h = t % H;
    long long s = t / H;
    long long li = h * S + s;
    float a = la[li], b = lb[li];
    float m = fmaxf(a, b);
    float ea = (a == NEG) ? 0.f : expf(a - m);
    float eb = (b == NEG) ? 0.f : expf(b - m);
    float inv = 1.f / (ea + eb);
    acc = acc * (ea * inv) + (VALUE) * (eb * inv);
"""


def _kernels():
    """CuPy elementwise kernels: the log-sum-exp merge of a partial (o [S, H, D] in bf16 / fp16,
    lse [H, S]) into the fp32 accumulator (acc [S, H, D], lse_acc [H, S]), the lse update, and the
    final fp32 -> bf16 rounding (to nearest even)."""
    import cupy

    if not _K:
        _K["merge_bf16"] = cupy.ElementwiseKernel(
            "uint16 o, raw float32 la, raw float32 lb, int64 S, int64 H, int64 D", "float32 acc",
            _MERGE.replace("VALUE", "__uint_as_float(((unsigned int)o) << 16)"), "mk_bench_ring_merge_bf16")
        _K["merge_fp16"] = cupy.ElementwiseKernel(
            "float16 o, raw float32 la, raw float32 lb, int64 S, int64 H, int64 D", "float32 acc",
            _MERGE.replace("VALUE", "(float)o"), "mk_bench_ring_merge_fp16")
        _K["lse"] = cupy.ElementwiseKernel(
            "float32 lb", "float32 la", r"""
            const float NEG = __int_as_float((int)0xff800000u);
            if (la == NEG) { la = lb; }
            else if (lb != NEG) { float m = fmaxf(la, lb); la = m + logf(expf(la - m) + expf(lb - m)); }
            """, "mk_bench_ring_lse")
        _K["to_bf16"] = cupy.ElementwiseKernel(
            "float32 x", "uint16 y", r"""
            unsigned int u = __float_as_uint(x);
            y = (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
            """, "mk_bench_ring_to_bf16")
    return _K


class Baseline:
    """The engine block by block with NCCL send/recv between the steps, on one stream (see the
    module docstring). __call__ writes ``out``."""

    def __init__(self, comm, q, k, v, out, causal, shared=None):
        import cupy

        self.attention = importlib.import_module("mkernel.engines.attention").attention
        self.comm, self.q, self.k, self.v, self.out, self.causal = comm, q, k, v, out, causal
        self.W, self.me = comm.size, comm.rank
        S, H, D = q.shape
        self.S, self.H, self.D = S, H, D
        self.bf16 = q.dtype.name == "bfloat16"
        self.shared = shared  # ranks sharing a GPU: a SymmetricExchange instead of NCCL
        if shared is not None:
            self.bufs = shared.slots
        else:
            self.bufs = [(cupy.empty_like(k), cupy.empty_like(v)) for _ in range(2)] if self.W > 1 else []
        self.acc = cupy.empty((S, H, D), dtype=cupy.float32)
        c = S // 2
        # (global chunk id, q rows, accumulator, lse accumulator) per query segment
        if causal:
            self.segments = [(self.me, q[:c], self.acc[:c], cupy.empty((H, c), cupy.float32)),
                             (2 * self.W - 1 - self.me, q[c:], self.acc[c:], cupy.empty((H, c), cupy.float32))]
        else:
            self.segments = [(None, q, self.acc, cupy.empty((H, S), cupy.float32))]
        self.k_ = _kernels()
        self.stream = cupy.cuda.get_current_stream()

    def _merge(self, acc, lse_acc, o, lse):
        S_seg = acc.shape[0]
        if self.bf16:
            self.k_["merge_bf16"](o.view("uint16"), lse_acc, lse, np.int64(S_seg), np.int64(self.H), np.int64(self.D),
                                  acc)
        else:
            self.k_["merge_fp16"](o, lse_acc, lse, np.int64(S_seg), np.int64(self.H), np.int64(self.D), acc)
        self.k_["lse"](lse, lse_acc)

    def _exchange(self, cur_k, cur_v, nxt_k, nxt_v):
        if self.shared is not None:
            self.shared.send(cur_k, cur_v, (nxt_k, nxt_v))
            return
        from cupy.cuda import nccl

        nc = self.comm.nccl
        nbytes = cur_k.nbytes
        to, frm = (self.me + 1) % self.W, (self.me - 1) % self.W
        s = self.stream.ptr
        nccl.groupStart()
        nc.send(cur_k.data.ptr, nbytes, nccl.NCCL_UINT8, to, s)
        nc.recv(nxt_k.data.ptr, nbytes, nccl.NCCL_UINT8, frm, s)
        nc.send(cur_v.data.ptr, nbytes, nccl.NCCL_UINT8, to, s)
        nc.recv(nxt_v.data.ptr, nbytes, nccl.NCCL_UINT8, frm, s)
        nccl.groupEnd()

    def __call__(self):
        self.acc.fill(0)
        for _, _, _, lse_acc in self.segments:
            lse_acc.fill(-np.inf)
        cur_k, cur_v = self.k, self.v
        W, c = self.W, self.S // 2
        for s in range(W):
            src = (self.me - s) % W
            if not self.causal:
                _, qq, acc, lse_acc = self.segments[0]
                o, lse = self.attention(qq, cur_k, cur_v, return_lse=True)
                self._merge(acc, lse_acc, o, lse)
            else:
                blocks = [(src, cur_k[:c], cur_v[:c]), (2 * W - 1 - src, cur_k[c:], cur_v[c:])]
                for qi, qq, acc, lse_acc in self.segments:
                    for kj, kk, vv in blocks:
                        if kj > qi:
                            continue
                        diag = kj == qi
                        o, lse = self.attention(qq, kk, vv, causal=diag, causal_offset=0 if diag else None,
                                                return_lse=True)
                        self._merge(acc, lse_acc, o, lse)
            if s < W - 1:
                nk, nv = self.bufs[s % 2]
                self._exchange(cur_k, cur_v, nk, nv)
                cur_k, cur_v = nk, nv
        if self.bf16:
            self.k_["to_bf16"](self.acc, self.out.view("uint16"))
        else:
            self.out[...] = self.acc


class SymmetricExchange:
    """The baseline's ring step where NCCL cannot run (ranks sharing a GPU, one node): two receive
    slots in symmetric memory; a step copies the current block into the next rank's slot (a device
    copy through its IPC mapping), then a device barrier (bench/mps_timing.py) so that no rank
    reads a slot before its writer finished, nor writes one its reader still uses."""

    def __init__(self, comm, k, barrier):
        self.comm, self.barrier = comm, barrier
        self.slots = [(comm.empty(k.shape, k.dtype), comm.empty(k.shape, k.dtype)) for _ in range(2)]
        self.to = (comm.local_rank + 1) % comm.local_size

    def send(self, cur_k, cur_v, slot):
        import cupy

        stream = cupy.cuda.get_current_stream().ptr
        base = self.comm.heap.peer_base[self.to]
        for src, dst in zip((cur_k, cur_v), slot):
            if not src.flags.c_contiguous:
                src = cupy.ascontiguousarray(src)
            cupy.cuda.runtime.memcpyAsync(base + self.comm.offset_of(dst), src.data.ptr, src.nbytes, 3, stream)
        self.barrier()


class GatherBaseline:
    """The unfused path between nodes (module docstring): K and V side by side in one row, gathered
    by allgather_gemm's unfused path, then the engine over the gathered sequence. Causal: the
    gathered zigzag chunks copied into global order, then query chunk i against keys [0, (i+1) c)
    (the engine's default causal offset, S_kv - S_q = i c, is the global one). __call__ writes out."""

    def __init__(self, comm, q, k, v, out, causal):
        import cupy

        self.comm, self.q, self.k, self.v, self.out, self.causal = comm, q, k, v, out, causal
        self.attention = importlib.import_module("mkernel.engines.attention").attention
        self.allgather_gemm = importlib.import_module("mkernel.ops.allgather_gemm").allgather_gemm
        S, Hkv, D = k.shape
        W = comm.size
        self.rows = cupy.empty((S, 2 * Hkv * D), k.dtype)  # [K row | V row]
        self.b = cupy.zeros((2 * Hkv * D, 8), k.dtype)
        self.sink = cupy.empty((W * S, 8), k.dtype)
        if causal:
            self.kg = cupy.empty((2 * W, S // 2, Hkv, D), k.dtype)  # global chunk order
            self.vg = cupy.empty_like(self.kg)
        # Every kernel after the gather loads its module here, with nothing of ours in flight: a first
        # load behind a gather between nodes blocks the proxy's copies it waits for (calls.quiesced_first_use).
        cupy.cuda.runtime.deviceSynchronize()
        self._stage()
        self._attend(cupy.zeros((W * S, 2 * Hkv * D), k.dtype))
        cupy.cuda.runtime.deviceSynchronize()

    def __call__(self):
        self._stage()
        _, g = self.allgather_gemm(self.rows, self.b, comm=self.comm, out=self.sink, path="unfused",
                                   return_gathered=True)
        self._attend(g)

    def _stage(self):
        S, Hkv, D = self.k.shape
        self.rows[:, :Hkv * D] = self.k.reshape(S, Hkv * D)
        self.rows[:, Hkv * D:] = self.v.reshape(S, Hkv * D)

    def _attend(self, g):
        S, Hkv, D = self.k.shape
        W = self.comm.size
        if not self.causal:
            g = g.reshape(W * S, 2, Hkv, D)
            attend_gathered(self.attention, self.q, g[:, 0], g[:, 1], self.out, self.comm, False)
            return
        c = S // 2
        g = g.reshape(W, 2, c, 2, Hkv, D)  # (rank, zigzag half, row, K or V, head, dim)
        for dst, kv in ((self.kg, 0), (self.vg, 1)):
            dst[:W] = g[:, 0, :, kv]  # chunk j < W: rank j's first half
            dst[W:] = g[::-1, 1, :, kv]  # chunk j >= W: rank 2W - 1 - j's second half
        kg, vg = (x.reshape(2 * W * c, Hkv, D) for x in (self.kg, self.vg))
        attend_gathered(self.attention, self.q, kg, vg, self.out, self.comm, True)


def attend_gathered(attention, q, kg, vg, out, comm, causal):
    """The engine over every rank's keys in global order: one call; causal (zigzag), one per local
    query chunk over the global keys up to it (the engine's default offset is the global one)."""
    if not causal:
        attention(q, kg, vg, out=out)
        return
    c, W, me = q.shape[0] // 2, comm.size, comm.rank
    for half, chunk in ((0, me), (1, 2 * W - 1 - me)):
        rows = slice(half * c, (half + 1) * c)
        attention(q[rows], kg[:(chunk + 1) * c], vg[:(chunk + 1) * c], causal=True, out=out[rows])


def engine_alone(comm, attention, q, k, v, causal):
    """The engine's work of this rank with every rank's keys already in place (GatherBaseline
    without the gather and the reordering): a callable, for the bound."""
    import cupy

    kg, vg = cupy.concatenate([k] * comm.size), cupy.concatenate([v] * comm.size)  # values do not change the time
    out = cupy.empty_like(q)
    return lambda: attend_gathered(attention, q, kg, vg, out, comm, causal)


# --------------------------------------------------------------------------- sampled reference
def sampled_reference(comm, row, q, rows, S, Hq, Hkv, D, dt, causal):
    """float32 attention of this rank's local query rows ``rows`` (host int array) against the
    whole global sequence: every rank's keys and values regenerated from their seeds, one rank's
    block at a time (online softmax), masked by global position. Returns [n, H_q, D] float32."""
    import cupy

    W, me = comm.size, comm.rank
    g = Hq // Hkv
    scale = 1.0 / math.sqrt(D)
    qh = harness.as_float(harness.take_rows(q, cupy.asarray(rows))).transpose(1, 0, 2)  # [H_q, n, D]
    n = len(rows)
    pos_q = cupy.asarray(global_positions(me, W, S, causal=causal)[rows])
    m = cupy.full((Hq, n), -np.inf, dtype=cupy.float32)
    l_ = cupy.zeros((Hq, n), dtype=cupy.float32)
    acc = cupy.zeros((Hq, n, D), dtype=cupy.float32)
    for p in range(W):
        kh = cupy.repeat(harness.as_float(harness.rand((S, Hkv, D), _seed(row, p, 1), dt)).transpose(1, 0, 2), g,
                         axis=0)
        vh = cupy.repeat(harness.as_float(harness.rand((S, Hkv, D), _seed(row, p, 2), dt)).transpose(1, 0, 2), g,
                         axis=0)
        s = cupy.matmul(qh, kh.transpose(0, 2, 1)) * np.float32(scale)  # [H_q, n, S]
        if causal:
            pos_k = cupy.asarray(global_positions(p, W, S, causal=True))
            s = cupy.where(pos_k[None, None, :] <= pos_q[None, :, None], s, np.float32(-np.inf))
        m_new = cupy.maximum(m, s.max(axis=-1))
        safe = cupy.where(cupy.isfinite(m_new), m_new, np.float32(0))
        corr = cupy.exp(m - safe)
        pe = cupy.exp(s - safe[..., None])
        l_ = l_ * corr + pe.sum(axis=-1)
        acc = acc * corr[..., None] + cupy.matmul(pe, vh)
        m = m_new
        del kh, vh, s, pe
    return (acc / l_[..., None]).transpose(1, 0, 2)


# --------------------------------------------------------------------------------------- a row
def bench_row(comm, ring, attention, row, S, causal, dt, reps, have_baseline, comm_sms, shared=None,
              kv_heads=HEADS):
    """One row. ``shared`` (ranks sharing a GPU under MPS: a SharedMode) times by
    bench/mps_timing.py's rule against the SymmetricExchange baseline."""
    import cupy

    W, me = comm.size, comm.rank
    H, Hkv, D = HEADS, kv_heads, DIM
    q = harness.rand((S, H, D), _seed(row, me, 0), dt)
    k = harness.rand((S, Hkv, D), _seed(row, me, 1), dt)
    v = harness.rand((S, Hkv, D), _seed(row, me, 2), dt)
    out = cupy.empty_like(q)
    kw = {} if comm_sms is None else {"comm_sms": comm_sms}

    def mk():
        ring(q, k, v, comm=comm, causal=causal, out=out, **kw)

    mk()
    wait(f"mkernel first call {S} causal={causal}")
    comm.check()
    rows = np.sort(np.random.default_rng(row).choice(S, SAMPLE_ROWS, replace=False))
    ref = sampled_reference(comm, row, q, rows, S, H, Hkv, D, dt, causal)
    err_mk = _rel(harness.as_float(harness.take_rows(out, cupy.asarray(rows))), ref)

    base, err_base, err_vs = None, None, None
    if have_baseline:
        base_out = cupy.empty_like(q)
        if comm.num_nodes > 1:
            base = GatherBaseline(comm, q, k, v, base_out, causal)
        else:
            exchange = SymmetricExchange(comm, k, shared.barrier) if shared is not None and W > 1 else None
            base = Baseline(comm, q, k, v, base_out, causal, shared=exchange)
        base()
        wait(f"baseline first call {S} causal={causal}")
        err_base = _rel(harness.as_float(harness.take_rows(base_out, cupy.asarray(rows))), ref)
        err_vs = _rel(harness.as_float(out), harness.as_float(base_out))
    # one collective for the three errors: the max over ranks of each
    gathered = comm.bench_mpi.allgather((err_mk, err_base, err_vs))
    err_mk = max(g[0] for g in gathered)
    err_base = max(g[1] for g in gathered) if have_baseline else None
    err_vs = max(g[2] for g in gathered) if have_baseline else None
    correct = max(err_mk, err_base or 0.0, err_vs or 0.0) < MAX_REL_ERR

    if shared is not None:
        return shared.row(comm, (S, H, Hkv, D, causal), dt, mk, base,
                          lambda: attention(q, k, v, causal=causal, out=out), engine_alone(comm, attention, q, k, v,
                                                                                          causal),
                          k.nbytes, err_mk, err_base, err_vs, correct, comm_sms)
    t_mk, ts_mk = timed(comm, mk, reps)
    comm.check()
    t_base = timed(comm, base, reps)[0] if base is not None else None
    blk = cupy.empty_like(q)
    t_blk = timed(comm, lambda: attention(q, k, v, causal=causal, out=blk), reps)[0]
    t_alone = timed(comm, engine_alone(comm, attention, q, k, v, causal), reps)[0]
    bound = min(W * t_blk, t_alone)
    fl = 4.0 * S * (W * S) * H * D * (0.5 if causal else 1.0)  # per rank, FlashAttention's convention
    goal_sp = GOAL_SPEEDUP.get(S)
    r = harness.row([S, H, Hkv, D, causal], t_mk, t_base or 0.0, bound, engine_block_ms=t_blk,
                    engine_gathered_ms=t_alone,
                    mkernel_ms_rank_median=harness.median(ts_mk), mkernel_ms_ci95=harness.ci95(ts_mk),
                    tflops_per_gpu=fl / t_mk * 1e-9, world=W, dtype=dt.name, comm_sms=comm_sms,
                    rel_err_vs_baseline=err_vs, ref_rel_err_mkernel=err_mk, ref_rel_err_baseline=err_base,
                    correct=bool(correct), goal_speedup=goal_sp, goal_fraction_of_bound=GOAL_FRACTION,
                    name=f"{S} {H}/{Hkv} {D} {'causal' if causal else 'full'}")
    if t_base is None:
        r["speedup"] = r["baseline_ms"] = None
    r["meets_speedup_goal"] = None if goal_sp is None or r["speedup"] is None else bool(r["speedup"] >= goal_sp)
    r["meets_fraction_goal"] = bool(r["fraction_of_bound"] is not None and r["fraction_of_bound"] >= GOAL_FRACTION)
    return r


class SharedMode:
    """Ranks sharing a GPU under MPS (issue 25's rule, bench/mps_timing.py): a device barrier starts
    each batch of back-to-back calls; compute_ms is the engine's work without communication (the
    less of world calls on the local block and the gathered calls alone) with every rank computing
    at once; link_ms the bytes each rank must send over the link measured in this run
    with every rank copying: in a node the K and V blocks it forwards ((world - 1) x 2 blocks over the
    device copy rate), between nodes its share of the other nodes' blocks ((nodes - 1) x 2 blocks over
    the host copy rate, device to host and back at once)."""

    def __init__(self, comm):
        import mps_timing as cc

        self.cc = cc
        self.barrier = cc.DeviceBarrier(comm)
        self.nodes = comm.num_nodes
        self.link_gbs = (cc.host_link_gbs if self.nodes > 1 else cc.device_link_gbs)(comm, self.barrier)
        # issue 25: between nodes fraction_of_bound >= 0.80 (one rank a node) / 0.70, speedup >= 1.0
        self.goal_speedup = SHARED_GOAL_SPEEDUP if self.nodes == 1 else 1.0
        self.goal_fraction = None if self.nodes == 1 else 0.80 if comm.local_size == 1 else 0.70

    def row(self, comm, shape, dt, mk, base, block, alone, block_bytes, err_mk, err_base, err_vs, correct,
            comm_sms):
        W, cc = comm.size, self.cc
        t_mk = cc.batch_ms(comm, self.barrier, mk)  # issue 25's rule: batches of cc.BATCH (50) calls
        t_base = cc.batch_ms(comm, self.barrier, base) if base is not None else None

        def computing():  # the local queries against every rank's block: W engine calls
            for _ in range(W):
                block()
        compute_blocks_ms = cc.batch_ms(comm, self.barrier, computing)
        compute_gathered_ms = cc.batch_ms(comm, self.barrier, alone)
        compute_ms = min(compute_blocks_ms, compute_gathered_ms)
        import mkernel

        cfg = mkernel.config.get()  # the default call with a knob flipped, interleaved with it (A/B, same run)
        changes = ({"comm_staged": not cfg.comm_staged}, cc.full_share_change(comm, "ring_attention"))
        variants = cc.interleaved_ms(comm, self.barrier, [("default", mk, {})] + [
            (",".join(f"{k}={v}" for k, v in c.items()), mk, c) for c in changes])
        sent = ((W - 1) if self.nodes == 1 else (self.nodes - 1)) * 2 * block_bytes
        link_ms = sent / (self.link_gbs * 1e9) * 1e3
        S, H, Hkv, D, causal = shape
        r = harness.row(list(shape), t_mk, t_base, max(compute_ms, link_ms), compute_ms=compute_ms,
                        compute_blocks_ms=compute_blocks_ms, compute_gathered_ms=compute_gathered_ms,
                        link_ms=link_ms, bytes_per_direction=sent, link_GBps=self.link_gbs, path="fused",
                        sms_per_rank=cc.sms_per_rank(), mps=True, world=W, nodes=self.nodes, dtype=dt.name,
                        comm_sms=comm_sms, rel_err_vs_baseline=err_vs, ref_rel_err_mkernel=err_mk,
                        ref_rel_err_baseline=err_base, correct=bool(correct), goal_speedup=self.goal_speedup,
                        variants_ms=variants,
                        goal_fraction_of_bound=self.goal_fraction,
                        name=f"{S} {H}/{Hkv} {D} {'causal' if causal else 'full'}")
        r["meets_speedup_goal"] = None if r["speedup"] is None else bool(r["speedup"] >= self.goal_speedup)
        # inside a node the goal is fusion never costing time: the fraction is reported only
        r["meets_fraction_goal"] = (None if self.goal_fraction is None
                                    else bool(r["fraction_of_bound"] >= self.goal_fraction))
        return r


TABLE = [("name", "S_local H_q/H_kv D mask", None), ("mkernel_ms", "mkernel ms", ".3f"),
         ("baseline_ms", "baseline ms", ".3f"), ("speedup", "speedup", ".3f"), ("goal_speedup", "goal", ".2f"),
         ("bound_ms", "bound ms", ".3f"), ("fraction_of_bound", "of bound", ".3f"),
         ("tflops_per_gpu", "TF/s/GPU", ".1f"), ("rel_err_vs_baseline", "err vs base", ".1e"),
         ("ref_rel_err_mkernel", "err vs ref", ".1e")]


def summary(rows, n_rows, W, shared, baseline_note, errors, path, seconds, mode=None):
    nodes = f", {mode.nodes} nodes" if mode is not None and mode.nodes > 1 else ""
    parts = [f"{W} ranks{nodes}" + (f" sharing a GPU under MPS (goal: speedup >= {mode.goal_speedup})" if mode
                                    else " sharing a GPU (speed not meaningful)" if shared else ""),
             f"{len(rows)}/{n_rows} rows"]
    for S, goal in GOAL_SPEEDUP.items():
        goal = mode.goal_speedup if mode else goal
        rs = [r for r in rows if r["shape"][0] == S]
        if not rs:
            continue
        if any(r["speedup"] is None for r in rs):
            parts.append(f"speedup at {S}: n/a ({baseline_note or 'no baseline'})")
            continue
        sp = ", ".join(f"{'causal' if r['shape'][4] else 'full'} {r['speedup']:.2f}x" for r in rs)
        met = all(r["speedup"] >= goal for r in rs)
        parts.append(f"speedup at {S}: {sp} (goal >= {goal:.2f}: {'met' if met else 'NOT met'})")
    if rows:
        if W == 1:
            parts.append("world 1: goals not applicable")
            rows_for_goal = []
        else:
            rows_for_goal = rows
        worst = min(rows, key=lambda r: r["fraction_of_bound"] or 0.0)
        below = [r for r in rows_for_goal if r["meets_fraction_goal"] is False]
        fgoal = GOAL_FRACTION if mode is None else mode.goal_fraction
        verdict = ("n/a at world 1" if W == 1 else "no goal under MPS in one node" if fgoal is None else "met"
                   if not below else f"NOT met on {len(below)} rows")
        parts.append(f"fraction of bound min {worst['fraction_of_bound']:.3f} at {worst['shape']} (goal >= "
                     f"{fgoal or GOAL_FRACTION:.2f} everywhere: {verdict})")
        wrong = [r for r in rows if not r["correct"]]
        parts.append(f"results {'correct' if not wrong else f'WRONG on {len(wrong)} rows'} (max rel err vs ref "
                     f"{max(r['ref_rel_err_mkernel'] for r in rows):.1e}"
                     + (f", vs baseline {max(r['rel_err_vs_baseline'] for r in rows):.1e}"
                        if all(r["rel_err_vs_baseline"] is not None for r in rows) else "") + ")")
    if errors:
        parts.append(f"{len(errors)} rows FAILED: {', '.join(errors)}")
    parts.append(f"{path}, {seconds:.0f} s")
    return "SUMMARY ring_attention: " + "; ".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"S_local {SEQ_QUICK} only, {QUICK_REPS} reps")
    ap.add_argument("--reps", type=int, default=harness.REPS)
    ap.add_argument("--seq", default=None, help="comma-separated S_local values (overrides --quick's)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--comm-sms", type=int, default=None, help="ring_attention's comm_sms (default: the op's)")
    ap.add_argument("--kv-heads", type=int, default=HEADS, help=f"key/value heads (of {HEADS} query heads)")
    ap.add_argument("--workspace-gb", type=float, default=4.0, help="symmetric workspace per rank (GiB)")
    ap.add_argument("--nodes", type=int, default=1, help="emulated nodes (gpus_per_node = ranks / nodes)")
    ap.add_argument("--transport", default="host", help="between emulated nodes: host, tcp or verbs")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args()

    import cupy
    import ml_dtypes

    import mkernel
    from mkernel.ops import tp

    harness.require_gpu("bench/ring_attention.py")
    t_start = time.time()
    from mpi4py import MPI

    if args.nodes < 1 or MPI.COMM_WORLD.size % args.nodes:
        sys.exit(f"bench/ring_attention.py: --nodes {args.nodes} does not divide the {MPI.COMM_WORLD.size} ranks")
    comm = mkernel.init(workspace_bytes=int(args.workspace_gb * (1 << 30)),
                        gpus_per_node=MPI.COMM_WORLD.size // args.nodes if args.nodes > 1 else None,
                        transport=args.transport if args.nodes > 1 else "auto")
    # The benchmark's own collectives (barriers, reductions, status) on a duplicate, so that they can
    # never be matched against a collective inside the op.
    comm.bench_mpi = comm.mpi.Dup()
    W, me = comm.size, comm.rank
    ring = importlib.import_module("mkernel.ops.ring_attention").ring_attention
    attention = importlib.import_module("mkernel.engines.attention").attention
    dt = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype(np.float16)
    reps = QUICK_REPS if args.quick else max(20, args.reps)
    seqs = tuple(int(s) for s in args.seq.split(",")) if args.seq else (SEQ_QUICK if args.quick else SEQ_FULL)
    shapes = [(S, c) for S in seqs for c in (False, True)]

    shared = not tp.gpus_distinct(comm)
    physical = len(set(comm.bench_mpi.allgather((comm.topology.host, comm.device_id))))
    baseline_note = None
    if W == 1:  # no ring: the op is the engine on one block, and the goals are about overlap
        baseline_note = ("world 1: there is no ring to overlap, so no baseline; the speedup and bound goals apply "
                         "at 2+ GPUs")
    elif comm.num_nodes > 1:  # GatherBaseline: the library's own transport, on any placement
        pass
    elif shared and not mps_client():  # MPS in one node: SymmetricExchange
        baseline_note = (f"the {W} ranks share {physical} GPU(s) time-sliced: NCCL needs one GPU per rank and "
                         "the symmetric-copy baseline runs under MPS only, so the baseline was "
                         "skipped (baseline_ms and speedup are null)")
    elif W > 1 and not shared:
        try:
            comm.nccl  # noqa: B018  (created collectively on first use)
        except Exception as e:  # noqa: BLE001
            baseline_note = f"NCCL is not usable ({type(e).__name__}: {e}); baseline skipped"
    have_baseline = baseline_note is None
    mode = SharedMode(comm) if shared and have_baseline and mps_client() else None  # issue 25's timing
    if me == 0:
        nsm = cupy.cuda.Device().attributes["MultiProcessorCount"]
        timing = f"median of {reps}"
        if mode:
            import mps_timing as cc

            timing = f"median of {cc.BATCHES} batches of {cc.BATCH} calls behind a device barrier (MPS)"
        print(f"# {W} ranks, {physical} GPU(s) ({harness.device_name()}, {nsm} SMs), {dt.name}, {timing}, "
              f"setup {time.time() - t_start:.1f} s", flush=True)
        print("# NO BASELINE: " + baseline_note if baseline_note else
              "# baseline: K/V all-gather over the transport, then the engine" if comm.num_nodes > 1 else
              "# baseline: mkernel.attention per KV block + fp32 LSE merge + ring exchange, no overlap", flush=True)
        print(f"# goals: speedup >= {mode.goal_speedup}" + (f", fraction_of_bound >= {mode.goal_fraction}"
                                                           if mode.goal_fraction else "") if mode else
              f"# goals: speedup >= {GOAL_SPEEDUP[4096]} at 4096, >= {GOAL_SPEEDUP[8192]} at 8192; "
              f"fraction_of_bound >= {GOAL_FRACTION} everywhere", flush=True)

    if args.comm_sms is None:  # recorded as the number that ran, not as "the op's default"
        args.comm_sms = mkernel.config.get().ring_comm_sms
    rows, errors = [], {}
    fatal = (mkernel.TimeoutError, mkernel.PeerError, mkernel.ClosedError)
    for i, (S, causal) in enumerate(shapes):
        name = f"{S} {'causal' if causal else 'full'}"
        err, is_fatal = None, False
        try:
            r = bench_row(comm, ring, attention, i, S, causal, dt, reps, have_baseline, args.comm_sms, shared=mode,
                          kv_heads=args.kv_heads)
        except Exception as e:  # noqa: BLE001  (report it; the other rows still run if the ranks are in step)
            r, err, is_fatal = None, f"{type(e).__name__}: {e}"[:400], isinstance(e, fatal)
        status = comm.bench_mpi.allgather((err, is_fatal))
        for rk, (e_, _) in enumerate(status):
            if e_ is not None:
                errors[f"{name} (rank {rk})"] = e_
        if any(e_ is not None for e_, _ in status):
            if me == 0:
                print(f"ERROR in {name}: " + "; ".join(f"rank {rk}: {e_}" for rk, (e_, _) in enumerate(status) if e_),
                      flush=True)
            if any(f for _, f in status) or not all(e_ is not None for e_, _ in status):
                if me == 0:
                    print("# stopping: the ranks may be out of step", flush=True)
                break
        else:
            rows.append(r)
            if me == 0:
                sp = f"{r['speedup']:.3f}x" if r["speedup"] is not None else "n/a"
                bl = "n/a" if r["baseline_ms"] is None else f"{r['baseline_ms']:9.3f} ms"
                print(f"{name:14s} mkernel {r['mkernel_ms']:9.3f} ms  baseline {bl}  speedup {sp}  "
                      f"bound {r['bound_ms']:9.3f} ms  of bound {r['fraction_of_bound']:.3f}  "
                      f"err vs ref {r['ref_rel_err_mkernel']:.1e}", flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
        comm.release_plans()  # every rank, same point (synchronises)

    if me == 0:
        nodes = comm.num_nodes
        if nodes > 1:
            baseline = ("K and V gathered by allgather_gemm's unfused path (the library's hierarchical all-gather "
                        "over the same transport), then mkernel.attention over the gathered sequence (causal: per "
                        "local query chunk over the global keys up to it), no overlap")
        else:
            baseline = ("mkernel.attention per KV block (causal: zigzag chunk pairs) + fp32 log-sum-exp merge "
                        "(CuPy) + " + ("a device copy into the next rank's symmetric slot and a device barrier"
                                       if mode else "NCCL send/recv") + " ring, one stream, no overlap")
        link = "host copy rate (device to host and back, every rank at once)" if nodes > 1 else "device copy rate"
        path = harness.write("ring_attention", rows, gpus=physical if shared else W, ranks_per_gpu=W // physical,
                             nodes=nodes, transport=(comm.stats()["proxy"] or args.transport) if nodes > 1 else
                             "nvlink", out_dir=args.out, reps=reps, errors=errors,
                             physical_gpus=physical, shared_gpu=shared, baseline_note=baseline_note,
                             baseline=baseline,
                             bound_definition=(
                                 "max(compute_ms: the less of world x mkernel.attention on the local block and the "
                                 "gathered baseline's engine calls alone, every rank at once; "
                                 f"link_ms: the bytes a rank must send over the {link})" if mode else
                                 "the less of world x mkernel.attention(q, k, v, causal=causal) on the local block and "
                                 "the gathered baseline's engine calls alone, with all SMs"),
                             goals=({"speedup": mode.goal_speedup, "fraction_of_bound": mode.goal_fraction} if mode
                                    else {"speedup": {str(s): g for s, g in GOAL_SPEEDUP.items()},
                                          "fraction_of_bound": GOAL_FRACTION}),
                             mps=bool(mode), kv_heads=args.kv_heads, comm_sms=args.comm_sms)
        harness.plot_rows(json.loads(path.read_text()), path.with_suffix(".png"))
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        print()
        print(harness.table(rows, TABLE))
        print()
        for r in rows:
            v = "n/a" if r["meets_speedup_goal"] is None else "met" if r["meets_speedup_goal"] else "NOT met"
            if r["goal_speedup"] is not None:
                print(f"goal speedup >= {r['goal_speedup']:.2f} at {r['name']}: {v}")
        for r in (r for r in rows if r["goal_fraction_of_bound"] is not None):
            print(f"goal fraction_of_bound >= {r['goal_fraction_of_bound']:.2f} at {r['name']}: "
                  f"{'met' if r['meets_fraction_goal'] else 'NOT met'} ({r['fraction_of_bound']:.3f})")
        print(summary(rows, len(shapes), W, shared, baseline_note, errors, rel, time.time() - t_start, mode),
              flush=True)
    comm.bench_mpi.Free()
    comm.close()


if __name__ == "__main__":
    main()
