"""GPU tests of mkernel.moe's errors, 1 rank and under mpirun (marked gpu and mpi): host argument
errors raise ArgumentError on every rank before anything is launched (at 2 ranks, marked multi_gpu,
also arguments that disagree across ranks); device-detected errors (capacity, expert ids) raise from
comm.check() on every rank. tests/cpu/test_moe.py's docstring says what each checks; the problems are
tests/helpers/moe_cases.py's."""

import numpy as np
import pytest

import mkernel
from mkernel.core.errors import ArgumentError, CapacityError, MKernelError

from tests.helpers import collective_cases
from tests.helpers.argument_errors import refused_before_launch
from tests.helpers.arrays import BF16, DTYPES
from tests.helpers.arrays import bits as _bits
from tests.helpers.arrays import poisoned as _poisoned
from tests.helpers.moe_cases import (
    ERR_WORKSPACE,
    HANG_S,
    _inputs,
    _nan_bits,
    _problem,
    _report_and_decide,
    _run_cases,
    _solo,
    _sync,
    mmoe,
)


# ============================================================================== argument errors
def _valid_call(comm, moe, tag):
    """(ok, message) of a small dispatch + combine, checked exactly."""
    me = comm.rank
    P = _problem(f"valid after {tag}", comm.size, "bf16", 64, 4, 2, "uniform", 64)
    _, _, ok, msg = _solo(moe, comm, P, _inputs(P, me))
    return ok, msg


def _expect_argument_errors(comm, cases, tag):
    """(ok, message): every callable raises ArgumentError, nothing is launched, and a valid call
    afterwards is right."""
    return refused_before_launch(comm, cases, lambda: _valid_call(comm, mmoe, tag), HANG_S)


def _base(comm):
    import cupy

    W = comm.size
    T, H, k, E = 64, 64, 2, 4 * W
    x = cupy.zeros((T, H), dtype=BF16)
    ids = cupy.asarray(np.tile(np.arange(k, dtype=np.int32), (T, 1)))  # experts 0 and 1 (rank 0's)
    w = cupy.full((T, k), 0.5, dtype=cupy.float32)
    return T, H, k, E, x, ids, w


def _dispatch_error_cases(comm):
    import cupy

    moe = mmoe
    W = comm.size
    T, H, k, E, x, ids, w = _base(comm)
    i32, f32 = cupy.int32, cupy.float32

    def z(shape, dt=BF16):
        return cupy.zeros(shape, dtype=dt)

    def d(x_=x, ids_=ids, w_=w, **kw):
        kw.setdefault("comm", comm)
        kw.setdefault("num_experts", E)
        return moe.moe_dispatch(x_, ids_, w_, **kw)

    cap = W * T * k
    cases = {
        "x float32": lambda: d(z((T, H), np.float32)),
        "x float64": lambda: d(z((T, H), np.float64)),
        "x int16": lambda: d(z((T, H), np.int16)),
        "x 1-D": lambda: d(z((T * H,))),
        "x 3-D": lambda: d(z((1, T, H))),
        "x a NumPy array": lambda: d(np.zeros((T, H), dtype=BF16)),
        "x rows not 16-byte aligned": lambda: d(z((T, H + 8))[:, 4:H + 4]),
        "H = 100": lambda: d(z((T, 100))),
        "H = 4": lambda: d(z((T, 4))),
        "topk_ids int64": lambda: d(ids_=ids.astype(cupy.int64)),
        "topk_ids uint32": lambda: d(ids_=ids.astype(cupy.uint32)),
        "topk_ids float32": lambda: d(ids_=ids.astype(f32)),
        "topk_ids T+1 rows": lambda: d(ids_=z((T + 1, k), i32)),
        "topk_ids 1-D": lambda: d(ids_=z((T * k,), i32)),
        "topk_ids not contiguous": lambda: d(ids_=z((T, 2 * k), i32)[:, ::2]),
        "k = 9": lambda: d(ids_=z((T, 9), i32), w_=z((T, 9), f32), num_experts=16 * W),
        "k = 0": lambda: d(ids_=z((T, 0), i32), w_=z((T, 0), f32)),
        "weights float64": lambda: d(w_=w.astype(cupy.float64)),
        "weights float16": lambda: d(w_=w.astype(cupy.float16)),
        "weights [T, k+1]": lambda: d(w_=z((T, k + 1), f32)),
        "weights [T+1, k]": lambda: d(w_=z((T + 1, k), f32)),
        "weights 1-D": lambda: d(w_=z((T * k,), f32)),
        "weights not contiguous": lambda: d(w_=z((T, 2 * k), f32)[:, ::2]),
        "num_experts = 0": lambda: d(num_experts=0),
        "num_experts = -4": lambda: d(num_experts=-4),
        "num_experts > 512": lambda: d(num_experts=512 + W),
        "num_experts = 8.0": lambda: d(num_experts=8.0),
        "num_experts None": lambda: d(num_experts=None),
        "capacity = 0": lambda: d(capacity=0),
        "capacity = -1": lambda: d(capacity=-1),
        "capacity = 2**24 + 1": lambda: d(capacity=(1 << 24) + 1),
        "capacity = 100.0": lambda: d(capacity=100.0),
        "out wrong rows": lambda: d(out=z((cap + 1, H))),
        "out wrong H": lambda: d(out=z((cap, H + 8))),
        "out fp16 for bf16 x": lambda: d(out=z((cap, H), np.float16)),
        "out a NumPy array": lambda: d(out=np.zeros((cap, H), dtype=BF16)),
    }
    if W > 1:
        cases["num_experts not a multiple of the world"] = lambda: d(num_experts=4 * W + 1)
    return cases


def _comm_error_cases(comm):
    """comm= that is not an mkernel communicator (ring_attention raises ArgumentError for these)."""
    import cupy

    moe = mmoe
    T, H, k, E, x, ids, w = _base(comm)
    w1 = cupy.zeros((E // comm.size, H, 64), dtype=BF16)
    return {
        "moe_dispatch comm=None": lambda: moe.moe_dispatch(x, ids, w, comm=None, num_experts=E),
        "moe_dispatch comm is an mpi4py communicator": lambda: moe.moe_dispatch(x, ids, w, comm=comm.mpi,
                                                                               num_experts=E),
        "moe_dispatch comm is a string": lambda: moe.moe_dispatch(x, ids, w, comm="world", num_experts=E),
        "moe_dispatch_gemm comm is an mpi4py communicator": lambda: mkernel.moe_dispatch_gemm(
            x, ids, w, w1, comm=comm.mpi, num_experts=E),
    }


def _combine_error_cases(comm, recv, h):
    import cupy

    moe = mmoe
    T, H = h.T, h.H
    cap, El = h.capacity, h.group_rows.size

    def z(shape, dt=BF16):
        return cupy.zeros(shape, dtype=dt)

    def c(y=recv, handle=h, **kw):
        kw.setdefault("comm", comm)
        return moe.moe_combine(y, handle, **kw)

    def gc(y2=None, w2=None, handle=h, **kw):
        kw.setdefault("comm", comm)
        return mkernel.moe_gemm_combine(z((cap, 64)) if y2 is None else y2, z((El, 64, H)) if w2 is None else w2,
                                    handle, **kw)

    return {
        "combine y rows cap+1": lambda: c(y=z((cap + 1, H))),
        "combine y rows cap-1": lambda: c(y=z((cap - 1, H))),
        "combine y H+8": lambda: c(y=z((cap, H + 8))),
        "combine y fp16 for a bf16 dispatch": lambda: c(y=z((cap, H), np.float16)),
        "combine y float32": lambda: c(y=z((cap, H), np.float32)),
        "combine y 3-D": lambda: c(y=z((1, cap, H))),
        "combine handle None": lambda: c(handle=None),
        "combine handle (recv, handle)": lambda: c(handle=(recv, h)),
        "combine out [T+1, H]": lambda: c(out=z((T + 1, H))),
        "combine out fp16": lambda: c(out=z((T, H), np.float16)),
        "combine comm=None": lambda: c(comm=None),
        "gemm_combine w2 maps F to H+8": lambda: gc(w2=z((El, 64, H + 8))),
        "gemm_combine w2 float16": lambda: gc(w2=z((El, 64, H), np.float16)),
        "gemm_combine w2 El+1 experts": lambda: gc(w2=z((El + 1, 64, H))),
        "gemm_combine w2 K matches neither dim": lambda: gc(w2=z((El, 72, 72))),
        "gemm_combine w2 2-D": lambda: gc(w2=z((64, H))),
        "gemm_combine w_layout='xy'": lambda: gc(w_layout="xy"),
        "gemm_combine w_layout='nk' on [El, F, H]": lambda: gc(w2=z((El, 64, H + 8)), w_layout="nk"),
        "gemm_combine y2 rows cap-1": lambda: gc(y2=z((cap - 1, 64))),
        "gemm_combine y2 1-D": lambda: gc(y2=z((cap * 64,))),
        "gemm_combine handle None": lambda: gc(handle=None),
        "gemm_combine path='both'": lambda: gc(path="both"),
        "gemm_combine comm_sms=0": lambda: gc(comm_sms=0, path="fused"),
        "gemm_combine fused y2 float32": lambda: gc(y2=z((cap, 64), np.float32), path="fused"),
        "gemm_combine fused y2 F=60 (not a multiple of 8)": lambda: gc(y2=z((cap, 60)), w2=z((El, 60, H)),
                                                                      path="fused"),
        "gemm_combine fused out [T+1, H]": lambda: gc(out=z((T + 1, H)), path="fused"),
    }


def _dispatch_gemm_error_cases(comm):
    import cupy

    W = comm.size
    T, H, k, E, x, ids, w = _base(comm)
    El = E // W

    def z(shape, dt=BF16):
        return cupy.zeros(shape, dtype=dt)

    def dg(w1, **kw):
        return mkernel.moe_dispatch_gemm(x, ids, w, w1, comm=comm, num_experts=E, **kw)

    return {
        "w1 float32": lambda: dg(z((El, H, 64), np.float32)),
        "w1 fp16 for bf16 x": lambda: dg(z((El, H, 64), np.float16)),
        "w1 El+1 experts": lambda: dg(z((El + 1, H, 64))),
        "w1 K matches neither dim": lambda: dg(z((El, 72, 72))),
        "w1 2-D": lambda: dg(z((H, 64))),
        "w1 w_layout='nk' on [El, H, F]": lambda: dg(z((El, H, 72)), w_layout="nk"),
        "w1 w_layout='xy'": lambda: dg(z((El, H, 64)), w_layout="xy"),
        "path='fast'": lambda: dg(z((El, H, 64)), path="fast"),
        "comm_sms=True": lambda: dg(z((El, H, 64)), comm_sms=True),
        "capacity 100.0 (a float)": lambda: dg(z((El, H, 64)), capacity=100.0),
    }


def _argument_body(comm, name):
    moe = mmoe
    if name == "moe_dispatch inputs":
        return _expect_argument_errors(comm, _dispatch_error_cases(comm), name)
    if name == "comm arguments":
        return _expect_argument_errors(comm, _comm_error_cases(comm), name)
    if name == "moe_combine / moe_gemm_combine":
        T, H, k, E, x, ids, w = _base(comm)
        recv, h = moe.moe_dispatch(x, ids, w, comm=comm, num_experts=E)  # a valid handle (launched before e0)
        return _expect_argument_errors(comm, _combine_error_cases(comm, recv, h), name)
    if name == "moe_dispatch_gemm bad w1 (raised before the dispatch launches)":
        # moe_dispatch_gemm validates w1 before it plans or launches anything (mkernel/ops/moe_gemm.py).
        return _expect_argument_errors(comm, _dispatch_gemm_error_cases(comm), name)
    raise ValueError(name)


@collective_cases.gpu_mpi
def test_argument_errors(comm):
    names = ["moe_dispatch inputs", "comm arguments", "moe_combine / moe_gemm_combine",
             "moe_dispatch_gemm bad w1 (raised before the dispatch launches)"]
    results = _run_cases(comm, names, lambda n: _argument_body(comm, n))
    _report_and_decide(comm, "argument errors (every rank alike): ArgumentError, nothing launched", names, results)


def _disagreeing_cases(comm):
    """Arguments valid on each rank that disagree across ranks (comm.agree raises on every rank).
    Every H here is used nowhere else in this file: no rank can have agreed on the shape before
    (a rank with the key cached would skip the collective the others enter)."""
    import cupy

    moe = mmoe
    W, r = comm.size, comm.rank
    odd = r % 2

    def call(H, T=64, k=2, E=4 * W, dt=BF16, capacity=None):
        ids = cupy.asarray(np.tile(np.arange(k, dtype=np.int32), (T, 1)))
        return moe.moe_dispatch(cupy.zeros((T, H), dtype=dt), ids, cupy.full((T, k), 0.5, dtype=cupy.float32),
                                comm=comm, num_experts=E, capacity=capacity)

    return {
        "T differs, default capacity": lambda: call(136, T=64 + 8 * r),
        "k differs": lambda: call(152, k=2 + odd),
        "num_experts differs": lambda: call(168, E=4 * W * (1 + odd)),
        "dtype differs": lambda: call(184, dt=np.dtype(np.float16) if odd else BF16),
        "capacity differs": lambda: call(208, capacity=1000 + r),
    }


@pytest.mark.multi_gpu
@collective_cases.gpu_mpi
def test_arguments_that_disagree_across_ranks_raise_on_every_rank(comm):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    names = list(_disagreeing_cases(comm))
    results = _run_cases(comm, names, lambda n: _expect_argument_errors(comm, {n: _disagreeing_cases(comm)[n]}, n))
    _report_and_decide(comm, "arguments that disagree across ranks", names, results)


# ============================================================================== device errors
def _device_error_problem(name, W):
    """(problem, capacity, expected exception class) of a device-error case."""
    if name == "capacity one row short of the need":
        # T * k = 602 and a capacity of 601 at world 1: the ranking step runs before the capacity
        # check and must not write send_order past its capacity entries (it skips positions >= capacity).
        P = _problem(name, W, "bf16", 64, 4, 2, "uniform", 301)
        return P, P.need - 1, CapacityError
    if name == "a rank receives more than the capacity, every send fits":
        P = _problem(name, W, "bf16", 64, 4, 2, "rank0", 200)
        return P, 200 * 2, CapacityError  # each rank sends 400 rows; rank 0 would receive 400 * W
    P = _problem(name, W, "fp16", 64, 4, 2, "uniform", 150)
    if name == "expert id == num_experts on the last rank":
        P.ids[W - 1][7, 1] = P.E
    elif name == "expert id -1 on rank 0":
        P.ids[0][0, 0] = -1
    elif name == "expert ids 10**6 on every rank":
        for s in range(W):
            P.ids[s][::3, 0] = 10 ** 6
    else:
        raise ValueError(name)
    return P, None, ArgumentError


FUSED = " [moe_dispatch_gemm]"  # a device-error case run through the fused kernel


def _device_error_body(comm, name):
    import cupy
    from mpi4py import MPI

    W, me = comm.size, comm.rank
    fused = name.endswith(FUSED)
    op = "moe_dispatch_gemm" if fused else "moe_dispatch"
    P, cap, exc = _device_error_problem(name[:-len(FUSED)] if fused else name, W)
    c = mkernel.init(MPI.COMM_WORLD, workspace_bytes=ERR_WORKSPACE)  # errors are sticky: a communicator per case
    try:
        x, ids, w = _inputs(P, me)
        buf = _poisoned((cap if cap is not None else P.cap, 64 if fused else P.H), P.dtn)
        at_call = None
        try:
            if fused:
                w1 = cupy.ones((P.El, P.H, 64), dtype=DTYPES[P.dtn])
                mkernel.moe_dispatch_gemm(x, ids, w, w1, comm=c, num_experts=P.E, capacity=cap, out=buf)
            else:
                mkernel.moe_dispatch(x, ids, w, comm=c, num_experts=P.E, capacity=cap, out=buf)
        except Exception as e:  # noqa: BLE001  (the error must be found on the device, not here)
            at_call = e
        _sync(name)
        got = None
        try:
            c.check()
        except MKernelError as e:
            got = e
        sticky = False
        try:
            c.check()
        except MKernelError:
            sticky = True
        untouched = bool((_bits(buf) == _nan_bits(P.dtn)).all())
        ok = at_call is None and isinstance(got, exc) and op in str(got) and untouched
        msg = (f"call: {'returned' if at_call is None else f'RAISED {type(at_call).__name__}: {str(at_call)[:120]}'}; "
               f"check(): {type(got).__name__ if got is not None else 'NOTHING'} (want {exc.__name__})"
               f"{': ' + str(got)[:160] if got is not None else ''}; out {'untouched' if untouched else 'WRITTEN'}; "
               f"sticky: {sticky}")
        return ok, msg
    finally:
        c.close()


@collective_cases.gpu_mpi
def test_device_errors(comm):
    names = ["capacity one row short of the need"]
    if comm.size > 1:
        names.append("a rank receives more than the capacity, every send fits")
    names += ["expert id == num_experts on the last rank", "expert id -1 on rank 0", "expert ids 10**6 on every rank"]
    names += [n + FUSED for n in names]  # the fused kernel: its GEMM CTAs stop on the dispatch's verdict
    results = _run_cases(comm, names, lambda n: _device_error_body(comm, n))
    _report_and_decide(comm, "errors found on the device, raised by comm.check() on every rank", names, results)
