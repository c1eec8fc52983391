"""A small ctypes binding of NVRTC, so kernels compile with or without a GPU or a driver.

CuPy's own NVRTC path needs a CUDA device for its cache and does not hash headers reached through
include paths; compiling here lets the cache key cover every header and lets a GPU-less machine
(CI, a build host) produce the exact cubins a GPU machine loads.
"""

import ctypes
import glob
import os
import site
import sysconfig
from pathlib import Path

from mkernel.core import env
from mkernel.core.errors import CompileError

_SONAME = "libnvrtc.so.13"


def _candidates():
    explicit = env.get("MKERNEL_NVRTC")
    if explicit:
        yield explicit
    roots = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    for root in roots:  # the nvidia-cuda-nvrtc wheel (what CuPy itself loads on CUDA 13)
        yield from sorted(glob.glob(os.path.join(root, "nvidia", "cu13", "lib", _SONAME)))
        yield from sorted(glob.glob(os.path.join(root, "nvidia", "cuda_nvrtc", "lib", _SONAME)))
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            yield os.path.join(os.environ[var], "lib64", _SONAME)
    yield "/usr/local/cuda/lib64/" + _SONAME
    yield _SONAME  # the dynamic loader's own search path


class _Lib:
    def __init__(self):
        tried = []
        for path in _candidates():
            if os.sep in path and not os.path.exists(path):
                continue
            tried.append(path)
            try:
                if os.sep in path:  # its builtins must be found beside it, whatever LD_LIBRARY_PATH says
                    for b in glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*")):
                        ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                self.lib = ctypes.CDLL(path)
                self.path = path
                break
            except OSError:
                continue
        else:
            raise CompileError(
                "NVRTC 13 (libnvrtc.so.13) was not found; tried " + ", ".join(tried or ["nothing"]) +
                ". Install it with `pip install 'nvidia-cuda-nvrtc==13.0.*'` or set MKERNEL_NVRTC.")
        lib = self.lib
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetLoweredName.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, status, what, log=""):
        if status != 0:
            msg = self.lib.nvrtcGetErrorString(status).decode()
            raise CompileError(f"{what} failed: {msg}\n{log}")


_lib = None


def library() -> _Lib:
    global _lib
    if _lib is None:
        _lib = _Lib()
    return _lib


def version() -> tuple:
    return library().version


def compile_cubin(source: str, name: str, headers: dict, options, name_expressions):
    """Compile one translation unit. Returns (cubin bytes, log text, {expression: lowered name})."""
    nv = library()
    lib = nv.lib
    prog = ctypes.c_void_p()
    hdr_names = list(headers)
    hdr_src = (ctypes.c_char_p * len(hdr_names))(*[headers[h].encode() for h in hdr_names])
    hdr_inc = (ctypes.c_char_p * len(hdr_names))(*[h.encode() for h in hdr_names])
    nv._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                     len(hdr_names), hdr_src, hdr_inc), "nvrtcCreateProgram")
    try:
        for expr in name_expressions:
            nv._check(lib.nvrtcAddNameExpression(prog, expr.encode()), "nvrtcAddNameExpression")
        opts = [o.encode() for o in options]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        nv._check(status, f"compiling {name}", log)
        lowered = {}
        for expr in name_expressions:
            out = ctypes.c_char_p()
            nv._check(lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)), "nvrtcGetLoweredName")
            lowered[expr] = out.value.decode()
        nv._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        nv._check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw, log, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def location() -> str:
    return str(Path(library().path).resolve())
