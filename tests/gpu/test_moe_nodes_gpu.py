"""GPU: expert parallelism between nodes (mkernel/ops/moe_nodes.py, issue 11): moe_dispatch / moe_combine,
moe_dispatch_gemm (fused and unfused) and moe_gemm_combine across emulated nodes.

Layouts: 2 ranks as 2 nodes (the 2-rank pass of tests/run_gpu.sh, host and TCP transports); 4 ranks
as 2 nodes x 2 and 3 ranks as 3 nodes (child jobs started from the 1-rank pass, host transport).

Checks, every output poisoned with NaN first, inputs of every rank generated on every rank (seeded
by case and rank) for the float64 reference:
- dispatch: per local expert, the row count and the rows themselves (as a multiset: between nodes
  the rows of an expert are ordered by forwarding rank, then its virtual tokens; test_moe pins the
  one-node order) bitwise; rows past received still poisoned;
- combine of y = recv * c(expert) (c in {1, 2, 3}, so a row returned to the wrong pair or expert
  shows): out bitwise equal to the float64 sum (integer-valued x, power-of-two weights: exact);
- moe_dispatch_gemm fused bitwise equal to unfused and to the float64 GEMM of the received rows
  (H <= 128, entries in {-2..2} and {-1, 0, 1}: exact), then moe_gemm_combine within 1e-2 of the
  float64 layer, its fused path (the node sums sent by the kernel) bitwise equal to the unfused;
- each bundle's order (the plan's slots): by the token's first expert on the receiving node as the
  receiver sends rows, then by token, and the receiver's piece starts; the bundles crossing in 1, 2 and 3 pieces
  (config.moe_bundle_pieces; 8 by default): the same checks;
- each case twice, interleaved with the others (stale flags, epochs), with T differing per rank,
  a rank with T = 0, skewed routing, repeated experts in a token, experts that receive nothing,
  top-1 and top-8;
- the bytes the proxy sent for one dispatch + combine equal to the minimum: the count rows, each
  token once per other node with a pair there (row and 8k bytes of routing), its node sums back
  (16-bit rows);
- errors found on the device (capacity, expert ids) raise on every rank (a communicator per case).
"""

import zlib

import numpy as np
import pytest

import mkernel
from mkernel.comm.collectives import allgather_object
from mkernel.core.errors import ArgumentError, CapacityError
from mkernel.ops.moe_nodes import MAX_NODES, MAX_PIECES
from mkernel.testing import bytes_sent, bytes_sent_since, sync_or_exit

from tests.helpers.arrays import BF16, bits, dev, host, poisoned
from tests.helpers.jobs import WORLD, relaunch

DT = {"bf16": BF16, "fp16": np.dtype(np.float16)}
NAN = {"bf16": 0x7FC0, "fp16": 0x7E00}
# (name, T of rank r (a function of r and W), H, experts per rank, k, routing, dtype)
CASES = [
    ("uniform", lambda r, W: 96 + 17 * r, 64, 2, 2, "uniform", "bf16"),
    ("zipf top-8", lambda r, W: 80 - 30 * (r % 2), 128, 4, 8, "zipf", "fp16"),
    ("top-1, a rank without tokens", lambda r, W: 0 if r == W - 1 else 200, 96, 3, 1, "uniform", "bf16"),
    ("repeated experts", lambda r, W: 50, 64, 1, 4, "repeat", "bf16"),
    ("odd experts empty", lambda r, W: 64, 64, 4, 2, "even", "fp16"),
]
F = 72  # the first GEMM's width (part of one N-tile)
HANG_S = 60.0


def _problem(case, W):
    name, tfn, H, El, k, routing, dtn = case
    E = El * W
    inp = []
    for r in range(W):
        rng = np.random.default_rng(zlib.crc32(f"{name}|{r}|{W}".encode()))
        T = tfn(r, W)
        x = rng.integers(-2, 3, size=(T, H)).astype(np.float32).astype(DT[dtn])
        if routing == "uniform":
            ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]) if T else np.zeros((0, k))
        elif routing == "zipf":
            p = 1.0 / np.arange(1, E + 1) ** 1.2
            ids = np.stack([rng.choice(E, size=k, replace=False, p=p / p.sum()) for _ in range(T)])
        elif routing == "even":  # only even experts: every odd one receives nothing, on every rank
            ids = np.stack([2 * rng.permutation(E // 2)[:k] for _ in range(T)])
        else:  # the same expert may appear twice in a token
            ids = rng.integers(0, E, size=(T, k))
        w = rng.choice(np.array([0.5, 1.0, 2.0], dtype=np.float32), size=(T, k))
        inp.append((x, ids.astype(np.int32).reshape(T, k), w.astype(np.float32)))
    return dict(name=name, H=H, El=El, E=E, k=k, dtn=dtn, inp=inp,
                cap=mkernel.moe_capacity(max(tfn(r, W) for r in range(W)), k, W))


def _scale(e):
    return float(e % 3 + 1)


def _expected_rows(P, me, origin=lambda r: True):
    """Per local expert of rank me: the rows it receives (float64), in any order; only those of the
    tokens of ranks r with origin(r)."""
    out = []
    for le in range(P["El"]):
        e = me * P["El"] + le
        rows = [x[t].astype(np.float64) for r, (x, ids, _) in enumerate(P["inp"]) if origin(r)
                for t in range(ids.shape[0]) for j in range(P["k"]) if ids[t, j] == e]
        out.append(np.array(rows).reshape(-1, P["H"]))
    return out


def _sorted_rows(a):
    return a[np.lexsort(a.T[::-1])] if a.shape[0] else a


def _sync(comm, what):
    """Waits (a hang ends the job, naming what), then raises what the device recorded."""
    sync_or_exit(what, HANG_S)
    comm.check()


def _check_dispatch(P, me, recv, h, local):
    """Per local expert its rows as a multiset: first those of the tokens of rank me's node (the
    forwarders' own, sent while the others cross the network), then the others (docs/MOE.md)."""
    want = _expected_rows(P, me)
    here = _expected_rows(P, me, lambda r: r // local == me // local)
    counts = np.asarray(h.counts())
    if counts.tolist() != [len(w) for w in want]:
        return f"counts {counts.tolist()} != {[len(w) for w in want]}"
    got = host(recv).astype(np.float64)
    start = 0
    for le, (w, o) in enumerate(zip(want, here)):
        g = got[start:start + len(w)]
        if not np.array_equal(_sorted_rows(g), _sorted_rows(w)):
            return f"local expert {le}: its {len(w)} rows differ from the expected multiset"
        if not np.array_equal(_sorted_rows(g[:len(o)]), _sorted_rows(o)):
            return f"local expert {le}: its first {len(o)} rows are not those of its node's tokens"
        start += len(w)
    tail = bits(recv)[start:]
    if tail.size and not (tail == NAN[P["dtn"]]).all():
        return f"rows past received ({start}) written"
    return None


def _combine_ref(P, me, gemm=None):
    x, ids, w = P["inp"][me]
    out = np.zeros((x.shape[0], P["H"] if gemm is None else gemm[1].shape[2]))
    for t in range(x.shape[0]):
        for j in range(P["k"]):
            e = ids[t, j]
            row = x[t].astype(np.float64)
            out[t] += w[t, j] * (_scale(e) * row if gemm is None else row @ gemm[0][e] @ gemm[1][e])
    return out


def _bucket(ids, j, epn, El, L, lr):
    """Token ids' bucket at rank (j, lr): the least place of its node-j experts in the order that rank
    sends rows (local expert, then owner from lr on); None without one."""
    return min(((v % El) * L + (v // El - lr) % L for v in (int(e) - j * epn for e in ids) if 0 <= v < epn),
               default=None)


def _check_bundle_order(comm, P, h):
    """Each bundle's slots: its tokens sorted by their first expert on the receiving node in the order
    the receiver sends rows (local expert, then owner from its rank on), then by token."""
    L, N, node, lr, El = comm.local_size, comm.num_nodes, comm.node, comm.local_rank, P["El"]
    epn, (_, ids, _) = P["E"] // N, P["inp"][comm.rank]
    T, R = ids.shape[0], h._nodes["fwd_rows"]
    slots = host(h._nodes["slots"]).reshape(N - 1, R)
    for j in (j for j in range(N) if j != node):
        keys = [_bucket(ids[t], j, epn, El, L, lr) for t in range(T)]
        order = sorted((k, t) for t, k in enumerate(keys) if k is not None)
        want = np.full(T, -1)
        want[[t for _, t in order]] = np.arange(len(order))
        if not np.array_equal(slots[j - (j > node)][:T], want):
            return f"bundle to node {j}: slots differ from the order by first expert, then token"
    pcs, vseg = h._nodes["pieces"], host(h._nodes["vseg"])
    for j in (j for j in range(N) if j != node):  # the bundle received from j: its pieces' first tokens
        keys = [_bucket(sids, node, epn, El, L, lr) for sids in P["inp"][j * L + lr][1]]
        n = np.bincount([key * pcs // epn for key in keys if key is not None], minlength=pcs)
        want = np.concatenate([[0], np.cumsum(n), np.full(MAX_PIECES - pcs, n.sum())])
        at = MAX_NODES + (MAX_PIECES + 1) * (j - (j > node))  # MOE_VPST(segment, 0)
        if not np.array_equal(vseg[at:at + MAX_PIECES + 1], want):
            return f"bundle from node {j}: piece starts {vseg[at:at + MAX_PIECES + 1]} != {want}"
    return None


def _run_dispatch_combine(comm, P):
    """One dispatch + combine, checked; returns an error message or None."""
    me = comm.rank
    x, ids, w = P["inp"][me]
    recv_out = poisoned((P["cap"], P["H"]), P["dtn"])
    recv, h = mkernel.moe_dispatch(dev(x), dev(ids), dev(w), comm=comm, num_experts=P["E"], capacity=P["cap"],
                                   out=recv_out)
    _sync(comm, "moe_dispatch between nodes")
    msg = _check_dispatch(P, me, recv, h, comm.local_size) or _check_bundle_order(comm, P, h)  # (after the combine)
    y = host(recv).astype(np.float64)
    start = 0
    for le, n in enumerate(np.asarray(h.counts())):
        y[start:start + n] *= _scale(me * P["El"] + le)
        start += n
    out = poisoned((x.shape[0], P["H"]), P["dtn"])
    mkernel.moe_combine(dev(y.astype(DT[P["dtn"]])), h, comm=comm, out=out)
    _sync(comm, "moe_combine between nodes")
    if msg:
        return f"dispatch: {msg}"
    want = _combine_ref(P, me).astype(DT[P["dtn"]])
    bad = np.flatnonzero(~(bits(out) == want.view(np.uint16)).all(axis=1))
    if bad.size:
        t = int(bad[0])
        return f"combine: {bad.size} wrong tokens, first {t}: {host(out)[t, :4]} != {want[t, :4]}"
    return None


def _weights(P, shape, density=1.0, seed="w1"):
    rng = np.random.default_rng(zlib.crc32(f"{seed}|{P['name']}".encode()))
    w = rng.integers(-1, 2, size=shape) * (rng.random(shape) < density)
    return w.astype(np.float32).astype(DT[P["dtn"]])


def _run_gemm_ops(comm, P):
    """moe_dispatch_gemm fused and unfused, then moe_gemm_combine; an error message or None."""
    me, El = comm.rank, P["El"]
    x, ids, w = P["inp"][me]
    W1 = _weights(P, (P["E"], P["H"], F))
    W2 = _weights(P, (P["E"], F, P["H"]), density=0.1, seed="w2")
    recv = poisoned((P["cap"], P["H"]), P["dtn"])  # the rows the GEMM works on, for its reference
    _, h = mkernel.moe_dispatch(dev(x), dev(ids), dev(w), comm=comm, num_experts=P["E"], capacity=P["cap"], out=recv)
    _sync(comm, "moe_dispatch between nodes")
    counts = np.asarray(h.counts())
    n = int(counts.sum())
    rows, start = host(recv).astype(np.float64), 0
    want = np.zeros((n, F))
    for le, c in enumerate(counts):
        want[start:start + c] = rows[start:start + c] @ W1[me * El + le].astype(np.float64)
        start += c
    ys, msgs = {}, []  # every rank makes every call; the first message is reported
    for path in ("fused", "unfused"):  # a dispatch makes the previous handle stale: keep only the last
        y = poisoned((P["cap"], F), P["dtn"])
        _, h = mkernel.moe_dispatch_gemm(dev(x), dev(ids), dev(w), dev(W1[me * El:(me + 1) * El]), comm=comm,
                                         num_experts=P["E"], capacity=P["cap"], out=y, path=path)
        _sync(comm, f"moe_dispatch_gemm ({path}) between nodes")
        if not np.array_equal(np.asarray(h.counts()), counts):
            msgs.append(f"moe_dispatch_gemm ({path}): counts {np.asarray(h.counts()).tolist()} != {counts.tolist()}")
        ys[path] = y
    yf, yu = bits(ys["fused"])[:n], bits(ys["unfused"])[:n]
    if not np.array_equal(yf, yu):
        msgs.append(f"moe_dispatch_gemm: fused and unfused differ in {int((~(yf == yu).all(axis=1)).sum())} "
                    f"of {n} rows")
    if not np.array_equal(host(ys["fused"])[:n].astype(np.float64), want):
        msgs.append("moe_dispatch_gemm: y differs from the float64 GEMM of the received rows")
    outs = {}
    for path in ("unfused", "fused"):  # both on the last handle; the fused one sends the node sums itself
        outs[path] = mkernel.moe_gemm_combine(ys["unfused"], dev(W2[me * El:(me + 1) * El]), h, comm=comm,
                                              out=poisoned((x.shape[0], P["H"]), P["dtn"]), path=path)
        _sync(comm, f"moe_gemm_combine ({path}) between nodes")
    if not np.array_equal(bits(outs["fused"]), bits(outs["unfused"])):
        msgs.append("moe_gemm_combine: fused and unfused differ between nodes")
    again = []
    for group in (4, 1, 3):  # chunks of sums per WRITE; the benchmark's batches repeat it on one dispatch too
        with mkernel.config.override(moe_sums_group=group):
            again.append(mkernel.moe_gemm_combine(ys["unfused"], dev(W2[me * El:(me + 1) * El]), h, comm=comm,
                                                  out=poisoned((x.shape[0], P["H"]), P["dtn"]), path="fused"))
    _sync(comm, "moe_gemm_combine (fused) three times more on one dispatch between nodes")
    for group, o in zip((4, 1, 3), again):
        if not np.array_equal(bits(o), bits(outs["unfused"])):
            msgs.append(f"moe_gemm_combine: fused again on one dispatch (moe_sums_group={group}) differs from "
                        f"the unfused path")
    out = outs["unfused"]
    if msgs:
        return msgs[0]
    ref = _combine_ref(P, me, gemm=(W1.astype(np.float64), W2.astype(np.float64)))
    got = host(out).astype(np.float64)
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    if not np.isfinite(got).all() or err > 1e-2:
        return f"moe_gemm_combine: relative error {err:.2e} against float64"
    return None


def _minimum_bytes(comm, P):
    """What one dispatch + combine must send from this rank between nodes."""
    from mkernel.ops import moe_nodes

    L, N, node, local_rank, k, H = comm.local_size, comm.num_nodes, comm.node, comm.local_rank, P["k"], P["H"]
    epn = P["E"] // N
    total = (comm.size - L) * moe_nodes.grow_words(P["E"]) * 4
    _, ids, _ = P["inp"][comm.rank]
    for j in range(N):
        if j == node:
            continue
        bundle = int(((ids // epn) == j).any(axis=1).sum())
        total += bundle * (H * 2 + 8 * k)
        _, ids_j, _ = P["inp"][j * L + local_rank]  # tokens rank (j, local_rank) sends here: their sums go back
        total += int(((ids_j // epn) == node).any(axis=1).sum()) * H * 2
    return total


def _guarded(fn, *args):
    """fn(*args)'s message, or the exception it raised as one: every rank reaches the next
    collective check instead of leaving its partners waiting in it."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001  (reported through _collective_check on every rank)
        return f"{type(e).__name__}: {e}"


def _collective_check(comm, name, msg):
    msgs = allgather_object(WORLD, msg, f"reporting {name}", timeout_s=120)  # timed: no hang if a peer is stuck
    bad = [f"rank {r}: {m}" for r, m in enumerate(msgs) if m]
    assert not bad, f"{name}: " + "; ".join(bad)


def _run_all(comm, make_comm):
    W = comm.size
    problems = [_problem(c, W) for c in CASES]
    for rep in range(2):
        for P in problems:
            before = bytes_sent(comm)
            with mkernel.config.override(mps_full_share=(False, "always")[rep]):  # 7/8 and all of the MPS share
                msg = _guarded(_run_dispatch_combine, comm, P)
            if msg is None and rep == 1:  # the plan's setup traffic is behind us
                want = _minimum_bytes(comm, P)
                sent = bytes_sent_since(comm, before, want)
                if sent != want:
                    msg = f"sent {sent} bytes between nodes, the minimum is {want}"
            _collective_check(comm, f"{P['name']} (repeat {rep})", msg)
    for i, P in enumerate(problems[:2]):
        with mkernel.config.override(mps_full_share=(False, "always")[i]):  # whatever the default between nodes
            _collective_check(comm, f"{P['name']}: GEMM ops", _guarded(_run_gemm_ops, comm, P))
    for pieces, P in ((1, problems[1]), (3, problems[1]), (2, problems[0])):  # a bundle in other pieces: new plans
        with mkernel.config.override(moe_bundle_pieces=pieces):
            _collective_check(comm, f"{P['name']}: moe_bundle_pieces={pieces}",
                              _guarded(_run_dispatch_combine, comm, P))
            if pieces == 2:
                _collective_check(comm, f"{P['name']}: GEMM ops, moe_bundle_pieces={pieces}",
                                  _guarded(_run_gemm_ops, comm, P))
    _device_errors(make_comm, problems[0])


def _device_errors(make_comm, P):
    """A capacity too small and an expert id out of range (on rank 0 only): every rank raises the
    error naming the op. Errors are sticky: a communicator per case."""
    me = WORLD.Get_rank()
    x, ids, w = P["inp"][me]
    need = max(int(sum(len(r) for r in _expected_rows(P, d))) for d in range(WORLD.Get_size()))
    bad_ids = ids.copy()
    if me == 0 and bad_ids.size:
        bad_ids[0, 0] = P["E"] + 3
    for what, cap, i, exc in (("capacity", need - 1, ids, CapacityError),
                              ("expert id", P["cap"], bad_ids, ArgumentError)):
        c = make_comm()
        try:
            try:
                mkernel.moe_dispatch(dev(x), dev(i), dev(w), comm=c, num_experts=P["E"], capacity=cap)
                _sync(c, f"moe_dispatch with a bad {what}")
                msg = f"no error for a bad {what}"
            except Exception as e:  # noqa: BLE001  (any other exception is a failure, reported on every rank)
                msg = (None if isinstance(e, exc) and "moe_dispatch" in str(e)
                       else f"expected {exc.__name__} naming moe_dispatch, got {type(e).__name__}: {e}")
            _collective_check(c, f"device error ({what})", msg)
        finally:
            c.close()


WORKSPACE = 192 << 20


def _in_nodes(nodes, per_node, transport):
    """_run_all on WORLD as nodes x per_node ranks (gpus_per_node emulates the nodes)."""
    def make_comm():
        return mkernel.init(WORLD, gpus_per_node=per_node, transport=transport, workspace_bytes=WORKSPACE)
    comm = make_comm()
    try:
        assert comm.num_nodes == nodes and comm.local_size == per_node
        _run_all(comm, make_comm)
    finally:
        comm.close()


def _nodes_job(request, nodes, per_node):
    """A child job of nodes x per_node ranks (from the 1-rank pass), host transport."""
    if relaunch(request, n=nodes * per_node):
        return
    if WORLD.Get_size() != nodes * per_node:
        pytest.skip(f"{nodes * per_node} ranks as {nodes} nodes x {per_node}")
    _in_nodes(nodes, per_node, "host")


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.multi_gpu
@pytest.mark.parametrize("transport", ["host", "tcp"])
def test_moe_between_two_emulated_nodes(transport):
    """2 ranks as 2 nodes x 1: every pair of another node's expert crosses the network."""
    if WORLD.Get_size() != 2:
        pytest.skip("pairs exactly two ranks")
    _in_nodes(2, 1, transport)


@pytest.mark.gpu
def test_moe_on_two_nodes_of_two_ranks(request):
    """4 ranks (a child job sharing the GPUs) as 2 nodes x 2: bundles between same-index ranks, then
    NVLink inside the node."""
    _nodes_job(request, nodes=2, per_node=2)


@pytest.mark.gpu
def test_moe_on_three_emulated_nodes(request):
    """3 ranks as 3 nodes: two bundles and two partial sums per rank."""
    _nodes_job(request, nodes=3, per_node=1)
