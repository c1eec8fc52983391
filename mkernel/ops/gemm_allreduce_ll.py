"""gemm_allreduce's fused latency path (issue 26; kernels: mkernel/cuda/ops/gemm_allreduce_ll.cu):
inside a node, at most ``config.tp_latency_ll_max_rows`` rows and B as [N, K], the decode GEMM
pushes every finished value to every rank as an LL word (data and the launch's epoch in one 8-byte
store), while the rest of the GEMM runs; a second kernel waits for each word, adds the ranks' values
in rank order in fp32 and rounds once into out. The same sum, rounding and bits as the two-kernel
latency path (decode GEMM, then mkernel.allreduce) where mkernel.gemm takes the decode path
(``config.gemm_decode_max_m`` rows).

Workspace: the plan's own LL buffer, ``[world][ceil(M / 2)][N]`` words of 8 bytes (zeroed at the shape's
first call), and the decode GEMM's partials in the stream's workspace.

Importable without CuPy; the kernels are registered at import.
"""

import ctypes

from mkernel.core import config
from mkernel.engines import gemm as _gemm
from mkernel.engines import gemm_decode as _decode
from mkernel.ops import buffers, tp
from mkernel.runtime import compile as _compile
from mkernel.runtime import launch
from mkernel.runtime.arrays import row_stride
from mkernel.runtime.launch import Launch, launch_all
from mkernel.runtime.sync import MkSync

OP = "gemm_allreduce"
PUSH, REDUCE = "mk_gemm_allreduce_ll_push", "mk_allreduce_ll_reduce"
M_TILES = (8, 16, 32, 64, 128)  # the decode instantiations it pushes from
# Its decode GEMM's row block: 128 (at 2 ranks under MPS, 8192 x 4096, 64-row blocks took the path
# 48.5 -> 59.9 us from graphs while the engine rows stayed within 0.3 us: bench/NOTES.md session 28).
ROWS = 128
EXPRESSIONS = tuple(f"{PUSH}<{dt},{mt},{rows}>" for dt in (0, 1) for mt in M_TILES for rows in _decode.ROW_BLOCKS) + \
    tuple(f"{REDUCE}<{dt}>" for dt in (0, 1))
SPEC = _compile.register("gemm_allreduce_ll", "gemm_allreduce_ll.cu", EXPRESSIONS, hot=True)
REDUCE_THREADS = 512  # LL_REDUCE_THREADS
CNT_WORDS = 1  # LL_CNT_WORDS


class MkDecodePushArgs(ctypes.Structure):
    """Mirror of ``MkDecodePushArgs`` (mkernel/cuda/ops/gemm_allreduce_ll_args.cuh), 640 bytes (64-byte
    aligned in C: the padding makes the sizes equal)."""
    _fields_ = [("g", _decode.MkDecodeArgs), ("peer_base", ctypes.c_void_p), ("ll_off", ctypes.c_uint64),
                ("counters", ctypes.c_void_p), ("pairs", ctypes.c_int32), ("world", ctypes.c_int32),
                ("me", ctypes.c_int32), ("pad", ctypes.c_uint32 * 7)]


class MkAllreduceLLArgs(ctypes.Structure):
    """Mirror of ``MkAllreduceLLArgs`` (mkernel/cuda/ops/gemm_allreduce_ll_args.cuh), 136 bytes."""
    _fields_ = [("sync", MkSync), ("peer_base", ctypes.c_void_p), ("ll_off", ctypes.c_uint64),
                ("out", ctypes.c_void_p), ("counters", ctypes.c_void_p), ("ldo", ctypes.c_int64),
                ("m", ctypes.c_int32), ("n", ctypes.c_int32), ("pairs", ctypes.c_int32), ("world", ctypes.c_int32),
                ("me", ctypes.c_int32), ("pad", ctypes.c_uint32)]


def eligible(c) -> bool:
    """Whether a latency-path call (tp.Call) takes the fused kernels: B as [N, K], few rows."""
    return (c.layout == tp.B_NK and 1 <= c.M <= min(config.get().tp_latency_ll_max_rows, M_TILES[-1])
            and c.N <= _decode.MAX_N)


def run(comm, c, stream):
    """The two launches of one call (out, c.out, may have strided rows); returns them, their plan's
    key and the decode partials' buffer they use: (launches, plans, keep), for comm.plans' record."""
    W, dt, pairs = comm.size, c.a.dtype, -(-c.M // 2)
    plan_key = ("buffers", "gemm_allreduce_ll", c.M, c.N, dt.name)
    plan = buffers.plan_buffers("gemm_allreduce_ll", comm, plan_key, [("ll", (W, pairs, c.N, 2), "uint32")],
                                 {"counters": CNT_WORDS})
    sync = comm.sync_args(OP)
    rows = config.get().gemm_decode_rows or ROWS
    _, grid, block, g, buffer, smem = _decode.build(c.a, c.b, c.out, tp.DT[dt.name], M=c.M, N=c.N, K=c.K,
                                                     accumulate=False, sync=sync, rows=rows, staged_out=False,
                                                     partial=_gemm.workspace(stream).decode_partials)
    push = MkDecodePushArgs(g=g, peer_base=comm.peer_table.data.ptr, ll_off=comm.offset_of(plan["ll"]),
                            counters=plan["counters"].data.ptr, pairs=pairs, world=W, me=comm.local_rank)
    mt = _decode.m_tile(c.M)
    module = _compile.module(SPEC)
    red = MkAllreduceLLArgs(sync=sync, peer_base=push.peer_base, ll_off=push.ll_off, out=c.out.data.ptr,
                            counters=push.counters, ldo=row_stride(c.out) // dt.itemsize, m=c.M, n=c.N,
                            pairs=pairs, world=W, me=comm.local_rank)
    blocks = max(1, min(-(-c.N * pairs // REDUCE_THREADS), launch.sm_count()))
    launches = (Launch(module.function(f"{PUSH}<{tp.DT[dt.name]},{mt},{rows}>"), grid, block, push, smem),
                Launch(module.function(f"{REDUCE}<{tp.DT[dt.name]}>"), (blocks,), (REDUCE_THREADS,), red, 0,
                       config.get().tp_latency_ll_overlap))
    launch_all(launches, stream)
    return launches, (plan_key,), (buffer,)
