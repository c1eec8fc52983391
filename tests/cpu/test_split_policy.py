"""The split policy (mkernel/cuda/primitives/split_policy.cuh through mkernel.split) on synthetic cost curves (CPU).

Curves: T(n) = max(gemm(total - n), comm(n)) + 5% of the smaller (imperfect overlap), gemm from the
measured SM sweep (bench/results/gemm-1gpu.json, 8192 x 8192 x 4096, scaled by FLOPs), comm from the
measured push rates over NVLink (1 SM 46 GB/s, 4: 182, 8: 352, saturating at 365; pulling needs twice
the SMs); variants: a mis-modelled link or GEMM (the optimum shifts away from the prior), a cliff (too
few comm CTAs multiplies the time by 25), multiplicative noise (uniform +-2% and +-5%, fixed seeds),
and a flat curve.
"""

import ctypes
import json
import math
import random
import shutil
import subprocess
import zlib

import pytest

from mkernel.runtime import compile as kc
from mkernel.split import policy as split

SWEEP = {132: 0.747, 126: 0.798, 120: 0.840, 114: 0.835, 108: 0.869, 102: 0.931, 96: 0.969, 90: 0.965,
         84: 1.030, 78: 1.116, 72: 1.142, 66: 1.219}
PUSH = [(0, 0.0), (1, 46.0), (4, 182.0), (8, 352.0), (9, 365.0)]
TOTAL, LO, HI = 132, 1, 64
REF_FLOP = 8192 * 8192 * 4096
OPS = ("rs", "ar", "ag", "ar_pull")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    # One host library for the whole file (built once), outside the user's cache.
    monkeypatch.setenv("MKERNEL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "split-cache"))


def gemm_ms(n, scale):
    if n >= 132:
        return SWEEP[132] * scale
    if n < 66:
        return SWEEP[66] * 66 / n * scale  # below the sweep: ideal scaling
    pts = sorted(SWEEP)
    for a, b in zip(pts, pts[1:]):
        if a <= n <= b:
            return (SWEEP[a] + (SWEEP[b] - SWEEP[a]) * (n - a) / (b - a)) * scale


def push_gbps(n):
    if n >= 9:
        return 365.0
    for (a, ra), (b, rb) in zip(PUSH, PUSH[1:]):
        if a <= n <= b:
            return ra + (rb - ra) * (n - a) / (b - a)


def curve(op, M, N, K, W, link=1.0, gemm=1.0, cliff=None):
    """(T(n) in ms, the model prior). ``link`` / ``gemm`` mis-model the rates the prior assumes."""
    scale = M * N * K / REF_FLOP
    out = M * N * 2
    nbytes = {"rs": out, "ar": 2 * out, "ag": M * K * 2, "ar_pull": 2 * out}[op] * (W - 1) / W
    pull = op == "ar_pull"

    def f(n):
        c = nbytes / (push_gbps(n / 2 if pull else n) * link * 1e6)
        g = gemm_ms(TOTAL - n, scale * gemm)
        t = max(g, c) + 0.05 * min(g, c)
        return t * 25 if cliff is not None and n < cliff else t

    pr = split.prior(comm_bytes=nbytes, cta_gbps=46.0 / (2 if pull else 1), link_gbps=365.0,
                     gemm_ms=SWEEP[132] * scale, total=TOTAL, lo=LO, hi=HI)
    return f, pr


def best_static(f):
    return min(f(n) for n in range(LO, HI + 1))


def argbest(f):
    return min(range(LO, HI + 1), key=f)


def drive(f, pr, noise, seed, calls=10, search=None):
    """Runs `calls` calls through a Search; returns it and the counts it ran."""
    rng = random.Random(seed)
    s = search or split.Search(LO, HI, pr)
    ran = []
    n = s.pending
    for _ in range(calls):
        ran.append(n)
        n = s.observe(n, f(n) * (1 + rng.uniform(-noise, noise)))
    return s, ran


def family():
    """(name, f, prior, noise, seed, model_consistent) for distinct curves."""
    out = []
    for op in OPS:
        for K in (512, 1024, 2048, 4096, 8192, 16384):
            M, N = (8192, 8192) if op != "ag" else (8192, 8192 * 4096 // K)  # AG: bytes follow K / N
            KK = K if op != "ag" else 4096
            for W in (2, 4, 8):
                for link, gm in ((1, 1), (0.6, 1), (1.5, 1), (1, 0.8), (1, 1.25)):
                    f0, pr = curve(op, M, N, KK, W, link, gm)
                    for cliff in (None, max(1, argbest(f0) // 2)):
                        f, _ = curve(op, M, N, KK, W, link, gm, cliff)
                        for noise in (0.0, 0.02, 0.05):
                            name = f"{op} {M}x{N}x{KK} W{W} link{link} gemm{gm} cliff{cliff} noise{noise}"
                            out.append((name, f, pr, noise, zlib.crc32(name.encode()),
                                        (link, gm, cliff) == (1, 1, None)))
    return out


def geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


# ------------------------------------------------------------------------------- builds
def test_header_compiles_for_the_host_without_system_headers(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src = tmp_path / "only_header.cpp"
    src.write_text('#include "split_policy.cuh"\nint main() { MkSplitSearch s; mk_split_search_init(s, 1, 8, 4);\n'
                   '  return mk_split_search_observe(s, 4, 1000) == 5 ? 0 : 1; }\n')
    exe = tmp_path / "only_header"
    # -nostdinc: the header must not need any system header on the host either
    subprocess.run([cxx, "-std=c++17", "-nostdinc", "-Wall", "-Wextra", "-Werror",
                    *(f"-I{d}" for d in kc.include_dirs()), str(src), "-o", str(exe)], check=True)
    assert subprocess.run([str(exe)]).returncode == 0  # from prior 4 the first probe is 5


def test_header_compiles_for_the_device(kernel_cache):
    assert split.SPEC.name in kc.REGISTRY and not split.SPEC.hot
    c = kc.compile_spec(split.SPEC)
    assert c.cubin[:4] == b"\x7fELF" and set(c.lowered) == {"split_policy_test"}
    for fn, r in c.resources["functions"].items():
        assert r.get("spill_stores", 0) == 0, f"{fn} spills: {r}"


def test_mirrors_match_the_header():
    lib = split.library()
    for i, cls in enumerate((split.MkSplitSearch, split.MkSplitCtl, split.MkSplitWindow, split.MkSplitModel)):
        assert lib.mk_split_sizeof(i) == ctypes.sizeof(cls), cls.__name__


# ------------------------------------------------------------------------------- cross-call search
def test_first_call_within_15_percent_on_model_consistent_curves():
    ratios = [f(pr) / best_static(f) for _, f, pr, noise, _, consistent in family() if consistent and noise == 0]
    assert len(ratios) == len(OPS) * 6 * 3
    assert max(ratios) <= 1.15, sorted(ratios)[-5:]


def test_steady_state_on_the_curve_family():
    ratios, worst = [], []
    for name, f, pr, noise, seed, _ in family():
        s, ran = drive(f, pr, noise, seed)
        assert s.converged, f"{name}: still searching after 10 calls ({s.phase}, ran {ran})"
        r = f(s.best) / best_static(f)
        ratios.append(r)
        worst.append((r, name, ran))
    within3 = sum(r <= 1.03 for r in ratios) / len(ratios)
    worst.sort(reverse=True)
    assert within3 >= 0.90, (within3, worst[:5])
    assert max(ratios) <= 1.10, worst[:5]
    assert geomean(ratios) <= 1.03
    # Without noise, every curve within 2% (not 0: the measured sweep is not monotone, 114 SMs beat
    # 120, so some curves have a local minimum 1.3% above the global one).
    clean = [r for (_, _, _, noise, _, _), r in zip(family(), ratios) if noise == 0]
    assert max(clean) <= 1.02 and sum(r <= 1.001 for r in clean) >= 0.9 * len(clean)


def test_cliff_just_below_the_optimum_is_touched_at_most_twice():
    for op in OPS:
        f0, pr = curve(op, 8192, 8192, 2048, 4)
        cliff = argbest(f0) - 1
        f, _ = curve(op, 8192, 8192, 2048, 4, cliff=cliff)
        for seed in range(3):
            s, ran = drive(f, pr, 0.02, seed)
            assert f(s.best) / best_static(f) <= 1.03, (op, ran)
            assert sum(n < cliff for n in ran) <= 2, (op, cliff, ran)


def test_flat_curve_converges_and_holds():
    s, ran = drive(lambda n: 1.0, 9, 0.03, 1)
    assert s.converged and LO <= s.best <= HI
    s2, ran2 = drive(lambda n: 1.0, 9, 0.03, 1, calls=20, search=s)
    assert set(ran2) == {s.best}  # holding: no more exploration


def test_search_is_deterministic_and_stays_in_bounds():
    rng = random.Random(5)
    for _ in range(200):
        lo = rng.randint(1, 20)
        hi = lo + rng.randint(0, 40)
        opt = rng.randint(lo, hi)
        f = (lambda o: lambda n: 1.0 + 0.02 * abs(n - o) ** 1.3)(opt)
        pr = rng.randint(lo, hi)
        states = []
        for _ in range(2):
            r2 = random.Random(7)
            s = split.Search(lo, hi, pr)
            n = s.pending
            for _ in range(30):
                assert lo <= n <= hi
                n = s.observe(n, f(n) * (1 + r2.uniform(-0.05, 0.05)))
            states.append(s.state())
        assert states[0] == states[1]  # ranks fed the same times decide the same


def test_unrequested_counts_inform_but_do_not_advance():
    s = split.Search(1, 64, 8)
    assert s.observe(20, 1.0) == 8 and s.phase == "prior"
    assert s.points()[20] == (1, 1.0)


def test_reopens_only_on_a_large_persistent_change():
    f, pr = curve("rs", 8192, 8192, 2048, 4)
    s, _ = drive(f, pr, 0.0, 0)
    held = s.best
    s.observe(held, f(held) * 2.0)  # one outlier: still held
    assert s.converged and s.s.reopens == 0
    g, _ = curve("rs", 8192, 8192, 2048, 4, link=0.4)  # the link got much slower (another topology)
    for _ in range(3):
        s.observe(s.pending, g(s.pending))
    assert s.s.reopens == 1 and not s.converged
    s, ran = drive(g, pr, 0.0, 0, calls=10, search=s)
    assert s.converged and g(s.best) / best_static(g) <= 1.03 and s.best > held


# ------------------------------------------------------------------------------- in-call controller
def window(n_comm, tiles_left, items_left, per_cta_tile_ns=90_000, item_bytes=128 * 256 * 2 * 3,
           dt_ns=50_000, total=TOTAL):
    """One window of a fluid model: GEMM CTAs each take `per_cta_tile_ns` per tile; comm CTAs move
    items at the push rate table (shared); comm starves when it outruns the GEMM's production."""
    n_g = total - n_comm
    gemm_done = max(1, n_g * dt_ns // per_cta_tile_ns)
    rate = push_gbps(n_comm) * 1e9 / 1e9  # bytes per ns
    can = int(rate * dt_ns / item_bytes)
    comm_done = max(1, min(can, gemm_done))
    busy = comm_done * item_bytes / rate * n_comm  # CTA-ns: every comm CTA shares the link
    return dict(gemm_done=gemm_done, comm_done=comm_done, gemm_busy_ns=n_g * dt_ns, comm_busy_ns=int(busy),
                gemm_stall_ns=0, comm_stall_ns=max(0, int(n_comm * dt_ns - busy)),
                gemm_left=tiles_left, comm_left=items_left)


def test_controller_stationary_input_settles_without_oscillating():
    for start in (1, 4, 30, 64):
        c = split.Controller(TOTAL, 1, 64, start, step_max=8)
        seen = []
        for _ in range(300):
            seen.append(c.step(**window(c.n_comm, 1000, 1000)))
        changes = sum(1 for a, b, d in zip(seen, seen[1:], seen[2:]) if (b - a) * (d - b) < 0)
        assert changes <= 3 and c.c.reversals <= 3, (start, seen[:40])
        assert len(set(seen[-100:])) == 1  # settled
        assert 1 <= min(seen) and max(seen) <= 64


def test_controller_finds_the_balance_of_the_fluid_model():
    # 3-partial items of 192 KiB per tile, 90 us per tile and CTA: the GEMM makes ~128 / 90us tiles,
    # i.e. ~283 GB/s of items, so the balance needs 6-7 pushing CTAs (267 and 310 GB/s).
    for start in (1, 30):
        c = split.Controller(TOTAL, 1, 64, start, step_max=8)
        for _ in range(100):
            c.step(**window(c.n_comm, 1000, 1000))
        assert 6 <= c.n_comm <= 8, (start, c.n_comm)


def test_controller_random_windows_stay_in_bounds_with_bounded_reversals():
    rng = random.Random(11)
    for _ in range(50):
        lo = rng.randint(1, 10)
        hi = lo + rng.randint(0, 50)
        step = rng.randint(1, 16)
        c = split.Controller(TOTAL, lo, hi, rng.randint(lo, hi), step_max=step)
        d = split.Controller(TOTAL, lo, hi, c.n_comm, step_max=step)
        for _ in range(500):
            w = {k: rng.randint(0, 10**6) for k in ("gemm_done", "comm_done", "gemm_busy_ns", "comm_busy_ns",
                                                    "gemm_stall_ns", "comm_stall_ns", "gemm_left", "comm_left")}
            n = c.step(**w)
            assert d.step(**w) == n  # deterministic
            assert lo <= n <= hi
        # each reversal halves the step or widens the dead band by one CTA, up to the bounds' width
        assert c.c.reversals <= step.bit_length() + (hi - lo) + 1


def test_controller_starved_comm_gives_ctas_back_and_idle_windows_change_nothing():
    c = split.Controller(TOTAL, 1, 64, 20)
    w = window(20, 1000, 1000)
    w.update(comm_busy_ns=1000, comm_stall_ns=20 * 50_000, comm_done=10, gemm_done=10, gemm_busy_ns=10**6)
    w.update(comm_left=10**6)  # the balance alone would ask for more
    assert c.step(**w) < 20
    n = c.n_comm
    assert c.step(**dict(w, comm_done=0)) == n and c.step(**dict(w, gemm_left=0)) == n


def test_kernel_window_moves_turns_to_comm_and_takes_waits_out():
    """mk_split_window (what the TP kernels' controller feeds the step): per-role CTA-ns are the role's
    CTAs times the window, the lent CTAs' turns moved from the GEMM to the comm side, waits taken out,
    every difference clamped at zero."""
    w = split.window(dt_ns=10_000, gemm_ctas=124, comm_ctas=8, turn_ns=30_000, gemm_stall_ns=5_000,
                     comm_stall_ns=20_000, gemm_done=50, comm_done=7, gemm_left=900, comm_left=300)
    assert w["gemm_busy_ns"] == 124 * 10_000 - 30_000 - 5_000 and w["gemm_stall_ns"] == 5_000
    assert w["comm_busy_ns"] == 8 * 10_000 + 30_000 - 20_000 and w["comm_stall_ns"] == 20_000
    assert (w["gemm_done"], w["comm_done"], w["gemm_left"], w["comm_left"]) == (50, 7, 900, 300)
    # timer noise larger than the window: nothing wraps below zero
    w = split.window(dt_ns=1_000, gemm_ctas=2, comm_ctas=1, turn_ns=5_000, gemm_stall_ns=9_000, comm_stall_ns=99_000,
                     gemm_done=1, comm_done=1, gemm_left=1, comm_left=1)
    assert w["gemm_busy_ns"] == 0 and w["gemm_stall_ns"] == 0
    assert w["comm_busy_ns"] == 0 and w["comm_stall_ns"] == 1_000 + 5_000
    # a starved reduction (one comm CTA, a GEMM of 131) asks the step for more comm CTAs
    c = split.Controller(132, 1, 66, 1)
    w = split.window(dt_ns=10_000, gemm_ctas=131, comm_ctas=1, gemm_done=60, comm_done=5, gemm_left=400, comm_left=500)
    assert c.step(**w) > 1


# ------------------------------------------------------------------------------- memory
def test_memory_choose_observe_persist_reload(tmp_path):
    f, pr = curve("ar", 8192, 8192, 4096, 8)
    key = split.split_key("gemm_allreduce", (8192, 8192, 4096), 8, "nvlink", "p2p")
    other = split.split_key("gemm_allreduce", (8192, 8192, 4096), 4, "nvlink", "p2p")
    mem = split.SplitMemory(persist=True, directory=tmp_path)
    with pytest.raises(split.MKernelError):
        mem.observe(key, 8, 1.0)
    assert mem.choose(key, pr) == pr and mem.choose(other, 3) == 3
    for _ in range(10):
        n = mem.choose(key, pr)
        mem.observe(key, n, f(n))
    s = mem.search(key)
    assert s.converged and f(s.best) / best_static(f) <= 1.03
    data = json.loads((tmp_path / "splits.json").read_text())
    assert list(data["entries"]) == [split._key_str(key)]  # only converged keys are kept
    assert not list(tmp_path.glob("*.tmp"))
    again = split.SplitMemory(persist=True, directory=tmp_path)
    assert again.choose(key, 1) == s.best and again.search(key).converged  # held from the first call
    assert again.choose(other, 3) == 3 and not again.search(other).converged
    # bounds changed: the saved split becomes the prior of a new search
    third = split.SplitMemory(persist=True, directory=tmp_path)
    assert third.choose(key, 1, lo=1, hi=32) == min(s.best, 32) and not third.search(key).converged


def test_memory_ignores_a_corrupt_or_foreign_file(tmp_path):
    (tmp_path / "splits.json").write_text("{not json")
    assert split.SplitMemory(persist=True, directory=tmp_path).choose(("x",), 5) == 5
    (tmp_path / "splits.json").write_text(json.dumps({"version": -1, "entries": {split._key_str(("x",)): {
        "comm_ctas": 40, "state": "00"}}}))
    assert split.SplitMemory(persist=True, directory=tmp_path).choose(("x",), 5) == 5


def test_memory_without_persistence_writes_nothing(tmp_path):
    mem = split.SplitMemory(directory=tmp_path)
    for _ in range(12):
        n = mem.choose(("k",), 4)
        mem.observe(("k",), n, 1.0 + abs(n - 6) * 0.05)
    assert mem.search(("k",)).converged and not list(tmp_path.iterdir())


def test_shape_buckets():
    assert split.shape_bucket(8192, 8000, 4097) == (8192, 8192, 6144)
    assert split.shape_bucket(1, 3, 6, 7) == (1, 3, 6, 8)
    for d in range(1, 5000, 37):
        (b,) = split.shape_bucket(d)
        assert d <= b < 1.5 * d + 2
    assert split.split_key("rs", (100, 200, 300), 2, "t", "p") == ("rs", (128, 256, 384), 2, "t", "p")
