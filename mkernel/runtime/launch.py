"""Launching a compiled kernel with one argument struct.

A kernel takes a single ``const __grid_constant__`` struct (declared in an ``*_args.cuh`` header)
that a :class:`ctypes.Structure` on the Python side mirrors field for field; the CPU tests compare
the two layouts. Launch goes straight to ``cuLaunchKernel`` through CuPy's driver binding.
"""

import ctypes
import functools

from mkernel.core import config
from mkernel.core.errors import ArgumentError, MKernelError
from mkernel.runtime import gpu
from mkernel.runtime.extension import proxy_ext

# cuFuncSetAttribute attribute ids (cuda.h); CuPy does not export every name.
FUNC_ATTR_MAX_DYNAMIC_SHARED = 8
_smem_set = {}  # function pointer -> the dynamic shared memory limit already raised for it


def _allow_smem(fn, smem: int) -> None:
    """Raise the function's dynamic shared-memory limit once, not on every launch (a driver call)."""
    if smem > 48 * 1024 and _smem_set.get(fn.ptr, 0) < smem:
        from cupy.cuda import driver
        driver.funcSetAttribute(fn.ptr, FUNC_ATTR_MAX_DYNAMIC_SHARED, smem)
        _smem_set[fn.ptr] = smem


class Launch:
    """One kernel launch ``(fn, grid, block, args, smem[, overlapped])`` with its parameter block
    packed once: ``go(stream_ptr)`` only calls the driver (a recorded call's repeat)."""

    __slots__ = ("fn", "grid", "block", "args", "smem", "overlapped", "_params", "_addr", "_ex")

    def __init__(self, fn, grid, block, args: ctypes.Structure, smem: int = 0, overlapped: bool = False):
        self.fn, self.args, self.smem, self.overlapped = fn, args, smem, bool(overlapped)
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        _allow_smem(fn, smem)
        self._params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        self._addr = ctypes.addressof(self._params)
        self._ex = None  # cuLaunchKernelEx's arguments but the stream, packed at the first go()

    def go(self, stream_ptr: int) -> None:
        if self.overlapped:
            _launch_overlapped(self, stream_ptr)
        else:
            g, b = self.grid, self.block
            _driver().launchKernel(self.fn.ptr, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, stream_ptr, self._addr,
                                   0)


@functools.cache
def _driver():
    """CuPy's driver binding, imported once (a function-level import costs every launch)."""
    from cupy.cuda import driver

    return driver


def stream_ptr(stream=None) -> int:
    """The handle of ``stream`` (a CuPy stream; None: the current one)."""
    import cupy

    return (stream if stream is not None else cupy.cuda.get_current_stream()).ptr


def launch(fn, grid, block, args: ctypes.Structure, *, smem: int = 0, stream=None, cooperative: bool = False,
           overlapped: bool = False) -> Launch:
    """Launches ``fn`` with ``args``; returns the Launch (to record). ``overlapped``: the kernel may
    begin before the stream's previous kernel ends, once that kernel's CTAs have all started or run
    ``griddepcontrol.launch_dependents``; it must wait for that kernel's results itself (and run
    ``griddepcontrol.wait`` before it ends)."""
    if cooperative and overlapped:
        raise ArgumentError("a cooperative launch cannot also be overlapped")
    one = Launch(fn, grid, block, args, smem, overlapped)
    if cooperative:
        g, b = one.grid, one.block
        _driver().launchCooperativeKernel(fn.ptr, *g, *b, smem, stream_ptr(stream), one._addr)
    else:
        one.go(stream_ptr(stream))
    return one


def _launch_overlapped(one: Launch, stream_ptr: int) -> None:
    """An overlapped launch: cuLaunchKernelEx, which CuPy does not bind; its arguments packed once
    per Launch (a recorded call's repeat only casts the stream)."""
    if one._ex is None:
        ffi, lib, _ = proxy_ext()
        one._ex = (ffi, lib.mk_cuda_launch_overlapped, ffi.cast("void *", one.fn.ptr), ffi.new("unsigned[3]", one.grid),
                   ffi.new("unsigned[3]", one.block), ffi.cast("void **", one._addr), ffi.new("char[]", 256))
    ffi, call, fn, grid, block, params, why = one._ex
    rc = call(fn, grid, block, one.smem, ffi.cast("void *", stream_ptr), params, why, 256)
    if rc:
        raise MKernelError(f"overlapped launch failed: {ffi.string(why).decode(errors='replace')}")


def launch_all(launches, stream=None, stream_handle: int = None):
    """Launches Launch objects in order (a call's recorded launches) on ``stream`` (or the stream of
    handle ``stream_handle``)."""
    ptr = stream_handle if stream_handle is not None else stream_ptr(stream)
    for one in launches:
        one.go(ptr)


def call_key(cupy, stream, arrays, options) -> tuple:
    """The key of a call whose launches are a function of its arrays' addresses, shapes, strides
    and dtypes (None allowed) and of ``options`` only: for PlanCache and ``comm.plans``' records.
    Its second entry is the stream's handle."""
    s = stream if stream is not None else cupy.cuda.get_current_stream()
    key = [cupy.cuda.runtime.getDevice(), s.ptr]
    for x in arrays:
        key += (None,) if x is None else (x.data.ptr, x.shape, x.strides, x.dtype)
    return (*key, *options)


def max_resident_blocks(fn, block_threads: int, smem: int) -> int:
    """Blocks of this kernel that fit on one SM at once (persistent kernels launch at most this x SMs)."""
    from cupy.cuda import driver

    _allow_smem(fn, smem)
    return driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, block_threads, smem)


# Under MPS a persistent grid counts on this fraction of the client's SMs: two clients given 50%
# each (66 SMs) were not resident at once with 66 CTAs each, but were with 60 (bench/NOTES.md).
MPS_RESIDENT_FRACTION = 7 / 8
_device_sms = {}  # device -> (its SMs or this client's share, those resident at once)


def _sm_counts() -> tuple:
    """Read once per device: a process's MPS client state is fixed once its context exists."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    c = _device_sms.get(dev)
    if c is None:
        n = cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
        c = _device_sms[dev] = (n, max(1, int(n * MPS_RESIDENT_FRACTION)) if gpu.mps_client() else n)
    return c


def device_sms() -> int:
    """The current device's SMs (under MPS the client's share)."""
    return _sm_counts()[0]


def sm_count(full_share: bool = False) -> int:
    """SMs whose CTAs a persistent grid may count on being resident at once: :func:`device_sms`,
    under MPS less a margin (``full_share``: the whole share, for kernels whose work any resident
    subset of CTAs finishes; the rest start as SMs free up)."""
    return _sm_counts()[0 if full_share else 1]


# Between nodes every op measured faster on the whole MPS share (RS, AG ~9%, ring 5-8%, MoE 1-4%) but AR at one
# rank per node (3-27% slower at K 14336; at 2 x 2 2-17% faster; bench/NOTES.md sessions 29, 45-47)
PART_SHARE_BETWEEN_NODES = frozenset({"gemm_allreduce"})


def full_share(comm, op) -> bool:
    """Whether the grids of kernels that finish with any resident subset of CTAs (the fused TP ops,
    ring attention, MoE) take the whole MPS share (config.mps_full_share; True: in one node, between
    nodes too but for the ops in PART_SHARE_BETWEEN_NODES at one rank per node)."""
    v = config.get().mps_full_share
    between = op not in PART_SHARE_BETWEEN_NODES or comm.local_size > 1
    return v == "always" or (v is True and (comm.num_nodes == 1 or between))


def grid_sms(comm, op) -> int:
    """SMs such a kernel's grid takes (under MPS 7/8 of the share, or all of it: full_share)."""
    return sm_count(full_share=full_share(comm, op))


_grids = {}


def persistent_grid(fn, block_threads: int, smem: int, blocks: int = None, what: str = "kernel",
                    full_share: bool = False) -> int:
    """The grid of a persistent kernel: ``blocks`` (default: as many as fit on :func:`sm_count`
    SMs, ``full_share`` as there), checked to fit at once."""
    key = (fn.ptr, block_threads, smem, blocks, full_share)  # occupancy is a driver query: once per function
    if key in _grids:
        return _grids[key]
    per_sm = max_resident_blocks(fn, block_threads, smem)
    if per_sm == 0:
        raise MKernelError(f"{what}: a block of {block_threads} threads with {smem} bytes of shared memory "
                           f"does not fit on one SM")
    limit = per_sm * sm_count(full_share)
    blocks = limit if blocks is None else blocks
    if not 0 < blocks <= limit:
        raise ArgumentError(f"{what}: {blocks} persistent blocks requested, but only {limit} can be resident "
                            f"at once ({per_sm} per SM)")
    _grids[key] = blocks
    return blocks


def launch_persistent(fn, grid, block, args, *, smem: int, stream=None) -> Launch:
    """Launches a persistent kernel (grid from persistent_grid), plainly. Every persistent kernel
    gives its CTAs roles in arrival order and claims its work from counters, so any resident subset
    of its blocks finishes. Not cooperatively: a cooperative launch waits until its whole grid fits,
    and on a GPU shared under MPS the SMs it waits for may be held by a peer's kernel that waits for
    this one: ranks then stall until their timeout (bench/NOTES.md)."""
    return launch(fn, grid, block, args, smem=smem, stream=stream)


class PlanCache:
    """Launch plans ``(fn, grid, block, args, smem[, kept])`` of an op by a key of everything that
    determines the arguments (pointers, shapes, strides, dtypes, options, stream), each with its
    Launch packed once: a repeated call (benchmarks, fused ops, training loops) skips validation and
    argument building and only calls the driver. Bounded; least recently used goes first."""

    def __init__(self, size: int = 256):
        from collections import OrderedDict

        self._plans = OrderedDict()
        self.size = size

    def launch(self, key, stream=None) -> bool:
        """Launches the plan of ``key`` if there is one; False otherwise."""
        entry = self._plans.get(key)
        if entry is None:
            return False
        self._plans.move_to_end(key)
        entry[1].go(stream_ptr(stream))
        return True

    def get(self, key):
        """``(plan, Launch)`` of ``key``, or None."""
        return self._plans.get(key)

    def clear(self):
        """Drops every plan (and what its arguments keep alive): each key builds its plan again."""
        self._plans.clear()

    def add(self, key, plan, launched: "Launch"):
        """Keeps ``plan`` for ``key`` with ``launched``, the first call's Launch of it (packed once)."""
        self._plans[key] = (plan, launched)
        while len(self._plans) > self.size:
            self._plans.popitem(last=False)
