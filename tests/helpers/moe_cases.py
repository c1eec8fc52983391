"""The problems, references and checks of the MoE tests (tests/cpu/test_moe.py, tests/gpu/test_moe_gpu.py,
test_moe_errors_gpu.py, test_moe_gemm_gpu.py, test_residency_gpu.py): the global problem every rank
builds from a fixed seed, the row-order rule of the receive buffer (_layout), the float64 references,
the dispatch / combine cases, the device-side checks and the collective driver. tests/cpu/test_moe.py's
docstring describes what is checked."""

import importlib
import math
import zlib
from types import SimpleNamespace

import numpy as np

import mkernel
from mkernel.testing import sync_or_exit

from tests.helpers import collective_cases
from tests.helpers.arrays import DTYPES, NAN_BITS
from tests.helpers.arrays import bits as _bits
from tests.helpers.arrays import dev as _dev
from tests.helpers.arrays import host as _host
from tests.helpers.arrays import poisoned as _poisoned

# The module, not the function: mkernel re-exports the function under the same name.
mmoe = importlib.import_module("mkernel.ops.moe")

REL_TOL = 1e-2        # layer: relative Frobenius error of out and of y
TOKEN_TOL = 5e-2      # layer: relative error of any one token's output row
HANG_S = 45.0         # past MKERNEL_TIMEOUT_S (30): a device wait times out and is reported first
WORKSPACE = 1 << 30   # the module communicator's symmetric workspace (the slow H = 7168 case needs ~120 MiB a rank)
ERR_WORKSPACE = 16 << 20  # the communicators of the device-error cases
WEIGHT_SET = np.array([0.25, 0.5, 1.0, 2.0])  # exact cases: every weighted fp32 sum is exact

# ============================================================================ the reference
def _tokens(T, W):
    """Tokens per rank: an int (every rank), 'zero-last' (300 each, none on the last rank; at world 1
    no token at all) or 'ragged' (100 + 97 * rank)."""
    if isinstance(T, int):
        return [T] * W
    if T == "zero-last":
        return [300] * (W - 1) + [0]
    if T == "ragged":
        return [100 + 97 * r for r in range(W)]
    raise ValueError(T)


def _layout(ids, k, W, El):
    """Per owner rank d: (src, pair, counts) of the rows d receives, in order: by local expert
    el = 0 .. El - 1 (global expert d * El + el), then by source rank s = 0 .. W - 1, then by the
    source's pair index p = t * k + j ascending. src / pair: int64 [n]; counts: [El, W] rows of each
    (local expert, source) block. Expert ids out of range are in no row."""
    flat = [np.asarray(a).reshape(-1) for a in ids]
    owners = []
    for d in range(W):
        src, pair = [], []
        counts = np.zeros((El, W), dtype=np.int64)
        for el in range(El):
            e = d * El + el
            for s in range(W):
                p = np.flatnonzero(flat[s] == e)  # ascending
                src.append(np.full(p.size, s, dtype=np.int64))
                pair.append(p.astype(np.int64))
                counts[el, s] = p.size
        owners.append((np.concatenate(src), np.concatenate(pair), counts))
    return owners


def _problem(name, W, dtn, H, El, k, routing, T, cap="auto", values="int"):
    """The global problem of one case, the same on every rank (seeded by name and world size).

    routing: 'uniform' (k distinct experts, uniformly), 'zipf' (k distinct experts, expert e drawn
    with probability ~ 1 / rank(e) ** 1.2 without replacement, ranks a random permutation),
    'repeat' (k experts with replacement: a token may pick one twice), 'sparse' (k distinct among
    experts e < El * max(1, W - 1) with e % 4 in (0, 3): some experts empty everywhere, and at
    W >= 2 the last rank receives nothing), 'rank0' (k distinct among rank 0's experts).
    values: 'int' (x integers in [-64, 64], exact in bf16 / fp16; weights from WEIGHT_SET), 'unit' (x in
    {-1, 0, 1}: a GEMM with such weights is exact while |sums| <= 256, bf16's exact integers), or
    'normal' (x standard normal; weights a softmax over the k picks).
    cap: 'auto' (None: the default), 'max' (moe_capacity(max T, k, W)), 'tight' (exactly the most
    rows any rank receives or sends), 'slack' (37 rows more: rows past received at every world
    size, also at world 1 where the default capacity is exactly what the rank receives), or an int."""
    dt = DTYPES[dtn]
    E = El * W
    Ts = _tokens(T, W)
    rng = np.random.default_rng(zlib.crc32(f"{name}|world={W}".encode()))
    pool, logp = np.arange(E), None
    if routing == "zipf":
        pop = np.empty(E)
        pop[rng.permutation(E)] = np.arange(1, E + 1, dtype=np.float64) ** -1.2
        logp = np.log(pop)
    elif routing == "sparse":
        pool = np.array([e for e in range(El * max(1, W - 1)) if e % 4 in (0, 3)])
    elif routing == "rank0":
        pool = np.arange(El)
    elif routing not in ("uniform", "repeat"):
        raise ValueError(routing)
    if routing != "repeat" and k > pool.size:
        raise ValueError(f"{name}: {k} distinct experts out of {pool.size}")
    xs, ids, ws = [], [], []
    for s in range(W):
        n = Ts[s]
        if values == "int":
            x = rng.integers(-64, 65, size=(n, H)).astype(np.float32).astype(dt)
        elif values == "unit":
            x = rng.integers(-1, 2, size=(n, H)).astype(np.float32).astype(dt)
        else:
            x = rng.standard_normal((n, H)).astype(np.float32).astype(dt)
        if routing == "repeat":
            i = rng.integers(0, E, size=(n, k))
        else:  # Gumbel top-k: k distinct, weighted without replacement (uniform when logp is None)
            keys = rng.random((n, pool.size)) if logp is None else logp[None, :] + rng.gumbel(size=(n, pool.size))
            i = pool[np.argsort(-keys, axis=1, kind="stable")[:, :k]]
        if values in ("int", "unit"):
            w = rng.choice(WEIGHT_SET, size=(n, k)).astype(np.float32)
        else:
            lg = rng.standard_normal((n, k))
            w = (np.exp(lg) / np.exp(lg).sum(axis=1, keepdims=True)).astype(np.float32)
        xs.append(np.ascontiguousarray(x))
        ids.append(np.ascontiguousarray(i, dtype=np.int32).reshape(n, k))
        ws.append(np.ascontiguousarray(w).reshape(n, k))
    P = SimpleNamespace(name=name, W=W, dtn=dtn, dt=dt, H=H, El=El, E=E, k=k, Ts=Ts, xs=xs, ids=ids, ws=ws)
    P.xcat = np.concatenate(xs, axis=0)
    P.xoff = np.concatenate([[0], np.cumsum(Ts)[:-1]]).astype(np.int64)
    P.layout = _layout(ids, k, W, El)
    P.need = max([o[0].size for o in P.layout] + [t * k for t in Ts] + [1])  # the smallest capacity that fits
    if cap == "auto":
        P.capacity = None
        assert len(set(Ts)) == 1, "the default capacity differs across ranks when T does"
    elif cap == "max":
        P.capacity = max(1, W * max(Ts) * k)
    elif cap == "tight":
        P.capacity = P.need
    elif cap == "slack":
        P.capacity = P.need + 37
    else:
        P.capacity = int(cap)
    P.cap = P.capacity if P.capacity is not None else max(1, W * Ts[0] * k)  # default: W * T * k
    return P


def _expected_rows(P, d):
    """The rows owner d must receive, in order (host array of P.dt, [n, H])."""
    src, pair, _ = P.layout[d]
    return P.xcat[P.xoff[src] + pair // P.k] if src.size else np.zeros((0, P.H), dtype=P.dt)


def _pair_rows(P, s):
    """For every pair p = t * k + j of rank s: the row it occupies at its owner (ids // El)."""
    rows = np.full(P.Ts[s] * P.k, -1, dtype=np.int64)
    for d in range(P.W):
        src, pair, _ = P.layout[d]
        m = src == s
        rows[pair[m]] = np.flatnonzero(m)
    if (rows < 0).any():
        raise AssertionError(f"reference: pairs {np.flatnonzero(rows < 0)[:8].tolist()} of rank {s} have no row")
    return rows


def _combine_values(P):
    """The y rows of every owner for the exact combine: integers in [-16, 16], [n_d, H] (float64)."""
    rng = np.random.default_rng(zlib.crc32(f"y of {P.name}|world={P.W}".encode()))
    return [rng.integers(-16, 17, size=(o[0].size, P.H)).astype(np.float64) for o in P.layout]


def _combine_reference(P, s, Ys):
    """out of rank s (float64, exact): out[t] = sum_j w[t, j] * Ys[owner][row of (s, t * k + j)]."""
    T, k, H = P.Ts[s], P.k, P.H
    rows = _pair_rows(P, s)
    owner = P.ids[s].reshape(-1) // P.El
    vals = np.zeros((T * k, H))
    for d in range(P.W):
        m = owner == d
        vals[m] = Ys[d][rows[m]]
    return (P.ws[s].astype(np.float64)[:, :, None] * vals.reshape(T, k, H)).sum(axis=1)


def _roundtrip_want(P, s):
    """combine(recv) of rank s: every pair returns its own token row, so out[t] = x[t] * sum_j w[t, j]
    (exact in fp32: |x| <= 64, weights multiples of 1/4), rounded once."""
    x = P.xs[s].astype(np.float64)
    return (x * P.ws[s].astype(np.float64).sum(axis=1, keepdims=True)).astype(np.float32).astype(P.dt)


def _layer_problem(name, W, dtn, H, F, El, k, routing, T, cap="auto", layout="kn"):
    P = _problem(name, W, dtn, H, El, k, routing, T, cap=cap, values="normal")
    rng = np.random.default_rng(zlib.crc32(f"weights of {name}|world={W}".encode()))
    P.F, P.w_layout = F, layout
    P.W1 = (rng.standard_normal((P.E, H, F)) / math.sqrt(H)).astype(np.float32).astype(P.dt)  # [E, H, F]
    P.W2 = (rng.standard_normal((P.E, F, H)) / math.sqrt(F)).astype(np.float32).astype(P.dt)  # [E, F, H]
    return P


def _layer_reference(P, me):
    """float64 (y_ref [n, F]: the GEMM rows owner `me` holds, in recv order; out_ref [T_me, H])."""
    src, pair, counts = P.layout[me]
    k, El = P.k, P.El
    row_expert = me * El + np.repeat(np.arange(El), counts.sum(axis=1))  # rows go by local expert first
    xr = P.xcat[P.xoff[src] + pair // k].astype(np.float64) if src.size else np.zeros((0, P.H))
    y_ref = np.zeros((src.size, P.F))
    for e in np.unique(row_expert):
        m = row_expert == e
        y_ref[m] = xr[m] @ P.W1[e].astype(np.float64)
    T = P.Ts[me]
    ids = P.ids[me].reshape(-1)
    x = P.xs[me].astype(np.float64)
    z = np.zeros((T * k, P.H))
    for e in np.unique(ids):
        m = ids == e
        t = np.flatnonzero(m) // k
        z[m] = np.maximum(x[t] @ P.W1[e].astype(np.float64), 0.0) @ P.W2[e].astype(np.float64)
    out_ref = (P.ws[me].astype(np.float64)[:, :, None] * z.reshape(T, k, P.H)).sum(axis=1)
    return y_ref, out_ref

# ================================================================================ GPU helpers
def _sync(what, timeout_s=HANG_S):
    sync_or_exit(what, timeout_s)


def _nan_bits(dtn):
    return NAN_BITS[dtn][1]


def _inputs(P, me):
    """This rank's device inputs (x, topk_ids, topk_weights)."""
    return _dev(P.xs[me]), _dev(P.ids[me]), _dev(P.ws[me])


def _describe_row(P, row_bits):
    """What a received row holds: poison, a token (rank, t) of the problem, or unknown data."""
    if (row_bits == _nan_bits(P.dtn)).all():
        return "poison (never written)"
    if not hasattr(P, "_row_index"):
        P._row_index = {}
        for s, x in enumerate(P.xs):
            xb = x.view(np.uint16)
            for t in range(x.shape[0]):
                P._row_index.setdefault(xb[t].tobytes(), (s, t))
    hit = P._row_index.get(row_bits.tobytes())
    return f"token (rank {hit[0]}, t {hit[1]})" if hit else "data of no token"


def _check_recv(P, d, recv, handle):
    """(ok, message): what owner d received (recv [cap, H] on the device), against the layout."""
    src, pair, counts = P.layout[d]
    n, k, El = src.size, P.k, P.El
    ok, msgs = True, []
    got_n = handle.received()
    got_counts = np.asarray(handle.counts())
    want_counts = counts.sum(axis=1)
    msgs.append(f"received {got_n}/{n} of cap {P.cap}")
    if got_n != n:
        ok = False
        msgs.append(f"RECEIVED {got_n}, expected {n}")
    if got_counts.shape != want_counts.shape or not np.array_equal(got_counts, want_counts):
        ok = False
        diff = [int(i) for i in np.flatnonzero(got_counts != want_counts)[:6]] if got_counts.shape == \
            want_counts.shape else "shape"
        msgs.append(f"GROUP_ROWS differ at local experts {diff}: got {got_counts[:8].tolist()} expected "
                    f"{want_counts[:8].tolist()}")
    rb = _bits(recv)
    if rb.shape != (P.cap, P.H):
        return False, f"recv shape {rb.shape}, expected {(P.cap, P.H)}"
    want = _expected_rows(P, d).view(np.uint16)
    bad_rows = np.flatnonzero(~(rb[:n] == want).all(axis=1))
    if bad_rows.size:
        ok = False
        starts = np.concatenate([[0], np.cumsum(counts.reshape(-1))])  # blocks (el, s), el major
        blocks = sorted({int(np.searchsorted(starts, r, side="right") - 1) for r in bad_rows})
        b0 = blocks[0]
        el, s = divmod(b0, P.W)
        r = int(bad_rows[0])
        msgs.append(f"{bad_rows.size} WRONG ROWS in {len(blocks)} (expert, source) blocks; first: expert "
                    f"{d * El + el} (local {el}) from rank {s}, rows [{starts[b0]}, {starts[b0 + 1]}); row {r} "
                    f"holds {_describe_row(P, rb[r])}, expected token (rank {src[r]}, t {pair[r] // k}, "
                    f"j {pair[r] % k}); blocks (expert, source): "
                    f"{[(d * El + b // P.W, b % P.W) for b in blocks[:6]]}")
    tail = np.flatnonzero(~(rb[n:] == _nan_bits(P.dtn)).all(axis=1))
    if tail.size:
        ok = False
        msgs.append(f"{tail.size} ROWS PAST received WRITTEN, first {n + int(tail[0])} "
                    f"({_describe_row(P, rb[n + int(tail[0])])})")
    return ok, "; ".join(msgs)


def _check_exact_out(P, me, out, want):
    """(ok, message): out [T, H] on the device bitwise equal to want (host, P.dt)."""
    ob = _bits(out)
    wb = np.ascontiguousarray(want).view(np.uint16)
    if ob.shape != wb.shape:
        return False, f"out shape {ob.shape}, expected {wb.shape}"
    bad = np.flatnonzero(~(ob == wb).all(axis=1))
    if not bad.size:
        return True, f"out {ob.shape[0]} tokens bitwise right"
    t = int(bad[0])
    c = int(np.flatnonzero(ob[t] != wb[t])[0])
    got = _host(out)[t, c]
    return False, (f"{bad.size} WRONG TOKENS of {ob.shape[0]}, first t {t} col {c}: {got!r} != {want[t, c]!r} "
                   f"(experts {P.ids[me][t].tolist()}, weights {P.ws[me][t].tolist()})")


def _relu(y):
    """relu on the device on the bits (a CuPy without bf16 arithmetic works too); NaN stays NaN."""
    import cupy

    u = y.view(cupy.uint16)
    return cupy.where((u & 0x8000) != 0, cupy.zeros_like(u), u).view(y.dtype)


def _rel(got, ref):
    nref = float(np.linalg.norm(ref))
    if nref == 0:
        return 0.0 if not np.abs(got).sum() else float("inf")
    return float(np.linalg.norm(got - ref) / nref)


def _release(comm):
    """Frees the MoE plans' symmetric buffers (every rank at the same point: the end of a test)."""
    import gc


    gc.collect()  # every rank frees the same ranges now (reference cycles would free them later, unevenly)
    comm.release_plans()


# --------------------------------------------------------------------- the collective driver
def _run_cases(comm, names, body):
    """collective_cases.run_cases, releasing this file's MoE buffers when no case stopped the run."""
    return collective_cases.run_cases(comm, names, body, after=lambda: _release(comm))


_report_and_decide = collective_cases.report_and_decide


def _collective(comm, name, body):
    _report_and_decide(comm, name, [name], _run_cases(comm, [name], lambda _: body()))

# ======================================================================= dispatch / combine cases
def _case(label, dtn, H, El, k, routing, T, cap="auto"):
    return dict(label=label, dtn=dtn, H=H, El=El, k=k, routing=routing, T=T, cap=cap)


def _case_name(c):
    return f"{c['label']}: {c['dtn']} H={c['H']} El={c['El']} k={c['k']} T={c['T']} cap={c['cap']}"


DISPATCH_CASES = [
    _case("uniform top-2", "bf16", 64, 4, 2, "uniform", 333),
    _case("uniform top-2", "fp16", 1000, 4, 2, "uniform", 200),
    _case("uniform top-8", "bf16", 256, 16, 8, "uniform", 300),
    _case("uniform top-8 (at W 1: all 8 experts)", "fp16", 64, 8, 8, "uniform", 129),
    _case("zipf(1.2) top-2", "bf16", 256, 8, 2, "zipf", 1000),
    _case("zipf(1.2) top-8", "fp16", 128, 16, 8, "zipf", 500),
    _case("zipf(1.2) top-8, many CTAs", "bf16", 256, 8, 8, "zipf", 2000),
    _case("top-1", "bf16", 64, 4, 1, "uniform", 777),
    _case("top-1, El=1", "fp16", 64, 1, 1, "uniform", 500),
    _case("one token top-1, El=1 (cap 1 at W 1)", "bf16", 64, 1, 1, "uniform", 1),
    _case("one token top-2", "fp16", 128, 2, 2, "uniform", 1),
    _case("repeated experts top-4", "bf16", 128, 2, 4, "repeat", 250),
    _case("empty experts (and ranks)", "fp16", 64, 8, 2, "sparse", 300),
    _case("rank 0's experts only (rank 0 full)", "bf16", 64, 4, 2, "rank0", 200),
    _case("El=64 uniform top-8", "bf16", 64, 64, 8, "uniform", 256),
    _case("El=64 zipf(1.2) top-2", "fp16", 128, 64, 2, "zipf", 1000),
    _case("T=0 on the last rank", "bf16", 64, 4, 2, "uniform", "zero-last", "max"),
    _case("T differs per rank", "fp16", 256, 4, 2, "zipf", "ragged", "max"),
    _case("capacity exactly the need", "bf16", 128, 4, 2, "zipf", "ragged", "tight"),
    _case("capacity above the need (rows past received)", "fp16", 128, 4, 2, "zipf", 300, "slack"),
]
DISPATCH_SLOW = [
    _case("H=7168 zipf(1.2) top-8", "bf16", 7168, 8, 8, "zipf", 256),
    _case("H=7168 uniform top-2", "fp16", 7168, 4, 2, "uniform", 512),
]


def _cases_for(comm, cases):
    W = comm.size
    return {_case_name(c): c for c in cases if c["El"] * W <= 512}


def _build(comm, c):
    return _problem(_case_name(c), comm.size, c["dtn"], c["H"], c["El"], c["k"], c["routing"], c["T"], c["cap"])

def _solo(moe, comm, P, inp):
    """dispatch + combine(recv) of P alone: (recv bits, out bits, ok, message), checked exactly."""
    me = comm.rank
    rb, ob = _poisoned((P.cap, P.H), P.dtn), _poisoned((P.Ts[me], P.H), P.dtn)
    recv, h = moe.moe_dispatch(*inp, comm=comm, num_experts=P.E, capacity=P.capacity, out=rb)
    out = moe.moe_combine(recv, h, comm=comm, out=ob)
    _sync(f"solo {P.name}")
    comm.check()
    ok1, m1 = _check_recv(P, me, recv, h)
    ok2, m2 = _check_exact_out(P, me, out, _roundtrip_want(P, me))
    return _bits(recv), _bits(out), ok1 and ok2, f"{m1}; {m2}"


# ============================================================ the fused layer (moe_dispatch_gemm)
def _weights(P, F):
    """w1 of every expert, [E, H, F], entries in {-1, 0, 1} (seeded by the case)."""
    rng = np.random.default_rng(zlib.crc32(f"w1 of {P.name}|world={P.W}".encode()))
    return rng.integers(-1, 2, size=(P.E, P.H, F)).astype(np.float32).astype(P.dt)


def _run(P, me, W1, F, lay, comm, path=None, comm_sms=None):
    x, ids, w = _inputs(P, me)
    w1 = W1[me * P.El:(me + 1) * P.El]
    if lay == "nk":
        w1 = np.ascontiguousarray(w1.transpose(0, 2, 1))
    yb = _poisoned((P.cap, F), P.dtn)
    y, h = mkernel.moe_dispatch_gemm(x, ids, w, _dev(w1), comm=comm, num_experts=P.E, capacity=P.capacity, out=yb,
                                     w_layout=lay, path=path, comm_sms=comm_sms)
    return yb, y, h


def _combine(P, me, y, h, lay, comm, path="fused", comm_sms=None):
    """moe_gemm_combine of y with w2 (in {-1, 0, 1}, [El, F, H] or [El, H, F]) into a poisoned out."""
    rng = np.random.default_rng(zlib.crc32(f"w2 of {P.name}|world={P.W}".encode()))
    F = y.shape[1]
    w2 = rng.integers(-1, 2, size=(P.El, F, P.H)).astype(np.float32).astype(P.dt)  # this rank's experts
    if lay == "nk":
        w2 = np.ascontiguousarray(w2.transpose(0, 2, 1))
    ob = _poisoned((P.Ts[me], P.H), P.dtn)
    out = mkernel.moe_gemm_combine(y, _dev(w2), h, comm=comm, out=ob, w_layout=lay, path=path, comm_sms=comm_sms)
    return ob, out
