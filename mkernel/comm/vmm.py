"""GPU memory that outlives the process that made it: CUDA virtual memory management (cuMem*)
allocations shared between the ranks of a node as POSIX file descriptors.

With legacy CUDA IPC (cudaIpcGetMemHandle) an allocation is freed when its owner exits, and a
peer's kernel still writing into it faults; under MPS one client's fault takes down every client
on the GPU. A cuMem allocation imported from its file descriptor holds its own reference: a rank
that dies leaves its workspace mapped in the survivors, whose kernels then time out instead.

The descriptors travel over Unix sockets of the abstract namespace (SCM_RIGHTS), named after a
token the node agrees on; ranks of one node share a network namespace.
"""

import ctypes
import os
import socket

from mkernel.core.errors import MKernelError, WorkspaceError

# cuda.h enumerations
_ALLOCATION_TYPE_PINNED = 1
_HANDLE_TYPE_POSIX_FD = 1
_LOCATION_TYPE_DEVICE = 1
_ACCESS_READWRITE = 3
_GRANULARITY_RECOMMENDED = 1
EXCHANGE_TIMEOUT_S = 60.0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_lib = []


def _cuda():
    if not _lib:
        _lib.append(ctypes.CDLL("libcuda.so.1"))
    return _lib[0]


def _check(what, rc):
    if rc != 0:
        raise MKernelError(f"{what} failed (CUresult {rc})")


def _prop(device, rdma=False):
    p = _Prop()
    p.type, p.requestedHandleTypes = _ALLOCATION_TYPE_PINNED, _HANDLE_TYPE_POSIX_FD
    p.location = _Location(_LOCATION_TYPE_DEVICE, device)
    p.allocFlags.gpuDirectRDMACapable = int(rdma)  # the proxy may register it with a NIC (dma-buf)
    return p


def granularity(device: int) -> int:
    g = ctypes.c_size_t()
    _check("cuMemGetAllocationGranularity",
           _cuda().cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(_prop(device)),
                                                 _GRANULARITY_RECOMMENDED))
    return g.value


class Region:
    """A reserved range of ``reserve`` virtual bytes at ``ptr`` into which whole allocations are
    mapped back to back from offset 0 (``nbytes`` so far), read-write from ``device``. Growing maps
    another allocation at the end: the base and everything mapped stay where they are. :meth:`close`
    unmaps them and drops this process's references (each allocation goes with its last one)."""

    def __init__(self, reserve: int, device: int):
        self.reserve, self.device, self.nbytes, self.ptr, self._chunks = reserve, device, 0, 0, []
        ptr = ctypes.c_uint64()
        _check("cuMemAddressReserve", _cuda().cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(reserve),
                                                                  ctypes.c_size_t(0), ctypes.c_uint64(0),
                                                                  ctypes.c_ulonglong(0)))
        self.ptr = ptr.value

    def map(self, handle: int, nbytes: int):
        """Maps allocation ``handle`` (``nbytes``) at offset ``self.nbytes``; the region takes the handle."""
        cu = _cuda()
        if self.nbytes + nbytes > self.reserve:
            cu.cuMemRelease(ctypes.c_ulonglong(handle))
            raise MKernelError(f"the workspace's reserved {self.reserve} bytes of address space are full")
        at = self.ptr + self.nbytes
        rc = cu.cuMemMap(ctypes.c_uint64(at), ctypes.c_size_t(nbytes), ctypes.c_size_t(0), ctypes.c_ulonglong(handle),
                         ctypes.c_ulonglong(0))
        if rc != 0:
            cu.cuMemRelease(ctypes.c_ulonglong(handle))
            _check("cuMemMap", rc)
        self._chunks.append((at, nbytes, handle))
        access = _Access(_Location(_LOCATION_TYPE_DEVICE, self.device), _ACCESS_READWRITE)
        _check("cuMemSetAccess", cu.cuMemSetAccess(ctypes.c_uint64(at), ctypes.c_size_t(nbytes), ctypes.byref(access),
                                                   ctypes.c_size_t(1)))
        self.nbytes += nbytes

    def close(self):
        cu = _cuda()
        for at, nbytes, handle in reversed(self._chunks):
            cu.cuMemUnmap(ctypes.c_uint64(at), ctypes.c_size_t(nbytes))
            cu.cuMemRelease(ctypes.c_ulonglong(handle))
        self._chunks = []
        if self.ptr:
            cu.cuMemAddressFree(ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.reserve))
            self.ptr = 0


def create(nbytes: int, device: int) -> int:
    """A new allocation of ``nbytes`` (a multiple of :func:`granularity`) on ``device``: its handle."""
    h = ctypes.c_ulonglong()
    rc = 1
    for rdma in (True, False):  # RDMA-capable where the device can (a NIC may register it), else plain
        rc = _cuda().cuMemCreate(ctypes.byref(h), ctypes.c_size_t(nbytes), ctypes.byref(_prop(device, rdma)),
                                 ctypes.c_ulonglong(0))
        if rc == 0:
            break
    _check("cuMemCreate", rc)
    return h.value


def release(handle: int):
    _cuda().cuMemRelease(ctypes.c_ulonglong(handle))


def export_fd(handle: int) -> int:
    fd = ctypes.c_int(-1)
    _check("cuMemExportToShareableHandle",
           _cuda().cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_ulonglong(handle), _HANDLE_TYPE_POSIX_FD,
                                                ctypes.c_ulonglong(0)))
    return fd.value


def import_fd(fd: int) -> int:
    """This process's handle of a peer's allocation, given its descriptor."""
    h = ctypes.c_ulonglong()
    _check("cuMemImportFromShareableHandle",
           _cuda().cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fd), _HANDLE_TYPE_POSIX_FD))
    return h.value


def exchange_fds(node_mpi, token: str, fd: int) -> list:
    """Every rank of ``node_mpi`` passes its descriptor; returns the node's, by rank (this rank's own
    ``fd`` at its place; the others are new descriptors of this process, to close after import).
    Collective over the node: listen, barrier, connect to every peer, answer every peer, receive."""
    me, n = node_mpi.rank, node_mpi.size
    name = lambda r: f"\0mkernel-{token}-{r}".encode()  # noqa: E731
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.settimeout(EXCHANGE_TIMEOUT_S)
    out, conns = [None] * n, {}
    try:
        srv.bind(name(me))
        srv.listen(max(1, n))
        node_mpi.Barrier()
        for p in range(n):
            if p != me:
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.settimeout(EXCHANGE_TIMEOUT_S)
                c.connect(name(p))
                c.sendall(me.to_bytes(4, "little"))
                conns[p] = c
        for _ in range(n - 1):
            a, _addr = srv.accept()
            with a:
                a.settimeout(EXCHANGE_TIMEOUT_S)
                socket.send_fds(a, [b"fd"], [fd])
                a.recv(4)  # the peer's rank: it connected; its own copy is taken below
        for p, c in conns.items():
            _msg, fds, _flags, _addr = socket.recv_fds(c, 16, 1)
            if len(fds) != 1:
                raise MKernelError(f"workspace exchange: node rank {p} sent no descriptor")
            out[p] = fds[0]
    except OSError as e:
        raise MKernelError(f"workspace exchange between the node's ranks failed on node rank {me}: {e}") from e
    finally:
        srv.close()
        for c in conns.values():
            c.close()
    out[me] = fd
    return out


def add_node_chunk(node_mpi, regions: list, nbytes: int, device: int, token: str):
    """Every rank of ``node_mpi`` makes an allocation of ``nbytes``; each maps every rank's at the end
    of that rank's region (``regions[p]``). Collective over the node; ``token`` names its sockets.
    Raises WorkspaceError on every node rank when any rank's allocation fails."""
    try:
        own, why = create(nbytes, device), None
    except MKernelError as e:
        own, why = None, str(e)
    whys = node_mpi.allgather(why) if node_mpi.size > 1 else [why]
    if any(whys):
        if own is not None:
            release(own)
        r = next(r for r, w in enumerate(whys) if w)
        raise WorkspaceError(f"allocating {nbytes} more bytes of workspace failed on node rank {r}: {whys[r]}")
    try:
        fd = export_fd(own)
    except MKernelError:
        release(own)
        raise
    fds = [fd]
    try:
        fds = exchange_fds(node_mpi, token, fd) if node_mpi.size > 1 else [fd]
        for p, f in enumerate(fds):
            regions[p].map(own if p == node_mpi.rank else import_fd(f), nbytes)
    finally:
        for f in fds:
            os.close(f)
