"""CPU tests of mkernel.ring_attention: the argument structs' layout, the module and its export. The GPU
tests are tests/gpu/test_ring_attention_gpu.py, test_ring_attention_errors_gpu.py and
test_ring_attention_worlds_gpu.py."""

import importlib

import pytest

from tests.helpers.ring_cases import mra


def test_args_layout_matches_host_compiler(tmp_path):
    """MkRingArgs and MkAttnPos mirrors against ring_args.cuh / attn_args.cuh (g++); alignof of the
    64-byte aligned struct is checked apart (ctypes cannot express alignas(64))."""
    from tests.helpers.c_layout import c_offsets, py_offsets

    ma = importlib.import_module("mkernel.engines.attention")
    for header, cls, align in (("ring_args.cuh", mra.MkRingArgs, 64), ("attn_args.cuh", ma.MkAttnPos, 4)):
        c = c_offsets(header, cls.__name__, [name for name, *_ in cls._fields_], tmp_path)
        py = py_offsets(cls)
        assert c.pop("alignof") == align
        py.pop("alignof")
        assert c == py, f"{cls.__name__} mirror differs from {header}"


def test_module_and_export():
    import mkernel as mk

    assert callable(mra.ring_attention)
    assert mk.ring_attention is mra.ring_attention, \
        "mkernel.ring_attention is not the function (not exported in mkernel/__init__.py?)"
    assert "ring_attention" in mk.__all__


def test_rank0_sends_only_what_other_ranks_read():
    """Under the zigzag (one batch) rank 0's second chunk holds the sequence's last positions, which
    only its own queries see: its block travels as the key blocks of its first chunk (whole blocks,
    so nothing a tile loads is stale); otherwise, and with several batches, every row."""
    from mkernel.engines import attention as attn
    from mkernel.ops import ring_attention as ring_op

    assert attn.BLOCK_N == 128
    assert ring_op.rows_sent_of_rank0(1, 4096, True) == 2048
    assert ring_op.rows_sent_of_rank0(1, 330, True) == 256  # 165 rows round up to 2 key blocks
    assert ring_op.rows_sent_of_rank0(1, 200, True) == 128  # 100 rows: one key block
    assert ring_op.rows_sent_of_rank0(1, 100, True) == 100  # one key block is the whole block
    assert ring_op.rows_sent_of_rank0(1, 4096, False) == 4096
    assert ring_op.rows_sent_of_rank0(2, 4096, True) == 8192


@pytest.mark.parametrize("half_bytes,world", [(8 << 20, 2), (84480, 2), (64 << 30, 8), (16, 4), (3 << 30, 3)])
def test_remote_chunks_cover_each_half_within_the_proxy_flags(half_bytes, world):
    from mkernel.ops import ring_attention as ring_op

    chunk, chunks = ring_op.remote_chunks(half_bytes, world)
    assert chunk % 16 == 0 and chunk >= 2 * ring_op.CHUNK_BYTES and chunks % 2 == 0
    assert (chunks // 2 - 1) * chunk < half_bytes <= chunks // 2 * chunk
    assert chunks * (world - 1) <= ring_op.PROXY_CHUNK_FLAGS
