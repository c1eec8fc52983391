"""CPU tests of mkernel.sequence (sharding helpers for sequence parallelism): NumPy only, no GPU.

Round trips (shard every rank, unshard: the same bits) for both layouts, several world sizes,
axes (negative ones too) and dtypes (bfloat16 and float16 with NaN payloads and -0 kept bit for
bit); the zigzag layout spelled out on small cases; global_positions against sharding an arange;
the zigzag's causal load balance; and argument errors (ArgumentError with a useful message).
"""

import ml_dtypes
import numpy as np
import pytest

from mkernel.core.errors import ArgumentError
from mkernel.ops.sequence import global_positions, shard_sequence, unshard_sequence

BF16 = np.dtype(ml_dtypes.bfloat16)
WORLDS = (1, 2, 3, 4, 8)


def _bits(x):
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(f"u{x.dtype.itemsize}")


def _random(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    if x.dtype.itemsize == 2:  # special values must travel bit for bit
        flat = x.reshape(-1).view(np.uint16)
        flat[:4] = [0x8000, 0x7FC1 if dtype == BF16 else 0x7E01, 0xFFC0 if dtype == BF16 else 0xFE00, 0x0001]
    return x


# ----------------------------------------------------------------------------- layouts spelled out
def test_zigzag_world_2_on_8_rows():
    x = np.arange(8)
    assert shard_sequence(x, 0, 2).tolist() == [0, 1, 6, 7]
    assert shard_sequence(x, 1, 2).tolist() == [2, 3, 4, 5]
    assert shard_sequence(x, 0, 2, causal=False).tolist() == [0, 1, 2, 3]
    assert shard_sequence(x, 1, 2, causal=False).tolist() == [4, 5, 6, 7]


def test_zigzag_world_4_chunks():
    x = np.arange(16)  # 8 chunks of 2 rows
    want = {0: [0, 1, 14, 15], 1: [2, 3, 12, 13], 2: [4, 5, 10, 11], 3: [6, 7, 8, 9]}
    for r, rows in want.items():
        assert shard_sequence(x, r, 4).tolist() == rows
        assert global_positions(r, 4, 4).tolist() == rows


def test_world_1_is_identity():
    x = _random((6, 3, 4), np.float32)
    for causal in (False, True):
        assert np.array_equal(_bits(shard_sequence(x, 0, 1, causal=causal)), _bits(x))
        assert global_positions(0, 1, 6, causal=causal).tolist() == list(range(6))


# ------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.int64)])
def test_round_trip_seq_first(causal, world, dtype):
    s_full = 2 * world * 5
    x = _random((s_full, 3, 8), dtype, seed=world)
    parts = [shard_sequence(x, r, world, causal=causal) for r in range(world)]
    for p in parts:
        assert type(p) is np.ndarray and p.dtype == x.dtype and p.shape == (s_full // world, 3, 8)
        assert p.flags.c_contiguous
    back = unshard_sequence(parts, causal=causal)
    assert back.dtype == x.dtype and back.shape == x.shape
    assert np.array_equal(_bits(back), _bits(x))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("axis", [0, 1, 2, 3, -1, -2, -3, -4])
def test_round_trip_any_axis(causal, axis):
    world = 3
    shape = [2, 4, 3, 5]
    shape[axis] = 2 * world * 2
    x = _random(tuple(shape), BF16, seed=axis + 10)
    parts = [shard_sequence(x, r, world, causal=causal, axis=axis) for r in range(world)]
    ax = axis % 4
    for p in parts:
        want = list(shape)
        want[ax] //= world
        assert list(p.shape) == want
    back = unshard_sequence(parts, causal=causal, axis=axis)
    assert np.array_equal(_bits(back), _bits(x))
    # the sequence axis of [B, S, H, D] and of [S, H, D] is -3
    if axis == -3:
        pos = np.arange(shape[ax])
        for r, p in enumerate(parts):
            got = shard_sequence(pos, r, world, causal=causal)
            assert np.array_equal(_bits(p), _bits(np.take(x, got, axis=ax)))


def test_unshard_of_a_tuple_and_strided_parts():
    x = _random((24, 4), np.float32)
    parts = tuple(shard_sequence(x, r, 3) for r in range(3))
    assert np.array_equal(unshard_sequence(parts), x)
    y = _random((24, 8), np.float32)[:, ::2]  # a strided view shards and round-trips too
    parts = [shard_sequence(y, r, 2, causal=False) for r in range(2)]
    assert all(p.flags.c_contiguous for p in parts)
    assert np.array_equal(unshard_sequence(parts, causal=False), y)


def test_unshard_of_a_stacked_array():
    x = _random((2, 16, 3), np.float32)
    stacked = np.stack([shard_sequence(x, r, 4, axis=1) for r in range(4)])  # [W, B, S_local, H]
    assert np.array_equal(unshard_sequence(stacked, axis=1), x)
    _raises(lambda: unshard_sequence(np.zeros(4)), "NumPy or CuPy", "float64")  # its items are scalars


def test_result_is_a_copy():
    x = np.arange(8.0)
    for causal in (False, True):
        p = shard_sequence(x, 0, 2, causal=causal)
        p[:] = -1
        assert np.array_equal(x, np.arange(8.0))
    parts = [shard_sequence(x, r, 2) for r in range(2)]
    full = unshard_sequence(parts)
    full[:] = 0
    assert parts[0].tolist() == [0, 1, 6, 7]


# -------------------------------------------------------------------------------------- positions
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", WORLDS)
def test_global_positions_match_sharding(causal, world):
    s_local = 6
    s_full = s_local * world
    seen = []
    for r in range(world):
        pos = global_positions(r, world, s_local, causal=causal)
        assert pos.dtype == np.int64 and pos.shape == (s_local,)
        assert np.array_equal(pos, shard_sequence(np.arange(s_full), r, world, causal=causal))
        seen.append(pos)
    assert sorted(np.concatenate(seen).tolist()) == list(range(s_full))  # a partition of the sequence


def test_global_positions_formula():
    assert global_positions(1, 4, 6, causal=False).tolist() == [6, 7, 8, 9, 10, 11]
    # causal: chunks of 3; rank 1 of 4 holds chunks 1 and 6
    assert global_positions(1, 4, 6).tolist() == [3, 4, 5, 18, 19, 20]
    assert global_positions(0, 2, 0).tolist() == []


@pytest.mark.parametrize("world", WORLDS)
def test_zigzag_balances_causal_work(world):
    """Under causal masking a query at global position p sees p + 1 keys: the zigzag gives every
    rank the same total, and against every rank's key block the same amount (two full C x C chunk
    pairs, or the diagonal block's share for the rank's own block)."""
    c = 4
    s_local = 2 * c
    totals = []
    for r in range(world):
        qp = global_positions(r, world, s_local)
        totals.append(int((qp + 1).sum()))
        for src in range(world):
            kp = global_positions(src, world, s_local)
            pairs = int((kp[None, :] <= qp[:, None]).sum())
            want = 2 * c * c if src != r else 2 * c * c + c  # own block: 2 triangles with diagonals + 1 square
            assert pairs == want, (r, src, pairs, want)
    assert len(set(totals)) == 1, totals


# ----------------------------------------------------------------------------------------- errors
def _raises(fn, *words):
    with pytest.raises(ArgumentError) as e:
        fn()
    msg = str(e.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


def test_errors_divisibility():
    msg = _raises(lambda: shard_sequence(np.zeros(10), 0, 4), "2 * world = 8", "10")
    assert "pad" in msg and "causal=False" in msg
    _raises(lambda: shard_sequence(np.zeros(6), 0, 2), "multiple of 4")          # 6 % 4
    shard_sequence(np.zeros(6), 0, 2, causal=False)                              # 6 % 2 == 0: fine
    _raises(lambda: shard_sequence(np.zeros(7), 0, 2, causal=False), "multiple of world", "7")
    _raises(lambda: shard_sequence(np.zeros((4, 10)), 0, 4, axis=1), "axis 1", "10")


def test_errors_rank_world_axis():
    x = np.zeros((8, 2))
    _raises(lambda: shard_sequence(x, 2, 2), "rank", "[0, 2)")
    _raises(lambda: shard_sequence(x, -1, 2), "rank")
    _raises(lambda: shard_sequence(x, 0, 0), "world")
    _raises(lambda: shard_sequence(x, 0.0, 2), "rank", "integer")
    _raises(lambda: shard_sequence(x, 0, 2.5), "world", "integer")
    _raises(lambda: shard_sequence(x, True, 2), "rank")
    _raises(lambda: shard_sequence(x, 0, 2, axis=2), "axis 2", "out of range")
    _raises(lambda: shard_sequence(x, 0, 2, axis=-3), "axis -3")
    shard_sequence(x, np.int64(1), np.int32(2))  # NumPy integers are integers


def test_errors_types():
    _raises(lambda: shard_sequence([0, 1, 2, 3], 0, 2), "NumPy or CuPy", "list")
    _raises(lambda: unshard_sequence([]), "empty")
    _raises(lambda: unshard_sequence("ab"), "list")
    _raises(lambda: unshard_sequence(3), "list")
    _raises(lambda: unshard_sequence([np.zeros(4), [0, 0, 0, 0]]), "NumPy or CuPy")


def test_errors_unshard_mismatch_and_odd():
    _raises(lambda: unshard_sequence([np.zeros((4, 2)), np.zeros((6, 2))]), "same shape", "part 1")
    _raises(lambda: unshard_sequence([np.zeros(4), np.zeros(4, np.float16)]), "dtype")
    _raises(lambda: unshard_sequence([np.zeros(3), np.zeros(3)]), "even", "3")
    assert unshard_sequence([np.zeros(3), np.ones(3)], causal=False).tolist() == [0, 0, 0, 1, 1, 1]
    _raises(lambda: unshard_sequence([np.zeros((4, 2))], axis=2), "axis 2")


def test_errors_positions():
    _raises(lambda: global_positions(0, 2, 5), "even", "5")
    assert global_positions(0, 2, 5, causal=False).tolist() == [0, 1, 2, 3, 4]
    _raises(lambda: global_positions(0, 2, -2), "s_local")
    _raises(lambda: global_positions(3, 2, 4), "rank")
    _raises(lambda: global_positions(0, 2, 4.0), "s_local", "integer")


def test_argument_error_is_a_value_error():
    with pytest.raises(ValueError):
        shard_sequence(np.zeros(3), 0, 2)
