"""CPU: the one-shot all-reduce's argument mirror and kernels (no spills, no stack, 16-byte loads
and stores), and mkernel.allreduce exported."""

import mkernel
from mkernel.ops import allreduce as ar
from mkernel.runtime import compile as mkc

from tests.helpers import sass
from tests.helpers.c_layout import assert_same_layout


def test_args_mirror_matches_c_layout(tmp_path):
    assert_same_layout("allreduce_args.cuh", ar.MkAllreduceArgs, tmp_path)


def test_kernels_compile_without_spills_and_move_16_bytes():
    compiled = mkc.compile_spec(ar.SPEC, use_cache=False)
    funcs = compiled.resources["functions"]
    assert len(funcs) == 2, funcs
    for name, res in funcs.items():
        assert res.get("stack", 0) == 0 and res.get("spill_stores", 0) == 0, (name, res)
    for name, text in sass.kernels(compiled.cubin).items():
        assert "STG.E.128" in text and "LDG.E" in text and "LDL" not in text, name


def test_exported():
    assert mkernel.allreduce is ar.allreduce and "allreduce" in mkernel.__all__
