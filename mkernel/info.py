"""``python -m mkernel info``: what this process would run on, in one screen."""

import platform
import sys

from . import compile as kcompile
from . import gpu
from ._version import __version__


def _try(fn):
    try:
        return fn()
    except Exception as e:  # info reports what is missing instead of failing
        return f"unavailable ({type(e).__name__}: {e})"


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _gpus():
    import cupy
    rt = cupy.cuda.runtime
    n = rt.getDeviceCount()
    rows = []
    for i in range(n):
        p = rt.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        rows.append(f"  GPU {i}: {name}, cc {p['major']}.{p['minor']}, {p['multiProcessorCount']} SMs, "
                    f"{p['totalGlobalMem'] / 2**30:.0f} GiB, PCI {p['pciBusID']:02x}:{p['pciDeviceID']:02x}")
    for i in range(n):
        peers = [str(j) for j in range(n) if j != i and rt.deviceCanAccessPeer(i, j)]
        rows.append(f"  GPU {i} peer access to: {', '.join(peers) or 'none'}")
    return rows


def _transports():
    from . import proxy
    return proxy.describe_transports()


def collect() -> list:
    lines = [f"mkernel {__version__} (python {platform.python_version()}, {sys.platform})"]
    import numpy
    lines.append(f"numpy {numpy.__version__}")
    lines.append("cupy " + _try(lambda: __import__("cupy").__version__))
    lines.append("NVRTC " + _try(lambda: "%d.%d" % kcompile.nvrtc.version() + f" at {kcompile.nvrtc.location()}"))
    lines.append("CUDA driver " + _try(lambda: _cuda_version(__import__("cupy").cuda.runtime.driverGetVersion())))
    lines.append("NCCL " + _try(lambda: str(__import__("cupy.cuda.nccl", fromlist=["nccl"]).get_version())))
    lines.append("MPI " + _try(lambda: __import__("mpi4py.MPI", fromlist=["MPI"]).Get_library_version().splitlines()[0].strip()))
    count = gpu.device_count()
    lines.append(f"GPUs: {count}" + ("" if count else f" ({gpu.describe_missing()})"))
    if count:
        gpus = _try(_gpus)
        lines.extend(gpus if isinstance(gpus, list) else ["GPU details " + gpus])
    transports = _try(_transports)
    lines.extend(transports if isinstance(transports, list) else ["transports " + transports])
    lines.append(f"kernel cache: {kcompile.cache_dir()}")
    lines.append(f"kernels registered: {len(kcompile.REGISTRY)} ({', '.join(sorted(kcompile.REGISTRY)) or 'none'})")
    return lines
