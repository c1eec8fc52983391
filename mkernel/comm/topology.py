"""Who is where: ranks, physical hosts, and (possibly emulated) nodes. Needs MPI only, no GPU.

A *node* is a set of ranks that move data to each other directly (NVLink, CUDA IPC); between
nodes, data goes through the proxy and a transport. By default a node is a physical host (MPI's
shared-memory split). ``gpus_per_node`` (or ``MKERNEL_GPUS_PER_NODE``) cuts each host into nodes of
that many consecutive ranks, so one host can emulate several nodes.
"""

from dataclasses import dataclass

from mkernel.core import env
from mkernel.core.errors import ArgumentError


@dataclass(frozen=True)
class Topology:
    rank: int
    size: int
    host: int            # index of this rank's physical host, in order of its lowest rank
    host_rank: int       # rank among the ranks of this communicator on the same host
    host_size: int
    node: int            # index of this rank's node
    node_rank: int       # "local rank": rank inside the node
    node_size: int       # ranks per node (equal on every node)
    num_nodes: int
    node_of: tuple       # node index of every rank

    @property
    def single_node(self) -> bool:
        return self.num_nodes == 1

    def ranks_of_node(self, node: int):
        return [r for r, n in enumerate(self.node_of) if n == node]


def _gpus_per_node(arg):
    if arg is None:
        raw = env.get("MKERNEL_GPUS_PER_NODE")
        if not raw:
            return None
        try:
            arg = int(raw)
        except ValueError:
            raise ArgumentError(f"MKERNEL_GPUS_PER_NODE={raw!r} is not an integer") from None
    if isinstance(arg, bool) or not isinstance(arg, int) or arg < 1:
        raise ArgumentError(f"gpus_per_node must be a positive integer, got {arg!r}")
    return arg


def discover(mpi_comm, gpus_per_node=None, parent_node_of=None) -> Topology:
    """Collective over ``mpi_comm``. ``parent_node_of``: for a split, every member's node in the parent
    (a sub-communicator keeps its parent's node boundaries)."""
    from mpi4py import MPI

    gpn = _gpus_per_node(gpus_per_node)
    rank, size = mpi_comm.rank, mpi_comm.size
    shared = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        leader = shared.allreduce(rank, op=MPI.MIN)
        host_rank, host_size = shared.rank, shared.size
    finally:
        shared.Free()
    leaders = mpi_comm.allgather(leader)
    host_ids = {r: i for i, r in enumerate(sorted(set(leaders)))}
    host_of = [host_ids[r] for r in leaders]

    if parent_node_of is not None:
        grouping = list(parent_node_of)
    elif gpn is not None:
        if size % gpn:
            raise ArgumentError(f"gpus_per_node={gpn} does not divide the world size {size}: every node "
                                f"must have the same number of ranks")
        grouping = [r // gpn for r in range(size)]
    else:
        grouping = host_of
    ids = {g: i for i, g in enumerate(sorted(set(grouping), key=grouping.index))}
    node_of = tuple(ids[g] for g in grouping)
    for r in range(size):
        if host_of[r] != host_of[node_of.index(node_of[r])]:
            raise ArgumentError(f"node {node_of[r]} would span several hosts (rank {r}); gpus_per_node must "
                                f"cut hosts into nodes, not join them")
    sizes = {node_of.count(n) for n in set(node_of)}
    if len(sizes) != 1:
        raise ArgumentError(f"nodes have different numbers of ranks ({sorted(sizes)}); mkernel needs the same "
                            f"number of ranks on every node")
    node = node_of[rank]
    members = [r for r in range(size) if node_of[r] == node]
    return Topology(rank=rank, size=size, host=host_of[rank], host_rank=host_rank, host_size=host_size,
                    node=node, node_rank=members.index(rank), node_size=len(members),
                    num_nodes=len(set(node_of)), node_of=node_of)
