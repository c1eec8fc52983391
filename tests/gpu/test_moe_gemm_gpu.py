"""Tests of the fused MoE kernels: dispatch + grouped GEMM (mkernel.moe_dispatch_gemm, path="fused",
mkernel/cuda/ops/moe_dispatch_gemm.cu) and grouped GEMM + combine (mkernel.moe_gemm_combine,
mkernel/cuda/ops/moe_gemm_combine.cu). The problems, layout rule and helpers are tests/helpers/moe_cases.py's;
the CPU test is tests/cpu/test_moe_gemm.py.

GPU, 1 rank and under mpirun (marked gpu and mpi):
- exact, per (expert, source) block (test_fused_exact): x in {-1, 0, 1} and w1 in {-1, 0, 1} with
  H <= 256 (bf16) or H <= 1000 (fp16), so every output is an integer the dtype holds exactly: y rows
  [0, received) bitwise equal to the float64 GEMM of the rows the layout rule puts there, the first
  wrong (expert, source) block and 128-row tile named; rows past received still poisoned; the counts
  (handle.counts(), received()) right; and the unfused path (moe_dispatch then grouped_gemm) bitwise
  equal to the fused one; moe_gemm_combine of that y (w2 in {-1, 0, 1}) bitwise equal to grouped_gemm +
  moe_combine (exact in test_moe_gpu), no token left poisoned. Every routing of the dispatch cases
  (uniform, Zipf, top-1..8, repeated experts, empty experts and ranks, T = 0 on a rank, T per rank, a
  capacity exactly the need and above it), El up to 64, F 72 (a part of one N-tile) and 264 (two),
  w1 [El, H, F] and [El, F, H];
- 12 dispatch+GEMM and 12 GEMM+combine launches queued without synchronisation, alternating two inputs
  of one shape and a second shape (plans of their own), each bitwise equal to its solo run; the epoch
  moves by 24 (test_fused_repeated);
- comm_sms 1 and 40 give the same bits as the default, both ops (test_fused_split_invariant);
- the exact cases again with the dispatch CTAs joining the GEMM after their sends (config moe_join_gemm).
Device-detected errors of the fused kernel (capacity, expert ids) are cases of
tests/gpu/test_moe_errors_gpu.py::test_device_errors.
"""

import importlib

import numpy as np
import pytest

import mkernel

from tests.helpers import collective_cases
from tests.helpers import moe_cases as tm
from tests.helpers.arrays import bits, host

mmg = importlib.import_module("mkernel.ops.moe_gemm")

FS = (72, 264)  # output widths: part of one N-tile, two N-tiles

WORKSPACE = tm.WORKSPACE  # the module communicator's (tests/gpu/conftest.py)



def _want_y(P, me, W1):
    """The GEMM rows owner `me` holds (float64, exact), in receive order."""
    src, pair, counts = P.layout[me]
    rows = tm._expected_rows(P, me).astype(np.float64)
    expert = np.repeat(np.arange(P.El), counts.sum(axis=1))
    y = np.zeros((src.size, W1.shape[2]))
    for el in np.unique(expert):
        m = expert == el
        y[m] = rows[m] @ W1[me * P.El + el].astype(np.float64)
    return y


def _check_y(P, me, y, h, want):
    """(ok, message): y [cap, F] against want, bitwise, naming the first wrong block and tile."""
    src, _, counts = P.layout[me]
    n = src.size
    msgs, ok = [f"received {h.received()}/{n}"], True
    if h.received() != n or not np.array_equal(np.asarray(h.counts()), counts.sum(axis=1)):
        ok = False
        msgs.append(f"COUNTS {np.asarray(h.counts())[:8].tolist()} expected {counts.sum(axis=1)[:8].tolist()}")
    yb = bits(y)
    wb = want.astype(np.float32).astype(P.dt).view(np.uint16)
    bad = np.flatnonzero(~(yb[:n] == wb).all(axis=1))
    if bad.size:
        ok = False
        starts = np.concatenate([[0], np.cumsum(counts.reshape(-1))])  # blocks (el, s), el major
        b0 = int(np.searchsorted(starts, bad[0], side="right") - 1)
        el, s = divmod(b0, P.W)
        group_start = int(starts[el * P.W])
        r = int(bad[0])
        c = int(np.flatnonzero(yb[r] != wb[r])[0])
        msgs.append(f"{bad.size} WRONG ROWS; first row {r} (local expert {el}, from rank {s}, tile "
                    f"{(r - group_start) // 128} of its group) col {c}: {host(y)[r, c]!r} != {want[r, c]!r}")
    tail = np.flatnonzero(~(yb[n:] == tm._nan_bits(P.dtn)).all(axis=1))
    if tail.size:
        ok = False
        msgs.append(f"{tail.size} ROWS PAST received WRITTEN, first {n + int(tail[0])}")
    return ok, "; ".join(msgs)


EXACT_CASES = [c for c in tm.DISPATCH_CASES if c["H"] <= (256 if c["dtn"] == "bf16" else 1000)]


def _exact_name(c, F, lay):
    return f"{tm._case_name(c)} F={F} w={lay}"


def _exact_cases(comm):
    out = {}
    for i, c in enumerate(tm._cases_for(comm, EXACT_CASES).values()):
        if c["El"] > mmg.MAX_EXPERTS_LOCAL:
            continue
        F, lay = FS[i % 2], ("kn", "nk")[i // 2 % 2]
        out[_exact_name(c, F, lay)] = (c, F, lay)
    return out


def _exact_body(comm, c, F, lay):
    """dispatch + GEMM exact against float64 and bitwise equal to the building blocks; GEMM + combine
    of its y bitwise equal to the building blocks (grouped_gemm + moe_combine: exact in test_moe)."""
    me = comm.rank
    P = tm._problem(tm._case_name(c), comm.size, c["dtn"], c["H"], c["El"], c["k"], c["routing"], c["T"], c["cap"],
                    values="unit")
    W1 = tm._weights(P, F)
    yb, y, h = tm._run(P, me, W1, F, lay, comm)
    ob, out = tm._combine(P, me, y, h, lay, comm)
    tm._sync(_exact_name(c, F, lay))
    comm.check()
    if y is not yb or out is not ob:
        return False, "moe_dispatch_gemm / moe_gemm_combine did not return the given out"
    ok, msg = _check_y(P, me, y, h, _want_y(P, me, W1))
    y_bits, out_bits = bits(y), bits(out)
    _, yu, hu = tm._run(P, me, W1, F, lay, comm, path="unfused")
    _, outu = tm._combine(P, me, yu, hu, lay, comm, path="unfused")
    tm._sync(_exact_name(c, F, lay) + " unfused")
    comm.check()
    same_y = bool((bits(yu) == y_bits).all())
    same_out = bool((bits(outu) == out_bits).all())
    poison_left = int((out_bits == tm._nan_bits(P.dtn)).all(axis=1).sum()) if P.Ts[me] else 0
    msg += "; dispatch+GEMM " + ("= unfused" if same_y else "DIFFERS FROM UNFUSED")
    msg += "; GEMM+combine " + ("= unfused" if same_out else "DIFFERS FROM UNFUSED")
    if poison_left:
        msg += f"; {poison_left} TOKENS NEVER WRITTEN"
    return ok and same_y and same_out and not poison_left, msg


@collective_cases.gpu_mpi
@pytest.mark.parametrize("join", [False, True])
def test_fused_exact(comm, join):
    """join: the dispatch CTAs take GEMM tiles once their rows are sent (config moe_join_gemm)."""
    cases = _exact_cases(comm)
    names = list(cases)
    with mkernel.config.override(moe_join_gemm=join):
        results = tm._run_cases(comm, names, lambda n: _exact_body(comm, *cases[n]))
    tm._report_and_decide(comm, f"moe_dispatch_gemm fused (join={join}), exact per (expert, source) block", names,
                          results)


def _repeat_body(comm):
    """Shapes A (bf16 H 256 El 4 k 2 zipf T 500, two inputs) and B (fp16 H 512 El 16 k 8 uniform T 200):
    A0 A1 B, four times, queued without synchronisation, each y into a buffer of its own: each bitwise
    equal to its solo run, the epoch moved by 12; the second and fourth rounds with config.mps_full_share
    flipped (the grid's size under MPS: the same bits)."""
    from mkernel import config

    W, me = comm.size, comm.rank
    probs = {"A0": tm._problem("fused repeat A0", W, "bf16", 256, 4, 2, "zipf", 500, values="unit"),
             "A1": tm._problem("fused repeat A1", W, "bf16", 256, 4, 2, "zipf", 500, values="unit"),
             "B": tm._problem("fused repeat B", W, "fp16", 512, 16, 8, "uniform", 200, values="unit")}
    Fs = {"A0": 264, "A1": 264, "B": 72}
    W1s = {s: tm._weights(P, Fs[s]) for s, P in probs.items()}
    solos, ok, msgs = {}, True, []
    for s, P in probs.items():
        _, y, h = tm._run(P, me, W1s[s], Fs[s], "kn", comm)
        tm._sync(f"solo {s}")
        comm.check()
        o, m = _check_y(P, me, y, h, _want_y(P, me, W1s[s]))
        ok &= o
        msgs.append(f"solo {s}: {m}")
        solos[s] = (bits(y), bits(tm._combine(P, me, y, h, "kn", comm)[1]))
        tm._sync(f"solo {s} combine")
    order = ["A0", "A1", "B"] * 4
    e0 = comm.sync.epoch()
    runs = []
    for i, s in enumerate(order):  # dispatch+GEMM, then GEMM+combine of its y, each into buffers of their own
        with config.override(mps_full_share=config.get().mps_full_share != (i // 3 % 2 == 1)):
            _, y, h = tm._run(probs[s], me, W1s[s], Fs[s], "kn", comm)
            runs.append((y, tm._combine(probs[s], me, y, h, "kn", comm)[1]))
    tm._sync("fused repeats", 60.0)
    comm.check()
    moved = (comm.sync.epoch() - e0) % (1 << 32)
    differ = [(i, s) for i, (s, (y, o)) in enumerate(zip(order, runs))
              if not ((bits(y) == solos[s][0]).all() and (bits(o) == solos[s][1]).all())]
    msgs.append(f"differ from solo at {differ}; epoch moved by {moved} (want {2 * len(order)})")
    return ok and not differ and moved == 2 * len(order), "; ".join(msgs)


@collective_cases.gpu_mpi
def test_fused_repeated(comm):
    tm._collective(comm, "12 fused launches, two inputs and two shapes interleaved, one synchronisation",
                   lambda: _repeat_body(comm))


def _split_body(comm):
    W, me = comm.size, comm.rank
    P = tm._problem("fused split", W, "bf16", 256, 8, 4, "zipf", 700, values="unit")
    W1 = tm._weights(P, 264)
    want = _want_y(P, me, W1)
    ok, msgs = True, []
    outs = []
    from mkernel.runtime.launch import sm_count
    for sms in (None, 1, min(40, sm_count() - 1)):  # 40, or all but one CTA where fewer SMs count (MPS)
        _, y, h = tm._run(P, me, W1, 264, "kn", comm, comm_sms=sms)
        outs.append(bits(tm._combine(P, me, y, h, "kn", comm, comm_sms=sms)[1]))
        tm._sync(f"comm_sms={sms}")
        comm.check()
        o, m = _check_y(P, me, y, h, want)
        ok &= o
        msgs.append(f"comm_sms={sms}: {m}")
    same = all((o == outs[0]).all() for o in outs)
    msgs.append("combine outputs " + ("equal" if same else "DIFFER"))
    return ok and same, "; ".join(msgs)


@collective_cases.gpu_mpi
def test_fused_split_invariant(comm):
    tm._collective(comm, "comm_sms default (16 and 8), 1, 40 (or the most allowed): the same exact y",
                   lambda: _split_body(comm))
