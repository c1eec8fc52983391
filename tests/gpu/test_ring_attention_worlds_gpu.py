"""GPU tests of mkernel.ring_attention on other worlds (tests/gpu/test_ring_attention_gpu.py's docstring):
world 1 (mkernel.init(MPI.COMM_SELF)) equals mkernel.attention bitwise (1-rank pass only); 2 ranks as 2
emulated nodes through the proxy (also on a split sub-communicator); 3 and 4 ranks on one node and
several ranks per node between nodes, each in a child mpiexec job."""

import zlib

import pytest

import mkernel

from tests.helpers import collective_cases
from tests.helpers.arrays import BF16, DTYPES, REL_TOL
from tests.helpers.arrays import bits as _bits
from tests.helpers.arrays import dev as _dev
from tests.helpers.arrays import poisoned as _poisoned
from tests.helpers.ring_cases import _global_inputs, _report_and_decide, _ring, _run_cases, _sync

# =================================================================================== world 1
WORLD1_CONFIGS = [("bf16", 128, 8, 2, 1, 330, True, None), ("fp16", 64, 4, 4, None, 200, False, None),
                  ("bf16", 64, 8, 1, 2, 256, True, None), ("fp16", 128, 4, 2, 1, 1000, False, None),
                  ("bf16", 128, 4, 4, None, 130, True, 0.3), ("fp16", 128, 8, 2, 1, 1024, True, None)]


@pytest.mark.gpu
def test_world_one_equals_attention():
    """At world 1 (a communicator over MPI.COMM_SELF) ring_attention is mkernel.attention (causal
    with the default offset 0, S_q == S_kv): the same bits of out and lse."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.size != 1:
        pytest.skip("world 1 is covered by the 1-rank pass")
    ring = _ring()
    c1 = collective_cases.with_driver(mkernel.init(MPI.COMM_SELF))
    try:
        assert c1.size == 1

        def body(name):
            dtn, D, Hq, Hkv, B, S, causal, scale = WORLD1_CONFIGS[names.index(name)]
            q, k, v = (_dev(x) for x in _global_inputs(zlib.crc32(name.encode()), DTYPES[dtn], B, S, Hq, Hkv, D))
            out = _poisoned(q.shape, dtn)
            _, lse = ring(q, k, v, comm=c1, causal=causal, softmax_scale=scale, out=out, return_lse=True)
            out2 = _poisoned(q.shape, dtn)
            res2 = ring(q, k, v, comm=c1, causal=causal, softmax_scale=scale, out=out2)
            ref, ref_lse = mkernel.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
            _sync(name)
            c1.check()
            same = bool((_bits(out) == _bits(ref)).all() and (_bits(lse) == _bits(ref_lse)).all())
            same2 = res2 is out2 and bool((_bits(out2) == _bits(ref)).all())
            return same and same2, (f"with lse: {'same bits' if same else 'DIFFER'}; "
                                    f"without: {'same bits' if same2 else 'DIFFER'}")

        names = [f"{dtn} D={D} H={Hq}/{Hkv} B={B} S={S} {'causal' if causal else 'full'} scale={scale}"
                 for dtn, D, Hq, Hkv, B, S, causal, scale in WORLD1_CONFIGS]
        results = _run_cases(c1, names, body)
        _report_and_decide(c1, "world 1 (COMM_SELF) vs mkernel.attention, bitwise", names, results)
    finally:
        collective_cases.close(c1)


def _against_engine(make_comm, world, nodes):
    """Ring attention on the communicator make_comm() returns (its root last; ``nodes`` nodes),
    against the single-GPU engine on the whole sequence, causal (zigzag) and not, three launches
    each (stale flags; the grid on 7/8 or all of the MPS share: config.mps_full_share), and the
    proxy's byte counter: the ranks at a node's end send every step's
    block across the network once per launch (of rank 0's, causal, the first chunk's rows only), the
    others (and every rank of one node) nothing."""
    import cupy
    from mpi4py import MPI

    import mkernel
    from mkernel.ops import ring_attention as ring_op

    err = None
    try:
        comm, root = make_comm()
        try:
            assert comm.num_nodes == nodes
            W, me = comm.size, comm.rank
            S, H, Hkv, D = 330, 4, 2, 128
            rng = cupy.random.default_rng(21)
            qg = rng.standard_normal((S * W, H, D), dtype=cupy.float32).astype(BF16)
            kg, vg = (rng.standard_normal((S * W, Hkv, D), dtype=cupy.float32).astype(BF16) for _ in range(2))
            for causal in (False, True):
                ref, ref_lse = mkernel.attention(qg, kg, vg, causal=causal, return_lse=True)
                want = mkernel.shard_sequence(ref, me, W, causal=causal).astype(cupy.float32)
                want_lse = mkernel.shard_sequence(ref_lse, me, W, causal=causal, axis=1)
                q, k, v = (cupy.ascontiguousarray(mkernel.shard_sequence(x, me, W, causal=causal))
                           for x in (qg, kg, vg))
                for rep in range(3):
                    out = cupy.full(q.shape, float("nan"), dtype=BF16)
                    with mkernel.config.override(mps_full_share=(True, "always", False)[rep]):
                        o, lse = _ring()(q, k, v, comm=comm, causal=causal, out=out, return_lse=True)
                    cupy.cuda.get_current_stream().synchronize()
                    comm.check()
                    rel = float(cupy.linalg.norm(o.astype(cupy.float32) - want) / cupy.linalg.norm(want))
                    lerr = float(cupy.abs(lse - want_lse).max())
                    assert rel < REL_TOL and lerr < 1e-3, f"causal={causal} launch {rep}: rel {rel:.2e}, lse {lerr:.2e}"
            nxt = (me + 1) % W
            sent = sum(p["bytes_sent"] for p in comm.stats().get("peers", {}).values())
            boundary = comm.topology.node_of[nxt] != comm.node
            src0_rows = {c: ring_op.rows_sent_of_rank0(1, S, c) for c in (False, True)}  # step s sends rank me-s's
            launch_bytes = {c: sum(2 * Hkv * D * 2 * (src0_rows[c] if (me - s) % W == 0 else S) for s in range(W - 1))
                            for c in (False, True)}
            want_sent = 3 * (launch_bytes[False] + launch_bytes[True]) if boundary else 0
            assert sent == want_sent, f"proxy sent {sent} bytes, expected {want_sent}"
        finally:
            root.close()
    except Exception as e:  # noqa: BLE001  (decided collectively below)
        err = e
    ok = world.allreduce(err is None, op=MPI.LAND)
    if err is not None:
        raise err
    assert ok, "another rank failed (see its output)"


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.multi_gpu
@pytest.mark.parametrize("via_split", [False, True], ids=["root", "split"])
def test_two_emulated_nodes_through_the_proxy(via_split):
    """2 ranks as 2 nodes (gpus_per_node=1): each key/value block travels as WRITE commands through
    the communicator's proxy. "split": on a rank-reversed sub-communicator, through its root's proxy
    (ranks, offsets, flags translated)."""
    from mpi4py import MPI

    import mkernel

    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        pytest.skip("pairs exactly two ranks")

    def make():
        root = mkernel.init(world, gpus_per_node=1, workspace_bytes=(128 if via_split else 64) << 20)
        return (root.split(0, key=-root.rank, workspace_bytes=64 << 20) if via_split else root), root

    _against_engine(make, world, nodes=2)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [3, 4])
def test_more_than_two_ranks_on_one_node(request, ranks):
    """3 and 4 ranks on one node (a child mpiexec, sharing the GPU). At 2 ranks the forwarding loop
    ends after step 0; from 3 on a forwarder also writes at step 1 (a wait there for a FREE flag
    that no rank sets went unseen until session 5); 3 is the ring with no FREE flag at all, 4 the
    first whose forwarder writes a slot its next rank has read in this launch."""
    _ranks_in_child_job(request, ranks, gpus_per_node=None, nodes=1)


@pytest.mark.gpu
@pytest.mark.parametrize("nodes,per_node", [(2, 2), (3, 2), (2, 3)])
def test_several_ranks_per_node_between_nodes(request, nodes, per_node):
    """nodes x per_node ranks (a child mpiexec, sharing the GPUs): blocks move over NVLink inside a
    node and through the proxy from the last rank of one node to the first of the next."""
    _ranks_in_child_job(request, nodes * per_node, gpus_per_node=per_node, nodes=nodes)


def _ranks_in_child_job(request, ranks, gpus_per_node, nodes):
    from mpi4py import MPI

    import mkernel

    from tests.helpers.jobs import relaunch

    if relaunch(request, n=ranks):
        return
    world = MPI.COMM_WORLD
    if world.Get_size() != ranks:
        pytest.skip(f"{ranks} ranks")

    def make():
        root = mkernel.init(world, gpus_per_node=gpus_per_node, transport="host", workspace_bytes=64 << 20)
        return root, root

    _against_engine(make, world, nodes=nodes)
