"""Fakes of the fused tensor-parallel ops' launches on the CPU (tests/cpu/test_tp_compile.py,
test_autosplit.py): arrays and a communicator with just what the argument checks and the planning
read, and ``fake_launch(monkeypatch)``, which records each launch instead of running it."""

import ctypes

from mkernel.comm.plans import PlanRegistry
from mkernel.ops import buffers as op_buffers
from mkernel.ops import calls as op_calls
from mkernel.ops import tp
from mkernel.runtime import launch


class _Ptr:
    def __init__(self, ptr):
        self.ptr = ptr


class _Arr:
    """Just enough of a cupy.ndarray for the argument checks: shape, strides, dtype, pointer."""

    def __init__(self, shape, dtype, ptr, strides=None):
        import numpy as np
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)
        self.ndim = len(shape)
        self.itemsize = self.dtype.itemsize
        self.strides = strides or (shape[1] * self.itemsize, self.itemsize)
        self.data = _Ptr(ptr)

    @property
    def T(self):
        return _Arr(self.shape[::-1], self.dtype, self.data.ptr, self.strides[::-1])


class _Heap:
    def __init__(self, bases):
        self.peer_base = bases
        self.base = bases[0]
        self.nbytes = 1 << 28


class _Comm:
    def __init__(self, size, rank, nodes=1):
        import types
        L = size // nodes
        self.size, self.rank, self.local_rank, self.local_size, self.num_nodes = size, rank, rank % L, L, nodes
        self.node = rank // L
        self.topology = types.SimpleNamespace(node_of=tuple(r // L for r in range(size)))
        self.heap = _Heap([(1 << 40) * (p + 1) for p in range(L)])
        self.heap.base = self.heap.peer_base[rank % L]
        self.proxy_flags = (0x7000000, None)
        self.flag_blocks = []
        self.peer_table = types.SimpleNamespace(data=_Ptr(0xABC000))
        self._agreed = {}
        self.plans, self.gpus_shared = PlanRegistry(synchronize=lambda: None), True
        self.agreements = []  # every key agreed on, in order

    def agree(self, key, value):
        self.agreements.append(key)
        self._agreed[key] = value
        return value

    def agreed(self, key):
        return key in self._agreed

    def check(self):  # a replay's check for a pending error: none here
        pass

    def sync_args(self, op):
        from mkernel.runtime.sync import MkSync
        return MkSync()

    def offset_of(self, arr):
        return arr.data.ptr - self.heap.base

    def proxy_flag_block(self, count):
        import types
        self.flag_blocks.append(count)
        return types.SimpleNamespace(offset=100, size=count)

    def proxy_queue_args(self, flag_base=0):
        from mkernel.comm.proxy import QueueArgs
        return QueueArgs(0, 0, 0, None, 0, 0, flag_base)


def pass_arrays_through(monkeypatch):
    """``as_cupy`` returns its argument, in every mkernel module that imported it (fakes stay fakes)."""
    import sys

    import mkernel.runtime.arrays

    real = mkernel.runtime.arrays.as_cupy
    for name, mod in list(sys.modules.items()):
        if name.startswith("mkernel") and getattr(mod, "as_cupy", None) is real:
            monkeypatch.setattr(mod, "as_cupy", lambda x, name, stream=None: x)


def fake_launch(monkeypatch):
    """Fakes what the fused TP ops launch with (arrays, tensor maps, plan buffers, the launch itself)
    on ``monkeypatch``; returns the record of the calls (calls["launch"]: the last launch's arguments,
    calls["copies"]: mkernel.ops.calls.copy_rows's)."""
    calls = {"maps": [], "launch": None}
    pass_arrays_through(monkeypatch)
    monkeypatch.setattr(op_calls, "prepare_out",
                        lambda op, out, shape, dtype, comm: (out, calls.setdefault("out_shape", shape))[0])

    def encode(dtype, ptr, dims, strides, box, swizzle=3, l2=3):
        _tma.check_tiled(dtype, ptr, dims, strides, box, swizzle)
        calls["maps"].append((ptr, tuple(dims), tuple(strides), tuple(box)))
        m = _tma.TensorMap()
        m.v[0] = ptr
        return m

    from mkernel.runtime import tma as _tma
    monkeypatch.setattr(tp._tma, "encode_tiled", encode)

    def plan_buffers(op, comm, key, sizes):
        plan, off = {}, 1 << 20
        for name, shape, dt in sizes:
            plan[name] = _Arr(shape if len(shape) == 2 else (shape[0], 1) if len(shape) == 1 else
                              (shape[0] * shape[1], shape[2]), dt, comm.heap.base + off)
            plan[name].size_bytes = op_buffers.nbytes(shape, dt)
            off += -(-plan[name].size_bytes // 1024) * 1024
        plan["counters"] = _Arr((8, 1), "uint32", 0x5000)
        plan["ctl"] = _Arr((ctypes.sizeof(tp.TpCtl) // 4, 1), "uint32", 0x6000)
        calls["plan"], calls["plan_key"] = plan, key
        comm.plans.add(key, plan)  # a recorded call names its plans
        return plan

    monkeypatch.setattr(tp, "plan_buffers", plan_buffers)
    monkeypatch.setattr(launch, "sm_count", lambda full_share=False: 132)

    def launch_fused(comm, op, spec, kernel, args, dtype, layout, grid, stream):
        calls["launch"] = dict(op=op, kernel=kernel, args=args, layout=layout, grid=grid)
        calls["launches"] = calls.get("launches", 0) + 1
        return calls["launch"]

    monkeypatch.setattr(tp, "launch_fused", launch_fused)
    monkeypatch.setattr(op_calls, "copy_rows", lambda *args: calls.setdefault("copies", []).append(args))
    return calls
