"""launch.PlanCache (CPU): a hit launches the stored plan on the given stream, a miss launches
nothing, the least recently used plan goes first, and clear() drops them all."""

import pytest

from mkernel.runtime import launch as ml


def test_plan_cache_hit_miss_and_eviction(monkeypatch):
    import ctypes

    calls = []
    monkeypatch.setattr(ml.Launch, "go", lambda self, ptr: calls.append((self.fn, self.args, self.smem, ptr)))
    monkeypatch.setattr(ml, "stream_ptr", lambda stream=None: {None: 0, "s": 5}[stream])
    cache = ml.PlanCache(size=2)
    args = {n: ctypes.c_int(i) for i, n in enumerate("abc")}
    assert cache.launch("a") is False and not calls
    def add(key, plan):
        cache.add(key, plan, ml.Launch(*plan[:5]))

    add("a", ("fa", (1,), (2,), args["a"], 10))
    add("b", ("fb", (1,), (2,), args["b"], 20, "kept buffer"))
    assert cache.get("b")[0][5] == "kept buffer" and cache.get("b")[1].grid == (1, 1, 1)
    assert cache.launch("a", stream="s") is True
    assert calls[-1] == ("fa", args["a"], 10, 5)
    add("c", ("fc", (1,), (2,), args["c"], 30))  # evicts b: a was used more recently
    assert cache.launch("b") is False
    assert cache.launch("a") and cache.launch("c")
    assert len(calls) == 3
    cache.clear()
    assert cache.get("a") is None and cache.launch("c") is False and len(calls) == 3


def test_mps_client_detection(monkeypatch, tmp_path):
    from mkernel.runtime import gpu

    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not gpu.mps_client()
    (tmp_path / "control").touch()  # a daemon's control pipe
    assert gpu.mps_client()
    (tmp_path / "control").unlink()
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    assert gpu.mps_client()


def test_persistent_grids_keep_a_margin_under_mps(monkeypatch):
    """Under MPS a persistent grid counts on 7/8 of the client's SMs (two clients' full shares were
    not resident at once); otherwise on all of them."""
    import types

    from mkernel.runtime import gpu

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
        Device=lambda dev: types.SimpleNamespace(attributes={"MultiProcessorCount": 66})))
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake)
    for mps, want in ((False, 66), (True, 57)):
        monkeypatch.setattr(ml, "_device_sms", {})
        monkeypatch.setattr(gpu, "mps_client", lambda mps=mps: mps)
        assert ml.sm_count() == want and ml.sm_count(full_share=True) == 66


def test_child_jobs_get_their_share_of_the_gpu_under_mps(monkeypatch):
    from mkernel import testing
    from mkernel.runtime import gpu

    monkeypatch.setattr(gpu, "device_count", lambda: 1)
    monkeypatch.setattr(gpu, "mps_client", lambda: False)
    env, extra = testing.mpi_child_env(4, {"A": "1"})
    assert env == {"A": "1"} and extra == []
    monkeypatch.setattr(gpu, "mps_client", lambda: True)
    env, extra = testing.mpi_child_env(4, {"A": "1"})
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and extra == ["-x", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]
    monkeypatch.setattr(gpu, "device_count", lambda: 2)
    env, _ = testing.mpi_child_env(2, {"CUDA_MPS_PIPE_DIRECTORY": "/x"})
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"


def test_recorded_launches_keep_their_overlapped_flag(monkeypatch):
    import ctypes

    from mkernel.runtime import launch as _launch

    seen = []
    monkeypatch.setattr(_launch.Launch, "go", lambda self, ptr: seen.append((self.fn, self.smem, ptr, self.overlapped)))
    arg = ctypes.c_int(0)  # packed Launch objects, on the stream of one handle
    _launch.launch_all((_launch.Launch("a", (1,), (32,), arg, 0), _launch.Launch("b", (2,), (64,), arg, 16, True),
                        _launch.Launch("c", (2,), (64,), arg, 0, False)), stream_handle=7)
    assert seen == [("a", 0, 7, False), ("b", 16, 7, True), ("c", 0, 7, False)]


def test_a_packed_launch_points_the_driver_at_its_arguments(monkeypatch):
    import ctypes

    from mkernel.runtime import launch as _launch

    args = ctypes.c_uint64(5)
    one = _launch.Launch(type("F", (), {"ptr": 11})(), (3,), (128, 2), args, 0)
    assert one.grid == (3, 1, 1) and one.block == (128, 2, 1)
    calls = []
    monkeypatch.setattr(_launch, "_driver", lambda: type("D", (), {"launchKernel": staticmethod(
        lambda *a: calls.append(a))}))
    one.go(99)
    (fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra), = calls
    assert (fn, gx, gy, gz, bx, by, bz, smem, stream, extra) == (11, 3, 1, 1, 128, 2, 1, 0, 99, 0)
    assert ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))[0] == ctypes.addressof(args)


def test_the_overlap_knob_is_a_bool():
    import pytest

    from mkernel import ArgumentError, config

    assert config.get().tp_latency_ll_overlap is False  # on once bench/tp_decode.py measures it faster
    with pytest.raises(ArgumentError):
        with config.override(tp_latency_ll_overlap=1):
            pass


def test_overlapped_launches_go_through_launch_overlapped(monkeypatch):
    """Overlapped launches (kept in recorded plans) take cuLaunchKernelEx; plain ones cuLaunchKernel."""
    import ctypes

    from mkernel.runtime import launch as _launch

    ex, plain = [], []
    monkeypatch.setattr(_launch, "_launch_overlapped", lambda one, ptr: ex.append((one.fn, ptr)))
    monkeypatch.setattr(_launch, "_driver", lambda: type("D", (), {"launchKernel": staticmethod(
        lambda *a: plain.append(a[0]))}))
    arg = ctypes.c_int(0)
    f = [type("F", (), {"ptr": i})() for i in range(3)]
    _launch.launch_all((_launch.Launch(f[0], (1,), (32,), arg), _launch.Launch(f[1], (2,), (64,), arg, 0, True),
                        _launch.Launch(f[2], (4,), (64,), arg, 0, True)), stream_handle=7)
    assert plain == [0] and ex == [(f[1], 7), (f[2], 7)]


def test_an_overlapped_launch_without_a_driver_says_why():
    import ctypes
    import ctypes.util
    import types

    from mkernel.core.errors import MKernelError
    from mkernel.runtime import launch as _launch

    if ctypes.util.find_library("cuda"):
        pytest.skip("a CUDA driver is present: the GPU tests launch overlapped kernels for real")
    one = _launch.Launch(types.SimpleNamespace(ptr=0), (2,), (32,), ctypes.c_int(0), 0, True)
    for _ in range(2):  # the second go() reuses the packed arguments
        with pytest.raises(MKernelError, match="libcuda"):
            one.go(0)


def test_a_cooperative_launch_cannot_be_overlapped():
    import ctypes
    import types

    from mkernel.core.errors import ArgumentError
    from mkernel.runtime import launch as _launch

    with pytest.raises(ArgumentError, match="cooperative"):
        _launch.launch(types.SimpleNamespace(ptr=0), (2,), (32,), ctypes.c_int(0), cooperative=True, overlapped=True)
