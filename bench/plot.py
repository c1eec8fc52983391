#!/usr/bin/env python3
"""Draws the PNG of stored results files next to them, without a GPU: each benchmark's own plot
where it has one for the file (bench/gemm.py, gemm_decode.py, tp_decode.py), else harness.plot_rows
(per row: the speed over the baseline and the fraction of the bound).

    python3 bench/plot.py bench/results/ring_attention-2rank-mps.json [...]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

# op -> the benchmark module whose plot(result, path) draws that op's file
OWN = {"gemm": "gemm", "gemm_decode": "gemm_decode", "gemm_allreduce_decode": "tp_decode"}


def draw(path: Path, png: Path = None):
    """The PNG of results file ``path`` at ``png`` (default: next to it); returns its path."""
    doc = json.loads(path.read_text())
    png = png or path.with_suffix(".png")
    if doc["op"] in OWN:
        import importlib

        return importlib.import_module(OWN[doc["op"]]).plot(doc, png)
    return harness.plot_rows(doc, png)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(draw(Path(arg)))
