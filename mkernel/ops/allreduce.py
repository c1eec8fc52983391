"""``allreduce(x, *, comm)``: the sum over ranks of ``x``, the same bits on every rank, by one kernel
inside a node (mkernel/cuda/ops/allreduce.cu). One-shot (the latency path): each rank pushes its
data into every peer's scratch once and each sums there; up to ``config.allreduce_ll_max_bytes`` the
pushes are LL words (the flag in the data: no fence, no flag round trip), above it the data, then a
flag per chunk. Two-shot, from ``config.allreduce_twoshot_min_bytes`` (``..._2ranks`` at 2 ranks):
each chunk is pushed to one owner, which sums it, and copied from there (2 (W - 1) / W of the data a
rank sends instead of W - 1; at 2 ranks the same bytes in two rounds, but each rank sums and reads
half). Every path adds in rank order in fp32: the same bits.

Importable without CuPy; the kernels are registered at import.
"""

import ctypes

from mkernel.core import config
from mkernel.core.errors import ArgumentError
from mkernel.ops import buffers, calls, tp
from mkernel.runtime import compile as _compile
from mkernel.runtime import launch
from mkernel.runtime.arrays import as_cupy
from mkernel.runtime.launch import launch_persistent, persistent_grid
from mkernel.runtime.sync import MkSync

OP = "allreduce"
KERNEL = "mk_allreduce_kernel"
ELEMENT = {"bfloat16": 0, "float16": 1, "float32": 2}  # the kernel's DT (MK_OUT_* codes)
SPEC = _compile.register(OP, "allreduce.cu", tuple(f"{KERNEL}<{dt},{ll}>" for dt in ELEMENT.values() for ll in (0, 1)),
                         hot=True)
THREADS = 512  # AR_THREADS
CNT_WORDS = 2  # AR_CNT_WORDS
# Elements per chunk (a CTA's item): the least power of two from CHUNK_MIN that makes at most
# CHUNKS_TARGET chunks, up to CHUNK_MAX (index: LL or not). LL pushes load 4 bytes a word, so they
# want more, smaller items; data + flags amortise a fence and a flag per item (bench/NOTES.md, session 32).
CHUNK_MIN = 2048
CHUNK_MAX = {True: 8192, False: 65536}
CHUNKS_TARGET = {True: 32, False: 16}
MAX_CTAS = 64  # more only adds CTAs that wait (a chunk is one item per rank)


class MkAllreduceArgs(ctypes.Structure):
    """Mirror of ``MkAllreduceArgs`` (mkernel/cuda/ops/allreduce_args.cuh), 168 bytes."""
    _fields_ = [("sync", MkSync), ("peer_base", ctypes.c_void_p), ("slots_off", ctypes.c_uint64),
                ("flags_off", ctypes.c_uint64), ("src", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("counters", ctypes.c_void_p), ("count", ctypes.c_uint64), ("slot_bytes", ctypes.c_uint64),
                ("chunk", ctypes.c_uint32), ("chunks", ctypes.c_uint32), ("world", ctypes.c_int32),
                ("me", ctypes.c_int32), ("in_place", ctypes.c_uint32), ("src_is_slot", ctypes.c_uint32),
                ("twoshot", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


def allreduce(x, *, comm, out=None, stream=None):
    """Sum over ranks of ``x`` (any shape and size, contiguous; bfloat16, float16 or float32):
    returns ``out`` (x's shape and dtype; ``out=x`` sums in place), every element the fp32 sum in
    rank order rounded once, so every rank holds the same bits. The same shape and dtype on every
    rank (ranks that disagree raise ArgumentError together). Inside one node (ranks between nodes
    raise ArgumentError). Collective; returns without synchronising."""
    key = calls.call_key(comm, OP, stream, (x, out), ())
    if calls.replay(comm, key, stream):
        return out
    x, out, path = _check(comm, x, out, stream)
    if comm.size == 1:  # a device copy, not a kernel
        if out.data.ptr != x.data.ptr:
            out.data.copy_from_device_async(x.data, x.nbytes, stream)
        return out
    in_place = out.data.ptr == x.data.ptr
    dst = _aligned(out, stream, keep=in_place)
    src = dst if in_place else _aligned(x, stream, keep=True)  # in place: each chunk is sent before it is summed
    plan, template = _plan(comm, x.size, x.dtype, path)
    launched = _launch(comm, template, src, dst, stream, path=path)
    if key is not None and dst is out and (src is x or in_place):  # only the kernel: recorded
        comm.plans.record_launches(key, (launched,), [plan_key(x.size, x.dtype, path)])
    if dst is not out:
        with calls.on_stream(stream):
            out[...] = dst
    return out


def own_slot(comm, shape, dtype):
    """For a producer that writes this rank's contribution straight into the all-reduce's scratch
    (gemm_allreduce's latency path): (slot, finish, key). ``slot`` is a contiguous array of ``shape``
    and ``dtype`` in this rank's own slot, valid until ``finish(out, stream)`` (collective, after
    the producer's work on ``stream``) has launched the all-reduce of it into ``out`` (contiguous,
    16-byte aligned, outside the workspace) and returned that launch; ``key`` is the plan's (for a
    call's record). No copy, no allocation."""
    import numpy

    dt = numpy.dtype(dtype)
    count = int(numpy.prod(shape))
    path = path_of(comm.size, count * dt.itemsize, slot=True)
    calls.agree_call(OP, comm, (OP, count, dt.name, "from slot", path), "one node")
    plan, template = _plan(comm, count, dt, path)
    slot = plan["slots"][comm.local_rank, :count].reshape(shape)

    def finish(out, stream=None):
        """Launches the all-reduce into out; returns its launch (for a call's record)."""
        return _launch(comm, template, slot, out, stream, src_is_slot=True, path=path)
    return slot, finish, plan_key(count, dt, path)


def _check(comm, x, out, stream):
    tp.check_comm(OP, comm)
    if comm.num_nodes > 1:
        raise ArgumentError(f"{OP}: the all-reduce kernel works inside one node; this communicator spans "
                            f"{comm.num_nodes} (use gemm_allreduce's paths between nodes)")
    cupy = tp.cupy_mod()
    x = as_cupy(x, "x", stream=stream)
    if x.dtype.name not in ELEMENT:
        raise ArgumentError(f"{OP}: x must be bfloat16, float16 or float32; got {x.dtype}")
    if not x.flags.c_contiguous or x.size == 0:
        raise ArgumentError(f"{OP}: x must be contiguous and not empty; got shape {tuple(x.shape)} "
                            f"(cupy.ascontiguousarray makes a strided array contiguous)")
    if out is None:
        out = cupy.empty_like(x)
    elif not isinstance(out, cupy.ndarray) or out.shape != x.shape or out.dtype != x.dtype:
        raise ArgumentError(f"{OP}: out must be a cupy.ndarray of x's shape {tuple(x.shape)} and dtype {x.dtype}")
    elif not out.flags.c_contiguous:
        raise ArgumentError(f"{OP}: out must be contiguous")
    elif out.data.ptr != x.data.ptr and out.data.ptr < x.data.ptr + x.nbytes and x.data.ptr < out.data.ptr + out.nbytes:
        raise ArgumentError(f"{OP}: out overlaps x without being x (pass out=x to sum in place)")
    calls.check_outside_workspace(OP, out, comm)
    path = path_of(comm.size, x.nbytes)
    calls.agree_call(OP, comm, (OP, x.size, x.dtype.name, path), "one node")
    return x, out, path


def path_of(world: int, nbytes: int, slot: bool = False) -> str:
    """The kernel's path for nbytes over ``world`` ranks: "ll" (LL words, up to
    config.allreduce_ll_max_bytes; not from a producer's slot, which holds data), "twoshot" (from
    config.allreduce_twoshot_min_bytes, or ..._2ranks at 2 ranks; 0: never) or "oneshot"."""
    cfg = config.get()
    if not slot and nbytes <= cfg.allreduce_ll_max_bytes:
        return "ll"
    least = cfg.allreduce_twoshot_min_bytes_2ranks if world == 2 else cfg.allreduce_twoshot_min_bytes
    if world >= 2 and 0 < least <= nbytes:
        return "twoshot"
    return "oneshot"


def _aligned(arr, stream, keep):
    """arr, or a 16-byte aligned array in its place (the kernel moves 16-byte vectors), holding
    arr's values if ``keep``."""
    if arr.data.ptr % 16 == 0:
        return arr
    cupy = tp.cupy_mod()
    with calls.on_stream(stream):
        copy = cupy.empty_like(arr)
        if keep:
            copy[...] = arr
    return copy


def chunk_of(count: int, ll: bool) -> int:
    """Elements per push / reduce item of a message of ``count`` elements: the least power of two
    in [CHUNK_MIN, CHUNK_MAX[ll]] that makes at most CHUNKS_TARGET[ll] chunks."""
    chunk = CHUNK_MIN
    while chunk < CHUNK_MAX[ll] and chunk * CHUNKS_TARGET[ll] < count:
        chunk *= 2
    return chunk


def plan_key(count, dt, path="oneshot"):
    """The key of the plan of an all-reduce of ``count`` elements of ``dt`` in ``comm.plans``."""
    return ("buffers", OP, count, dt.name) + (() if path == "oneshot" else (path,))


def _plan(comm, count, dt, path="oneshot"):
    """(plan, launch template) per (elements, dtype, path): every rank's slot in the scratch
    (padded to 16 bytes) and the chunk flags the plan's own (two-shot: one more row, the results this
    rank owns, and one result flag per chunk); LL: every rank's slot of LL words (8 bytes per 4 of
    data) the plan's own, no flags."""
    W, ll, two = comm.size, path == "ll", path == "twoshot"
    chunk = chunk_of(count, ll)
    chunks = -(-count // chunk)
    if ll:
        words = -(-count * dt.itemsize // 4)
        sizes, slot_bytes = [("ll", (W, words, 2), "uint32")], words * 8
    else:
        slot = -(-count * dt.itemsize // 16) * 16 // dt.itemsize
        sizes = [("slots", (W + two, slot), dt), ("flags", ((W + two) * chunks,), "uint32")]
        slot_bytes = slot * dt.itemsize
    plan = buffers.plan_buffers(OP, comm, plan_key(count, dt, path), sizes, {"counters": CNT_WORDS})

    def build():
        args = MkAllreduceArgs()
        args.peer_base = comm.peer_table.data.ptr
        if ll:
            args.slots_off, args.flags_off = comm.offset_of(plan["ll"]), 0
        else:
            args.slots_off, args.flags_off = comm.offset_of(plan["slots"]), comm.offset_of(plan["flags"])
        args.counters = plan["counters"].data.ptr
        args.count, args.slot_bytes, args.chunk, args.chunks = count, slot_bytes, chunk, chunks
        args.world, args.me, args.twoshot = W, comm.local_rank, int(two)
        return args
    return plan, buffers.launch_template(plan, (), build)


def _launch(comm, template, src, out, stream, src_is_slot=False, path="oneshot"):
    """Launches the all-reduce of src into out; returns the Launch (to record)."""
    args = MkAllreduceArgs.from_buffer_copy(template["args"])
    args.sync = comm.sync_args(OP)
    args.src, args.out = src.data.ptr, out.data.ptr
    args.in_place = int(src.data.ptr == out.data.ptr)
    args.src_is_slot = int(src_is_slot)
    fn = _compile.module(SPEC).function(f"{KERNEL}<{ELEMENT[src.dtype.name]},{int(path == 'll')}>")
    pushes = args.chunks * (1 if args.twoshot else args.world)  # two-shot: a push per chunk, to its owner
    grid = persistent_grid(fn, THREADS, 0, blocks=min(pushes, MAX_CTAS, launch.sm_count()), what=OP)
    return launch_persistent(fn, (grid,), (THREADS,), args, smem=0, stream=stream)
