"""CPU: the all-reduce's argument mirror and kernels (no spills, no stack, 16-byte loads
and stores, 8-byte LL words), and mkernel.allreduce exported."""

import pytest

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
    assert len(funcs) == 6, funcs  # bf16, fp16, fp32; data + flags or LL words
    for name, res in funcs.items():
        assert res.get("stack", 0) == 0 and res.get("spill_stores", 0) == 0, (name, res)
    texts = sass.kernels(compiled.cubin)
    for expr, name in compiled.lowered.items():
        store = "STG.E.64" if expr.endswith(",1>") else "STG.E.128"  # an LL word, or a 16-byte vector
        assert store in texts[name] and "LDG.E" in texts[name] and "LDL" not in texts[name], expr


def test_exported():
    assert mkernel.allreduce is ar.allreduce and "allreduce" in mkernel.__all__


def test_gemm_allreduce_takes_the_latency_path_by_knob_or_request():
    import pytest

    from mkernel import config
    from mkernel.ops import tp

    class Comm:
        size, num_nodes, gpus_shared = 2, 1, True

    assert tp.choose_path("gemm_allreduce", Comm, None, rows=256, N=4096, K=4096)[0] == "latency"  # the default
    assert tp.choose_path("gemm_allreduce", Comm, None, rows=257, N=4096, K=4096)[0] == "fused"
    with config.override(tp_latency_max_rows=0):
        assert tp.choose_path("gemm_allreduce", Comm, None, rows=1, N=4096, K=4096)[0] == "fused"  # off
    with config.override(tp_latency_max_rows=64):
        assert tp.choose_path("gemm_allreduce", Comm, None, rows=64, N=4096, K=4096)[0] == "latency"
        assert tp.choose_path("gemm_allreduce", Comm, None, rows=65, N=4096, K=4096)[0] == "fused"
        assert tp.choose_path("gemm_reduce_scatter", Comm, None, rows=16, N=4096, K=4096)[0] == "fused"
    assert tp.choose_path("gemm_allreduce", Comm, "latency", rows=4096, N=64, K=64)[0] == "latency"
    Comm.num_nodes = 2
    with pytest.raises(mkernel.ArgumentError, match="inside one node"):
        tp.choose_path("gemm_allreduce", Comm, "latency", rows=16, N=64, K=64)


def test_small_messages_split_into_more_chunks():
    from mkernel.ops import allreduce as ar

    for ll in (True, False):
        most, target = ar.CHUNK_MAX[ll], ar.CHUNKS_TARGET[ll]
        assert ar.chunk_of(8, ll) == ar.CHUNK_MIN and ar.chunk_of(1 << 30, ll) == most
        for count in (1, 8191, 8192, 65536, 65537, 131072, 1 << 19, 3 << 20):
            chunk = ar.chunk_of(count, ll)
            assert chunk % 8 == 0 and chunk & (chunk - 1) == 0  # whole LL words and 16-byte vectors per item
            assert -(-count // chunk) <= target or chunk == most
            assert chunk == ar.CHUNK_MIN or -(-count // (chunk // 2)) > target  # the least such


def test_path_by_size_and_world():
    """LL words up to allreduce_ll_max_bytes (never from a producer's slot), two-shot from
    allreduce_twoshot_min_bytes (allreduce_twoshot_min_bytes_2ranks at 2 ranks), one-shot otherwise."""
    from mkernel import config

    with config.override(allreduce_ll_max_bytes=512 << 10, allreduce_twoshot_min_bytes=1 << 20,
                         allreduce_twoshot_min_bytes_2ranks=8 << 20):
        assert ar.path_of(8, 512 << 10) == "ll" and ar.path_of(8, 512 << 10, slot=True) == "oneshot"
        assert ar.path_of(2, (8 << 20) - 1) == "oneshot" and ar.path_of(2, 8 << 20) == "twoshot"
        assert ar.path_of(3, (1 << 20) - 1) == "oneshot" and ar.path_of(3, 1 << 20) == "twoshot"
        assert ar.path_of(4, 1 << 20, slot=True) == "twoshot"
        assert ar.path_of(1, 1 << 30) == "oneshot"  # a copy: nothing to split
    with config.override(allreduce_twoshot_min_bytes=0, allreduce_twoshot_min_bytes_2ranks=0):
        assert ar.path_of(8, 1 << 30) == "oneshot" and ar.path_of(2, 1 << 30) == "oneshot"  # 0: never
    with pytest.raises(mkernel.ArgumentError), config.override(allreduce_twoshot_min_bytes_2ranks=-1):
        pass
