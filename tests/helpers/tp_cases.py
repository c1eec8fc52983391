"""The problems and checks of the fused tensor-parallel ops' GPU tests (tests/gpu/test_tp_gpu.py,
test_tp_controller_gpu.py, test_tp_nodes_gpu.py, test_residency_gpu.py): per-rank inputs, float64
references, exact and bounded comparisons naming the 128 x 256 tiles that differ, and a collective
pass / fail decision."""

import numpy as np

from mkernel.comm.collectives import allgather_object
from mkernel.ops.allgather_gemm import allgather_gemm
from mkernel.ops.gemm_allreduce import gemm_allreduce
from mkernel.ops.gemm_reduce_scatter import gemm_reduce_scatter
from mkernel.testing import sync_or_exit

from tests.helpers.arrays import dev as _dev

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    BF16 = None
DTYPES = {"bf16": BF16, "fp16": np.dtype(np.float16)}
TM, TN = 128, 256
HANG_S = 45.0  # past MKERNEL_TIMEOUT_S (30): a device wait times out and is reported first


def _sync(what):
    sync_or_exit(what, HANG_S)


def _collective(comm, body):
    """Runs body() -> (ok, message) on every rank; passes only if it passed everywhere."""
    try:
        ok, msg = body()
    except Exception as e:  # noqa: BLE001  (an error on one rank must not leave the others waiting)
        ok, msg = False, f"{type(e).__name__}: {e}"
    try:  # timed: a rank that failed early may meet peers still inside an op's own collectives
        oks = allgather_object(comm.mpi, (bool(ok), msg), "gathering the test's result", timeout_s=60)
    except Exception as e:  # noqa: BLE001  (MPI's own errors too: say what this rank saw)
        raise AssertionError(f"this rank: {'passed' if ok else msg}; peers did not report: "
                             f"{type(e).__name__}: {e}") from None
    bad = [f"rank {r}: {m}" for r, (o, m) in enumerate(oks) if not o]
    assert not bad, "; ".join(bad)


def _q(x, dt):
    """float64 -> dtype -> float64 (the value the kernel sees)."""
    return x.astype(dt).astype(np.float64)


def _rank_inputs(seed, r, a_shape, b_shape, dt, integer):
    rng = np.random.default_rng([seed, r])
    if integer:  # {-1, 0, 1}: partials of K <= 256 terms are exact in bf16 and fp16
        a = rng.integers(-1, 2, size=a_shape).astype(np.float64)
        b = rng.integers(-1, 2, size=b_shape).astype(np.float64)
    else:
        a = rng.standard_normal(a_shape)
        b = rng.standard_normal(b_shape)
    return _q(a, dt), _q(b, dt)


def _b_arg(b, layout, dt):
    """b [K, N] (float64 values) as the op receives it: (array, b_layout)."""
    if layout == "kn":
        return _dev(b.astype(dt)), None
    if layout == "nk":
        return _dev(np.ascontiguousarray(b.T).astype(dt)), "nk"
    return _dev(np.ascontiguousarray(b.T).astype(dt)).T, None  # "view": w.T of a row-major [N, K]


def _tile_report(bad_mask, row0=0):
    """'tile (mt, nt): count' for the 128 x 256 tiles (rows counted from row0) with bad elements."""
    rows, cols = bad_mask.shape
    out = []
    for mt in range(-(-rows // TM)):
        for nt in range(-(-cols // TN)):
            n = int(bad_mask[mt * TM:(mt + 1) * TM, nt * TN:(nt + 1) * TN].sum())
            if n:
                out.append(f"tile ({(row0 + mt * TM) // TM}, {nt}): {n}")
    return out


def _bits(x):
    """16-bit patterns with -0 folded into +0: IEEE sums give +0 where the float64 reference, scaled
    by a negative factor, holds -0, and the two are the same number."""
    x = x.copy()
    x[x == 0] = 0
    return x.view(np.uint16)


def _check_exact(got, ref64, dt, what, row0=0):
    bad = _bits(got) != _bits(ref64.astype(dt))
    if bad.any():
        tiles = _tile_report(bad, row0)
        return False, f"{what}: {int(bad.sum())} elements differ in {len(tiles)} tiles: {tiles[:8]}"
    return True, ""


def _check_close(got, ref64, rounded64, absprod64, K, dt, what, row0=0):
    """Per element: the roundings to the dtype (of each partial, summed in rounded64, and of the
    result) plus fp32 accumulation over K terms of |a||b| (absprod64), with a margin of 4. A missing
    or doubled partial is far outside it, even where the products cancel."""
    eps = 2.0 ** -8 if dt == BF16 else 2.0 ** -11
    err = np.abs(got.astype(np.float64) - ref64)
    bound = 4 * eps * (rounded64 + np.abs(ref64)) + 4 * np.sqrt(K) * 2.0 ** -24 * absprod64 + 1e-6
    bad = ~(err <= bound)  # NaN (unwritten) fails
    if bad.any():
        tiles = _tile_report(bad, row0)
        return False, f"{what}: {int(bad.sum())} elements out of bound in {len(tiles)} tiles: {tiles[:8]}"
    return True, float(err.max())


# --------------------------------------------------------------------- reference problems
def _reduce_problem(comm, seed, M, K, N, kind, integer):
    """Rank r's (a, b) and the float64 references: the sum, the sum of |partials| (each is rounded
    once), the sum of |a| @ |b| (the accumulation error's scale), and the emulated baseline."""
    dt = DTYPES[kind]
    W = comm.size
    total = np.zeros((M, N))
    absum = np.zeros((M, N))
    absprod = np.zeros((M, N))
    base = None
    mine = None
    for r in range(W):
        a, b = _rank_inputs(seed, r, (M, K), (K, N), dt, integer)
        p = a @ b
        total += p
        absum += np.abs(p)
        absprod += np.abs(a) @ np.abs(b)
        pq = _q(p, dt)  # cuBLAS rounds its partial to the dtype; NCCL adds in fp32, rounds per step
        base = pq if base is None else _q(base + pq, dt)
        if r == comm.rank:
            mine = (a, b)
    return mine, total, absum, absprod, base


def _rows(x, comm, M):
    mb = M // comm.size
    return x[comm.rank * mb:(comm.rank + 1) * mb]


PATHS = ["fused", None]  # None: the automatic choice (world 1: the GEMM engine; shared GPU: fused)


def _controller_problem(comm, op, seed, M, K, N):
    """(call(out, **kw) -> the op's output, the exact reference, row0, output shape) for fp16
    integer inputs (partials of K <= 2048 terms of {-1, 0, 1} are exact in fp16)."""
    W, dt = comm.size, DTYPES["fp16"]
    mb = M // W
    if op == "ag":
        shards = [_rank_inputs(seed, r, (mb, K), (K, N), dt, True) for r in range(W)]
        a, b = (_dev(x.astype(dt)) for x in shards[comm.rank])
        return (lambda out, **kw: allgather_gemm(a, b, comm=comm, out=out, path="fused", **kw),
                np.vstack([sh[0] for sh in shards]) @ shards[comm.rank][1], 0, (M, N))
    (a, b), total, _, _, _ = _reduce_problem(comm, seed, M, K, N, "fp16", True)
    a, b = _dev(a.astype(dt)), _dev(b.astype(dt))
    fn = gemm_reduce_scatter if op == "rs" else gemm_allreduce
    ref, row0, shape = (_rows(total, comm, M), comm.rank * mb, (mb, N)) if op == "rs" else (total, 0, (M, N))
    return (lambda out, **kw: fn(a, b, comm=comm, out=out, path="fused", **kw)), ref, row0, shape
