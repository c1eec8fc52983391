"""The workspace allocator: offsets are a pure function of every rank's free ranges (so symmetric
across ranks), even when ranks' free ranges differ (ranges other communicators of a shared pool hold)."""

import random
import types

import pytest

import mkernel
from mkernel.comm.plans import PlanRegistry
from mkernel.comm.scratch import Scratch
from mkernel.comm.symmetric import ALIGN, FreeList, take_symmetric
from mkernel.core.errors import PeerError

TOTAL = 1 << 24


def _take(lists, nbytes):
    off, size = take_symmetric([fl.free for fl in lists], nbytes, TOTAL)
    for fl in lists:
        fl.take_at(off, size)
    return off, size


def test_same_calls_same_offsets_and_no_overlap():
    def replay(seed):
        rng, fl, live, offsets = random.Random(seed), FreeList(4096, TOTAL), [], []
        for _ in range(2000):
            if live and rng.random() < 0.45:
                fl.give(*live.pop(rng.randrange(len(live))))
            else:
                off, size = _take([fl], rng.randrange(1, 1 << 16))
                assert off % ALIGN == 0 and size % ALIGN == 0
                assert all(off + size <= o or o + s <= off for o, s in live), "overlapping ranges"
                live.append((off, size))
                offsets.append(off)
        for r in live:
            fl.give(*r)
        assert fl.free == [(4096, TOTAL)], "freeing everything must give back one range"
        return offsets
    assert replay(7) == replay(7)


def test_ranks_with_different_holdings_get_a_range_free_on_all():
    """Three ranks; each also holds ranges only it has (a sub-communicator's arena on some ranks
    only). Shared allocations must land where all three are free, and never overlap anyone's."""
    rng = random.Random(3)
    lists = [FreeList(4096, TOTAL) for _ in range(3)]
    own = [[] for _ in lists]
    shared = []
    for _ in range(600):
        r = rng.randrange(3)
        if rng.random() < 0.3:  # a range only rank r takes (its own communicator's)
            off, size = _take([lists[r]], rng.randrange(1, 1 << 15))
            own[r].append((off, size))
        elif rng.random() < 0.3 and own[r]:
            lists[r].give(*own[r].pop(rng.randrange(len(own[r]))))
        elif shared and rng.random() < 0.4:
            off, size = shared.pop(rng.randrange(len(shared)))
            for fl in lists:
                fl.give(off, size)
        else:
            off, size = _take(lists, rng.randrange(1, 1 << 15))
            for held in own + [shared]:
                assert all(off + size <= o or o + s <= off for o, s in held), "overlapping ranges"
            shared.append((off, size))


def test_exhaustion_is_a_workspace_error():
    fl = FreeList(0, 4 * ALIGN)
    _take([fl], 3 * ALIGN)
    with pytest.raises(mkernel.WorkspaceError, match="2048 bytes wanted"):
        _take([fl], 2 * ALIGN)


def test_grown_size_doubles_fits_the_request_and_respects_the_cap():
    from mkernel.comm.symmetric import grown_size

    MiB, g = 1 << 20, 2 << 20
    assert grown_size(256 * MiB, 10 * MiB, g, 1 << 40) == 512 * MiB  # at least double
    assert grown_size(256 * MiB, 300 * MiB, g, 1 << 40) == 556 * MiB  # room for it past the end
    assert grown_size(256 * MiB, 10 * MiB, g, 300 * MiB) == 300 * MiB  # doubling stops at the cap
    assert grown_size(256 * MiB, 100 * MiB, g, 300 * MiB) is None  # the request itself passes it
    assert grown_size(256 * MiB, 1, g, 1 << 40) % g == 0


class _FakeHeap:
    """The heap interface Communicator.empty and _grow_for use, over a FreeList (no GPU)."""

    def __init__(self, nbytes, growable=True):
        from mkernel.comm.symmetric import CONTROL_BYTES, take_symmetric

        self.nbytes, self.growable, self.grown, self.base = nbytes, growable, [], 0
        self.in_use, self.free_on_device = 0, 1 << 40
        self._take = take_symmetric
        self.free = FreeList(CONTROL_BYTES, nbytes - CONTROL_BYTES)

    def granularity(self):
        return 2 << 20

    def device_free(self):
        return self.free_on_device

    def alloc_symmetric(self, mpi, nbytes, what, agree=None):
        views = mpi.allgather(self.free.free)
        off, size = self._take(views, nbytes, self.nbytes)
        self.free.take_at(off, size)
        return off, size

    def array(self, rng, shape, dtype):
        return rng

    def grow(self, node_mpi, nbytes, token):
        self.grown.append((nbytes, token is not None))
        self.free.give(self.nbytes, nbytes - self.nbytes)
        self.nbytes = nbytes


class _FakeProxy:
    def __init__(self, transport, refuse=False):
        self.transport, self.refuse, self.grown = transport, refuse, []

    def grow_region(self, region, nbytes):
        if self.refuse:  # the verbs transport: a rank could not register the grown span with its NIC
            raise PeerError("proxy set-up failed: rank 0: cannot register GPU region")
        self.grown.append((region, nbytes))


def _service(proxy):
    from mkernel.comm.communicator import ProxyService
    return ProxyService(proxy, None, 0, None, None)


def _fake_comm(heap, proxy=None, sub=False):
    from mpi4py import MPI

    c = mkernel.Communicator.__new__(mkernel.Communicator)
    c._closed, c.heap, c._proxy, c.rank, c.device_id = False, heap, proxy, MPI.COMM_WORLD.rank, 0
    c.mpi = c.node_mpi = MPI.COMM_WORLD
    c._root = object() if sub else c
    c.plans = PlanRegistry(synchronize=lambda: None)
    c.scratch = Scratch(c)
    return c


@pytest.mark.mpi
def test_empty_grows_the_workspace_in_place_when_it_is_full(monkeypatch):
    """comm.empty: a request no free range holds grows the workspace (every rank to the same size,
    at least double) and succeeds at the old end; it raises WorkspaceError naming why where the
    workspace cannot grow (legacy IPC, a sub-communicator, the cap) or the proxy cannot take the grown
    range (a NIC's registration failed). Any rank count."""
    monkeypatch.setenv("MKERNEL_WORKSPACE_MAX_BYTES", str(1 << 30))
    MiB = 1 << 20
    heap = _FakeHeap(8 * MiB)
    comm = _fake_comm(heap)
    first = comm.empty(5 * MiB, "uint8")
    second = comm.empty(6 * MiB, "uint8")  # no room left: grows 8 -> 16 MiB
    assert heap.grown == [(16 * MiB, True)] and second[0] >= first[0] + first[1]
    comm.empty(64 * MiB, "uint8")  # past double: grows to fit
    assert heap.nbytes >= 8 * MiB + 6 * MiB + 64 * MiB and len(heap.grown) == 2
    for fake, kw, why in [(_FakeHeap(8 * MiB, growable=False), {}, "legacy CUDA IPC"),
                          (_FakeHeap(8 * MiB), {"sub": True}, "sub-communicator")]:
        with pytest.raises(mkernel.WorkspaceError, match=why):
            _fake_comm(fake, **kw).empty(16 * MiB, "uint8")
        assert not fake.grown
    for transport in ("host", "verbs"):  # a running proxy that grows its region with the heap
        heap, proxy = _FakeHeap(8 * MiB), _FakeProxy(transport)
        _fake_comm(heap, proxy=_service(proxy)).empty(16 * MiB, "uint8")
        assert heap.grown and proxy.grown == [(mkernel.Communicator.PROXY_WORKSPACE_REGION, heap.nbytes)]
    with pytest.raises(mkernel.WorkspaceError, match="verbs transport could not take the grown range: .*register"):
        _fake_comm(_FakeHeap(8 * MiB), proxy=_service(_FakeProxy("verbs", refuse=True))).empty(16 * MiB, "uint8")
    monkeypatch.setenv("MKERNEL_WORKSPACE_MAX_BYTES", str(12 * MiB))
    with pytest.raises(mkernel.WorkspaceError, match="MKERNEL_WORKSPACE_MAX_BYTES"):
        _fake_comm(_FakeHeap(8 * MiB)).empty(16 * MiB, "uint8")


@pytest.mark.mpi
def test_a_growth_the_gpu_cannot_hold_raises_on_every_rank_saying_what_is_held(monkeypatch):
    """The GPU short of memory on one rank: every rank raises WorkspaceError before any allocation,
    naming the bytes needed, the bytes free and what this communicator holds. Any rank count."""
    import cupy
    from mpi4py import MPI

    monkeypatch.setattr(cupy, "get_default_memory_pool", lambda: types.SimpleNamespace(total_bytes=lambda: 0))
    monkeypatch.setenv("MKERNEL_WORKSPACE_MAX_BYTES", str(1 << 30))
    MiB = 1 << 20
    heap = _FakeHeap(8 * MiB)
    if MPI.COMM_WORLD.rank == MPI.COMM_WORLD.size - 1:
        heap.free_on_device = 4 * MiB
    with pytest.raises(mkernel.WorkspaceError, match=r"needs \d+ more bytes on GPU 0, which has \d+ free.*plans"):
        _fake_comm(heap).empty(16 * MiB, "uint8")
    assert not heap.grown


@pytest.mark.mpi
def test_a_failed_allocation_during_growth_fails_every_rank(monkeypatch):
    """A rank whose growth raises (its cuMemCreate failed after the check): every rank raises
    WorkspaceError naming that rank, none hangs. Any rank count."""
    from mpi4py import MPI

    monkeypatch.setenv("MKERNEL_WORKSPACE_MAX_BYTES", str(1 << 30))
    MiB = 1 << 20
    heap = _FakeHeap(8 * MiB)
    last = MPI.COMM_WORLD.size - 1
    if MPI.COMM_WORLD.rank == last:
        def grow(node_mpi, nbytes, token):
            raise mkernel.WorkspaceError("allocating 8388608 more bytes of workspace failed on node rank 0: oom")
        heap.grow = grow
    with pytest.raises(mkernel.WorkspaceError, match=f"growing it failed on rank {last}"):
        _fake_comm(heap).empty(16 * MiB, "uint8")


@pytest.mark.mpi
def test_empty_releases_cached_plans_before_growing(monkeypatch):
    """comm.empty: when no free range holds a request, the ops' cached plans are released first
    (their buffers freed), and the workspace grows only if that is not enough. Any rank count."""
    monkeypatch.setenv("MKERNEL_WORKSPACE_MAX_BYTES", str(1 << 30))
    MiB = 1 << 20
    heap = _FakeHeap(8 * MiB)
    comm = _fake_comm(heap)

    class Held:  # a plan's buffer: its range goes back when the plan is dropped
        def __init__(self, rng):
            self.rng = rng

        def __del__(self):
            heap.free.give(*self.rng)

    comm.plans.add(("op", 1), {"buf": Held(comm.empty(5 * MiB, "uint8"))})
    comm.empty(6 * MiB, "uint8")  # fits once the plan is gone: no growth
    assert not heap.grown and len(comm.plans) == 0
    comm.plans.add(("op", 2), {"buf": Held(comm.empty(MiB, "uint8"))})
    comm.empty(8 * MiB, "uint8")  # still too big after the release: grows
    assert len(heap.grown) == 1 and len(comm.plans) == 0


def test_taking_a_range_that_is_not_free_is_an_error():
    fl = FreeList(0, 4 * ALIGN)
    fl.take_at(ALIGN, ALIGN)
    with pytest.raises(mkernel.MKernelError, match="out of step"):
        fl.take_at(0, 2 * ALIGN)


@pytest.mark.mpi
def test_workspace_descriptors_reach_every_node_rank():
    """vmm.exchange_fds (how cuMem workspaces are shared): every rank passes a descriptor of a file
    only it wrote; each gets a working descriptor of every peer's file, its own unchanged. At any
    rank count; twice (fresh sockets each time)."""
    import os
    import tempfile
    import uuid

    from mpi4py import MPI

    from mkernel.comm import vmm

    world = MPI.COMM_WORLD
    for rep in range(2):
        token = world.bcast(uuid.uuid4().hex if world.rank == 0 else None)
        with tempfile.TemporaryFile() as f:
            f.write(f"rank {world.rank} rep {rep}".encode())
            f.flush()
            fds = vmm.exchange_fds(world, token, f.fileno())
            assert fds[world.rank] == f.fileno()
            for p, fd in enumerate(fds):
                assert os.pread(fd, 64, 0) == f"rank {p} rep {rep}".encode()
                if p != world.rank:
                    os.close(fd)
        world.Barrier()


def test_cumem_structs_match_cuda_h(tmp_path):
    """The ctypes mirrors of CUmemAllocationProp and CUmemAccessDesc (mkernel.vmm) against cuda.h."""
    import ctypes
    import shutil
    import subprocess
    from pathlib import Path

    from mkernel.comm import vmm

    inc = next((Path(p) for p in ("/usr/local/cuda/include", "/usr/include") if (Path(p) / "cuda.h").exists()), None)
    cxx = shutil.which("g++")
    if inc is None or cxx is None:
        pytest.skip("needs cuda.h and g++")
    src = tmp_path / "l.cpp"
    src.write_text('#include <cuda.h>\n#include <cstdio>\n#include <cstddef>\n'
                   'int main() { std::printf("%zu %zu %zu %zu %zu\\n", '
                   'sizeof(CUmemAllocationProp), offsetof(CUmemAllocationProp, location), '
                   'offsetof(CUmemAllocationProp, win32HandleMetaData), offsetof(CUmemAllocationProp, allocFlags), '
                   'sizeof(CUmemAccessDesc)); }\n')
    subprocess.run([cxx, "-I", str(inc), str(src), "-o", str(tmp_path / "l")], check=True)
    got = [int(x) for x in
           subprocess.run([str(tmp_path / "l")], capture_output=True, text=True, check=True).stdout.split()]
    assert got == [ctypes.sizeof(vmm._Prop), vmm._Prop.location.offset, vmm._Prop.win32HandleMetaData.offset,
                   vmm._Prop.allocFlags.offset, ctypes.sizeof(vmm._Access)]
    assert vmm._HANDLE_TYPE_POSIX_FD == 1 and vmm._ALLOCATION_TYPE_PINNED == 1 and vmm._ACCESS_READWRITE == 3


def test_default_workspace_is_a_share_of_the_gpu():
    """MKERNEL_WORKSPACE_BYTES=auto: 1/64 of the GPU's memory among the ranks on it, 64 MiB to 1 GiB."""
    from mkernel.comm.symmetric import default_workspace_bytes

    MiB, GiB = 1 << 20, 1 << 30
    h200 = 150_000 * MiB
    assert default_workspace_bytes(h200, 1) == GiB  # 2.3 GB capped
    assert default_workspace_bytes(h200, 2) == GiB  # 1.17 GB capped
    assert default_workspace_bytes(h200, 4) == 584 * MiB  # 585.9 MiB down to 2 MiB
    assert default_workspace_bytes(h200, 64) == 64 * MiB  # the floor
    assert all(default_workspace_bytes(h200, n) % (2 * MiB) == 0 for n in range(1, 9))
