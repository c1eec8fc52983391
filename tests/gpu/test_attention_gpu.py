"""GPU tests of mkernel.attention (fused multi-head / grouped-query attention, forward); the CPU tests
are tests/cpu/test_attention.py.

GPU (sm_90, CuPy): a matrix of cases (bf16 / fp16, D 64 / 128, causal or not, GQA / MQA / MHA,
ragged and unequal lengths, batch 1 and 2, 3-D inputs, custom softmax_scale, explicit
causal_offset, rows that see no key) against a float64 NumPy reference (small) or a float32 CuPy
reference (large), by relative Frobenius error of the whole output and of every (batch, head,
128-row tile), with the log-sum-exp checked too (a table of per-case errors is printed before
anything is asserted); then an exact case (bitwise-exact expected output, mismatching tiles
named), repeated launches, back-to-back launches of different shapes (a stale tile counter is the
classic bug of a persistent kernel), SM counts, strided views, streams and argument validation.
Every output starts poisoned with NaN, so an element nobody wrote fails.

Every GPU check runs in a child process (python3 -m tests.gpu.test_attention_gpu --child CASE...), so a
hang (killed after 30 s with a HANG line) or a sticky CUDA error in one check cannot take the
others down; run without -x to see every part in one go.

Run on a GPU machine: python3 -m pytest tests/gpu/test_attention_gpu.py -q -s   (-s shows the tables)
Manual, from the repository root: python3 -m tests.gpu.test_attention_gpu --child all   |   --child feature:exact
"""

import importlib
import importlib.util
import math
import zlib

import numpy as np
import pytest

from mkernel.testing import sync_or_exit

from tests.helpers import child_cases
from tests.helpers.argument_errors import argument_errors
from tests.helpers.arrays import BF16, DTYPES
from tests.helpers.arrays import attention_reference as _attention_reference
from tests.helpers.arrays import bits as _bits
from tests.helpers.arrays import compare_attention as _compare
from tests.helpers.arrays import compare_exact as _compare_exact
from tests.helpers.arrays import dev as _dev
from tests.helpers.arrays import host as _host
from tests.helpers.arrays import host_result as _host_result
from tests.helpers.arrays import kind as _kind
from tests.helpers.arrays import poison as _poison
from tests.helpers.arrays import poisoned as _poisoned
from tests.helpers.arrays import random_qkv as _random_qkv

# The module, not the function: mkernel re-exports attention() under the same name.
ma = importlib.import_module("mkernel.engines.attention")


def _module():
    return ma


# ================================================================================ GPU helpers
def _sync(what, timeout_s=30.0):
    sync_or_exit(what, timeout_s)


def _empty_rows(Sq, causal, offset):
    """Query rows that see no key: i + offset < 0."""
    return max(0, min(Sq, -offset)) if causal else 0


# ============================================================================= the case matrix
# A case: dtype:dD:hHq/Hkv:batch:sSq/Skv:mask[:scale=X][:off=N]; batch is b1 / b2 (4-D inputs) or
# 3d (3-D inputs); mask is full or causal; off is causal_offset (default: S_kv - S_q).
def matrix_cases():
    cases = []
    for dtn in ("bf16", "fp16"):
        for D in (64, 128):
            for mask in ("full", "causal"):
                cases.append(f"{dtn}:d{D}:h8/2:b1:s333/333:{mask}")   # GQA, 4-D
                cases.append(f"{dtn}:d{D}:h4/4:3d:s200/200:{mask}")   # MHA, 3-D
    cases += [
        # longer, ragged
        "bf16:d128:h8/2:b1:s1000/1000:causal", "bf16:d64:h4/4:3d:s1000/1000:full",
        "fp16:d128:h4/4:b1:s1000/1000:causal",
        # S_q < S_kv (causal aligned bottom-right)
        "bf16:d128:h8/2:b1:s130/517:full", "bf16:d128:h8/2:b1:s130/517:causal",
        "fp16:d64:h4/4:3d:s130/517:causal", "fp16:d64:h8/2:b1:s130/517:full",
        # S_q > S_kv: under causal the first S_q - S_kv rows see no key (0 and -inf)
        "bf16:d128:h8/2:b1:s517/130:causal", "fp16:d64:h4/4:3d:s517/130:causal", "bf16:d64:h4/4:b1:s517/130:full",
        # batch 2
        "bf16:d128:h8/2:b2:s333/333:causal", "fp16:d64:h4/4:b2:s200/517:full", "bf16:d64:h8/8:b2:s130/517:causal",
        # multi-query (one kv head)
        "bf16:d128:h8/1:b1:s256/256:causal",
        # tiny and tile edges
        "bf16:d128:h2/2:3d:s1/1:full", "bf16:d64:h2/1:3d:s1/300:causal", "fp16:d128:h4/2:b1:s7/1:full",
        "bf16:d128:h4/2:b1:s129/129:causal", "fp16:d64:h4/4:b1:s128/384:full", "bf16:d64:h2/2:b1:s127/255:causal",
        # custom softmax_scale (large ones make rows peaky: the running max moves between blocks)
        "bf16:d64:h4/4:3d:s333/333:full:scale=0.5", "fp16:d128:h8/2:b1:s200/200:causal:scale=0.25",
        "bf16:d64:h8/2:b1:s1000/1000:causal:scale=1.0", "fp16:d64:h4/4:b1:s256/256:full:scale=0.01",
        # explicit causal_offset: 0 = the default for S_q == S_kv (also compared bitwise with the
        # default), negative (first rows see nothing), positive, top-left alignment for S_q < S_kv,
        # every row empty, and every key visible
        "bf16:d128:h8/2:b1:s256/256:causal:off=0", "bf16:d128:h8/2:b1:s256/256:causal:off=-37",
        "fp16:d64:h4/4:3d:s256/256:causal:off=50", "bf16:d64:h4/2:b1:s130/517:causal:off=0",
        "bf16:d128:h4/4:b1:s200/200:causal:off=-300", "fp16:d128:h4/2:b1:s200/300:causal:off=1000",
    ]
    return cases


def _parse(case):
    dtn, d, h, b, s, mask, *opts = case.split(":")
    Hq, Hkv = map(int, h[1:].split("/"))
    Sq, Skv = map(int, s[1:].split("/"))
    opts = dict(o.split("=", 1) for o in opts)
    return dict(dtn=dtn, D=int(d[1:]), Hq=Hq, Hkv=Hkv, B=None if b == "3d" else int(b[1:]), Sq=Sq, Skv=Skv,
                causal=mask == "causal", scale=float(opts["scale"]) if "scale" in opts else None,
                offset=int(opts["off"]) if "off" in opts else None)


def run_case(case):
    """One matrix case; returns (ok, message). 'feature:NAME' runs feature_NAME() (asserts inside)."""
    if case.startswith("feature:"):
        globals()["feature_" + case.split(":", 1)[1]]()
        return True, "all checks passed"
    m = _module()
    c = _parse(case)
    dtn, D, Hq, Hkv, B, Sq, Skv, causal = (c[x] for x in ("dtn", "D", "Hq", "Hkv", "B", "Sq", "Skv", "causal"))
    q, k, v = _random_qkv(zlib.crc32(case.encode()), DTYPES[dtn], B, Sq, Skv, Hq, Hkv, D)
    dq, dk, dv = _dev(q), _dev(k), _dev(v)
    scale = c["scale"] if c["scale"] is not None else 1.0 / math.sqrt(D)
    offset = c["offset"] if c["offset"] is not None else Skv - Sq
    kw = dict(causal=causal, softmax_scale=c["scale"], causal_offset=c["offset"])

    out = _poisoned(q.shape, dtn)
    res = m.attention(dq, dk, dv, return_lse=True, out=out, **kw)
    if not (isinstance(res, tuple) and len(res) == 2 and res[0] is out):
        return False, f"return_lse=True returned {type(res).__name__}, not (out, lse) with the given out"
    lse = res[1]
    _sync(case)
    lse_shape = (Hq, Sq) if B is None else (B, Hq, Sq)
    if lse.dtype != np.float32 or tuple(lse.shape) != lse_shape:
        return False, f"lse is {lse.dtype} {lse.shape}, expected float32 {lse_shape}"

    ref_o, ref_lse = _attention_reference(q, k, v, causal, scale, offset)
    ok, msg = _compare(*_host_result(out, lse), ref_o, ref_lse, _empty_rows(Sq, causal, offset))

    # Without lse: the same output (checked against the reference; the bits are reported).
    out2 = _poisoned(q.shape, dtn)
    res2 = m.attention(dq, dk, dv, out=out2, **kw)
    _sync(case + " (no lse)")
    if res2 is not out2:
        return False, f"return_lse=False returned {type(res2).__name__}, not the given out; " + msg
    same = bool((_bits(out2) == _bits(out)).all())
    ok2, msg2 = _compare(*_host_result(out2), ref_o, ref_lse, _empty_rows(Sq, causal, offset))
    msg += f" nolse-bits={'same' if same else 'DIFFER'}"
    if not ok2:
        ok, msg = False, msg + f" nolse: {msg2}"

    # An explicit causal_offset equal to the default must give the default's bits.
    if causal and c["offset"] is not None and c["offset"] == Skv - Sq:
        out3 = _poisoned(q.shape, dtn)
        m.attention(dq, dk, dv, causal=True, softmax_scale=c["scale"], out=out3)
        _sync(case + " (default offset)")
        if not (_bits(out3) == _bits(out)).all():
            ok, msg = False, msg + " default-offset-bits-DIFFER"
        else:
            msg += " =default"
    return ok, msg


@pytest.mark.gpu
def test_matrix():
    cases = matrix_cases()
    results, _ = child_cases.run(__file__, cases)
    child_cases.report("attention matrix (dtype:D:Hq/Hkv:batch:Sq/Skv:mask[:options])", cases, results, 44)


# ========================================================= feature checks (run in child processes)
def _rand_dev(shape, dt, seed):
    """Standard normal device array of dtype dt (generated on the host: exact across runs)."""
    return _dev(np.random.default_rng(seed).standard_normal(shape).astype(dt))


def _check_against_reference(what, out, q, k, v, causal=False, scale=None, offset=None, lse=None):
    D, Sq, Skv = q.shape[-1], q.shape[-3], k.shape[-3]
    sc = scale if scale is not None else 1.0 / math.sqrt(D)
    off = offset if offset is not None else Skv - Sq
    ref_o, ref_lse = _attention_reference(q, k, v, causal, sc, off)
    ok, msg = _compare(*_host_result(out, lse), ref_o, ref_lse, _empty_rows(Sq, causal, off))
    print(f"{'OK ' if ok else 'BAD'} {what}: {msg}")
    return ok


def feature_exact():
    """Keys identical within each (batch, kv head): every score of a row is the same, so the softmax
    is exactly uniform (p = 1 after subtracting the max, l = S_kv). Values are small integers
    paired so that every column sums to S_kv * c with c a half-integer: the output is c exactly in
    bf16 and fp16 (the fp32 sum is exact, and any rounding of 1 / l is far below half an ulp of c).
    Queries are random. Non-causal only (with a mask the visible count varies per row)."""
    m = _module()
    configs = [("bf16", 128, 8, 2, 2, 300, 512),    # GQA, batch 2, ragged S_q
               ("fp16", 64, 4, 4, None, 1000, 256),  # 3-D
               ("bf16", 64, 8, 1, 1, 128, 384),     # MQA, S_kv not a power of two
               ("fp16", 128, 8, 2, 1, 77, 1024),
               ("bf16", 128, 4, 4, 1, 200, 320)]    # S_kv off the key-block grid: padding must be masked
    failures = []
    for i, (dtn, D, Hq, Hkv, B, Sq, Skv) in enumerate(configs):
        dt = DTYPES[dtn]
        rng = np.random.default_rng(100 + i)
        Bn = B or 1
        g = Hq // Hkv
        q = rng.standard_normal((Bn, Sq, Hq, D)).astype(dt)
        kvec = rng.standard_normal((Bn, 1, Hkv, D))
        k = np.ascontiguousarray(np.broadcast_to(kvec, (Bn, Skv, Hkv, D))).astype(dt)
        c = rng.integers(-6, 7, size=(Bn, 1, Hkv, D)) / 2.0
        v1 = rng.integers(-4, 5, size=(Bn, Skv // 2, Hkv, D)).astype(np.float64)
        v = np.concatenate([v1, 2 * c - v1], axis=1)[:, rng.permutation(Skv)].astype(dt)
        assert (v.astype(np.float64).sum(axis=1, keepdims=True) == Skv * c).all()
        expect = np.repeat(c, g, axis=2)[:, 0]  # [B, H_q, D]: query head h reads kv head h // g
        if B is None:
            q, k, v = q[0], k[0], v[0]
        out = _poisoned(q.shape, dtn)
        _, lse = m.attention(_dev(q), _dev(k), _dev(v), out=out, return_lse=True)
        _sync(f"exact {i}")
        # lse = scale * q . kvec + ln(S_kv), exactly uniform rows
        q64 = (q if B is not None else q[None]).astype(np.float64)
        kv64 = np.repeat(kvec.astype(dt).astype(np.float64), g, axis=2)[:, 0]  # [B, H_q, D]
        ref_lse = np.einsum("bshd,bhd->bhs", q64, kv64) / math.sqrt(D) + math.log(Skv)
        ok, msg, _ = _compare_exact(*_host_result(out, lse), expect, ref_lse)
        print(f"{'OK ' if ok else 'BAD'} exact {dtn} D={D} H={Hq}/{Hkv} B={B} S={Sq}/{Skv}: {msg}")
        if not ok:
            failures.append((dtn, D, Hq, Hkv, B, Sq, Skv))
    assert not failures, failures


def feature_repeat():
    """Ten launches in a row on the same buffers (the output poisoned before each, a copy of its bits
    taken after, nothing synchronised in between): every result identical bitwise, and right. The
    first five return lse; the last five do not (calls with out= and no lse may reuse a cached
    launch plan)."""
    import cupy

    m = _module()
    B, Sq, Skv, Hq, Hkv, D = 1, 1000, 1000, 8, 2, 128
    q, k, v = (_rand_dev((B, S, H, D), BF16, seed) for (S, H, seed) in ((Sq, Hq, 1), (Skv, Hkv, 2), (Skv, Hkv, 3)))
    out = cupy.empty(q.shape, dtype=BF16)
    snaps, lses = [], []
    for i in range(10):
        _poison(out)
        if i < 5:
            res = m.attention(q, k, v, causal=True, out=out, return_lse=True)
            lses.append(res[1])
        else:
            res = m.attention(q, k, v, causal=True, out=out)
        snaps.append(out.view(cupy.uint16).copy())
    _sync("10 repeated launches")
    assert res is out
    assert _check_against_reference("repeat, launch 10", out, q, k, v, causal=True)
    assert _check_against_reference("repeat, launch 5 (lse)", snaps[4].view(BF16), q, k, v, causal=True, lse=lses[-1])
    first, first_lse = cupy.asnumpy(snaps[0]), _bits(lses[0])
    differ = [i for i in range(10) if not (cupy.asnumpy(snaps[i]) == first).all()]
    differ += [f"lse {i}" for i in range(5) if not (_bits(lses[i]) == first_lse).all()]
    print(f"repeat: launches differing from the first: {differ}")
    assert not differ, f"launches {differ} differ from the first"


def _b2b_configs():
    # (name, dtype, D, H_q, H_kv, B (None: 3-D), S_q, S_kv, causal, sms): tile counts 64, 8, 2, 192, 64, 16
    return [("A", "bf16", 128, 8, 2, 1, 1000, 1000, True, None),
            ("B", "fp16", 64, 4, 4, None, 200, 200, False, None),
            ("C", "bf16", 64, 2, 1, None, 1, 300, True, None),
            ("D", "bf16", 128, 16, 16, 2, 700, 700, False, None),  # more tiles than SMs
            ("E", "bf16", 128, 8, 2, 1, 1000, 1000, True, None),   # A again, other buffers
            ("F", "fp16", 128, 8, 2, 1, 130, 517, True, 7)]


def feature_back_to_back():
    """Different shapes (and a GEMM) launched back to back without synchronising: each result must
    equal bitwise the one the same call gave alone (a tile counter left stale by one launch skips or
    repeats tiles of the next)."""
    m = _module()
    mg = importlib.import_module("mkernel.engines.gemm")
    runs = []
    for i, (name, dtn, D, Hq, Hkv, B, Sq, Skv, causal, sms) in enumerate(_b2b_configs()):
        lead = () if B is None else (B,)
        dt = DTYPES[dtn]
        q = _rand_dev(lead + (Sq, Hq, D), dt, 10 * i + 1)
        k = _rand_dev(lead + (Skv, Hkv, D), dt, 10 * i + 2)
        v = _rand_dev(lead + (Skv, Hkv, D), dt, 10 * i + 3)
        runs.append((name, q, k, v, dict(causal=causal, sms=sms)))
    ga = _dev(np.random.default_rng(7).integers(-3, 4, size=(520, 264)).astype(BF16))
    gb = _dev(np.random.default_rng(8).integers(-3, 4, size=(264, 776)).astype(BF16))

    def launch_all(order, with_lse=True):
        """Queues the named launches (no synchronisation); [(name, out, lse)] (lse None for the GEMM
        and without with_lse)."""
        outs = []
        for name in order:
            if name == "gemm":
                c = _poisoned((520, 776), "f32")
                mg.gemm(ga, gb, out=c)
                outs.append((name, c, None))
                continue
            _, q, k, v, kw = next(r for r in runs if r[0] == name)
            o = _poisoned(q.shape, _kind(q.dtype))
            if with_lse:
                outs.append((name, o, m.attention(q, k, v, out=o, return_lse=True, **kw)[1]))
            else:
                outs.append((name, m.attention(q, k, v, out=o, **kw), None))
        return outs

    # Alone, each synchronised and checked against the reference.
    solo, ok = {}, True
    for name, q, k, v, kw in runs:
        solo[name] = launch_all([name])[0][1:]
        _sync(f"solo {name}")
        ok &= _check_against_reference(f"solo {name} {tuple(q.shape)} kv {tuple(k.shape)} {kw}", solo[name][0],
                                       q, k, v, causal=kw["causal"], lse=solo[name][1])
    solo["gemm"] = launch_all(["gemm"])[0][1:]
    _sync("solo gemm")
    exact = _host(ga).astype(np.float64) @ _host(gb).astype(np.float64)
    ok &= bool((_host(solo["gemm"][0]) == exact).all())  # small integers: exact in float32
    assert ok, "a solo run is wrong (see above)"
    names = [r[0] for r in runs]
    failures = []
    for label, order, with_lse in (("forward", names[:3] + ["gemm"] + names[3:], True),
                                   ("reverse", ["gemm"] + names[::-1], True),
                                   ("no lse, twice", names + ["gemm"] + names, False)):
        outs = launch_all(order, with_lse)
        _sync(f"back to back {label}")
        for pos, (name, o, lse) in enumerate(outs):
            so, slse = solo[name]
            same = (_bits(o) == _bits(so)).all() and (lse is None or (_bits(lse) == _bits(slse)).all())
            if not same:
                failures.append((label, pos, name))
        print(f"back to back {label} {order}: {'OK' if not any(f[0] == label for f in failures) else 'BAD'}")
    assert not failures, f"differ from the solo run: {failures}"


def feature_sms_strides_stream():
    """sms= gives the default's bits; strided views of inputs and output give the contiguous bits;
    stream= gives the same bits on another stream."""
    import cupy

    m = _module()
    nsm = cupy.cuda.Device().attributes["MultiProcessorCount"]
    failures = []

    # --- SM counts: 2 * 8 * 8 = 128 tiles
    B, S, Hq, Hkv, D = 2, 1000, 8, 2, 128
    qs, ks, vs = (_rand_dev((B, S, H, D), BF16, seed) for H, seed in ((Hq, 21), (Hkv, 22), (Hkv, 23)))
    base = _poisoned(qs.shape, "bf16")
    _, base_lse = m.attention(qs, ks, vs, causal=True, out=base, return_lse=True)
    _sync("sms default")
    if not _check_against_reference("sms default", base, qs, ks, vs, causal=True, lse=base_lse):
        failures.append("default run")
    for sms in (1, 7, 66, nsm - 1, nsm):
        out = _poisoned(qs.shape, "bf16")
        _, lse = m.attention(qs, ks, vs, causal=True, out=out, return_lse=True, sms=sms)
        _sync(f"sms={sms}")
        same = (_bits(out) == _bits(base)).all() and (_bits(lse) == _bits(base_lse)).all()
        print(f"sms={sms}: {'same bits' if same else 'DIFFER'}")
        if not same:
            failures.append(f"sms={sms}")

    def same_as_contiguous(what, qv, kv, vv, out_buf=None, out_index=None, **kw):
        """The strided views qv, kv, vv (and out_buf[out_index] as out, if given) give the bits of
        their contiguous copies; nothing of out_buf outside the view is written."""
        ref = _poisoned(qv.shape, _kind(qv.dtype))
        _, ref_lse = m.attention(cupy.ascontiguousarray(qv), cupy.ascontiguousarray(kv), cupy.ascontiguousarray(vv),
                                 out=ref, return_lse=True, **kw)
        out_view = _poisoned(qv.shape, _kind(qv.dtype)) if out_buf is None else out_buf[out_index]
        before = None if out_buf is None else _bits(out_buf)
        res = m.attention(qv, kv, vv, out=out_view, return_lse=True, **kw)
        _sync(what)
        ok = res[0] is out_view and (_bits(out_view) == _bits(ref)).all() and (_bits(res[1]) == _bits(ref_lse)).all()
        ok = ok and _check_against_reference(f"{what} (contiguous copy)", ref, qv, kv, vv,
                                             causal=kw.get("causal", False), lse=ref_lse)
        if out_buf is not None:  # what lies around the output view must be untouched
            after = _bits(out_buf)
            mask = np.ones(out_buf.shape, dtype=bool)
            mask[out_index] = False
            if not (after[mask] == before[mask]).all():
                print(f"BAD {what}: wrote outside the output view")
                ok = False
        print(f"{what}: {'same bits as contiguous' if ok else 'DIFFER'}")
        if not ok:
            failures.append(what)

    # --- packed [B, S, 3, H, D] (MHA): q, k, v strided views
    B, S, H, D = 2, 333, 4, 128
    packed = _rand_dev((B, S, 3, H, D), BF16, 31)
    same_as_contiguous("packed [B,S,3,H,D]", packed[:, :, 0], packed[:, :, 1], packed[:, :, 2], causal=True)
    p3 = _rand_dev((517, 3, 4, 64), DTYPES["fp16"], 32)
    same_as_contiguous("packed [S,3,H,D] 3-D fp16", p3[:, 0], p3[:, 1], p3[:, 2])
    # --- packed along heads [S, H_q + 2 H_kv, D] (GQA), 3-D
    Hq, Hkv = 8, 2
    ph = _rand_dev((300, Hq + 2 * Hkv, 128), BF16, 33)
    same_as_contiguous("packed heads [S,Hq+2Hkv,D]", ph[:, :Hq], ph[:, Hq:Hq + Hkv], ph[:, Hq + Hkv:], causal=True)
    # --- rows padded past D (head stride 192 elements), batch stride doubled
    big = _rand_dev((4, 256, 4, 192), BF16, 34)
    kb, vb = _rand_dev((2, 400, 2, 128), BF16, 35), _rand_dev((2, 400, 2, 128), BF16, 36)
    same_as_contiguous("q padded rows + every other batch", big[::2, :, :, :128], kb, vb, causal=True)
    # --- a strided output: the upper half of the heads of a [B, S, 2H, D] buffer
    q2, k2, v2 = (_rand_dev((2, 200, 4, 64), BF16, 37), _rand_dev((2, 300, 4, 64), BF16, 38),
                  _rand_dev((2, 300, 4, 64), BF16, 39))
    buf = _poisoned((2, 200, 8, 64), "bf16")
    same_as_contiguous("strided out [B,S,2H,D][:,:,H:]", q2, k2, v2, out_buf=buf,
                       out_index=(slice(None), slice(None), slice(4, 8)), causal=True)

    # --- another stream
    s = cupy.cuda.Stream(non_blocking=True)
    out = _poisoned(qs.shape, "bf16")
    cupy.cuda.get_current_stream().synchronize()  # the poison is written before the other stream reads
    _, lse = m.attention(qs, ks, vs, causal=True, out=out, return_lse=True, stream=s)
    sync_or_exit("stream=", 30.0, stream=s)
    same = (_bits(out) == _bits(base)).all() and (_bits(lse) == _bits(base_lse)).all()
    print(f"stream=: {'same bits' if same else 'DIFFER'}")
    if not same:
        failures.append("stream=")
    assert not failures, failures


def feature_argument_errors():
    import cupy

    m = _module()
    nsm = cupy.cuda.Device().attributes["MultiProcessorCount"]
    F16 = DTYPES["fp16"]

    def z(shape, dt=BF16):
        return cupy.zeros(shape, dtype=dt)

    q, k, v = z((1, 256, 4, 128)), z((1, 256, 2, 128)), z((1, 256, 2, 128))
    flat = z(1 * 256 * 4 * 128 + 8)
    strided = cupy.lib.stride_tricks.as_strided
    bad = {
        "float32 inputs": lambda: m.attention(z(q.shape, np.float32), z(k.shape, np.float32), z(v.shape, np.float32)),
        "q bf16, k/v fp16": lambda: m.attention(q, z(k.shape, F16), z(v.shape, F16)),
        "v dtype differs": lambda: m.attention(q, k, z(v.shape, F16)),
        "D = 96": lambda: m.attention(z((1, 256, 4, 96)), z((1, 256, 2, 96)), z((1, 256, 2, 96))),
        "D = 256": lambda: m.attention(z((1, 256, 4, 256)), z((1, 256, 2, 256)), z((1, 256, 2, 256))),
        "D = 32": lambda: m.attention(z((1, 256, 4, 32)), z((1, 256, 2, 32)), z((1, 256, 2, 32))),
        "q D != k D": lambda: m.attention(q, z((1, 256, 2, 64)), z((1, 256, 2, 64))),
        "v D != k D": lambda: m.attention(q, k, z((1, 256, 2, 64))),
        "H_q % H_kv": lambda: m.attention(z((1, 256, 6, 128)), z((1, 256, 4, 128)), z((1, 256, 4, 128))),
        "H_kv > H_q": lambda: m.attention(z((1, 256, 2, 128)), z((1, 256, 4, 128)), z((1, 256, 4, 128))),
        "rank 2": lambda: m.attention(z((256, 128)), z((256, 128)), z((256, 128))),
        "rank 5": lambda: m.attention(z((1, 1, 256, 4, 128)), z((1, 1, 256, 2, 128)), z((1, 1, 256, 2, 128))),
        "q 4-D, k/v 3-D": lambda: m.attention(q, k[0], v[0]),
        "q 3-D, k/v 4-D": lambda: m.attention(q[0], k, v),
        "batch mismatch": lambda: m.attention(z((2, 256, 4, 128)), k, v),
        "k/v S_kv differ": lambda: m.attention(q, k, z((1, 255, 2, 128))),
        "k/v H_kv differ": lambda: m.attention(z((1, 256, 8, 128)), z((1, 256, 2, 128)), z((1, 256, 4, 128))),
        "k/v batch differ": lambda: m.attention(z((2, 256, 4, 128)), z((2, 256, 2, 128)), z((1, 256, 2, 128))),
        "S_kv = 0": lambda: m.attention(q, z((1, 0, 2, 128)), z((1, 0, 2, 128))),
        "S_q = 0": lambda: m.attention(z((1, 0, 4, 128)), k, v),
        "S_kv = 0, 3-D": lambda: m.attention(q[0], z((0, 2, 128)), z((0, 2, 128))),
        "last dim strided": lambda: m.attention(z((1, 256, 4, 256))[..., ::2], k, v),
        "k last dim strided": lambda: m.attention(q, z((1, 256, 2, 256))[..., ::2], v),
        "head stride % 16 B": lambda: m.attention(z((1, 256, 4, 132))[..., :128], k, v),
        "seq stride % 16 B": lambda: m.attention(strided(z((1, 256, 516)), shape=(1, 256, 4, 128),
                                                         strides=(256 * 516 * 2, 516 * 2, 256, 2)), k, v),
        "misaligned base": lambda: m.attention(flat[1:1 + q.size].reshape(q.shape), k, v),
        "misaligned v base": lambda: m.attention(q, k, z(v.size + 8)[1:1 + v.size].reshape(v.shape)),
        "negative seq stride": lambda: m.attention(q[:, ::-1], k, v),
        "q is a numpy array": lambda: m.attention(np.zeros((1, 256, 4, 128), dtype=BF16), k, v),
        "out shape": lambda: m.attention(q, k, v, out=z((1, 256, 4, 64))),
        "out shape (3-D for 4-D q)": lambda: m.attention(q, k, v, out=z((256, 4, 128))),
        "out dtype fp16": lambda: m.attention(q, k, v, out=z(q.shape, F16)),
        "out float32": lambda: m.attention(q, k, v, out=z(q.shape, np.float32)),
        "out last dim strided": lambda: m.attention(q, k, v, out=z((1, 256, 4, 256))[..., ::2]),
        "out misaligned": lambda: m.attention(q, k, v, out=z(q.size + 8)[1:1 + q.size].reshape(q.shape)),
        "out numpy": lambda: m.attention(q, k, v, out=np.zeros(q.shape, dtype=BF16)),
        "sms = 0": lambda: m.attention(q, k, v, sms=0),
        f"sms = {nsm + 1}": lambda: m.attention(q, k, v, sms=nsm + 1),
    }
    missed, wrong = argument_errors(bad)
    _sync("argument errors")
    # Nothing was left broken: a valid call still works.
    out = _poisoned(q.shape, "bf16")
    qq, kk, vv = _rand_dev(q.shape, BF16, 41), _rand_dev(k.shape, BF16, 42), _rand_dev(v.shape, BF16, 43)
    m.attention(qq, kk, vv, out=out)
    _sync("valid call after the errors")
    valid_ok = _check_against_reference("valid call after the errors", out, qq, kk, vv)
    print(f"missed (no error): {missed}")
    print(f"wrong exception type: {wrong}")
    assert not missed and not wrong and valid_ok, f"no ArgumentError for: {missed}; other exceptions: {wrong}"


@pytest.mark.gpu
def test_exact():
    child_cases.feature(__file__, "exact")


@pytest.mark.gpu
def test_repeated_launches():
    child_cases.feature(__file__, "repeat")


@pytest.mark.gpu
def test_back_to_back_shapes():
    child_cases.feature(__file__, "back_to_back")


@pytest.mark.gpu
def test_sms_strides_and_streams():
    child_cases.feature(__file__, "sms_strides_stream")


@pytest.mark.gpu
def test_argument_errors():
    child_cases.feature(__file__, "argument_errors")


if __name__ == "__main__":
    child_cases.main(run_case, matrix_cases, __doc__)
