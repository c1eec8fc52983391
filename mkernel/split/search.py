"""``comm_sms="auto"`` for the fused tensor-parallel ops: the cross-call split search of
:mod:`mkernel.split` (docs/CONTROLLER.md, loop 1) wired into the calls.

Each call on a key (op, shape bucket, world, topology, transport) launches with the number of
communication CTAs that the key's search asks for; a timed call records two CUDA events around its
launch. A later call on the key feeds the search the times of earlier calls whose end event has
fired (``cudaEventQuery``): the host never waits for the GPU and no rank talks to another, so a
call only launches and returns, and a dead peer cannot hang the host here.

Each rank searches on its own times. The count need not agree across ranks: which CTA reduces or
pushes a tile changes who does the work and when, not what crosses the wire (tiles, flags and bytes
are fixed by tile ids; tests/gpu/test_tp_controller_gpu.py runs ranks pinned to different counts). A rank's
kernel time includes its waits for the others, so every rank sees the op's pace.

Each communicator has its own search memory (:func:`memory`): the two groups a rank belongs to
(tensor- and sequence-parallel) have different partners and so different curves. While a key's
search runs (about 7-10 calls) every call is timed, afterwards one in ``HOLD_SAMPLE`` (to see
drift). With ``MKERNEL_SPLIT_PERSIST=1`` converged keys are kept on disk
(:class:`mkernel.split.SplitMemory`; rank 0 writes, every rank reads), so a later process starts a
known key at its split. Inside each "auto" call the in-call controller (loop 2, tp_controller.cuh)
lends GEMM CTAs to communication when it falls behind; the search sees the call times with that
inside.
"""

import contextlib

from mkernel.core import config, env
from mkernel.core.errors import MKernelError
from mkernel.core.log import get_logger
from mkernel.split import policy as split

log = get_logger("autosplit")

HOLD_SAMPLE = 16  # once a key holds, every this-many-th call is timed (drift re-opens the search)
MAX_COMM_CTAS = 64  # the search's upper bound, and at most half the SMs: the GEMM keeps the rest
# The prior's model (docs/CONTROLLER.md): the comm CTAs load and store cta_bytes() (their copies and
# reductions, local traffic included) at config.cta_gbps each (between nodes config.cta_gbps_nodes),
# and the link carries comm_bytes() at its rate (config.nvlink_gbps, or between nodes
# config.transport_gbps[transport]).


def comm_bytes(op: str, M: int, N: int, K: int, world: int, esize: int, nodes: int = 1) -> int:
    """Bytes one rank moves over its slowest link in one call: inside a node, RS the partials of
    this rank's block from the other ranks, AR twice that (reduce, then gather), AG the other ranks'
    shards of A; between nodes only the network's share, one block per other node (the hierarchy
    sums or fans out inside the node over NVLink). ``M`` is the rows of the whole problem."""
    blocks = nodes - 1 if nodes > 1 else world - 1
    if op == "allgather_gemm":
        return blocks * (M // world) * K * esize
    once = blocks * (M // world) * N * esize
    return 2 * once if op == "gemm_allreduce" else once


def cta_bytes(op: str, M: int, N: int, K: int, world: int, esize: int, nodes: int = 1) -> int:
    """Bytes one rank's comm CTAs load and store in one call (a copy counts its load and its store).
    RS: each of this rank's node blocks sums its local ranks' partials into a store (out, or the
    stage of a node partial to send), the own block also loads the other nodes' partials; AR also
    stores its reduced block into its local peers' gather buffers, forwards the other nodes'
    reduced blocks into its node and copies the other local ranks' blocks into out; AG copies its
    shard into every local rank's buffer (its own too, unless config.tp_ag_copy_first copied it
    before the kernel) and forwards the other nodes' shards to its local peers."""
    L = world // nodes
    if op == "allgather_gemm":
        shard = (M // world) * K * esize
        own = 0 if config.get().tp_ag_copy_first else 1
        return 2 * shard * (L - 1 + own + (nodes - 1) * (L - 1))
    blk = (M // world) * N * esize
    rs = blk * (nodes * (L + 1) + nodes - 1)
    if op != "gemm_allreduce":
        return rs
    own = blk * ((L - 1) + (1 if nodes > 1 else 0))
    forwards = blk * (nodes - 1) * (L + 1)
    copies = blk * 2 * (world - nodes)
    return rs + own + forwards + copies


def prior_for(op: str, M: int, N: int, K: int, world: int, esize: int, nodes: int, link_gbps: float, sms: int,
              hi: int) -> int:
    """The model's first guess of comm CTAs: the smallest n minimising max(the GEMM on sms - n CTAs,
    cta_bytes over n CTAs, comm_bytes over the link)."""
    cb = cta_bytes(op, M, N, K, world, esize, nodes)
    lb = comm_bytes(op, M, N, K, world, esize, nodes)
    # split.prior's comm time is bytes / min(n * cta_rate, link_rate): with bytes = cta_bytes and the
    # link rate scaled to CTA bytes it is max(cta_bytes / (n * cta_rate), comm_bytes / link_rate).
    link_scaled = link_gbps * cb / lb if lb else 1e9
    cta_gbps = config.get().cta_gbps_nodes if nodes > 1 else config.get().cta_gbps
    return split.prior(comm_bytes=cb, cta_gbps=cta_gbps, link_gbps=link_scaled, gemm_ms=gemm_s(M, N, K, sms) * 1e3,
                       total=sms, lo=1, hi=hi)


def gemm_s(M: int, N: int, K: int, sms: int) -> float:
    """The model's time of one rank's GEMM of ``[M, K] x [K, N]`` on ``sms`` SMs (under MPS the
    rank's share, not the GPU's; config.gemm_tflops_per_sm)."""
    return 2.0 * M * N * K / (config.get().gemm_tflops_per_sm * sms * 1e12)


def gemm_share(op: str, M: int, N: int, K: int, comm, esize: int, sms: int) -> float:
    """The model's GEMM time on ``sms`` SMs over the time its link takes for one call's comm_bytes
    (the prior's rates): below 1 the link, not the GEMM, sets the call's pace."""
    lb = comm_bytes(op, M, N, K, comm.size, esize, comm.num_nodes)
    return gemm_s(M, N, K, sms) * _link_gbps(comm) * 1e9 / lb if lb else float("inf")


def _transport(comm) -> str:
    """The key's transport: "nvlink" inside a node, else the proxy's (started by the op's plan)."""
    if comm.num_nodes == 1:
        return "nvlink"
    stats = comm.stats() if hasattr(comm, "stats") else {}
    return str(stats.get("proxy") or getattr(comm, "transport", "host"))


def _link_gbps(comm) -> float:
    if comm.num_nodes == 1:
        return config.get().nvlink_gbps
    rates = config.get().transport_gbps
    return rates.get(_transport(comm), rates["host"])


class _KeyState:
    """One (op, M, N, K) of a communicator: its split key, this rank's bound, the model's prior, and
    the timed calls whose end has not been seen yet (oldest first)."""

    def __init__(self, key, hi, prior):
        self.key, self.hi, self.prior = key, hi, prior
        self.pending = []  # [(count, timer)]
        self.calls = 0
        self.n, self.settled = None, False  # the last call's count, and whether the search held it

    def steady(self, n) -> bool:
        """Whether the next call may replay a launch recorded with ``n`` comm CTAs (counted if so):
        the search holds at ``n``, that call is not one of those timed to see drift, and no timed
        call has ended unfed (a whole call collects it); one still running does not stop replays."""
        if not self.settled or self.n != n or (self.calls + 1) % HOLD_SAMPLE == 0:
            return False
        if self.pending and self.pending[0][1].ended():
            return False
        self.calls += 1
        return True

    def collect(self, mem):
        """Feeds the search every pending call that has ended, in launch order; never waits."""
        while self.pending and self.pending[0][1].ended():
            n, events = self.pending.pop(0)
            ms = events.elapsed_ms()
            nxt = mem.observe(self.key, n, ms)
            log.debug("%s: %d comm CTAs took %.3f ms; next %d", self.key[:2], n, ms, nxt)


class _Events:
    """The timer of one call: CUDA events around the launch (tests replace it)."""

    def __init__(self, stream):
        import cupy
        self.start, self.end = cupy.cuda.Event(), cupy.cuda.Event()
        self.stream = stream

    def before(self):
        self.start.record(self.stream)

    def after(self):
        self.end.record(self.stream)

    def ended(self) -> bool:
        return self.end.done  # cudaEventQuery: never blocks

    def elapsed_ms(self) -> float:
        import cupy
        return cupy.cuda.get_elapsed_time(self.start, self.end)


timer = _Events
MAX_PENDING = 8  # timed calls in flight per key; beyond this a call is not timed


def _states(comm) -> dict:
    return comm.plans.state.setdefault("autosplit.keys", {})


def memory(comm) -> split.SplitMemory:
    """The communicator's split memory (its keys' searches); with MKERNEL_SPLIT_PERSIST=1 every rank
    starts known keys from the file and rank 0 keeps converged keys there."""
    state = comm.plans.state
    if "autosplit.memory" not in state:
        persist = env.get_int("MKERNEL_SPLIT_PERSIST") == 1
        state["autosplit.memory"] = split.SplitMemory(persist=persist, write=comm.rank == 0)
    return state["autosplit.memory"]


def preload():
    """Builds or loads the split policy's host library now (from a plan's first call), so that the
    first "auto" call of a key is not the one that pays for it; without a host compiler that call
    raises, as before."""
    try:
        split.library()
    except MKernelError as e:
        log.info("the split policy's host library is not available yet: %s", e)


def choose(comm, op: str, *, M: int, N: int, K: int, esize: int, comm_items: int, sms: int,
           joined_in_node: bool = False):
    """(comm CTAs for this call, a token for :func:`timed`). Local: no collective, no wait. A call
    whose GEMM CTAs join the reduction inside one node starts its search at one comm CTA: the
    joined CTAs do the reduction's bulk, which the model's prior does not count (bench/NOTES.md)."""
    mem = memory(comm)
    st = _states(comm).get((op, M, N, K))
    if st is None:
        key = split.split_key(op, (M, N, K), comm.size, f"{comm.num_nodes}x{comm.local_size}", _transport(comm))
        hi = max(1, min(MAX_COMM_CTAS, comm_items, sms // 2))
        prior = 1 if joined_in_node else \
            prior_for(op, M, N, K, comm.size, esize, comm.num_nodes, _link_gbps(comm), sms, hi)
        st = _states(comm)[(op, M, N, K)] = _KeyState(key, hi, prior)
    st.collect(mem)
    n = mem.choose(st.key, st.prior, lo=1, hi=st.hi)
    st.calls += 1
    converged = mem.search(st.key).converged
    st.n, st.settled = n, converged
    sampled = not converged or st.calls % HOLD_SAMPLE == 0
    return n, (st, n, sampled and len(st.pending) < MAX_PENDING)


@contextlib.contextmanager
def timed(token, stream):
    """Around the launch of the call :func:`choose` planned: records its events when it is timed
    (``token`` None: a call with a fixed count, nothing to do)."""
    if token is None or not token[2]:
        yield
        return
    st, n, _ = token
    events = timer(stream)
    events.before()
    yield
    events.after()
    st.pending.append((n, events))
