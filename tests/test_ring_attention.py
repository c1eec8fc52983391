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
- comm_sms=1 and 2 and another stream give the default's bits;
- argument errors raise ArgumentError on every rank, before anything is launched; at 2 ranks also
  shapes and dtypes that disagree across ranks (marked multi_gpu).
GPU, 1-rank pass only: world 1 (mkernel.init(MPI.COMM_SELF)) equals mkernel.attention bitwise.

Collective discipline: every rank runs the same cases in the same order, and each case is guarded
(an exception is caught and recorded). After every case the ranks exchange their outcomes, on a
duplicate of the communicator's MPI communicator kept for the tests (so that the exchange can
never be matched against a collective inside the op); if one rank raised where another did not,
or a peer error or timeout was raised, the ranks may be out of step, so all of them stop running
cases. Per-case tables are printed, then pass / fail is decided with conftest.all_ranks. A device
hang ends the process after 45 s (sync_or_exit), past the op's own device timeout
(MKERNEL_TIMEOUT_S, 30 s). Limit: an exception on one rank between two collective ops can still
leave another rank inside the second op's host-side agreement (comm.agree), which no test can
undo; the cases are built so that everything before each call is identical on every rank.

    python3 -m pytest tests/test_ring_attention.py -q -s
    mpirun -n 2 --oversubscribe python3 -m pytest tests/test_ring_attention.py -q -s -m "gpu and mpi"
"""

import importlib
import math
import time
import zlib

import numpy as np
import pytest

import mkernel
from mkernel.ops.sequence import shard_sequence
from mkernel.testing import sync_or_exit

from tests.helpers import collective_cases
from tests.helpers.argument_errors import refused_before_launch
from tests.helpers.arrays import BF16, DTYPES, REL_TOL
from tests.helpers.arrays import attention_reference as _attention_reference
from tests.helpers.arrays import bits as _bits
from tests.helpers.arrays import compare_attention as _compare
from tests.helpers.arrays import compare_exact as _compare_exact
from tests.helpers.arrays import dev as _dev
from tests.helpers.arrays import host_result as _host_result
from tests.helpers.arrays import poison as _poison
from tests.helpers.arrays import poisoned as _poisoned
from tests.helpers.arrays import random_qkv as _random_qkv

# The module, not the function: mkernel re-exports the function under the same name.
mra = importlib.import_module("mkernel.ops.ring_attention")

HANG_S = 45.0        # past MKERNEL_TIMEOUT_S (30): a device wait times out and is reported first


def _ring():
    return mra.ring_attention


@pytest.fixture(scope="module")
def comm():
    c = collective_cases.with_driver(mkernel.init())
    yield c
    collective_cases.close(c)


# ======================================================================================== CPU
def test_args_layout_matches_host_compiler(tmp_path):
    """MkRingArgs and MkAttnPos mirrors against ring_args.cuh / attn_args.cuh (g++); alignof of the
    64-byte aligned struct is checked apart (ctypes cannot express alignas(64))."""
    from tests.helpers.c_layout import c_offsets, py_offsets

    ma = importlib.import_module("mkernel.engines.attention")
    for header, cls, align in (("ring_args.cuh", mra.MkRingArgs, 64), ("attn_args.cuh", ma.MkAttnPos, 4)):
        c = c_offsets(header, cls.__name__, [name for name, *_ in cls._fields_], tmp_path)
        py = py_offsets(cls)
        assert c.pop("alignof") == align
        py.pop("alignof")
        assert c == py, f"{cls.__name__} mirror differs from {header}"


def test_module_and_export():
    import mkernel as mk

    assert callable(mra.ring_attention)
    assert mk.ring_attention is mra.ring_attention, \
        "mkernel.ring_attention is not the function (not exported in mkernel/__init__.py?)"
    assert "ring_attention" in mk.__all__


# ================================================================================ GPU helpers
def _sync(what, timeout_s=HANG_S):
    sync_or_exit(what, timeout_s)


def _local_reference(comm, q, k, v, causal, scale):
    """This rank's rows of the reference on the whole sequence of the global host arrays q, k, v (the
    plain causal mask of the global sequence): (out [B, S_local, H_q, D], lse [B, H_q, S_local])."""
    o, lse = _attention_reference(q, k, v, causal, scale)
    return (shard_sequence(o, comm.rank, comm.size, causal=causal, axis=1),
            shard_sequence(lse, comm.rank, comm.size, causal=causal, axis=2))


def _check_local(comm, out, q, k, v, causal, scale=None, lse=None):
    """(ok, message): a device output (and lse) of this rank against the sharded global reference of
    the global host arrays q, k, v."""
    D = q.shape[-1]
    sc = scale if scale is not None else 1.0 / math.sqrt(D)
    ref_o, ref_lse = _local_reference(comm, q, k, v, causal, sc)
    return _compare(*_host_result(out, lse), ref_o, ref_lse)


def _global_inputs(seed, dt, B, S_full, Hq, Hkv, D):
    """Host (q, k, v) of the whole sequence, [B, S_full, H, D] (B None: 3-D), standard normal; the
    same on every rank (a fixed seed)."""
    return _random_qkv(seed, dt, B, S_full, S_full, Hq, Hkv, D)


def _shard(comm, causal, *xs):
    """This rank's parts (device arrays) of global host arrays (sequence axis -3)."""
    return tuple(_dev(shard_sequence(x, comm.rank, comm.size, causal=causal, axis=-3)) for x in xs)


# --------------------------------------------------------------------- the collective driver
_run_cases = collective_cases.run_cases
_report_and_decide = collective_cases.report_and_decide
_collective = collective_cases.collective


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
    launches return lse, odd ones do not (calls with out= and no lse may reuse a launch plan)."""
    import cupy

    ring = _ring()
    W = comm.size
    q, k, v = _global_inputs(31, BF16, 1, 330 * W, 8, 2, 128)
    dq, dk, dv = _shard(comm, True, q, k, v)
    out = cupy.empty(dq.shape, dtype=BF16)
    snaps, lses = [], []
    for i in range(n):
        _poison(out)
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
    """comm_sms=1 / 2 and stream= give the default's bits (out and lse)."""
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
    names = ["comm_sms=1", "comm_sms=2", "stream"]
    results = _run_cases(comm, names, lambda n: _options_body(comm, n))
    _report_and_decide(comm, "comm_sms and stream (bf16 D128 H 8/2 S_local 1000 causal) vs default bits", names,
                       results)


# ============================================================================ argument errors
def _expect_argument_errors(comm, cases):
    """(ok, message): every callable in cases raises ArgumentError, nothing is launched, and a
    valid call afterwards is right."""
    return refused_before_launch(comm, cases, lambda: _valid_ring_call(comm), HANG_S)


def _valid_ring_call(comm):
    W = comm.size
    host = _global_inputs(61, BF16, 1, 256 * W, 4, 2, 128)
    dq, dk, dv = _shard(comm, True, *host)
    out = _poisoned(dq.shape, "bf16")
    _ring()(dq, dk, dv, comm=comm, causal=True, out=out)
    _sync("valid call after the errors")
    comm.check()
    return _check_local(comm, out, *host, True)


def _local_error_cases(comm):
    """Bad arguments every rank passes alike."""
    import cupy

    ring = _ring()
    F16 = DTYPES["fp16"]

    def z(shape, dt=BF16):
        return cupy.zeros(shape, dtype=dt)

    S = 256
    q, k, v = z((1, S, 4, 128)), z((1, S, 2, 128)), z((1, S, 2, 128))

    def r(q_, k_, v_, **kw):
        kw.setdefault("comm", comm)
        return ring(q_, k_, v_, **kw)

    return {
        "float32 inputs": lambda: r(z(q.shape, np.float32), z(k.shape, np.float32), z(v.shape, np.float32)),
        "float64 inputs": lambda: r(z(q.shape, np.float64), z(k.shape, np.float64), z(v.shape, np.float64)),
        "q bf16, k/v fp16": lambda: r(q, z(k.shape, F16), z(v.shape, F16)),
        "v dtype differs": lambda: r(q, k, z(v.shape, F16)),
        "D = 96": lambda: r(z((1, S, 4, 96)), z((1, S, 2, 96)), z((1, S, 2, 96))),
        "D = 256": lambda: r(z((1, S, 4, 256)), z((1, S, 2, 256)), z((1, S, 2, 256))),
        "D = 32": lambda: r(z((1, S, 4, 32)), z((1, S, 2, 32)), z((1, S, 2, 32))),
        "q D != k D": lambda: r(q, z((1, S, 2, 64)), z((1, S, 2, 64))),
        "v D != k D": lambda: r(q, k, z((1, S, 2, 64))),
        "H_q % H_kv": lambda: r(z((1, S, 6, 128)), z((1, S, 4, 128)), z((1, S, 4, 128))),
        "H_kv > H_q": lambda: r(z((1, S, 2, 128)), z((1, S, 4, 128)), z((1, S, 4, 128))),
        "k/v H_kv differ": lambda: r(z((1, S, 8, 128)), z((1, S, 2, 128)), z((1, S, 4, 128))),
        "rank 2": lambda: r(z((S, 128)), z((S, 128)), z((S, 128))),
        "rank 5": lambda: r(z((1, 1, S, 4, 128)), z((1, 1, S, 2, 128)), z((1, 1, S, 2, 128))),
        "q 4-D, k/v 3-D": lambda: r(q, k[0], v[0]),
        "q 3-D, k/v 4-D": lambda: r(q[0], k, v),
        "batch mismatch": lambda: r(z((2, S, 4, 128)), k, v),
        "k/v batch differ": lambda: r(z((2, S, 4, 128)), z((2, S, 2, 128)), z((1, S, 2, 128))),
        "k S_local != q S_local": lambda: r(q, z((1, S + 2, 2, 128)), z((1, S + 2, 2, 128))),
        "v S_local != k S_local": lambda: r(q, k, z((1, S - 2, 2, 128))),
        "S_local = 0": lambda: r(z((1, 0, 4, 128)), z((1, 0, 2, 128)), z((1, 0, 2, 128))),
        "causal, odd S_local": lambda: r(z((1, 255, 4, 128)), z((1, 255, 2, 128)), z((1, 255, 2, 128)), causal=True),
        "causal, odd S_local, 3-D": lambda: r(z((331, 4, 64)), z((331, 4, 64)), z((331, 4, 64)), causal=True),
        "comm=None": lambda: r(q, k, v, comm=None),
        "comm is an mpi4py communicator": lambda: r(q, k, v, comm=comm.mpi),
        "q is a numpy array": lambda: r(np.zeros(q.shape, dtype=BF16), k, v),
        "out shape": lambda: r(q, k, v, out=z((1, S, 4, 64))),
        "out shape (3-D for 4-D q)": lambda: r(q, k, v, out=z((S, 4, 128))),
        "out dtype fp16": lambda: r(q, k, v, out=z(q.shape, F16)),
        "out float32": lambda: r(q, k, v, out=z(q.shape, np.float32)),
        "out numpy": lambda: r(q, k, v, out=np.zeros(q.shape, dtype=BF16)),
        "comm_sms = 0": lambda: r(q, k, v, comm_sms=0),
        "comm_sms = -1": lambda: r(q, k, v, comm_sms=-1),
        "comm_sms = 1.5": lambda: r(q, k, v, comm_sms=1.5),
    }


@collective_cases.gpu_mpi
def test_argument_errors(comm):
    _collective(comm, "argument errors (every rank alike)",
                lambda: _expect_argument_errors(comm, _local_error_cases(comm)))


def _disagreeing_cases(comm):
    """Arguments that are valid on each rank but disagree across ranks. Every shape here is used
    nowhere else in this file (no rank can have agreed on it before)."""
    import cupy

    ring = _ring()
    r_ = comm.rank
    odd = r_ % 2

    def z(shape, dt=BF16):
        return cupy.zeros(shape, dtype=dt)

    def call(B, S, Hq, Hkv, D, dt=BF16, causal=False):
        return ring(z((B, S, Hq, D), dt), z((B, S, Hkv, D), dt), z((B, S, Hkv, D), dt), comm=comm, causal=causal)

    return {
        "S_local differs": lambda: call(1, 264 + 8 * r_, 4, 2, 64),
        "S_local differs (causal)": lambda: call(1, 272 + 16 * r_, 4, 2, 64, causal=True),
        "dtype differs": lambda: call(1, 296, 4, 2, 64, dt=DTYPES["fp16"] if odd else BF16),
        "H_q differs": lambda: call(1, 312, 4 + 4 * odd, 2, 64),
        "H_kv differs": lambda: call(1, 328, 8, 2 + 2 * odd, 64),
        "D differs": lambda: call(1, 344, 4, 2, 64 + 64 * odd),
        "batch differs": lambda: call(1 + odd, 360, 4, 2, 64),
    }


@pytest.mark.multi_gpu
@collective_cases.gpu_mpi
def test_arguments_that_disagree_across_ranks_raise_on_every_rank(comm):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    names = list(_disagreeing_cases(comm))
    # One case at a time (each decided across ranks), so that a rank that did not raise is named.
    results = _run_cases(comm, names, lambda n: _expect_argument_errors(comm, {n: _disagreeing_cases(comm)[n]}))
    _report_and_decide(comm, "arguments that disagree across ranks", names, results)


# =================================================================================== world 1
WORLD1_CONFIGS = [("bf16", 128, 8, 2, 1, 330, True, None), ("fp16", 64, 4, 4, None, 200, False, None),
                  ("bf16", 64, 8, 1, 2, 256, True, None), ("fp16", 128, 4, 2, 1, 1000, False, None),
                  ("bf16", 128, 4, 4, None, 130, True, 0.3), ("fp16", 128, 8, 2, 1, 1024, True, None)]


@pytest.mark.gpu
def test_world_one_equals_attention():
    """At world 1 (a communicator over MPI.COMM_SELF) ring_attention is mkernel.attention (causal
    with the default offset 0, S_q == S_kv): the same bits of out and lse."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.size != 1:
        pytest.skip("world 1 is covered by the 1-rank pass")
    ring = _ring()
    c1 = collective_cases.with_driver(mkernel.init(MPI.COMM_SELF))
    try:
        assert c1.size == 1

        def body(name):
            dtn, D, Hq, Hkv, B, S, causal, scale = WORLD1_CONFIGS[names.index(name)]
            q, k, v = (_dev(x) for x in _global_inputs(zlib.crc32(name.encode()), DTYPES[dtn], B, S, Hq, Hkv, D))
            out = _poisoned(q.shape, dtn)
            _, lse = ring(q, k, v, comm=c1, causal=causal, softmax_scale=scale, out=out, return_lse=True)
            out2 = _poisoned(q.shape, dtn)
            res2 = ring(q, k, v, comm=c1, causal=causal, softmax_scale=scale, out=out2)
            ref, ref_lse = mkernel.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
            _sync(name)
            c1.check()
            same = bool((_bits(out) == _bits(ref)).all() and (_bits(lse) == _bits(ref_lse)).all())
            same2 = res2 is out2 and bool((_bits(out2) == _bits(ref)).all())
            return same and same2, (f"with lse: {'same bits' if same else 'DIFFER'}; "
                                    f"without: {'same bits' if same2 else 'DIFFER'}")

        names = [f"{dtn} D={D} H={Hq}/{Hkv} B={B} S={S} {'causal' if causal else 'full'} scale={scale}"
                 for dtn, D, Hq, Hkv, B, S, causal, scale in WORLD1_CONFIGS]
        results = _run_cases(c1, names, body)
        _report_and_decide(c1, "world 1 (COMM_SELF) vs mkernel.attention, bitwise", names, results)
    finally:
        collective_cases.close(c1)


def _against_engine(make_comm, world, nodes):
    """Ring attention on the communicator make_comm() returns (its root last; ``nodes`` nodes),
    against the single-GPU engine on the whole sequence, causal (zigzag) and not, three launches
    each (stale flags), and the proxy's byte counter: the ranks at a node's end send every step's
    block across the network once per launch, the others (and every rank of one node) nothing."""
    import cupy
    from mpi4py import MPI

    import mkernel

    err = None
    try:
        comm, root = make_comm()
        try:
            assert comm.num_nodes == nodes
            W, me = comm.size, comm.rank
            S, H, Hkv, D = 330, 4, 2, 128
            rng = cupy.random.default_rng(21)
            qg = rng.standard_normal((S * W, H, D), dtype=cupy.float32).astype(BF16)
            kg, vg = (rng.standard_normal((S * W, Hkv, D), dtype=cupy.float32).astype(BF16) for _ in range(2))
            for causal in (False, True):
                ref, ref_lse = mkernel.attention(qg, kg, vg, causal=causal, return_lse=True)
                want = mkernel.shard_sequence(ref, me, W, causal=causal).astype(cupy.float32)
                want_lse = mkernel.shard_sequence(ref_lse, me, W, causal=causal, axis=1)
                q, k, v = (cupy.ascontiguousarray(mkernel.shard_sequence(x, me, W, causal=causal))
                           for x in (qg, kg, vg))
                for rep in range(3):
                    out = cupy.full(q.shape, float("nan"), dtype=BF16)
                    o, lse = _ring()(q, k, v, comm=comm, causal=causal, out=out, return_lse=True)
                    cupy.cuda.get_current_stream().synchronize()
                    comm.check()
                    rel = float(cupy.linalg.norm(o.astype(cupy.float32) - want) / cupy.linalg.norm(want))
                    lerr = float(cupy.abs(lse - want_lse).max())
                    assert rel < REL_TOL and lerr < 1e-3, f"causal={causal} launch {rep}: rel {rel:.2e}, lse {lerr:.2e}"
            nxt = (me + 1) % W
            sent = sum(p["bytes_sent"] for p in comm.stats().get("peers", {}).values())
            boundary = comm.topology.node_of[nxt] != comm.node
            want_sent = 6 * (W - 1) * 2 * S * Hkv * D * 2 if boundary else 0
            assert sent == want_sent, f"proxy sent {sent} bytes, expected {want_sent}"
        finally:
            root.close()
    except Exception as e:  # noqa: BLE001  (decided collectively below)
        err = e
    ok = world.allreduce(err is None, op=MPI.LAND)
    if err is not None:
        raise err
    assert ok, "another rank failed (see its output)"


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.multi_gpu
@pytest.mark.parametrize("via_split", [False, True], ids=["root", "split"])
def test_two_emulated_nodes_through_the_proxy(via_split):
    """2 ranks as 2 nodes (gpus_per_node=1): each key/value block travels as WRITE commands through
    the communicator's proxy. "split": on a rank-reversed sub-communicator, through its root's proxy
    (ranks, offsets, flags translated)."""
    from mpi4py import MPI

    import mkernel

    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        pytest.skip("pairs exactly two ranks")

    def make():
        root = mkernel.init(world, gpus_per_node=1, workspace_bytes=(128 if via_split else 64) << 20)
        return (root.split(0, key=-root.rank, workspace_bytes=64 << 20) if via_split else root), root

    _against_engine(make, world, nodes=2)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [3, 4])
def test_more_than_two_ranks_on_one_node(request, ranks):
    """3 and 4 ranks on one node (a child mpiexec, sharing the GPU). At 2 ranks the forwarding loop
    ends after step 0; from 3 on a forwarder also writes at step 1 (a wait there for a FREE flag
    that no rank sets went unseen until session 5); 3 is the ring with no FREE flag at all, 4 the
    first whose forwarder writes a slot its next rank has read in this launch."""
    _ranks_in_child_job(request, ranks, gpus_per_node=None, nodes=1)


@pytest.mark.gpu
@pytest.mark.parametrize("nodes,per_node", [(2, 2), (3, 2), (2, 3)])
def test_several_ranks_per_node_between_nodes(request, nodes, per_node):
    """nodes x per_node ranks (a child mpiexec, sharing the GPUs): blocks move over NVLink inside a
    node and through the proxy from the last rank of one node to the first of the next."""
    _ranks_in_child_job(request, nodes * per_node, gpus_per_node=per_node, nodes=nodes)


def _ranks_in_child_job(request, ranks, gpus_per_node, nodes):
    from mpi4py import MPI

    import mkernel

    from tests.helpers.jobs import relaunch

    if relaunch(request, n=ranks):
        return
    world = MPI.COMM_WORLD
    if world.Get_size() != ranks:
        pytest.skip(f"{ranks} ranks")

    def make():
        root = mkernel.init(world, gpus_per_node=gpus_per_node, transport="host", workspace_bytes=64 << 20)
        return root, root

    _against_engine(make, world, nodes=nodes)
