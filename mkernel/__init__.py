"""mkernel: fused multi-GPU, multi-node kernels for CuPy, without PyTorch.

Importing mkernel needs neither a GPU nor CuPy; CuPy is imported when an op first runs.

- ``comm = mkernel.init(mpi_comm=None, gpus_per_node=None, transport="auto", workspace_bytes=None)``
  returns a :class:`Communicator`; ``comm.empty(shape, dtype)`` allocates symmetric memory.
- Errors derive from :class:`mkernel.MKernelError`.
"""

from ._version import __version__
from .errors import (ArgumentError, CapacityError, ClosedError, CompileError, MKernelError, NoGPUError,
                     NoRDMADeviceError, PeerError, TimeoutError, WorkspaceError)
from . import compile  # noqa: F401  (the kernel registry; the modules below register into it)
from . import config  # noqa: F401  (the tuning knobs: mkernel.config.get / configure / override)
from .comm import Communicator, init
from . import selftest  # noqa: F401
from .gemm import gemm, grouped_gemm
from . import proxy  # noqa: F401  (registers the command-queue test kernels)
from .gemm_reduce_scatter import gemm_reduce_scatter
from .gemm_allreduce import gemm_allreduce
from .allgather_gemm import allgather_gemm
from .attention import attention
from .ring_attention import ring_attention
from .sequence import shard_sequence, unshard_sequence
from .moe import MoeHandle, moe_capacity, moe_combine, moe_dispatch
from .moe_gemm import moe_dispatch_gemm, moe_gemm_combine
from . import split  # noqa: F401  (the SM-split policy; registers its compile-check kernel)

__all__ = [
    "__version__", "init", "Communicator", "gemm", "grouped_gemm",
    "gemm_reduce_scatter", "gemm_allreduce", "allgather_gemm", "attention", "ring_attention",
    "shard_sequence", "unshard_sequence",
    "moe_dispatch", "moe_combine", "moe_dispatch_gemm", "moe_gemm_combine", "moe_capacity", "MoeHandle",
    "MKernelError", "ArgumentError", "CapacityError", "ClosedError", "CompileError", "NoGPUError",
    "NoRDMADeviceError", "PeerError", "TimeoutError", "WorkspaceError",
]
