"""The cffi API-mode build of the proxy extension, ``mkernel.verbs._proxy``.

The verbs transport needs the rdma-core headers (``libibverbs-dev``) to compile; libibverbs itself
and libcuda are loaded with dlopen at run time, so the extension links against neither and imports
anywhere. Without the headers the build still produces the proxy with its null, TCP and host
transports, and says so.
"""

import os
import subprocess
import sys
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
CUDA_PRIMITIVES = HERE.parent / "cuda" / "primitives"  # queue_layout.cuh, shared with the kernels
SOURCES = ["proxy.c", "cuda_dl.c", "transport_null.c", "transport_tcp.c", "transport_host.c",
           "transport_verbs.c", "host_producer.c"]


def _verbs_headers() -> bool:
    """True when <infiniband/verbs.h> (and efadv, which comes with it) compile here."""
    probe = b"#include <infiniband/verbs.h>\n#include <infiniband/efadv.h>\n"
    try:
        r = subprocess.run([os.environ.get("CC", "cc"), "-fsyntax-only", "-x", "c", "-"], input=probe,
                           capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


HAVE_VERBS = os.environ.get("MKERNEL_BUILD_VERBS", "auto") != "0" and _verbs_headers()
if not HAVE_VERBS:
    print("mkernel: building the proxy without the verbs transport (no rdma-core headers; "
          "install libibverbs-dev to include it)", file=sys.stderr)

ffibuilder = FFI()
ffibuilder.cdef((HERE / "proxy_api.h").read_text())
ffibuilder.set_source(
    "mkernel.verbs._proxy",
    '#include "proxy_api.h"\n',
    sources=[str(HERE / s) for s in SOURCES],
    include_dirs=[str(HERE), str(CUDA_PRIMITIVES)],
    define_macros=[("MK_HAVE_VERBS", "1")] if HAVE_VERBS else [],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-pthread"],
    libraries=["dl", "pthread", "rt"],
)

if __name__ == "__main__":  # a build outside setup.py: python build_proxy.py [build directory]
    print(ffibuilder.compile(tmpdir=sys.argv[1] if len(sys.argv) > 1 else str(HERE / "build")))
