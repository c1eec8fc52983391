"""GPU: every op's transient buffers share one scratch (mkernel/comm/scratch.py). 40 random shapes of
the three TP ops, ring attention and MoE dispatch + combine, then 200 calls drawn from them in a
random order (the same on every rank), all on one communicator with the default workspace:

- each shape's first call is checked against a reference: TP on sparse integer inputs, exact
  (every output element a small integer) against a float32 cuBLAS product of the same integers;
  ring attention against float64; MoE's combine of its dispatch with weights 1/2, 1/2 gives the
  tokens back bit for bit;
- every later call must give the first call's bits: a call whose scratch another op's call
  overwrote too early (a missing credit) would not;
- memory: the scratch ends at the largest single call's need; once every shape ran, no call grows
  it or rebuilds a plan.

And two different ops back to back while one rank's GPU is held 50 ms: the other rank's second op
must not write into the held rank's scratch before its first op read it (credits).
"""

import numpy as np

import mkernel
from mkernel.ops.sequence import shard_sequence

from tests.helpers import collective_cases
from tests.helpers.arrays import DTYPES, attention_reference, bits, dev, f32, host

SHAPES, CALLS = 40, 200
OPS = ("rs", "ar", "ag", "ring", "moe")



def _log_uniform(rng, lo, hi, multiple=1):
    return int(np.exp(rng.uniform(np.log(lo), np.log(hi)))) // multiple * multiple or multiple


ONE_BITS = {"bfloat16": (0x3F80, 0xBF80), "float16": (0x3C00, 0xBC00)}  # +1, -1


def _sparse_ints(cupy, seed, shape, dt):
    """A few +-1 per 64 columns, else 0 (built from bits: no 16-bit casts needed): every product and
    sum stays a small integer, exact in fp32 and in the 16-bit output."""
    rs = cupy.random.RandomState(seed)
    nz, neg = rs.random_sample(shape) < 4.0 / 64, rs.random_sample(shape) < 0.5
    pos_bits, neg_bits = ONE_BITS[dt.name]
    return cupy.where(nz, cupy.where(neg, neg_bits, pos_bits), 0).astype(cupy.uint16).view(dt)


def _tp_case(rng, W, op, case_seed):
    # issue 24's ranges: M = m W from 1 row per rank to 16384, N and K multiples of 8 up to 16384
    m, N, K = _log_uniform(rng, 1, 16384 // W), _log_uniform(rng, 8, 16384, 8), _log_uniform(rng, 8, 16384, 8)
    return _tp_problem(W, op, m, N, K, DTYPES[("bf16", "fp16")[int(rng.integers(2))]], case_seed)


def _tp_problem(W, op, m, N, K, dt, case_seed):
    """(name, call, reference) of one TP op on sparse integer inputs: m rows per rank's block."""
    import cupy

    fn = {"rs": mkernel.gemm_reduce_scatter, "ar": mkernel.gemm_allreduce, "ag": mkernel.allgather_gemm}[op]
    rows = m if op == "ag" else m * W  # A of one rank: [M, K] for RS / AR, [m, K] for AG

    def inputs(r):
        seed = case_seed * 16
        return _sparse_ints(cupy, seed + r, (rows, K), dt), _sparse_ints(cupy, seed + 15, (K, N), dt)

    def call(comm):
        a, b = inputs(comm.rank)
        return fn(a, b, comm=comm)

    def reference(comm):  # float32 (exact here): the output must equal it element for element
        if op == "ag":
            return cupy.concatenate([f32(inputs(r)[0]) for r in range(W)]) @ f32(inputs(0)[1])
        total = sum(f32(inputs(r)[0]) @ f32(inputs(r)[1]) for r in range(W))
        return total if op == "ar" else total[comm.rank * m:(comm.rank + 1) * m]

    return f"{op} M {rows * (1 if op != 'ag' else W)} N {N} K {K} {dt.name}", call, reference


def _ring_case(rng, W, case_seed):
    B, Hq, D = int(rng.integers(1, 3)), (2, 4)[int(rng.integers(2))], (64, 128)[int(rng.integers(2))]
    S = 2 * W * _log_uniform(rng, 8, 256, 8)  # global rows; even chunks for the causal zigzag
    causal = bool(rng.integers(2))
    dt = DTYPES["bf16"]
    g = np.random.default_rng(case_seed)
    q, k, v = (g.standard_normal((B, S, Hq, D)).astype(dt) for _ in range(3))

    def call(comm):
        qs, ks, vs = (dev(shard_sequence(x, comm.rank, W, causal=causal, axis=1)) for x in (q, k, v))
        return mkernel.ring_attention(qs, ks, vs, comm=comm, causal=causal)

    def reference(comm):
        o, _ = attention_reference(q, k, v, causal, 1.0 / np.sqrt(D))
        return shard_sequence(o, comm.rank, W, causal=causal, axis=1)

    return f"ring B {B} S {S} H {Hq} D {D} causal {causal}", call, reference


def _moe_case(rng, W, case_seed):
    import cupy

    T, H, E, k = _log_uniform(rng, 1, 2048), 64 * int(rng.integers(1, 64)), 4 * W, 2
    dt = DTYPES[("bf16", "fp16")[int(rng.integers(2))]]

    def call(comm):
        g = np.random.default_rng(case_seed * 16 + comm.rank)
        x = dev(g.standard_normal((T, H)).astype(dt))
        ids = cupy.asarray(np.argsort(g.random((T, E)), axis=1)[:, :k].astype(np.int32))
        w = cupy.full((T, k), 0.5, dtype=cupy.float32)
        recv, h = mkernel.moe_dispatch(x, ids, w, comm=comm, num_experts=E, capacity=T * k * W)
        return mkernel.moe_combine(recv, h, comm=comm)

    def reference(comm):  # 0.5 x + 0.5 x is x exactly: the tokens come back bit for bit
        g = np.random.default_rng(case_seed * 16 + comm.rank)
        return g.standard_normal((T, H)).astype(dt)

    return f"moe T {T} H {H} E {E} {dt.name}", call, reference


def _cases(W):
    rng = np.random.default_rng(2026)
    out = []
    for i in range(SHAPES):
        op = OPS[i % len(OPS)]
        out.append(_tp_case(rng, W, op, i) if op in ("rs", "ar", "ag") else
                   _ring_case(rng, W, i) if op == "ring" else _moe_case(rng, W, i))
    return out


def _matches(got, want, kind):
    """(ok, message): TP exact against float32 integers, MoE bit for bit, ring by relative error."""
    import cupy

    if kind == "tp":
        wrong = int(cupy.count_nonzero(f32(got) != want))
        return wrong == 0, f"{wrong} of {want.size} elements differ from the exact reference"
    if kind == "moe":
        same = np.array_equal(bits(got), np.ascontiguousarray(want).view(np.uint16))
        return same, "combine(dispatch(x)) is not x bit for bit"
    g, w = host(got).astype(np.float64), want
    err = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
    return err < 1e-2, f"relative error {err:.3g} against float64"


def _kind(name):
    return name.split()[0] if name.split()[0] in ("ring", "moe") else "tp"


@collective_cases.gpu_mpi
def test_interleaved_calls_share_the_scratch(comm):
    cases = _cases(comm.size)
    first = {}

    def body():
        for i, (name, call, reference) in enumerate(cases):  # the first calls, checked
            got = call(comm)
            ok, msg = _matches(got, reference(comm), _kind(name))
            if not ok:
                return False, f"{name}: {msg}"
            first[i] = bits(got)
        for _, call, _ in cases:  # plans dropped by a growth of the first pass rebuild here
            call(comm)
        before = comm.stats()
        order = np.random.default_rng(7).integers(0, len(cases), CALLS)
        for n, i in enumerate(order):
            got = bits(cases[i][1](comm))
            if not np.array_equal(got, first[i]):
                return False, f"call {n} ({cases[i][0]}) differs from its first call"
        st = comm.stats()
        if st["plans"] != before["plans"] or st["scratch"]["grown"] != before["scratch"]["grown"]:
            return False, f"plans rebuilt or the scratch grown in steady state: {before} -> {st}"
        if st["scratch"]["bytes"] != st["scratch"]["largest_need"]:
            return False, f"the scratch is not the largest single need: {st['scratch']}"
        return True, f"{len(cases)} shapes, {CALLS} calls; scratch {st['scratch']}, plans {st['plans']}"

    collective_cases.collective(comm, f"{CALLS} interleaved calls", body)


@collective_cases.gpu_mpi
def test_the_sequences_that_once_exhausted_the_workspace_fit_by_default(comm):
    """Issue 24's reports, on the default workspace: the three TP ops at bf16 2048x2048x1024, then
    bf16 and fp16 6144x3072x2560 (the third failed), and gemm_allreduce of 8192x2048 @ 2048x8192
    in fp16 (671 MB of workspace at 2 ranks); M is the whole problem's rows. Every output exact."""
    W = comm.size
    shapes = [(2048, 2048, 1024, "bf16"), (6144, 3072, 2560, "bf16"), (6144, 3072, 2560, "fp16")]
    cases = [_tp_problem(W, op, M // W, N, K, DTYPES[dt], 200 + i)
             for i, (M, N, K, dt) in enumerate(shapes) for op in ("rs", "ar", "ag")]
    cases.append(_tp_problem(W, "ar", 8192 // W, 8192, 2048, DTYPES["fp16"], 300))

    def body():
        for name, call, reference in cases:
            ok, msg = _matches(call(comm), reference(comm), "tp")
            if not ok:
                return False, f"{name}: {msg}"
        return True, f"{len(cases)} calls exact; scratch {comm.stats()['scratch']}"

    collective_cases.collective(comm, "the reported sequences", body)


@collective_cases.gpu_mpi
def test_two_ops_back_to_back_with_one_rank_held(comm):
    """Rank 0's GPU is held 50 ms before an AllReduce and a ReduceScatter that share the scratch;
    the other ranks run ahead. Both outputs exact."""
    import cupy

    from mkernel.testing import StreamHold

    rng = np.random.default_rng(11)
    _, ar_call, ar_ref = _tp_case(rng, comm.size, "ar", 101)
    _, rs_call, rs_ref = _tp_case(rng, comm.size, "rs", 102)

    def body():
        ar_call(comm), rs_call(comm)  # plans built
        cupy.cuda.runtime.deviceSynchronize()
        comm.test_mpi.Barrier()
        hold = StreamHold(cupy.cuda.get_current_stream(), timeout_s=0.05) if comm.rank == 0 else None  # 50 ms
        a, r = ar_call(comm), rs_call(comm)
        ok_a, msg_a = _matches(a, ar_ref(comm), "tp")
        ok_r, msg_r = _matches(r, rs_ref(comm), "tp")
        if hold:
            hold.close()
        return ok_a and ok_r, (f"allreduce: {msg_a if not ok_a else 'exact'}; "
                               f"reduce-scatter: {msg_r if not ok_r else 'exact'}")

    collective_cases.collective(comm, "two ops, one rank held 50 ms", body)
