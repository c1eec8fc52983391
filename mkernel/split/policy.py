"""The compute / communication split policy on the host, and its memory across calls (docs/CONTROLLER.md).

One implementation: ``mkernel/cuda/primitives/split_policy.cuh`` is plain integer C++ that the fused kernels will
include (NVRTC) and that this module compiles with the host C++ compiler into a small shared library
(cached in ``MKERNEL_CACHE_DIR/host``), loaded with ctypes. So the host search, the tests and the device
controller run the same code.

- :func:`prior` : the model-based first guess of comm CTAs for an op (bytes, link rate, GEMM work).
- :class:`Search`, :class:`Controller`: thin wrappers of one cross-call search state and one in-call
  controller state.
- :class:`SplitMemory`: ``choose(key, prior) -> comm_ctas`` before a call, ``observe(key, comm_ctas, ms)``
  after it, per key :func:`split_key` (op, shape bucket, world, topology, transport); optionally saved
  as JSON (atomic replace) so that the next process starts from the converged split.

Ranks need not agree on a split (the fused kernels are exact whatever count each rank runs): each
rank's search works on its own times.
"""

import ctypes
import functools
import hashlib
import json
import math
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from mkernel.core import env
from mkernel.core.errors import MKernelError
from mkernel.core.log import get_logger
from mkernel.runtime import compile as _compile

log = get_logger("split")

HEADER = "split_policy.cuh"
# The device compile check (tests/cpu/test_compile.py compiles every registered spec with NVRTC).
SPEC = _compile.register("split_policy_test", "split_policy_test.cu", ("split_policy_test",), hot=False)

PHASES = ("prior", "up", "down", "refine", "confirm", "hold")
HOLD = PHASES.index("hold")

_SHIM = r"""
#include "split_policy.cuh"
extern "C" {
int mk_split_version() { return MK_SPLIT_VERSION; }
unsigned long long mk_split_sizeof(int which) {
  return which == 0 ? sizeof(MkSplitSearch) : which == 1 ? sizeof(MkSplitCtl) : which == 2 ? sizeof(MkSplitWindow)
       : sizeof(MkSplitModel);
}
int mk_split_prior_c(const MkSplitModel* m) { return mk_split_prior(*m); }
void mk_split_search_init_c(MkSplitSearch* s, int lo, int hi, int prior) { mk_split_search_init(*s, lo, hi, prior); }
int mk_split_search_observe_c(MkSplitSearch* s, int n, unsigned long long ns) {
  return mk_split_search_observe(*s, n, ns);
}
void mk_split_ctl_init_c(MkSplitCtl* c, int total, int lo, int hi, int n, int step, unsigned h, unsigned st) {
  mk_split_ctl_init(*c, total, lo, hi, n, step, h, st);
}
int mk_split_ctl_step_c(MkSplitCtl* c, const MkSplitWindow* w) { return mk_split_ctl_step(*c, *w); }
void mk_split_window_c(MkSplitWindow* w, unsigned long long dt, int g, int c, unsigned long long turn,
                       unsigned long long gs, unsigned long long cs, unsigned long long gd, unsigned long long cd,
                       unsigned long long gl, unsigned long long cl) {
  *w = mk_split_window(dt, g, c, turn, gs, cs, gd, cd, gl, cl);
}
}
"""


class MkSplitModel(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in ("comm_bytes", "cta_bytes_per_us", "link_bytes_per_us", "gemm_sm_ns")] + [
        (f, ctypes.c_int32) for f in ("total", "lo", "hi", "pad")]


class MkSplitWindow(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in ("gemm_done", "comm_done", "gemm_busy_ns", "comm_busy_ns",
                                              "gemm_stall_ns", "comm_stall_ns", "gemm_left", "comm_left")]


class MkSplitCtl(ctypes.Structure):
    _fields_ = [(f, ctypes.c_int32) for f in ("total", "lo", "hi", "n_comm", "step_lim", "last_dir",
                                             "dead_extra", "reversals")] + [
        ("hyst_permille", ctypes.c_uint32), ("stall_permille", ctypes.c_uint32)]


class MkSplitPoint(ctypes.Structure):
    _fields_ = [("n", ctypes.c_int32), ("count", ctypes.c_uint32), ("sum_ns", ctypes.c_uint64)]


class MkSplitSearch(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32)] + [
        (f, ctypes.c_int32) for f in ("lo", "hi", "phase", "pending", "best", "a", "b", "step", "confirms")] + [
        (f, ctypes.c_uint32)
        for f in ("observations", "npts", "drift", "max_obs", "reopen_permille", "reopen_calls")] + [
        ("ref_ns", ctypes.c_uint64), ("reopens", ctypes.c_uint32), ("prior", ctypes.c_int32),
        ("pts", MkSplitPoint * 24)]


# ------------------------------------------------------------------------------- the host library
_lib = None
_lib_lock = threading.Lock()


def _build(cxx: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "split_shim.cpp"
        src.write_text(_SHIM)
        so = Path(tmp) / out.name
        cmd = [cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-Wall", "-Werror",
               *(f"-I{d}" for d in _compile.include_dirs()), str(src), "-o", str(so)]
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise MKernelError(f"the host C++ compiler {cxx} did not run ({e}); set CXX to one that does") from e
        if r.returncode:
            raise MKernelError(f"building the split policy's host library failed ({' '.join(cmd)}):\n{r.stderr}")
        os.replace(so, out)  # atomic: ranks building at once never load a torn library
        log.info("built the split policy's host library in %.0f ms (%s)", (time.perf_counter() - t0) * 1e3, out)


def library():
    """The host build of split_policy.cuh (g++, cached by the hash of the header and the shim)."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if not cxx:
            raise MKernelError("mkernel.split needs a host C++ compiler (g++ or c++ on PATH, or CXX) to build "
                               "the split policy's host library")
        text = _compile.cuda_files()[HEADER].read_text()
        key = hashlib.sha256((text + "\0" + _SHIM + "\0" + cxx).encode()).hexdigest()[:24]
        path = Path(env.get("MKERNEL_CACHE_DIR")) / "host" / f"split_policy-{key}.so"
        if not path.is_file():
            _build(cxx, path)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # a cache carried from another machine whose C library this one lacks: build here
            _build(cxx, path)
            lib = ctypes.CDLL(str(path))
        lib.mk_split_sizeof.restype = ctypes.c_uint64
        lib.mk_split_prior_c.argtypes = [ctypes.POINTER(MkSplitModel)]
        lib.mk_split_search_init_c.argtypes = [ctypes.POINTER(MkSplitSearch)] + [ctypes.c_int] * 3
        lib.mk_split_search_observe_c.argtypes = [ctypes.POINTER(MkSplitSearch), ctypes.c_int, ctypes.c_uint64]
        lib.mk_split_ctl_init_c.argtypes = [ctypes.POINTER(MkSplitCtl)] + [ctypes.c_int] * 5 + [ctypes.c_uint] * 2
        lib.mk_split_ctl_step_c.argtypes = [ctypes.POINTER(MkSplitCtl), ctypes.POINTER(MkSplitWindow)]
        lib.mk_split_window_c.argtypes = ([ctypes.POINTER(MkSplitWindow), ctypes.c_uint64, ctypes.c_int, ctypes.c_int] +
                                          [ctypes.c_uint64] * 7)
        for i, cls in enumerate((MkSplitSearch, MkSplitCtl, MkSplitWindow, MkSplitModel)):
            if lib.mk_split_sizeof(i) != ctypes.sizeof(cls):  # the mirrors must match the header
                raise MKernelError(f"{cls.__name__} mirror is {ctypes.sizeof(cls)} bytes; the header's is "
                                   f"{lib.mk_split_sizeof(i)}")
        _lib = lib
        return lib


def version() -> int:
    return library().mk_split_version()


# ------------------------------------------------------------------------------- policy wrappers
def prior(*, comm_bytes, cta_gbps, link_gbps, gemm_ms, total, lo=1, hi=None) -> int:
    """Model first guess of comm CTAs: the op moves ``comm_bytes``; one comm CTA moves ``cta_gbps``
    GB/s (pulling: half the pushing rate) up to ``link_gbps``; the GEMM takes ``gemm_ms`` on ``total``
    CTAs (ideal scaling assumed)."""
    m = MkSplitModel(int(comm_bytes), max(1, round(cta_gbps * 1e3)), max(1, round(link_gbps * 1e3)),
                     round(gemm_ms * 1e6 * total), int(total), int(lo), int(total - 1 if hi is None else hi), 0)
    return library().mk_split_prior_c(ctypes.byref(m))


class Search:
    """One key's cross-call search (MkSplitSearch)."""

    def __init__(self, lo: int, hi: int, prior: int, state: bytes = None):
        self.s = MkSplitSearch()
        if state is not None and len(state) == ctypes.sizeof(MkSplitSearch):
            ctypes.memmove(ctypes.byref(self.s), state, len(state))
        if state is None or self.s.version != version():
            library().mk_split_search_init_c(ctypes.byref(self.s), int(lo), int(hi), int(prior))

    @property
    def pending(self) -> int:
        return self.s.pending

    @property
    def best(self) -> int:
        return self.s.best

    @property
    def phase(self) -> str:
        return PHASES[self.s.phase]

    @property
    def converged(self) -> bool:
        return self.s.phase == HOLD

    def observe(self, n: int, ms: float) -> int:
        """Records a call's time (the same value on every rank); returns the next count to run."""
        return library().mk_split_search_observe_c(ctypes.byref(self.s), int(n), ms_to_ns(ms))

    def state(self) -> bytes:
        return ctypes.string_at(ctypes.byref(self.s), ctypes.sizeof(self.s))

    def points(self) -> dict:
        """{comm CTAs: (samples, mean ms)} measured since the search (re)opened."""
        return {p.n: (p.count, p.sum_ns / p.count / 1e6) for p in self.s.pts[:self.s.npts] if p.count}


class Controller:
    """One in-call controller state (MkSplitCtl), stepped with window counters (host: tests)."""

    def __init__(self, total, lo, hi, n_comm, step_max=8, hyst_permille=125, stall_permille=300):
        self.c = MkSplitCtl()
        library().mk_split_ctl_init_c(ctypes.byref(self.c), total, lo, hi, n_comm, step_max, hyst_permille,
                                      stall_permille)

    def step(self, **window) -> int:
        w = MkSplitWindow(**{k: int(v) for k, v in window.items()})
        return library().mk_split_ctl_step_c(ctypes.byref(self.c), ctypes.byref(w))

    @property
    def n_comm(self) -> int:
        return self.c.n_comm


def window(*, dt_ns, gemm_ctas, comm_ctas, turn_ns=0, gemm_stall_ns=0, comm_stall_ns=0, gemm_done, comm_done,
           gemm_left, comm_left) -> dict:
    """The MkSplitWindow the fused kernels' controller builds from one window's counters
    (mk_split_window), as a dict of its fields."""
    w = MkSplitWindow()
    library().mk_split_window_c(ctypes.byref(w), int(dt_ns), int(gemm_ctas), int(comm_ctas), int(turn_ns),
                                int(gemm_stall_ns), int(comm_stall_ns), int(gemm_done), int(comm_done),
                                int(gemm_left), int(comm_left))
    return {f: getattr(w, f) for f, _ in MkSplitWindow._fields_}


def ms_to_ns(ms: float) -> int:
    if not (ms >= 0 and math.isfinite(ms)):
        raise ValueError(f"a call time must be a finite number of ms >= 0; got {ms!r}")
    return int(round(ms * 1e6))


# ------------------------------------------------------------------------------- memory across calls
def shape_bucket(*dims) -> tuple:
    """Each dimension rounded up to a power of two, or to 1.5 times one (so a bucket spans at most
    1.5x: shapes in one bucket share an optimum split closely enough to start from it)."""
    out = []
    for d in dims:
        d = max(1, int(d))
        p = 1 << (d - 1).bit_length()
        out.append(p * 3 // 4 if p >= 4 and d <= p * 3 // 4 else p)
    return tuple(out)


def split_key(op: str, dims, world: int, topology: str, transport: str) -> tuple:
    """The memory key: (op, shape bucket, world, topology, transport), all plain JSON-able values."""
    return (str(op), shape_bucket(*dims), int(world), str(topology), str(transport))


@functools.lru_cache(maxsize=4096)  # a whole call asks 2-3 times for its key's (split_key's tuples hash)
def _key_str(key) -> str:
    return json.dumps([list(k) if isinstance(k, tuple) else k for k in key])


class SplitMemory:
    """Per key, the search state: ``choose`` before a call, ``observe`` after it.

    ``persist=True`` reads converged keys from ``directory`` (default ``MKERNEL_CACHE_DIR/split``),
    ``splits.json``: a key loaded from it starts held at its converged split (and re-opens its search
    if the times it sees changed a lot); with ``write`` (one rank of a job) it also keeps the keys
    it converges there, replaced atomically. Thread-safe.
    """

    FILE = "splits.json"

    def __init__(self, persist: bool = False, directory=None, write: bool = True):
        self.persist = persist
        self.write = write
        self.directory = Path(directory) if directory is not None else Path(env.get("MKERNEL_CACHE_DIR")) / "split"
        self._searches = {}
        self._saved = {}  # key string -> entry, as read from disk
        self._lock = threading.Lock()
        if persist:
            self._saved = self._read()

    @property
    def path(self) -> Path:
        return self.directory / self.FILE

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if data.get("version") != version():
            return {}  # another policy's states: start again
        return data.get("entries", {})

    def _search(self, key, prior, lo, hi) -> Search:
        ks = _key_str(key)
        s = self._searches.get(ks)
        if s is None:
            saved = self._saved.get(ks)
            if saved is not None:
                state = bytes.fromhex(saved.get("state", ""))
                s = Search(lo, hi, saved.get("comm_ctas", prior), state)
                if (s.s.lo, s.s.hi) != (lo, hi):  # other bounds now: restart from the saved split
                    s = Search(lo, hi, saved.get("comm_ctas", prior))
            else:
                s = Search(lo, hi, prior)
            self._searches[ks] = s
        return s

    def choose(self, key, prior: int, lo: int = 1, hi: int = 64) -> int:
        """The comm CTA count for the next call on ``key`` (``prior``: the model guess, used when the
        key is new; ``lo``/``hi``: bounds)."""
        with self._lock:
            return self._search(key, prior, lo, hi).pending

    def observe(self, key, comm_ctas: int, ms: float) -> int:
        """Records a call on ``key`` that ran ``comm_ctas`` and took ``ms``. Returns the count for the
        next call."""
        with self._lock:
            ks = _key_str(key)
            s = self._searches.get(ks)
            if s is None:
                raise MKernelError(f"split memory: observe({key}) before choose()")
            was = s.converged, s.s.reopens
            nxt = s.observe(comm_ctas, ms)
            if s.converged and not was[0]:
                log.debug("split %s converged to %d comm CTAs (%.3f ms, %d calls)", key, s.best,
                          s.s.ref_ns / 1e6, s.s.observations)
            if self.persist and self.write and ((s.converged, s.s.reopens) != was):
                self._save_locked()
            return nxt

    def saved(self, key):
        """The state saved for ``key`` as this process read it (None: none)."""
        with self._lock:
            return self._saved.get(_key_str(key))

    def search(self, key):
        """The key's :class:`Search` (None when never chosen)."""
        return self._searches.get(_key_str(key))

    def save(self):
        with self._lock:
            self._save_locked()

    def _save_locked(self):
        entries = self._read()  # merge: other processes may have saved other keys
        for ks, s in self._searches.items():
            if s.converged:
                entries[ks] = {"comm_ctas": s.best, "ms": s.s.ref_ns / 1e6, "state": s.state().hex()}
            else:
                entries.pop(ks, None)
        data = json.dumps({"version": version(), "entries": entries}, indent=1, sort_keys=True).encode()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _compile._write_atomic(self.path, data)
        except OSError as e:  # a failing disk must not fail the op on this rank alone (its peers go on)
            log.warning("split memory: cannot write %s (%s); keeping splits in memory only", self.path, e)
            self.persist = False
            return
        self._saved = entries


_memory = None


def memory() -> SplitMemory:
    """The process's split memory (in memory only; pass ``persist=True`` to a SplitMemory of your own
    to keep converged splits on disk)."""
    global _memory
    if _memory is None:
        _memory = SplitMemory()
    return _memory
