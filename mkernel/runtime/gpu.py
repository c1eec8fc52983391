"""What GPUs this process sees, without raising when there are none."""

import os

from mkernel.core.errors import NoGPUError

REQUIRED_CC = (9, 0)


def device_count() -> int:
    """Visible CUDA devices; 0 when CuPy, the driver or a GPU is missing."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no cupy, no libcuda, no device: all mean 'no GPU' here
        return 0


def describe_missing() -> str:
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not importable ({e}); install cupy-cuda13x"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return f"the CUDA driver reports no usable GPU ({type(e).__name__}: {e})"
    return "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)" if n == 0 else ""


def require_hopper(device_id: int = None) -> None:
    """Raise NoGPUError unless the (current) device is compute capability 9.0."""
    if device_count() == 0:
        raise NoGPUError("mkernel needs an NVIDIA Hopper GPU: " + describe_missing())
    import cupy
    dev = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
    cc = tuple(int(c) for c in dev.compute_capability)
    if cc != REQUIRED_CC:
        raise NoGPUError(f"GPU {dev.id} has compute capability {cc[0]}.{cc[1]}; mkernel's kernels are "
                         f"built for sm_90a (H100/H200) only")


def mps_client() -> bool:
    """True when CUDA runs this process as an MPS client: a control daemon answers in its pipe
    directory, or it was given a share of the SMs. Its kernels then share the GPU's SMs with the
    other clients' kernels at the same time."""
    if os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        return True
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe, "control"))
