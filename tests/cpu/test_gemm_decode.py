"""CPU: the decode GEMM (mkernel/engines/gemm_decode.py): its argument mirror, the choice of the
path and of the K ranges, and every instantiation compiling without spills, stack or local memory,
with two CTAs of registers per SM and the HMMA it is built on."""

import pytest

from mkernel import config
from mkernel.core.errors import ArgumentError
from mkernel.engines import gemm_decode as dec
from mkernel.runtime import compile as mkc

from tests.helpers import sass
from tests.helpers.c_layout import assert_same_layout


def test_args_mirror_matches_c_layout(tmp_path):
    assert_same_layout("gemm_decode_args.cuh", dec.MkDecodeArgs, tmp_path)


@pytest.mark.parametrize("N,K", [(8192, 8192), (4096, 14336), (14336, 4096), (10240, 8192), (8192, 28672),
                                 (8200, 1032), (3000, 2000), (8, 8), (264, 136), (128, 512), (100000, 64)])
@pytest.mark.parametrize("mt", dec.M_TILES)
@pytest.mark.parametrize("groups", [1, 3])
def test_k_ranges_cover_k_once_in_whole_steps(N, K, mt, groups):
    splits, k_split = dec.split_k(N, K, mt, groups)  # the shape alone: the same bits on any number of SMs
    step = 32 * dec.unroll(mt)
    assert splits >= 1 and k_split % step == 0
    assert (splits - 1) * k_split < K <= splits * k_split  # every range starts inside K
    assert splits == 1 or k_split >= dec.MIN_SPLIT_K
    blocks = -(-N // dec.ROWS) * groups
    assert splits == 1 or blocks * splits <= dec.RESIDENT * dec.SPLIT_SMS + blocks  # about one wave on 132


def test_the_path_is_chosen_by_shape_layout_and_knob():
    assert dec.eligible(1, 4096, True, controls=False) and dec.eligible(16, 4096, True, controls=False)
    assert not dec.eligible(17, 4096, True, controls=False)  # 17-64 tokens: the engine with split K
    assert not dec.eligible(8, 4096, False, controls=False)  # B as [K, N]: the engine
    assert not dec.eligible(8, 4096, True, controls=True)  # a fused op's controls address the engine's tiles
    assert not dec.eligible(8, dec.MAX_N + 1, True, controls=False)  # the row blocks fill the grid's y
    with config.override(gemm_decode_max_m=32):
        assert dec.eligible(32, 4096, True, controls=False) and not dec.eligible(33, 4096, True, controls=False)
    with config.override(gemm_decode_max_m=0):
        assert not dec.eligible(1, 4096, True, controls=False)
    assert [dec.m_tile(m) for m in (1, 8, 9, 16, 17, 32)] == [(8, 1), (8, 1), (16, 1), (16, 1), (32, 1), (32, 1)]
    assert [dec.m_tile(m) for m in (33, 64, 65, 256)] == [(32, 2), (32, 2), (32, 3), (32, 8)]
    with config.override(gemm_decode_group=64):
        assert [dec.m_tile(m) for m in (33, 64, 65)] == [(64, 1), (64, 1), (64, 2)]
    with config.override(gemm_decode_max_m=256):
        assert dec.eligible(256, 4096, True, controls=False) and not dec.eligible(257, 4096, True, controls=False)
    with pytest.raises(ArgumentError), config.override(gemm_decode_group=48):
        pass


def test_unroll_and_waves_knobs_pick_instantiated_kernels():
    assert [dec.unroll(mt) for mt in dec.M_TILES] == [4, 4, 4, 2]  # the shallower of each pair
    with config.override(gemm_decode_unroll=4):
        assert [dec.unroll(mt) for mt in dec.M_TILES] == [4, 4, 4, 4]
    with config.override(gemm_decode_unroll=8):
        assert [dec.unroll(mt) for mt in dec.M_TILES] == [8, 8, 8, 2]  # 8 exists up to 32 tokens only
    assert all(dec.kernel_expr(0, 0, mt, dec.unroll(mt)) in dec.EXPRESSIONS for mt in dec.M_TILES)
    one = dec.split_k(8192, 8192, 8)[0]
    with config.override(gemm_decode_waves=2):
        assert dec.split_k(8192, 8192, 8)[0] == 2 * one
    for bad in ({"gemm_decode_unroll": 3}, {"gemm_decode_waves": 3}):
        with pytest.raises(ArgumentError), config.override(**bad):
            pass


@pytest.fixture(scope="module")
def compiled():
    return mkc.compile_spec(dec.SPEC, use_cache=False)


def test_every_instantiation_compiles_in_two_ctas_of_registers(compiled):
    assert set(compiled.lowered) == set(dec.EXPRESSIONS)
    funcs = compiled.resources["functions"]
    assert len(funcs) == len(dec.EXPRESSIONS), funcs
    for name, res in sorted(funcs.items()):
        assert res.get("stack", 0) == 0, (name, res)
        assert res.get("spill_stores", 0) == 0 and res.get("spill_loads", 0) == 0, (name, res)
        assert res.get("registers", 0) <= 65536 // (dec.RESIDENT * dec.THREADS), (name, res)
    assert not compiled.resources["warnings"], compiled.resources["warnings"]


def test_sass_streams_b_with_wide_loads_into_hmma(compiled):
    for name, text in sass.kernels(compiled.cubin).items():
        assert "HMMA.16816.F32" in text, name
        assert "LDG.E.NA.128" in text, name  # B: 16-byte loads that skip L1
        assert "LDL" not in text and "STL" not in text, name
