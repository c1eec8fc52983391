"""Expert parallelism between nodes: the exchange before the node's dispatch and the partial sums
after its combine (mkernel/cuda/ops/moe_nodes.cu; design: docs/MOE.md "Between nodes").

Ranks are node-major (rank = node * local + local rank) with the same number per node. Rank
(n, l) sends each other node j, through its rank (j, l), the bundle of its tokens that have a
pair on node j, once (rows, ids, weights); (j, l) then dispatches inside node j, over NVLink, its
own tokens and the ones it forwards as one list of virtual tokens, with moe.cu / moe_dispatch_gemm.cu
unchanged but for that list. Combine runs inside each node the same way, leaving per virtual token
the sum of its node's pairs (fp32, summed in fp32); the forwarded tokens' sums go back to their
ranks rounded to 16 bits (half the bytes), and each rank adds the nodes' sums in node order.

Not a public module: :mod:`mkernel.ops.moe` and :mod:`mkernel.ops.moe_gemm` call it when the communicator
spans nodes.
"""

import ctypes

from mkernel.comm import proxy as _proxy
from mkernel.core import config
from mkernel.core.errors import ArgumentError
from mkernel.engines import gemm as _gemm
from mkernel.ops import buffers as _buffers
from mkernel.runtime import compile as _compile
from mkernel.runtime import launch
from mkernel.runtime.arrays import DT, row_stride
from mkernel.runtime.launch import launch_persistent
from mkernel.runtime.sync import MkSync

MAX_NODES = 8       # MOE_MAX_NODES
MAX_PIECES = 8      # MOE_MAX_PIECES: WRITEs of a bundle's rows at most (config.moe_bundle_pieces)
MAX_WRITE_BYTES = 1 << 32  # a proxy command's size is 32 bits: a bundle's rows (a piece at most all of them), its sums
PART_BYTES = 2  # a bundle's node sums go back as 16-bit rows: the size of its rows
THREADS = 512       # MOE_NODE_THREADS
PF_WORDS = 120      # MOE_PF_WORDS: the plan's proxy flags
CNT_WORDS = 3       # MOE_NCNT_WORDS
FWD_SUM_TOKENS = 32  # MOE_FWD_SUM_TOKENS: virtual tokens per chunk of forwarded sums
VSEG_WORDS = MAX_NODES + (MAX_NODES - 1) * (MAX_PIECES + 1)  # MOE_VSEG_WORDS: segments, then their pieces
FWD_CELLS = (MAX_NODES - 1) * MAX_PIECES  # MOE_FWD_CELLS: a group of forwarded sums lies in one (piece, segment)
TOKENS_PER_CTA = 32  # the exchange stages a warp's 32 tokens per unit; CTAs beyond T / 32 idle
PARTIAL_TOKENS_PER_CTA = 16  # the final sums: a warp per token
EXCHANGE_MAX_CTAS = 64  # every CTA scans all T * k ids (cheap): more would only repeat that scan


def grow_words(E):
    """Words of a global count row (MOE_GROW_WORDS)."""
    return E + 2 + MAX_NODES


SPEC = _compile.register("moe_nodes", "moe_nodes.cu", ("mk_moe_exchange_kernel", "mk_moe_partials_kernel<0>",
                                                       "mk_moe_partials_kernel<1>"))


class MkMoeNodeArgs(ctypes.Structure):
    """Mirror of ``MkMoeNodeArgs`` (mkernel/cuda/ops/moe_nodes_args.cuh)."""
    _fields_ = [("sync", MkSync), ("peer_base", ctypes.c_void_p), ("queue", _proxy.QueueArgs),
                ("pflags", ctypes.c_void_p)] + \
               [(f"{n}_off", ctypes.c_uint64) for n in ("gcounts", "gcflag", "xsend", "dsend", "xrecv", "drecv",
                                                         "part", "precv")] + \
               [(n, ctypes.c_void_p) for n in ("x", "topk_ids", "topk_w", "out", "vids", "vw", "vseg", "slots",
                                               "verdict", "xepoch", "vown", "part_total", "counters")] + \
               [("ldx", ctypes.c_int64), ("ldo", ctypes.c_int64)] + \
               [(n, ctypes.c_int32) for n in ("T", "H", "k", "E", "e_local", "world", "me", "capacity", "node",
                                              "nodes", "local", "lrank", "fwd_rows", "sent", "pieces")]


def check_sizes(op, H, k, capacity):
    """Between nodes, before anything collective: a bundle's node sums (as its rows: 16-bit) fit
    one WRITE (32-bit sizes)."""
    R = fwd_rows(capacity, k)
    if R * H * PART_BYTES >= MAX_WRITE_BYTES:
        raise ArgumentError(f"{op}: between nodes a bundle of up to capacity / k = {R} tokens x H = {H} (its "
                            f"sums: {R * H * PART_BYTES} bytes) must stay under {MAX_WRITE_BYTES} bytes (one "
                            f"WRITE); pass a smaller capacity")


def fwd_rows(capacity, k):
    """Tokens of one bundle and virtual tokens of one rank: a rank's pairs (T * k, and its virtual
    tokens' * k) never exceed the capacity, or the call fails on every rank."""
    return max(1, capacity // k)


def buffer_sizes(W, N, H, dtype, k, E, capacity):
    """[(name, shape, dtype)] of the symmetric buffers between nodes (bench/moe.py sizes its
    workspace from it too)."""
    import numpy as np

    R = fwd_rows(capacity, k)
    u32, f32 = np.dtype(np.uint32), np.dtype(np.float32)
    return [("gcounts", (W * grow_words(E),), u32), ("gcflag", (W,), u32),
            ("xsend", ((N - 1) * R, H), dtype), ("dsend", ((N - 1) * R * 2 * k,), u32),
            ("xrecv", ((N - 1) * R, H), dtype), ("drecv", ((N - 1) * R * 2 * k,), u32),
            ("part", (R, H), f32), ("precv", ((N - 1) * R, H), dtype), ("fwdret", (MAX_PIECES,), u32)]


def plan(op, comm, H, dtype, k, E, capacity, scratch_start):
    """The symmetric buffers, local scratch and proxy flags between nodes of one (H, dtype, k, E,
    capacity), collective the first time; its scratch buffers start at ``scratch_start`` (past those of
    the node's plan, used in the same calls)."""
    import cupy

    N = comm.num_nodes
    R = fwd_rows(capacity, k)
    pieces = config.get().moe_bundle_pieces  # what crosses the network: the same on every rank
    key = ("buffers", "moe_nodes", H, dtype.name, k, E, capacity, scratch_start, pieces)
    comm.agree(key, "moe_bundle_pieces")
    sizes = buffer_sizes(comm.size, N, H, dtype, k, E, capacity)
    p = _buffers.plan_buffers(op, comm, key, sizes, {"counters": CNT_WORDS}, scratch_start=scratch_start)
    if "pflags" not in p:
        p.update(fwd_rows=R, pieces=pieces, vids=cupy.empty(R * k, dtype=cupy.int32),
                 vw=cupy.empty(R * k, dtype=cupy.float32),
                 vseg=cupy.zeros(VSEG_WORDS, dtype=cupy.uint32), slots=cupy.empty((N - 1) * R, dtype=cupy.int32),
                 verdict=cupy.zeros(1, dtype=cupy.uint32), xepoch=cupy.zeros(1, dtype=cupy.uint32),
                 vown=cupy.zeros(E // N, dtype=cupy.uint32),
                 part_total=cupy.zeros(MAX_NODES, dtype=cupy.uint32),
                 tile_order=cupy.zeros(-(-capacity // _gemm.BM) + E // comm.size, dtype=cupy.uint32),
                 fwdgrp=cupy.zeros(R // FWD_SUM_TOKENS + FWD_CELLS, dtype=cupy.uint32))
        cupy.cuda.runtime.deviceSynchronize()
        p["pflags"] = comm.proxy_flag_block(PF_WORDS)  # collective; peers signal them from their kernels
    return p


def args(comm, p, op, T, k, E, H, capacity) -> MkMoeNodeArgs:
    a = MkMoeNodeArgs()
    a.sync = comm.sync_args(op)
    a.peer_base = comm.peer_table.data.ptr
    base = p["pflags"].offset
    a.queue = comm.proxy_queue_args(flag_base=base)
    a.pflags = comm.proxy_flags[0] + 4 * base
    for n in ("gcounts", "gcflag", "xsend", "dsend", "xrecv", "drecv", "part", "precv"):
        setattr(a, f"{n}_off", comm.offset_of(p[n]))
    for n in ("vids", "vw", "vseg", "slots", "verdict", "xepoch", "vown", "part_total", "counters"):
        setattr(a, n, p[n].data.ptr)
    a.T, a.H, a.k, a.E = T, H, k, E
    a.e_local, a.world, a.me, a.capacity = E // comm.size, comm.size, comm.rank, capacity
    a.node, a.nodes, a.local, a.lrank = comm.node, comm.num_nodes, comm.local_size, comm.local_rank
    a.fwd_rows, a.pieces = p["fwd_rows"], p["pieces"]
    return a


def claim_order(words, tn, backward):
    """The fused GEMMs' tile ids in claim order from tile_order's words (M-tiles first): the host
    mirror of moe_tiles.cuh moe_tile_id (benchmarks time the grouped GEMM alone in that order)."""
    M, ids = len(words), []
    at = (lambda u: int(words[M - 1 - u])) if backward else (lambda u: int(words[u]))
    for pos in range(M * tn):
        u = pos // tn
        w = at(u)
        n, off = w >> 28, (w >> 24) & 15
        first = u - (n - 1 - off) if backward else u - off
        r = pos - first * tn
        ids.append((at(first + r % n) & 0xFFFFFF) * tn + r // n)
    return ids


def set_virtual(m, p, comm):
    """The node's dispatch / combine arguments (MkMoeArgs m) over the virtual tokens of plan p, and
    what the dispatch waits for: the forwarded rows' and the exchange's flush flags; the fused GEMMs'
    M-tile order, which the dispatch writes (docs/MOE.md "Overlap")."""
    m.vseg, m.nseg = p["vseg"].data.ptr, comm.num_nodes - 1
    m.xfwd, m.fwd_rows = p["xrecv"].data.ptr, p["fwd_rows"]
    m.topk_ids = p["vids"].data.ptr
    m.vown, m.xepoch, m.node = p["vown"].data.ptr, p["xepoch"].data.ptr, comm.node
    m.pieces = p["pieces"]
    m.tile_order, m.tile_m = p["tile_order"].data.ptr, _gemm.BM
    base = p["pflags"].offset
    m.queue = comm.proxy_queue_args(flag_base=base)
    m.pflags = comm.proxy_flags[0] + 4 * base


def set_sums(m, p, comm):
    """The fused GEMM + combine sends the forwarded tokens' sums itself (MkMoeArgs m; then
    partials(..., sent=True))."""
    m.part_off, m.precv_off, m.fwdret_off = (comm.offset_of(p[n]) for n in ("part", "precv", "fwdret"))
    m.send_sums, m.sums_group, m.fwdgrp = 1, config.get().moe_sums_group, p["fwdgrp"].data.ptr


def _launch(op, expr, a, ctas, stream):
    fn = _compile.module(SPEC).function(expr)
    launch_persistent(fn, (ctas,), (THREADS,), a, smem=0, stream=stream)


def exchange(d, p, stream):
    """The exchange of a checked dispatch call d (moe.Dispatch, its plan between nodes p), launched
    before the node's dispatch."""
    a = args(d.comm, p, d.op, d.T, d.k, d.E, d.H, d.capacity)
    a.x, a.ldx = d.x.data.ptr, row_stride(d.x) // d.x.itemsize
    a.topk_ids, a.topk_w = d.ids.data.ptr, d.w.data.ptr
    ctas = max(1, min(launch.sm_count(), EXCHANGE_MAX_CTAS, -(-d.T // TOKENS_PER_CTA)))
    _launch(d.op, "mk_moe_exchange_kernel", a, ctas, stream)


def partials(op, comm, handle, out, stream, sent=False):
    """After the node's combine (its sums in the plan's part): the nodes' sums of this rank's
    tokens into out [T, H]. sent: the combine (fused, set_sums) sent the forwarded tokens' sums."""
    p = handle._nodes
    a = args(comm, p, op, handle.T, handle.k, handle.E, handle.H, handle.capacity)
    a.out, a.ldo = out.data.ptr, row_stride(out) // out.itemsize
    a.sent = int(sent)
    ctas = max(1, min(launch.sm_count(), -(-handle.T // PARTIAL_TOKENS_PER_CTA)))
    _launch(op, f"mk_moe_partials_kernel<{DT[handle.dtype.name]}>", a, ctas, stream)
