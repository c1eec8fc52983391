"""CPU: a proxy region grown in place while the proxy runs (the workspace grown between nodes,
issue 24): a WRITE past the old end lands once every rank grew it; growing refuses to shrink and an
unknown region. Verbs: over soft-RoCE where tools/verbs_vm.sh runs it, and the grown span's key
exchange (every rank, or none) on a stand-in for the C side."""

import time

import numpy as np
import pytest

from mkernel.comm.proxy import FLAG_SET, WRITE, CommandQueue, Proxy
from mkernel.core.errors import ArgumentError

from tests.helpers.jobs import WORLD, collectively, relaunch
from tests.helpers.rdma import VERBS

OLD, NEW = 1 << 20, 3 << 20


def _grow_and_write(transport):
    rank, n = WORLD.Get_rank(), WORLD.Get_size()
    peers = [r for r in range(n) if r != rank]
    src = np.random.default_rng(rank).integers(0, 256, NEW, dtype=np.uint8)
    dst = np.zeros(n * NEW, dtype=np.uint8)  # rank s writes [s * NEW + OLD, (s + 1) * NEW): past the old end
    flags = np.zeros(n, dtype=np.uint32)
    with Proxy(WORLD, transport=transport, bind_address="127.0.0.1") as proxy:
        proxy.register(0, src.ctypes.data, src.nbytes)
        proxy.register(1, dst.ctypes.data, OLD)  # every write below lands past this end...
        proxy.register_flags(2, flags.ctypes.data, flags.size)
        proxy.attach_queue(CommandQueue(64))
        proxy.connect()
        proxy.start()
        with pytest.raises(ArgumentError, match="cannot grow"):
            proxy.grow_region(1, OLD - 1)  # smaller than now
        with pytest.raises(ArgumentError, match="not registered"):
            proxy.grow_region(7, NEW)
        proxy.grow_region(1, n * NEW)  # ... until it grew: every rank, then the writes
        WORLD.Barrier()
        for q in peers:
            proxy.queue.push(WRITE, q, NEW - OLD, src=(0, OLD), dst=(1, rank * NEW + OLD), flag=(rank, 1, FLAG_SET))
        deadline = time.monotonic() + 30
        for s in peers:
            while flags[s] != 1:
                proxy.check()
                assert time.monotonic() < deadline, f"the write from rank {s} never arrived"
                time.sleep(1e-3)
            want = np.random.default_rng(s).integers(0, 256, NEW, dtype=np.uint8)[OLD:]
            assert np.array_equal(dst[s * NEW + OLD:(s + 1) * NEW], want), f"rank {s}'s bytes past the old end"
        assert proxy.stats()["frames_rejected"] == 0
        proxy.check()
        WORLD.Barrier()  # no peer still sends to us when we close


@pytest.mark.mpi
@pytest.mark.parametrize("transport", ["host", "tcp", VERBS])
def test_a_region_grows_while_the_proxy_runs(request, transport):
    if not relaunch(request):
        collectively(_grow_and_write, transport)


class _FakeVerbsLib:
    """The C calls grow_region makes on the verbs transport (each rank's grown region: base 0x1000 x
    (rank + 1), key 100 + rank), recording the peers' keys it is given."""

    def __init__(self, rank, fail_grow=False, fail_peer=None):
        self.rank, self.fail_grow, self.fail_peer, self.remote, self.grown = rank, fail_grow, fail_peer, {}, None

    def mk_proxy_grow_region(self, p, region, nbytes):
        self.grown = (region, nbytes)
        return -1 if self.fail_grow else 0

    def mk_proxy_last_setup_error(self, p):
        return _ffi().new("char[]", b"cannot register the grown span")

    def mk_verbs_region_key(self, p, region, addr, size, rkey):
        addr[0], size[0], rkey[0] = 0x1000 * (self.rank + 1), self.grown[1], 100 + self.rank
        return 0

    def mk_verbs_set_remote_region(self, p, peer, region, addr, size, rkey):
        self.remote[peer] = (region, addr, size, rkey)
        return -1 if peer == self.fail_peer else 0

    def mk_proxy_error(self, p, info):
        return 0


def _ffi():
    from mkernel.runtime.extension import proxy_ext

    return proxy_ext()[0]


class _Ranks:
    """A communicator of stand-in ranks: allgather round i returns rounds[i] with this rank's value in place."""

    def __init__(self, rank, rounds):
        self.rank, self.rounds = rank, list(rounds)

    def Get_rank(self):
        return self.rank

    def allgather(self, x):
        values = list(self.rounds.pop(0))
        values[self.rank] = x
        return values


def _verbs_proxy(lib, comm, nranks):
    proxy = Proxy.__new__(Proxy)
    proxy.transport, proxy.comm, proxy.rank, proxy.nranks = "verbs", comm, comm.Get_rank(), nranks
    proxy.peers = [r for r in range(nranks) if r != proxy.rank]
    proxy._ffi, proxy._lib, proxy._p = _ffi(), lib, None
    return proxy


def test_verbs_grow_registers_then_takes_every_peers_new_key():
    lib = _FakeVerbsLib(rank=1)
    keys = [(0x1000, NEW, 100), None, (0x3000, NEW, 102)]  # what ranks 0 and 2 send
    comm = _Ranks(1, [[None] * 3, keys, [None] * 3])  # the errors' round, the keys, the errors again
    _verbs_proxy(lib, comm, 3).grow_region(0, NEW)
    assert lib.grown == (0, NEW) and not comm.rounds
    assert lib.remote == {0: (0, 0x1000, NEW, 100), 2: (0, 0x3000, NEW, 102)}


@pytest.mark.parametrize("failure", ["grow", "peer"])
def test_verbs_grow_failing_on_one_rank_raises_on_every_rank(failure):
    from mkernel.core.errors import PeerError

    lib = _FakeVerbsLib(rank=0, fail_grow=failure == "grow", fail_peer=1 if failure == "peer" else None)
    comm = _Ranks(0, [[None, None], [None, (0x2000, NEW, 101)], [None, None]])
    own = ArgumentError if failure == "grow" else PeerError  # its own region, as the other transports raise
    with pytest.raises(own, match="rank 0: (cannot register the grown span|rank 1's grown region 0 was refused)"):
        _verbs_proxy(lib, comm, 2).grow_region(0, NEW)
    # the other rank, whose own part went well, raises in the same round (no rank waits for another)
    rounds = [["rank 0's error", None]] if failure == "grow" else [[None, None], [(0x1000, NEW, 100), None],
                                                                   ["rank 0's error", None]]
    lib1 = _FakeVerbsLib(rank=1)
    with pytest.raises(PeerError, match="rank 0: rank 0's error"):
        _verbs_proxy(lib1, _Ranks(1, rounds), 2).grow_region(0, NEW)
    assert lib1.remote == ({} if failure == "grow" else {0: (0, 0x1000, NEW, 100)})
