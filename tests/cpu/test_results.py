"""bench/results: every results file has the layout the developers' guide fixes (bench/harness.py
writes it) and figures that agree with each other: an op's row has its baseline, the speedup is
baseline / mkernel, the fraction of the bound is bound / mkernel and at most 1, the file's name
matches its GPU, rank and node counts, and the commit names one."""

import json
import math
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
NAME = re.compile(r"^(?P<op>[a-z_]+)-(?:(?P<gpus>\d+)gpu|(?P<ranks>\d+)rank-(?P<mode>mps|timesliced))"
                  r"(?:-(?P<nodes>\d+)node)?\.json$")
TOP = ("op", "device", "gpus", "nodes", "transport", "date", "commit", "rows")
ROW = ("shape", "mkernel_ms", "baseline_ms", "speedup", "bound_ms")
# Files that time no op against a baseline: their rows are rates (bench/transport.py).
RATES = {"transport"}
# Known exceptions, each with its reason (re-run the benchmark to clear it).
DIRTY = {"transport-2rank-mps.json": "session 9 measured it from a tree with uncommitted changes"}
FILES = sorted(RESULTS.glob("*.json"))


def test_there_are_results():
    assert FILES, f"no results in {RESULTS}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_layout_and_name(path):
    doc = json.loads(path.read_text())
    assert all(k in doc for k in TOP), f"missing {[k for k in TOP if k not in doc]}"
    m = NAME.match(path.name)
    assert m, f"{path.name}: not <op>-<N>gpu[-<nodes>node].json or <op>-<N>rank-mps[-<nodes>node].json"
    assert doc["op"] == m["op"], (doc["op"], m["op"])
    assert doc["nodes"] == int(m["nodes"] or 1)
    if m["gpus"]:
        assert doc["gpus"] == int(m["gpus"])
    else:  # ranks sharing GPUs: as many ranks as the name says
        assert doc["gpus"] * doc.get("ranks_per_gpu", 1) == int(m["ranks"]), (doc["gpus"], doc.get("ranks_per_gpu"))
    commit = str(doc["commit"])
    if path.name in DIRTY:
        assert commit.endswith("-dirty"), f"{path.name} is listed as dirty ({DIRTY[path.name]}) but is not"
    else:
        assert re.fullmatch(r"[0-9a-f]{7,40}", commit), f"commit {commit!r} names no commit"
    assert doc["rows"], "no rows"


# Bounds at the copy rate (read + write bytes per second) of read-only kernels: reads alone stream
# faster (the decode GEMM's trace read B at 4.4-4.7 TB/s against a 4.26 copy: bench/NOTES.md).
BEAT_SLACK = {"gemm_decode-1gpu.json": 1.10}


@pytest.mark.parametrize("path", [p for p in FILES if NAME.match(p.name) and NAME.match(p.name)["op"] not in RATES],
                         ids=lambda p: p.name)
def test_rows_time_mkernel_against_a_baseline(path):
    doc = json.loads(path.read_text())
    mps = NAME.match(path.name)["mode"] == "mps"
    for r in doc["rows"]:
        what = f"{path.name} {r.get('shape')}"
        assert all(k in r for k in ROW), f"{what}: missing {[k for k in ROW if k not in r]}"
        mk, base, bound = r["mkernel_ms"], r["baseline_ms"], r["bound_ms"]
        assert mk > 0 and base > 0 and bound > 0, f"{what}: {mk}, {base}, {bound}"
        assert math.isclose(r["speedup"], base / mk, rel_tol=1e-3), f"{what}: speedup {r['speedup']} != {base / mk}"
        if r.get("fraction_of_bound") is not None:
            assert math.isclose(r["fraction_of_bound"], bound / mk, rel_tol=2e-3), f"{what}: fraction_of_bound"
        # a physical bound is never beaten (2%: the rate and the op measured apart); a row that beats
        # it has a wrong bound (session 40: tp_decode's took reads at half the copy rate)
        slack = BEAT_SLACK.get(path.name, 1.02)
        assert bound <= slack * mk, f"{what}: mkernel {mk} ms beats its bound {bound} ms: the bound is wrong"
        if mps:
            assert r.get("mps") is True, f"{what}: a row of ranks under MPS says mps: {r.get('mps')!r}"
