"""CPU: the fused tensor-parallel kernels (GEMM+RS, GEMM+AR, AG+GEMM) compile with NVRTC for sm_90a
in every instantiation without spills, stack or ptxas warnings; the ctypes mirror of TpArgs matches
g++'s layout; the host-side planning rules (tile order, grid split, path choice) hold."""

import ctypes
import importlib
import itertools

import pytest

from mkernel import config
from mkernel.comm.plans import PlanRegistry
from mkernel.core.errors import ArgumentError
from mkernel.ops import calls as op_calls
from mkernel.ops import tp
from mkernel.runtime import compile as mkc

from tests.helpers import sass, tp_fakes
from tests.helpers.tp_fakes import _Arr, _Comm

# The modules (the package exports functions of the same names).
ag = importlib.import_module("mkernel.ops.allgather_gemm")
ar = importlib.import_module("mkernel.ops.gemm_allreduce")
rs = importlib.import_module("mkernel.ops.gemm_reduce_scatter")

MODULES = {"gemm_reduce_scatter": rs, "gemm_allreduce": ar, "allgather_gemm": ag}


def test_controller_state_layout_matches_host_compiler(tmp_path):
    from tests.helpers.c_layout import assert_same_layout

    assert_same_layout("tp_args.cuh", tp.TpCtlStats, tmp_path)
    assert_same_layout("tp_args.cuh", tp.TpCtl, tmp_path)
    assert tp.TpCtl.last.offset + ctypes.sizeof(tp.TpCtlStats) == ctypes.sizeof(tp.TpCtl)  # tp_ctl_finish


@pytest.mark.parametrize("setting,comm_sms,path,mode", [
    ("auto", "auto", "fused", tp.CTL_ADAPT), ("auto", 8, "fused", tp.CTL_OFF), ("auto", "auto", "unfused", tp.CTL_OFF),
    ("always", 8, "fused", tp.CTL_ADAPT), ("pattern", 8, "fused", tp.CTL_PATTERN),
    ("pattern", "auto", "unfused", tp.CTL_OFF), ("off", "auto", "fused", tp.CTL_OFF)])
def test_controller_mode_follows_comm_sms_and_the_setting(setting, comm_sms, path, mode):
    with config.override(tp_controller=setting):
        assert tp.controller_mode("gemm_reduce_scatter", comm_sms, path) == mode
        joined = tp.controller_mode("gemm_reduce_scatter", comm_sms, path, joined_in_node=True)
        assert joined == (tp.CTL_OFF if setting == "auto" else mode)  # joined CTAs: no lending on top
    with pytest.raises(ArgumentError, match="tp_controller"):
        with config.override(tp_controller="sometimes"):
            pass
    assert config.get().tp_controller == "auto"


def test_auto_split_launches_with_the_adaptive_controller(fake_launch, monkeypatch):
    from mkernel.split import search as autosplit
    monkeypatch.setattr(autosplit, "choose", lambda comm, op, **kw: (6, None))
    comm = _Comm(2, 0)
    M, K, N = 400, 136, 264
    for fn in (rs.gemm_reduce_scatter, ar.gemm_allreduce):
        out = _Arr((M, N) if fn is ar.gemm_allreduce else (M // 2, N), "float16", 0x300000)
        for join, mode in ((False, tp.CTL_ADAPT), (True, tp.CTL_OFF)):  # in a node, joined CTAs: no lending
            fn(_Arr((M, K), "float16", 0x100000), _Arr((K, N), "float16", 0x200000), comm=comm, out=out,
               path="fused", comm_sms="auto", join=join)
            args = fake_launch["launch"]["args"]
            assert args.ctl_mode == mode and 0 < fake_launch["launch"]["grid"] - args.gemm_ctas <= 6
    out = _Arr((M, N), "float16", 0x300000)
    ag.allgather_gemm(_Arr((M // 2, K), "float16", 0x100000), _Arr((K, N), "float16", 0x200000), comm=comm, out=out,
                      path="fused", comm_sms="auto")
    assert fake_launch["launch"]["args"].ctl_mode == tp.CTL_ADAPT
    # config.tp_ag_copy_first (default): the shard's M // 2 rows of K halves copied before the launch
    (dst, pitch, src, rows, row_bytes, _), = fake_launch["copies"]
    assert (pitch, rows, row_bytes, src.data.ptr) == (K * 2, M // 2, K * 2, 0x100000)
    assert fake_launch["launch"]["args"].own_copied == 1


def test_args_layout_matches_host_compiler(tmp_path):
    from tests.helpers.c_layout import c_offsets, py_offsets

    c = c_offsets("tp_args.cuh", "TpArgs", [name for name, *_ in tp.TpArgs._fields_], tmp_path)
    py = py_offsets(tp.TpArgs)
    assert c.pop("alignof") == 64  # TmaDesc is alignas(64); ctypes cannot say so (passed by copy)
    py.pop("alignof")
    assert c == py
    assert ctypes.sizeof(tp.TpArgs) % 64 == 0


@pytest.fixture(scope="module", params=sorted(MODULES))
def compiled(request):
    mod = MODULES[request.param]
    return mod, mkc.compile_spec(mod.SPEC, use_cache=False)


def test_every_instantiation_compiles_clean(compiled):
    mod, c = compiled
    assert set(c.lowered) == set(mod.SPEC.name_expressions)
    funcs = c.resources["functions"]
    assert len(funcs) == 4, funcs
    for name, res in sorted(funcs.items()):
        print(f"{name}: {res}")
        assert res.get("stack", 0) == 0, (name, res)
        assert res.get("spill_stores", 0) == 0 and res.get("spill_loads", 0) == 0, (name, res)
        assert res.get("registers", 0) <= 168, (name, res)  # 384 threads, 1 CTA per SM; setmaxnreg inside
    assert not c.resources["warnings"], c.resources["warnings"]
    assert mod.SPEC.hot


def test_sass_is_warp_specialized_hgmma_without_local_memory(compiled):
    """The TP producer (with the AG arrival wait) within its 40 registers, the consumers (with the
    TP epilogue) within 232, HGMMA and no local memory."""
    _, c = compiled
    sass.check_warp_specialized(c.cubin, 4)

def _block_tile(r, tiles_mb, tiles_n, gm=16):  # mirror of tp_block_tile (tp_epilogue.cuh)
    span = gm * tiles_n
    g, rr = divmod(r, span)
    first = g * gm
    gs = min(gm, tiles_mb - first)
    return (first + rr % gs) * tiles_n + rr // gs


@pytest.mark.parametrize("tiles_mb,tiles_n", [(1, 1), (3, 2), (17, 5), (40, 3)])
def test_block_tile_order_is_a_permutation(tiles_mb, tiles_n):
    n = tiles_mb * tiles_n
    assert sorted(_block_tile(r, tiles_mb, tiles_n) for r in range(n)) == list(range(n))


def test_grid_split():
    assert tp.grid_split("gemm_reduce_scatter", 8, 1000, 500, 132) == (124, 8)
    assert tp.grid_split("gemm_reduce_scatter", 8, 6, 3, 132) == (6, 3)  # no idle CTAs
    with pytest.raises(ArgumentError):
        tp.grid_split("gemm_reduce_scatter", 132, 10, 10, 132)
    assert tp.check_comm_sms("allgather_gemm", None) == "auto"  # the default: the split search and the controller
    for bad in (0, -1, 2.5, "8"):
        with pytest.raises(ArgumentError):
            tp.check_comm_sms("allgather_gemm", bad)


class _FakeComm:
    def __init__(self, size, distinct=True):
        self.size, self.num_nodes = size, 1
        self.plans, self.gpus_shared = PlanRegistry(synchronize=lambda: None), not distinct


def test_path_choice_is_a_function_of_shapes_and_topology():
    op = "gemm_allreduce"
    assert tp.choose_path(op, _FakeComm(1), None, rows=64, N=64, K=64)[0] == "gemm"
    assert tp.choose_path(op, _FakeComm(2, distinct=False), None, rows=512, N=64, K=64)[0] == "fused"
    assert tp.choose_path(op, _FakeComm(2), None, rows=512, N=64, K=64)[0] == "fallback"
    assert tp.choose_path(op, _FakeComm(2), None, rows=64, N=64, K=64)[0] == "latency"  # few rows, one node
    assert tp.choose_path("gemm_reduce_scatter", _FakeComm(2), None, rows=64, N=64, K=64)[0] == "fallback"
    assert tp.choose_path(op, _FakeComm(2), None, rows=8192, N=8192, K=4096)[0] == "fused"
    assert tp.choose_path(op, _FakeComm(2), "fused", rows=64, N=64, K=64)[0] == "fused"
    with pytest.raises(ArgumentError):
        tp.choose_path(op, _FakeComm(2), "gemm", rows=64, N=64, K=64)
    with pytest.raises(ArgumentError):
        tp.choose_path(op, _FakeComm(2), "nccl", rows=64, N=64, K=64)


def test_modules_register_without_cupy_at_import():
    for name, mod in MODULES.items():
        assert mkc.REGISTRY[name] is mod.SPEC
        assert callable(getattr(mod, name))
    from mkernel.diagnostics import sanitize
    assert all(callable(getattr(sanitize, f"target_{n}")) for n in MODULES)


# ------------------------------------------------- launch arguments, with a fake communicator
@pytest.fixture(autouse=True)
def _auto_asks_for_the_static_counts(monkeypatch):
    """This module's launches with comm_sms "auto" (the default) get the static counts from the
    split search (tests/cpu/test_autosplit.py runs the real one on the same fakes)."""
    from mkernel.split import search as autosplit
    monkeypatch.setattr(autosplit, "choose", lambda comm, op, **kw: (config.get().tp_comm_sms[op], None))


@pytest.fixture
def fake_launch(monkeypatch):
    return tp_fakes.fake_launch(monkeypatch)


@pytest.mark.parametrize("world,rank", [(1, 0), (2, 1), (4, 2)])
def test_reduce_scatter_and_allreduce_launch_arguments(fake_launch, world, rank):
    M, K, N = 200 * world, 136, 264
    for fn, allreduce in ((rs.gemm_reduce_scatter, False), (ar.gemm_allreduce, True)):
        comm = _Comm(world, rank)
        a = _Arr((M, K), "float16", 0x100000)
        b = _Arr((K, N), "float16", 0x200000)
        out = _Arr((M, N) if allreduce else (M // world, N), "float16", 0x300000)
        assert fn(a, b, comm=comm, out=out, path="fused") is out
        L = fake_launch["launch"]
        args, plan = L["args"], fake_launch["plan"]
        mb = M // world
        assert L["layout"] == tp.B_KN and args.world == world and args.me == rank and args.mb == mb
        assert args.tiles_mb == 2 and args.tiles_n == 2 and args.g.k == K and args.g.n == N and args.g.m == M
        tiles = world * 4
        items = (world if allreduce else 1) * 4  # AR: also the copies of the other ranks' reduced blocks
        assert args.gemm_ctas == tiles and L["grid"] == tiles + min(config.get().tp_comm_sms[L["op"]], items)
        assert args.recv_off == comm.offset_of(plan["recv"]) and args.rflag_off == comm.offset_of(plan["rflag"])
        if allreduce:
            assert args.gath_off == comm.offset_of(plan["gath"]) and args.gflag_off == comm.offset_of(plan["gflag"])
        for o in range(world):  # tile of block o -> rank o's slot for this sender
            assert args.dst[o].v[0] == comm.heap.peer_base[o] + args.recv_off + rank * mb * N * 2
        assert args.out == out.data.ptr and args.ldo == N and args.g.a.v[0] == a.data.ptr
        assert comm.agreements and comm.agreements[-1][-1] == "fused"
        # the default "auto" adapts inside the call unless its GEMM CTAs join (in a node by
        # default, where they take the reduction's items themselves); an integer split is static
        assert args.ctl == plan["ctl"].data.ptr and args.ctl_mode == (tp.CTL_OFF if args.join else tp.CTL_ADAPT)
        assert args.ctl_lend_max == args.gemm_ctas // config.get().tp_lend_share
        fn(a, b, comm=comm, out=out, path="fused", comm_sms=3)
        assert fake_launch["launch"]["args"].ctl_mode == tp.CTL_OFF and fake_launch["launch"]["grid"] == tiles + 3


@pytest.mark.parametrize("tiles_blk", [1, 4, 15, 16, 17, 255, 1024, 4096, 16384])
@pytest.mark.parametrize("nodes", [2, 3, 8])
def test_send_groups_cover_every_tile_once(tiles_blk, nodes):
    """RS / AR between nodes (tp_send_staged): groups of consecutive tiles, at least tp_send_tiles each
    (ARRIVAL_FLAGS permitting), partition the block; the staged-tile word of every (kind, node,
    group) lies inside xstaged, and the arrival counters fit their flag block."""
    comm = _Comm(nodes, 0, nodes)
    plan, args = {}, tp.TpArgs()
    send = config.get().tp_send_tiles
    tp.plan_between_nodes(comm, plan, args, tiles_blk, kinds=2, min_group=send)
    xgroup, xgroups = args.xgroup, args.xgroups
    assert xgroup >= send
    groups = [(g * xgroup, min(xgroup, tiles_blk - g * xgroup)) for g in range(xgroups)]
    assert sum(n for _, n in groups) == tiles_blk and all(n > 0 for _, n in groups)
    assert max((kind * nodes + j) * xgroups + g for kind in (0, 1) for j in range(nodes)
               for g in range(xgroups)) < tp.send_groups(tiles_blk, send)
    assert comm.flag_blocks == [tp.PF_ARRIVED + 2 * nodes * xgroups]
    assert 2 * nodes * xgroups <= tp.ARRIVAL_FLAGS + 2 * nodes  # the flag block stays bounded


@pytest.mark.parametrize("allreduce", [False, True], ids=["rs", "ar"])
@pytest.mark.parametrize("world,nodes,rank", [(2, 2, 1), (4, 2, 1), (4, 2, 2), (8, 4, 5)])
def test_reduce_ops_between_nodes_launch_arguments(fake_launch, world, nodes, rank, allreduce):
    """Hierarchical RS / AR: block o's tiles go to rank o % L of this node (slot [lrank][o // L]);
    the node partials' staging / receive buffers (AR: and the received reduced tiles), the plan's
    proxy flags and queue are set."""
    M, K, N = 200 * world, 136, 264
    L = world // nodes
    comm = _Comm(world, rank, nodes)
    a, b = _Arr((M, K), "float16", 0x100000), _Arr((K, N), "float16", 0x200000)
    out = _Arr((M, N) if allreduce else (M // world, N), "float16", 0x300000)
    fn = ar.gemm_allreduce if allreduce else rs.gemm_reduce_scatter
    assert fn(a, b, comm=comm, out=out, path="fused") is out
    args, plan, mb = fake_launch["launch"]["args"], fake_launch["plan"], M // world
    assert (args.world, args.me, args.nodes, args.local, args.lrank, args.node) == (world, rank, nodes, L, rank % L,
                                                                                  rank // L)
    for o in range(world):
        slot = comm.heap.peer_base[o % L] + args.recv_off + ((rank % L) * nodes + o // L) * mb * N * 2
        assert args.dst[o].v[0] == slot
    tiles_blk = 4
    assert plan["recv"].size_bytes == L * nodes * mb * N * 2 and plan["rflag"].size_bytes == L * nodes * tiles_blk * 4
    for name in ("stage", "xrecv") + (("xgath",) if allreduce else ()):
        assert plan[name].size_bytes == nodes * tiles_blk * tp.TILE_BYTES
    assert args.stage_off == comm.offset_of(plan["stage"]) and args.xrecv_off == comm.offset_of(plan["xrecv"])
    assert args.xgath_off == (comm.offset_of(plan["xgath"]) if allreduce else 0)
    # tiles go out in groups of tp_send_tiles (here all 4 in one WRITE), counted in the plan's xstaged words
    assert args.xgroup == config.get().tp_send_tiles and args.xgroups == 1
    assert comm.flag_blocks == [tp.PF_ARRIVED + (2 if allreduce else 1) * nodes]
    assert args.xstaged == plan["xstaged"].data.ptr and plan["xstaged"].size_bytes == 4 * 2 * tp.MAX_WORLD
    assert args.queue.flag_base == 100 and args.pflags == 0x7000000 + 4 * 100
    items = (world + nodes - 1 if allreduce else nodes) * tiles_blk  # AR: also gather copies and forwards
    n_comm = config.get().tp_comm_sms[fake_launch["launch"]["op"]]
    assert fake_launch["launch"]["grid"] == world * tiles_blk + min(n_comm, items)
    with pytest.raises(ArgumentError, match="node-major"):
        c = _Comm(world, rank, nodes)
        c.topology.node_of = tuple(reversed(c.topology.node_of))
        fn(a, b, comm=c, out=out, path="fused")


@pytest.mark.parametrize("allreduce", [False, True], ids=["rs", "ar"])
def test_send_tiles_knob_makes_its_own_plan_between_nodes_only(fake_launch, allreduce):
    """config.tp_send_tiles sets the tiles per WRITE of a shape's plan between nodes; a changed value
    gets a plan of its own (its staged-tile counters count over that plan's launches), in a node none."""
    M, K, N = 4 * 128 * 2, 136, 4 * 256  # 16 tiles a block
    fn = ar.gemm_allreduce if allreduce else rs.gemm_reduce_scatter
    a, b = _Arr((M, K), "float16", 0x100000), _Arr((K, N), "float16", 0x200000)
    out = _Arr((M, N) if allreduce else (M // 2, N), "float16", 0x300000)
    for nodes in (2, 1):
        comm = _Comm(2, 1, nodes)
        fn(a, b, comm=comm, out=out, path="fused")
        first, xgroup = fake_launch["plan_key"], fake_launch["launch"]["args"].xgroup
        with config.override(tp_send_tiles=4):
            fn(a, b, comm=comm, out=out, path="fused")
        args, plan = fake_launch["launch"]["args"], fake_launch["plan"]
        if nodes == 1:
            assert fake_launch["plan_key"] == first and args.xgroups == 0
            continue
        assert fake_launch["plan_key"] != first and (xgroup, args.xgroup, args.xgroups) == (16, 4, 4)
        assert plan["xstaged"].size_bytes == 4 * tp.send_groups(16, 4) == 4 * 2 * tp.MAX_WORLD * 4


@pytest.mark.parametrize("world,nodes,rank", [(2, 2, 1), (4, 2, 3), (8, 4, 5)])
def test_allgather_gemm_between_nodes_launch_arguments(fake_launch, monkeypatch, world, nodes, rank):
    """Hierarchical AG: the plan's proxy flags count chunk arrivals per source node; the pushers get
    this node's pushes and the forwards of the other nodes' chunks as items."""
    mb, K, N = 200, 136, 264
    L = world // nodes
    comm = _Comm(world, rank, nodes)
    out = _Arr((world * mb, N), "float16", 0x300000)
    a, b = _Arr((mb, K), "float16", 0x100000), _Arr((K, N), "float16", 0x200000)
    ag.allgather_gemm(a, b, comm=comm, out=out, path="fused")
    args = fake_launch["launch"]["args"]
    chunks = 2
    assert (args.nodes, args.local, args.lrank, args.node) == (nodes, L, rank % L, rank // L)
    assert comm.flag_blocks == [tp.PF_ARRIVED + nodes * chunks] and args.xgroup == 1 and args.xgroups == chunks
    assert args.queue.flag_base == 100 and args.pflags == 0x7000000 + 4 * 100
    assert fake_launch["launch"]["grid"] == world * chunks * 2 + min(config.get().tp_comm_sms["allgather_gemm"],
                                                                     (L + nodes - 1) * chunks)


def test_unfused_path_launches_the_collective_after_a_gemm(fake_launch, monkeypatch):
    """path='unfused' (the benchmarks' overlap baseline): RS / AR hand the kernel the finished
    partial (its GEMM CTAs only move tiles); AG launches only the gather CTAs, then multiplies."""
    world, rank, nodes = 4, 1, 2
    M, K, N = 200 * world, 136, 264
    calls = []
    partial = _Arr((M, N), "float16", 0x900000)

    def fake_matmul(a, b_arr, layout, out=None):
        calls.append((a, out))
        return partial if out is None else out

    monkeypatch.setattr(tp, "matmul", fake_matmul)
    quiesced = []  # between nodes the first cuBLAS use of a shape waits for the stream (no GPU here)
    monkeypatch.setattr(op_calls, "quiesced_first_use", lambda comm, plan, key: quiesced.append(key) or True)
    a, b = _Arr((M, K), "float16", 0x100000), _Arr((K, N), "float16", 0x200000)
    out = _Arr((M // world, N), "float16", 0x300000)
    rs.gemm_reduce_scatter(a, b, comm=_Comm(world, rank, nodes), out=out, path="unfused")
    args = fake_launch["launch"]["args"]
    assert calls == [(a, None)] and args.partial == partial.data.ptr and args.ldp == N
    assert args.gemm_ctas == world * 4  # the partial's tiles, moved by as many CTAs as the GEMM would use
    ga_out = _Arr((world * 200, N), "float16", 0x400000)
    ag.allgather_gemm(_Arr((200, K), "float16", 0x100000), b, comm=_Comm(world, rank, nodes), out=ga_out,
                      path="unfused")
    L = fake_launch["launch"]
    assert L["args"].gemm_ctas == 0 and L["grid"] == min(config.get().tp_comm_sms["allgather_gemm"], (2 + 1) * 2)
    # the warm-up multiply (cuBLAS loads its kernel before the gather is in flight), then the real one
    assert calls[-2:] == [(fake_launch["plan"]["ga"], ga_out)] * 2 and len(quiesced) == 2


def test_allgather_gemm_launch_arguments_and_nk_layout(fake_launch):
    world, rank, mb, K, N = 2, 1, 200, 136, 264
    comm = _Comm(world, rank)
    a = _Arr((mb, K), "float16", 0x100000)
    b = _Arr((N, K), "float16", 0x200000)
    out = _Arr((world * mb, N), "float16", 0x300000)
    ag.allgather_gemm(a, b, comm=comm, out=out, b_layout="nk", path="fused")
    L = fake_launch["launch"]
    args, plan = L["args"], fake_launch["plan"]
    assert L["layout"] == tp.B_NK and args.g.a.v[0] == plan["ga"].data.ptr and args.a_local == a.data.ptr
    assert args.lda == K and args.ga_off == comm.offset_of(plan["ga"])
    for o in range(world):
        assert args.dst[o].v[0] == out.data.ptr + o * mb * N * 2
    # the transposed view of a row-major [N, K] is read as [N, K]
    ag.allgather_gemm(a, b.T, comm=_Comm(world, rank), out=out, path="fused")
    assert fake_launch["launch"]["layout"] == tp.B_NK


def test_uneven_rows_raise(fake_launch):
    comm = _Comm(2, 0)
    with pytest.raises(ArgumentError, match="split evenly"):
        rs.gemm_reduce_scatter(_Arr((201, 64), "float16", 0x1000), _Arr((64, 64), "float16", 0x2000), comm=comm,
                               out=_Arr((100, 64), "float16", 0x3000))


def _tile_shape(p, mb, n):
    """Mirror of TpTileShape (tp_reduce.cuh) and TpBlockPos (tp_epilogue.cuh): (tile id, rows, cols,
    packed byte offset) of the tile at position p of a block in the GEMM's order."""
    tiles_mb, tiles_n, group_m = -(-mb // 128), -(-n // 256), 16
    g, rr = divmod(p, group_m * tiles_n)
    first = g * group_m
    band = min(group_m, tiles_mb - first)
    mt, nt = first + rr % band, rr // band
    rows, cols = min(128, mb - mt * 128), min(256, n - nt * 256)
    band_rows = min(band * 128, mb - first * 128)
    packed = (first * 128 * n + nt * 256 * band_rows + (mt - first) * 128 * cols) * 2
    return mt * tiles_n + nt, rows, cols, packed


@pytest.mark.parametrize("mb,n", [(128, 256), (4096, 8192), (4000, 8200), (2056, 520), (130, 8), (2048 + 1, 256 * 33)])
def test_packed_tiles_follow_the_gemm_order(mb, n):
    """Between nodes a block's tiles are staged and sent packed in the GEMM's order: every tile once,
    each right after the one before it (so any run of positions is one span), filling the block."""
    tiles = -(-mb // 128) * -(-n // 256)
    shapes = [_tile_shape(p, mb, n) for p in range(tiles)]
    assert sorted(s[0] for s in shapes) == list(range(tiles))
    end = 0
    for _, rows, cols, packed in shapes:
        assert packed == end
        end = packed + rows * cols * 2
    assert end == mb * n * 2


@pytest.mark.parametrize("setting", ["auto", True, False])
def test_join_follows_the_config_per_op_and_nodes(fake_launch, setting):
    """config.tp_join_reduce "auto": the GEMM CTAs join RS's and AR's reduction, at one rank per node
    between nodes only where the model's GEMM is a share of its link time (not at this small shape);
    True / False: every RS and AR call; an explicit join= wins."""
    M, K, N = 400, 136, 264
    with config.override(tp_join_reduce=setting):
        for fn, (world, nodes) in itertools.product((rs.gemm_reduce_scatter, ar.gemm_allreduce),
                                                    ((1, 1), (2, 1), (2, 2), (4, 2))):
            comm = _Comm(world, 0, nodes=nodes)
            out = _Arr((M, N) if fn is ar.gemm_allreduce else (M // world, N), "float16", 0x300000)
            a, b = _Arr((M, K), "float16", 0x100000), _Arr((K, N), "float16", 0x200000)
            fn(a, b, comm=comm, out=out, path="fused", comm_sms=8)
            want = (world, nodes) != (2, 2) if setting == "auto" else setting
            assert fake_launch["launch"]["args"].join == int(want), (fn.__name__, nodes)
            fn(a, b, comm=comm, out=out, path="fused", comm_sms=8, join=not want)
            assert fake_launch["launch"]["args"].join == int(not want), (fn.__name__, nodes)


@pytest.mark.parametrize("sms", [132, 66])
@pytest.mark.parametrize("op,K,joins", [("gemm_allreduce", 14336, True), ("gemm_allreduce", 4096, False),
                                        ("gemm_reduce_scatter", 14336, True)])
def test_join_between_nodes_of_one_rank_follows_the_gemm_share_of_the_link(op, K, joins, sms, monkeypatch):
    """At one rank per node between nodes, "auto" joins where the split model's GEMM time on the
    rank's SMs is at least config.tp_join_min_gemm_share of its link time (host transport, 20 GB/s;
    650 TFLOP/s on 132 SMs): AR 8192^2 x 14336 0.44, x 4096 0.13, RS x 14336 0.88 on a whole GPU
    (bench/NOTES.md session 25's rows), twice that on an MPS share of 66 SMs: the same decisions."""
    monkeypatch.setattr(tp._launch, "grid_sms", lambda comm, op: sms)
    comm = _Comm(2, 0, nodes=2)
    M = N = 8192
    assert tp.default_join(op, comm, M=M, N=N, K=K, esize=2) is joins
    with config.override(tp_join_min_gemm_share=0.0):
        assert tp.default_join(op, comm, M=M, N=N, K=K, esize=2)
    with config.override(tp_join_reduce=False):
        assert not tp.default_join(op, _Comm(4, 0, nodes=2), M=M, N=N, K=K, esize=2)
