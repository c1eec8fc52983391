"""CPU: a proxy region grown in place while the proxy runs (the workspace grown between nodes,
issue 24): a WRITE past the old end lands once every rank grew it; growing refuses to shrink, an
unknown region, and the verbs transport (the NIC holds its registration)."""

import time

import numpy as np
import pytest

from mkernel.comm.proxy import FLAG_SET, WRITE, CommandQueue, Proxy
from mkernel.core.errors import ArgumentError

from tests.helpers.jobs import WORLD, collectively, relaunch

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
        assert proxy.regions_grow
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
@pytest.mark.parametrize("transport", ["host", "tcp"])
def test_a_region_grows_while_the_proxy_runs(request, transport):
    if not relaunch(request):
        collectively(_grow_and_write, transport)


def test_verbs_regions_do_not_grow():
    """The NIC's registration covers the old span only: the communicator keeps its workspace then."""
    assert Proxy.regions_grow.fget(type("P", (), {"transport": "verbs"})()) is False
