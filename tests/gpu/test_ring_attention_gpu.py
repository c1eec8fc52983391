"""Tests of mkernel.ring_attention (sequence-parallel attention forward over the ranks of a node).

Every rank builds the same global q, k, v from a fixed seed (S_full = S_local * world), takes its
part with mkernel.ops.sequence.shard_sequence (zigzag for causal, contiguous otherwise), runs
ring_attention into an output poisoned with NaN (an element nobody wrote fails), and compares with
a reference computed on the whole global sequence and then sharded the same way: float64 NumPy for
small problems, float32 CuPy for larger ones. Criteria: relative Frobenius error < 1e-2 of the
whole local output and of every (batch, head, 128-row tile), max |error| / max |ref| < 3e-2, and
the log-sum-exp within 1e-3 * (1 + |ref|). The reference never uses global_positions: the causal
mask is the plain one of the global sequence, so a wrong zigzag (or a missing or doubled KV block)
shows up as a wrong result.

CPU: the module imports and is exported as mkernel.ring_attention.
GPU, 1 rank and under mpirun (marked gpu and mpi; tests/run_gpu.sh runs them at 2 ranks):
- a matrix: causal and not, bf16 and fp16, D 64 and 128, GQA / MQA / MHA, S_local not a multiple
  of 128 (200, 330, 1000, 130, 2, 1), 1024 and 256, batch 2, 3-D inputs, custom softmax_scale; each
  case also without return_lse (checked against the reference, its bits compared) and checks that
  q, k, v were not modified;
- an exact case (non-causal): keys identical along the whole global sequence, so the softmax is
  exactly uniform over S_full keys; integer values whose columns sum to S_local * c_p over rank p's
  block (c_p half-integers averaging c over the ranks, so a missing or doubled block moves the
  result): the output must be c bit for bit, mismatching (batch, head, tile)s named;
- 20 launches in a row on the same buffers: bitwise identical and right (stale flags between
  launches are the classic bug); 1000 back-to-back launches alternating two inputs (marked slow);
- two shapes back to back, 5 times each, all queued before one synchronisation: each bitwise equal
  to its solo run;
- comm_sms=1 and 8 and another stream give the default's bits;
- argument errors raise ArgumentError on every rank, before anything is launched; at 2 ranks also
  shapes and dtypes that disagree across ranks (marked multi_gpu).
GPU, 1-rank pass only: world 1 (mkernel.init(MPI.COMM_SELF)) equals mkernel.attention bitwise.

Collective discipline: every rank runs the same cases in the same order, and each case is guarded
(an exception is caught and recorded). After every case the ranks exchange their outcomes, on a
duplicate of the communicator's MPI communicator kept for the tests (so that the exchange can
never be matched against a collective inside the op); if one rank raised where another did not,
or a peer error or timeout was raised, the ranks may be out of step, so all of them stop running
cases. Per-case tables are printed, then pass / fail is decided with tests.helpers.ranks.all_ranks. A device
hang ends the process after 45 s (sync_or_exit), past the op's own device timeout
(MKERNEL_TIMEOUT_S, 30 s). Limit: an exception on one rank between two collective ops can still
leave another rank inside the second op's host-side agreement (comm.agree), which no test can
undo; the cases are built so that everything before each call is identical on every rank.

The CPU tests are tests/cpu/test_ring_attention.py; this file has the matrix, the exact case, the
repeated and back-to-back launches and comm_sms / stream; test_ring_attention_errors_gpu.py the argument
errors; test_ring_attention_worlds_gpu.py world 1 and the ranks between (emulated) nodes and beyond two
on one node; tests/helpers/ring_cases.py what they share.

    python3 -m pytest tests/gpu/test_ring_attention*_gpu.py -q -s
    mpirun -n 2 --oversubscribe python3 -m pytest tests/gpu/test_ring_attention*_gpu.py -q -s -m "gpu and mpi"
"""

import math
import time
import zlib

import numpy as np
import pytest

from mkernel.ops.sequence import shard_sequence
from mkernel.testing import sync_or_exit

from tests.helpers import collective_cases
from tests.helpers.arrays import BF16, DTYPES
from tests.helpers.arrays import bits as _bits
from tests.helpers.arrays import compare_exact as _compare_exact
from tests.helpers.arrays import host_result as _host_result
from tests.helpers.arrays import poison as _poison
from tests.helpers.arrays import poisoned as _poisoned
from tests.helpers.ring_cases import (
    HANG_S,
    _check_local,
    _collective,
    _global_inputs,
    _report_and_decide,
    _ring,
    _run_cases,
    _shard,
    _sync,
)


# ============================================================================= the case matrix
# A case: dtype:dD:hHq/Hkv:batch:sS_local:mask[:scale=X]; batch is b1 / b2 (4-D inputs) or 3d
# (3-D inputs); mask is full or causal (causal needs an even S_local: the zigzag's two chunks).
def matrix_cases():
    cases = []
    for dtn in ("bf16", "fp16"):
        for D in (64, 128):
            for mask in ("full", "causal"):
                cases.append(f"{dtn}:d{D}:h8/2:b1:s200:{mask}")   # GQA, 4-D, S_local off the tile grid
                cases.append(f"{dtn}:d{D}:h4/4:3d:s330:{mask}")   # MHA, 3-D (chunks of 165 rows)
    cases += [
        # longer, ragged, and a multiple of 128
        "bf16:d128:h8/2:b1:s1000:causal", "fp16:d64:h4/4:3d:s1000:full", "fp16:d128:h8/2:b1:s1000:full",
        "bf16:d128:h8/2:b1:s1024:causal", "bf16:d128:h8/8:b1:s1024:full", "fp16:d128:h4/2:3d:s1024:causal",
        # batch 2
        "bf16:d128:h8/2:b2:s330:causal", "fp16:d64:h4/4:b2:s200:full", "bf16:d64:h4/1:b2:s256:causal",
        # multi-query (one kv head)
        "bf16:d128:h8/1:b1:s256:full",
        # tiny and tile edges: chunks of 1 row, one row per rank, chunks of 64 and 65 rows
        "bf16:d128:h2/2:3d:s2:causal", "fp16:d64:h2/1:b1:s1:full", "bf16:d64:h2/2:b1:s128:causal",
        "bf16:d128:h4/4:b1:s130:causal", "fp16:d128:h4/2:b1:s256:full",
        # custom softmax_scale (a large one makes rows peaky: the running max moves between blocks)
        "bf16:d64:h4/4:3d:s330:full:scale=0.5", "fp16:d128:h8/2:b1:s200:causal:scale=0.25",
        "bf16:d64:h8/2:b1:s330:causal:scale=1.0",
    ]
    return cases


def _parse(case):
    dtn, d, h, b, s, mask, *opts = case.split(":")
    Hq, Hkv = map(int, h[1:].split("/"))
    opts = dict(o.split("=", 1) for o in opts)
    return dict(dtn=dtn, D=int(d[1:]), Hq=Hq, Hkv=Hkv, B=None if b == "3d" else int(b[1:]), S=int(s[1:]),
                causal=mask == "causal", scale=float(opts["scale"]) if "scale" in opts else None)


def run_case(comm, case):
    """One matrix case on this rank; (ok, message)."""
    ring = _ring()
    c = _parse(case)
    dtn, D, Hq, Hkv, B, S, causal, scale = (c[x] for x in ("dtn", "D", "Hq", "Hkv", "B", "S", "causal", "scale"))
    W = comm.size
    q, k, v = _global_inputs(zlib.crc32(case.encode()), DTYPES[dtn], B, S * W, Hq, Hkv, D)
    dq, dk, dv = _shard(comm, causal, q, k, v)
    in_bits = [_bits(x) for x in (dq, dk, dv)]

    out = _poisoned(dq.shape, dtn)
    res = ring(dq, dk, dv, comm=comm, causal=causal, softmax_scale=scale, return_lse=True, out=out)
    if not (isinstance(res, tuple) and len(res) == 2 and res[0] is out):
        return False, f"return_lse=True returned {type(res).__name__}, not (out, lse) with the given out"
    lse = res[1]
    _sync(case)
    comm.check()
    lse_shape = (Hq, S) if B is None else (B, Hq, S)
    if lse.dtype != np.float32 or tuple(lse.shape) != lse_shape:
        return False, f"lse is {lse.dtype} {tuple(lse.shape)}, expected float32 {lse_shape}"
    ok, msg = _check_local(comm, out, q, k, v, causal, scale, lse)

    # Without lse: the same output (checked against the reference; the bits are reported).
    out2 = _poisoned(dq.shape, dtn)
    res2 = ring(dq, dk, dv, comm=comm, causal=causal, softmax_scale=scale, out=out2)
    _sync(case + " (no lse)")
    comm.check()
    if res2 is not out2:
        return False, f"return_lse=False returned {type(res2).__name__}, not the given out; " + msg
    ok2, msg2 = _check_local(comm, out2, q, k, v, causal, scale)
    msg += f" nolse-bits={'same' if (_bits(out2) == _bits(out)).all() else 'DIFFER'}"
    if not ok2:
        ok, msg = False, msg + f" nolse: {msg2}"
    changed = [n for n, x, b in zip("qkv", (dq, dk, dv), in_bits) if not (_bits(x) == b).all()]
    if changed:
        ok, msg = False, msg + f" INPUTS-MODIFIED={changed}"
    return ok, msg


@collective_cases.gpu_mpi
def test_matrix(comm):
    cases = matrix_cases()
    results = _run_cases(comm, cases, lambda case: run_case(comm, case))
    _report_and_decide(comm, "ring attention matrix (dtype:D:Hq/Hkv:batch:S_local:mask[:options])", cases, results)


# ======================================================================================== exact
EXACT_CONFIGS = [("bf16", 128, 8, 2, 2, 300),    # GQA, batch 2, S_local off the tile grid
                 ("fp16", 64, 4, 4, None, 1000),  # 3-D
                 ("bf16", 64, 8, 1, 1, 128),      # MQA
                 ("fp16", 128, 8, 2, 1, 200)]


def _exact_case(comm, i):
    """Keys identical along the whole global sequence within each (batch, kv head): every score of
    a row is the same, so the softmax is exactly uniform over the S_full keys (p = 1 after the max
    is subtracted). Values are small integers, paired so that over rank p's block every column sums
    to S_local * c_p, with c_p = c + (p - (W - 1) / 2) * sign a half-integer and c a nonzero
    half-integer: every block's partial is exact, their mean is c, and the output must be c bit for
    bit in bf16 and fp16 (any fp32 rounding of the merge is far below half an ulp of c). A block
    left out or taken twice moves the result by a multiple of 1 / (2 W). Queries are random."""
    ring = _ring()
    dtn, D, Hq, Hkv, B, S = EXACT_CONFIGS[i]
    dt = DTYPES[dtn]
    W = comm.size
    Bn, g = B or 1, Hq // Hkv
    rng = np.random.default_rng(200 + i)
    q = rng.standard_normal((Bn, S * W, Hq, D)).astype(dt)
    kvec = rng.standard_normal((Bn, 1, Hkv, D)).astype(dt)
    k = np.ascontiguousarray(np.broadcast_to(kvec, (Bn, S * W, Hkv, D)))
    c = rng.choice(np.array([-3, -2.5, -2, -1.5, -1, -0.5, 0.5, 1, 1.5, 2, 2.5, 3]), size=(Bn, 1, Hkv, D))
    sign = rng.choice(np.array([-1.0, 1.0]), size=(Bn, 1, Hkv, D))
    blocks = []
    for p in range(W):
        cp = c + (p - (W - 1) / 2) * sign
        v1 = rng.integers(-4, 5, size=(Bn, S // 2, Hkv, D)).astype(np.float64)
        blk = np.concatenate([v1, 2 * cp - v1], axis=1)[:, rng.permutation(S)]
        assert (blk.sum(axis=1, keepdims=True) == S * cp).all()
        blocks.append(blk)
    v64 = np.concatenate(blocks, axis=1)
    assert (v64.sum(axis=1, keepdims=True) == S * W * c).all()
    v = v64.astype(dt)
    assert (v.astype(np.float64) == v64).all()
    expect = np.repeat(c, g, axis=2)[:, 0]  # [B, H_q, D]: query head h reads kv head h // g
    if B is None:
        q, k, v = q[0], k[0], v[0]
    dq, dk, dv = _shard(comm, False, q, k, v)
    out = _poisoned(dq.shape, dtn)
    _, lse = ring(dq, dk, dv, comm=comm, out=out, return_lse=True)
    _sync(f"exact {i}")
    comm.check()
    # lse = scale * q . kvec + ln(S_full) for every local row
    q_loc = shard_sequence(q if B is not None else q[None], comm.rank, W, causal=False, axis=1).astype(np.float64)
    kv64 = np.repeat(kvec.astype(np.float64), g, axis=2)[:, 0]  # [B, H_q, D]
    ref_lse = np.einsum("bshd,bhd->bhs", q_loc, kv64) / math.sqrt(D) + math.log(S * W)
    got, got_lse = _host_result(out, lse)
    ok, msg, bad = _compare_exact(got, got_lse, expect, ref_lse)
    if bad.any():
        b0, s0, h0, d0 = (int(t[0]) for t in np.nonzero(bad))
        msg += f"; first at (b {b0}, row {s0}, h {h0}, d {d0}): {got[b0, s0, h0, d0]!r} != {expect[b0, h0, d0]!r}"
    return ok, msg


@collective_cases.gpu_mpi
def test_exact(comm):
    names = [f"exact {dtn} D={D} H={Hq}/{Hkv} B={B} S_local={S}" for dtn, D, Hq, Hkv, B, S in EXACT_CONFIGS]
    results = _run_cases(comm, names, lambda n: _exact_case(comm, names.index(n)))
    _report_and_decide(comm, "exact (uniform softmax over the global sequence)", names, results)


# ======================================================================== repeated launches
def _repeat_body(comm, n=20):
    """n launches in a row on the same buffers (the output poisoned before each, a copy of its bits
    taken after, nothing synchronised in between): every result identical bitwise, and right. Even
    launches return lse, odd ones do not (calls with out= and no lse may reuse a launch plan); launches
    2-3, 6-7, ... forward with config.comm_staged (through shared memory: the same bits); 4-7, 12-15,
    ... run with config.mps_full_share flipped (the grid's size under MPS: the same bits)."""
    import cupy

    from mkernel import config

    ring = _ring()
    W = comm.size
    q, k, v = _global_inputs(31, BF16, 1, 330 * W, 8, 2, 128)
    dq, dk, dv = _shard(comm, True, q, k, v)
    out = cupy.empty(dq.shape, dtype=BF16)
    snaps, lses = [], []
    for i in range(n):
        _poison(out)
        full = config.get().mps_full_share != (i % 8 >= 4)
        with config.override(comm_staged=i % 4 >= 2, mps_full_share=full):
            if i % 2 == 0:
                res = ring(dq, dk, dv, comm=comm, causal=True, out=out, return_lse=True)
                lses.append(res[1].copy())
            else:
                res = ring(dq, dk, dv, comm=comm, causal=True, out=out)
        snaps.append(out.view(cupy.uint16).copy())
    _sync(f"{n} repeated launches")
    comm.check()
    if res is not out:
        return False, "the call did not return the given out"
    ok1, m1 = _check_local(comm, out, q, k, v, True)
    ok2, m2 = _check_local(comm, snaps[n - 2].view(BF16), q, k, v, True, lse=lses[-1])
    first, first_lse = cupy.asnumpy(snaps[0]), _bits(lses[0])
    differ = [i for i in range(n) if not (cupy.asnumpy(snaps[i]) == first).all()]
    differ += [f"lse {2 * i}" for i in range(len(lses)) if not (_bits(lses[i]) == first_lse).all()]
    msg = f"last: {m1}; launch {n - 1} with lse: {m2}; launches differing from the first: {differ}"
    return ok1 and ok2 and not differ, msg


@collective_cases.gpu_mpi
def test_repeated_launches(comm):
    _collective(comm, "20 repeated launches, same buffers (bf16 D128 H 8/2 S_local 330 causal)",
                lambda: _repeat_body(comm))


def _thousand_body(comm, n=1000):
    """n back-to-back launches (nothing synchronised) alternating two inputs of one small shape
    (S_local 256, 2 heads, causal) into two outputs, poisoned before the last two launches: those
    two results equal their solo runs bitwise, and nothing raised (comm.check)."""
    ring = _ring()
    W = comm.size
    sets = []
    for seed in (41, 42):
        q, k, v = _global_inputs(seed, BF16, 1, 256 * W, 2, 2, 128)
        sets.append(((q, k, v), _shard(comm, True, q, k, v), _poisoned((1, 256, 2, 128), "bf16")))
    solo, msgs, ok = [], [], True
    for j, (host, (dq, dk, dv), out) in enumerate(sets):
        ring(dq, dk, dv, comm=comm, causal=True, out=out)
        _sync(f"solo {j}")
        comm.check()
        o, m = _check_local(comm, out, *host, True)
        ok &= o
        msgs.append(f"solo {j}: {m}")
        solo.append(_bits(out))
    t0 = time.perf_counter()
    for i in range(n):
        if i == n - 2:
            for _, _, out in sets:
                _poison(out)
        _, (dq, dk, dv), out = sets[i % 2]
        ring(dq, dk, dv, comm=comm, causal=True, out=out)
    t_host = time.perf_counter() - t0
    _sync(f"{n} back-to-back launches", timeout_s=120.0)
    t_all = time.perf_counter() - t0
    comm.check()
    same = [bool((_bits(out) == solo[j]).all()) for j, (_, _, out) in enumerate(sets)]
    msgs.append(f"last two equal their solo runs: {same}; {n} launches queued in {t_host:.2f} s, done in "
                f"{t_all:.2f} s ({t_all / n * 1e6:.0f} us per launch)")
    return ok and all(same), "; ".join(msgs)


@pytest.mark.slow
@collective_cases.gpu_mpi
def test_thousand_back_to_back_launches(comm):
    _collective(comm, "1000 back-to-back launches (bf16 D128 H 2/2 S_local 256 causal, two inputs)",
                lambda: _thousand_body(comm))


# ================================================================== back-to-back different shapes
def _b2b_body(comm):
    """Two shapes (X: bf16 D128 GQA 4-D causal, with lse; Y: fp16 D64 MHA 3-D non-causal, without)
    launched alternately, 5 times each, all queued before one synchronisation: each result equals
    bitwise what the same call gave alone (a counter or flag left stale by one launch corrupts the
    next)."""
    ring = _ring()
    W = comm.size
    shapes = {"X": ("bf16", 128, 8, 2, 1, 330, True, True), "Y": ("fp16", 64, 4, 4, None, 200, False, False)}
    prob = {}
    for name, (dtn, D, Hq, Hkv, B, S, causal, with_lse) in shapes.items():
        host = _global_inputs(zlib.crc32(name.encode()), DTYPES[dtn], B, S * W, Hq, Hkv, D)
        prob[name] = (host, _shard(comm, causal, *host), dtn, causal, with_lse)

    def launch(name):
        _, (dq, dk, dv), dtn, causal, with_lse = prob[name]
        out = _poisoned(dq.shape, dtn)
        if with_lse:
            return out, ring(dq, dk, dv, comm=comm, causal=causal, out=out, return_lse=True)[1]
        return ring(dq, dk, dv, comm=comm, causal=causal, out=out), None

    solo, ok, msgs = {}, True, []
    for name in shapes:
        solo[name] = launch(name)
        _sync(f"solo {name}")
        comm.check()
        o, m = _check_local(comm, solo[name][0], *prob[name][0], prob[name][3], lse=solo[name][1])
        ok &= o
        msgs.append(f"solo {name}: {m}")
    order = ["X", "Y"] * 5
    outs = [launch(name) for name in order]
    _sync("back to back")
    comm.check()
    differ = []
    for pos, (name, (o, lse)) in enumerate(zip(order, outs)):
        so, slse = solo[name]
        if not ((_bits(o) == _bits(so)).all() and (lse is None or (_bits(lse) == _bits(slse)).all())):
            differ.append((pos, name))
    msgs.append(f"back to back {''.join(order)}: differ from solo at {differ}")
    return ok and not differ, "; ".join(msgs)


@collective_cases.gpu_mpi
def test_back_to_back_shapes(comm):
    _collective(comm, "two shapes back to back, 5 times each", lambda: _b2b_body(comm))


# =========================================================================== comm_sms, stream
def _options_body(comm, name):
    """comm_sms=1 / 8 and stream= give the default's bits (out and lse)."""
    import cupy

    ring = _ring()
    W = comm.size
    host = _global_inputs(51, BF16, 1, 1000 * W, 8, 2, 128)
    dq, dk, dv = _shard(comm, True, *host)
    base = _poisoned(dq.shape, "bf16")
    _, base_lse = ring(dq, dk, dv, comm=comm, causal=True, out=base, return_lse=True)
    _sync("default")
    comm.check()
    ok, msg = _check_local(comm, base, *host, True, lse=base_lse)
    out = _poisoned(dq.shape, "bf16")
    if name == "stream":
        s = cupy.cuda.Stream(non_blocking=True)
        cupy.cuda.get_current_stream().synchronize()  # the poison is written before the other stream runs
        _, lse = ring(dq, dk, dv, comm=comm, causal=True, out=out, return_lse=True, stream=s)
        sync_or_exit("stream=", HANG_S, stream=s)
    else:
        _, lse = ring(dq, dk, dv, comm=comm, causal=True, out=out, return_lse=True, comm_sms=int(name.split("=")[1]))
        _sync(name)
    comm.check()
    same = bool((_bits(out) == _bits(base)).all() and (_bits(lse) == _bits(base_lse)).all())
    return ok and same, f"default: {msg}; {name}: {'same bits' if same else 'DIFFER'}"


@collective_cases.gpu_mpi
def test_comm_sms_and_stream(comm):
    names = ["comm_sms=1", "comm_sms=8", "stream"]
    results = _run_cases(comm, names, lambda n: _options_body(comm, n))
    _report_and_decide(comm, "comm_sms and stream (bf16 D128 H 8/2 S_local 1000 causal) vs default bits", names,
                       results)
