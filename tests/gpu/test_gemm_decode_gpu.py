"""GPU: mkernel.gemm's decode path (few rows against weights as [N, K]; mkernel/engines/gemm_decode.py).

Against float64 on fresh random inputs (relative Frobenius error below 1e-2), every output poisoned
with NaN first; exact integer-valued inputs ({-1, 0, 1}, K <= 256: every sum exact in fp32 and in
bf16) compared bit for bit per 16 x 128 tile; one K range and several; off-grid M, N and K; strided
A and output; float32 outputs and accumulate; three launches bitwise equal (the arrival counters
reset), back to back with other shapes; the path really taken."""

import numpy as np
import pytest

import mkernel
from mkernel import config
from mkernel.engines import gemm as engine
from mkernel.engines import gemm_decode as dec

from tests.helpers.arrays import BF16, DTYPES, bits, dev, host, poison, poisoned

REL_TOL = 1e-2


def _inputs(seed, M, N, K, dt, integer):
    rng = np.random.default_rng(seed)
    if integer:
        a, w = rng.integers(-1, 2, (M, K)).astype(np.float64), rng.integers(-1, 2, (N, K)).astype(np.float64)
    else:
        a, w = rng.standard_normal((M, K)), rng.standard_normal((N, K)) / np.sqrt(K)
    a, w = a.astype(dt).astype(np.float64), w.astype(dt).astype(np.float64)  # the values the kernel sees
    return a, w


def _rel(got, ref):
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def _run(a64, w64, dt, out_kind=None, accumulate=False, start=None, a_pad=0, out_pad=0):
    """mkernel.gemm(a, w.T) with a's rows and out's rows padded by a_pad / out_pad elements."""
    import cupy

    M, K = a64.shape
    N = w64.shape[0]
    a_full = dev(np.pad(a64, ((0, 0), (0, a_pad))).astype(dt))
    a = a_full[:, :K]
    w = dev(w64.astype(dt))
    kind = out_kind or ("bf16" if dt == BF16 else "fp16")
    out_full = poisoned((M, N + out_pad), kind)
    if start is not None:
        out_full[...] = dev(start.astype(out_full.dtype))
    out = out_full[:, :N]
    mkernel.gemm(a, w.T, out=out, accumulate=accumulate)
    cupy.cuda.get_current_stream().synchronize()
    return out


@pytest.fixture
def decode_calls(monkeypatch):
    """Counts the launches that took the decode path."""
    calls = []
    real = engine._launch_decode
    monkeypatch.setattr(engine, "_plans", engine.PlanCache())  # no launch plan of an earlier test is reused

    def spy(*args, **kwargs):
        calls.append(kwargs.get("M"))
        return real(*args, **kwargs)
    monkeypatch.setattr(engine, "_launch_decode", spy)
    return calls


SHAPES = [(1, 8192, 8192), (3, 264, 136), (8, 4096, 2048), (13, 1000, 1032), (16, 520, 4104), (31, 8200, 1032),
          (33, 1024, 8192), (64, 2048, 512), (64, 136, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_random_inputs_against_float64(M, N, K, kind, decode_calls):
    dt = DTYPES[kind]
    a, w = _inputs(M * N + K, M, N, K, dt, integer=False)
    got = host(_run(a, w, dt)).astype(np.float64)
    ref = a @ w.T
    assert np.isfinite(got).all(), "NaN left in the output (a row or column not written)"
    rows = dec.row_block(N, K)
    assert _rel(got, ref) < REL_TOL, (M, N, K, kind, _rel(got, ref), rows, dec.runs(N, K, rows))
    assert decode_calls == [M]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 4096, 256), (7, 1032, 136), (64, 264, 248), (17, 8200, 256)])
@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_integer_inputs_bitwise_per_tile(M, N, K, kind):
    dt = DTYPES[kind]
    a, w = _inputs(7 + M, M, N, K, dt, integer=True)
    got = bits(_run(a, w, dt))
    want = (a @ w.T).astype(dt).view(np.uint16)
    bad = [(i, j) for i in range(0, M, 16) for j in range(0, N, 128)
           if not np.array_equal(got[i:i + 16, j:j + 128], want[i:i + 16, j:j + 128])]
    assert not bad, f"tiles (row, column) differing: {bad[:8]}"


@pytest.mark.gpu
@pytest.mark.parametrize("rows", dec.ROW_BLOCKS)
@pytest.mark.parametrize("M,N,K", [(40, 1032, 2048), (65, 4096, 1024), (100, 264, 4104), (128, 8200, 1032),
                                   (129, 520, 2056), (256, 264, 4104)])
def test_wide_token_tiles_exact(M, N, K, rows, decode_calls):
    """M up to 256 by the knob (shapes whose runs fill the SMs: gemm_decode.eligible), every token
    in one CTA's wgmma (tiles of 64 .. 256 columns): integer inputs exact, every token's row written."""
    a, w = _inputs(21 + M, M, N, K, BF16, integer=True)
    with config.override(gemm_decode_max_m=256, gemm_decode_rows=rows):
        got = bits(_run(a, w, BF16))
    assert np.array_equal(got, (a @ w.T).astype(BF16).view(np.uint16)), (M, N, K, rows)
    assert decode_calls == [M]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(96, 4096, 8192), (200, 1000, 1032), (256, 8192, 2048)])
@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_wide_token_tiles_against_float64(M, N, K, kind, decode_calls):
    dt = DTYPES[kind]
    a, w = _inputs(5 * M + K, M, N, K, dt, integer=False)
    with config.override(gemm_decode_max_m=256):
        got = host(_run(a, w, dt)).astype(np.float64)
    assert np.isfinite(got).all()
    assert _rel(got, a @ w.T) < REL_TOL, (M, N, K, kind, _rel(got, a @ w.T))
    assert decode_calls == [M]


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [{"gemm_decode_rows": 64}, {"gemm_decode_rows": 128},
                                   {"gemm_decode_split": "stream"}])
@pytest.mark.parametrize("M,N,K", [(1, 4096, 8192), (24, 1032, 4104), (64, 520, 2056)])
def test_row_block_and_split_variants_exact(M, N, K, knobs, decode_calls):
    """The benchmark's variants (row blocks of 64 and of 128; stream-K's equal runs): integer
    inputs exact."""
    a, w = _inputs(41 + M, M, N, K, BF16, integer=True)
    with config.override(**knobs):
        got = bits(_run(a, w, BF16))
    assert np.array_equal(got, (a @ w.T).astype(BF16).view(np.uint16)), (M, N, K, knobs)
    assert decode_calls == [M]


# Copies n 16-bit words src -> dst after spinning `ns` nanoseconds: a kernel still running (and
# about to write the GEMM's A) when an overlapped launch's CTAs start.
SLOW_COPY = r"""extern "C" __global__ void slow_copy(const unsigned short* src, unsigned short* dst,
                                           unsigned long long n, unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    dst[i] = src[i];
}"""


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(8, 4096, 2048), (64, 8192, 1024), (256, 1024, 2048), (300, 1000, 520)])
def test_an_overlapped_launch_reads_what_the_kernel_before_wrote(M, N, K, monkeypatch):
    """config.gemm_overlap: mkernel.gemm's kernel (decode; the engine's past the decode path's rows:
    the last two) launched while the kernel before it (which writes its A after 200 us) still runs
    reads the new A: the bits of a plain launch on it, three calls in a row (a kept plan's replays)."""
    import cupy

    a_old, w = _inputs(31 + M, M, N, K, BF16, integer=False)
    a_new, _ = _inputs(32 + M, M, N, K, BF16, integer=False)
    w_d, src, old = dev(w.astype(BF16)), dev(a_new.astype(BF16)), dev(a_old.astype(BF16))
    a_d, out = old.copy(), poisoned((M, N), "bf16")
    words = [x.view(cupy.uint16) for x in (src, a_d, old)]  # bf16 moved as its bits (any CuPy)
    mkernel.gemm(src, w_d.T, out=out)
    want = bits(out)
    assert not np.array_equal(want, bits(_run(a_old, w, BF16))), "the two inputs give the same output"
    seen = []
    real = engine.launch
    monkeypatch.setattr(engine, "launch", lambda *a, **kw: seen.append(kw.get("overlapped")) or real(*a, **kw))
    monkeypatch.setattr(engine, "_plans", engine.PlanCache())
    slow = cupy.RawKernel(SLOW_COPY, "slow_copy")
    with config.override(gemm_overlap=True):
        for _ in range(3):
            words[1][...] = words[2]
            poison(out)
            slow((4,), (256,), (words[0], words[1], np.uint64(M * K), np.uint64(200_000)))
            mkernel.gemm(a_d, w_d.T, out=out)
            cupy.cuda.get_current_stream().synchronize()
            assert np.array_equal(bits(out), want), "the overlapped GEMM read A before the kernel before wrote it"
    assert seen == [True], seen  # built once, overlapped; then its plan replayed


@pytest.mark.gpu
@pytest.mark.parametrize("rows", dec.ROW_BLOCKS)
@pytest.mark.parametrize("M,N,K,kind", [(17, 1000, 1032, "bf16"), (29, 8200, 2048, "fp16"), (64, 264, 4104, "bf16"),
                                        (100, 4096, 1024, "bf16"), (128, 1032, 8192, "fp16")])
def test_sixteen_bit_outputs_leave_by_tma_store(M, N, K, kind, rows, decode_calls):
    """A finished 16-bit block leaves through shared memory and one TMA store per warp
    (MK_DECODE_TMA_OUT): the fp32 output's bits rounded once, and nothing past m or n written (out is
    a view: the rows and columns beyond it stay poisoned)."""
    import cupy

    dt = DTYPES[kind]
    a, w = _inputs(7 + M, M, N, K, dt, integer=False)
    with config.override(gemm_decode_rows=rows):
        full = poisoned((M + 3, N + 8), kind)
        out = full[:M, :N]
        assert dec.tma_out(0 if kind == "bf16" else 1, dec.m_tile(M), rows, False)
        mkernel.gemm(dev(a.astype(dt)), dev(w.astype(dt)).T, out=out)
        cupy.cuda.get_current_stream().synchronize()
        wide = host(_run(a, w, dt, out_kind="f32"))
    assert decode_calls == [M, M]
    got = host(full)
    np.testing.assert_array_equal(got[:M, :N].view(np.uint16), wide.astype(dt).view(np.uint16))
    assert np.isnan(got[M:].astype(np.float64)).all() and np.isnan(got[:, N:].astype(np.float64)).all()
    assert _rel(got[:M, :N].astype(np.float64), a @ w.T) < REL_TOL


@pytest.mark.gpu
def test_several_k_ranges_are_taken_and_reduced_in_order():
    M, N, K = 5, 256, 16384  # 2 row blocks: many CTAs share each
    assert dec.runs(N, K, dec.row_block(N, K))[1] > 1
    a, w = _inputs(3, M, N, K, BF16, integer=False)
    outs = [bits(_run(a, w, BF16)) for _ in range(3)]  # the counters reset: launches 2 and 3 reduce too
    assert all(np.array_equal(outs[0], o) for o in outs[1:]), "not bitwise equal from launch to launch"
    got = host(_run(a, w, BF16)).astype(np.float64)
    assert _rel(got, a @ w.T) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
def test_float32_output_accumulate_and_strides(split):
    M, N, K = 9, 392, 8192 if split else 256
    a, w = _inputs(11, M, N, K, BF16, integer=False)
    start = np.random.default_rng(5).standard_normal((M, N + 24)).astype(np.float32)
    got = host(_run(a, w, BF16, out_kind="f32", accumulate=True, start=start, a_pad=40, out_pad=24))
    ref = start[:, :N] + a @ w.T
    assert _rel(got.astype(np.float64), ref) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(37, 1032, 2048), (100, 4096, 4096), (128, 264, 8192)])
def test_bf16_accumulate_many_token_blocks(M, N, K):
    """accumulate=True at tiles of several read groups (ragged M and N): out = start + a @ w.T, bitwise
    on integer inputs (the fp32 sum exact, rounded to bf16 once), within REL_TOL on random ones."""
    for integer in (True, False):
        a, w = _inputs(21 + M, M, N, K if not integer else 256, BF16, integer=integer)
        rng = np.random.default_rng(M)
        shape = (M, N + 8)  # out's rows padded by 8 elements
        start = rng.integers(-8, 9, shape).astype(np.float64) if integer else rng.standard_normal(shape)
        got = host(_run(a, w, BF16, accumulate=True, start=start, out_pad=8)).astype(np.float64)
        ref = start[:, :N].astype(BF16).astype(np.float64) + a @ w.T
        if integer:
            np.testing.assert_array_equal(got, ref.astype(BF16).astype(np.float64))
        else:
            assert _rel(got, ref) < REL_TOL


@pytest.mark.gpu
def test_back_to_back_shapes_stay_exact():
    """Shapes interleaved on one stream (one workspace, grown and reused): each bitwise as alone."""
    shapes = [(4, 4096, 8192), (40, 264, 136), (1, 1024, 16384), (4, 4096, 8192)]
    alone = {}
    for M, N, K in shapes:
        a, w = _inputs(100 + M, M, N, K, BF16, integer=False)
        got = bits(_run(a, w, BF16))
        if (M, N, K) in alone:
            assert np.array_equal(alone[M, N, K], got), (M, N, K)
        alone[M, N, K] = got
        assert _rel(host(_run(a, w, BF16)).astype(np.float64), a @ w.T) < REL_TOL


@pytest.mark.gpu
def test_knob_off_and_kn_layout_take_the_engine(decode_calls):
    a, w = _inputs(2, 8, 512, 256, BF16, integer=False)
    with config.override(gemm_decode_max_m=0):
        got = host(_run(a, w, BF16)).astype(np.float64)
    assert decode_calls == [] and _rel(got, a @ w.T) < REL_TOL
    import cupy

    b_kn = dev(np.ascontiguousarray(w.T).astype(BF16))  # [K, N] row-major
    out = cupy.empty((8, 512), dtype=BF16)
    mkernel.gemm(dev(a.astype(BF16)), b_kn, out=out)
    assert decode_calls == [] and _rel(host(out).astype(np.float64), a @ w.T) < REL_TOL


# The knob off by default (the overlapped launch) runs the long tests too.
KNOBS_OFF_BY_DEFAULT = [{}, {"gemm_overlap": True}]


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", KNOBS_OFF_BY_DEFAULT, ids=["default", "overlap"])
def test_thousand_launches_alternating_decode_and_large_shapes_stay_exact(knobs):
    """1000 launches on one stream alternating decode shapes (split K: counters reset by the last
    CTA) and an engine shape: every output bitwise equal to its shape's first (integer inputs),
    counted on the device, checked once at the end."""
    import cupy

    shapes = [(1, 4096, 8192), (48, 1032, 4104), (512, 1024, 512), (7, 264, 16384)]
    ops = []
    with config.override(**knobs):
        for M, N, K in shapes:
            a, w = _inputs(300 + M, M, N, K, BF16, integer=True)
            a_d, w_d = dev(a.astype(BF16)), dev(w.astype(BF16))
            out = cupy.empty((M, N), BF16)
            mkernel.gemm(a_d, w_d.T, out=out)
            ops.append((a_d, w_d, out, out.copy()))
        bad = cupy.zeros((), cupy.int64)
        for i in range(1000):
            a_d, w_d, out, first = ops[i % len(ops)]
            mkernel.gemm(a_d, w_d.T, out=out)
            bad += cupy.count_nonzero(out.view(cupy.uint16) != first.view(cupy.uint16))
    assert int(bad) == 0
    for (M, N, K), (_, _, _, first) in zip(shapes, ops):
        a, w = _inputs(300 + M, M, N, K, BF16, integer=True)
        assert np.array_equal(bits(first), (a @ w.T).astype(BF16).view(np.uint16)), (M, N, K)


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", KNOBS_OFF_BY_DEFAULT, ids=["default", "overlap"])
def test_captured_in_a_cuda_graph_and_replayed_a_thousand_times(knobs):
    """Decode calls (several K ranges) captured once, replayed 1000 times: the same bits each time."""
    import cupy

    M, N, K = 5, 2048, 16384
    a, w = _inputs(17, M, N, K, BF16, integer=False)
    a_d, w_d = dev(a.astype(BF16)), dev(w.astype(BF16))
    out = cupy.empty((M, N), BF16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream, config.override(**knobs):
        mkernel.gemm(a_d, w_d.T, out=out)  # the first call (plan, workspace) outside the capture
        want = out.copy()
        out.fill(0)
        stream.begin_capture()
        mkernel.gemm(a_d, w_d.T, out=out)
        graph = stream.end_capture()
        bad = cupy.zeros((), cupy.int64)
        for _ in range(1000):
            graph.launch(stream)
            bad += cupy.count_nonzero(out.view(cupy.uint16) != want.view(cupy.uint16))
        stream.synchronize()
    assert int(bad) == 0 and _rel(host(out).astype(np.float64), a @ w.T) < REL_TOL


@pytest.mark.gpu
def test_a_launch_short_of_shared_memory_records_an_error_and_writes_nothing():
    """The kernel checks the dynamic shared memory it was given against DecodeCfg::SMEM (which
    gemm_decode.smem_bytes mirrors): a launch with less records MK_ERR_INPUT instead of writing
    past it, and the host raises it."""
    import cupy

    import mkernel
    from mkernel.runtime.launch import launch
    from mkernel.runtime.sync import SyncState

    M, N, K = 4, 256, 8192  # 2 row blocks shared by many CTAs: the partials' path too
    a, w = _inputs(5, M, N, K, BF16, integer=False)
    out = poisoned((M, N), "bf16")
    state = SyncState(0)
    try:
        d = dec.build(dev(a.astype(BF16)), dev(w.astype(BF16)), out, 0, M=M, N=N, K=K, accumulate=False,
                      sync=state.args("gemm"), partial=dec.Partials)
        launch(d.fn, d.grid, d.block, d.args, smem=d.smem - 1024)
        cupy.cuda.get_current_stream().synchronize()
        with pytest.raises(mkernel.MKernelError, match="shared memory"):
            state.check()
        assert np.isnan(host(out).astype(np.float64)).all()
    finally:
        state.close()


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [{"gemm_decode_rows": 64}, {"gemm_decode_rows": 128},
                                   {"gemm_decode_rows": 128, "gemm_decode_split": "stream"}])
@pytest.mark.parametrize("M,N,K", [(16, 1032, 4104), (8, 8192, 512)])
def test_trace_mode_stamps_every_cta_in_order_and_keeps_the_bits(M, N, K, knobs, monkeypatch, tmp_path):
    """Trace mode (tools/gemm_phases.py): every CTA writes its row blocks' phases in order without a
    gap (fill, mma, then partial and / or out; a block's values handed out once, by one CTA), and the
    values are the same bits as an untraced launch's."""
    import cupy

    from mkernel.runtime.launch import launch
    from mkernel.runtime.sync import SyncState
    from mkernel.runtime.trace import Trace

    monkeypatch.setenv("MKERNEL_TRACE", str(tmp_path / "trace"))
    TRACE, FILL, MMA, PARTIAL, OUT = 0x20000000, 0, 1, 2, 3  # gemm_decode_args.cuh
    a, w = _inputs(9, M, N, K, BF16, integer=False)
    a_d, w_d = dev(a.astype(BF16)), dev(w.astype(BF16))
    outs, trace, state = [poisoned((M, N), "bf16") for _ in range(2)], Trace(0), SyncState(0)
    kept = []  # the partials' buffers, alive until the launches ran
    try:
        with config.override(**knobs):
            for out, traced in zip(outs, (False, True)):
                d = dec.build(a_d, w_d, out, 0, M=M, N=N, K=K, accumulate=False, sync=state.args("gemm"),
                              partial=dec.Partials)
                kept.append(d.buffer)
                if traced:
                    d.args.sync.trace_events, d.args.sync.trace_count, d.args.sync.trace_capacity = trace.pointers()
                launch(d.fn, d.grid, d.block, d.args, smem=d.smem)
                grid = d.grid
        cupy.cuda.get_current_stream().synchronize()
        state.check()
    finally:
        state.close()
    assert np.array_equal(bits(outs[0]), bits(outs[1])), "trace mode changed the bits"
    assert _rel(host(outs[1]).astype(np.float64), a @ w.T) < REL_TOL
    ctas, handed = {}, []
    for start, end, _sm, cta, role, ident in trace.spans():
        assert role == 0 and ident & 0xF0000000 == TRACE and start <= end
        ctas.setdefault(cta, []).append((start, end, (ident >> 24) & 0xF, ident & 0xFFFFFF))
    assert sorted(ctas) == list(range(grid[0])), "a CTA wrote no stamps"
    for spans in ctas.values():  # in the order written: a CTA's one writer takes its slots in order
        assert all(p[1] == s[0] for p, s in zip(spans, spans[1:])), "a gap between a CTA's phases"
        phases = [s[2] for s in spans]
        blocks = [s[3] for s in spans]
        assert blocks == sorted(blocks), "row blocks out of order"
        for rb in dict.fromkeys(blocks):
            seq = [p for p, b in zip(phases, blocks) if b == rb]
            assert seq in ([FILL, MMA, OUT], [FILL, MMA, PARTIAL], [FILL, MMA, PARTIAL, OUT]), seq
        handed += [b for p, b in zip(phases, blocks) if p == OUT]
    assert sorted(handed) == list(range(-(-N // (knobs["gemm_decode_rows"])))), "a block handed out twice or never"
