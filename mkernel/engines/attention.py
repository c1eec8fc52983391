"""The Hopper attention engine (forward): ``attention`` (design: docs/ATTENTION.md).

A persistent, warp-specialized kernel (``mkernel/cuda/engines/attention.cu``): a TMA producer warpgroup
streams Q once per tile and K, V blocks through a 2-stage ring; two consumer warpgroups each own
64 query rows of a 128-row tile and run Q K^T (wgmma from shared memory), the online softmax in
registers and P V (wgmma with P from registers), overlapped inside a warpgroup (the next block's
Q K^T with this block's softmax) and between the two (ping-pong turns at the tensor cores).
Tiles are (batch, head, 128-query block), claimed dynamically; ``sms`` bounds the CTAs, so a fused
kernel (ring attention) can keep other SMs for communication.

Layout: q ``[S_q, H_q, D]`` or ``[B, S_q, H_q, D]``; k, v ``[S_kv, H_kv, D]`` or
``[B, S_kv, H_kv, D]``; out as q. D is 64 or 128; H_q a multiple of H_kv (grouped-query
attention: query head h reads kv head h // (H_q // H_kv)). The last dim is contiguous; other
strides are positive multiples of 16 bytes; bases 16-byte aligned (what TMA can address).
Causal masking: query i sees key j iff j <= i + causal_offset, default S_kv - S_q (bottom-right
alignment, as FlashAttention >= 2.1); a row that sees no key gets 0 and a log-sum-exp of -inf.
"""

import ctypes
import logging
import math

from mkernel.core.errors import ArgumentError
from mkernel.engines.gemm import MkGemmSched, _check_device, _num_sms
from mkernel.engines.gemm import workspace as _gemm_workspace
from mkernel.runtime import compile as _compile
from mkernel.runtime import tma as _tma
from mkernel.runtime.arrays import DT, as_cupy, cupy_mod
from mkernel.runtime.launch import PlanCache, launch
from mkernel.runtime.sync import MkSync

log = logging.getLogger("mkernel.engines.attention")

BLOCK_M, BLOCK_N = 128, 128  # query rows per tile, keys per block (AttnCfg)
THREADS = 384
HEAD_DIMS = (64, 128)
# Dynamic shared memory per head dim (attention.cu static_asserts them).
SMEM = {128: 197848, 64: 99544}
LOG2E = 1.4426950408889634


def kernel_expr(dt: int, d: int, causal: bool) -> str:
    return f"mk_attention_kernel<{dt},{d},{'true' if causal else 'false'}>"


EXPRESSIONS = tuple(kernel_expr(dt, d, c) for dt in (0, 1) for d in HEAD_DIMS for c in (False, True))
SPEC = _compile.register("attention", "attention.cu", EXPRESSIONS, hot=True)


class MkAttnPos(ctypes.Structure):
    """Global position of local index i: ``i + (off0 if i < half else off1)`` (attn_args.cuh)."""
    _fields_ = [("half", ctypes.c_int32), ("off0", ctypes.c_int32), ("off1", ctypes.c_int32),
                ("pad", ctypes.c_int32)]


ONE_SEGMENT = 2 ** 31 - 1  # MkAttnPos.half of a single segment


def positions(offset: int) -> MkAttnPos:
    """One segment: index i sits at position i + offset."""
    return MkAttnPos(ONE_SEGMENT, offset, offset, 0)


class MkAttnArgs(ctypes.Structure):
    # 64-byte aligned in C (TmaDesc); 704 bytes, a multiple of 64, so no tail padding.
    _fields_ = [("q", _tma.TensorMap), ("k", _tma.TensorMap), ("v", _tma.TensorMap), ("o", _tma.TensorMap),
                ("sync", MkSync), ("sched", MkGemmSched), ("lse", ctypes.c_void_p),
                ("batch", ctypes.c_int32), ("heads_q", ctypes.c_int32), ("heads_kv", ctypes.c_int32),
                ("seq_q", ctypes.c_int32), ("seq_kv", ctypes.c_int32), ("q_blocks", ctypes.c_uint32),
                ("scale_log2", ctypes.c_float), ("scale", ctypes.c_float),
                ("qpos", MkAttnPos), ("kpos", MkAttnPos)]


def _as4d(x, what):
    if x.ndim == 3:
        return x[None]
    if x.ndim == 4:
        return x
    raise ArgumentError(f"{what} must be [S, H, D] or [B, S, H, D]; got shape {x.shape}")


def _check_tma_layout(x, what):
    """x: 4-D [B, S, H, D]. Contiguous head dim, 16-byte multiples elsewhere, aligned base."""
    if x.strides[3] != x.itemsize:
        raise ArgumentError(f"{what}'s last (head) dimension must be contiguous; got strides {x.strides}")
    for axis, name in ((0, "batch"), (1, "sequence"), (2, "head")):
        if x.shape[axis] > 1 and (x.strides[axis] <= 0 or x.strides[axis] % 16):
            raise ArgumentError(f"{what}'s {name} stride must be a positive multiple of 16 bytes; got "
                                f"strides {x.strides}")
    if x.data.ptr % 16:
        raise ArgumentError(f"{what} must start at a 16-byte aligned address; got 0x{x.data.ptr:x}")


def _tensor_map(x, rows_box):
    """[B, S, H, D] -> a 4-D map {D, S, H, B} with a {64, rows_box, 1, 1} box."""
    tdt = _tma.DTYPE_BFLOAT16 if x.dtype.name == "bfloat16" else _tma.DTYPE_FLOAT16
    B, S, H, D = x.shape
    strides = tuple(x.strides[a] if x.shape[a] > 1 else 16 for a in (1, 2, 0))  # a unit dim's stride is unused
    return _tma.encode_tiled(tdt, x.data.ptr, (D, S, H, B), strides, (64, rows_box, 1, 1))


def _check(cupy, q, k, v, out, causal_offset, sms):
    if q.ndim != k.ndim or k.ndim != v.ndim:
        raise ArgumentError(f"q, k, v must have the same rank; got shapes {q.shape}, {k.shape}, {v.shape}")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ArgumentError(f"q, k, v must have the same dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype.name not in DT:
        raise ArgumentError(f"attention takes bfloat16 or float16; got {q.dtype}")
    q4, k4, v4 = _as4d(q, "q"), _as4d(k, "k"), _as4d(v, "v")
    B, Sq, Hq, D = q4.shape
    if k4.shape != v4.shape:
        raise ArgumentError(f"k and v must have the same shape; got {k.shape} and {v.shape}")
    Bk, Skv, Hkv, Dk = k4.shape
    if Bk != B:
        raise ArgumentError(f"q and k/v must have the same batch size; got {B} and {Bk}")
    if Dk != D:
        raise ArgumentError(f"q and k/v must have the same head dim; got {D} and {Dk}")
    if D not in HEAD_DIMS:
        raise ArgumentError(f"head dim must be one of {HEAD_DIMS}; got {D}")
    if Hkv == 0 or Hq % Hkv:
        raise ArgumentError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
    if Sq == 0 or Skv == 0 or B == 0:
        raise ArgumentError(f"empty attention: batch {B}, {Sq} queries, {Skv} keys")
    if max(Sq, Skv) >= 2 ** 31 or B * Hq * Sq >= 2 ** 31:
        raise ArgumentError("sequence too long for 32-bit indices")
    for x, name in ((q4, "q"), (k4, "k"), (v4, "v")):
        _check_tma_layout(x, name)
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ArgumentError(f"out must have q's shape {q.shape} and dtype {q.dtype}; got {out.shape} {out.dtype}")
        _check_tma_layout(_as4d(out, "out"), "out")
    if causal_offset is not None and not -(2 ** 31) <= int(causal_offset) < 2 ** 31:
        raise ArgumentError(f"causal_offset {causal_offset} out of the 32-bit range")
    if sms is not None and not 1 <= int(sms) <= _num_sms():
        raise ArgumentError(f"sms must be 1..{_num_sms()}; got {sms}")
    return q4, k4, v4


# Launch plans of attention() calls that passed `out` and no lse (launch.PlanCache).
_plans = PlanCache()


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, out=None, stream=None,
              causal_offset=None, sms=None):
    """Softmax attention forward: ``out[b, i, h] = sum_j softmax_j(scale * q[b, i, h] . k[b, j, hk]) v[b, j, hk]``.

    q: ``[S_q, H_q, D]`` or ``[B, S_q, H_q, D]``; k, v: ``[S_kv, H_kv, D]`` or ``[B, S_kv, H_kv, D]``
    (CuPy arrays, or any GPU array with ``__dlpack__`` / ``__cuda_array_interface__``); bfloat16 or float16;
    D in (64, 128); H_q % H_kv == 0 (hk = h // (H_q // H_kv)).
    causal: query i sees key j iff ``j <= i + causal_offset`` (default ``S_kv - S_q``).
    softmax_scale: default ``1 / sqrt(D)``. out: optional, q's shape and dtype.
    sms: CTAs of the persistent kernel (default: all SMs, at most one per tile).
    Returns out, or ``(out, lse)`` with return_lse: lse float32 ``[B, H_q, S_q]`` (``[H_q, S_q]``
    for 3-D inputs), the natural-log log-sum-exp of the scaled scores of each row.
    """
    cupy = cupy_mod()
    _check_device(cupy)
    s = stream if stream is not None else cupy.cuda.get_current_stream()
    key = None
    if out is not None and not return_lse and all(isinstance(x, cupy.ndarray) for x in (q, k, v, out)):
        key = (cupy.cuda.runtime.getDevice(), s.ptr, bool(causal), softmax_scale, causal_offset, sms) + tuple(
            (x.data.ptr, x.shape, x.strides, x.dtype.str) for x in (q, k, v, out))
        if _plans.launch(key, stream):
            return out

    q, k, v = (as_cupy(x, name, stream=stream) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    if out is not None:
        out = as_cupy(out, "out", stream=stream)
    q4, k4, v4 = _check(cupy, q, k, v, out, causal_offset, sms)
    B, Sq, Hq, D = q4.shape
    _, Skv, Hkv, _ = k4.shape
    if out is None:
        out = cupy.empty(q.shape, dtype=q.dtype)
    o4 = _as4d(out, "out")
    lse = cupy.empty((B, Hq, Sq), dtype=cupy.float32) if return_lse else None
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(D)
    offset = int(causal_offset) if causal_offset is not None else Skv - Sq
    offset = max(-(2 ** 30), min(2 ** 30, offset))  # beyond this every or no key is visible: same result

    q_blocks = -(-Sq // BLOCK_M)
    num_tiles = B * Hq * q_blocks
    ws = _gemm_workspace(stream)
    args = MkAttnArgs()
    args.q = _tensor_map(q4, BLOCK_M)
    args.k = _tensor_map(k4, BLOCK_N)
    args.v = _tensor_map(v4, BLOCK_N)
    args.o = _tensor_map(o4, 64)
    args.sync = ws.sync_state.args("attention")
    args.sched = MkGemmSched(None, ws.base + ws.COUNTER, ws.base + ws.DONE, None, num_tiles, 0, 0, 0)
    args.lse = lse.data.ptr if lse is not None else None
    args.batch, args.heads_q, args.heads_kv, args.seq_q, args.seq_kv = B, Hq, Hkv, Sq, Skv
    args.qpos, args.kpos = positions(offset), positions(0)
    args.scale, args.scale_log2 = scale, scale * LOG2E
    args.q_blocks = q_blocks
    grid = min(int(sms) if sms is not None else _num_sms(), num_tiles)
    fn = _compile.module(SPEC).function(kernel_expr(DT[q.dtype.name], D, bool(causal)))

    launched = launch(fn, (grid,), (THREADS,), args, smem=SMEM[D], stream=stream)
    if key is not None:
        _plans.add(key, (fn, (grid,), (THREADS,), args, SMEM[D]), launched)
    if return_lse:
        return out, (lse[0] if q.ndim == 3 else lse)
    return out


def check(stream=None) -> None:
    """Raises the error (mkernel.TimeoutError) an attention launch on this stream recorded, if any."""
    _gemm_workspace(stream).check()


def reference(q, k, v, *, causal=False):
    """Plain attention in q's precision (float64 NumPy or float32 CuPy arrays, the array module of
    q): q ``[S_q, H_q, D]``, k / v ``[S_kv, H_kv, D]``, the engine's causal rule with the default
    offset. For checks (the sanitizer target, the main job), not for speed."""
    import numpy

    xp = numpy if isinstance(q, numpy.ndarray) else cupy_mod()
    Sq, Hq, D = q.shape
    Skv, Hkv, _ = k.shape
    kh = xp.repeat(k.transpose(1, 2, 0), Hq // Hkv, axis=0)  # [H_q, D, S_kv]
    vh = xp.repeat(v.transpose(1, 0, 2), Hq // Hkv, axis=0)  # [H_q, S_kv, D]
    s = q.transpose(1, 0, 2) @ kh / math.sqrt(D)
    if causal:
        s = xp.where(xp.arange(Skv)[None, None, :] <= xp.arange(Sq)[None, :, None] + Skv - Sq, s, -xp.inf)
    m = s.max(-1, keepdims=True)
    p = xp.exp(s - xp.where(xp.isfinite(m), m, 0))
    denom = p.sum(-1, keepdims=True)
    return (p @ vh / xp.where(denom > 0, denom, 1)).transpose(1, 0, 2)
