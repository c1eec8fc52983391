"""CPU: the decode GEMM (mkernel/engines/gemm_decode.py): its argument mirror, the choice of the
path and of the CTAs' runs, and every instantiation compiling without spills, stack or local memory,
in its residency's registers, with the TMA and wgmma (HGMMA) it is built on."""

import pytest

from mkernel import config
from mkernel.core.errors import ArgumentError
from mkernel.engines import gemm_decode as dec
from mkernel.runtime import compile as mkc

from tests.helpers import sass
from tests.helpers.c_layout import assert_same_layout


def test_args_mirror_matches_c_layout(tmp_path):
    assert_same_layout("gemm_decode_args.cuh", dec.MkDecodeArgs, tmp_path, c_align=64)


@pytest.mark.parametrize("N,K", [(8192, 8192), (4096, 14336), (14336, 4096), (10240, 8192), (8192, 28672),
                                 (8200, 1032), (3000, 2000), (8, 8), (264, 136), (128, 512), (100000, 64)])
@pytest.mark.parametrize("rows", dec.ROW_BLOCKS)
@pytest.mark.parametrize("split", ["stream", "even"])
def test_runs_cut_the_units_evenly_and_slots_hold_every_block(N, K, rows, split):
    with config.override(gemm_decode_split=split):
        ctas, slots = dec.runs(N, K, rows)  # the shape alone: the same bits on any number of SMs
    kb, blocks = -(-K // dec.BK), -(-N // rows)
    units = kb * blocks
    assert 1 <= ctas <= units and ctas <= dec.SPLIT_SMS
    starts = [c * units // ctas for c in range(ctas + 1)]
    lengths = [b - a for a, b in zip(starts, starts[1:])]
    assert min(lengths) >= 1 and max(lengths) - min(lengths) <= 1  # equal runs, none empty
    for x in (0, units // 2, units - 1):  # the kernel's inverse (decode_cta_of)
        c = dec.cta_of(x, units, ctas)
        assert starts[c] <= x < starts[c + 1]
    most = max(dec.cta_of((b + 1) * kb - 1, units, ctas) - dec.cta_of(b * kb, units, ctas) + 1 for b in range(blocks))
    assert most <= slots <= ctas
    if split == "even" and blocks <= dec.SPLIT_SMS and ctas < units:
        assert ctas % blocks == 0


def test_the_path_is_chosen_by_shape_layout_and_knob():
    assert dec.eligible(1, 4096, 4096, True, controls=False) and dec.eligible(64, 4096, 4096, True, controls=False)
    # 65-128 tokens where the runs fill the SMs (4096 x 4096: 128 runs; 10240 x 8192: 80), then the engine
    assert dec.eligible(128, 4096, 4096, True, controls=False) and not dec.eligible(128, 10240, 8192, True,
                                                                                   controls=False)
    assert dec.eligible(128, 14336, 4096, True, controls=False)  # 112 runs
    assert not dec.eligible(129, 4096, 4096, True, controls=False)
    assert not dec.eligible(8, 4096, 4096, False, controls=False)  # B as [K, N]: the engine
    assert not dec.eligible(8, 4096, 4096, True, controls=True)  # a fused op's controls address the engine's tiles
    assert not dec.eligible(8, dec.MAX_N + 1, 4096, True, controls=False)
    with config.override(gemm_decode_max_m=16):
        assert dec.eligible(16, 4096, 4096, True, controls=False)
        assert not dec.eligible(17, 4096, 4096, True, controls=False)
    with config.override(gemm_decode_max_m=0):
        assert not dec.eligible(1, 4096, 4096, True, controls=False)
    assert [dec.m_tile(m) for m in (1, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256)] == \
        [8, 8, 16, 16, 32, 32, 64, 64, 128, 128, 256, 256]  # every token in one CTA: B read once
    with config.override(gemm_decode_max_m=256):
        assert dec.eligible(256, 4096, 4096, True, controls=False)
        assert not dec.eligible(257, 4096, 4096, True, controls=False)
    with pytest.raises(ArgumentError), config.override(gemm_decode_max_m=257):
        pass


def test_row_blocks_by_shape_and_knob():
    # 64 rows only where that leaves every row block to one CTA and 128 does not
    assert [dec.row_block(N, K) for N, K in ((8192, 8192), (4096, 14336), (14336, 4096), (10240, 8192), (8, 8))] == \
        [64, 128, 128, 128, 128]
    for rows in dec.ROW_BLOCKS:
        with config.override(gemm_decode_rows=rows):
            assert dec.row_block(8192, 8192) == rows
            assert all(dec.kernel_expr(0, 0, mt, rows) in dec.EXPRESSIONS for mt in dec.M_TILES)
            assert all(dec.smem_bytes(mt, rows) <= 227 * 1024 for mt in dec.M_TILES)  # one CTA per SM
    # 64 and 128 columns: 64 rows where their blocks fit the SMs on as many CTAs and K is not large
    for mt in (64, 128):
        assert [dec.row_block(N, K, mt) for N, K in ((8192, 8192), (4096, 14336), (8192, 4096), (14336, 4096),
                                                     (10240, 8192), (8192, 28672), (4288, 4096))] == \
            [64, 64, 64, 128, 128, 128, 128]
    assert dec.row_block(8192, 8192, 32) == 64 and dec.row_block(4096, 14336, 32) == 128
    assert dec.row_block(8192, 8192, 256) == 128
    for bad in ({"gemm_decode_rows": 96}, {"gemm_decode_rows": 256}, {"gemm_decode_split": "k"},
                {"gemm_overlap": "tail"}, {"gemm_overlap": 1}):
        with pytest.raises(ArgumentError), config.override(**bad):
            pass


def test_staged_store_room_fits_beside_the_ring_from_32_to_128_tokens():
    # gemm_decode.cu's static_asserts pin DecodeCfg<128, 128>::SMEM_OUT and OUT_STAGED to these
    assert dec.smem_bytes(128, 128, True) == 230528
    for rows in dec.ROW_BLOCKS:
        for mt in dec.M_TILES:
            room = rows // 16 * mt * 32  # each consumer warp's 16 rows x mt tokens of 16-bit out
            assert dec.smem_bytes(mt, rows, True) >= dec.smem_bytes(mt, rows) + room
            assert dec.out_staged(mt, rows) == (dec.TMA_OUT_MIN_MT <= mt <= 128)


def test_input_error_codes_match_the_header():
    import re

    from mkernel.runtime import sync

    text = (mkc.CUDA_DIR / "engines" / "gemm_decode_args.cuh").read_text()
    codes = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define MK_DECODE_ERR_(\w+) (\d+)u", text)}
    assert codes == {"SMEM": sync.DECODE_ERR_SMEM}
    st = sync.MkStatus(code=sync.ERR_INPUT, op=sync.OP_ID["gemm"], rank=0, peer=-1, where=sync.DECODE_ERR_SMEM,
                       expected=4096, seen=1024)
    assert "shared memory" in str(sync.error_from_status(st))


@pytest.fixture(scope="module")
def compiled():
    return mkc.compile_spec(dec.SPEC, use_cache=False)


def test_every_instantiation_compiles_in_its_residency_of_registers(compiled):
    assert set(compiled.lowered) == set(dec.EXPRESSIONS)
    funcs = compiled.resources["functions"]
    assert len(funcs) == len(dec.EXPRESSIONS), funcs
    for expr, name in compiled.lowered.items():
        res = funcs[name]
        rows = int(expr.rstrip(">").split(",")[-1])
        assert res.get("stack", 0) == 0, (name, res)
        assert res.get("spill_stores", 0) == 0 and res.get("spill_loads", 0) == 0, (name, res)
        assert res.get("registers", 0) * dec.threads(rows) <= 65536, (name, res)
    assert not compiled.resources["warnings"], compiled.resources["warnings"]


def test_sass_streams_b_with_tma_into_wgmma(compiled):
    kernels = sass.kernels(compiled.cubin)
    for name, text in kernels.items():
        assert "HGMMA.64x" in text, name  # both operands from the swizzled stages
        assert "UTMALDG.2D" in text, name  # B and A: TMA boxes
        assert "LDL" not in text and "STL" not in text, name
        # the overlapped launch's wait and trigger (config.gemm_overlap: griddepcontrol)
        assert "ACQBULK" in text and "PREEXIT" in text, name
    for expr, name in compiled.lowered.items():  # 16-bit outputs: stmatrix into the stage, a TMA store
        out, mt, rows = (int(x) for x in expr.rstrip(">").split("<")[1].split(",")[1:])
        text = kernels[name]
        assert (("STSM" in text and "UTMASTG" in text) == (out != dec.OUT_F32 and dec.out_staged(mt, rows))), expr
