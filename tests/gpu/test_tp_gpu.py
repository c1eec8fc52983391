"""GPU: the fused tensor-parallel ops (gemm_reduce_scatter, gemm_allreduce, allgather_gemm), their results.

Marked gpu and mpi: runs at 1 rank (the fused kernel forced with path='fused', and the default
world-1 GEMM path) and under ``mpirun -n 2`` (2 GPUs, or 2 ranks sharing GPU 0, where the fused
path is the only one); the tests that need 2 ranks are also marked multi_gpu (2-rank pass only).
Every output starts poisoned with NaN, so an element nobody wrote fails. Checks:

- exact integer-valued inputs (every partial exactly representable), with and without the GEMM
  CTAs joining the reduction (join=): the result must equal the float64 sum rounded once to the
  input dtype, bit for bit, with the mismatching 128 x 256 tiles named (a missing or doubled
  partial in any tile fails);
- random inputs against float64, bitwise equal over two runs: a per-element bound of a few ulps
  of sum(|partial|), checked and reported per tile, and the max error next to the emulated
  cuBLAS-then-NCCL error (printed);
- bf16 and fp16, B as [K, N], as [N, K] (b_layout='nk') and as a transposed view (w.T);
- off-grid shapes (rows per rank, N and K not multiples of the tile);
- gemm_allreduce: identical bits on every rank; allgather_gemm: the gathered A returned bitwise;
- the fallback path (world 1: cupy.matmul; ranks on distinct GPUs: NCCL);
- argument errors raise mkernel.ArgumentError before launch, including shapes that disagree
  across ranks;
- examples/tp_mlp.py (CuPy, and JAX through DLPack where JAX has a GPU) against one GPU.

The split of the GPU between GEMM and communication (comm_sms, the in-call controller) and
back-to-back launches are tests/gpu/test_tp_controller_gpu.py; the problems and checks both share
are tests/helpers/tp_cases.py.
"""

import hashlib
import itertools

import numpy as np
import pytest

import mkernel
from mkernel import config
from mkernel.ops.allgather_gemm import allgather_gemm
from mkernel.ops.gemm_allreduce import gemm_allreduce
from mkernel.ops.gemm_reduce_scatter import gemm_reduce_scatter

from tests.helpers.argument_errors import argument_errors
from tests.helpers.arrays import dev as _dev
from tests.helpers.arrays import host as _host
from tests.helpers.arrays import poisoned as _poisoned
from tests.helpers.ranks import all_ranks
from tests.helpers.tp_cases import (
    BF16,
    DTYPES,
    PATHS,
    _b_arg,
    _check_close,
    _check_exact,
    _collective,
    _rank_inputs,
    _reduce_problem,
    _rows,
    _sync,
)

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]  # 1-rank pass, and the 2-rank pass (tests/run_gpu.sh)



# ---------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("kind", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["kn", "nk", "view"])
@pytest.mark.parametrize("op", ["rs", "ar"])
def test_reduce_ops_integer_inputs_are_exact_per_tile(comm, op, layout, kind):
    W = comm.size
    M, K, N = 200 * W, 120, 264  # 200 rows per rank (off-grid), N and K off-grid
    dt = DTYPES[kind]
    (a, b), total, _, _, _ = _reduce_problem(comm, 11, M, K, N, kind, True)
    fn = gemm_reduce_scatter if op == "rs" else gemm_allreduce

    def body():
        msgs = []
        # (path, join): the fused kernel with dedicated reducers only, with the GEMM CTAs joining
        # the reduction, and the automatic choice.
        for path, join in (("fused", False), ("fused", True), (None, None)):
            out = _poisoned((M // W, N) if op == "rs" else (M, N), kind)
            bb, bl = _b_arg(b, layout, dt)
            got = fn(_dev(a.astype(dt)), bb, comm=comm, out=out, b_layout=bl, path=path, join=join)
            assert got is out
            _sync(f"{op} {layout} {kind}")
            comm.check()
            g = _host(got)
            if op == "rs":
                ok, msg = _check_exact(g, _rows(total, comm, M), dt, f"path {path} join {join}", comm.rank * (M // W))
            else:
                ok, msg = _check_exact(g, total, dt, f"path {path} join {join}")
                digests.append(hashlib.sha256(g.view(np.uint16).tobytes()).hexdigest())
            if not ok:
                msgs.append(msg)
        return not msgs, "; ".join(msgs)

    digests = []
    _collective(comm, body)
    if op == "ar":  # every rank passed: compare the bits they hold (a collective all ranks reach)
        _collective(comm, lambda: (len({tuple(d) for d in comm.mpi.allgather(digests)}) == 1,
                                   "ranks hold different bits"))


def _integer_case(comm, op, seed, rows, N, join=None):
    """An exact bf16 problem of op ("rs", "ar", "ag") with `rows` rows per rank (K 136 for AG, 120
    for RS / AR: every sum exact in the 16-bit output): (reference, output shape, this rank's first
    reference row, call(out, path)); join as the RS / AR ops take it (None: their default)."""
    W, dt = comm.size, BF16
    if op == "ag":
        K = 136
        shards = [_rank_inputs(seed, r, (rows, K), (K, N), dt, True) for r in range(W)]
        a, b = shards[comm.rank]
        a_d, b_d = _dev(a.astype(dt)), _dev(b.astype(dt))
        return (np.vstack([s[0] for s in shards]) @ b, (W * rows, N), 0,
                lambda out, path: allgather_gemm(a_d, b_d, comm=comm, out=out, path=path))
    M, K = rows * W, 120
    (a, b), total, _, _, _ = _reduce_problem(comm, seed, M, K, N, "bf16", True)
    a_d, b_d = _dev(a.astype(dt)), _dev(b.astype(dt))
    fn = gemm_reduce_scatter if op == "rs" else gemm_allreduce
    call = lambda out, path: fn(a_d, b_d, comm=comm, out=out, path=path, join=join)  # noqa: E731
    if op == "rs":
        return _rows(total, comm, M), (rows, N), comm.rank * rows, call
    return total, (M, N), 0, call


def _exact_and_as_before(out, ref, row0, what, first: dict, key):
    """(ok, message): out exact against ref, and bitwise the first output stored under key."""
    g = _host(out)
    ok, msg = _check_exact(g, ref, BF16, what, row0)
    if not ok:
        return False, msg
    if not np.array_equal(first.setdefault(key, g.view(np.uint16).copy()), g.view(np.uint16)):
        return False, f"{what}: other bits than the first launch"
    return True, ""


@pytest.mark.parametrize("op", ["rs", "ar", "ag"])
def test_comm_staging_changes_no_bit(comm, op):
    """config.comm_staged (the comm CTAs' loads through shared memory) and, RS / AR with the GEMM
    CTAs joining, config.tp_join_staged (theirs through the GEMM's freed stages) sum in the same
    order: fused and unfused results bitwise equal to the register loops', exact on integer inputs,
    over launches that alternate the settings (off-grid shapes; partial tiles in every direction)."""
    ref, shape, row0, call = _integer_case(comm, op, 23 if op == "ag" else 13, 330, 520, join=True)
    settings = [(False, False), (True, False), (False, True), (True, True)]  # (comm_staged, tp_join_staged)

    def body():
        first = {}
        paths = ("fused", "unfused") if comm.size > 1 else ("fused",)  # unfused: the baseline of 2 or more ranks
        for (staged, join_staged), path in itertools.product(settings + settings[::-1], paths):
            what = f"{op} {path} staged {staged} join_staged {join_staged}"
            with config.override(comm_staged=staged, tp_join_staged=join_staged):
                out = call(_poisoned(shape, "bf16"), path)
            _sync(what)
            comm.check()
            ok, msg = _exact_and_as_before(out, ref, row0, what, first, path)
            if not ok:
                return False, msg
        return True, ""

    _collective(comm, body)


@pytest.mark.parametrize("op", ["rs", "ar", "ag"])
def test_full_mps_share_changes_no_bit(comm, op):
    """config.mps_full_share (under MPS in a node the grid takes the whole SM share; CTAs that
    find no SM start late and find no work): exact on integer inputs and bitwise equal launch to
    launch, the setting alternating, with more tiles than CTAs."""
    ref, shape, row0, call = _integer_case(comm, op, 25 if op == "ag" else 15, 1024, 2056)

    def body():
        first = {}
        for full in (True, False, True, True):
            what = f"{op} full_share {full}"
            with config.override(mps_full_share=full):
                out = call(_poisoned(shape, "bf16"), "fused")
            _sync(what)
            comm.check()
            ok, msg = _exact_and_as_before(out, ref, row0, what, first, "fused")
            if not ok:
                return False, msg
        return True, ""

    _collective(comm, body)


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
@pytest.mark.parametrize("op", ["rs", "ar"])
def test_reduce_ops_against_float64(comm, op, kind):
    W = comm.size
    M, K, N = 384 * W, 1000, 776
    dt = DTYPES[kind]
    (a, b), total, absum, absprod, base = _reduce_problem(comm, 12, M, K, N, kind, False)
    fn = gemm_reduce_scatter if op == "rs" else gemm_allreduce

    def body():
        shape = (M // W, N) if op == "rs" else (M, N)
        a_d, b_d = _dev(a.astype(dt)), _dev(b.astype(dt))
        out = fn(a_d, b_d, comm=comm, out=_poisoned(shape, kind), path="fused")
        again = fn(a_d, b_d, comm=comm, out=_poisoned(shape, kind), path="fused")
        _sync(f"{op} float64 {kind}")
        comm.check()
        g = _host(out)
        if not np.array_equal(g.view(np.uint16), _host(again).view(np.uint16)):
            return False, "two runs on the same inputs differ (the reduction order must be fixed)"
        sl = (lambda x: _rows(x, comm, M)) if op == "rs" else (lambda x: x)
        ok, err = _check_close(g, sl(total), sl(absum), sl(absprod), K, dt, f"{op} {kind}",
                               comm.rank * (M // W) if op == "rs" else 0)
        if not ok:
            return False, err
        base_err = float(np.abs(sl(base) - sl(total)).max())
        print(f"\n{op} {kind} {M}x{N}x{K}/rank: max |err| vs float64: mkernel {err:.4g}, "
              f"cuBLAS+NCCL (emulated) {base_err:.4g}")
        if err > 1.5 * base_err + 1e-6:
            return False, f"error {err} worse than the emulated baseline's {base_err}"
        return True, ""

    _collective(comm, body)


@pytest.mark.parametrize("copy_first,join", [(False, False), (True, False), (True, True)])  # config.tp_ag_*
@pytest.mark.parametrize("kind", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["kn", "nk", "view"])
def test_allgather_gemm_integer_inputs_are_exact_per_tile(comm, layout, kind, copy_first, join):
    W = comm.size
    mb, K, N = 200, 136, 264
    dt = DTYPES[kind]
    shards = [_rank_inputs(21, r, (mb, K), (K, N), dt, True) for r in range(W)]
    a, b = shards[comm.rank]
    full = np.vstack([s[0] for s in shards])
    ref = full @ b

    def body():
        msgs = []
        for path in PATHS:
            bb, bl = _b_arg(b, layout, dt)
            with config.override(tp_ag_copy_first=copy_first, tp_ag_join_gemm=join):
                out, gathered = allgather_gemm(_dev(a.astype(dt)), bb, comm=comm, out=_poisoned((W * mb, N), kind),
                                               b_layout=bl, path=path, return_gathered=True)
            _sync(f"ag {layout} {kind}")
            comm.check()
            ok, msg = _check_exact(_host(out), ref, dt, f"path {path}")
            if not ok:
                msgs.append(msg)
            if not np.array_equal(_host(gathered).view(np.uint16), full.astype(dt).view(np.uint16)):
                msgs.append(f"path {path}: gathered A differs")
        return not msgs, "; ".join(msgs)

    _collective(comm, body)


@pytest.mark.parametrize("copy_first,join", [(False, False), (True, False), (True, True)])  # config.tp_ag_*
@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_allgather_gemm_against_float64(comm, kind, copy_first, join):
    W = comm.size
    mb, K, N = 320, 1024, 520
    dt = DTYPES[kind]
    shards = [_rank_inputs(22, r, (mb, K), (K, N), dt, False) for r in range(W)]
    a, b = shards[comm.rank]
    full = np.vstack([s[0] for s in shards])
    ref, absprod = full @ b, np.abs(full) @ np.abs(b)

    def body():
        padded = _dev(np.hstack([a, np.full((mb, 24), np.nan)]).astype(dt))[:, :K]  # rows 24 elements apart
        with config.override(tp_ag_copy_first=copy_first, tp_ag_join_gemm=join):
            out = allgather_gemm(padded, _dev(b.astype(dt)), comm=comm, path="fused")
        _sync(f"ag float64 {kind}")
        comm.check()
        ok, err = _check_close(_host(out), ref, 0.0, absprod, K, dt, f"ag {kind}")
        return ok, "" if ok else err

    _collective(comm, body)


def test_world_one_fallback_path(comm):
    if comm.size != 1:
        pytest.skip("world-1 fallback (cupy.matmul); at 2 ranks NCCL needs a GPU per rank")
    M, K, N = 192, 64, 128
    (a, b), total, _, _, _ = _reduce_problem(comm, 50, M, K, N, "fp16", True)
    got = gemm_allreduce(_dev(a.astype(np.float16)), _dev(b.astype(np.float16)), comm=comm, path="fallback")
    _sync("fallback")
    ok, msg = _check_exact(_host(got), total, np.float16, "fallback")
    assert ok, msg


@pytest.mark.multi_gpu
def test_fallback_path_on_distinct_gpus(comm):
    from mkernel.ops import tp
    if comm.size < 2 or not tp.gpus_distinct(comm):
        pytest.skip("needs 2 ranks on distinct GPUs (NCCL)")
    W = comm.size
    M, K, N = 128 * W, 64, 128
    (a, b), total, _, _, _ = _reduce_problem(comm, 51, M, K, N, "fp16", True)

    def body():
        rs = gemm_reduce_scatter(_dev(a.astype(np.float16)), _dev(b.astype(np.float16)), comm=comm, path="fallback")
        ar = gemm_allreduce(_dev(a.astype(np.float16)), _dev(b.astype(np.float16)), comm=comm, path="fallback")
        _sync("fallback")
        ok1, m1 = _check_exact(_host(rs), _rows(total, comm, M), np.float16, "rs fallback")
        ok2, m2 = _check_exact(_host(ar), total, np.float16, "ar fallback")
        return ok1 and ok2, m1 + m2

    _collective(comm, body)


# -------------------------------------------------------------------------- argument errors
def test_argument_errors_raise_before_launch(comm):
    import cupy

    W = comm.size
    f16 = np.float16
    a = _dev(np.zeros((128 * W, 64), f16))
    b = _dev(np.zeros((64, 128), f16))
    ws_out = comm.empty((128 * W, 128), f16)  # symmetric: allocated and freed at the same point on every rank
    e0 = comm.sync.epoch()
    cases = {
        "float32 inputs": lambda: gemm_reduce_scatter(cupy.zeros((128 * W, 64), cupy.float32),
                                                      cupy.zeros((64, 128), cupy.float32), comm=comm),
        "mixed dtypes": lambda: gemm_allreduce(a, _dev(np.zeros((64, 128), BF16)), comm=comm),
        "K mismatch": lambda: gemm_reduce_scatter(a, _dev(np.zeros((72, 128), f16)), comm=comm),
        "N % 8": lambda: gemm_allreduce(a, _dev(np.zeros((64, 100), f16)), comm=comm),
        "K % 8": lambda: allgather_gemm(_dev(np.zeros((128, 60), f16)), _dev(np.zeros((60, 128), f16)), comm=comm),
        "bad b_layout": lambda: gemm_reduce_scatter(a, b, comm=comm, b_layout="tn"),
        "bad comm_sms": lambda: gemm_allreduce(a, b, comm=comm, comm_sms=0),
        "bad join": lambda: gemm_reduce_scatter(a, b, comm=comm, join=1),
        "bad path": lambda: allgather_gemm(a, b, comm=comm, path="nccl"),
        "no comm": lambda: gemm_reduce_scatter(a, b, comm=None),
        "out shape": lambda: gemm_allreduce(a, b, comm=comm, out=cupy.zeros((8, 128), f16)),
        "out in workspace": lambda: gemm_allreduce(a, b, comm=comm, out=ws_out),
        "host array": lambda: gemm_reduce_scatter(np.zeros((128 * W, 64), f16), b, comm=comm),
    }
    if W > 1:
        cases["uneven M"] = lambda: gemm_reduce_scatter(_dev(np.zeros((128 * W + 1, 64), f16)), b, comm=comm)
        cases["path gemm at world > 1"] = lambda: gemm_reduce_scatter(a, b, comm=comm, path="gemm")

    def body():
        missed, wrong = argument_errors(cases)
        _sync("argument errors")
        if comm.sync.epoch() != e0:
            missed.append("a launch happened")
        return not missed and not wrong, f"no ArgumentError for: {missed}; other exceptions: {wrong}"

    _collective(comm, body)
    ws_out = None  # freed here on every rank


@pytest.mark.multi_gpu
def test_shapes_that_disagree_across_ranks_raise_on_every_rank(comm):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    W = comm.size
    f16 = np.float16
    M = 128 * W * (1 + comm.rank)  # differs by rank
    a = _dev(np.zeros((M, 64), f16))
    b = _dev(np.zeros((64, 128), f16))
    e0 = comm.sync.epoch()

    def body():
        for fn in (gemm_reduce_scatter, gemm_allreduce):
            try:
                fn(a, b, comm=comm, path="fused")
                return False, f"{fn.__name__}: no ArgumentError"
            except mkernel.ArgumentError:
                pass
        try:
            allgather_gemm(_dev(np.zeros((64, 64 * (1 + comm.rank)), f16)),
                           _dev(np.zeros((64 * (1 + comm.rank), 128), f16)), comm=comm, path="fused")
            return False, "allgather_gemm: no ArgumentError"
        except mkernel.ArgumentError:
            pass
        _sync("disagreement")
        return comm.sync.epoch() == e0, "a launch happened"

    _collective(comm, body)


# ------------------------------------------------------------------------------ examples
def _example():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "examples" / "tp_mlp.py"
    spec = importlib.util.spec_from_file_location("tp_mlp_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_tp_mlp_matches_one_gpu(comm):
    ex = _example()
    _collective(comm, lambda: ex.run(comm))


def test_example_tp_mlp_with_jax_arrays(comm):
    try:
        import jax
        if not jax.devices("gpu"):
            raise RuntimeError
    except Exception:  # noqa: BLE001
        ok = False
    else:
        ok = True
    if not all_ranks(comm.mpi, ok):
        pytest.skip("JAX with a GPU backend is not installed")
    ex = _example()
    _collective(comm, lambda: ex.run(comm, use_jax=True))
