"""``python -m mkernel``: every kernel that exists, on all visible GPUs (one MPI rank each), checked
against a reference and timed against its baseline, printed as one table by rank 0."""

import numpy as np

import mkernel
from mkernel.comm import collectives
from mkernel.core.log import get_logger
from mkernel.diagnostics.selftest import Protocol
from mkernel.engines import attention as _attn
from mkernel.engines import attention as attention_engine
from mkernel.ops.ring_attention import ring_attention
from mkernel.ops.sequence import shard_sequence
from mkernel.ops.tp import gpus_distinct
from mkernel.runtime.arrays import BFLOAT16
from mkernel.runtime.arrays import BFLOAT16 as bf16

log = get_logger("main")


def _time_ms(fn, reps=20, warmup=3):
    import cupy
    for _ in range(warmup):
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def check_runtime(comm, quick):
    """The protocol every fused op relies on: peers' slots written through the pointer table."""
    import cupy

    words = 1 << 16
    proto = Protocol(comm, words)
    launches = 100 if quick else 1000
    for _ in range(launches):
        proto.run("exchange")
    cupy.cuda.get_current_stream().synchronize()
    comm.check()
    ok = proto.mismatch_count() == 0
    ms = _time_ms(lambda: proto.run("exchange"))
    return {"op": "runtime exchange", "shape": f"{comm.local_size} x {words * 4} B", "ok": ok,
            "mkernel_ms": ms, "baseline_ms": None, "note": f"{launches} checked launches"}


def check_gemm(comm, quick):
    """The GEMM engine on this rank's GPU against cupy.matmul (cuBLAS), random bf16 inputs."""
    import cupy

    m, n, k = (2048, 2048, 2048) if quick else (8192, 8192, 4096)
    rng = cupy.random.default_rng(comm.rank)
    a = (rng.standard_normal((m, k), dtype=cupy.float32)).astype(BFLOAT16)
    b = (rng.standard_normal((k, n), dtype=cupy.float32)).astype(BFLOAT16)
    out = cupy.full((m, n), float("nan"), dtype=BFLOAT16)
    mkernel.gemm(a, b, out=out)
    ref = cupy.matmul(a.astype(cupy.float32), b.astype(cupy.float32))
    err = float(cupy.linalg.norm(out.astype(cupy.float32) - ref) / cupy.linalg.norm(ref))
    ms = _time_ms(lambda: mkernel.gemm(a, b, out=out))
    base = _time_ms(lambda: cupy.matmul(a, b, out=out))
    return {"op": "gemm (engine)", "shape": f"{m}x{n}x{k}", "ok": err < 1e-2, "mkernel_ms": ms,
            "baseline_ms": base, "note": f"rel err {err:.1e}; baseline cupy.matmul"}


def check_attention(comm, quick):
    """The attention engine on this rank's GPU against an fp32 CuPy reference (small) and timed at
    32 heads x 128; no cuDNN here (torch is not a dependency: bench/attention.py compares)."""
    import cupy

    rng = cupy.random.default_rng(comm.rank)
    S_small, S, H, D = 300, (2048 if quick else 8192), 32, 128
    q, k, v = (rng.standard_normal((S_small, 4, D), dtype=cupy.float32).astype(BFLOAT16) for _ in range(3))
    out = cupy.full(q.shape, float("nan"), dtype=BFLOAT16)
    mkernel.attention(q, k, v, causal=True, out=out)
    ref = attention_engine.reference(*(x.astype(cupy.float32) for x in (q, k, v)), causal=True)
    err = float(cupy.linalg.norm(out.astype(cupy.float32) - ref) / cupy.linalg.norm(ref))
    q, k, v = (rng.standard_normal((S, H, D), dtype=cupy.float32).astype(BFLOAT16) for _ in range(3))
    out = cupy.empty_like(q)
    ms = _time_ms(lambda: mkernel.attention(q, k, v, out=out))
    return {"op": "attention (engine)", "shape": f"S {S} x H {H} x D {D}", "ok": err < 1e-2, "mkernel_ms": ms,
            "baseline_ms": None, "note": f"rel err {err:.1e} (causal, S 300); {4 * S * S * H * D / ms / 1e9:.0f} "
                                         f"TFLOP/s; cuDNN comparison: bench/attention.py"}


def check_tp(comm, quick, op):
    import cupy

    fn = getattr(mkernel, op)
    W, r = comm.size, comm.rank
    M, N, K = (1024, 1024, 256) if quick else (8192, 8192, 256 * W)
    rng = lambda p: np.random.default_rng([7, p])  # noqa: E731
    if op == "allgather_gemm":
        shards = [rng(p).integers(-1, 2, size=(M // W, K)).astype(np.float16) for p in range(W)]
        b = rng(100 + r).integers(-1, 2, size=(K, N)).astype(np.float16)
        ref = np.vstack(shards).astype(np.float64) @ b.astype(np.float64)
        a_dev, b_dev = cupy.asarray(shards[r]), cupy.asarray(b)
    else:
        Kr = K // W
        ab = [(rng(p).integers(-1, 2, size=(M, Kr)).astype(np.float16),
               rng(100 + p).integers(-1, 2, size=(Kr, N)).astype(np.float16)) for p in range(W)]
        ref = sum(a.astype(np.float64) @ b.astype(np.float64) for a, b in ab)
        if op == "gemm_reduce_scatter":
            ref = ref[r * (M // W):(r + 1) * (M // W)]
        a_dev, b_dev = cupy.asarray(ab[r][0]), cupy.asarray(ab[r][1])
    out = fn(a_dev, b_dev, comm=comm)
    cupy.cuda.get_current_stream().synchronize()
    comm.check()
    ok = bool(np.array_equal(cupy.asnumpy(out), ref.astype(np.float16)))
    path = comm.plans.state["tp.last_path"][op]
    ms = _time_ms(lambda: fn(a_dev, b_dev, comm=comm, out=out))
    base, base_name = None, ""
    if W > 1:  # NCCL where the ranks have GPUs of their own, else the op's own unfused path
        base_name = "fallback" if gpus_distinct(comm) else "unfused"
        base = _time_ms(lambda: fn(a_dev, b_dev, comm=comm, path=base_name))
    return {"op": op, "shape": f"{M}x{N}x{K}", "ok": ok, "mkernel_ms": ms, "baseline_ms": base,
            "note": f"{path} path, exact integer check" + (f"; baseline the {base_name} path" if base else "")}


def check_ring_attention(comm, quick):
    """The row ``python -m mkernel`` adds: ring attention (causal, zigzag) against the single-GPU
    engine on the whole sequence (every rank builds the same global inputs), then timed."""
    import cupy

    W, me = comm.size, comm.rank
    S, H, D = (512 if quick else 2048), 8, 128
    rng = cupy.random.default_rng(11)  # the same global inputs on every rank
    qg, kg, vg = (rng.standard_normal((S * W, H, D), dtype=cupy.float32).astype(BFLOAT16) for _ in range(3))
    ref = shard_sequence(_attn.attention(qg, kg, vg, causal=True), me, W, causal=True)
    q, k, v = (cupy.ascontiguousarray(shard_sequence(x, me, W, causal=True)) for x in (qg, kg, vg))
    out = cupy.full(q.shape, float("nan"), dtype=BFLOAT16)
    ring_attention(q, k, v, comm=comm, causal=True, out=out)
    cupy.cuda.get_current_stream().synchronize()
    comm.check()
    r = ref.astype(cupy.float32)
    err = float(cupy.linalg.norm(out.astype(cupy.float32) - r) / cupy.linalg.norm(r))
    ms = _time_ms(lambda: ring_attention(q, k, v, comm=comm, causal=True, out=out))
    return {"op": "ring_attention", "shape": f"S_local {S} x H {H} x D {D}, causal", "ok": err < 1e-2,
            "mkernel_ms": ms, "baseline_ms": None,
            "note": f"rel err {err:.1e} vs the engine on the whole sequence; speed: bench/ring_attention.py"}


def check_moe(comm, quick):
    """MoE: moe_dispatch_gemm then moe_gemm_combine (fused paths) on every rank's tokens against a
    float64 reference of the whole layer (x @ W1[e], rounded as the op rounds it, @ W2[e], weighted
    and summed); each timed against its building blocks (the unfused paths: moe_dispatch +
    grouped_gemm, grouped_gemm + moe_combine)."""
    import cupy

    W, r = comm.size, comm.rank
    T, H, F, El, k = (256, 512, 256, 2, 2) if quick else (1024, 1024, 512, 4, 2)
    E = El * W
    combine = "fused" if comm.num_nodes == 1 else "unfused"  # the fused combine works inside a node
    g = np.random.default_rng(31)  # the experts' weights: the same on every rank
    w1 = (g.standard_normal((E, H, F)) / np.sqrt(H)).astype(bf16)
    w2 = (g.standard_normal((E, F, H)) / np.sqrt(F)).astype(bf16)
    t = np.random.default_rng([32, r])  # this rank's tokens and routing
    x = t.standard_normal((T, H)).astype(bf16)
    ids = np.argsort(t.random((T, E)), axis=1)[:, :k].astype(np.int32)
    wts = t.random((T, k)).astype(np.float32) + 0.5
    ref = np.zeros((T, H))
    for j in range(k):
        for e in range(E):
            rows = ids[:, j] == e
            if rows.any():
                h = (x[rows].astype(np.float64) @ w1[e].astype(np.float64)).astype(bf16).astype(np.float64)
                ref[rows] += wts[rows, j:j + 1] * (h @ w2[e].astype(np.float64)).astype(bf16).astype(np.float64)
    xd, idd, wd = cupy.asarray(x.view(np.uint16)).view(bf16), cupy.asarray(ids), cupy.asarray(wts)
    w1d = cupy.asarray(np.ascontiguousarray(w1[r * El:(r + 1) * El]).view(np.uint16)).view(bf16)
    w2d = cupy.asarray(np.ascontiguousarray(w2[r * El:(r + 1) * El]).view(np.uint16)).view(bf16)

    def dispatch_gemm(path):
        return mkernel.moe_dispatch_gemm(xd, idd, wd, w1d, comm=comm, num_experts=E, path=path)

    y, handle = dispatch_gemm("fused")
    out = mkernel.moe_gemm_combine(y, w2d, handle, comm=comm, path=combine)
    cupy.cuda.get_current_stream().synchronize()
    comm.check()
    got = cupy.asnumpy(out.view(cupy.uint16)).view(bf16).astype(np.float64)
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    shape = f"T {T} x H {H} x F {F}, E {E}, k {k}"
    note = f"rel err {err:.1e} vs float64 (the whole layer); baseline the unfused path"
    row = {"op": "moe_dispatch_gemm", "shape": shape, "ok": err < 1e-2, "note": note,
           "mkernel_ms": _time_ms(lambda: dispatch_gemm("fused")),
           "baseline_ms": _time_ms(lambda: dispatch_gemm("unfused"))}
    y, handle = dispatch_gemm("fused")  # a handle no later dispatch made stale
    return [row, {"op": "moe_gemm_combine", "shape": shape, "ok": err < 1e-2, "note": note,
                  "mkernel_ms": _time_ms(lambda: mkernel.moe_gemm_combine(y, w2d, handle, comm=comm, path=combine)),
                  "baseline_ms": None if combine == "unfused" else
                  _time_ms(lambda: mkernel.moe_gemm_combine(y, w2d, handle, comm=comm, path="unfused"))}]


def checks():
    """(name, check) of every row: check(comm, quick) returns a row or a list of rows."""
    tp = [(op, lambda comm, quick, op=op: check_tp(comm, quick, op))
          for op in ("gemm_reduce_scatter", "gemm_allreduce", "allgather_gemm")]
    return ([("runtime exchange", check_runtime), ("gemm (engine)", check_gemm),
             ("attention (engine)", check_attention)] + tp
            + [("ring_attention", check_ring_attention), ("moe", check_moe)])


def _ms(x):
    return f"{x:.3f}" if x else "-"


def run(quick=False) -> int:
    """Every row on every rank; rank 0 prints the table and, last, which ops failed. Returns 1 when
    a check failed on any rank."""
    comm = mkernel.init()
    rows = []
    for name, check in checks():
        try:
            got = check(comm, quick)
            rows += got if isinstance(got, list) else [got]
        except Exception as e:  # noqa: BLE001  (a row that raised fails; the others still run)
            log.debug("check %s raised", name, exc_info=True)
            rows.append({"op": name, "ok": False, "note": f"{type(e).__name__}: {str(e)[:300]}"})
    all_rows = collectives.allgather_object(comm.mpi, rows, "the main job's report")  # timed: a dead peer raises
    failed = sorted({r["op"] for rank_rows in all_rows for r in rank_rows if not r["ok"]})
    if comm.rank == 0:
        print(f"mkernel {mkernel.__version__}: {comm.size} rank(s), {comm.num_nodes} node(s)")
        print(f"{'op':28s} {'shape':34s} {'check':6s} {'mkernel ms':>11s} {'baseline ms':>12s} {'speedup':>8s}")
        for r in all_rows[0]:
            base, ms = r.get("baseline_ms"), r.get("mkernel_ms")
            speed = f"{base / ms:7.2f}x" if base and ms else "       -"
            print(f"{r['op']:28s} {str(r.get('shape', '')):34s} {'ok' if r['ok'] else 'FAIL':6s} "
                  f"{_ms(ms):>11s} {_ms(base):>12s} {speed}" + (f"  ({r['note']})" if r.get("note") else ""))
        print(f"FAILED: {', '.join(failed)}" if failed else f"all {len(all_rows[0])} checks passed")
    comm.close()
    return 1 if failed else 0
