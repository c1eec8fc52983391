"""tools/ring_trace.py's summary on synthetic spans: per kind and step, counts and end times
relative to the launch's announce, as ring_attention.cu writes the ids (RING_TRACE_*)."""

import sys

from tests.helpers.tools import load_tool

ring_trace = load_tool("ring_trace")


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


def test_command_line_summarises_files(tmp_path, monkeypatch, capsys):
    """`--summarize FILES` (tp_trace.trace_cli, shared with moe_trace.py) reads Chrome trace files."""
    import json

    ev = [{"cat": "control", "ts": 0.0, "dur": 0.1, "tid": 0, "args": {"id": 0x80000001, "block": 0}},
          {"cat": "send", "ts": 1.0, "dur": 2.0, "tid": 1, "args": {"id": 0x01000000 | 3, "block": 1}},
          {"cat": "control", "ts": 9.0, "dur": 0.001, "tid": 1, "args": {"id": 0x40000001, "block": 1}}]
    path = tmp_path / "trace.rank0.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    monkeypatch.setattr(sys, "argv", ["ring_trace.py", "--summarize", str(path)])
    ring_trace.main()
    out = capsys.readouterr().out
    assert "launch: last CTA exit at       9.0 us (1 CTAs)" in out
    assert "step 0 chunk sent (copied or queued)      1  start      1.0  end first      3.0" in out
