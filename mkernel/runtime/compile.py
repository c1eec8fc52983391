"""Run-time compilation of mkernel's CUDA sources, and the kernel cache.

Every kernel is declared once with :func:`register` (its source in ``mkernel/cuda/``, the template
instantiations it needs, the defines it is built with). It is compiled by NVRTC for ``sm_90a`` with
:data:`OPTIONS`, the headers it includes handed to NVRTC in memory, so that the cache key covers
exactly the text compiled: the source, every header it reaches, the options, mkernel's version and
NVRTC's version. Editing a header therefore recompiles. Entries are written with atomic renames, so
several ranks compiling the same kernel at once never leave a torn file. The cache needs no GPU to
fill (``python -m mkernel precompile``) and can be copied to a GPU machine with the same NVRTC.
"""

import hashlib
import json
import os
import re
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from mkernel._version import __version__
from mkernel.core import env
from mkernel.core.errors import CompileError
from mkernel.core.log import get_logger
from mkernel.runtime import nvrtc

log = get_logger("compile")

CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"  # primitives/, engines/, ops/, tests/ (test kernels)
ARCH = "sm_90a"
# The options every kernel is built with, at run time and in the compile check alike.
OPTIONS = (f"-arch={ARCH}", "-std=c++17", "-lineinfo", "-DNDEBUG", "--ptxas-options=-v")
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


@dataclass(frozen=True)
class KernelSpec:
    """One compiled translation unit: a source, its instantiations and its defines."""
    name: str
    source: str
    name_expressions: tuple
    defines: tuple = ()
    hot: bool = True  # hot kernels must not spill or touch local memory (the compile check enforces it)

    def options(self):
        return OPTIONS + tuple(f"-D{k}={v}" for k, v in self.defines)


REGISTRY = {}


def register(name, source, name_expressions, defines=(), hot=True) -> KernelSpec:
    spec = KernelSpec(name, source, tuple(name_expressions), tuple(sorted(defines)), hot)
    if REGISTRY.get(name, spec) != spec:
        raise ValueError(f"kernel {name!r} registered twice with different contents")
    REGISTRY[name] = spec
    return spec


def cuda_files(cuda_dir: Path = CUDA_DIR) -> dict:
    """{file name: path} of every CUDA source under ``cuda_dir``, its folders included. Sources
    include each other by file name alone, so names are unique across the folders."""
    out = {}
    for path in sorted(cuda_dir.rglob("*.cu*")):
        if path.name in out:
            raise CompileError(f"two CUDA sources are named {path.name}: {out[path.name]} and {path}")
        out[path.name] = path
    return out


def include_dirs(cuda_dir: Path = CUDA_DIR) -> list:
    """The folders holding CUDA sources (``-I`` for a host compiler reading the shared headers)."""
    return sorted({str(p.parent) for p in cuda_files(cuda_dir).values()})


def include_closure(source: str, cuda_dir: Path = CUDA_DIR) -> dict:
    """{file name: text} of the source and every quoted include it reaches, recursively."""
    index = cuda_files(cuda_dir)
    files, todo = {}, [source]
    while todo:
        name = todo.pop()
        if name in files:
            continue
        path = index.get(name)
        if path is None:
            raise CompileError(f"{name} (included from the closure of {source}) is not in {cuda_dir}")
        files[name] = path.read_text()
        todo.extend(_INCLUDE.findall(files[name]))
    return files


def cache_key(spec: KernelSpec, files: dict) -> str:
    h = hashlib.sha256()
    parts = [__version__, repr(nvrtc.version()), repr(spec.options()), repr(spec.name_expressions), spec.source]
    for p in parts:
        h.update(p.encode() + b"\0")
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name].encode() + b"\0")
    return h.hexdigest()


def cache_dir() -> Path:
    return Path(env.get("MKERNEL_CACHE_DIR")) / "kernels"


_RES_FN = re.compile(r"Function properties for (\S+)")
_RES_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RES_REGS = re.compile(r"Compiling entry function '(\S+)'|Used (\d+) registers")
# Warnings, and the "Potential Performance Loss" notes ptxas prints as info (C7520: wgmma serialised
# by a divergent path is one of those).
_WARN = re.compile(r"ptxas.*(?:warning|Potential Performance Loss).*", re.I)


def parse_ptxas(log_text: str) -> dict:
    """{mangled function: {registers, stack, spill_stores, spill_loads}} and the ptxas warnings."""
    funcs, current, entry = {}, None, None
    for line in log_text.splitlines():
        m = _RES_FN.search(line)
        if m:
            current = funcs.setdefault(m.group(1), {})
            continue
        m = _RES_STACK.search(line)
        if m and current is not None:
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            continue
        m = _RES_REGS.search(line)
        if m and m.group(1):
            entry = funcs.setdefault(m.group(1), {})
        elif m and entry is not None:
            entry["registers"] = int(m.group(2))
    warnings = [w.strip() for w in _WARN.findall(log_text)]
    return {"functions": funcs, "warnings": warnings}


@dataclass
class Compiled:
    spec: KernelSpec
    key: str
    cubin: bytes
    lowered: dict
    log: str
    resources: dict = field(default_factory=dict)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _read_cached(base: Path):
    try:
        meta = json.loads(base.with_suffix(".json").read_text())
        cubin = base.with_suffix(".cubin").read_bytes()
    except (OSError, ValueError):
        return None
    if hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256"):
        return None  # a different process's entry raced ours in between the two reads: recompile
    return cubin, meta


def compile_spec(spec: KernelSpec, cuda_dir: Path = CUDA_DIR, use_cache: bool = True) -> Compiled:
    files = include_closure(spec.source, cuda_dir)
    key = cache_key(spec, files)
    base = cache_dir() / f"{Path(spec.source).stem}-{key[:32]}"
    if use_cache:
        hit = _read_cached(base)
        if hit is not None:
            cubin, meta = hit
            return Compiled(spec, key, cubin, meta["lowered"], meta["log"], meta["resources"])
    log.info("compiling %s (%s, %d instantiations) with NVRTC %d.%d; first use, cached in %s",
             spec.source, spec.name, len(spec.name_expressions), *nvrtc.version(), base.parent)
    source = files.pop(spec.source)
    cubin, text, lowered = nvrtc.compile_cubin(source, spec.source, files, spec.options(), spec.name_expressions)
    resources = parse_ptxas(text)
    if use_cache:
        base.parent.mkdir(parents=True, exist_ok=True)
        meta = {"kernel": spec.name, "source": spec.source, "key": key, "lowered": lowered, "log": text,
                "resources": resources, "cubin_sha256": hashlib.sha256(cubin).hexdigest()}
        _write_atomic(base.with_suffix(".cubin"), cubin)
        _write_atomic(base.with_suffix(".json"), json.dumps(meta, indent=1).encode())
    return Compiled(spec, key, cubin, lowered, text, resources)


class Module:
    """The loaded cubin of one :class:`KernelSpec` on the current device, with its functions."""

    def __init__(self, compiled: Compiled):
        import cupy

        self.compiled = compiled
        _quiesce()
        self._module = cupy.cuda.function.Module()
        self._module.load(compiled.cubin)
        self._functions = {}

    def function(self, expression: str):
        fn = self._functions.get(expression)
        if fn is None:
            _quiesce()
            fn = self._functions[expression] = self._module.get_function(self.compiled.lowered[expression])
        return fn


def _quiesce():
    """Before loading a module or function: a load waits for the device to go idle and meanwhile
    blocks every CUDA call of the process, the proxy thread's included, so an op of ours in flight
    that waits on the proxy (between nodes) would never finish. Waiting for it first is free once.
    Not while the current stream captures a graph (a synchronisation would invalidate the capture;
    nothing captured runs until the graph is launched)."""
    import cupy
    if cupy.cuda.get_current_stream().is_capturing():
        return
    cupy.cuda.runtime.deviceSynchronize()


_modules = {}
_lock = threading.Lock()


def module(spec: KernelSpec) -> Module:
    """The spec's module on the current CUDA device, compiled (or read from the cache) on first use."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    with _lock:
        mod = _modules.get((spec.name, dev))
        if mod is None:
            mod = _modules[(spec.name, dev)] = Module(compile_spec(spec))
        return mod
