#!/usr/bin/env python3
"""gemm_reduce_scatter against its baselines (see bench/tp.py: one node, or --nodes N between emulated nodes):
mpirun -n 2 python3 bench/gemm_reduce_scatter.py [--quick] [--out DIR]"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tp  # noqa: E402

if __name__ == "__main__":
    sys.argv[1:1] = ["--op", "gemm_reduce_scatter"]
    tp.main()
