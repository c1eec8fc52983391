"""Every fused kernel once at a small shape, for compute-sanitizer (tools/sanitize.sh,
tools/sanitize_targets.py): each target raises on a wrong result, so the sanitizer run also checks
the answer."""

import contextlib
import os
import tempfile

import mkernel
from mkernel.comm.communicator import init
from mkernel.core import config
from mkernel.core.errors import MKernelError
from mkernel.core.log import get_logger
from mkernel.engines import attention as _attn
from mkernel.engines import gemm as _gemm
from mkernel.engines.attention import HEAD_DIMS, reference
from mkernel.ops import moe as _moe
from mkernel.ops.sequence import shard_sequence
from mkernel.runtime.arrays import cupy_mod

log = get_logger("sanitize")


def check_result(got, want_f64, what, atol):
    """Raises MKernelError when got (device) differs from a float64 reference by more than atol."""
    import numpy
    cupy = cupy_mod()
    g = cupy.asnumpy(got.view(cupy.uint16)).view(got.dtype).astype(numpy.float64)
    err = float(numpy.max(numpy.abs(g - want_f64))) if g.size else 0.0
    if not numpy.isfinite(err) or err > atol:
        raise MKernelError(f"{what}: max error {err} > {atol}")


def target_gemm():
    """The engine once at a shape off the tile grid in every dimension, both B layouts, with and
    without clusters and in narrow tiles, then split K (long K) alone, in pairs and in narrow tiles;
    integer inputs (exact); raises on a wrong result. tools/sanitize.sh runs it under compute-sanitizer."""
    import numpy as np

    cupy = cupy_mod()
    rng = np.random.default_rng(0)
    M, K, N = 200, 136, 264
    a = rng.integers(-2, 3, size=(M, K)).astype(np.float16)
    b = rng.integers(-2, 3, size=(K, N)).astype(np.float16)
    want = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float16)
    for name, b_dev, layout in (("kn", cupy.asarray(b), None), ("nk", cupy.asarray(np.ascontiguousarray(b.T)), "nk")):
        for cluster, tile_n in ((False, 256), (True, 256), (False, 192)):
            out = cupy.full((M, N), np.nan, dtype=np.float16)
            with config.override(gemm_tile_n=tile_n):
                mkernel.gemm(cupy.asarray(a), b_dev, out=out, b_layout=layout, cluster=cluster)
            got = out.get()
            if not np.array_equal(got, want):
                raise AssertionError(f"gemm {name} cluster={cluster} tiles of {tile_n}: "
                                     f"{int((got != want).sum())} of {got.size} elements wrong")
    a = rng.integers(-1, 2, size=(M, 4104)).astype(np.float16)  # split K (8 ranges), alone and in pairs
    b = rng.integers(-1, 2, size=(4104, N)).astype(np.float16)
    want = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float32)
    for cluster, tile_n in ((False, 256), (True, 256), (False, 192)):
        out = cupy.full((M, N), np.nan, dtype=np.float32)
        with config.override(gemm_decode_max_m=0, gemm_tile_n=tile_n):
            mkernel.gemm(cupy.asarray(a), cupy.asarray(b), out=out, cluster=cluster)
        got = out.get()
        if not np.array_equal(got, want):
            raise AssertionError(f"gemm split K cluster={cluster} tiles of {tile_n}: "
                                 f"{int((got != want).sum())} of {got.size} wrong")


def target_gemm_decode():
    """The decode path (few rows, weights as [N, K]) with one K range and with several (row blocks
    shared by 2 .. 132 CTAs), 16-bit outputs by TMA stores (32-128 token columns) and by scalar ones
    (8, 256), and accumulate=True (out's reads before the stores), integer inputs (exact); raises on a
    wrong result."""
    import numpy as np

    cupy = cupy_mod()
    rng = np.random.default_rng(3)
    # K 4104 over 2 row blocks: many CTAs share them; 130 tokens: 132 runs over 4 row blocks
    cases = [(M, N, K, False) for M, N, K in ((3, 264, 136), (17, 136, 4104), (40, 512, 1032), (100, 520, 2056),
                                                  (130, 512, 4104))]
    for M, N, K, acc in cases + [(37, 264, 1032, True), (100, 512, 4104, True)]:
        a = rng.integers(-1, 2, size=(M, K)).astype(np.float16)
        w = rng.integers(-1, 2, size=(N, K)).astype(np.float16)
        start = rng.integers(-8, 9, size=(M, N)).astype(np.float16) if acc else np.zeros((M, N), np.float16)
        want = (start.astype(np.float64) + a.astype(np.float64) @ w.astype(np.float64).T).astype(np.float16)
        out = cupy.asarray(start) if acc else cupy.full((M, N), np.nan, dtype=np.float16)
        with config.override(gemm_decode_max_m=256):  # the decode path, not the engine's
            mkernel.gemm(cupy.asarray(a), cupy.asarray(w).T, out=out, accumulate=acc)
        got = out.get()
        if not np.array_equal(got, want):
            raise AssertionError(f"gemm decode {M}x{N}x{K}: {int((got != want).sum())} of {got.size} elements wrong")


def target_allreduce(world=None):
    """The all-reduce on ``world`` (default MPI.COMM_WORLD: run it with 2 ranks), integer inputs
    (exact), twice each as LL words, one-shot and two-shot data + flags; raises on a wrong result."""
    import numpy as np
    from mpi4py import MPI

    cupy = cupy_mod()
    comm = init(world or MPI.COMM_WORLD, workspace_bytes=16 << 20)
    try:
        # 8200 elements: 5 chunks
        x_of = lambda r: np.random.default_rng(r).integers(-3, 4, size=8200).astype(np.float16)  # noqa: E731
        want = sum(x_of(r).astype(np.float64) for r in range(comm.size))
        one = {"allreduce_ll_max_bytes": 0, "allreduce_twoshot_min_bytes": 0, "allreduce_twoshot_min_bytes_2ranks": 0}
        two = {"allreduce_ll_max_bytes": 0, "allreduce_twoshot_min_bytes": 1, "allreduce_twoshot_min_bytes_2ranks": 1}
        for knobs in ({"allreduce_ll_max_bytes": 1 << 40}, one, two):
            with config.override(**knobs):
                for _ in range(2):
                    out = cupy.full(8200, np.nan, dtype=np.float16)
                    mkernel.allreduce(cupy.asarray(x_of(comm.rank)), comm=comm, out=out)
                    cupy.cuda.runtime.deviceSynchronize()
                    comm.check()
                    check_result(out, want, f"allreduce ({knobs})", 0.0)
    finally:
        comm.close()
    _latency_paths(world)


def _latency_paths(world):
    """gemm_allreduce's latency paths at 5 rows (the fused LL kernels, then the decode GEMM +
    all-reduce), integer inputs (exact), twice each."""
    import numpy as np
    from mpi4py import MPI

    cupy = cupy_mod()
    comm = init(world or MPI.COMM_WORLD, workspace_bytes=16 << 20)
    try:
        M, N, K = 5, 264, 1032
        a_of = lambda r: np.random.default_rng(r).integers(-1, 2, size=(M, K)).astype(np.float16)  # noqa: E731
        w_of = lambda r: np.random.default_rng(50 + r).integers(-1, 2, size=(N, K)).astype(np.float16)  # noqa: E731
        want = sum(a_of(r).astype(np.float64) @ w_of(r).astype(np.float64).T for r in range(comm.size))
        for ll_rows in (16, 0):
            with config.override(tp_latency_ll_max_rows=ll_rows):
                for _ in range(2):
                    out = cupy.full((M, N), np.nan, dtype=np.float16)
                    mkernel.gemm_allreduce(cupy.asarray(a_of(comm.rank)), cupy.asarray(w_of(comm.rank)).T, comm=comm,
                                           out=out, path="latency")
                    cupy.cuda.runtime.deviceSynchronize()
                    comm.check()
                    check_result(out, want, f"gemm_allreduce latency (LL rows {ll_rows})", 0.0)
    finally:
        comm.close()


def target_attention():
    """The engine once per head dim at small ragged shapes (two key blocks, a partial query tile),
    causal and not, against a float64 reference; raises on a wrong result. tools/sanitize.sh runs
    it under compute-sanitizer."""
    import numpy as np

    cupy = cupy_mod()
    rng = np.random.default_rng(0)
    for D in HEAD_DIMS:
        for causal in (False, True):
            Sq, Skv, Hq, Hkv = 150, 200, 2, 1
            q, k, v = (rng.standard_normal(s).astype(np.float16) for s in ((Sq, Hq, D), (Skv, Hkv, D), (Skv, Hkv, D)))
            out = cupy.full(q.shape, np.nan, dtype=np.float16)
            mkernel.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=causal, out=out)
            got = out.get().astype(np.float64)
            want = reference(*(x.astype(np.float64) for x in (q, k, v)), causal=causal)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            if not err < 1e-2:
                raise AssertionError(f"attention D={D} causal={causal}: relative error {err:.2e}")


def target_gemm_reduce_scatter(world=None):
    """The fused kernel once at a small shape on ``world`` (default MPI.COMM_SELF:
    tools/sanitize_targets.py); raises on a wrong result."""
    _tp_reduce(mkernel.gemm_reduce_scatter, world)


def target_gemm_allreduce(world=None):
    """The fused kernel once at a small shape on ``world`` (default MPI.COMM_SELF); raises on a
    wrong result."""
    _tp_reduce(mkernel.gemm_allreduce, world)


def target_allgather_gemm(world=None):
    """The fused kernel once at a small shape on ``world`` (default MPI.COMM_SELF); raises on a wrong
    result."""
    import cupy
    import numpy as np

    with _tp_world(world) as (comm, a_of, b):
        a = a_of(comm.rank)
        a_all = np.concatenate([a_of(r) for r in range(comm.size)]).astype(np.float64)
        for controller in ("off", "pattern"):  # pushers only; odd GEMM CTAs pushing between their tiles
            with config.override(tp_controller=controller):
                out, gathered = mkernel.allgather_gemm(cupy.asarray(a), cupy.asarray(b), comm=comm, path="fused",
                                                       return_gathered=True, comm_sms=1)
            cupy.cuda.runtime.deviceSynchronize()
            comm.check()
            check_result(out, a_all @ b.astype(np.float64), f"allgather_gemm {controller}", 0.0)
            check_result(gathered, a_all, f"allgather_gemm {controller} gathered A", 0.0)


def target_tp_world():
    """The three fused TP kernels on MPI.COMM_WORLD (run it with 2 ranks: tools/sanitize.sh)."""
    from mpi4py import MPI

    target_gemm_reduce_scatter(MPI.COMM_WORLD)
    target_gemm_allreduce(MPI.COMM_WORLD)
    target_allgather_gemm(MPI.COMM_WORLD)


def target_ring_attention(nodes: int = 1):
    """Ring attention once per mask at a small ragged shape on MPI.COMM_WORLD (run it with 2 ranks:
    tools/sanitize.sh does; nodes=2: one emulated node per rank, host transport), against the
    single-GPU engine on the whole sequence; raises on a wrong result."""
    import cupy
    from mpi4py import MPI

    W0 = MPI.COMM_WORLD.Get_size()
    comm = init(MPI.COMM_WORLD, workspace_bytes=16 << 20, **(
        dict(gpus_per_node=W0 // nodes, transport="host") if nodes > 1 else {}))
    W, me = comm.size, comm.rank
    S, H, D = 130, 2, 64
    rng = cupy.random.default_rng(5)
    qg, kg, vg = (rng.standard_normal((S * W, H, D), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
    for causal in (False, True):
        ref = shard_sequence(_attn.attention(qg, kg, vg, causal=causal), me, W, causal=causal).astype(cupy.float32)
        q, k, v = (cupy.ascontiguousarray(shard_sequence(x, me, W, causal=causal)) for x in (qg, kg, vg))
        out = cupy.full(q.shape, float("nan"), dtype=cupy.float16)
        for _ in range(2):
            mkernel.ring_attention(q, k, v, comm=comm, causal=causal, out=out, comm_sms=2)
        cupy.cuda.get_current_stream().synchronize()
        comm.check()
        err = float(cupy.linalg.norm(out.astype(cupy.float32) - ref) / cupy.linalg.norm(ref))
        if not err < 1e-2:
            raise AssertionError(f"ring_attention causal={causal} rank {me} ({nodes} nodes): relative error {err:.2e}")
    comm.close()


def target_ring_attention_nodes():
    """target_ring_attention between 2 emulated nodes (run it with 2 ranks)."""
    target_ring_attention(nodes=2)


def target_moe():
    """Dispatch and combine once at world 1 (every expert local) with integer inputs; raises on a
    wrong result. tools/sanitize.sh runs it under compute-sanitizer."""
    import cupy
    import numpy as np
    from mpi4py import MPI

    comm = init(MPI.COMM_SELF, workspace_bytes=16 << 20)
    try:
        # Rows of 4112 bytes: two copier pieces each; 600 pairs: 3 CTAs (their barriers), 2 runs per warp.
        T, H, E, k = 300, 2056, 8, 2
        rng = np.random.default_rng(0)
        x = rng.integers(-3, 4, size=(T, H)).astype(np.float16)
        ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
        w = np.full((T, k), 0.5, dtype=np.float32)
        recv, h = mkernel.moe_dispatch(cupy.asarray(x), cupy.asarray(ids), cupy.asarray(w), comm=comm, num_experts=E)
        out = mkernel.moe_combine(recv, h, comm=comm)
        comm.check()
        want = x.astype(np.float64) * (0.5 * k)  # every pair returns its own token row
        if not np.array_equal(out.get().astype(np.float64), want):
            raise AssertionError("moe dispatch/combine: wrong result")
    finally:
        comm.close()


def _watch_status(comm, every_s: float):
    """Logs the communicator's error word every ``every_s`` seconds from a daemon thread (mapped host
    memory: no CUDA call), so a run stalled inside a kernel shows whether a timed wait has fired.
    Returns the function that stops it (before the communicator frees that memory)."""
    import threading

    stop = threading.Event()

    def watch():
        while not stop.wait(every_s):
            st = comm.sync.host_status
            log.info("error word: code %d, where 0x%x, peer %d, expected %d, seen %d, waited %.1f s", st.code, st.where,
                     st.peer, st.expected, st.seen, st.waited_ns / 1e9)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return lambda: (stop.set(), thread.join())


def _read_stalled(array, what: str):
    """``array`` (device) copied to the host on a side stream while the current stream's kernel is
    stalled, as numpy; None (logged) when the copy did not complete in 10 s."""
    import time

    import cupy
    import numpy as np

    side = cupy.cuda.Stream(non_blocking=True)
    host = cupy.cuda.alloc_pinned_memory(max(array.nbytes, 1))
    cupy.cuda.runtime.memcpyAsync(host.ptr, array.data.ptr, array.nbytes, cupy.cuda.runtime.memcpyDeviceToHost,
                                  side.ptr)
    until = time.monotonic() + 10
    while not side.done and time.monotonic() < until:
        time.sleep(0.1)
    if not side.done:
        log.info("%s: the copy did not complete in 10 s (the device is held)", what)
        return None
    return np.frombuffer(host, array.dtype, array.size).copy()


def _wait_reading_counters(comm, counters, every_s: float, tiles: int = 0, span0: int = 0):
    """Waits for the current stream; once the error word is set (a timed wait fired), copies the MoE
    counters (MOE_CNT_*) to the host on a side stream and logs them, and again 2 periods later: which
    of the return protocol's counts fell short, and whether they still move. With trace mode on, also
    which of the ``tiles`` GEMM tiles a consumer finished (its compute span from the span0-th on:
    mainloop and epilogue call returned) and in how many CTAs."""
    import time

    import cupy

    main = cupy.cuda.get_current_stream()
    looks, again = 0, None
    while not main.done and looks < 2:
        if comm.sync.host_status.code and (again is None or time.monotonic() >= again):
            # a second look 2 periods later tells a kernel still progressing (slowed by the tool) from a frozen one
            words = _read_stalled(counters, "counters")
            if words is None:
                return
            when = "at the stall" if looks == 0 else f"{2 * every_s:.0f} s later"
            log.info("counters %s: %s", when, ", ".join(f"{n} {int(v)}" for n, v in zip(_moe.CNT_NAMES, words)))
            if comm.trace.path:
                _log_stalled_spans(comm.trace, tiles, span0, when)
            looks, again = looks + 1, time.monotonic() + 2 * every_s
        time.sleep(min(every_s, 0.5))  # a run that ends is not held up by the watch's period


def _log_stalled_spans(trace, tiles: int, span0: int, when: str):
    """The compute spans (role 0, id = tile id) recorded from the span0-th on (the stalled kernel's):
    tiles finished, the first missing ones, the CTAs that finished any."""
    from mkernel.runtime import trace as _trace

    count = _read_stalled(trace.count, "trace count")
    if count is None:
        return
    n = min(int(count[0]), trace.capacity)
    raw = _read_stalled(trace.events[: n * _trace.WORDS], "trace events") if n else None
    spans = [] if raw is None else raw.reshape(n, _trace.WORDS)[span0:]
    count, missing, blocks = compute_span_summary(spans, tiles)
    log.info("compute spans %s: %d spans; tiles finished %d of %d, missing %s%s; CTAs with a span %d", when,
             count, tiles - len(missing), tiles, missing[:24], " ..." if len(missing) > 24 else "", blocks)


def compute_span_summary(spans, tiles: int):
    """(spans, tile ids in range(tiles) without a compute span, CTAs with one) of trace rows
    (start, end, sm << 32 | block, role << 32 | id)."""
    compute = [(int(w) & 0xFFFFFFFF, int(r) & 0xFFFFFFFF) for _, _, w, r in spans if int(r) >> 32 == 0]
    done = {t for _, t in compute}
    return len(spans), [t for t in range(tiles) if t not in done], len({b for b, _ in compute})


def target_moe_gemm(watch_s: float = 0):
    """The fused dispatch + GEMM once at world 1 with integer inputs (exact in fp32), then the fused
    GEMM + combine against the unfused one; raises on a wrong result. tools/sanitize.sh runs it under
    compute-sanitizer; watch_s > 0 logs each stage and the error word every watch_s seconds."""
    import cupy
    import numpy as np
    from mpi4py import MPI

    if watch_s > 0 and not os.environ.get("MKERNEL_TRACE"):  # spans say which GEMM tiles finished at a stall
        os.environ["MKERNEL_TRACE"] = os.path.join(tempfile.gettempdir(), "mkernel-sanitize-moe-{rank}.json")
    comm = init(MPI.COMM_SELF, workspace_bytes=32 << 20)
    stop_watch = _watch_status(comm, watch_s) if watch_s > 0 else lambda: None
    try:
        # Rows of 8320 bytes: two copier pieces each; 600 pairs over 3 dispatch CTAs (their barriers):
        # 2-3 runs per warp; 3 returning CTAs.
        T, H, F, E, k = 300, 4160, 72, 4, 2
        rng = np.random.default_rng(0)
        x = rng.integers(-2, 3, size=(T, H)).astype(np.float16)
        ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
        w = (rng.integers(-1, 2, size=(E, H, F)) * (rng.random((E, H, F)) < 0.02)).astype(np.float16)
        y, h = mkernel.moe_dispatch_gemm(cupy.asarray(x), cupy.asarray(ids), cupy.ones((T, k), dtype=cupy.float32),
                                 cupy.asarray(w), comm=comm, num_experts=E, comm_sms=3)
        if watch_s > 0:  # the host is past the launch (under the tool a launch may block until the kernel ends)
            log.info("target_moe_gemm: moe_dispatch_gemm launched")
        comm.check()
        rows = [(e, t) for e in range(E) for t in range(T) for j in range(k) if ids[t, j] == e]
        want = np.stack([x[t].astype(np.float64) @ w[e].astype(np.float64) for e, t in rows])
        assert np.abs(want).max() <= 2048  # integers fp16 holds exactly
        if not np.array_equal(y.get()[:len(rows)].astype(np.float64), want):
            raise AssertionError("moe_dispatch_gemm: wrong result")
        if watch_s > 0:
            log.info("target_moe_gemm: moe_dispatch_gemm done")
        w2 = (rng.integers(-1, 2, size=(E, F, H)) * (rng.random((E, F, H)) < 0.1)).astype(np.float16)
        group_rows = h.group_rows.get()  # before the launch: a copy after it would wait for it
        rows_back = int(group_rows.sum())
        tiles = int(sum(-(-int(r) // _gemm.BM) for r in group_rows)) * -(-H // _gemm.BN)  # the combine GEMM's tiles
        span0 = int(comm.trace.count.get()[0]) if comm.trace.path else 0
        fused = mkernel.moe_gemm_combine(y, cupy.asarray(w2), h, comm=comm, comm_sms=3, path="fused")
        if watch_s > 0:
            log.info("target_moe_gemm: fused moe_gemm_combine launched; %d rows to return", rows_back)
            _wait_reading_counters(comm, h._plan["counters"], watch_s, tiles, span0)
            cupy.cuda.get_current_stream().synchronize()
            log.info("target_moe_gemm: fused moe_gemm_combine done")
        unfused = mkernel.moe_gemm_combine(y, cupy.asarray(w2), h, comm=comm, path="unfused")
        comm.check()
        if not np.array_equal(fused.get().view(np.uint16), unfused.get().view(np.uint16)):
            raise AssertionError("moe_gemm_combine: the fused kernel differs from grouped_gemm + moe_combine")
    finally:
        stop_watch()
        comm.close()


def target_moe_nodes():
    """Dispatch, combine, the fused dispatch + GEMM and GEMM + combine once on MPI.COMM_WORLD as one
    emulated node per rank (run it with 2 ranks: tools/sanitize.sh does), integer inputs; raises on a
    wrong result."""
    import cupy
    import numpy as np
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    comm = init(world, gpus_per_node=1, transport="host", workspace_bytes=32 << 20)
    try:
        W, me = comm.size, comm.rank
        T, H, F, E, k = 70, 264, 72, 2 * W, 2  # 70 tokens: three warps' ranges, a partial one
        rng = np.random.default_rng(11 + me)
        x = rng.integers(-2, 3, size=(T, H)).astype(np.float16)
        ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
        w = np.full((T, k), 0.5, dtype=np.float32)
        cap = mkernel.moe_capacity(T, k, W)
        recv, h = mkernel.moe_dispatch(cupy.asarray(x), cupy.asarray(ids), cupy.asarray(w), comm=comm,
                                       num_experts=E, capacity=cap)
        out = mkernel.moe_combine(recv, h, comm=comm)
        cupy.cuda.runtime.deviceSynchronize()
        comm.check()
        if not np.array_equal(out.get().astype(np.float64), x.astype(np.float64) * (0.5 * k)):
            raise AssertionError(f"moe between nodes, rank {me}: wrong dispatch + combine")
        w1 = cupy.asarray(rng.integers(-1, 2, size=(E // W, H, F)).astype(np.float16))
        y, h = mkernel.moe_dispatch_gemm(cupy.asarray(x), cupy.asarray(ids), cupy.asarray(w), w1, comm=comm,
                                         num_experts=E, capacity=cap, comm_sms=2)
        y_blocks = mkernel.grouped_gemm(recv, w1, h.group_rows)
        cupy.cuda.runtime.deviceSynchronize()
        comm.check()
        n = int(h.received())
        if not np.array_equal(y.get()[:n].view(np.uint16), y_blocks.get()[:n].view(np.uint16)):
            raise AssertionError(f"moe_dispatch_gemm between nodes, rank {me}: differs from its blocks")
        w2 = cupy.asarray(rng.integers(-1, 2, size=(E // W, F, H)).astype(np.float16))
        z = {p: mkernel.moe_gemm_combine(y, w2, h, comm=comm, path=p, comm_sms=2) for p in ("unfused", "fused")}
        cupy.cuda.runtime.deviceSynchronize()
        comm.check()
        if not np.array_equal(z["fused"].get().view(np.uint16), z["unfused"].get().view(np.uint16)):
            raise AssertionError(f"moe_gemm_combine between nodes, rank {me}: fused differs from unfused")
    finally:
        comm.close()


@contextlib.contextmanager
def _tp_world(world):
    """(communicator, a of rank r, b): small integer inputs off the tile grid in every dimension, exact
    in fp16 at any world size up to 4 (|a| <= 3, |b| <= 1, K = 136)."""
    import numpy as np
    from mpi4py import MPI

    comm = init(world or MPI.COMM_SELF, workspace_bytes=16 << 20)
    M, K, N = 200, 136, 264
    base = np.random.default_rng(0).integers(-2, 3, size=(M, K))
    b = np.random.default_rng(1).integers(-1, 2, size=(K, N)).astype(np.float16)
    try:
        yield comm, lambda r: (base + r % 2).astype(np.float16), b
    finally:
        comm.close()


def _tp_reduce(op_fn, world):
    import cupy
    import numpy as np

    with _tp_world(world) as (comm, a_of, b):
        a = a_of(comm.rank)
        M = a.shape[0] - a.shape[0] % comm.size  # rows split evenly among the ranks
        full = sum(a_of(r)[:M].astype(np.float64) for r in range(comm.size)) @ b.astype(np.float64)
        rows = M // comm.size
        want = full if op_fn is mkernel.gemm_allreduce else full[comm.rank * rows:(comm.rank + 1) * rows]
        # dedicated reducers only; the GEMM CTAs joining them (in registers, then staged in the GEMM's
        # freed stages); odd GEMM CTAs reducing between tiles
        for join, staged, controller in ((False, False, "off"), (True, False, "off"), (True, True, "off"),
                                         (False, False, "pattern")):
            with config.override(tp_controller=controller, tp_join_staged=staged):
                out = op_fn(cupy.asarray(a[:M]), cupy.asarray(b), comm=comm, path="fused", join=join, comm_sms=1)
            cupy.cuda.runtime.deviceSynchronize()
            comm.check()
            check_result(out, want, f"{op_fn.__name__} join={join} join_staged={staged} controller={controller}",
                            0.0)


# world 1 (tools/sanitize_targets.py runs these); ring attention and MoE between nodes need 2 ranks
# (tools/sanitize.sh runs them under mpiexec -n 2)
WORLD1 = (target_gemm, target_gemm_decode, target_attention, target_gemm_reduce_scatter, target_gemm_allreduce,
          target_allgather_gemm, target_moe, target_moe_gemm)
