"""Transports end to end on the CPU: every rank writes payloads of 1 byte to 64 MiB to every other rank
through its proxy, and checks each incoming write's bytes the moment its flag appears (a flag seen
before its data fails the check); then FLUSH and SIGNAL-add complete. Also: a rank killed
mid-transfer makes the others raise within 30 s, and a stopped one makes them time out.

At one rank each test relaunches itself under ``mpiexec -n 2``; under mpiexec it runs in place.
Run as a module from the repository root (``python -m tests.cpu.test_transport kill tcp``, ``stop
host``) it is the killed- or stopped-rank worker.
"""

import os
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mkernel.comm.proxy import FLAG_ADD, FLAG_SET, FLUSH, SIGNAL, WRITE, CommandQueue, Proxy
from mkernel.core.errors import PeerError, TimeoutError

from tests.helpers.jobs import WORLD, collectively, mpiexec, relaunch, slow
from tests.helpers.rdma import NEEDS_RDMA, VERBS

SIZES = [1, 2, 3, 1000, 4096 + 3, (1 << 19) + 1, (1 << 20) + 7, 3 << 20, 64 << 20]  # one WRITE each, per peer
STOPPED_TIMEOUT_S = 5  # the proxies' timeout in the stopped-rank test
SRC_SKEW = 4096  # source offsets are unaligned, inside this


def _source(rank):
    return np.random.default_rng(rank).integers(0, 256, max(SIZES) + SRC_SKEW, dtype=np.uint8)


def _layout():
    src_off = [(k * 977) % SRC_SKEW for k in range(len(SIZES))]
    dst_off = np.concatenate([[0], np.cumsum(SIZES)[:-1]]).tolist()
    return src_off, dst_off, sum(SIZES)


def _started(proxy, src, dst, flags, queue):
    """Registers src as region 0, dst as region 1, flags as region 2, attaches queue, then connects
    and starts proxy (collective)."""
    proxy.register(0, src.ctypes.data, src.nbytes)
    proxy.register(1, dst.ctypes.data, dst.nbytes)
    proxy.register_flags(2, flags.ctypes.data, flags.size)
    proxy.attach_queue(queue)
    proxy.connect()
    proxy.start()


def _exchange(transport, **proxy_options):
    rank, n = WORLD.Get_rank(), WORLD.Get_size()
    peers = [r for r in range(n) if r != rank]
    K = len(SIZES)
    src_off, dst_off, slice_bytes = _layout()
    src = _source(rank)
    dst = np.zeros(n * slice_bytes, dtype=np.uint8)
    write_flag = lambda s, k: s * K + k
    flush_flag = lambda q: n * K + q
    counter = n * K + n
    flags = np.zeros(counter + 1, dtype=np.uint32)
    queue = CommandQueue(64)  # smaller than the commands issued: wraps around
    with Proxy(WORLD, transport=transport, bind_address="127.0.0.1", **proxy_options) as proxy:
        _started(proxy, src, dst, flags, queue)
        for k, nbytes in enumerate(SIZES):
            for q in peers:
                queue.push(WRITE, q, nbytes, src=(0, src_off[k]), dst=(1, rank * slice_bytes + dst_off[k]),
                           flag=(write_flag(rank, k), 1000 + k, FLAG_SET))
        for q in peers:
            queue.push(FLUSH, q, flag=(flush_flag(q), 7, FLAG_SET))

        sources = {s: _source(s) for s in peers}
        pending = {(s, k) for s in peers for k in range(K)}
        deadline = time.monotonic() + slow(60)
        while pending:
            proxy.check()
            assert time.monotonic() < deadline, f"writes {sorted(pending)} never arrived"
            for s, k in sorted(pending):
                v = int(flags[write_flag(s, k)])
                if v == 0:
                    continue
                assert v == 1000 + k
                lo = s * slice_bytes + dst_off[k]
                got, want = dst[lo:lo + SIZES[k]], sources[s][src_off[k]:src_off[k] + SIZES[k]]
                assert np.array_equal(got, want), (f"flag of write {k} ({SIZES[k]} B) from rank {s} "
                                                   "was seen before its data")
                pending.discard((s, k))
        for q in peers:  # FLUSH: every earlier command to q is applied there
            proxy.wait_flag(flags, flush_flag(q), 7)
        for q in peers:
            queue.push(SIGNAL, q, flag=(counter, 1, FLAG_ADD))
        proxy.wait_flag(flags, counter, len(peers))

        untouched = np.ones(dst.size, dtype=bool)  # nothing outside the writes was touched
        for s in peers:
            untouched[s * slice_bytes:(s + 1) * slice_bytes] = False
        assert not dst[untouched].any()
        stats = proxy.stats()
        assert stats["frames_rejected"] == 0
        for q in peers:
            assert stats["peers"][q]["bytes_sent"] == sum(SIZES)
            assert stats["peers"][q]["bytes_received"] == sum(SIZES)
            assert stats["peers"][q]["writes"] == K
        proxy.check()
        # Closing needs no barrier: every peer's FLUSH to us completed before it sent the SIGNAL we waited for.


@pytest.mark.mpi
@pytest.mark.parametrize("transport, options", [("tcp", dict(tcp_connections=4)),
                                                ("tcp", dict(shuffle_seed=12345, tcp_connections=3)),
                                                ("host", {}), ("host", dict(host_run_chunks=1)),
                                                ("host", dict(host_run_chunks=16)),
                                                pytest.param("verbs", {}, marks=NEEDS_RDMA)],
                         ids=["tcp", "tcp-shuffle", "host", "host-run1", "host-run16", "verbs"])
def test_payloads_and_flags(request, transport, options):
    if not relaunch(request):
        collectively(_exchange, transport, **options)


def _rounds(transport, rounds=300, tiles=8, tile=64 << 10):
    """The pattern of the TP ops between nodes: ranks as 2 nodes, each paired with the rank of the
    same local index on the other node; per round a credit SIGNAL (SET), then, once the partner's
    credit is seen, tile WRITEs counted in the partner's arrival flag (ADD), then a FLUSH."""
    rank, n = WORLD.Get_rank(), WORLD.Get_size()
    L = n // 2
    partner = (rank + L) % n
    src = np.zeros(tiles * tile, np.uint8)
    dst = np.zeros(tiles * tile, np.uint8)
    flags = np.zeros(3, np.uint32)  # credit, arrivals, flush
    queue = CommandQueue(64)
    with Proxy(WORLD, [r // L for r in range(n)], transport=transport, bind_address="127.0.0.1") as proxy:
        _started(proxy, src, dst, flags, queue)
        for rd in range(1, rounds + 1):
            src[:] = (rank * 31 + rd) & 0xFF  # the partner wrote round rd - 1 and we checked it
            queue.push(SIGNAL, partner, flag=(0, rd, FLAG_SET))
            proxy.wait_flag(flags, 0, rd, timeout_s=slow(30))
            for t in range(tiles):
                queue.push(WRITE, partner, tile, src=(0, t * tile), dst=(1, t * tile), flag=(1, 1, FLAG_ADD))
            queue.push(FLUSH, partner, flag=(2, rd, FLAG_SET))
            proxy.wait_flag(flags, 1, rd * tiles, timeout_s=slow(30))
            assert (dst == ((partner * 31 + rd) & 0xFF)).all(), f"rank {rank} round {rd}: stale or torn tiles"
            proxy.wait_flag(flags, 2, rd, timeout_s=slow(30))
        stats = proxy.stats()["peers"][partner]
        assert stats["bytes_received"] == stats["bytes_sent"] == rounds * tiles * tile
        WORLD.Barrier()  # the partner's last FLUSH needs our proxy to answer it


@pytest.mark.mpi
@pytest.mark.parametrize("transport", ["host", "tcp", VERBS])
def test_rounds_of_credits_writes_and_counters(request, transport):
    """300 rounds of credit, counted WRITEs and FLUSH between paired ranks of 2 nodes (CPU memory)."""
    if relaunch(request):
        return
    if WORLD.Get_size() % 2:
        pytest.skip("ranks pair up across 2 nodes")
    collectively(_rounds, transport)


def _survive(rank, start, wait):
    """A survivor: runs wait() and prints how it ended, for _survivors to read."""
    try:
        wait()
        print(f"SURVIVOR {rank} raised nothing after {time.monotonic() - start:.2f} s", flush=True)
    except (PeerError, TimeoutError) as e:
        print(f"SURVIVOR {rank} raised {type(e).__name__} after {time.monotonic() - start:.2f} s: {e}", flush=True)


def _survivors(worker, transport):
    """Runs ``worker`` as a 3-rank job of its own in which rank 1 fails; [(error, seconds)] of ranks
    0 and 2, whose messages must name rank 1."""
    r = mpiexec(3, ["-m", __name__, worker, transport], timeout=90, extra=["--with-ft", "ulfm"])
    lines = re.findall(r"SURVIVOR (\d) raised (\w+) after ([\d.]+) s(?:: (.*))?", r.stdout)
    assert sorted(int(line[0]) for line in lines) == [0, 2], f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    for _, kind, _, msg in lines:
        assert "rank 1" in msg and "peer 1" in msg, (kind, msg)
    return [(kind, float(seconds)) for _, kind, seconds, _ in lines]


def _killed_worker(transport):
    """Rank 1 dies (SIGKILL) right after enqueueing a 64 MiB write; the others wait for its flags."""
    rank, n = WORLD.Get_rank(), WORLD.Get_size()
    big = 64 << 20
    src = np.ones(big, dtype=np.uint8)
    dst = np.zeros(n * big, dtype=np.uint8)
    flags = np.zeros(n, dtype=np.uint32)
    queue = CommandQueue(64)
    proxy = Proxy(WORLD, transport=transport, bind_address="127.0.0.1", timeout_s=120)
    _started(proxy, src, dst, flags, queue)
    WORLD.Barrier()
    start = time.monotonic()
    if rank == 1:
        for q in range(n):
            if q != rank:
                queue.push(WRITE, q, big, dst=(1, rank * big), flag=(rank, 1, FLAG_SET))
        os.kill(os.getpid(), signal.SIGKILL)
    for q in range(n):
        if q != rank:
            queue.push(WRITE, q, big, dst=(1, rank * big), flag=(rank, 1, FLAG_SET))

    def wait():
        while True:  # the flag of rank 1 never comes (or comes, and the next check still sees it die)
            proxy.wait_flag(flags, 1, 2, timeout_s=100)
    _survive(rank, start, wait)
    time.sleep(1)  # stay up, so that the other survivor sees rank 1's death and not our exit
    os._exit(0)  # MPI cannot finalize with a dead rank


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "host", VERBS])
def test_killed_rank_makes_others_raise(transport):
    if WORLD.Get_size() > 1:
        pytest.skip("launches its own mpiexec job, so it runs from the one-rank pass")
    for kind, seconds in _survivors("kill", transport):
        assert kind == "PeerError" and seconds < 30, (kind, seconds)


def _stopped_worker(transport):
    """Rank 1 stops (SIGSTOP) after set-up: alive to the OS and its NIC, silent to its peers, which
    WRITE to it and FLUSH; rank 0 kills it once both have reported."""
    rank = WORLD.Get_rank()
    pids = WORLD.allgather(os.getpid())
    src, dst = np.zeros(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    flags = np.zeros(1, dtype=np.uint32)
    queue = CommandQueue(64)
    proxy = Proxy(WORLD, transport=transport, bind_address="127.0.0.1", timeout_s=STOPPED_TIMEOUT_S)
    _started(proxy, src, dst, flags, queue)
    WORLD.Barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    deadline = time.monotonic() + 30  # until rank 1 is stopped: its proxy thread must not answer first
    while Path(f"/proc/{pids[1]}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":  # its state
        assert time.monotonic() < deadline, "rank 1 did not stop"
        time.sleep(0.01)
    start = time.monotonic()
    queue.push(WRITE, 1, src.nbytes, dst=(1, 0))  # a FLUSH with nothing sent may complete at once (host)
    queue.push(FLUSH, 1, flag=(0, 1, FLAG_SET))
    _survive(rank, start, lambda: proxy.wait_flag(flags, 0, 1, timeout_s=100))
    time.sleep(2)  # the other survivor reports before rank 1 goes (no collective: rank 1 is stopped)
    if rank == 0:
        os.kill(pids[1], signal.SIGKILL)
    os._exit(0)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "host", VERBS])
def test_stopped_rank_makes_others_time_out(transport):
    """A peer that hangs (its process stopped, its NIC still answering) is a TimeoutError naming it,
    after the proxy's timeout: not before (a slow peer gets all of it), nor long after."""
    if WORLD.Get_size() > 1:
        pytest.skip("launches its own mpiexec job, so it runs from the one-rank pass")
    for kind, seconds in _survivors("stop", transport):
        assert kind == "TimeoutError" and STOPPED_TIMEOUT_S - 1 < seconds < STOPPED_TIMEOUT_S + 10, (kind, seconds)


if __name__ == "__main__" and sys.argv[1:2] == ["kill"]:
    _killed_worker(sys.argv[2])
if __name__ == "__main__" and sys.argv[1:2] == ["stop"]:
    _stopped_worker(sys.argv[2])


def test_tcp_listener_admits_only_the_job_secret():
    """The acceptor drops a stranger (wrong secret) and logs it, admits the peer, and proves the secret back."""
    import hashlib
    import hmac
    import socket as so
    import threading

    from mkernel.comm.proxy import _ACK, _HELLO, _MAGIC_HELLO

    secret = os.urandom(32)
    proxy = Proxy(MPI.COMM_SELF, transport="tcp")
    proxy.rank, proxy.peers = 1, [0]  # this end plays rank 1, expecting one connection from rank 0
    listener = so.create_server(("127.0.0.1", 0))
    addr = listener.getsockname()
    got = {}

    def dial(name, key, nonce, sent):
        s = so.create_connection(addr, timeout=10)
        s.sendall(_HELLO.pack(_MAGIC_HELLO, key, nonce, 0, 0))
        sent.set()
        got[name] = s.recv(_ACK.size)
        s.close()

    dialers = []
    for name, key, nonce in (("stranger", os.urandom(32), b"s" * 16), ("peer", secret, b"n" * 16)):
        sent = threading.Event()  # the stranger is queued first: it must not take the peer's place
        dialers.append(threading.Thread(target=dial, args=(name, key, nonce, sent)))
        dialers[-1].start()
        assert sent.wait(10)
    admitted = proxy._tcp_accept(listener, secret, 1, time.monotonic() + 10)
    for d in dialers:
        d.join()
    listener.close()
    assert [r for r, _ in admitted] == [0]
    for _, s in admitted:
        s.close()
    assert got["stranger"] == b""  # closed without an answer
    magic, proof, rank = _ACK.unpack(got["peer"])
    assert rank == 1 and hmac.compare_digest(proof, hmac.new(secret, b"n" * 16, hashlib.sha256).digest())
    proxy.close()


def test_host_segments_are_owner_only_unlinked_and_refused_otherwise():
    from mkernel.verbs import ffi, lib

    name = f"/mkernel-test-{os.getpid()}".encode()
    path = "/dev/shm" + name.decode()
    why = ffi.new("char[]", 256)
    addr = lib.mk_host_segment_create(name, why, 256)
    assert addr, ffi.string(why)
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert not lib.mk_host_segment_create(name, why, 256)  # exclusive: nobody can pre-create ours
        os.chmod(path, 0o644)
        assert not lib.mk_host_segment_open(name, why, 256) and b"owner-only" in ffi.string(why)
        os.chmod(path, 0o600)
        assert lib.mk_host_segment_open(name, why, 256), ffi.string(why)
    finally:
        lib.mk_host_segment_unlink(name)
    assert not os.path.exists(path)
