"""Accepting arrays from any GPU framework, and checking them before anything launches.

Inputs may be CuPy arrays or anything with ``__dlpack__`` (JAX, Numba, ...) or
``__cuda_array_interface__``; outputs are CuPy arrays. DLPack's stream handshake is honoured: the
producer is told the stream the op will run on, so it orders its pending work before ours.
mkernel ops launch kernels themselves and therefore cannot run inside ``jax.jit``; call them on
concrete JAX arrays.
"""

import numpy as np

from mkernel.core.errors import ArgumentError, NoGPUError

FLOAT16 = np.dtype(np.float16)
HALF_NAMES = ("bfloat16", "float16")  # the kernels' input dtypes, by NumPy name
DT = {"bfloat16": 0, "float16": 1}  # the kernels' input dtype codes by NumPy name (MK_DT_*, wgmma.cuh)


def __getattr__(name):
    """BFLOAT16 (ml_dtypes' bfloat16) and HALF_TYPES on first use: importing ml_dtypes takes ~0.6 s,
    which every rank of every job paid in ``import mkernel``; None / float16 only without it."""
    if name not in ("BFLOAT16", "HALF_TYPES"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import ml_dtypes
        bf16 = np.dtype(ml_dtypes.bfloat16)
    except ImportError:  # ml_dtypes is a dependency; keep import-time failure out of CPU-only tools
        bf16 = None
    globals().update(BFLOAT16=bf16, HALF_TYPES=tuple(d for d in (bf16, FLOAT16) if d is not None))
    return globals()[name]


def cupy_mod():
    """CuPy, imported when an op first runs; NoGPUError where it is not installed."""
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise NoGPUError("mkernel's GPU ops need CuPy (cupy-cuda13x)") from e
    return cupy


def as_cupy(x, name: str, *, stream=None):
    """``x`` as a CuPy array on the current device, without a copy."""
    import cupy

    if isinstance(x, cupy.ndarray):
        arr = x
    elif hasattr(x, "__dlpack__"):
        if isinstance(x, np.ndarray):
            raise ArgumentError(f"{name} is a NumPy array in host memory; move it to the GPU (cupy.asarray)")
        try:
            with stream if stream is not None else cupy.cuda.get_current_stream():
                arr = cupy.from_dlpack(x)
        except Exception as e:
            raise ArgumentError(f"{name} could not be imported through DLPack ({e}); is it on a CUDA GPU?") from e
    elif hasattr(x, "__cuda_array_interface__"):
        arr = cupy.asarray(x)
    else:
        raise ArgumentError(f"{name} must be a GPU array (CuPy, JAX, Numba, or anything with __dlpack__ or "
                            f"__cuda_array_interface__); got {type(x).__name__}")
    dev = cupy.cuda.runtime.getDevice()
    if arr.device.id != dev:
        raise ArgumentError(f"{name} is on GPU {arr.device.id} but this rank runs on GPU {dev}")
    return arr


def row_stride(x) -> int:
    """Bytes between rows of a 2-D array (its row length when it has one row: any stride is valid)."""
    return x.strides[0] if x.shape[0] > 1 else x.shape[1] * x.itemsize


def _dtype_names(dtypes):
    return dtypes if dtypes is HALF_NAMES else tuple(d if isinstance(d, str) else np.dtype(d).name for d in dtypes)


def check_matrix(arr, name: str, dtypes=HALF_NAMES, shape=None):
    """A 2-D array of one of ``dtypes`` (dtypes or their names; None: any) whose rows are contiguous,
    16-byte aligned and 16-byte strided; ``shape`` entries may be None. A stride along an axis of
    length 1 is never used, so it is not checked."""
    if arr.ndim != 2:
        raise ArgumentError(f"{name} must be 2-D, got shape {tuple(arr.shape)}")
    if dtypes is not None and arr.dtype.name not in (names := _dtype_names(dtypes)):
        raise ArgumentError(f"{name} has dtype {arr.dtype}; expected one of {list(names)}")
    if shape is not None:
        for axis, (got, want) in enumerate(zip(arr.shape, shape)):
            if want is not None and got != want:
                raise ArgumentError(f"{name} has shape {tuple(arr.shape)}; axis {axis} must be {want}")
    if arr.shape[0] == 0:  # no rows (a rank without tokens): no strides or address to check
        return arr
    if (arr.shape[1] > 1 and arr.strides[1] != arr.itemsize) or \
            (arr.shape[0] > 1 and (arr.strides[0] <= 0 or arr.strides[0] % 16)):
        raise ArgumentError(f"{name} must be row-major with rows 16-byte aligned (strides {arr.strides}); "
                            f"pass a contiguous copy (cupy.ascontiguousarray)")
    if arr.data.ptr % 16:
        raise ArgumentError(f"{name} must start on a 16-byte boundary")
    return arr
