"""CPU tests of the fused MoE kernels (dispatch + grouped GEMM, grouped GEMM + combine); the GPU tests
are tests/gpu/test_moe_gemm_gpu.py."""

import pytest


@pytest.mark.parametrize("spec", ["moe_gemm", "moe_gemm_combine"])
def test_fused_kernel_has_no_static_shared_memory(spec):
    """The fused kernels launch with the grouped GEMM's dynamic shared memory (gemm.SMEM_GROUPED, 1 KiB
    under the SM's limit); any static __shared__ variable would be padded to the dynamic part's
    1024-byte alignment and make every launch fail (CUDA_ERROR_INVALID_VALUE)."""
    from mkernel.runtime import compile as mkc

    log = mkc.compile_spec(mkc.REGISTRY[spec]).log
    assert "ptxas info" in log and "bytes smem" not in log, [line for line in log.splitlines() if "smem" in line]


@pytest.mark.parametrize("nodes, combine", [(1, "unfused"), (2, "fused"), (3, "fused")])
def test_default_paths(nodes, combine):
    """path=None: the fused dispatch + GEMM everywhere; the fused GEMM + combine only between nodes
    (inside one node it is slower than its blocks)."""
    import types

    from mkernel.ops import moe_gemm

    comm = types.SimpleNamespace(num_nodes=nodes)
    assert moe_gemm.default_path("moe_dispatch_gemm", comm) == "fused"
    assert moe_gemm.default_path("moe_gemm_combine", comm) == combine
