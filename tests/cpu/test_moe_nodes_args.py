"""CPU: the launch arguments of MoE between nodes (mkernel/ops/moe_nodes.py, used by mkernel.moe), with a
fake communicator and recorded launches, no GPU: the node's dispatch and combine run on the node's
ranks and experts over the virtual tokens; the exchange and partial-sum kernels get the plan's
buffers, the node layout and their grids. (tests/gpu/test_moe_nodes_gpu.py runs the kernels.)"""

import importlib
import types

import numpy as np
import pytest

from mkernel.comm.communicator import Communicator
from mkernel.comm.plans import PlanRegistry
from mkernel.comm.scratch import layout as scratch_layout
from mkernel.core import config
from mkernel.runtime import launch

from tests.helpers.tp_fakes import pass_arrays_through

mmoe = importlib.import_module("mkernel.ops.moe")
mnodes = importlib.import_module("mkernel.ops.moe_nodes")
op_buffers = importlib.import_module("mkernel.ops.buffers")
op_calls = importlib.import_module("mkernel.ops.calls")

HEAP = 1 << 40


class _Arr:
    """Just enough of a cupy.ndarray for the argument checks and the plans."""

    def __init__(self, shape, dtype, ptr):
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(s) for s in shape)
        self.ndim, self.itemsize = len(self.shape), self.dtype.itemsize
        self.size = int(np.prod(self.shape))
        self.nbytes = self.size * self.itemsize
        st = [self.itemsize]
        for s in reversed(self.shape[1:]):
            st.insert(0, st[0] * s)
        self.strides = tuple(st)
        self.data = types.SimpleNamespace(ptr=ptr, memset_async=lambda *a: None)
        self.flags = types.SimpleNamespace(c_contiguous=True)


class _FakeComm(Communicator):
    """Rank `rank` of `nodes` x `local` ranks, node-major; workspace offsets are plain addresses."""

    def __init__(self, nodes, local, rank):
        self.size, self.rank, self.local_size, self.local_rank = nodes * local, rank, local, rank % local
        self.num_nodes, self.node = nodes, rank // local
        self.topology = types.SimpleNamespace(node_of=tuple(r // local for r in range(nodes * local)))
        self.heap = types.SimpleNamespace(base=HEAP, nbytes=1 << 36)
        self._agreed, self.plans, self.gpus_shared = {}, PlanRegistry(synchronize=lambda: None), True

    def check(self):
        pass

    def agree(self, key, value, cache=True):
        self._agreed[key] = value
        return value

    def sync_args(self, op, timeout_s=None):
        from mkernel.runtime.sync import MkSync
        return MkSync()

    def offset_of(self, arr):
        return arr.data.ptr - HEAP

    def proxy_flag_block(self, count):
        return types.SimpleNamespace(offset=200, size=count)

    def proxy_queue_args(self, flag_base=0):
        from mkernel.comm.proxy import QueueArgs
        return QueueArgs(0, 0, 0, None, 0, 0, flag_base)

    @property
    def peer_table(self):
        return types.SimpleNamespace(data=types.SimpleNamespace(ptr=0xABC000))

    @property
    def proxy_flags(self):
        return (0x7000000, None)


@pytest.fixture
def fake(monkeypatch):
    """Fake arrays for every allocation, recorded launches."""
    import cupy

    calls = {"launches": [], "next": 0x100000}

    def alloc(shape, dtype=np.float32, base=0):
        shape = (shape,) if isinstance(shape, int) else shape
        a = _Arr(shape, dtype, base + calls["next"])
        calls["next"] += -(-max(a.nbytes, 1) // 4096) * 4096
        return a

    def plan_buffers(op, comm, key, sizes, local_words, scratch_start=0):
        plan = comm.plans.get(key)
        if plan is None:
            plan = {name: alloc(shape, dt, HEAP) for name, shape, dt in sizes}
            for name, words in local_words.items():
                plan[name] = alloc(words, np.uint32)
            plan["scratch_end"] = scratch_start + scratch_layout(sizes)[0]
            comm.plans.add(key, plan)
        return plan

    pass_arrays_through(monkeypatch)
    monkeypatch.setattr(op_calls, "prepare_out", lambda op, out, shape, dtype, comm: out or alloc(shape, dtype))
    monkeypatch.setattr(op_buffers, "plan_buffers", plan_buffers)
    monkeypatch.setattr(launch, "sm_count", lambda full_share=False: 132)
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=np.float32: alloc(shape, dtype))
    monkeypatch.setattr(cupy, "zeros", lambda shape, dtype=np.float32: alloc(shape, dtype))
    monkeypatch.setattr(cupy.cuda.runtime, "deviceSynchronize", lambda: None)

    def record(module):
        def launch(op, expr, args, ctas, stream, smem=0, full_share=False):
            calls["launches"].append(dict(module=module, op=op, expr=expr, args=args, grid=ctas))
        return launch

    monkeypatch.setattr(mmoe, "_launch", record("moe"))
    monkeypatch.setattr(mnodes, "_launch", record("moe_nodes"))
    return calls


@pytest.mark.parametrize("nodes,local,rank", [(2, 1, 1), (2, 2, 3), (3, 1, 0), (4, 2, 5)])
def test_dispatch_and_combine_between_nodes_arguments(fake, nodes, local, rank):
    W, T, H, k, El = nodes * local, 300, 64, 2, 4
    E, cap = El * W, 2000
    comm = _FakeComm(nodes, local, rank)
    x, ids, w = _Arr((T, H), "float16", 0x10000), _Arr((T, k), "int32", 0x20000), _Arr((T, k), "float32", 0x30000)
    recv, h = mmoe.moe_dispatch(x, ids, w, comm=comm, num_experts=E, capacity=cap)
    (ex, dp) = fake["launches"]
    assert (ex["module"], ex["expr"], dp["module"], dp["expr"]) == ("moe_nodes", "mk_moe_exchange_kernel", "moe",
                                                                  "mk_moe_dispatch_kernel")
    R = cap // k
    p = h._nodes
    a = ex["args"]
    assert (a.T, a.H, a.k, a.E, a.e_local, a.world, a.me, a.capacity) == (T, H, k, E, El, W, rank, cap)
    assert (a.node, a.nodes, a.local, a.lrank, a.fwd_rows) == (rank // local, nodes, local, rank % local, R)
    assert (a.x, a.topk_ids, a.topk_w, a.ldx) == (0x10000, 0x20000, 0x30000, H)
    for name in ("gcounts", "gcflag", "xsend", "dsend", "xrecv", "drecv", "part", "precv"):
        assert getattr(a, f"{name}_off") == p[name].data.ptr - HEAP, name
    assert p["xsend"].shape == ((nodes - 1) * R, H) and p["part"].shape == (R, H)
    assert p["gcounts"].shape == (W * mnodes.grow_words(E),) and p["vids"].shape == (R * k,)
    assert a.queue.flag_base == 200 and a.pflags == 0x7000000 + 4 * 200
    assert ex["grid"] == min(mnodes.EXCHANGE_MAX_CTAS, -(-T // mnodes.TOKENS_PER_CTA))
    m = dp["args"]  # the node's dispatch: the node's ranks and experts, over the virtual tokens
    assert (m.world, m.me, m.E, m.e_local, m.T, m.capacity) == (local, rank % local, E // nodes, El, T, cap)
    assert (m.nseg, m.vseg, m.topk_ids, m.xfwd, m.fwd_rows) == (nodes - 1, p["vseg"].data.ptr, p["vids"].data.ptr,
                                                               p["xrecv"].data.ptr, R)
    assert a.pieces == m.pieces == p["pieces"] == config.get().moe_bundle_pieces  # sender and receiver alike
    assert dp["grid"] == min(132, -(-cap // mmoe.PAIRS_PER_CTA))
    assert h.group_rows.shape == (El,)

    out = mmoe.moe_combine(recv, h, comm=comm)
    (cb, pt) = fake["launches"][2:]
    assert (cb["expr"], pt["expr"]) == ("mk_moe_combine_kernel<1>", "mk_moe_partials_kernel<1>")
    c = cb["args"]  # the node's combine: fp32 sums of the virtual tokens into part
    assert (c.partial_out, c.out, c.ldo, c.topk_w, c.topk_ids) == (1, p["part"].data.ptr, H, p["vw"].data.ptr,
                                                                  p["vids"].data.ptr)
    assert (c.world, c.me, c.nseg) == (local, rank % local, nodes - 1)
    q = pt["args"]
    assert (q.out, q.ldo, q.T, q.fwd_rows) == (out.data.ptr, H, T, R)
    assert pt["grid"] == -(-T // mnodes.PARTIAL_TOKENS_PER_CTA)


def test_one_node_arguments_unchanged(fake):
    """Inside one node nothing of the path between nodes is set or launched."""
    comm = _FakeComm(1, 2, 1)
    T, H, k, E = 100, 64, 2, 8
    x, ids, w = _Arr((T, H), "float16", 0x10000), _Arr((T, k), "int32", 0x20000), _Arr((T, k), "float32", 0x30000)
    recv, h = mmoe.moe_dispatch(x, ids, w, comm=comm, num_experts=E, capacity=400)
    (dp,) = fake["launches"]
    m = dp["args"]
    assert h._nodes is None and (m.nseg, m.vseg, m.xfwd, m.partial_out) == (0, None, None, 0)
    assert (m.world, m.me, m.E, m.topk_ids) == (2, 1, E, 0x20000)


def test_bundle_pieces_are_part_of_the_plan_and_agreed(fake):
    """What crosses the network: another moe_bundle_pieces is another plan, agreed on by its key."""
    comm = _FakeComm(2, 1, 0)
    x, ids, w = _Arr((64, 64), "float16", 0x10000), _Arr((64, 2), "int32", 0x20000), _Arr((64, 2), "float32", 0x30000)
    _, h8 = mmoe.moe_dispatch(x, ids, w, comm=comm, num_experts=8, capacity=512)
    with config.override(moe_bundle_pieces=3):
        _, h3 = mmoe.moe_dispatch(x, ids, w, comm=comm, num_experts=8, capacity=512)
    assert (h8._nodes["pieces"], h3._nodes["pieces"]) == (config.get().moe_bundle_pieces, 3)
    assert fake["launches"][-2]["args"].pieces == fake["launches"][-1]["args"].pieces == 3
    agreed = [key for key, value in comm._agreed.items() if value == "moe_bundle_pieces"]
    assert sorted(key[-1] for key in agreed) == sorted({3, config.get().moe_bundle_pieces})
