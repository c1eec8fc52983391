"""The proxy extension: a C thread that drains the GPU's command queue into a transport.

Built by cffi in API mode from ``build_proxy.py`` (``pip install -e .`` runs it). The verbs transport
is compiled in only where the rdma-core headers were present; import says once when it is not.
"""

from mkernel.core.errors import MKernelError
from mkernel.core.log import get_logger

try:
    from ._proxy import ffi, lib
except ImportError as e:  # pragma: no cover - only on a source tree that was never built
    raise MKernelError(
        "mkernel's proxy extension (mkernel.verbs._proxy) is not built; run `pip install -e . "
        f"--no-build-isolation` in the repository (needs a C compiler and cffi): {e}") from e

HAVE_VERBS = bool(lib.mk_verbs_available())
if not HAVE_VERBS:
    get_logger("proxy").info("this build has no verbs transport (libibverbs-dev was missing at build time); "
                             "tcp and host transports are available")

__all__ = ["ffi", "lib", "HAVE_VERBS"]
