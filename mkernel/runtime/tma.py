"""TMA tensor maps: ``cuTensorMapEncodeTiled`` from ``libcuda.so.1`` through cffi, cached.

CuPy does not wrap the tensor-map API, so the driver entry point is called directly, through the
cffi extension ``mkernel.verbs._proxy`` (``mk_cuda_tensor_map_encode_tiled`` in
``mkernel/verbs/cuda_dl.c``, which loads libcuda with dlopen on first use). A tensor map
is 128 opaque bytes that a kernel receives inside its argument struct (``TmaDesc`` in
``mkernel/cuda/engines/gemm_args.cuh``, 64-byte aligned). Encoding is a host-only computation (no stream,
no synchronisation); the results are cached by every argument, the global address included, so a
GEMM called again on the same buffers (weights, workspaces, benchmark loops) reuses them.

The rules TMA imposes, checked here before the driver is asked (its own error is a bare
CUDA_ERROR_INVALID_VALUE): the global address is 16-byte aligned; every stride (bytes, of the
dimensions after the innermost) is a multiple of 16 and below 2**40; dimensions are 1..2**32; box
sizes are 1..256; with 128-byte swizzle the inner box extent is at most 128 bytes.
"""

import ctypes
import threading
from collections import OrderedDict

from mkernel.core.errors import ArgumentError, NoGPUError
from mkernel.runtime.extension import proxy_ext

# CUtensorMapDataType
DTYPE_UINT8, DTYPE_UINT16, DTYPE_UINT32 = 0, 1, 2
DTYPE_FLOAT16, DTYPE_FLOAT32, DTYPE_BFLOAT16 = 6, 7, 9
# CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapInterleave, CUtensorMapFloatOOBfill
SWIZZLE_NONE, SWIZZLE_32B, SWIZZLE_64B, SWIZZLE_128B = 0, 1, 2, 3
L2_NONE, L2_64B, L2_128B, L2_256B = 0, 1, 2, 3
INTERLEAVE_NONE = 0
OOB_FILL_ZERO = 0

_ELEM_BYTES = {DTYPE_UINT8: 1, DTYPE_UINT16: 2, DTYPE_UINT32: 4, DTYPE_FLOAT16: 2, DTYPE_FLOAT32: 4,
               DTYPE_BFLOAT16: 2}
_SWIZZLE_BYTES = {SWIZZLE_NONE: None, SWIZZLE_32B: 32, SWIZZLE_64B: 64, SWIZZLE_128B: 128}


class TensorMap(ctypes.Structure):
    """The 128-byte CUtensorMap (mirrors ``TmaDesc``)."""
    _fields_ = [("v", ctypes.c_uint64 * 16)]


def dtype_code(dtype) -> int:
    """CUtensorMapDataType of a NumPy/CuPy dtype (bfloat16 is ml_dtypes' dtype)."""
    import numpy

    dt = numpy.dtype(dtype)
    if dt == numpy.float16:
        return DTYPE_FLOAT16
    if dt == numpy.float32:
        return DTYPE_FLOAT32
    if dt.name == "bfloat16":
        return DTYPE_BFLOAT16
    raise ArgumentError(f"no TMA data type for dtype {dt}")




def check_tiled(dtype: int, ptr: int, dims, strides, box, swizzle: int) -> None:
    """Raises ArgumentError when TMA cannot address this tensor (see the module docstring)."""
    esize = _ELEM_BYTES[dtype]
    if ptr % 16:
        raise ArgumentError(f"TMA needs a 16-byte aligned base address; got 0x{ptr:x}")
    if not 1 <= len(dims) <= 5 or len(strides) != len(dims) - 1 or len(box) != len(dims):
        raise ArgumentError("TMA tensor rank must be 1..5 with rank-1 strides and rank box sizes")
    for d in dims:
        if not 1 <= d <= 1 << 32:
            raise ArgumentError(f"TMA dimension {d} out of range 1..2**32 (dims {tuple(dims)})")
    for s in strides:
        if s % 16 or not 0 < s < 1 << 40:
            raise ArgumentError(
                f"TMA strides must be positive multiples of 16 bytes below 2**40; got {tuple(strides)} bytes "
                f"(a row of {dims[0]} elements of {esize} bytes): the row length must be a multiple of "
                f"{16 // esize} elements")
    for b in box:
        if not 1 <= b <= 256:
            raise ArgumentError(f"TMA box sizes must be 1..256; got {tuple(box)}")
    sw = _SWIZZLE_BYTES[swizzle]
    if sw is not None and box[0] * esize > sw:
        raise ArgumentError(f"inner box of {box[0] * esize} bytes exceeds the {sw}-byte swizzle span")


_WHY_BYTES = 256  # MKP_MESSAGE_BYTES
_cache = OrderedDict()
_cache_lock = threading.Lock()
CACHE_SIZE = 512


def encode_tiled(dtype: int, ptr: int, dims, strides, box, swizzle: int = SWIZZLE_128B,
                 l2: int = L2_256B) -> TensorMap:
    """A tiled tensor map: dims and box innermost first, strides in bytes for dims 1.. (cached)."""
    key = (dtype, ptr, tuple(dims), tuple(strides), tuple(box), swizzle, l2)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    check_tiled(dtype, ptr, dims, strides, box, swizzle)
    rank = len(dims)
    ffi, lib, _ = proxy_ext()
    tmap = TensorMap()
    g_dims = ffi.new("unsigned long long[]", list(dims))
    g_strides = ffi.new("unsigned long long[]", list(strides) or [0])
    b_dims = ffi.new("unsigned[]", list(box))
    e_strides = ffi.new("unsigned[]", [1] * rank)
    why = ffi.new("char[]", _WHY_BYTES)
    rc = lib.mk_cuda_tensor_map_encode_tiled(ffi.cast("void *", ctypes.addressof(tmap)), dtype, rank,
                                             ffi.cast("void *", ptr), g_dims, g_strides, b_dims, e_strides,
                                             INTERLEAVE_NONE, swizzle, l2, OOB_FILL_ZERO, why, _WHY_BYTES)
    if rc < 0:
        raise NoGPUError(f"the CUDA driver cannot encode TMA tensor maps: {ffi.string(why).decode(errors='replace')}")
    if rc != 0:
        raise ArgumentError(f"cuTensorMapEncodeTiled failed with CUresult {rc} (dtype {dtype}, dims {tuple(dims)}, "
                            f"strides {tuple(strides)}, box {tuple(box)}, swizzle {swizzle}): "
                            f"{ffi.string(why).decode(errors='replace')}")
    with _cache_lock:
        _cache[key] = tmap
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return tmap


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()
