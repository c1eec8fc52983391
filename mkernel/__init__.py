"""mkernel: fused multi-GPU, multi-node kernels for CuPy, without PyTorch.

Importing mkernel needs neither a GPU nor CuPy; CuPy is imported when an op first runs.
Public API (shapes documented on each function):

- ``mkernel.init(...)`` returns a :class:`Communicator`; ``comm.empty`` allocates symmetric memory.
- Errors derive from :class:`mkernel.MKernelError`.
"""

from ._version import __version__
from .errors import (ArgumentError, ClosedError, CompileError, MKernelError, NoGPUError,
                     NoRDMADeviceError, PeerError, TimeoutError)
from . import compile  # noqa: F401  (kernel registry; op modules register into it below)

__all__ = [
    "__version__",
    "MKernelError", "ArgumentError", "ClosedError", "CompileError", "NoGPUError",
    "NoRDMADeviceError", "PeerError", "TimeoutError",
]
