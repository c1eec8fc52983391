"""The decode GEMM: ``mkernel.gemm`` for few rows (tokens) against weights as stored ([N, K], read
as ``w.T``), bound by reading the weights once (kernel and protocol: mkernel/cuda/engines/gemm_decode.cuh).

``gemm`` takes this path by shape (:func:`eligible`: M up to ``config.gemm_decode_max_m``, B as
[N, K], none of the fused ops' controls). A CTA is 1 or 2 consumer warpgroups (64 or 128 rows of
B; wgmma against all the tokens) fed by a TMA producer warp; the
(row block, k-block) units are cut into equal runs, one per CTA, each row block in the same number
of runs (or stream-K: config.gemm_decode_split), a function of the shape only.
Row blocks shared by several CTAs are added from fp32 partials in a fixed order: bitwise
reproducible run to run and on any number of SMs. The partials live in the stream's workspace
(grown to a call's need at its first call; launch plans keep the buffer they were built with alive).
"""

import ctypes
import typing

from mkernel.core import config
from mkernel.runtime import compile as _compile
from mkernel.runtime import tma as _tma
from mkernel.runtime.arrays import DT, row_stride
from mkernel.runtime.sync import MkSync

BK = 64  # MK_DECODE_BK: elements of K per stage
ROW_BLOCKS = (64, 128)  # rows of B per CTA (ROWS / 64 consumer warpgroups and a producer warp)
# At 64-128 tokens 64-row blocks beat 128 where they fit the SMs: 3-10% on 8192 x 8192, 4096 x 14336
# and (under MPS) 8192 x 4096; 6% behind on 8192 x 28672, each CTA streaming A's 7 MB (sessions 41, 62)
ROWS64_MAX_K = 16384
M_TILES = (8, 16, 32, 64, 128, 256)  # token columns of the instantiations (wgmma's N)
MAX_M = M_TILES[-1]  # tokens the path takes at most (config.gemm_decode_max_m picks up to this)
MAX_N = 1 << 24  # rows of B: keeps the counts and the partials' index small
# The runs are planned for this many SMs whatever the device has (H100 / H200: 132), so that the
# sums (their grouping by CTA) and the bits are the same on 66 SMs of an MPS share as on 132.
SPLIT_SMS = 132
# B's L2 promotion: 128-byte requests (a box row), not 256 (the next k-block's half line fetched
# early): 1-128 tokens 0.5-2 us faster on every decode shape (bench/NOTES.md session 33).
B_L2 = _tma.L2_128B
# Past WIDE_M tokens the decode path needs most SMs to beat the engine (split K): at 128 tokens on
# 112 CTAs 39.1 us against 43.7 (14336 x 4096), on 80 CTAs 57.1 against 57.0 (10240 x 8192).
WIDE_M = 64
WIDE_MIN_CTAS = SPLIT_SMS * 3 // 4
OUT_F32 = 2
SMEM_LIMIT = 232448  # dynamic shared memory a CTA may opt in to (227 KiB)
TMA_OUT = 1  # MK_DECODE_TMA_OUT
# Below 32 token columns a block's 2-byte stores take 0.5 us and staging them measured 0.3-1.3%
# slower; at 64-128 the staged store is 1-3.5% faster (bench/NOTES.md session 63)
TMA_OUT_MIN_MT = 32


def threads(rows: int) -> int:
    """Threads of a CTA of `rows` rows (DecodeCfg::THREADS)."""
    return 2 * rows + 32


def smem_bytes(mt: int, rows: int, staged_out: bool = False) -> int:
    """Dynamic shared memory of an instantiation (DecodeCfg::SMEM, or ::SMEM_OUT with the staged
    store's room; the kernel records MK_ERR_INPUT when given less): 128 KiB of B in flight, the ring
    within 200 KiB; staged: then each consumer warp's mt tokens x 16 rows of 16-bit out."""
    b, stage = rows * BK * 2, (rows + mt) * BK * 2
    stages = (128 << 10) // b if (128 << 10) // b * stage <= 200 << 10 else (200 << 10) // stage
    ring = stages * stage + 16 * stages
    if not staged_out:
        return ring + 1024
    return -(-ring // 128) * 128 + (rows // 16) * mt * 32 + 1024


def out_staged(mt: int, rows: int) -> bool:
    """Whether the staged store is built (DecodeCfg::OUT_STAGED): from TMA_OUT_MIN_MT token columns,
    where its room fits beside the ring (227 KiB less 1 KiB)."""
    return mt >= TMA_OUT_MIN_MT and smem_bytes(mt, rows, True) + 1024 <= SMEM_LIMIT


def tma_out(out_code: int, mt: int, rows: int, accumulate: bool) -> bool:
    """Whether a finished block leaves by TMA stores (MK_DECODE_TMA_OUT): 16-bit outputs stored, not
    added, where the staged store is built. TMA can address out: gemm's check_matrix holds its rows
    16-byte aligned and strided, and from 32 columns it has more than one row."""
    return out_code != OUT_F32 and not accumulate and out_staged(mt, rows)


def kernel_expr(dt: int, out: int, mt: int, rows: int) -> str:
    return f"mk_gemm_decode_kernel<{dt},{out},{mt},{rows}>"


EXPRESSIONS = tuple(kernel_expr(dt, out, mt, rows) for dt in (0, 1) for out in (dt, OUT_F32) for mt in M_TILES
                    for rows in ROW_BLOCKS)
SPEC = _compile.register("gemm_decode", "gemm_decode.cu", EXPRESSIONS, hot=True)


class MkDecodeArgs(ctypes.Structure):
    """Mirror of ``MkDecodeArgs`` (mkernel/cuda/engines/gemm_decode_args.cuh), 576 bytes (the C
    struct is 64-byte aligned, its tensor maps; the padding makes the sizes equal)."""
    _fields_ = [("a_map", _tma.TensorMap), ("b_map", _tma.TensorMap), ("out_map", _tma.TensorMap), ("sync", MkSync),
                ("out", ctypes.c_void_p), ("partial", ctypes.c_void_p), ("counts", ctypes.c_void_p),
                ("ldc", ctypes.c_int64)] + \
               [(n, ctypes.c_int32) for n in ("m", "n", "k", "kblocks", "ctas", "slots")] + \
               [("epi_op", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("pad", ctypes.c_uint32 * 14)]


def knobs() -> tuple:
    """The config knobs that pick the decode path's kernel and grid (part of a launch plan's key)."""
    c = config.get()
    return c.gemm_decode_max_m, c.gemm_decode_rows, c.gemm_decode_split


def eligible(M: int, N: int, K: int, layout_nk: bool, *, controls: bool) -> bool:
    """Whether ``gemm`` takes the decode path: few rows, weights as [N, K], no fused-op controls; past
    WIDE_M rows only where its CTAs keep WIDE_MIN_CTAS SMs busy."""
    if not (layout_nk and not controls and 1 <= M <= min(config.get().gemm_decode_max_m, MAX_M) and N <= MAX_N):
        return False
    return M <= WIDE_M or runs(N, K, row_block(N, K, m_tile(M)))[0] >= WIDE_MIN_CTAS


def m_tile(M: int) -> int:
    """Token columns of the instantiation that takes M tokens: the narrowest that holds them."""
    return next(mt for mt in M_TILES if mt >= M)


def cta_of(x: int, units: int, ctas: int) -> int:
    """The CTA whose run holds unit x (decode_cta_of)."""
    return ((x + 1) * ctas - 1) // units


def runs(N: int, K: int, rows: int = 128) -> tuple:
    """(ctas, slots): CTAs, each an equal run of the (row block, k-block) units
    (together at most SPLIT_SMS, one per unit at most; config.gemm_decode_split "even": a multiple
    of the row blocks, so that each is cut alike), and the partial slots a row block may need (a
    run is at least units // ctas long, so a block meets at most ceil(kblocks / that) + 1 runs);
    a function of the shape and the knobs only."""
    kblocks, blocks = -(-K // BK), -(-N // rows)
    units = blocks * kblocks
    cap = SPLIT_SMS
    if config.get().gemm_decode_split == "even" and blocks <= cap:
        cap = blocks * (cap // blocks)  # every row block in cap // blocks runs
    ctas = min(units, cap)
    return ctas, min(ctas, -(-kblocks // (units // ctas)) + 1)


def row_block(N: int, K: int, mt: int = 8) -> int:
    """Rows of B per CTA (config.gemm_decode_rows, or by shape): 128, or below 64 token columns
    (mt) 64 where that makes every row block one CTA's (no reduction at the end) and 128 would not
    (561df40: 64 rows ahead only at N 8192, 1-32 tokens: bench/NOTES.md session 33); at 64 and 128
    columns 64 where its blocks fit the SMs, on as many CTAs, and K <= ROWS64_MAX_K (sessions 41, 62)."""
    if config.get().gemm_decode_rows:
        return config.get().gemm_decode_rows
    if mt in (64, 128) and K <= ROWS64_MAX_K and -(-N // 64) <= SPLIT_SMS and runs(N, K, 64)[0] >= runs(N, K)[0]:
        return 64
    if mt >= 64:
        return 128
    whole = [r for r in ROW_BLOCKS if runs(N, K, r)[0] == -(-N // r)]  # one run per block
    return 64 if whole == [64] else 128


class Built(typing.NamedTuple):
    """One launch of the decode kernel (``launch(fn, grid, block, args, smem=smem)``) and the
    partials' buffer it uses (None: no shared row block)."""
    fn: object
    grid: tuple
    block: tuple
    args: "MkDecodeArgs"
    buffer: object
    smem: int


def build(a, b_arr, out, out_code, *, M, N, K, accumulate, sync, partial, rows=None, staged_out=True) -> Built:
    """One launch. ``partial(nbytes, blocks)`` returns the stream's (partials, counts) buffer of at
    least that size (only called when row blocks are shared); rows: the row block (None: row_block's);
    staged_out: out may be stored by TMA (:func:`tma_out`; False for an epilogue of its own)."""
    mt = m_tile(M)
    rows = rows or row_block(N, K, mt)
    ctas, slots = runs(N, K, rows)
    blocks = -(-N // rows)
    tdt = _tma.DTYPE_BFLOAT16 if a.dtype.name == "bfloat16" else _tma.DTYPE_FLOAT16
    args = MkDecodeArgs()
    args.a_map = _tma.encode_tiled(tdt, a.data.ptr, (K, M), (row_stride(a),), (BK, mt))
    args.b_map = _tma.encode_tiled(tdt, b_arr.data.ptr, (K, N), (row_stride(b_arr),), (BK, rows), l2=B_L2)
    args.sync = sync
    args.out = out.data.ptr
    args.ldc = row_stride(out) // out.itemsize
    args.m, args.n, args.k, args.kblocks, args.ctas, args.slots = M, N, K, -(-K // BK), ctas, slots
    args.epi_op = 1 if accumulate else 0
    staged = staged_out and tma_out(out_code, mt, rows, accumulate)
    if staged:
        args.out_map = _tma.encode_tiled(tdt, out.data.ptr, (N, M), (row_stride(out),), (16, mt), _tma.SWIZZLE_NONE)
        args.flags = TMA_OUT
    buffer = None
    if slots > 1:
        buffer = partial(blocks * slots * mt * rows * 4, blocks)
        args.partial, args.counts = buffer.partial_ptr, buffer.counts_ptr
    fn = _compile.module(SPEC).function(kernel_expr(DT[a.dtype.name], out_code, mt, rows))
    return Built(fn, (ctas,), (threads(rows),), args, buffer, smem_bytes(mt, rows, staged))


class Partials:
    """A stream's buffer of the shared row blocks: fp32 partials, then the row blocks' arrival counts
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
