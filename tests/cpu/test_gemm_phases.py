"""tools/gemm_phases.py on synthetic spans: the decode kernel's stamps (ids as gemm_decode_args.cuh
defines them) and the engine's tile spans, grouped by CTA and turned into a call's phases."""

import re
from pathlib import Path

from tests.helpers.tools import load_tool

ROOT = Path(__file__).resolve().parents[2]
gemm_phases = load_tool("gemm_phases")


def test_ids_match_the_header():
    text = (ROOT / "mkernel" / "cuda" / "engines" / "gemm_decode_args.cuh").read_text()
    defs = {k: int(v, 16 if v.startswith("0x") else 10) for k, v in
            re.findall(r"#define (MK_DECODE_TRACE|MK_DECODE_PH_\w+) (0x[0-9a-fA-F]+|\d+)u", text)}
    assert defs == {"MK_DECODE_TRACE": gemm_phases.TRACE, "MK_DECODE_PH_FILL": gemm_phases.PH_FILL,
                    "MK_DECODE_PH_MMA": gemm_phases.PH_MMA, "MK_DECODE_PH_PARTIAL": gemm_phases.PH_PARTIAL,
                    "MK_DECODE_PH_OUT": gemm_phases.PH_OUT}


def _stamp(block, phase, rb, start, end):
    return (start, end, block, block, 0, gemm_phases.TRACE | phase << 24 | rb)


def test_decode_phases_of_one_call():
    spans = [  # the CTAs' slots interleaved; CTA 0 covers block 5 whole, CTA 1 ends block 6's sum
        _stamp(1, 0, 6, 120, 300), _stamp(0, 0, 5, 100, 200), _stamp(1, 1, 6, 300, 800), _stamp(1, 2, 6, 800, 850),
        _stamp(0, 1, 5, 200, 900), _stamp(1, 3, 6, 850, 990), _stamp(0, 3, 5, 900, 950),
        (5, 6, 1, 1, 4, 0x200),  # another kernel's span in the same buffer
        (7, 8, 1, 1, 0, 12),  # an engine tile's
    ]
    ctas = gemm_phases.per_cta(spans, decode=True)
    assert sorted(ctas) == [0, 1] and [s[0] for s in ctas[1]] == [0, 1, 2, 3]
    assert gemm_phases.decode_phases(ctas) == {
        "entry": [0, 20], "landed": [100, 200], "mma_end": [800, 700], "end": [850, 890], "partial": [50],
        "store": [50], "sum": [140]}


def test_engine_phases_of_one_call():
    spans = [(100, 300, 2, 1, 0, 4), (150, 650, 3, 0, 0, 5), (300, 700, 2, 1, 0, 9),
             _stamp(0, 0, 5, 100, 200), (5, 6, 1, 1, 4, 0x200)]  # a decode stamp, another role: not tiles
    ctas = gemm_phases.per_cta(spans, decode=False)
    assert ctas == {0: [(0, 5, 150, 650)], 1: [(0, 4, 100, 300), (0, 9, 300, 700)]}
    assert gemm_phases.engine_phases(ctas) == {"start": [50, 0], "tiles": [1, 2], "first": [500, 200],
                                               "later": [400], "end": [550, 600]}
