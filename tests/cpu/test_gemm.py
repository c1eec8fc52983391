"""CPU tests of mkernel.gemm / mkernel.grouped_gemm: the argument struct's layout (host g++ against
ctypes), TMA rules, registration, layout inference and host-side checks. The GPU tests are
tests/gpu/test_gemm_gpu.py."""

import importlib

import numpy as np
import pytest

from mkernel.core.errors import ArgumentError
from mkernel.runtime import tma

from tests.helpers.arrays import BF16

# The module, not the function: mkernel re-exports gemm() under the same name.
mg = importlib.import_module("mkernel.engines.gemm")
plan = importlib.import_module("mkernel.engines.gemm_plan")


@pytest.mark.parametrize("cls", ["MkGemmSched", "MkGemmArgs"])
def test_args_layout_matches_host_compiler(cls, tmp_path):
    from tests.helpers.c_layout import assert_same_layout

    c_align = 64 if cls == "MkGemmArgs" else None  # ctypes cannot express alignas(64)
    assert_same_layout("gemm_args.cuh", getattr(mg, cls), tmp_path, c_align=c_align)


def test_tma_rules():
    ok = dict(dtype=tma.DTYPE_BFLOAT16, ptr=0x1000, dims=(64, 128), strides=(128,), box=(64, 128), swizzle=3)
    tma.check_tiled(**ok)
    for bad in (dict(ptr=0x1008), dict(strides=(120,)), dict(box=(64, 512)), dict(box=(128, 64)),
                dict(dims=(0, 128))):
        with pytest.raises(ArgumentError):
            tma.check_tiled(**{**ok, **bad})


def test_tma_encode_goes_through_the_extension():
    import ctypes

    from mkernel import verbs
    from mkernel.core.errors import NoGPUError

    assert hasattr(verbs.lib, "mk_cuda_tensor_map_encode_tiled")
    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("libcuda is present here: the no-driver path cannot be seen")
    except OSError:
        pass
    tma.clear_cache()
    with pytest.raises(NoGPUError, match="libcuda.so.1 could not be loaded"):
        tma.encode_tiled(tma.DTYPE_BFLOAT16, 0x1000, (64, 128), (128,), (64, 128))


def test_registration():
    from mkernel.runtime import compile as mkc

    assert mkc.REGISTRY["gemm"] is mg.SPEC and mkc.REGISTRY["gemm_narrow"] is mg.NARROW_SPEC
    assert len(mg.EXPRESSIONS) == 24  # 16 unclustered (plain and grouped) + 8 clustered (plain)
    assert len(mg.NARROW_EXPRESSIONS) == 8 and all(e.endswith(",192>") for e in mg.NARROW_EXPRESSIONS)
    assert plan.tiles(129, 257) == 4 and plan.tiles(128, 256) == 1 and plan.tiles(129, 385, plan.BN_NARROW) == 6


def test_tile_width_takes_narrow_tiles_where_they_save_a_wave():
    from mkernel import config

    assert plan.tile_width(1000, 3000, 2000) == plan.BN_NARROW  # the default: "auto"
    with config.override(gemm_tile_n=256):
        assert plan.tile_width(1000, 3000, 2000) == plan.BN
    with config.override(gemm_tile_n=192):
        assert plan.tile_width(8192, 8192, 8192) == plan.BN_NARROW
    with config.override(gemm_tile_n="auto"):
        assert plan.tile_width(1000, 3000, 2000) == plan.BN_NARROW  # 96 wide tiles, 128 narrow: one wave each
        assert plan.tile_width(256, 10240, 8192) == plan.BN_NARROW  # 80 wide, 108 narrow
        for M, N, K in [(8192, 8192, 8192), (256, 8192, 8192), (256, 4096, 14336), (3000, 1000, 520),
                        (8191, 8200, 1032), (4000, 7000, 3000)]:  # a wave more, or split K fills the SMs
            assert plan.tile_width(M, N, K) == plan.BN, (M, N, K)
    assert plan.split_bytes(256, 2056, 2, plan.BN_NARROW) == plan.SPLIT_COUNTS_BYTES + 2 * 11 * 2 * 128 * 192 * 4
    with pytest.raises(ArgumentError, match="gemm_tile_n"), config.override(gemm_tile_n=128):
        pass


class _Fake:
    """Enough of a cupy.ndarray (shape, strides, itemsize, dtype, data.ptr) for the host-side checks."""

    class _Data:
        def __init__(self, ptr):
            self.ptr = ptr

    def __init__(self, shape, dtype=BF16, strides=None, ptr=0x10000):
        self.shape, self.dtype, self.itemsize, self.ndim = (tuple(shape), np.dtype(dtype), np.dtype(dtype).itemsize,
                                                            len(shape))
        if strides is None:
            strides, acc = [], self.itemsize
            for d in reversed(shape):
                strides.insert(0, acc)
                acc *= d
        self.strides = tuple(strides)
        self.data = self._Data(ptr)

    @property
    def T(self):
        return _Fake(self.shape[::-1], self.dtype, self.strides[::-1], self.data.ptr)


def test_b_layout_inference_and_host_checks():
    K, N = 64, 96
    lay, arr, n = mg._resolve_b_2d(_Fake((K, N)), K, None)
    assert (lay, n, arr.shape) == (mg.B_KN, N, (K, N))
    w = _Fake((N, K))
    lay, arr, n = mg._resolve_b_2d(w.T, K, None)  # the transpose of a row-major [N, K]: weights layout
    assert (lay, n, arr.shape, arr.strides) == (mg.B_NK, N, (N, K), w.strides)
    lay, arr, n = mg._resolve_b_2d(w, K, "nk")
    assert (lay, n) == (mg.B_NK, N)
    for bad in ((_Fake((K + 8, N)), None), (_Fake((N, K + 8)), "nk"), (_Fake((K, N)), "xx"), (_Fake((K,)), None)):
        with pytest.raises(ArgumentError):
            mg._resolve_b_2d(bad[0], K, bad[1])
    mg.check_matrix(_Fake((5, 64)), "a", dtypes=None)
    mg.check_matrix(_Fake((1, 64), strides=(2, 2)), "a", dtypes=None)  # one row: its stride is never used
    for bad in (_Fake((5, 64), ptr=0x10002), _Fake((5, 64), strides=(130, 2)), _Fake((5, 64), strides=(256, 4)),
                _Fake((5, 64), strides=(-256, 2))):
        with pytest.raises(ArgumentError):
            mg.check_matrix(bad, "a", dtypes=None)
    mg.check_matrix(_Fake((5, 64)), "a")  # the default: bfloat16 or float16, by name
    mg.check_matrix(_Fake((5, 64), np.float16), "a")
    mg.check_matrix(_Fake((5, 64), np.float32), "a", dtypes=(np.dtype(np.float32),))
    with pytest.raises(ArgumentError, match=r"float32; expected one of \['bfloat16', 'float16'\]"):
        mg.check_matrix(_Fake((5, 64), np.float32), "a")
    with pytest.raises(ArgumentError):
        mg._check_inputs(_Fake((4, 60)), None, 60, 64)
    with pytest.raises(ArgumentError):
        mg._check_inputs(_Fake((4, 64)), None, 64, 60)
    with pytest.raises(ArgumentError):
        mg._check_inputs(_Fake((4, 64), dtype=np.float32), None, 64, 64)
    assert mg._out_code("bfloat16", "float32") == mg.OUT_F32 and mg._out_code("float16", "float16") == mg.OUT_F16
    with pytest.raises(ArgumentError):
        mg._out_code("bfloat16", "float16")
    assert plan.default_ctas(2048, 132) == 128 and plan.default_ctas(45, 132) == 45
    assert plan.default_ctas(133, 132) == 67
    assert mg.grouped_tiles_bound(1000, 520, 8) == (8 + 8) * 3


def test_split_k_fills_the_sms_with_few_tiles_and_long_k():
    from mkernel import config

    with config.override(gemm_split_k=False):
        assert plan.split_k(128, 8192, 8192) == 1
        assert plan.use_cluster(256, 4096, 14336)  # 2 M-tiles, long K
    assert not plan.use_cluster(256, 4096, 14336)  # 32 tiles x 4 ranges of 56 k-blocks: too short for pairs
    assert plan.split_k(256, 4096, 14336, cluster=True) == 4 and plan.split_k(256, 8192, 8192, cluster=True) == 2
    assert plan.use_cluster(256, 8192, 28672) and plan.split_k(256, 8192, 28672, cluster=True) == 2  # 224 each
    assert not plan.use_cluster(256, 10240, 8192, cluster=False) and plan.split_k(256, 10240, 8192) == 1
    assert plan.use_cluster(8192, 8192, 8192) and plan.split_k(8192, 8192, 8192) == 1
    assert not plan.use_cluster(8191, 8200, 1032)  # short K, rows in whole L2 lines: one CTA per tile
    assert plan.use_cluster(8191, 8200, 1032, aligned=False)  # rows straddling lines: the pairs
    assert not plan.use_cluster(1000, 3000, 2000, aligned=False)  # 96 tiles, less than a wave
    with config.override(gemm_split_k=True):
        assert plan.split_k(128, 8192, 8192) == 4  # 32 tiles: 4 ranges of 32 k-blocks fill 132 SMs once
        assert plan.split_k(128, 4096, 14336) == 8  # 16 tiles
        assert plan.split_k(8192, 8192, 8192) == 1  # 1024 tiles fill the SMs without it
        assert plan.split_k(128, 4096, 960) == 1  # 15 k-blocks: a range would hold fewer than 8
        for M, N, K in [(128, 4096, 14336), (256, 4096, 1032), (130, 1000, 4104), (1, 256, 65536)]:
            s = plan.split_k(M, N, K)
            kb = -(-K // plan.BK)
            per = -(-kb // s)
            assert 1 <= s <= plan.SPLIT_MAX and (s - 1) * per < kb  # no empty range
            assert s == 1 or per >= plan.SPLIT_MIN_KBLOCKS and plan.tiles(M, N) * s <= plan.SPLIT_SMS
            assert plan.split_bytes(M, N, s) >= plan.SPLIT_COUNTS_BYTES + plan.tiles(M, N) * s * 128 * 256 * 4
            assert s == 1 or plan.tiles(M, N) * 8 * 4 <= plan.SPLIT_COUNTS_BYTES  # counts in the fixed region


def test_sched_flags_take_first_tiles_by_index_only_where_the_grid_is_resident():
    assert plan.sched_flags("m", False, 128, 132) == plan.SCHED_OWN_FIRST
    assert plan.sched_flags("n", False, 132, 132) == plan.SCHED_BY_N | plan.SCHED_OWN_FIRST
    assert plan.sched_flags("m", False, 66, 57) == 0  # an MPS share's margin: 9 CTAs would start late
    assert plan.sched_flags("n", True, 8, 132) == plan.SCHED_BY_N  # role words move CTAs: the counter
