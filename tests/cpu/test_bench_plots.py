"""The benchmarks' plots (drawn on the GPU machine after each run, or from a results file with
``--plot``) draw every results file they own, here on the CPU: a plot's bug does not wait for a
device session to show."""

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
# (benchmark module, results file, how its plot takes the results dict and the PNG's path)
PLOTS = [("gemm", "gemm-1gpu.json", lambda m, doc, path: m.plot(doc, path)),
         ("gemm_decode", "gemm_decode-1gpu.json", lambda m, doc, path: m.plot(doc, path)),
         ("tp_decode", "gemm_allreduce_decode-2rank-mps.json", lambda m, doc, path: m.plot(doc, path)),
         ("attention", "attention-1gpu.json", lambda m, doc, path: m.plot(doc["rows"], path, doc["device"])),
         ("tp", "gemm_allreduce-2rank-mps.json",
          lambda m, doc, path: m.plot(doc["op"], doc["rows"], path, shared=True)),
         ("controller", "controller-2rank-mps.json",
          lambda m, doc, path: m.plot("gemm_allreduce", [r for r in doc["rows"] if r["op"] == "gemm_allreduce"], path))]


@pytest.mark.parametrize("module,results,draw", PLOTS, ids=[f"{m}:{r}" for m, r, _ in PLOTS])
def test_plot_draws_its_results_file(module, results, draw, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(BENCH))
    mod = importlib.import_module(module)
    path = tmp_path / "plot.png"
    draw(mod, json.loads((BENCH / "results" / results).read_text()), path)
    assert path.stat().st_size > 10_000, path
    sys.modules.pop(module, None)


# Files drawn by a plot of their own benchmark that takes more than one file (bench/tp.py,
# bench/controller.py: above) or that hold rates, not an op against its baseline (transport).
NOT_BY_PLOT_PY = ("controller", "transport", "gemm_allreduce-", "gemm_reduce_scatter-", "allgather_gemm-", "attention-")
RESULTS = sorted(p for p in (BENCH / "results").glob("*.json") if not p.name.startswith(NOT_BY_PLOT_PY))


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_every_op_file_draws_and_its_png_is_committed(path, tmp_path, monkeypatch):
    """bench/plot.py draws each op's file (its benchmark's own plot, or the per-row bars), and the
    PNG beside the file is there: a results file without its picture is half a result."""
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(BENCH))
    plot = importlib.import_module("plot")
    out = plot.draw(path, tmp_path / "plot.png")
    assert out.stat().st_size > 10_000, out
    assert path.with_suffix(".png").exists(), f"{path.name}: no PNG beside it (python3 bench/plot.py {path.name})"
