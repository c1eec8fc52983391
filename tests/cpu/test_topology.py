"""Topology, node splitting and argument checks: CPU only, at any rank count (mpiexec -n 1, 2, 4)."""

import pytest

import mkernel
from mkernel.comm import topology

from tests.helpers.ranks import all_ranks

pytestmark = pytest.mark.mpi


def test_default_is_one_node_per_host(mpi_comm):
    t = topology.discover(mpi_comm)
    ok = (t.num_nodes == 1 and t.node_size == mpi_comm.size and t.node_rank == mpi_comm.rank
          and t.node_of == (0,) * mpi_comm.size and t.host_size == mpi_comm.size)
    assert all_ranks(mpi_comm, ok), t


def test_gpus_per_node_one_makes_every_rank_a_node(mpi_comm):
    t = topology.discover(mpi_comm, gpus_per_node=1)
    ok = t.num_nodes == mpi_comm.size and t.node == mpi_comm.rank and t.node_rank == 0 and t.node_size == 1
    assert all_ranks(mpi_comm, ok), t


def test_gpus_per_node_from_environment(mpi_comm, monkeypatch):
    monkeypatch.setenv("MKERNEL_GPUS_PER_NODE", "1")
    assert all_ranks(mpi_comm, topology.discover(mpi_comm).num_nodes == mpi_comm.size)


def test_nodes_of_two(mpi_comm):
    if mpi_comm.size % 2:
        with pytest.raises(mkernel.ArgumentError, match="does not divide"):
            topology.discover(mpi_comm, gpus_per_node=2)
        return
    t = topology.discover(mpi_comm, gpus_per_node=2)
    ok = (t.num_nodes == mpi_comm.size // 2 and t.node == mpi_comm.rank // 2 and t.node_rank == mpi_comm.rank % 2
          and t.ranks_of_node(t.node) == [2 * t.node, 2 * t.node + 1])
    assert all_ranks(mpi_comm, ok), t


def test_split_keeps_the_parents_node_boundaries(mpi_comm):
    parent = topology.discover(mpi_comm, gpus_per_node=1)
    sub = mpi_comm.Split(mpi_comm.rank % 2, mpi_comm.rank)
    try:
        node_of = sub.allgather(parent.node)
        t = topology.discover(sub, parent_node_of=node_of)
        expect = [r for r in range(mpi_comm.size) if r % 2 == mpi_comm.rank % 2]
        ok = t.size == len(expect) and t.rank == expect.index(mpi_comm.rank) and t.num_nodes == t.size
    finally:
        sub.Free()
    assert all_ranks(mpi_comm, ok), t


@pytest.mark.parametrize("bad", [0, -1, 1.5, "two", True])
def test_bad_gpus_per_node_is_an_argument_error(mpi_comm, bad):
    with pytest.raises(mkernel.ArgumentError):
        topology.discover(mpi_comm, gpus_per_node=bad)


def test_init_checks_arguments_before_touching_a_gpu():
    with pytest.raises(mkernel.ArgumentError, match="transport"):
        mkernel.init(transport="carrier-pigeon")
    with pytest.raises(mkernel.ArgumentError, match="workspace_bytes"):
        mkernel.init(workspace_bytes=-5)


@pytest.mark.skipif(mkernel.runtime.gpu.device_count() > 0, reason="a GPU is visible")
def test_init_without_gpu_raises_no_gpu_error(mpi_comm):
    with pytest.raises(mkernel.NoGPUError, match="Hopper"):
        mkernel.init(mpi_comm)


def test_timed_collectives_agree_and_give_up(mpi_comm):
    from mkernel.comm import collectives
    got = collectives.allgather_bytes(mpi_comm, bytes([mpi_comm.rank]) * 4, "testing")
    assert got == [bytes([r]) * 4 for r in range(mpi_comm.size)]
    collectives.barrier(mpi_comm, 30)

    class NeverDone:  # a request whose peer never arrives
        def Test(self):
            return False
    with pytest.raises(mkernel.PeerError, match=r"rank \d+: .* within 0.05 s"):
        collectives.wait(NeverDone(), "waiting for a dead peer", mpi_comm.rank, timeout_s=0.05)
