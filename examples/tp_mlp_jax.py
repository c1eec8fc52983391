#!/usr/bin/env python3
"""The tensor-parallel MLP block of tp_mlp.py fed with JAX arrays through DLPack (mkernel ops take
any array with __dlpack__; their CuPy outputs go back to JAX with jax.dlpack.from_dlpack).

    mpirun -n 2 python3 examples/tp_mlp_jax.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tp_mlp  # noqa: E402

if __name__ == "__main__":
    sys.argv[1:1] = ["--jax"]
    tp_mlp.main()
