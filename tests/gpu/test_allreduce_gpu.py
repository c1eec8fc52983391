"""GPU: mkernel.allreduce (LL words, one-shot and two-shot, inside a node) at any rank count (1-rank pass, the 2- and
4-rank passes under MPS). Every output poisoned with NaN first; random inputs against the float64
sum (relative error below 1e-2) and the same bits on every rank; integer inputs exact; bf16, fp16
and fp32; sizes from one element to several chunks, off the vector and chunk grids, 1-D and 2-D;
three launches of each size interleaved with the others (stale flags and counters); in place;
unaligned views; typed errors before anything launches."""

import hashlib

import numpy as np
import pytest

import mkernel
from mkernel.comm.collectives import allgather_object
from mkernel.ops import gemm_allreduce_ll as ll

from tests.helpers.arrays import DTYPES, bits, dev, host, poison, poisoned
from tests.helpers.ranks import all_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]
SHAPES = [(1,), (7,), (8,), (1000,), (1001,), (8192,), (8193,), (8200,), (3, 8192 + 67), (64, 8192), (524300,)]
KINDS = {"bf16": DTYPES["bf16"], "fp16": DTYPES["fp16"], "f32": np.dtype(np.float32)}
MODES = {  # every size as LL words, as one-shot data + flags, or as two-shot data + flags at any world
    "ll": {"allreduce_ll_max_bytes": 1 << 40},
    "flags": {"allreduce_ll_max_bytes": 0, "allreduce_twoshot_min_bytes": 0, "allreduce_twoshot_min_bytes_2ranks": 0},
    "twoshot": {"allreduce_ll_max_bytes": 0, "allreduce_twoshot_min_bytes": 1, "allreduce_twoshot_min_bytes_2ranks": 1},
}


def _mode(mode):
    from mkernel import config

    return config.override(**MODES[mode])


def _x(seed, rank, shape, dt, integer):
    rng = np.random.default_rng([seed, rank])
    v = rng.integers(-8, 9, shape).astype(np.float64) if integer else rng.standard_normal(shape)
    return v.astype(dt).astype(np.float64)


@pytest.mark.parametrize("kind", list(KINDS))
def test_sums_every_rank_in_rank_order_the_same_bits_everywhere(comm, kind):
    """Exact integer and random sums of many sizes (odd counts: a partial last LL word or vector),
    three launches each, as LL words, one-shot and two-shot data + flags: the same bits on every rank
    and in every mode (the same fp32 sums in rank order, rounded once)."""
    dt = KINDS[kind]
    msgs, digests = [], {m: [] for m in MODES}
    for mode in MODES:
        with _mode(mode):
            for rep in range(3):
                _sums(comm, dt, kind, f"{mode} launch {rep}", msgs, digests[mode])
    if len({tuple(d) for d in digests.values()}) != 1:
        msgs.append(f"{kind}: the LL, one-shot and two-shot modes' bits differ")
    assert all_ranks(comm.mpi, not msgs), msgs[:6]


def _sums(comm, dt, kind, launch, msgs, digests):
    import cupy

    W = comm.size
    for i, shape in enumerate(SHAPES):
        for integer in (True, False):
            xs = [_x(i * 2 + integer, r, shape, dt, integer) for r in range(W)]
            out = poisoned(shape, kind)
            mkernel.allreduce(dev(xs[comm.rank].astype(dt)), comm=comm, out=out)
            cupy.cuda.get_current_stream().synchronize()
            comm.check()
            got = host(out).astype(np.float64)
            want = sum(xs)
            what = f"{shape} {kind} {'integer' if integer else 'random'} {launch}"
            if integer and not np.array_equal(got, want.astype(dt).astype(np.float64)):
                msgs.append(f"{what}: {int((got != want).sum())} elements differ")
            err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
            if not np.isfinite(got).all() or err > 1e-2:
                msgs.append(f"{what}: relative error {err:.3g}")
            digest = hashlib.sha256(bits(out).tobytes()).hexdigest()
            digests.append(digest)
            if len(set(allgather_object(comm.mpi, digest, "comparing bits", 60))) != 1:
                msgs.append(f"{what}: ranks hold different bits")


def test_returns_a_new_array_by_default(comm):
    x = dev(_x(9, comm.rank, (16, 8), DTYPES["bf16"], True).astype(DTYPES["bf16"]))
    y = mkernel.allreduce(x, comm=comm)
    assert y.shape == x.shape and y.dtype == x.dtype and y.data.ptr != x.data.ptr


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("where", ["in place", "unaligned"])
def test_in_place_and_unaligned_views(comm, where, mode):
    """out=x sums in place (each chunk is sent before it is overwritten); views that start 2 bytes
    into an allocation go through an aligned copy. Exact integer inputs, the same bits everywhere."""
    import cupy

    dt, W, n = DTYPES["bf16"], comm.size, 3 * 8192 + 5
    msgs = []
    with _mode(mode):
        for rep in range(3):
            xs = [_x(20 + rep, r, (n,), dt, True) for r in range(W)]
            want = sum(xs).astype(dt)
            if where == "in place":
                x = dev(xs[comm.rank].astype(dt))
                got_arr = mkernel.allreduce(x, comm=comm, out=x)
                ok_ptr = got_arr is x
            else:
                big = dev(np.concatenate([[0.0], xs[comm.rank]]).astype(dt))
                outbig = poisoned((n + 1,), "bf16")
                got_arr = mkernel.allreduce(big[1:], comm=comm, out=outbig[1:])
                ok_ptr = got_arr.data.ptr == outbig.data.ptr + 2
            cupy.cuda.get_current_stream().synchronize()
            comm.check()
            got = host(got_arr)
            if not ok_ptr or not np.array_equal(got.view(np.uint16), want.view(np.uint16)):
                msgs.append(f"{where} launch {rep}: {int((got != want).sum())} of {n} differ")
            digest = hashlib.sha256(bits(cupy.ascontiguousarray(got_arr)).tobytes()).hexdigest()
            if len(set(allgather_object(comm.mpi, digest, "comparing bits", 60))) != 1:
                msgs.append(f"{where} launch {rep}: ranks hold different bits")
    assert all_ranks(comm.mpi, not msgs), msgs[:6]


def test_shapes_or_dtypes_that_disagree_across_ranks_raise_on_every_rank(comm):
    """Rank r passes 64 + 8r elements, then rank r's own dtype: ArgumentError everywhere, nothing
    launched; the gemm_allreduce latency path likewise (rows differing by rank)."""
    import cupy

    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    e0 = comm.sync.epoch()
    cases = {"size": lambda: mkernel.allreduce(cupy.zeros(64 + 8 * comm.rank, DTYPES["bf16"]), comm=comm),
             "dtype": lambda: mkernel.allreduce(cupy.zeros(64, (DTYPES["bf16"], DTYPES["fp16"])[comm.rank % 2]),
                                                comm=comm),
             "latency rows": lambda: mkernel.gemm_allreduce(
                 cupy.zeros((1 + comm.rank, 64), DTYPES["bf16"]), cupy.zeros((128, 64), DTYPES["bf16"]).T,
                 comm=comm, path="latency")}
    missed = []
    for name, call in cases.items():
        try:
            call()
            missed.append(name)
        except mkernel.ArgumentError:
            pass
    cupy.cuda.get_current_stream().synchronize()
    assert all_ranks(comm.mpi, not missed and comm.sync.epoch() == e0), (missed, comm.sync.epoch(), e0)


@pytest.mark.parametrize("bad", ["empty", "dtype", "strided", "out shape", "overlap"])
def test_bad_arguments_raise_before_launch(comm, bad):
    import cupy

    x = cupy.zeros(64, dtype=DTYPES["bf16"])
    kwargs = {}
    if bad == "empty":
        x = cupy.zeros(0, dtype=DTYPES["bf16"])
    elif bad == "dtype":
        x = cupy.zeros(64, dtype=cupy.int32)
    elif bad == "strided":
        x = cupy.zeros(128, dtype=DTYPES["bf16"])[::2]
    elif bad == "out shape":
        kwargs["out"] = cupy.zeros(32, dtype=DTYPES["bf16"])
    else:
        big = cupy.zeros(72, dtype=DTYPES["bf16"])
        x, kwargs["out"] = big[:64], big[8:]
    with pytest.raises(mkernel.ArgumentError):
        mkernel.allreduce(x, comm=comm, **kwargs)


@pytest.mark.parametrize("mode", ["default", "twoshot"])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("M", [1, 5, 64])
def test_gemm_allreduce_latency_path(comm, M, strided, mode):
    """gemm_allreduce(path='latency'): this rank's partial by mkernel.gemm into its slot of the
    one-shot all-reduce (twoshot: of the two-shot one, the GEMM path forced), then the all-reduce;
    against the float64 sum, the same bits on every rank, into a contiguous out and a strided one
    (three launches each)."""
    import contextlib

    from mkernel import config
    from mkernel.ops import allreduce as _ar

    W = comm.size
    if W == 1:
        pytest.skip("the latency path sums over 2 or more ranks")
    N, K, dt = 1032, 264, DTYPES["bf16"]
    a = [_x(40 + M, r, (M, K), dt, False) for r in range(W)]
    w = [_x(50 + M, r, (N, K), dt, False) / np.sqrt(K) for r in range(W)]
    w = [x.astype(dt).astype(np.float64) for x in w]
    want = sum(a[r] @ w[r].T for r in range(W))
    results = []
    forced = config.override(tp_latency_ll_max_rows=0, **MODES["twoshot"]) if mode == "twoshot" else None
    with forced or contextlib.nullcontext():
        for _ in range(3):  # repeated launches: stale flags, the slot rewritten by the next GEMM
            results.append(_latency_once(comm, a, w, want, M, N, dt, strided))
    # forced: the all-reduce from the slot ran the two-shot plan (by default few rows take the LL kernels)
    took = mode != "twoshot" or _ar.plan_key(M * N, np.dtype(dt), "twoshot") in comm.plans
    ok = took and all(r[0] and r[1] and r[2] < 1e-2 and r[3] for r in results) and len({r[4] for r in results}) == 1
    assert all_ranks(comm.mpi, ok), (took, results)


def _latency_once(comm, a, w, want, M, N, dt, strided):
    """One gemm_allreduce(path="latency") call: (out used, finite, rel. error, same bits on every
    rank, digest)."""
    import cupy

    wide = poisoned((M, N + 8), "bf16")
    out = wide[:, :N] if strided else poisoned((M, N), "bf16")
    got_arr = mkernel.gemm_allreduce(dev(a[comm.rank].astype(dt)), dev(w[comm.rank].astype(dt)).T, comm=comm,
                                     path="latency", out=out)
    cupy.cuda.get_current_stream().synchronize()
    comm.check()
    got = host(got_arr).astype(np.float64)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    digest = hashlib.sha256(bits(cupy.ascontiguousarray(got_arr)).tobytes()).hexdigest()
    same = len(set(allgather_object(comm.mpi, digest, "comparing bits", 60))) == 1
    return got_arr is out, bool(np.isfinite(got).all()), err, same, digest


@pytest.mark.parametrize("mode", list(MODES))
def test_captured_in_a_cuda_graph_and_replayed_a_thousand_times(comm, mode):
    """mkernel.allreduce captured once on every rank and replayed 1000 times (the epochs live on
    the device): exact integer sums each time, the same bits on every rank."""
    import cupy

    W, n = comm.size, 3 * 8192 + 40
    xs = [_x(70, r, (n,), DTYPES["bf16"], True) for r in range(W)]
    want = sum(xs).astype(DTYPES["bf16"])
    x = dev(xs[comm.rank].astype(DTYPES["bf16"]))
    out = cupy.empty_like(x)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream, _mode(mode):
        mkernel.allreduce(x, comm=comm, out=out)  # the shape's first call (agreement, plan) outside
        stream.synchronize()
        stream.begin_capture()
        mkernel.allreduce(x, comm=comm, out=out)
        graph = stream.end_capture()
        want_d = dev(want)
        bad = cupy.zeros((), cupy.int64)
        for _ in range(1000):
            graph.launch(stream)
            bad += cupy.count_nonzero(out.view(cupy.uint16) != want_d.view(cupy.uint16))
        stream.synchronize()
    comm.check()
    assert all_ranks(comm.mpi, int(bad) == 0), int(bad)


@pytest.mark.parametrize("M", [1, 7, 16, 41, 128])
def test_fused_latency_kernels_give_the_two_kernel_paths_bits(comm, M):
    """gemm_allreduce at few rows takes the fused latency kernels (the decode GEMM pushing LL words,
    then their sum, launched after the GEMM or overlapping its tail): the same bits as the decode
    GEMM (taking up to M rows here) followed by mkernel.allreduce, on every rank, over repeated
    launches (stale LL words of earlier launches); exact integer sums; strided out."""
    import cupy

    from mkernel import config

    W = comm.size
    if W == 1:
        pytest.skip("the latency path sums over 2 or more ranks")
    N, K, dt = 1032, 2056, DTYPES["bf16"]  # several ranges of K: the push comes from the last CTA of each

    def ints(seed, r, shape):  # {-1, 0, 1}: every rank's partial stays an integer bf16 holds exactly
        return np.random.default_rng([seed, r]).integers(-1, 2, shape).astype(np.float64)

    msgs = []
    for integer in (True, False):
        a = [ints(80 + M, r, (M, K)) if integer else _x(80 + M, r, (M, K), dt, False) for r in range(W)]
        w = [ints(90 + M, r, (N, K)) if integer else _x(90 + M, r, (N, K), dt, False) / np.sqrt(K) for r in range(W)]
        w = [x.astype(dt).astype(np.float64) for x in w]
        a_d, w_d = dev(a[comm.rank].astype(dt)), dev(w[comm.rank].astype(dt))
        outs = {}
        for fused in (True, "overlapped", False):  # the sum kernel launched after the GEMM, or overlapping it
            with config.override(tp_latency_ll_max_rows=ll.M_TILES[-1] if fused else 0,
                                 tp_latency_ll_overlap=fused == "overlapped",
                                 gemm_decode_max_m=max(M, config.get().gemm_decode_max_m)):  # both GEMMs decode
                for rep in range(3):
                    wide = poisoned((M, N + 8), "bf16")
                    mkernel.gemm_allreduce(a_d, w_d.T, comm=comm, out=wide[:, :N], path="latency")
                    cupy.cuda.get_current_stream().synchronize()
                    comm.check()
                    got = bits(cupy.ascontiguousarray(wide[:, :N]))
                    if (fused, 0) in outs and not np.array_equal(outs[fused, 0], got):
                        msgs.append(f"M {M} fused {fused} launch {rep}: not the bits of launch 0")
                    outs.setdefault((fused, 0), got)
        for fused in (True, "overlapped"):
            if not np.array_equal(outs[fused, 0], outs[False, 0]):
                msgs.append(f"M {M} integer {integer} {fused}: the fused kernels' bits differ from the two-kernel "
                            f"path's")
        want = sum(a[r] @ w[r].T for r in range(W))
        got = host(dev(outs[True, 0]).view(dt)).astype(np.float64)
        if integer and not np.array_equal(got, want.astype(dt).astype(np.float64)):
            msgs.append(f"M {M}: integer sums not exact ({int((got != want).sum())} differ)")
        if not integer and np.linalg.norm(got - want) / np.linalg.norm(want) > 1e-2:
            msgs.append(f"M {M}: relative error {np.linalg.norm(got - want) / np.linalg.norm(want):.3g}")
        digest = hashlib.sha256(outs[True, 0].tobytes()).hexdigest()
        if len(set(allgather_object(comm.mpi, digest, "comparing bits", 60))) != 1:
            msgs.append(f"M {M} integer {integer}: ranks hold different bits")
    assert all_ranks(comm.mpi, not msgs), msgs[:6]


@pytest.mark.parametrize("M,overlap", [(4, False), (4, True), (48, False), (100, False)])
def test_repeated_calls_launch_what_their_first_call_recorded(comm, M, overlap):
    """A call repeated on the same arrays (new values in them) only launches what its first call
    recorded (comm.plans): gemm_allreduce's latency path (M 4, 48: the fused kernels; M 100: the
    GEMM engine, then the all-reduce) and mkernel.allreduce, exact integer sums over 12 calls, outputs
    poisoned before each, through a release of every plan (the records go with them) halfway; from
    each half's second call on, every call is recorded. The fused kernels' sum also launched overlapped."""
    import cupy

    from mkernel import config

    W = comm.size
    if W == 1:
        pytest.skip("the latency path sums over 2 or more ranks")
    N, K, dt, HALF = 1032, 2056, DTYPES["bf16"], 6

    def ints(seed, r, shape):  # float32 holds every sum exactly (|sum| <= K W < 2^24), at half float64's cost
        return np.random.default_rng([seed, r]).integers(-1, 2, shape).astype(np.float32)

    w = [ints(60, r, (N, K)) for r in range(W)]
    a_d, w_d = cupy.empty((M, K), dt), dev(w[comm.rank].astype(dt))
    out, x, x_out = cupy.empty((M, N), dt), cupy.empty((M, N), dt), cupy.empty((M, N), dt)
    from mkernel.ops import calls as op_calls

    keys = {"gemm_allreduce": op_calls.call_key(comm, "gemm_allreduce", None, (a_d, w_d.T, out),
                                          (None, None, True, "latency", None)),
            "allreduce": op_calls.call_key(comm, "allreduce", None, (x, x_out), ())}
    msgs = []
    with config.override(tp_latency_ll_overlap=overlap):
        for i in range(2 * HALF):
            if i == HALF:
                comm.release_plans()
            a = [ints(100 + i, r, (M, K)) for r in range(W)]
            xs = [ints(200 + i, r, (M, N)) for r in range(W)]
            a_d[...] = dev(a[comm.rank].astype(dt))
            x[...] = dev(xs[comm.rank].astype(dt))
            poison(out)
            poison(x_out)
            mkernel.gemm_allreduce(a_d, w_d.T, comm=comm, out=out, path="latency")
            mkernel.allreduce(x, comm=comm, out=x_out)
            cupy.cuda.get_current_stream().synchronize()
            comm.check()
            want = sum(a[r] @ w[r].T for r in range(W)).astype(dt).astype(np.float64)
            if not np.array_equal(host(out).astype(np.float64), want):
                msgs.append(f"call {i}: gemm_allreduce not exact")
            if not np.array_equal(host(x_out).astype(np.float64), sum(xs).astype(dt).astype(np.float64)):
                msgs.append(f"call {i}: allreduce not exact")
            recorded = {op: comm.plans.launches(k) is not None for op, k in keys.items()}
            # a round's first calls may grow the scratch, which releases the plans (and records) before it
            if i % HALF and not all(recorded.values()):
                msgs.append(f"call {i}: recorded {recorded}")
    assert all_ranks(comm.mpi, not msgs), msgs[:6]
