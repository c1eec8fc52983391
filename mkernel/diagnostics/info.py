"""``python -m mkernel info``: what this process would run on, in one screen."""

import platform
import sys
import warnings

from mkernel._version import __version__
from mkernel.comm import proxy
from mkernel.runtime import compile as kcompile
from mkernel.runtime import gpu


def _try(fn):
    try:
        with warnings.catch_warnings():  # CuPy warns at length when NCCL is missing; we say it in one line
            warnings.simplefilter("ignore")
            return fn()
    except Exception as e:  # info reports what is missing instead of failing
        return f"unavailable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


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
    if n > 1:
        rows.extend("  " + line for line in _nvidia_smi_topology())
    return rows


def _nvidia_smi_topology():
    """The link matrix (NV18 = 18 NVLinks, PIX/SYS = PCIe), when nvidia-smi is there."""
    import shutil
    import subprocess
    if not shutil.which("nvidia-smi"):
        return ["links: nvidia-smi not found"]
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return [f"links: nvidia-smi topo failed ({e})"]
    return [line.rstrip() for line in out.splitlines() if line.startswith(("\t", "GPU")) or "GPU0" in line][:10]


def _transports():
    return proxy.describe_transports()


def collect() -> list:
    lines = [f"mkernel {__version__} (python {platform.python_version()}, {sys.platform})"]
    import numpy
    lines.append(f"numpy {numpy.__version__}")
    lines.append("cupy " + _try(lambda: __import__("cupy").__version__))
    lines.append("NVRTC " + _try(lambda: "%d.%d" % kcompile.nvrtc.version() + f" at {kcompile.nvrtc.location()}"))
    lines.append("CUDA driver " + _try(lambda: _cuda_version(__import__("cupy").cuda.runtime.driverGetVersion())))
    lines.append("NCCL " + _try(_nccl_version))
    lines.append("MPI " + _try(lambda: __import__("mpi4py.MPI", fromlist=["MPI"])
                               .Get_library_version().splitlines()[0].strip()))
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


def _nccl_version():
    from cupy.cuda import nccl
    v = int(nccl.get_version() if hasattr(nccl, "get_version") else nccl.get_build_version())
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"  # NCCL_VERSION_CODE: 22809 is 2.28.9
