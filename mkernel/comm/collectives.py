"""MPI collectives that give up instead of hanging: a rank that died never arrives, and the others
must raise (``mkernel.PeerError``) within the timeout rather than wait forever."""

import time

from mkernel.core import env
from mkernel.core.errors import PeerError


def _timeout(timeout_s):
    return float(timeout_s if timeout_s is not None else env.get_float("MKERNEL_TIMEOUT_S"))


def wait(req, what: str, rank: int, timeout_s=None) -> None:
    """Complete a non-blocking MPI request, or raise PeerError after the timeout."""
    limit = _timeout(timeout_s)
    deadline = time.monotonic() + limit
    while not req.Test():
        if time.monotonic() > deadline:
            raise PeerError(f"rank {rank}: not every peer answered while {what} within {limit:g} s; "
                            f"a peer died, is stuck, or issues ops in another order")
        time.sleep(1e-4)


def barrier(comm, timeout_s=None, what: str = "at a barrier") -> None:
    wait(comm.Ibarrier(), what, comm.Get_rank(), timeout_s)


def allgather_bytes(comm, data: bytes, what: str, timeout_s=None) -> list:
    """Every rank's ``data`` (all the same length), in rank order."""
    import numpy

    send = numpy.frombuffer(data, dtype=numpy.uint8)
    recv = numpy.empty(len(data) * comm.Get_size(), dtype=numpy.uint8)
    wait(comm.Iallgather(send, recv), what, comm.Get_rank(), timeout_s)
    return [recv[i * len(data):(i + 1) * len(data)].tobytes() for i in range(comm.Get_size())]


def allgather_object(comm, obj, what: str, timeout_s=None) -> list:
    """Every rank's picklable ``obj`` (of any size), in rank order; gives up like allgather_bytes."""
    import pickle
    import struct

    data = pickle.dumps(obj)
    sizes = [struct.unpack("<Q", b)[0] for b in allgather_bytes(comm, struct.pack("<Q", len(data)), what, timeout_s)]
    padded = allgather_bytes(comm, data.ljust(max(sizes), b"\0"), what, timeout_s)
    return [pickle.loads(b[:n]) for b, n in zip(padded, sizes)]
