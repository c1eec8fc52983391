"""GPU tests of mkernel.gemm / mkernel.grouped_gemm (sm_90, CuPy); the CPU tests are tests/cpu/test_gemm.py.

A smoke matrix of every kernel variant (a table of per-case errors is printed before anything is
asserted), then flags / epochs, tile order, role words, SM counts, accumulation, grouped mode and
argument validation.

Every GPU check runs in a child process (python3 -m tests.gpu.test_gemm_gpu --child CASE...), so a hang
(killed after 30 s with a HANG line) or a sticky CUDA error in one check cannot take the others
down; run without -x to see every part in one go.

Run on a GPU machine: python3 -m pytest tests/gpu/test_gemm_gpu.py -q -s   (-s shows the tables)
Manual, from the repository root: python3 -m tests.gpu.test_gemm_gpu --child all   |   --child feature:grouped
"""

import importlib
import zlib

import numpy as np
import pytest

from mkernel.testing import sync_or_exit

from tests.helpers import child_cases
from tests.helpers.argument_errors import argument_errors
from tests.helpers.arrays import BF16, DTYPES
from tests.helpers.arrays import dev as _dev
from tests.helpers.arrays import host as _host
from tests.helpers.arrays import poisoned as _poisoned

# The module, not the function: mkernel re-exports gemm() under the same name.
mg = importlib.import_module("mkernel.engines.gemm")
plan = importlib.import_module("mkernel.engines.gemm_plan")


# ================================================================================ GPU helpers
def _sync(what, timeout_s=30.0):
    sync_or_exit(what, timeout_s)


def _inputs(rng, M, N, K, dt, integer):
    if integer:
        a = rng.integers(-3, 4, size=(M, K)).astype(np.float64)
        b = rng.integers(-3, 4, size=(K, N)).astype(np.float64)
    else:
        a = rng.standard_normal((M, K))
        b = rng.standard_normal((K, N))
    a_q, b_q = a.astype(dt), b.astype(dt)
    return a_q, b_q, a_q.astype(np.float64) @ b_q.astype(np.float64)


def _errors(c, ref):
    c = c.astype(np.float64)
    if not np.isfinite(c).all():
        return float("inf"), float("inf"), int((~np.isfinite(c)).sum())
    nref = np.linalg.norm(ref) or 1.0
    mref = np.abs(ref).max() or 1.0
    return float(np.linalg.norm(c - ref) / nref), float(np.abs(c - ref).max() / mref), 0


# ================================================================================ smoke matrix
SMOKE_SHAPES = [(128, 256, 64), (256, 512, 256), (129, 264, 72), (1, 8, 8), (300, 776, 1032), (1000, 1000, 1000)]


def smoke_cases():
    """dtype:B layout:out:data:M,N,K:kernel, every case with the clustered kernel ('cl', which at
    one M-tile computes an all-padding second tile), without ('one') and in narrow tiles ('narrow')."""
    cases = []
    for dt in ("bf16", "fp16"):
        for lay in ("nk", "kn", "wT"):
            for (M, N, K) in SMOKE_SHAPES:
                cases.append(f"{dt}:{lay}:same:rand:{M},{N},{K}")
            cases.append(f"{dt}:{lay}:same:int:300,776,1032")
            cases.append(f"{dt}:{lay}:f32:int:300,776,1032")
            cases.append(f"{dt}:{lay}:f32:rand:129,264,72")
    cases += ["bf16:kn:same:rand:2048,2048,2048", "bf16:nk:same:rand:2048,2048,2048"]
    return [f"{c}:{k}" for c in cases for k in ("cl", "one", "narrow")]


def run_case(case):
    """One smoke case; returns (ok, message). 'feature:NAME' runs feature_NAME() (asserts inside)."""
    if case.startswith("feature:"):
        globals()["feature_" + case.split(":", 1)[1]]()
        return True, "all checks passed"
    dtn, lay, outk, data, shape, kernel = case.split(":")
    M, N, K = map(int, shape.split(","))
    dt = DTYPES[dtn]
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    a, b, ref = _inputs(rng, M, N, K, dt, data == "int")
    da = _dev(a)
    if lay == "kn":
        db, kw = _dev(np.ascontiguousarray(b)), {}
    elif lay == "nk":
        db, kw = _dev(np.ascontiguousarray(b.T)), {"b_layout": "nk"}
    else:  # the transposed view of a row-major [N, K]: inferred as the weights layout
        db, kw = _dev(np.ascontiguousarray(b.T)).T, {}
    kind = dtn if outk == "same" else "f32"
    out = _poisoned((M, N), kind)
    from mkernel import config

    with config.override(gemm_tile_n=192 if kernel == "narrow" else 256):  # the default picks by shape
        mg.gemm(da, db, out=out, cluster=kernel == "cl", **kw)
    _sync(case)
    c = _host(out)
    rel, mx, nonfinite = _errors(c, ref)
    if data == "int":
        expect = ref.astype(c.dtype).astype(np.float64)  # round to nearest even, like cvt.rn
        bad = int((c.astype(np.float64) != expect).sum())
        return bad == 0, f"exact-mismatches={bad} rel={rel:.2e} max={mx:.2e} nonfinite={nonfinite}"
    return rel < 1e-2 and mx < 3e-2, f"rel={rel:.2e} max={mx:.2e} nonfinite={nonfinite}"


@pytest.mark.gpu
@pytest.mark.slow
def test_smoke_matrix():
    cases = smoke_cases()
    results, _ = child_cases.run(__file__, cases)
    child_cases.report("gemm smoke matrix (dtype:B layout:out:data:M,N,K:kernel)", cases, results, 44)


# ========================================================= feature checks (run in child processes)
def _simple(M, N, K, dt=BF16, integer=True, seed=0):
    rng = np.random.default_rng(seed)
    a, b, ref = _inputs(rng, M, N, K, dt, integer)
    return _dev(a), _dev(np.ascontiguousarray(b)), ref


def _accumulate_exact(M, N, K, seed, what, **kw):
    """``out += a @ b`` into fp32 integers: exact (the sum is added once)."""
    a, b, ref = _simple(M, N, K, seed=seed)
    c0 = np.random.default_rng(seed + 1).integers(-50, 50, size=(M, N)).astype(np.float32)
    out = _dev(c0)
    mg.gemm(a, b, out=out, accumulate=True, **kw)
    _sync(what)
    assert (_host(out) == c0 + ref).all(), what
    return a, b, ref, c0


def feature_flags():
    import cupy

    for M, cluster in ((1000, False), (1000, True), (1100, True)):  # 1100: 9 M-tiles, a padding part
        N, K = 1288, 256
        T = plan.tiles(M, N)
        a, b, ref = _simple(M, N, K)
        flags = cupy.full(T + 5, 0xDEADBEEF, dtype=cupy.uint32)
        counts = cupy.zeros(T + 5, dtype=cupy.uint32)
        ws = mg.workspace()
        e0 = ws.epoch()
        out = _poisoned((M, N), "f32")
        mg.gemm(a, b, out=out, tile_flags=flags, tile_counts=counts, cluster=cluster)
        _sync("flags launch 1")
        f, n = cupy.asnumpy(flags), cupy.asnumpy(counts)
        print(f"M {M} cluster {cluster}: epoch {e0} -> {ws.epoch()}, flags {np.unique(f[:T])}, "
              f"counts {np.unique(n[:T])}")
        assert ws.epoch() == e0 + 1
        assert (f[:T] == e0 + 1).all() and (n[:T] == 1).all()
        assert (f[T:] == 0xDEADBEEF).all() and (n[T:] == 0).all()
        assert (_host(out) == ref).all()
        plain = _poisoned((M, N), "f32")
        for i in range(2, 21):  # repeated launches: nothing stale in the counters or the epochs
            out.fill(np.nan)
            if i % 2:  # a call without flags between: reads and advances no epoch (first tiles by CTA index)
                mg.gemm(a, b, out=plain, cluster=cluster)
            mg.gemm(a, b, out=out, tile_flags=flags, tile_counts=counts, cluster=cluster)
            _sync(f"flags launch {i}")
            assert ws.epoch() == e0 + i
            assert (cupy.asnumpy(flags)[:T] == e0 + i).all() and (cupy.asnumpy(counts)[:T] == i).all()
            assert (_host(out) == ref).all(), f"launch {i}"
        assert (_host(plain) == ref).all(), "the calls without flags"


def feature_order_roles_sms():
    import cupy

    M, N, K = 1100, 1032, 320
    T = plan.tiles(M, N)
    a, b, ref = _simple(M, N, K, seed=1)
    rng = np.random.default_rng(5)
    nsm = mg._num_sms()
    runs = {
        "reverse order": dict(tile_order=cupy.asarray(np.arange(T)[::-1].astype(np.uint32))),
        "random order": dict(tile_order=cupy.asarray(rng.permutation(T).astype(np.uint32))),
        "sms=1": dict(sms=1),
        "sms=3": dict(sms=3),
        "sms=66": dict(sms=66),
        "roles alternate": dict(roles=cupy.asarray((np.arange(nsm) % 2).astype(np.uint32))),
        "roles one CTA": dict(roles=cupy.asarray((np.arange(nsm) == 7).astype(np.uint32))),
        "group_m=1": dict(group_m=1),
        "group_m=3": dict(group_m=3),
        "order n, 2": dict(order="n", group_m=2),  # blocks of N-tiles; 1032 / 256: a ragged last block
        "order n, 3": dict(order="n", group_m=3),
        "order n, 8": dict(order="n", group_m=8),
        # The clustered kernel (1100 rows: 9 M-tiles, so the last unit has a padding part).
        "cl sms=2": dict(cluster=True, sms=2),
        "cl sms=6": dict(cluster=True, sms=6),
        "cl sms=66": dict(cluster=True, sms=66),
        "cl all SMs": dict(cluster=True, sms=nsm // 2 * 2),
        "cl group_m=1": dict(cluster=True, group_m=1),
        "cl group_m=6": dict(cluster=True, group_m=6),
        "cl order n, 3": dict(cluster=True, order="n", group_m=3),
        "one, auto off": dict(cluster=False),
    }
    failures = []
    for name, kw in runs.items():
        flags = cupy.zeros(T, dtype=cupy.uint32)
        counts = cupy.zeros(T, dtype=cupy.uint32)
        e0 = mg.workspace().epoch()
        out = _poisoned((M, N), "f32")
        mg.gemm(a, b, out=out, tile_flags=flags, tile_counts=counts, **kw)
        _sync(name)
        mg.check()
        c = _host(out)
        ok_data = bool((c == ref).all())
        ok_flags = bool((cupy.asnumpy(flags) == e0 + 1).all() and (cupy.asnumpy(counts) == 1).all())
        print(f"{name:16s} data {'OK' if ok_data else 'BAD'} flags {'OK' if ok_flags else 'BAD'}")
        if not (ok_data and ok_flags):
            failures.append(name)
    assert not failures, failures


def feature_accumulate():
    M, N, K = 257, 520, 136
    a, b, ref, c0 = _accumulate_exact(M, N, K, 2, "accumulate f32")
    _accumulate_exact(M, N, K, 2, "accumulate f32, other kernel", cluster=not plan.use_cluster(M, N, K))
    c0b = c0.astype(BF16)
    outb = _dev(c0b)
    mg.gemm(a, b, out=outb, accumulate=True)
    _sync("accumulate bf16")
    rel, mx, _ = _errors(_host(outb), c0b.astype(np.float64) + ref)
    print(f"accumulate bf16: rel {rel:.2e} max {mx:.2e}")
    assert rel < 1e-2


def feature_split_k():
    """Split K (config.gemm_split_k; few tiles, long K), unclustered and in CTA pairs sharing B
    (ranges of units of 2 M-tiles, a phantom part past M at one M-tile): integer inputs exact
    against float64 for every layout and output type, off-grid shapes, accumulate; random inputs
    within 1e-2; the same bits over three launches (the arrival counts reset), each followed by a
    one-row call sharing the stream's buffers, and in both kernels."""
    from mkernel import config

    cases = [(128, 4096, 14336, "kn", None), (200, 1032, 4104, "nk", None), (1, 256, 65536, "kn", None),
             (256, 2048, 2056, "kn", np.float32), (130, 520, 8200, "nk", np.float32),
             (256, 4096, 14336, "nk", None),  # 2 M-tiles, long K: split pairs by default
             (64, 4096, 8192, "nk", None)]  # 64 tokens: one warpgroup's rows move no partial
    with config.override(gemm_split_k=True, gemm_decode_max_m=0, gemm_tile_n=256):  # narrow: feature_narrow_tiles
        for M, N, K, lay, out_dt in cases:
            assert plan.split_k(M, N, K) > 1 and plan.split_k(M, N, K, cluster=True) > 1, (M, N, K)
            for integer in (True, False):
                a, b, ref = _simple(M, N, K, integer=integer, seed=M + K)
                bb = b if lay == "kn" else _dev(np.ascontiguousarray(_host(b).T))
                outs = []
                for cluster in (False, False, False, True, True):
                    out = _poisoned((M, N), "f32" if out_dt else "bf16")
                    mg.gemm(a, bb, out=out, b_layout=lay, cluster=cluster)
                    mg.gemm(a[:1], bb, out=_poisoned((1, N), "f32" if out_dt else "bf16"), b_layout=lay)
                    _sync(f"split K {M}x{N}x{K} {lay}")
                    outs.append(_host(out).astype(np.float64))
                what = f"{M}x{N}x{K} {lay} {out_dt or 'bf16'} {'integer' if integer else 'random'}"
                assert all(np.array_equal(outs[0], o, equal_nan=True) for o in outs[1:3]), f"{what}: not reproducible"
                assert np.array_equal(outs[3], outs[4], equal_nan=True), f"{what}: clustered, not reproducible"
                for o, kind in ((outs[0], "one CTA a tile"), (outs[3], "clustered")):
                    if integer and (out_dt or np.abs(ref).max() <= 256):
                        assert np.array_equal(o, ref), f"{what} {kind}: {int((o != ref).sum())} elements wrong"
                    rel, _, bad = _errors(o, ref)
                    assert bad == 0 and rel < 1e-2, f"{what} {kind}: relative error {rel:.3g}, {bad} not finite"
        _accumulate_exact(128, 1032, 8200, 4, "split K accumulate")  # the ranges' sum is added once
    print("split K: exact, reproducible, accumulate once")


def _ran_width(a, b, out, **kw):
    """The tile width of the plan a plain ``gemm(a, b, out=out, **kw)`` call kept (its N-tiles)."""
    tiles_n = mg.kept_plan(a, b, out, **kw)[0][3].sched.tiles_n
    widths = [w for w in (plan.BN, plan.BN_NARROW) if -(-out.shape[1] // w) == tiles_n]
    return widths[0] if len(widths) == 1 else None  # None: N does not tell the widths apart


def feature_narrow_tiles():
    """The narrow tiles (config.gemm_tile_n=192: 128 x 192, plain mode, unclustered): every input
    type, B layout and output type at shapes off the grid (a last tile 8 columns wide, N under one
    tile), integer inputs exact and random within 1e-2; accumulate; split K in narrow tiles exact
    over three launches; 20 launches alternating widths, shapes and split K on one stream (no stale
    counts). Each call's kept plan is checked to have run the width asked for. Which shapes "auto"
    gives them: tests/cpu/test_gemm.py."""
    from mkernel import config

    with config.override(gemm_tile_n=192, gemm_decode_max_m=0):
        for dtn in ("bf16", "fp16"):
            for lay in ("kn", "nk"):
                for M, N, K in ((300, 776, 1032), (129, 136, 72), (1000, 3000, 2000)):
                    for out_f32, integer in ((False, True), (True, True), (False, False)):
                        rng = np.random.default_rng(M + N + K + 7 * out_f32)
                        a, b, ref = _inputs(rng, M, N, K, DTYPES[dtn], integer)
                        bb = _dev(np.ascontiguousarray(b if lay == "kn" else b.T))
                        out = _poisoned((M, N), "f32" if out_f32 else dtn)
                        da = _dev(a)
                        mg.gemm(da, bb, out=out, b_layout=lay)
                        what = f"narrow {dtn} {lay} {M}x{N}x{K} {'f32' if out_f32 else dtn} " \
                               f"{'integer' if integer else 'random'}"
                        _sync(what)
                        assert N <= plan.BN_NARROW or _ran_width(da, bb, out, b_layout=lay) == plan.BN_NARROW, what
                        c = _host(out).astype(np.float64)
                        if integer:
                            want = ref.astype(np.float32 if out_f32 else DTYPES[dtn]).astype(np.float64)
                            assert np.array_equal(c, want), f"{what}: {int((c != want).sum())} elements wrong"
                        rel, _, bad = _errors(c, ref)
                        assert bad == 0 and rel < 1e-2, f"{what}: relative error {rel:.3g}, {bad} not finite"
        _accumulate_exact(257, 520, 136, 12, "narrow accumulate")
        M, N, K = 256, 2056, 4104  # split K in narrow tiles
        assert plan.split_k(M, N, K, bn=plan.BN_NARROW) > 1
        a, b, ref = _simple(M, N, K, seed=14)
        outs = []
        for _ in range(3):
            out = _poisoned((M, N), "f32")
            mg.gemm(a, b, out=out)
            _sync("narrow split K")
            assert _ran_width(a, b, out) == plan.BN_NARROW and mg.kept_plan(a, b, out)[0][3].splits > 1
            outs.append(_host(out))
        assert all(np.array_equal(o, ref) for o in outs), "narrow split K: not exact"
    shapes = [(256, 2056, 4104), (1000, 3000, 2000), (128, 1032, 8200), (300, 776, 1032)]
    inputs = {s: _simple(*s, seed=sum(s)) for s in shapes}
    for i in range(20):  # widths, shapes and split K alternating on one stream's buffers
        shape = shapes[i % len(shapes)]
        a, b, ref = inputs[shape]
        out = _poisoned(shape[:2], "f32")
        width = (plan.BN_NARROW, plan.BN)[(i // 4) % 2]
        with config.override(gemm_tile_n=width, gemm_decode_max_m=0):
            mg.gemm(a, b, out=out)
            assert _ran_width(a, b, out) == width, f"alternating launch {i}: not {width}-wide tiles"
        _sync(f"alternating launch {i}")
        assert np.array_equal(_host(out), ref), f"alternating launch {i} {shape}"
    print("narrow tiles: exact, within 1e-2, accumulate once, split K reproducible, alternating launches exact")


def feature_error_recorded():
    """Launches that find an error already recorded (every pipeline wait gives up at once, as after a
    peer's failure) run to their end without a GPU fault: a TMA producer never arms a stage again
    while its bytes are landing, and drains its stages before leaving (mbar_wait_landed). Plain,
    split-K and grouped GEMMs and attention, many k-blocks each (not the clustered GEMM: its second
    CTA's producer reads the tile ring unchecked once waits give up); then the same GEMM, on a
    stream whose word is clear, is exact (the context is healthy)."""
    import cupy

    from mkernel import config
    from mkernel.engines import attention as ma

    M, N, K = 1024, 1024, 16384
    a, b, ref = _simple(M, N, K, seed=9)
    rng = np.random.default_rng(10)
    q, k, v = (_dev(rng.standard_normal((4096, 8, 128)).astype(BF16)) for _ in range(3))
    bs = _dev(rng.integers(-3, 4, size=(4, K, N)).astype(BF16))
    rows = cupy.asarray(np.array([200, 0, 300, 524], dtype=np.int32))

    def plain():
        with config.override(gemm_split_k=False):
            mg.gemm(a, b, out=_poisoned((M, N), "bf16"), cluster=False)

    launches = {"plain": plain,
                "split K": lambda: mg.gemm(a[:128], b, out=_poisoned((128, N), "bf16")),
                "grouped": lambda: mg.grouped_gemm(a, bs, rows, out=_poisoned((M, N), "bf16")),
                "attention": lambda: ma.attention(q, k, v)}
    assert plan.split_k(128, N, K) > 1
    ws = mg.workspace()
    code = ws.sync_state._dev[8:12].view(cupy.uint32)  # MkStatus.code, after the epoch and exit count
    code.fill(1)  # the kernels test it for nonzero; the host mirror stays clear
    try:
        for name, fn in launches.items():
            fn()
            _sync(f"{name} with an error recorded")
            cupy.cuda.runtime.deviceSynchronize()  # a GPU fault raises here
            print(f"{name}: ran to its end with an error recorded")
    finally:
        code.fill(0)
    with cupy.cuda.Stream():  # its own workspace: the runs above may leave split K's counts unbalanced
        out = _poisoned((M, N), "f32")
        mg.gemm(a, b, out=out)
        _sync("the same GEMM on a clear stream")
        assert np.array_equal(_host(out).astype(np.float64), ref), "the GEMM after the error runs is not exact"
    print("error recorded: every launch ran to its end; the next GEMM is exact")


def _grouped_case(dtn, lay, outk, integer, rows, M_cap, N, K, accumulate=False, seed=3):
    import cupy

    dt = DTYPES[dtn]
    G = len(rows)
    rng = np.random.default_rng(seed)
    if integer:
        a = rng.integers(-3, 4, size=(M_cap, K)).astype(dt)
        bs = rng.integers(-3, 4, size=(G, K, N)).astype(dt)
    else:
        a = rng.standard_normal((M_cap, K)).astype(dt)
        bs = rng.standard_normal((G, K, N)).astype(dt)
    kind = dtn if outk == "same" else "f32"
    if accumulate:
        c0 = rng.integers(-20, 20, size=(M_cap, N)).astype(np.float32 if kind == "f32" else dt)
        out = _dev(c0)
    else:
        out = _poisoned((M_cap, N), kind)
    db = _dev(np.ascontiguousarray(bs)) if lay == "kn" else _dev(np.ascontiguousarray(bs.transpose(0, 2, 1)))
    kw = {"b_layout": "nk"} if lay == "nk" else {}
    T_bound = mg.grouped_tiles_bound(M_cap, N, G)
    flags = cupy.full(T_bound, 0xDEADBEEF, dtype=cupy.uint32)
    counts = cupy.zeros(T_bound, dtype=cupy.uint32)
    e0 = mg.workspace().epoch()
    mg.grouped_gemm(_dev(a), db, cupy.asarray(np.array(rows, dtype=np.int32)), out=out, tile_flags=flags,
                    tile_counts=counts, accumulate=accumulate, **kw)
    _sync(f"grouped {dtn} {lay} {outk}")
    c = _host(out).astype(np.float64)
    # expected
    clamped, start = [], 0
    for r in rows:
        r = max(0, min(r, M_cap - start))
        clamped.append((start, r))
        start += r
    msgs, ok = [], True
    for g, (s, r) in enumerate(clamped):
        if r == 0:
            continue
        ref = a[s:s + r].astype(np.float64) @ bs[g].astype(np.float64)
        if accumulate:
            ref = ref + c0[s:s + r].astype(np.float64)
        got = c[s:s + r]
        if integer:
            bad = int((got != ref.astype(_host(out).dtype).astype(np.float64)).sum())
            if bad:
                ok = False
                msgs.append(f"group {g} rows {s}+{r}: {bad} mismatches")
        else:
            rel, mx, nf = _errors(got, ref)
            if not rel < 1e-2:
                ok = False
                msgs.append(f"group {g} rows {s}+{r}: rel {rel:.2e} nonfinite {nf}")
    if not accumulate and start < M_cap and np.isfinite(c[start:]).any():
        ok = False
        msgs.append(f"rows {start}..{M_cap} past the groups were written")
    tiles_n = -(-N // 256)
    T = sum(-(-r // 128) for _, r in clamped) * tiles_n
    f, n = cupy.asnumpy(flags), cupy.asnumpy(counts)
    if not ((f[:T] == e0 + 1).all() and (n[:T] == 1).all() and (f[T:] == 0xDEADBEEF).all() and (n[T:] == 0).all()):
        ok = False
        msgs.append(f"flags: {np.unique(f[:T])} counts {np.unique(n[:T])} (T={T})")
    return ok, "; ".join(msgs) or "OK"


def feature_grouped():
    rows = [0, 1, 127, 128, 129, 300, 64, 200]
    cases = []
    for dtn in ("bf16", "fp16"):
        for lay in ("kn", "nk"):
            cases.append((dtn, lay, "same", False, rows, 1100, 520, 200, False))
            cases.append((dtn, lay, "f32", True, rows, 1100, 520, 200, False))
    cases.append(("bf16", "kn", "f32", True, rows, 1100, 520, 200, True))  # red.add / TMA add paths
    cases.append(("bf16", "kn", "same", True, [500, 700, 300], 1000, 264, 72, False))  # clamped counts
    cases.append(("bf16", "nk", "same", False, [1024] * 32, 32 * 1024, 512, 256, False))
    failures = []
    for case in cases:
        ok, msg = _grouped_case(*case)
        print(f"{'OK ' if ok else 'BAD'} grouped {case[:4]} rows={case[4][:6]} M={case[5]} N={case[6]} K={case[7]} "
              f"acc={case[8]}: {msg}")
        if not ok:
            failures.append((case[:4], msg))
    assert not failures, failures


def feature_argument_errors():
    import cupy

    a = cupy.zeros((64, 64), dtype=BF16)
    b = cupy.zeros((64, 64), dtype=BF16)
    bad = {
        "K % 8": lambda: mg.gemm(cupy.zeros((64, 60), dtype=BF16), cupy.zeros((60, 64), dtype=BF16)),
        "N % 8": lambda: mg.gemm(a, cupy.zeros((64, 60), dtype=BF16)),
        "dtype mismatch": lambda: mg.gemm(a, cupy.zeros((64, 64), dtype=cupy.float16)),
        "float32 inputs": lambda: mg.gemm(a.astype(cupy.float32), b.astype(cupy.float32)),
        "out shape": lambda: mg.gemm(a, b, out=cupy.zeros((64, 65), dtype=BF16)),
        "cluster, odd sms": lambda: mg.gemm(a, b, cluster=True, sms=3),
        "cluster, tile_order": lambda: mg.gemm(a, b, cluster=True, tile_order=cupy.zeros(1, dtype=cupy.uint32)),
        "cluster, roles": lambda: mg.gemm(a, b, cluster=True, roles=cupy.ones(132, dtype=cupy.uint32)),
        "out dtype": lambda: mg.gemm(a, b, out=cupy.zeros((64, 64), dtype=cupy.float16)),
        "misaligned a": lambda: mg.gemm(cupy.zeros(64 * 64 + 8, dtype=BF16)[1:64 * 64 + 1].reshape(64, 64), b),
        "strided rows": lambda: mg.gemm(cupy.zeros((64, 128), dtype=BF16)[:, ::2], b),
        "b_layout": lambda: mg.gemm(a, b, b_layout="xx"),
        "K disagrees": lambda: mg.gemm(a, cupy.zeros((32, 64), dtype=BF16)),
        "sms": lambda: mg.gemm(a, b, sms=100000),
        "tile_flags short": lambda: mg.gemm(a, b, tile_flags=cupy.zeros(0, dtype=cupy.uint32)),
        "grouped G": lambda: mg.grouped_gemm(a, cupy.zeros((129, 64, 64), dtype=BF16),
                                             cupy.zeros(129, dtype=cupy.int32)),
        "grouped rows dtype": lambda: mg.grouped_gemm(a, cupy.zeros((2, 64, 64), dtype=BF16),
                                                      cupy.zeros(2, dtype=cupy.int64)),
    }
    missed, wrong = argument_errors(bad)
    _sync("argument errors")
    assert not missed and not wrong, f"no ArgumentError for: {missed}; other exceptions: {wrong}"


@pytest.mark.gpu
def test_flags_and_epochs():
    child_cases.feature(__file__, "flags")


@pytest.mark.gpu
def test_tile_order_roles_and_sms():
    child_cases.feature(__file__, "order_roles_sms")


@pytest.mark.gpu
def test_accumulate():
    child_cases.feature(__file__, "accumulate")


@pytest.mark.gpu
@pytest.mark.slow
def test_grouped():
    child_cases.feature(__file__, "grouped")


@pytest.mark.gpu
def test_split_k():
    child_cases.feature(__file__, "split_k")


@pytest.mark.gpu
def test_narrow_tiles():
    child_cases.feature(__file__, "narrow_tiles")


@pytest.mark.gpu
def test_error_recorded():
    child_cases.feature(__file__, "error_recorded")


@pytest.mark.gpu
def test_argument_errors():
    child_cases.feature(__file__, "argument_errors")


if __name__ == "__main__":
    child_cases.main(run_case, smoke_cases, __doc__)
