"""The decode GEMM: ``mkernel.gemm`` for few rows (tokens) against weights as stored ([N, K], read
as ``w.T``), bound by reading the weights once (kernel and K order: mkernel/cuda/engines/gemm_decode.cu).

``gemm`` takes this path by shape (:func:`eligible`: M up to ``config.gemm_decode_max_m``, B as
[N, K], none of the fused ops' controls). Each CTA covers 128 rows of B over one of ``splits``
ranges of K; with several, the last CTA of a row block adds the ranges' fp32 partials in range
order: bitwise reproducible run to run. The partials live in the stream's workspace (grown to a
call's need at its first call; launch plans keep the buffer they were built with alive).
"""

import ctypes

from mkernel.core import config
from mkernel.runtime import compile as _compile
from mkernel.runtime.arrays import DT

ROWS = 128  # MK_DECODE_ROWS: rows of B per CTA
THREADS = 256  # MK_DECODE_THREADS
RESIDENT = 2  # CTAs per SM (launch bounds)
M_TILES = (8, 16, 32, 64)  # token columns of the instantiations
MAX_M = 256  # tokens the path takes at most (config.gemm_decode_max_m picks up to this)
MAX_N = 65535 * ROWS  # rows of B: the row blocks are the grid's y dimension
MIN_SPLIT_K = 512  # elements of K a range keeps at least (its loads must still fill the pipe)
# The split of K is planned for this many SMs whatever the device has (H100 / H200: 132), so that
# the sums (their grouping by range) and the bits are the same on 66 SMs of an MPS share as on 132.
SPLIT_SMS = 132
OUT_F32 = 2


UNROLLS = {8: (8, 4), 16: (8, 4), 32: (8, 4), 64: (4, 2)}  # instantiated U per MT; the last the default


def unroll(mt: int) -> int:
    """U: 32-element steps of K in flight per lane (config.gemm_decode_unroll where instantiated
    for mt, else the shallower of the two, measured the faster: bench/NOTES.md)."""
    u = config.get().gemm_decode_unroll
    return u if u in UNROLLS[mt] else UNROLLS[mt][-1]


def kernel_expr(dt: int, out: int, mt: int, u: int) -> str:
    return f"mk_gemm_decode_kernel<{dt},{out},{mt},{u}>"


EXPRESSIONS = tuple(kernel_expr(dt, out, mt, u) for dt in (0, 1) for out in (dt, OUT_F32) for mt in M_TILES
                    for u in UNROLLS[mt])
SPEC = _compile.register("gemm_decode", "gemm_decode.cu", EXPRESSIONS, hot=True)


class MkDecodeArgs(ctypes.Structure):
    """Mirror of ``MkDecodeArgs`` (mkernel/cuda/engines/gemm_decode_args.cuh), 96 bytes."""
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("partial", ctypes.c_void_p), ("counts", ctypes.c_void_p), ("lda", ctypes.c_int64),
                ("ldb", ctypes.c_int64), ("ldc", ctypes.c_int64), ("m", ctypes.c_int32), ("n", ctypes.c_int32),
                ("k", ctypes.c_int32), ("splits", ctypes.c_int32), ("k_split", ctypes.c_int32),
                ("epi_op", ctypes.c_uint32), ("pad", ctypes.c_uint32 * 2)]


def knobs() -> tuple:
    """The config knobs that pick the decode path's kernel and grid (part of a launch plan's key)."""
    c = config.get()
    return c.gemm_decode_max_m, c.gemm_decode_group, c.gemm_decode_unroll, c.gemm_decode_waves


def eligible(M: int, N: int, layout_nk: bool, *, controls: bool) -> bool:
    """Whether ``gemm`` takes the decode path: few rows, weights as [N, K], no fused-op controls."""
    return layout_nk and not controls and 1 <= M <= min(config.get().gemm_decode_max_m, MAX_M) and N <= MAX_N


def m_tile(M: int) -> tuple:
    """(MT, groups): token columns per CTA and token groups (blockIdx.x, innermost). Up to 32
    tokens one CTA of the narrowest tile that holds them; above, groups of config.gemm_decode_group."""
    if M <= 32:
        return next(mt for mt in M_TILES if mt >= M), 1
    mt = config.get().gemm_decode_group
    return mt, -(-M // mt)


def split_k(N: int, K: int, mt: int, groups: int = 1) -> tuple:
    """(splits, k_split): enough ranges of K that the CTAs (row blocks x token groups x ranges)
    fill SPLIT_SMS SMs RESIDENT deep, each a multiple of the kernel's step and at least MIN_SPLIT_K
    long; a function of the shape (and config.gemm_decode_group) only."""
    step = 32 * unroll(mt)
    blocks = -(-N // ROWS) * groups
    want = max(1, (config.get().gemm_decode_waves * RESIDENT * SPLIT_SMS) // blocks)
    most = max(1, K // MIN_SPLIT_K)
    splits = min(want, most)
    k_split = -(-K // splits)
    k_split = -(-k_split // step) * step
    return -(-K // k_split), k_split


def build(a, b_arr, out, out_code, *, M, N, K, accumulate, partial):
    """(function, grid, args, buffer) of one launch. ``partial(nbytes, blocks)`` returns the
    stream's (partials, counts) buffer of at least that size (only called for splits > 1)."""
    mt, groups = m_tile(M)
    splits, k_split = split_k(N, K, mt, groups)
    blocks = -(-N // ROWS)
    args = MkDecodeArgs()
    args.a, args.b, args.out = a.data.ptr, b_arr.data.ptr, out.data.ptr
    args.lda = (a.strides[0] if M > 1 else K * a.itemsize) // a.itemsize
    args.ldb = (b_arr.strides[0] if N > 1 else K * b_arr.itemsize) // b_arr.itemsize
    args.ldc = (out.strides[0] if M > 1 else N * out.itemsize) // out.itemsize
    args.m, args.n, args.k, args.splits, args.k_split = M, N, K, splits, k_split
    args.epi_op = 1 if accumulate else 0
    buffer = None
    if splits > 1:
        buffer = partial(splits * M * N * 4, blocks * groups)
        args.partial, args.counts = buffer.partial_ptr, buffer.counts_ptr
    fn = _compile.module(SPEC).function(kernel_expr(DT[a.dtype.name], out_code, mt, unroll(mt)))
    return fn, (groups, blocks, splits), args, buffer


class Partials:
    """A stream's buffer of the split ranges: fp32 partials, then the row blocks' arrival counts
    (zero between launches: the last CTA of a block resets its count)."""

    def __init__(self, nbytes: int, blocks: int):
        import cupy

        self.nbytes, self.blocks = nbytes, blocks
        counts_at = -(-nbytes // 256) * 256
        self.mem = cupy.zeros(counts_at + 4 * blocks, dtype=cupy.uint8)
        self.partial_ptr = self.mem.data.ptr
        self.counts_ptr = self.mem.data.ptr + counts_at

    def fits(self, nbytes: int, blocks: int) -> bool:
        return nbytes <= self.nbytes and blocks <= self.blocks
