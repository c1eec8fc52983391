"""Device-array helpers the GPU tests share: host <-> device copies that also work where CuPy lacks
bfloat16 transfers or casts, raw bits, and NaN-poisoned outputs (poison every output before a run)."""

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"bf16": BF16, "fp16": np.dtype(np.float16)}
NAN_BITS = {"bf16": (np.uint16, 0x7FC0), "fp16": (np.uint16, 0x7E00), "f32": (np.uint32, 0x7FC00000)}


def dev(x):
    """A NumPy array on the device (contiguous)."""
    import cupy

    x = np.ascontiguousarray(x)
    try:
        return cupy.asarray(x)
    except Exception:  # noqa: BLE001  (a CuPy without bfloat16 transfers)
        return cupy.asarray(x.view(np.uint16)).view(x.dtype)


def host(x):
    import cupy

    try:
        return cupy.asnumpy(x)
    except Exception:  # noqa: BLE001
        return cupy.asnumpy(x.view(cupy.uint16)).view(x.dtype)


def bits(x):
    """The raw bits of a device array, on the host (uint16 for 16-bit data, uint32 for float32)."""
    import cupy

    return cupy.asnumpy(x.view(cupy.uint16 if x.dtype.itemsize == 2 else cupy.uint32))


def f32(x):
    """A device bf16 / fp16 array as float32 (on the device)."""
    import cupy

    try:
        return x.astype(cupy.float32)
    except Exception:  # noqa: BLE001  (a CuPy without bfloat16 casts: do it on the bits)
        return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)


def kind(dt):
    dt = np.dtype(dt)
    return "bf16" if dt == BF16 else "fp16" if dt == np.float16 else "f32"


def poison(x):
    """Fills a device bf16 / fp16 / float32 array (a view too) with NaN."""
    word, nan = NAN_BITS[kind(x.dtype)]
    x.view(word).fill(nan)


def poisoned(shape, kind_):
    """A new device array of kind 'bf16', 'fp16' or 'f32', filled with NaN."""
    import cupy

    out = cupy.empty(shape, dtype={"bf16": BF16, "fp16": np.float16, "f32": np.float32}[kind_])
    poison(out)
    return out
