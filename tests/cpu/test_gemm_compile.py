"""CPU: every GEMM instantiation compiles with NVRTC for sm_90a, without spills, stack or the
ptxas warnings that mean wgmma was serialised (C7510-C7515) or registers were misallocated
(C7508); the cubin's SASS has HGMMA in every kernel and no local memory (when cuobjdump exists)."""

import importlib
import re

import pytest

from mkernel.runtime import compile as mkc

from tests.helpers import sass

gemm = importlib.import_module("mkernel.engines.gemm")  # the module (mkernel.gemm is also the function)


@pytest.fixture(scope="module", params=["gemm", "gemm_narrow"])
def compiled(request):
    spec = gemm.SPEC if request.param == "gemm" else gemm.NARROW_SPEC
    return spec, mkc.compile_spec(spec, use_cache=False)


def test_every_instantiation_compiles(compiled):
    spec, compiled = compiled
    assert set(compiled.lowered) == set(spec.name_expressions)
    funcs = compiled.resources["functions"]
    assert len(funcs) == len(spec.name_expressions), funcs
    for name, res in sorted(funcs.items()):
        print(f"{name}: {res}")
        assert res.get("stack", 0) == 0, (name, res)
        assert res.get("spill_stores", 0) == 0 and res.get("spill_loads", 0) == 0, (name, res)
        # 384 threads x 168 registers at launch; setmaxnreg moves them to the consumers.
        assert res.get("registers", 0) <= 168, (name, res)


def test_no_wgmma_or_register_warnings(compiled):
    _, compiled = compiled
    bad = [w for w in compiled.resources["warnings"] if re.search(r"C75(0[0-9]|1[0-9])", w)]
    assert not bad, bad
    assert not compiled.resources["warnings"], compiled.resources["warnings"]


def test_sass_is_warp_specialized_hgmma_without_local_memory(compiled):
    spec, compiled = compiled
    ks = sass.check_warp_specialized(compiled.cubin, len(spec.name_expressions),
                                     tile_n=gemm.BN_NARROW if spec is gemm.NARROW_SPEC else gemm.BN)
    for name, k in ks.items():  # the transpose bit exactly where B is [K, N]
        tnsp = re.search(r"mk_gemm_(?:cluster_)?kernelILi\dELi(\d)E", name).group(1) == "1"
        assert (".tnspB" in k) == tnsp, name
        assert "ACQBULK" in k and "PREEXIT" in k, name  # config.gemm_overlap: griddepcontrol wait, trigger


def test_smem_constants_fit():
    assert gemm.SMEM_GROUPED <= 227 * 1024
    assert gemm.SMEM_PLAIN <= gemm.SMEM_GROUPED
    assert gemm.smem_bytes(False, gemm.BN_NARROW) < gemm.SMEM_PLAIN  # gemm.cu static_asserts its value
