"""Sharding helpers for sequence parallelism (ring attention): which rows of the global sequence
each rank holds, and back.

Two layouts, chosen by ``causal`` as ``mkernel.ring_attention`` expects them:

- ``causal=False``: contiguous. With ``S_local = S_full / world``, rank r holds global rows
  ``[r * S_local, (r + 1) * S_local)``.
- ``causal=True``: zigzag, which balances causal attention's work. The sequence is cut into
  ``2 * world`` chunks of ``C = S_full / (2 * world)`` rows; rank r holds chunk r followed by chunk
  ``2 * world - 1 - r``. Every rank then has the same number of (query, visible key) pairs, and,
  against any other rank's key/value block, exactly two full ``C x C`` chunk pairs of work.

Example, ``world = 2``, 8 rows: causal=False gives rank 0 rows 0-3 and rank 1 rows 4-7;
causal=True gives rank 0 rows ``[0, 1, 6, 7]`` and rank 1 rows ``[2, 3, 4, 5]``.

Pure array code: works on NumPy and CuPy arrays (any dtype, including ml_dtypes' bfloat16, whose
bits are copied exactly) and needs no GPU. Bad arguments raise :class:`mkernel.ArgumentError`.
"""

import numbers
import sys

import numpy as np

from mkernel.core.errors import ArgumentError

__all__ = ["shard_sequence", "unshard_sequence", "global_positions"]


# ----------------------------------------------------------------------------------- helpers
def _int(value, what):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ArgumentError(f"{what} must be an integer; got {value!r} ({type(value).__name__})")
    return int(value)


def _check_rank(rank, world):
    world = _int(world, "world")
    rank = _int(rank, "rank")
    if world < 1:
        raise ArgumentError(f"world must be >= 1; got {world}")
    if not 0 <= rank < world:
        raise ArgumentError(f"rank must be in [0, {world}) for world {world}; got {rank}")
    return rank, world


def _xp(x):
    """The array module of x: cupy for a CuPy array, numpy for a NumPy array."""
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return cupy
    if isinstance(x, np.ndarray):
        return np
    raise ArgumentError(f"expected a NumPy or CuPy array; got {type(x).__name__} (convert it first, e.g. "
                        "with numpy.asarray or cupy.asarray)")


def _axis(x, axis):
    axis = _int(axis, "axis")
    if not -x.ndim <= axis < x.ndim:
        raise ArgumentError(f"axis {axis} is out of range for an array of {x.ndim} dimensions (shape {x.shape})")
    return axis % x.ndim


_RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _raw(x):
    """x viewed as unsigned integers of its item size (exact bit copies, and CuPy copies dtypes it
    has no kernels for, such as bfloat16); x itself where no such view exists."""
    raw = _RAW.get(x.dtype.itemsize)
    if raw is None or x.dtype == raw or x.dtype.kind not in "biufcV":
        return x
    try:
        return x.view(raw)
    except Exception:  # noqa: BLE001  (an unusual layout: copy the values instead of the bits)
        return x


def _concat(xp, pieces, axis, dtype):
    """Concatenation along axis of same-dtype pieces, bit for bit, as a new C-contiguous array."""
    raw = [_raw(p) for p in pieces]
    if any(r.dtype != raw[0].dtype for r in raw):
        raw = list(pieces)
    out = xp.ascontiguousarray(xp.concatenate(raw, axis=axis))
    return out if out.dtype == dtype else out.view(dtype)


def _take(x, axis, start, stop):
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def _chunk_ids(rank, world, causal):
    """The global chunk ids of rank's local rows, in local order: (rank, 2W-1-rank) for causal
    (chunks of S_full / 2W rows), (rank,) otherwise (chunks of S_full / W rows)."""
    return (rank, 2 * world - 1 - rank) if causal else (rank,)


# ---------------------------------------------------------------------------------------- API
def shard_sequence(x, rank, world, *, causal=True, axis=0):
    """This rank's part of the full sequence ``x`` along ``axis``.

    x: a NumPy or CuPy array holding the whole sequence (``S_full`` rows along ``axis``, which may
    be negative: ``axis=-3`` is the sequence axis of both ``[S, H, D]`` and ``[B, S, H, D]``).
    causal=False: rows ``[rank * S_local, (rank + 1) * S_local)`` with ``S_local = S_full / world``
    (``S_full % world == 0`` required). causal=True: the zigzag layout: chunk ``rank`` then chunk
    ``2 * world - 1 - rank`` of ``2 * world`` equal chunks (``S_full % (2 * world) == 0`` required).

    Returns a new C-contiguous array of the same type (NumPy or CuPy) and dtype as x, with
    ``S_full / world`` rows along ``axis``; x is not modified and the result does not alias it.
    """
    xp = _xp(x)
    rank, world = _check_rank(rank, world)
    ax = _axis(x, axis)
    s_full = x.shape[ax]
    parts = 2 * world if causal else world
    if s_full % parts:
        if causal:
            raise ArgumentError(
                f"causal (zigzag) sharding cuts the sequence into 2 * world = {parts} equal chunks, but its "
                f"length along axis {axis} is {s_full}, not a multiple of {parts}; pad the sequence to a multiple "
                f"of {parts} (e.g. {-(-s_full // parts) * parts}), or use causal=False for contiguous shards")
        raise ArgumentError(
            f"contiguous sharding needs the sequence length along axis {axis} ({s_full}) to be a multiple of "
            f"world ({world}); pad it to {-(-s_full // parts) * parts}")
    c = s_full // parts
    pieces = [_take(x, ax, i * c, (i + 1) * c) for i in _chunk_ids(rank, world, causal)]
    return _concat(xp, pieces, ax, x.dtype)


def unshard_sequence(parts, *, causal=True, axis=0):
    """The full sequence from every rank's part (the inverse of :func:`shard_sequence`).

    parts: a list (or tuple, or an array stacked along a new first axis) of ``world`` arrays in
    rank order, all of one type (NumPy or CuPy), dtype and shape, each with ``S_local`` rows along
    ``axis`` (even for causal=True: a zigzag part is two chunks of ``S_local / 2`` rows). Returns a
    new C-contiguous array with ``world * S_local`` rows along ``axis``.
    """
    if isinstance(parts, (str, bytes)) or not hasattr(parts, "__len__"):
        raise ArgumentError(f"parts must be a list of every rank's array (in rank order); got {type(parts).__name__}")
    parts = list(parts)
    if not parts:
        raise ArgumentError("parts is empty: pass every rank's array, in rank order")
    xp = _xp(parts[0])
    first = parts[0]
    for r, p in enumerate(parts):
        if _xp(p) is not xp:
            raise ArgumentError(f"parts mix NumPy and CuPy arrays (part 0 is {type(first).__name__}, part {r} "
                                f"is {type(p).__name__})")
        if p.shape != first.shape or p.dtype != first.dtype:
            raise ArgumentError(f"every part must have the same shape and dtype; part 0 is {first.shape} "
                                f"{first.dtype}, part {r} is {p.shape} {p.dtype}")
    world = len(parts)
    ax = _axis(first, axis)
    s_local = first.shape[ax]
    if not causal:
        return _concat(xp, parts, ax, first.dtype)
    if s_local % 2:
        raise ArgumentError(f"a zigzag (causal) part holds two equal chunks, so its length along axis {axis} must "
                            f"be even; got {s_local}")
    c = s_local // 2
    chunks = [None] * (2 * world)
    for r, p in enumerate(parts):
        lo, hi = _chunk_ids(r, world, True)
        chunks[lo] = _take(p, ax, 0, c)
        chunks[hi] = _take(p, ax, c, 2 * c)
    return _concat(xp, chunks, ax, first.dtype)


def global_positions(rank, world, s_local, *, causal=True):
    """The global position of each of this rank's ``s_local`` rows: a NumPy int64 array.

    causal=True (zigzag): the first ``s_local / 2`` rows are chunk ``rank`` (positions
    ``rank * C + i``) and the rest chunk ``2 * world - 1 - rank``, with ``C = s_local / 2`` (so
    ``s_local`` must be even). causal=False: ``rank * s_local + i``. Under causal masking a local
    query row sees exactly the keys (of any rank) whose global position is <= its own.
    """
    rank, world = _check_rank(rank, world)
    s_local = _int(s_local, "s_local")
    if s_local < 0:
        raise ArgumentError(f"s_local must be >= 0; got {s_local}")
    if not causal:
        return rank * s_local + np.arange(s_local, dtype=np.int64)
    if s_local % 2:
        raise ArgumentError(f"zigzag (causal) shards hold two equal chunks, so s_local must be even; got {s_local}")
    c = s_local // 2
    return np.concatenate([i * c + np.arange(c, dtype=np.int64) for i in _chunk_ids(rank, world, True)])
