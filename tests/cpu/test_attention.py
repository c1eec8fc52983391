"""CPU tests of mkernel.attention: the argument struct's layout (host g++ against ctypes), registration
and export, the generated wgmma header being current, NoGPUError without a GPU. The GPU tests are
tests/gpu/test_attention_gpu.py."""

import ctypes
import importlib
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from mkernel.core.errors import NoGPUError

from tests.helpers.arrays import BF16
from tests.helpers.tools import load_tool

ROOT = Path(__file__).resolve().parents[2]

# The module, not the function: mkernel re-exports attention() under the same name.
ma = importlib.import_module("mkernel.engines.attention")


def _module():
    return ma


def test_args_layout_matches_host_compiler(tmp_path):
    from tests.helpers.c_layout import assert_same_layout

    mirror = _module().MkAttnArgs
    assert_same_layout("attn_args.cuh", mirror, tmp_path, c_align=64)  # alignas(64) through TmaDesc
    assert ctypes.sizeof(mirror) % 64 == 0


def test_registration_and_export():
    import mkernel
    from mkernel.runtime import compile as mkc

    m = _module()
    assert mkc.REGISTRY["attention"] is m.SPEC
    assert m.SPEC.name == "attention" and m.SPEC.name_expressions
    assert m.SPEC.source in mkc.cuda_files()
    assert "attn_args.cuh" in mkc.include_closure(m.SPEC.source), "the kernel does not include attn_args.cuh"
    assert callable(m.attention)
    assert mkernel.attention is m.attention, "mkernel.attention is not the function (not exported in __init__?)"
    assert "attention" in mkernel.__all__


def test_wgmma_header_is_generated():
    gen = load_tool("gen_wgmma")
    current = (ROOT / "mkernel" / "cuda" / "primitives" / "wgmma_ops.cuh").read_text()
    assert current == gen.header(), "mkernel/cuda/primitives/wgmma_ops.cuh is stale: run python3 tools/gen_wgmma.py"


def test_no_gpu_error_without_a_gpu():
    from mkernel.runtime import gpu

    if gpu.device_count() > 0:
        pytest.skip("a GPU is visible: the GPU tests cover the real calls")
    m = _module()
    q = np.zeros((1, 128, 4, 64), dtype=BF16)
    k = np.zeros((1, 128, 2, 64), dtype=BF16)
    try:
        m.attention(q, k, k)
    except NoGPUError:
        return
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"without a usable GPU, attention raised {type(e).__name__} ({str(e)[:200]}), not "
                    "mkernel.NoGPUError")
    pytest.fail("attention returned without a GPU")
