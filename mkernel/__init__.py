"""mkernel: fused multi-GPU, multi-node kernels for CuPy, without PyTorch.

Importing mkernel needs neither a GPU nor CuPy; CuPy is imported when an op first runs.

- ``comm = mkernel.init(mpi_comm=None, gpus_per_node=None, transport="auto", workspace_bytes=None)``
  returns a :class:`Communicator`; ``comm.empty(shape, dtype)`` allocates symmetric memory.
- Errors derive from :class:`mkernel.MKernelError`.

Layers, each importing only from the ones below it (checked in CI): ``core`` (errors, environment,
logging, tuning knobs), ``runtime`` (GPU, compile, launch, TMA, device sync state), ``comm`` (the
communicator, symmetric workspace, plans, proxy), ``engines`` (GEMM, attention), ``split`` (the SM
split), ``ops`` (the fused ops), ``diagnostics`` (main job, self test, info). docs/ARCHITECTURE.md.
"""

from mkernel._version import __version__
from mkernel.comm import proxy  # noqa: F401  (registers the command-queue test kernels)
from mkernel.comm.communicator import Communicator, init
from mkernel.core import config  # noqa: F401  (the tuning knobs: mkernel.config.get / configure / override)
from mkernel.core.errors import (
                                 ArgumentError,
                                 CapacityError,
                                 ClosedError,
                                 CompileError,
                                 MKernelError,
                                 NoGPUError,
                                 NoRDMADeviceError,
                                 PeerError,
                                 TimeoutError,
                                 WorkspaceError,
)
from mkernel.diagnostics import selftest  # noqa: F401  (registers the runtime's test kernels)
from mkernel.engines.attention import attention
from mkernel.engines.gemm import gemm, grouped_gemm
from mkernel.ops.allgather_gemm import allgather_gemm
from mkernel.ops.allreduce import allreduce
from mkernel.ops.gemm_allreduce import gemm_allreduce
from mkernel.ops.gemm_reduce_scatter import gemm_reduce_scatter
from mkernel.ops.moe import MoeHandle, moe_capacity, moe_combine, moe_dispatch
from mkernel.ops.moe_gemm import moe_dispatch_gemm, moe_gemm_combine
from mkernel.ops.ring_attention import ring_attention
from mkernel.ops.sequence import shard_sequence, unshard_sequence
from mkernel.split import policy as _split_policy  # noqa: F401  (registers its compile-check kernel)

__all__ = [
    "__version__", "init", "Communicator", "gemm", "grouped_gemm",
    "gemm_reduce_scatter", "gemm_allreduce", "allgather_gemm", "allreduce", "attention", "ring_attention",
    "shard_sequence", "unshard_sequence",
    "moe_dispatch", "moe_combine", "moe_dispatch_gemm", "moe_gemm_combine", "moe_capacity", "MoeHandle",
    "MKernelError", "ArgumentError", "CapacityError", "ClosedError", "CompileError", "NoGPUError",
    "NoRDMADeviceError", "PeerError", "TimeoutError", "WorkspaceError",
]
