"""tools/tp_trace.py's summary on synthetic spans: the last launch is cut out by its announce span
and the item kinds, roles and times come out of the ids as the TP kernels write them."""

from tests.helpers.tools import load_tool

tp_trace = load_tool("tp_trace")


def _ev(cat, ident, ts, dur, sm=0):
    return {"cat": cat, "ts": ts, "dur": dur, "tid": sm, "args": {"id": ident, "block": 0}}


def _launch(epoch, t0):
    """A launch: 4 GEMM tiles, 2 node partials sent, 2 own tiles reduced, 2 forwards, exits."""
    ev = [_ev("control", 0x80000000 | epoch, t0, 0.1)]
    ev += [_ev("compute", 0x04000000 | i, t0 + 10 * (i + 1), 0.001, sm=1) for i in range(4)]
    for i in range(4):
        ev.append(_ev("wait", i, t0 + 10 * i, 5.0, sm=2))
        ev.append(_ev("send" if i < 2 else "intra-node", i, t0 + 10 * i + 5, 5.0, sm=2))
    for i in range(2):
        ev.append(_ev("wait", 0x01000000 | i, t0 + 40 + 10 * i, 8.0, sm=3))
        ev.append(_ev("recv", 0x01000000 | i, t0 + 48 + 10 * i, 2.0, sm=3))
    ev += [_ev("control", 0x40000000 | b, t0 + 70, 0.001, sm=b) for b in range(4)]
    return ev


def test_summary_of_the_last_launch():
    events = _launch(1, 0.0) + _launch(2, 1000.0)
    spans = tp_trace.launches(events)[-1]
    assert min(s[2] for s in spans) == 1000.0 and len(spans) == len(_launch(2, 0.0))
    text = "\n".join(tp_trace.summarize(spans))
    assert text.startswith("launch      70.0 us")
    assert "GEMM tiles      4" in text and "tail after the last:     30.0 us" in text
    assert "reduce  send            2" in text and "reduce  intra-node      2" in text
    assert "forward recv            2  done at 25/50/75/100%:     50.0,     50.0,     60.0,     60.0 us" in text
    assert "forward waits           2       16.0 us summed" in text
    # items by where they ran: the reductions on SM 2 and forwards on SM 3 (no GEMM tile there)
    assert "on comm SMs:      2 items, median     5.0 us, last done at      40.0 us" in text
    assert "on GEMM SMs" not in text


def test_a_cta_that_stamps_its_entry_before_the_announce_belongs_to_its_launch():
    early = _ev("control", 0x40000000 | 7, 999.9, 70.0, sm=7)  # launch 2's CTA, entered 0.1 us ahead
    runs = tp_trace.launches(_launch(1, 0.0) + _launch(2, 1000.0) + [early])
    assert 999.9 not in [s[2] for s in runs[0]] and round(tp_trace.launch_us(runs[0]), 3) == 70.001
    assert len(runs[1]) == len(_launch(2, 0.0)) + 1


def test_launches_in_order_and_any_one_summarised(tmp_path, capsys):
    """Every launch is cut at the next one's announce; --launch picks one, and the lengths of all
    of them are listed first (the first call against the steady ones)."""
    import json

    events = _launch(1, 0.0) + _launch(2, 1000.0)[:-1] + _launch(3, 2000.0)  # launch 2 misses one exit
    runs = tp_trace.launches(events)
    assert [min(s[2] for s in r) for r in runs] == [0.0, 1000.0, 2000.0]
    assert [round(tp_trace.launch_us(r), 3) for r in runs] == [70.001, 70.001, 70.001]
    p = tmp_path / "trace.rank0.json"
    p.write_text(json.dumps({"traceEvents": events[::-1]}))  # any order in the file
    tp_trace.summarize_files([str(p)], launch=0)
    out = capsys.readouterr().out
    assert "3 launches, us: 70 70 70" in out and "launch      70.0 us" in out
    assert "gaps between them, us: 930 930" in out  # each starts 1000 us after the last, 70 us long
    tp_trace.summarize_files([str(p)], launch=5)
    assert "no launch found" in capsys.readouterr().out


def test_no_launch():
    assert tp_trace.launches([]) == []
    assert "no launch found" in tp_trace.summarize([])[0]


def test_files_of_ranks_sharing_a_gpu_are_aligned_on_one_clock(tmp_path, capsys):
    """Each trace file's ts are relative to its first span; t0_ns (that span's %globaltimer, one
    clock for ranks sharing a GPU) puts the ranks' last launches on one axis."""
    import json

    paths = []
    for rank, (t0_ns, shift) in enumerate(((5_000_000, 0.0), (5_250_000, 30.0))):
        p = tmp_path / f"trace.rank{rank}.json"
        p.write_text(json.dumps({"traceEvents": _launch(1, shift) + _launch(2, 1000.0 + shift),
                                 "otherData": {"t0_ns": t0_ns}}))
        paths.append(str(p))
    tp_trace.summarize_files(paths)
    out = capsys.readouterr().out
    assert "launch starts on one clock: trace.rank0.json +0.0 us, trace.rank1.json +280.0 us" in out
