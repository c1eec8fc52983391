"""CPU: gemm_allreduce's fused latency kernels (mkernel/ops/gemm_allreduce_ll.py): the argument
mirrors, every instantiation compiling without spills or stack, and which calls take them."""

import pytest

from mkernel import config
from mkernel.engines import gemm_decode as dec
from mkernel.ops import gemm_allreduce_ll as ll
from mkernel.ops import tp
from mkernel.runtime import compile as mkc

from tests.helpers.c_layout import assert_same_layout


@pytest.mark.parametrize("cls", [ll.MkDecodePushArgs, ll.MkAllreduceLLArgs])
def test_args_mirrors_match_c_layout(cls, tmp_path):
    c_align = 64 if cls is ll.MkDecodePushArgs else None  # it holds the decode GEMM's tensor maps
    assert_same_layout("gemm_allreduce_ll_args.cuh", cls, tmp_path, c_align=c_align)


def test_kernels_compile_without_spills():
    compiled = mkc.compile_spec(ll.SPEC, use_cache=False)
    funcs = compiled.resources["functions"]
    assert len(funcs) == len(ll.EXPRESSIONS), funcs
    for expr, name in compiled.lowered.items():
        res = funcs[name]
        assert res.get("stack", 0) == 0 and res.get("spill_stores", 0) == 0, (name, res)
        if expr.startswith(ll.PUSH):  # the decode GEMM's CTA fits an SM's registers
            rows = int(expr.rstrip(">").split(",")[-1])
            assert res.get("registers", 0) * dec.threads(rows) <= 65536, (name, res)
    assert not compiled.resources["warnings"], compiled.resources["warnings"]


def test_fewest_rows_with_weights_as_nk_take_the_fused_kernels():
    def call(M, layout):
        return tp.Call(a=None, b=None, layout=layout, M=M, N=4096, K=4096, mb=M, out=None, path="latency",
                       comm_sms=None, join=False)

    assert ll.eligible(call(1, tp.B_NK)) and ll.eligible(call(64, tp.B_NK))
    assert not ll.eligible(call(65, tp.B_NK)) and not ll.eligible(call(8, tp.B_KN))
    with config.override(tp_latency_ll_max_rows=0):
        assert not ll.eligible(call(1, tp.B_NK))
    with config.override(tp_latency_ll_max_rows=256):
        assert ll.eligible(call(128, tp.B_NK))
        assert not ll.eligible(call(129, tp.B_NK))  # its instantiations stop at 128 tokens
