"""tools/moe_trace.py's summary on synthetic spans, with the ids the fused MoE kernels write
(MOE_TRACE_* in mkernel/cuda/ops/moe_dispatch.cuh): a dispatch + GEMM launch and a GEMM + combine one."""

import re
from pathlib import Path

from tests.helpers.tools import load_tool

ROOT = Path(__file__).resolve().parents[2]
moe_trace = load_tool("moe_trace")


def test_kinds_are_the_headers_span_ids():
    text = (ROOT / "mkernel" / "cuda" / "ops" / "moe_dispatch.cuh").read_text()
    ids = {m.group(1): int(m.group(2), 16) for m in re.finditer(r"MOE_TRACE_(\w+) = 0x([0-9a-fA-F]+)u", text)}
    assert ids["ANNOUNCE"] == moe_trace.ANNOUNCE and ids["EXIT"] == moe_trace.EXIT
    kinds = {v >> 24 for k, v in ids.items() if k not in ("ANNOUNCE", "EXIT")}
    assert kinds == set(moe_trace.KINDS)


def _launch(t0, kind_spans):
    spans = [("control", 0x80000000 | 5, t0, t0 + 0.1, 0)]
    spans += kind_spans
    spans += [("control", 0x40000000 | b, t0 + 100 + b, t0 + 100 + b, b) for b in range(3)]
    return spans


def test_a_dispatch_launch_and_a_combine_launch():
    t0 = 50.0
    dispatch = _launch(t0, [("send", 0x07000000 | c, t0, t0 + 40 + c, 1) for c in range(2)]
                       + [("wait", 0x08000000 | 1, t0 + 5, t0 + 30 + w, 2) for w in range(4)])
    text = "\n".join(moe_trace.summarize(dispatch))
    assert text.startswith("dispatch + GEMM: last CTA exit at     102.0 us (3 CTAs)")
    assert "dispatch CTA's rows sent              2  start       0.0  end first      40.0" in text
    assert "dispatch: a warp's bundle in          4  start       5.0  end first      30.0" in text
    combine = _launch(t0, [("compute", 0x01000000 | c, t0, t0 + 60, 1) for c in range(3)])
    text = "\n".join(moe_trace.summarize(combine))
    assert text.startswith("kernel: last CTA exit at     102.0 us (3 CTAs)")
    assert "GEMM CTA done                         3" in text and "bundle" not in text
    assert moe_trace.summarize([]) == ["no launch found (was MKERNEL_TRACE set before mkernel.init?)"]
