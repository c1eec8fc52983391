"""tools/ring_trace.py's summary on synthetic spans: per kind and step, counts and end times
relative to the launch's announce, as ring_attention.cu writes the ids (RING_TRACE_*)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
spec = importlib.util.spec_from_file_location("ring_trace", ROOT / "tools" / "ring_trace.py")
ring_trace = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ring_trace)


def test_summary_per_kind_and_step():
    t0 = 100.0
    spans = [("control", 0x80000000 | 7, t0, t0 + 0.1, 0)]
    spans += [("send", 0x01000000 | 0 << 16 | c, t0 + c, t0 + c + 1, 1) for c in range(4)]  # step 0's WRITEs
    spans += [("recv", 0x02000000 | 1 << 16 | c, t0, t0 + 100 + 10 * c, 2) for c in range(4)]  # step 1 landed
    spans += [("control", 0x03000000 | 1 << 16, t0, t0 + 130, 2)]
    spans += [("compute", 0x05000000 | s << 16 | i, t0 + 50 * s + i, t0 + 50 * s + i + 2, 3)
              for s in (0, 1) for i in range(4)]
    spans += [("control", 0x40000000 | b, t0 + 200 + b, t0 + 200 + b, b) for b in range(3)]
    text = "\n".join(ring_trace.summarize(spans))
    assert text.startswith("launch: last CTA exit at     202.0 us (3 CTAs)")
    assert "step 0 chunk sent (copied or queued)      4  start      0.0  end first      1.0" in text
    assert "step 1 chunk landed (receiver)            4" in text and "last    130.0 us" in text
    assert "step 1 block all here (ARRIVED)           1" in text
    assert "step 1 half tile merged                   4  start     50.0" in text and "(summed       8.0 us)" in text
    assert ring_trace.summarize([]) == ["no launch found (was MKERNEL_TRACE set before mkernel.init?)"]
