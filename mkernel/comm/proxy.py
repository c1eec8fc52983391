"""The host side of GPU-initiated inter-node communication: the command queue's memory, the proxy
thread (C, in :mod:`mkernel.verbs`), connection setup over MPI, and transport selection.

The communicator makes one :class:`Proxy` per process::

    queue = CommandQueue(capacity, gpu=True)            # pinned mapped host ring + device counter
    proxy = Proxy(mpi_comm, node_ids, transport="auto", cuda_device=dev)
    proxy.register(0, workspace_ptr, workspace_bytes, kind="cuda")
    proxy.register_flags(1, flags_host_ptr, nflags)     # the u32 flags peers' commands set
    proxy.attach_queue(queue)
    proxy.connect()                                      # collective: secrets, sockets, segments, blobs
    proxy.start()
    ...  kernels enqueue through queue.device_args(); proxy.check() raises a peer's failure ...
    barrier(mpi_comm); proxy.close()                     # once no peer can still send (timed barrier)

Everything before ``start()`` is set-up on the calling thread; after it, Python is not involved per
command. Only ranks on other nodes (``node_ids`` differ) are connected.
"""

import ctypes
import hmac
import os
import socket
import struct
import time

import numpy as np

from mkernel.comm import collectives
from mkernel.core import env
from mkernel.core.errors import ArgumentError, MKernelError, NoRDMADeviceError, PeerError, TimeoutError
from mkernel.core.log import get_logger
from mkernel.runtime import compile as _compile
from mkernel.runtime.extension import proxy_ext
from mkernel.runtime.sync import MkSync

log = get_logger("proxy")
SPIN_S = 0.02  # host waits (wait_flag) poll without sleeping this long, then back off to 1 ms
CHECK_S = 0.001  # and look at the proxy's error state this often

TRANSPORTS = ("null", "tcp", "host", "verbs")  # the C ids' order (mk_proxy_create); null: the proxy's tests only
USER_TRANSPORTS = ("auto", "verbs", "host", "tcp")  # what a communicator accepts ("auto": select_transport)
_KIND = {"host": 0, "cuda": 1}
_CMD_NAMES = {0: "none", 1: "WRITE", 2: "SIGNAL", 3: "FLUSH", 4: "NOP"}
_HELLO = struct.Struct("<8s32s16sii")  # magic, secret, nonce, rank, connection index
_ACK = struct.Struct("<8s32si")        # magic, hmac(secret, nonce), rank
_MAGIC_HELLO, _MAGIC_ACK = b"MKTCPHI1", b"MKTCPOK1"


def _timeout_s(timeout_s):
    return float(timeout_s if timeout_s is not None else env.get_float("MKERNEL_TIMEOUT_S"))


class QueueHeader(ctypes.Structure):
    """Mirror of MkQueueHeader (mkernel/cuda/primitives/queue_layout.cuh); a CPU test checks the two agree."""
    _fields_ = [("tail", ctypes.c_uint64), ("error", ctypes.c_uint32), ("capacity", ctypes.c_uint32),
                ("pad0", ctypes.c_uint32 * 12), ("reserve", ctypes.c_uint64), ("pad1", ctypes.c_uint32 * 14)]


class QueueArgs(ctypes.Structure):
    """Mirror of MkQueue, the producer's view inside a kernel's argument struct."""
    _fields_ = [("header", ctypes.c_void_p), ("slots", ctypes.c_void_p), ("reserve", ctypes.c_void_p),
                ("ranks", ctypes.c_void_p), ("workspace_base", ctypes.c_uint64), ("mask", ctypes.c_uint32),
                ("flag_base", ctypes.c_uint32), ("flags", ctypes.c_void_p), ("relay", ctypes.c_void_p)]


CMD_BYTES = 32
_CMD = struct.Struct("<IBBHIIHBBHHII")  # MkCmd, field for field
WRITE, SIGNAL, FLUSH, NOP = 1, 2, 3, 4   # MK_CMD_*
FLAG_NONE, FLAG_SET, FLAG_ADD = 0, 1, 2  # MK_FLAG_*


class CommandQueue:
    """The ring of 32-byte commands and its header, in host memory the proxy reads.

    With ``gpu=True`` both live in pinned host memory mapped into the GPU (valid on the device as is,
    under unified addressing) and the ticket counter is a u64 in device memory; without, plain host
    memory for CPU producers (tests)."""

    def __init__(self, capacity: int = 1 << 16, gpu: bool = False):
        if capacity < 2 or capacity > 1 << 30 or capacity & (capacity - 1):
            raise ArgumentError(f"queue capacity {capacity} must be a power of two in 2..2^30")
        self.capacity, self.gpu = capacity, gpu
        nbytes = ctypes.sizeof(QueueHeader) + capacity * CMD_BYTES
        if gpu:
            import cupy
            self._host = cupy.cuda.runtime.hostAlloc(nbytes, 2)  # cudaHostAllocMapped
            ctypes.memset(self._host, 0, nbytes)
            base = self._host
            self._reserve = cupy.zeros(2, dtype=cupy.uint64)  # ticket counter, cached tail (queue.cuh)
        else:
            self._buf = np.zeros(nbytes + 64, dtype=np.uint8)
            base = (self._buf.ctypes.data + 63) & ~63
            self._reserve = None
        self.header_address = base
        self.slots_address = base + ctypes.sizeof(QueueHeader)
        self.header = QueueHeader.from_address(base)
        self.header.capacity = capacity

    def push(self, type_, peer=0, nbytes=0, src=(0, 0), dst=(0, 0), flag=(0, 0, 0), timeout_s=None):
        """Enqueues one command from the host (C, release-ordered): flag is (id, value, MK_FLAG_* op)."""
        if self.gpu:
            raise ArgumentError("host pushes take tickets from the host counter; a GPU queue's come from the device "
                                "counter, so only kernels enqueue into it")
        _, lib, _ = proxy_ext()
        body = _CMD.pack(0, type_, flag[2], peer, nbytes, flag[1], flag[0], src[0], dst[0],
                         src[1] >> 32, dst[1] >> 32, src[1] & 0xFFFFFFFF, dst[1] & 0xFFFFFFFF)
        if lib.mk_queue_push(self.header_address, self.slots_address, body, _timeout_s(timeout_s)):
            raise TimeoutError(f"the command queue stayed full for {_timeout_s(timeout_s):.1f} s "
                               f"(proxy error word {self.header.error})")

    def device_args(self, ranks=None, workspace_base=0, flag_base=0, flags=None, relay=None) -> QueueArgs:
        """The producer's view. ranks (device u16 array: the caller's rank -> the proxy's), workspace_base
        and flag_base translate a sub-communicator's names into the proxy's (MkQueue). Kernels that wait
        for flags need flags (the proxy's flag array, a pointer) and relay (a zeroed device uint32 array
        of two words per flag, zeroed again with any flag the host zeroes)."""
        if not self.gpu:
            raise ArgumentError("device_args() needs a queue made with gpu=True")
        return QueueArgs(self.header_address, self.slots_address, self._reserve.data.ptr,
                         ranks.data.ptr if ranks is not None else None, workspace_base, self.capacity - 1, flag_base,
                         flags, relay.data.ptr if relay is not None else None)

    def produce_test_commands(self, threads: int, per_thread: int, timeout_s=None):
        """CPU producer threads (C, GIL released) enqueue threads*per_thread verify NOPs."""
        _, lib, _ = proxy_ext()
        if lib.mk_test_produce(self.header_address, self.slots_address, threads, per_thread, _timeout_s(timeout_s)):
            raise TimeoutError(f"CPU producers could not enqueue {threads}x{per_thread} commands: the queue stayed "
                               f"full (proxy error word {self.header.error})")

    def close(self):
        if self.gpu and self._host:
            import cupy
            cupy.cuda.runtime.freeHost(self._host)
            self._host = 0


def probe_rdma():
    """(active RDMA ports, what the probe saw). -1 ports: libibverbs is not installed."""
    ffi, lib, _ = proxy_ext()
    buf = ffi.new("char[]", 256)
    n = lib.mk_verbs_probe(buf, 256)
    return n, ffi.string(buf).decode()


def describe_transports() -> list:
    """Lines for ``python -m mkernel info``: what this build and this machine can use."""
    try:
        have_verbs = proxy_ext()[2]
    except MKernelError as e:
        return [f"transports: none ({e})"]
    ports, report = probe_rdma()
    verbs_line = ("verbs: not in this build (no rdma-core headers at build time)" if not have_verbs
                  else f"verbs: {'available' if ports > 0 else 'no active RDMA port'} ({report})")
    return ["transports: host, tcp" + (", verbs" if have_verbs and ports > 0 else ""), "  " + verbs_line]


def select_transport(requested: str, comm, node_ids) -> str:
    """Resolves "auto": verbs when an active RDMA port exists, else host memory when every rank of
    another node is on this very host, else TCP. The same answer on every rank (agreed over MPI)."""
    if requested not in TRANSPORTS + USER_TRANSPORTS:
        raise ArgumentError(f"transport {requested!r} is not one of {', '.join(USER_TRANSPORTS)} (or null)")
    if requested != "auto":
        return requested
    ports, report = probe_rdma()
    hosts = comm.allgather(socket.gethostname())
    me = comm.Get_rank()
    remote = [r for r in range(comm.Get_size()) if node_ids[r] != node_ids[me]]
    same_host = all(hosts[r] == hosts[me] for r in remote)
    votes = comm.allgather((ports > 0, same_host))
    if all(v[0] for v in votes):
        choice = "verbs"
    elif all(v[1] for v in votes):
        choice = "host"
    else:
        choice = "tcp"
    log.info("transport auto -> %s (RDMA probe: %s; peers of other nodes on this host: %s)", choice, report, same_host)
    return choice


def barrier(comm, timeout_s=None):
    """An MPI barrier that raises PeerError instead of hanging when a rank never arrives (it failed)."""
    collectives.barrier(comm, _timeout_s(timeout_s))

def _agree(comm, error, own=PeerError):
    """Raises on every rank if set-up failed on any (so that no rank waits for a peer that gave up):
    ``own`` where this rank's part failed, PeerError where only others' did."""
    errors = comm.allgather(error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        raise (own if error else PeerError)("proxy set-up failed: " + "; ".join(f"rank {r}: {e}" for r, e in bad))


class Proxy:
    """One per process. See the module docstring for the call sequence."""

    def __init__(self, comm, node_ids=None, *, transport: str = "auto", cuda_device=None, timeout_s=None,
                 bind_address=None, tcp_connections=None, shuffle_seed=None, host_run_chunks=None):
        self.comm = comm
        self.rank, self.nranks = comm.Get_rank(), comm.Get_size()
        self.node_ids = list(node_ids) if node_ids is not None else list(range(self.nranks))
        if len(self.node_ids) != self.nranks:
            raise ArgumentError(f"node_ids has {len(self.node_ids)} entries for {self.nranks} ranks")
        self.timeout_s = _timeout_s(timeout_s)
        self.transport = select_transport(transport, comm, self.node_ids)
        self.peers = [r for r in range(self.nranks) if self.node_ids[r] != self.node_ids[self.rank]]
        self.bind_address = bind_address
        self.tcp_connections = int(tcp_connections or env.get("MKERNEL_TCP_CONNECTIONS"))
        self.host_run_chunks = int(host_run_chunks or env.get("MKERNEL_HOST_RUN_CHUNKS"))
        if not 1 <= self.host_run_chunks <= 16:
            raise ArgumentError(f"host_run_chunks (MKERNEL_HOST_RUN_CHUNKS) must be 1 to 16; "
                                f"got {self.host_run_chunks}")
        self.shuffle_seed = shuffle_seed
        self._ffi, self._lib, _ = proxy_ext()
        self._p = self._lib.mk_proxy_create(self.rank, self.nranks, TRANSPORTS.index(self.transport), self.timeout_s)
        if self._p == self._ffi.NULL:
            raise ArgumentError(f"could not create a proxy for rank {self.rank} of {self.nranks}")
        self._started = self._connected = False
        try:
            if cuda_device is not None:
                self._setup(self._lib.mk_proxy_set_cuda_device(self._p, int(cuda_device)), "set_cuda_device")
            if self.transport == "verbs":  # every rank opens its device, or every rank raises
                try:
                    self._verbs_open()
                    error = None
                except NoRDMADeviceError as e:
                    error = str(e)
                errors = [e for e in comm.allgather(error) if e]
                if errors:
                    raise NoRDMADeviceError("; ".join(errors))
        except BaseException:
            self.close()
            raise

    # ---- set-up (before start) ----

    def _setup(self, rc, what):
        if rc:
            msg = self._ffi.string(self._lib.mk_proxy_last_setup_error(self._p)).decode()
            raise ArgumentError(f"proxy {what} on rank {self.rank}: {msg}")

    def register(self, region_id: int, address: int, nbytes: int, kind: str = "host"):
        """Makes [address, address + nbytes) a target (and source) of commands under `region_id`."""
        if kind not in _KIND:
            raise ArgumentError(f"region kind {kind!r} is not 'host' or 'cuda'")
        self._setup(self._lib.mk_proxy_register(self._p, region_id, address, nbytes, _KIND[kind]),
                    f"register({region_id})")

    def grow_region(self, region_id: int, nbytes: int):
        """Region ``region_id`` now spans ``nbytes`` from the same address (a workspace grown in place),
        also while running. Verbs: collective, every rank registers the grown span with its NIC and
        then takes its peers' new keys (PeerError on every rank where one failed); else local."""
        if self.transport != "verbs":
            self._setup(self._lib.mk_proxy_grow_region(self._p, region_id, nbytes), f"grow_region({region_id})")
            return
        ffi, lib = self._ffi, self._lib
        addr, size, rkey = ffi.new("unsigned long long*"), ffi.new("unsigned long long*"), ffi.new("unsigned int*")
        error = None
        if lib.mk_proxy_grow_region(self._p, region_id, nbytes):  # as _setup raises for the other transports
            error = ffi.string(lib.mk_proxy_last_setup_error(self._p)).decode()
        elif lib.mk_verbs_region_key(self._p, region_id, addr, size, rkey):
            error = self._error_text() or f"region {region_id} has no registration"
        _agree(self.comm, error, own=ArgumentError)
        keys = self.comm.allgather((addr[0], size[0], rkey[0]))
        for q in self.peers:
            if lib.mk_verbs_set_remote_region(self._p, q, region_id, *keys[q]):
                error = self._error_text() or f"rank {q}'s grown region {region_id} was refused"
                break
        _agree(self.comm, error)

    def register_flags(self, region_id: int, address: int, count: int):
        """The u32 flag array peers' WRITE/SIGNAL set and this rank's FLUSHes complete into (host memory)."""
        self.register(region_id, address, 4 * count, "host")
        self._setup(self._lib.mk_proxy_set_flags(self._p, region_id), "register_flags")

    def attach_queue(self, queue: CommandQueue):
        self.queue = queue
        self._setup(self._lib.mk_proxy_attach_queue(self._p, queue.header_address, queue.slots_address), "attach_queue")

    def connect(self):
        """Collective over the communicator: connects this rank to every rank of another node."""
        if self.transport == "tcp":
            self._connect_tcp()
        elif self.transport == "host":
            self._connect_host()
        elif self.transport == "verbs":
            self._connect_verbs()
        self._connected = True

    def _secret(self):
        return self.comm.bcast(os.urandom(32) if self.rank == 0 else None, root=0)

    def _default_bind_address(self):
        """The interface the job uses: loopback within one host, else the one that routes to rank 0."""
        explicit = env.get("MKERNEL_TCP_ADDR")
        if explicit:
            return explicit
        hosts = self.comm.allgather(socket.gethostname())
        if len(set(hosts)) == 1:
            return "127.0.0.1"
        root = socket.gethostbyname(hosts[0])
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((root, 9))  # no packet is sent: this only asks the kernel for the route
            return s.getsockname()[0]

    def _connect_tcp(self):
        secret = self._secret()
        addr = self.bind_address or self._default_bind_address()
        n = self.tcp_connections
        if not 1 <= n <= 16:
            raise ArgumentError(f"tcp_connections={n} must be in 1..16")
        listener, error = None, None
        try:
            listener = socket.create_server((addr, 0), backlog=n * self.nranks + 8)
        except OSError as e:
            error = f"cannot listen on {addr}: {e}"
        _agree(self.comm, error)
        endpoints = self.comm.allgather(listener.getsockname()[:2])
        deadline = time.monotonic() + self.timeout_s
        try:
            dialed = self._tcp_dial(endpoints, secret, n, deadline)
            incoming = self._tcp_accept(listener, secret, n, deadline)
            outgoing = self._tcp_await_acks(dialed, secret, deadline)
            error = None
        except (MKernelError, OSError) as e:
            error = str(e)
            outgoing, incoming = [], []
        finally:
            listener.close()  # the door is open only while the job connects
        _agree(self.comm, error)
        for peer, sock in outgoing + incoming:
            sock.setblocking(False)
            if self._lib.mk_tcp_add_connection(self._p, peer, sock.detach()):
                raise ArgumentError(f"could not hand a connection to rank {peer} to the proxy")
        if self.shuffle_seed is not None:
            self._lib.mk_tcp_set_shuffle(self._p, self.shuffle_seed)

    def _tcp_dial(self, endpoints, secret, n, deadline):
        out = []
        for peer in (q for q in self.peers if q > self.rank):
            for i in range(n):
                s = socket.create_connection(tuple(endpoints[peer]), timeout=max(deadline - time.monotonic(), 0.1))
                nonce = os.urandom(16)
                s.sendall(_HELLO.pack(_MAGIC_HELLO, secret, nonce, self.rank, i))
                out.append((peer, s, nonce))
        return out

    def _tcp_accept(self, listener, secret, n, deadline):
        expected = {(q, i) for q in self.peers if q < self.rank for i in range(n)}
        got = []
        while expected:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank {self.rank}: no authenticated TCP connection from ranks "
                                   f"{sorted({q for q, _ in expected})} within {self.timeout_s:.0f} s")
            listener.settimeout(left)
            try:
                s, where = listener.accept()
            except socket.timeout:
                continue
            s.settimeout(max(min(deadline - time.monotonic(), 5.0), 0.1))
            try:
                magic, their_secret, nonce, peer, idx = _HELLO.unpack(_recv_exact(s, _HELLO.size))
            except (OSError, struct.error, ConnectionError):
                magic, their_secret, peer, idx, nonce = b"", b"", -1, -1, b""
            if magic != _MAGIC_HELLO or not hmac.compare_digest(their_secret, secret) or (peer, idx) not in expected:
                log.warning("rejected a TCP connection from %s: %s", where,
                            "wrong job secret" if magic == _MAGIC_HELLO else "not an mkernel proxy hello")
                s.close()
                continue
            s.sendall(_ACK.pack(_MAGIC_ACK, hmac.new(secret, nonce, "sha256").digest(), self.rank))
            expected.discard((peer, idx))
            got.append((peer, s))
        return got

    def _tcp_await_acks(self, outgoing, secret, deadline):
        """The acceptor proves it knows the secret too, so a stranger cannot pose as a peer's listener."""
        done = []
        for peer, s, nonce in outgoing:
            s.settimeout(max(deadline - time.monotonic(), 0.1))
            try:
                magic, proof, their_rank = _ACK.unpack(_recv_exact(s, _ACK.size))
            except (OSError, ConnectionError) as e:
                raise PeerError(f"rank {self.rank}: rank {peer} did not acknowledge the TCP handshake: {e}") from e
            if (magic != _MAGIC_ACK or their_rank != peer
                    or not hmac.compare_digest(proof, hmac.new(secret, nonce, "sha256").digest())):
                raise PeerError(f"rank {self.rank}: the listener of rank {peer} failed the handshake "
                                f"(wrong job secret)")
            done.append((peer, s))
        return done

    def _connect_host(self):
        ffi, lib = self._ffi, self._lib
        tag = self._secret().hex()[:16]  # unguessable names; creation is exclusive and owner-only
        name = lambda src, dst: f"/mkernel-{tag}-{src}-{dst}".encode()
        why = ffi.new("char[]", 256)
        created, opened, handed, error = [], [], 0, None
        try:
            for q in self.peers:
                addr = lib.mk_host_segment_create(name(self.rank, q), why, 256)
                if not addr:
                    error = ffi.string(why).decode()
                    break
                created.append((q, addr))
            _agree(self.comm, error)
            for q in self.peers:
                addr = lib.mk_host_segment_open(name(q, self.rank), why, 256)
                if not addr:
                    error = ffi.string(why).decode()
                    break
                opened.append((q, addr))
            _agree(self.comm, error)
            for (q, send), (_, recv) in zip(created, opened):
                if lib.mk_host_add_peer(self._p, q, send, recv):
                    raise ArgumentError(f"could not hand the host segments of rank {q} to the proxy")
                handed += 1  # the proxy unmaps these
        except BaseException:
            for _, addr in created[handed:] + opened[handed:]:  # a set-up that failed part-way
                lib.mk_host_segment_unmap(addr)
            raise
        finally:  # mapped by both sides now, or given up: nothing is left to find in /dev/shm
            for q, _ in created:
                lib.mk_host_segment_unlink(name(self.rank, q))
        if lib.mk_host_set_run(self._p, self.host_run_chunks):
            raise ArgumentError(f"could not set the host transport's run of {self.host_run_chunks} chunks")

    def _verbs_open(self):
        ports, report = probe_rdma()
        if ports <= 0:
            raise NoRDMADeviceError(f"transport 'verbs' was asked for on rank {self.rank}, but {report}")
        device = env.get("MKERNEL_VERBS_DEVICE").encode() or self._ffi.NULL
        rc = self._lib.mk_verbs_open(self._p, device, int(env.get("MKERNEL_VERBS_PORT")),
                                     int(env.get("MKERNEL_VERBS_GID_INDEX")))
        if rc:
            raise NoRDMADeviceError(f"rank {self.rank}: {self._error_text() or 'could not open the RDMA device'}")
        log.info("rank %d: verbs on %s", self.rank, self.verbs_endpoint())

    def verbs_endpoint(self) -> str:
        """The opened RDMA device, port, link, GID (index, address, type) and MTU (transport verbs)."""
        buf = self._ffi.new("char[]", 256)
        if self.transport != "verbs" or self._lib.mk_verbs_describe(self._p, buf, 256):
            raise ArgumentError(f"rank {self.rank}: no RDMA device is open (transport {self.transport!r})")
        return self._ffi.string(buf).decode()

    def _connect_verbs(self):
        ffi, lib = self._ffi, self._lib
        size = lib.mk_verbs_blob_bytes()
        blobs, error = [b""] * self.nranks, None
        for q in self.peers:
            buf = ffi.new("unsigned char[]", size)
            if lib.mk_verbs_local_blob(self._p, q, buf, size) < 0:
                error = self._error_text() or f"could not make a queue pair for rank {q}"
                break
            blobs[q] = bytes(ffi.buffer(buf, size))
        _agree(self.comm, error)
        theirs = self.comm.alltoall(blobs)
        for q in self.peers:
            if lib.mk_verbs_connect(self._p, q, theirs[q], len(theirs[q])):
                error = self._error_text() or f"connecting to rank {q} failed"
                break
        _agree(self.comm, error)

    # ---- running ----

    def start(self):
        if self.peers and not self._connected and self.transport != "null":
            raise ArgumentError("call connect() (collective) before start()")
        self._setup(self._lib.mk_proxy_start(self._p), "start")
        self._started = True
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
        if cores == 1:  # mpirun binds each rank to one core by default (2 ranks or fewer)
            log.warning("rank %d: this process may run on one core only, so the proxy thread shares it with "
                        "the main thread and moves data slower; give each rank two cores or more (mpirun "
                        "--bind-to none, or --map-by slot:PE=2)", self.rank)

    def stop(self):
        """Stops the thread after it said goodbye to its peers. Call after a barrier, so that no peer
        still sends to this rank."""
        if self._p is not None and self._started:
            self._lib.mk_proxy_stop(self._p)
            self._started = False
        self._drain_log()

    def close(self):
        self.stop()
        if self._p is not None:
            self._lib.mk_proxy_destroy(self._p)
            self._p = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _drain_log(self):
        if self._p is None:
            return
        buf = self._ffi.new("char[]", 256)
        while self._lib.mk_proxy_next_log(self._p, buf, 256):
            log.warning("proxy of rank %d: %s", self.rank, self._ffi.string(buf).decode())

    def _error_text(self):
        info = self._ffi.new("mk_error_info*")
        return self._ffi.string(info.message).decode() if self._lib.mk_proxy_error(self._p, info) else None

    def check(self):
        """Raises the proxy's recorded failure (PeerError, TimeoutError) naming op, rank and peer."""
        self._drain_log()
        info = self._ffi.new("mk_error_info*")
        code = self._lib.mk_proxy_error(self._p, info)
        if not code:
            return
        msg = (f"proxy of rank {self.rank} ({self.transport}), op {_CMD_NAMES.get(info.op, info.op)}, "
               f"peer {info.peer}: {self._ffi.string(info.message).decode()}")
        if code == 1:
            raise TimeoutError(msg)
        if code == 2:
            raise PeerError(msg)
        raise MKernelError(msg)

    def stats(self) -> dict:
        s = self._ffi.new("mk_proxy_stats*")
        per = self._ffi.new("mk_peer_stats[]", self.nranks)
        self._lib.mk_proxy_get_stats(self._p, s, per)
        fields = ("bytes_sent", "bytes_received", "writes", "signals", "flushes")
        return {"commands": s.commands, "frames_rejected": s.frames_rejected,
                "verify": {"distinct": s.verify_distinct, "duplicates": s.verify_duplicates,
                           "corrupt": s.verify_corrupt},
                "peers": {r: {f: getattr(per[r], f) for f in fields} for r in range(self.nranks)}}

    def verify_commands(self, expected: int):
        """Test mode: the proxy checks that NOP commands with ids 0..expected-1 arrive once each, intact."""
        if self._lib.mk_null_verify(self._p, expected):
            raise ArgumentError("verify mode is set before start()")

    def wait_flag(self, flags: np.ndarray, index: int, value: int, timeout_s=None):
        """Host-side wait until flags[index] == value, raising the proxy's error or a timeout instead of hanging."""
        start = time.monotonic()
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = start + limit
        sleep, checked = 0.0, start
        while int(flags[index]) != value:  # a read of mapped host memory: no call into the proxy
            now = time.monotonic()
            if now - checked > CHECK_S:  # the proxy's state is read under its lock: not on every poll
                self.check()
                checked = now
            if now > deadline:
                raise TimeoutError(f"rank {self.rank}: flag {index} is {int(flags[index])}, not {value}, after "
                                   f"{limit:.1f} s")
            if now - start > SPIN_S:  # spins first: a sleep would be what a benchmark measures
                time.sleep(sleep)
                sleep = min(sleep * 2 + 1e-5, 1e-3)
        self.check()


def _recv_exact(s, n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("connection closed during the handshake")
        data += chunk
    return data


# ---- GPU test and benchmark kernels (mkernel/cuda/tests/queue_test.cu) ----

QUEUE_TEST = _compile.register("queue_test", "queue_test.cu",
                               ["queue_stress<true>", "queue_stress<false>", "tile_exchange"])


class QueueStressArgs(ctypes.Structure):
    """Mirrors of queue_test_args.cuh (a CPU test compares them)."""
    _fields_ = [("sync", MkSync), ("queue", QueueArgs), ("iters", ctypes.c_uint32),
                ("bad_first_command", ctypes.c_uint32)]


class TileExchangeArgs(ctypes.Structure):
    _fields_ = [("sync", MkSync), ("queue", QueueArgs), ("send", ctypes.c_void_p), ("recv", ctypes.c_void_p),
                ("flags", ctypes.c_void_p), ("mismatches", ctypes.c_void_p)] + [
        (f, ctypes.c_uint32) for f in ("tiles", "tile_bytes", "flag_base", "peer", "send_region", "recv_region")] + [
        ("send_off", ctypes.c_uint64), ("recv_off", ctypes.c_uint64)]
