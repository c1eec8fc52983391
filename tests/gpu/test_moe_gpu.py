"""GPU tests of mkernel.moe inside one node, 1 rank and under mpirun (marked gpu and mpi): the dispatch
layout and the combine, exact (and at H = 7168, marked slow); the whole layer (moe_dispatch_gemm ->
relu -> moe_gemm_combine) against float64; repeated and back-to-back launches; a stale handle.
tests/cpu/test_moe.py's docstring says what each checks; the problems are tests/helpers/moe_cases.py's."""

import numpy as np
import pytest

import mkernel

from tests.helpers import collective_cases
from tests.helpers.argument_errors import argument_errors
from tests.helpers.arrays import BF16
from tests.helpers.arrays import bits as _bits
from tests.helpers.arrays import dev as _dev
from tests.helpers.arrays import host as _host
from tests.helpers.arrays import poison as _poison
from tests.helpers.arrays import poisoned as _poisoned
from tests.helpers.moe_cases import (
    DISPATCH_CASES,
    DISPATCH_SLOW,
    REL_TOL,
    TOKEN_TOL,
    _build,
    _case_name,
    _cases_for,
    _check_exact_out,
    _check_recv,
    _collective,
    _combine_reference,
    _combine_values,
    _inputs,
    _layer_problem,
    _layer_reference,
    _nan_bits,
    _problem,
    _rel,
    _relu,
    _report_and_decide,
    _roundtrip_want,
    _run_cases,
    _solo,
    _sync,
    mmoe,
)


# ======================================================================= dispatch / combine cases
def _dispatch_body(comm, c):
    moe = mmoe
    me = comm.rank
    P = _build(comm, c)
    x, ids, w = _inputs(P, me)
    x_bits = _bits(x)
    buf = _poisoned((P.cap, P.H), P.dtn)
    recv, h = moe.moe_dispatch(x, ids, w, comm=comm, num_experts=P.E, capacity=P.capacity, out=buf)
    _sync(_case_name(c))
    comm.check()
    if recv is not buf:
        return False, "moe_dispatch did not return the given out"
    if h.capacity != P.cap or h.group_rows.shape != (P.El,) or str(h.group_rows.dtype) != "int32":
        return False, (f"handle: capacity {h.capacity} (want {P.cap}), "
                       f"group_rows {h.group_rows.dtype} {h.group_rows.shape}")
    ok, msg = _check_recv(P, me, recv, h)
    if not (_bits(x) == x_bits).all():
        ok, msg = False, msg + "; X MODIFIED"
    return ok, msg


def _combine_body(comm, c):
    moe = mmoe
    me = comm.rank
    P = _build(comm, c)
    x, ids, w = _inputs(P, me)
    recv, h = moe.moe_dispatch(x, ids, w, comm=comm, num_experts=P.E, capacity=P.capacity)
    Ys = _combine_values(P)
    n = P.layout[me][0].size
    y_host = np.empty((P.cap, P.H), dtype=P.dt)
    y_host.view(np.uint16)[:] = _nan_bits(P.dtn)  # rows past received: NaN (combine must not read them)
    y_host[:n] = Ys[me].astype(np.float32).astype(P.dt)
    y = _dev(y_host)
    out_buf = _poisoned((P.Ts[me], P.H), P.dtn)
    out = moe.moe_combine(y, h, comm=comm, out=out_buf)
    _sync(_case_name(c))
    comm.check()
    if out is not out_buf:
        return False, "moe_combine did not return the given out"
    if h.received() != n:
        return False, f"dispatch received {h.received()} rows, expected {n} (see test_dispatch_layout)"
    want = _combine_reference(P, me, Ys).astype(np.float32).astype(P.dt)
    return _check_exact_out(P, me, out, want)


@collective_cases.gpu_mpi
def test_dispatch_layout(comm):
    cases = _cases_for(comm, DISPATCH_CASES)
    names = list(cases)
    results = _run_cases(comm, names, lambda n: _dispatch_body(comm, cases[n]))
    _report_and_decide(comm, "moe_dispatch layout, bitwise (label: dtype H El k T capacity)", names, results)


@collective_cases.gpu_mpi
def test_combine_exact(comm):
    cases = _cases_for(comm, DISPATCH_CASES)
    names = list(cases)
    results = _run_cases(comm, names, lambda n: _combine_body(comm, cases[n]))
    _report_and_decide(comm, "moe_combine exact (integer rows, weights in {1/4, 1/2, 1, 2}), bitwise", names, results)


@pytest.mark.slow
@collective_cases.gpu_mpi
def test_dispatch_and_combine_large(comm):
    cases = _cases_for(comm, DISPATCH_SLOW)
    names = [f"{kind} {n}" for n in cases for kind in ("dispatch", "combine")]
    results = _run_cases(comm, names, lambda n: (_dispatch_body if n.startswith("dispatch") else _combine_body)(
        comm, cases[n.split(" ", 1)[1]]))
    _report_and_decide(comm, "moe_dispatch / moe_combine at H=7168, bitwise", names, results)


# ====================================================================================== the layer
LAYER_CASES = [
    # label, dtype, H, F, El, k, routing, T, capacity, w_layout
    ("uniform top-2", "bf16", 256, 512, 4, 2, "uniform", 300, "auto", "kn"),
    ("zipf(1.2) top-2", "bf16", 512, 256, 2, 2, "zipf", 400, "auto", "kn"),
    ("uniform top-8", "bf16", 128, 256, 8, 8, "uniform", 200, "auto", "kn"),
    ("zipf(1.2) top-8", "fp16", 256, 128, 8, 8, "zipf", 150, "auto", "kn"),
    ("El=64 zipf(1.2) top-8", "bf16", 128, 128, 64, 8, "zipf", 256, "auto", "kn"),
    ("empty experts (and ranks)", "bf16", 128, 256, 8, 2, "sparse", 200, "auto", "kn"),
    ("T=0 on the last rank", "fp16", 128, 128, 4, 2, "uniform", "zero-last", "max", "kn"),
    ("w_layout nk, H == F", "bf16", 256, 256, 4, 2, "uniform", 300, "auto", "nk"),
    ("w_layout nk", "fp16", 128, 384, 4, 2, "zipf", 200, "auto", "nk"),
]


def _layer_name(c):
    label, dtn, H, F, El, k, routing, T, cap, lay = c
    return f"{label}: {dtn} H={H} F={F} El={El} k={k} T={T} w={lay}"


def _layer_body(comm, c):
    label, dtn, H, F, El, k, routing, T, cap, lay = c
    W, me = comm.size, comm.rank
    P = _layer_problem(_layer_name(c), W, dtn, H, F, El, k, routing, T, cap=cap, layout=lay)
    x, ids, w = _inputs(P, me)
    w1 = P.W1[me * El:(me + 1) * El]  # [El, H, F]
    w2 = P.W2[me * El:(me + 1) * El]  # [El, F, H]
    if lay == "nk":
        w1, w2 = (np.ascontiguousarray(a.transpose(0, 2, 1)) for a in (w1, w2))
    w1, w2 = _dev(w1), _dev(w2)
    y_buf = _poisoned((P.cap, F), dtn)
    y, h = mkernel.moe_dispatch_gemm(x, ids, w, w1, comm=comm, num_experts=P.E, capacity=P.capacity, out=y_buf,
                                 w_layout=lay if lay == "nk" else None)
    act = _relu(y)
    out_buf = _poisoned((P.Ts[me], H), dtn)
    out = mkernel.moe_gemm_combine(act, w2, h, comm=comm, out=out_buf, w_layout=lay if lay == "nk" else None)
    _sync(_layer_name(c))
    comm.check()
    if y is not y_buf or out is not out_buf:
        return False, "moe_dispatch_gemm / moe_gemm_combine did not return the given out"
    y_ref, out_ref = _layer_reference(P, me)
    src, _, counts = P.layout[me]
    n = src.size
    ok, msgs = True, []
    got_n, got_counts = h.received(), np.asarray(h.counts())
    if got_n != n or not np.array_equal(got_counts, counts.sum(axis=1)):
        ok = False
        msgs.append(f"RECEIVED {got_n} rows / group_rows {got_counts[:8].tolist()}, expected {n} / "
                    f"{counts.sum(axis=1)[:8].tolist()}")
    yb = _bits(y)
    y_got = _host(y)[:n].astype(np.float64)
    tail = np.flatnonzero(~(yb[n:] == _nan_bits(dtn)).all(axis=1))
    if tail.size:
        ok = False
        msgs.append(f"{tail.size} y ROWS PAST received WRITTEN")
    if not np.isfinite(y_got).all():
        ok = False
        msgs.append(f"y NONFINITE in {int((~np.isfinite(y_got).all(axis=1)).sum())} of the received rows")
    else:
        ry = _rel(y_got, y_ref)
        per = counts.sum(axis=1)
        starts = np.concatenate([[0], np.cumsum(per)])
        worst = max(((_rel(y_got[starts[e]:starts[e + 1]], y_ref[starts[e]:starts[e + 1]]), e)
                     for e in range(El) if per[e]), default=(0.0, None))
        msgs.append(f"y rel={ry:.2e} worst expert {worst[1]}:{worst[0]:.2e}")
        ok &= ry < REL_TOL and worst[0] < REL_TOL
    o = _host(out).astype(np.float64)
    if not np.isfinite(o).all():
        ok = False
        msgs.append(f"out NONFINITE in tokens {np.flatnonzero(~np.isfinite(o).all(axis=1))[:8].tolist()}")
    else:
        ro = _rel(o, out_ref)
        num = np.linalg.norm(o - out_ref, axis=1)
        den = np.linalg.norm(out_ref, axis=1)
        tok = np.where(den > 0, num / np.where(den > 0, den, 1), np.where(num > 0, np.inf, 0.0))
        bad = np.flatnonzero(~(tok < TOKEN_TOL))
        wt = int(np.argmax(tok)) if tok.size else None
        msgs.append(f"out rel={ro:.2e} worst token {wt}:{(tok[wt] if tok.size else 0):.2e}")
        if bad.size:
            msgs.append(f"{bad.size} BAD TOKENS, first {int(bad[0])} (experts {P.ids[me][bad[0]].tolist()})")
        ok &= ro < REL_TOL and not bad.size
    return bool(ok), "; ".join(msgs)


@collective_cases.gpu_mpi
def test_layer_reference(comm):
    cases = {_layer_name(c): c for c in LAYER_CASES if c[4] * comm.size <= 512}
    names = list(cases)
    results = _run_cases(comm, names, lambda n: _layer_body(comm, cases[n]))
    _report_and_decide(comm, "moe_dispatch_gemm -> relu -> moe_gemm_combine vs float64", names, results)


# ================================================================== repeated and back-to-back launches
def _repeat_body(comm, n=20):
    """n dispatch + combine pairs on the same buffers (poisoned before each, copied after each),
    alternating two inputs of one shape (one plan: the same symmetric buffers), nothing synchronised
    in between: each equal to its solo run bitwise; the epoch moves by 2 n."""
    import cupy

    moe = mmoe
    W, me = comm.size, comm.rank
    probs = [_problem(f"repeat {i}", W, "bf16", 256, 4, 2, "zipf", 500) for i in range(2)]
    inps = [_inputs(P, me) for P in probs]
    solos, ok, msgs = [], True, []
    for P, inp in zip(probs, inps):
        rb, ob, o, m = _solo(moe, comm, P, inp)
        solos.append((rb, ob))
        ok &= o
        msgs.append(f"solo {P.name}: {m}")
    P0 = probs[0]
    rbuf = cupy.empty((P0.cap, P0.H), dtype=P0.dt)
    obuf = cupy.empty((P0.Ts[me], P0.H), dtype=P0.dt)
    e0 = comm.sync.epoch()
    snaps = []
    for i in range(n):
        P, inp = probs[i % 2], inps[i % 2]
        _poison(rbuf)
        _poison(obuf)
        recv, h = moe.moe_dispatch(*inp, comm=comm, num_experts=P.E, capacity=P.capacity, out=rbuf)
        moe.moe_combine(recv, h, comm=comm, out=obuf)
        snaps.append((rbuf.view(cupy.uint16).copy(), obuf.view(cupy.uint16).copy()))
    _sync(f"{n} repeated launches")
    comm.check()
    e1 = comm.sync.epoch()
    differ = [i for i, (r, o) in enumerate(snaps)
              if not ((cupy.asnumpy(r) == solos[i % 2][0]).all() and (cupy.asnumpy(o) == solos[i % 2][1]).all())]
    moved = (e1 - e0) % (1 << 32)
    msgs.append(f"launches differing from their solo run: {differ}; epoch moved by {moved} (want {2 * n})")
    return ok and not differ and moved == 2 * n, "; ".join(msgs)


@collective_cases.gpu_mpi
def test_repeated_launches(comm):
    _collective(comm, "20 dispatch + combine on the same buffers, two inputs alternating (bf16 H256 El4 k2 T500)",
                lambda: _repeat_body(comm))


def _b2b_body(comm, reps=5):
    """Two shapes X (bf16 H 128 k 2 El 4 uniform T 300) and Y (fp16 H 512 k 8 El 16 zipf T 200),
    dispatch + combine alternately, reps times each, into buffers of their own, all queued before
    one synchronisation: each equal bitwise to what the same call gave alone."""
    moe = mmoe
    W, me = comm.size, comm.rank
    shapes = {"X": ("bf16", 128, 4, 2, "uniform", 300), "Y": ("fp16", 512, 16, 8, "zipf", 200)}
    probs = {s: _problem(f"b2b {s}", W, *v) for s, v in shapes.items()}
    inps = {s: _inputs(P, me) for s, P in probs.items()}
    solos, ok, msgs = {}, True, []
    for s, P in probs.items():
        rb, ob, o, m = _solo(moe, comm, P, inps[s])
        solos[s] = (rb, ob)
        ok &= o
        msgs.append(f"solo {s}: {m}")
    order = ["X", "Y"] * reps
    bufs = [(_poisoned((probs[s].cap, probs[s].H), probs[s].dtn), _poisoned((probs[s].Ts[me], probs[s].H),
                                                                             probs[s].dtn)) for s in order]
    e0 = comm.sync.epoch()
    for s, (rb, ob) in zip(order, bufs):
        P = probs[s]
        recv, h = moe.moe_dispatch(*inps[s], comm=comm, num_experts=P.E, capacity=P.capacity, out=rb)
        moe.moe_combine(recv, h, comm=comm, out=ob)
    _sync("back to back", 60.0)
    comm.check()
    e1 = comm.sync.epoch()
    differ = [(i, s) for i, (s, (rb, ob)) in enumerate(zip(order, bufs))
              if not ((_bits(rb) == solos[s][0]).all() and (_bits(ob) == solos[s][1]).all())]
    moved = (e1 - e0) % (1 << 32)
    msgs.append(f"back to back {''.join(order)}: differ from solo at {differ}; epoch moved by {moved} "
                f"(want {2 * len(order)})")
    return ok and not differ and moved == 2 * len(order), "; ".join(msgs)


@collective_cases.gpu_mpi
def test_back_to_back_shapes(comm):
    _collective(comm, "two shapes back to back, 5 times each, one synchronisation", lambda: _b2b_body(comm))


# =================================================================================== stale handle
def _stale_body(comm):
    """A second dispatch of the same shape makes the first handle stale: moe_combine,
    moe_gemm_combine, received() and counts() raise ArgumentError without launching; the second
    handle combines right."""
    import cupy

    moe = mmoe
    W, me = comm.size, comm.rank
    A, B = (_problem(f"stale {i}", W, "bf16", 64, 4, 2, "uniform", 100) for i in range(2))
    recv1, h1 = moe.moe_dispatch(*_inputs(A, me), comm=comm, num_experts=A.E)
    recv2, h2 = moe.moe_dispatch(*_inputs(B, me), comm=comm, num_experts=B.E)
    _sync("two dispatches")
    comm.check()
    e0 = comm.sync.epoch()
    y2 = cupy.zeros((h1.capacity, 64), dtype=BF16)
    w2 = cupy.zeros((A.El, 64, 64), dtype=BF16)
    calls = {"moe_combine": lambda: moe.moe_combine(recv1, h1, comm=comm),
             "moe_gemm_combine": lambda: mkernel.moe_gemm_combine(y2, w2, h1, comm=comm),
             "received()": h1.received, "counts()": h1.counts}
    missed = sum(argument_errors(calls), [])
    _sync("stale calls")
    e1 = comm.sync.epoch()
    valid = (h1.valid(), h2.valid())
    out = moe.moe_combine(recv2, h2, comm=comm, out=_poisoned((B.Ts[me], B.H), "bf16"))
    _sync("fresh handle")
    comm.check()
    ok_out, m_out = _check_exact_out(B, me, out, _roundtrip_want(B, me))
    ok = not missed and e1 == e0 and valid == (False, True) and ok_out
    return ok, (f"no ArgumentError from: {missed}; valid() {valid} (want (False, True)); "
                f"{'LAUNCHED' if e1 != e0 else 'nothing launched'}; fresh handle: {m_out}")


@collective_cases.gpu_mpi
def test_stale_handle(comm):
    _collective(comm, "stale handle", lambda: _stale_body(comm))
