"""Tests of mkernel.moe (expert parallelism inside one node: moe_dispatch, moe_combine,
moe_dispatch_gemm, moe_gemm_combine).

Every rank builds the same GLOBAL problem from a fixed seed (the tokens, expert ids and routing
weights of every rank, and for the layer tests every expert's weights), takes its own slice, and
computes the reference of everything it must receive and return without any communication. The
row-order rule of the receive buffer (owner rank d holds experts d * El .. (d + 1) * El - 1): rows
by local expert, then by source rank, then by the source's pair index p = t * k + j ascending
(_layout; checked against a hand-worked example and an independent lexsort on the CPU). Every
output starts poisoned with NaN, so an element nobody wrote fails, and rows past handle.received()
must still hold the poison.

CPU:
- MkMoeArgs against moe_args.cuh (g++ offsetof / sizeof, 272 bytes); the constants of moe.py and
  sync.py against the headers (MOE_MAX_*, MOE_CNT_WORDS, MOE_ERR_*, MOE_THREADS, MK_ERR_INPUT);
- moe_capacity values and its ArgumentErrors; the exports (mkernel.moe_dispatch ... CapacityError);
  error_from_status maps the MoE device errors to CapacityError / ArgumentError naming the op;
- the tests' own reference: the row-order rule on a hand-worked example, against a lexsort, every
  pair in exactly one row, the routing generators' promises (distinct experts, empty experts, a
  rank receiving nothing), the exact combine sums representable in fp32, the layer reference
  against a per-token loop.
GPU, 1 rank and under mpirun (marked gpu and mpi):
- dispatch layout, exact (test_dispatch_layout): integer-valued x; recv rows [0, received) bitwise
  equal to the expected rows; received and group_rows (handle.counts()) equal the expected
  counts; rows past received still poisoned; the first wrong (expert, source) block is named
  together with what the wrong row holds; x unchanged. Routing: uniform top-1 / 2 / 8, Zipf(1.2)
  top-2 / 8, a token picking an expert twice, experts (and at W >= 2 whole ranks) left empty,
  everything to rank 0's experts (rank 0 receives exactly its capacity), one token, T = 333 / 777,
  T = 0 on the last rank, T different per rank (explicit capacity), a capacity exactly the need
  and one above it (rows past received also at world 1);
  El 1, 2, 4, 8, 16, 64; bf16 and fp16; H 64 ... 1000 (7168 in test_dispatch_and_combine_large,
  marked slow);
- combine, exact (test_combine_exact), the same cases: y integer-valued rows independent of
  recv (rows past received NaN: read them and the output is wrong), weights in {0.25, 0.5, 1, 2}
  so that every fp32 sum is exact: out bitwise equal to the exact sum rounded once;
- the whole layer (test_layer_reference): moe_dispatch_gemm (w1 [El, H, F]) -> relu on the device
  -> moe_gemm_combine (w2 [El, F, H]) on random normal inputs (weights scaled by 1 / sqrt(fan-in))
  against float64 NumPy of routing, both GEMMs, the activation and the weighted sum: relative
  Frobenius error < 1e-2 of out and of the received GEMM rows y, per token < 5e-2; uniform and
  Zipf, top-2 and top-8, El up to 64, empty experts, T = 0 on a rank, w_layout='nk' (once with
  H == F, where only w_layout can tell);
- 20 launches (dispatch + combine) on the same buffers alternating two inputs of one shape, nothing
  synchronised in between: each bitwise equal to its solo run, the epoch advanced by 40
  (test_repeated_launches); two shapes (H, k, E, dtype differ) back to back, 5 times each, all
  queued before one synchronisation: each bitwise equal to its solo run (test_back_to_back_shapes);
- a stale handle (a later dispatch of the same shape) raises ArgumentError in moe_combine,
  moe_gemm_combine, received() and counts(), launching nothing; the fresh handle still works;
- host argument errors (dtypes, shapes, H % 8, k of 0 and 9, num_experts, capacity, out, comm,
  combine's y / handle / out, moe_gemm_combine's w2 / y2) raise ArgumentError on every rank before
  anything is launched (the epoch does not move), and a valid call afterwards is right; bad w1 of
  moe_dispatch_gemm is a case of its own (see its docstring); at 2 ranks (marked multi_gpu) also
  T / k / num_experts / dtype / capacity disagreeing across ranks;
- device-detected errors (test_device_errors): capacity one row short, a rank receiving more than
  the capacity while every send fits (W >= 2), expert ids out of range on one rank or on all:
  the dispatch call returns, then comm.check() raises CapacityError / ArgumentError on EVERY rank,
  naming moe_dispatch, and the output is untouched. Errors are sticky (SyncState.check never
  clears them, and every later device wait gives up), so each case runs on a communicator of its
  own, created and closed inside the case.

Collective discipline (as tests/test_ring_attention.py): every rank runs the same cases in the same
order, each guarded (an exception is caught and recorded); after every case the ranks exchange their
outcomes on a duplicate of the communicator's MPI communicator; if one rank raised where another did
not, or a peer error or timeout was raised, all ranks stop running cases. Per-case tables are
printed, then pass / fail is decided with conftest.all_ranks. A device hang ends the process after
45 s (sync_or_exit). Each test frees its MoE buffers at its end (comm.release_plans).

    python3 -m pytest tests/test_moe.py -q -s
    mpirun -n 2 --oversubscribe python3 -m pytest tests/test_moe.py -q -s -m "gpu and mpi"
"""

import importlib
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import mkernel
from mkernel.core.errors import ArgumentError, CapacityError, MKernelError

from tests.helpers import collective_cases
from tests.helpers.argument_errors import argument_errors, refused_before_launch
from tests.helpers.arrays import BF16, DTYPES
from tests.helpers.arrays import bits as _bits
from tests.helpers.arrays import dev as _dev
from tests.helpers.arrays import host as _host
from tests.helpers.arrays import poison as _poison
from tests.helpers.arrays import poisoned as _poisoned
from tests.helpers.moe_cases import (
    DISPATCH_CASES,
    DISPATCH_SLOW,
    ERR_WORKSPACE,
    HANG_S,
    REL_TOL,
    TOKEN_TOL,
    WORKSPACE,
    _build,
    _case_name,
    _cases_for,
    _check_exact_out,
    _check_recv,
    _collective,
    _combine_reference,
    _combine_values,
    _inputs,
    _layer_problem,
    _layer_reference,
    _layout,
    _nan_bits,
    _pair_rows,
    _problem,
    _rel,
    _relu,
    _report_and_decide,
    _roundtrip_want,
    _run_cases,
    _solo,
    _sync,
    mmoe,
)


@pytest.fixture(scope="module")
def comm():
    c = collective_cases.with_driver(mkernel.init(workspace_bytes=WORKSPACE))
    yield c
    collective_cases.close(c)


# ======================================================================================== CPU
def test_args_layout_matches_host_compiler(tmp_path):
    """MkMoeArgs (moe.py) against the C struct of moe_args.cuh, as g++ lays it out (320 bytes)."""
    import ctypes

    from tests.helpers.c_layout import assert_same_layout

    m = mmoe
    assert_same_layout("moe_args.cuh", m.MkMoeArgs, tmp_path)
    assert ctypes.sizeof(m.MkMoeArgs) == 320


def test_fused_args_layout_matches_host_compiler(tmp_path):
    """MkMoeGemmArgs (moe_gemm.py) against moe_gemm_args.cuh. The C struct is alignas(64) through
    TmaDesc, which ctypes cannot express: the mirror ends in an explicit tail (no C field) and alignof
    is checked apart."""
    import ctypes

    from tests.helpers.c_layout import c_offsets, py_offsets

    mirror = importlib.import_module("mkernel.ops.moe_gemm").MkMoeGemmArgs
    fields = [name for name, *_ in mirror._fields_ if name != "tail"]
    c = c_offsets("moe_gemm_args.cuh", "MkMoeGemmArgs", fields, tmp_path)
    py = {k: v for k, v in py_offsets(mirror).items() if k not in ("alignof", "tail")}
    assert c.pop("alignof") == 64
    assert c == py, "MkMoeGemmArgs mirror differs from moe_gemm_args.cuh"
    assert ctypes.sizeof(mirror) == 960


def _c_constants(header, names, tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler to read the C constants")
    from mkernel.runtime.compile import include_dirs
    lines = [f'#include "{header}"', "#include <cstdio>", "int main() {"]
    lines += [f'  std::printf("%s %lld\\n", "{n.split("(")[0]}", (long long)({n}));' for n in names]
    lines.append("}")
    src = tmp_path / "moe_constants.cpp"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "moe_constants"
    subprocess.run([cxx, "-std=c++17", *(f"-I{d}" for d in include_dirs()), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {a: int(b) for a, b in (line.split() for line in out.splitlines())}


def test_constants_match_the_headers(tmp_path):
    from mkernel.runtime import sync
    from mkernel.runtime.compile import cuda_files

    m = mmoe
    c = _c_constants("moe_args.cuh", ["MOE_MAX_WORLD", "MOE_MAX_EXPERTS", "MOE_MAX_TOPK", "MOE_CNT_WORDS",
                                      "MOE_ERR_CAPACITY", "MOE_ERR_EXPERT_ID", "MOE_ROW_WORDS(10)"], tmp_path)
    assert c["MOE_MAX_WORLD"] == m.MAX_WORLD and c["MOE_MAX_EXPERTS"] == m.MAX_EXPERTS
    assert c["MOE_MAX_TOPK"] == m.MAX_TOPK and c["MOE_CNT_WORDS"] == m.CNT_WORDS
    assert c["MOE_ERR_CAPACITY"] == sync.MOE_ERR_CAPACITY and c["MOE_ERR_EXPERT_ID"] == sync.MOE_ERR_EXPERT_ID
    assert c["MOE_ROW_WORDS"] == 12
    cu = cuda_files()["moe.cu"].read_text()
    assert int(re.search(r"MOE_THREADS\s*=\s*(\d+)", cu).group(1)) == m.THREADS
    sig = cuda_files()["signals.cuh"].read_text()
    assert int(re.search(r"MK_ERR_INPUT\s*=\s*(\d+)", sig).group(1)) == sync.ERR_INPUT
    assert "moe_dispatch" in sync.OP_ID and "moe_combine" in sync.OP_ID
    assert set(m.SPEC.name_expressions) == {"mk_moe_dispatch_kernel", "mk_moe_combine_kernel<0>",
                                            "mk_moe_combine_kernel<1>"}
    assert m.DT == {"bfloat16": 0, "float16": 1}  # the combine template argument (0: bf16 in moe.cu)


def test_node_args_layout_and_constants(tmp_path):
    """Between nodes: MkMoeNodeArgs (moe_nodes.py) against moe_nodes_args.cuh as g++ lays it out,
    and the constants both sides use."""
    from mkernel.runtime.compile import cuda_files

    from tests.helpers.c_layout import assert_same_layout

    n = importlib.import_module("mkernel.ops.moe_nodes")
    assert_same_layout("moe_nodes_args.cuh", n.MkMoeNodeArgs, tmp_path)
    c = _c_constants("moe_nodes_args.cuh", ["MOE_MAX_NODES", "MOE_PF_WORDS", "MOE_NCNT_WORDS",
                                            "MOE_GROW_WORDS(10)"], tmp_path)
    assert c["MOE_MAX_NODES"] == n.MAX_NODES and c["MOE_PF_WORDS"] == n.PF_WORDS
    assert c["MOE_NCNT_WORDS"] == n.CNT_WORDS and c["MOE_GROW_WORDS"] == n.grow_words(10)
    cu = cuda_files()["moe_nodes.cu"].read_text()
    assert int(re.search(r"MOE_NODE_THREADS\s*=\s*(\d+)", cu).group(1)) == n.THREADS
    assert set(n.SPEC.name_expressions) == {"mk_moe_exchange_kernel", "mk_moe_partials_kernel<0>",
                                            "mk_moe_partials_kernel<1>"}


def _fake_comm(node_of, local_size):
    """A Communicator with only the attributes the argument checks read (no GPU, no MPI)."""
    import types

    from mkernel.comm.communicator import Communicator

    c = object.__new__(Communicator)
    c.size, c.rank, c.local_size, c.local_rank = len(node_of), 0, local_size, 0
    c.num_nodes, c.node = len(set(node_of)), node_of[0]
    c.topology = types.SimpleNamespace(node_of=tuple(node_of))
    return c


def test_between_nodes_refusals(monkeypatch):
    """Between nodes, before anything collective: node-major ranks of equal nodes (MoE, ring
    attention and the TP ops share the check), the fused GEMM + combine refused, a bundle's sums
    within one 32-bit WRITE."""
    from mkernel.ops import tp

    n = importlib.import_module("mkernel.ops.moe_nodes")
    mmoe._check_comm("moe_dispatch", _fake_comm((0, 0, 1, 1), 2))  # node-major: accepted
    for node_of, L in (((0, 1, 0, 1), 2), ((0, 0, 0, 1), 3), ((1, 1, 0, 0), 2)):
        with pytest.raises(ArgumentError, match="node-major"):
            mmoe._check_comm("moe_dispatch", _fake_comm(node_of, L))
        with pytest.raises(ArgumentError, match="node-major"):
            tp.check_node_major("ring_attention", _fake_comm(node_of, L))
    mg = importlib.import_module("mkernel.ops.moe_gemm")
    monkeypatch.setattr(tp, "sm_count", lambda: 132)  # comm_sms is checked against it (no GPU here)
    with pytest.raises(ArgumentError, match="inside one node"):
        mg.moe_gemm_combine(None, None, None, comm=_fake_comm((0, 1), 1), path="fused")
    n.check_sizes("moe_dispatch", 8192, 2, 1 << 17)  # sums of 65536 tokens x 8192: 2 GiB
    with pytest.raises(ArgumentError, match="WRITE"):
        n.check_sizes("moe_dispatch", 8192, 1, 1 << 17)  # 4 GiB
    src = (Path(mmoe.__file__).parent / "ring_attention.py").read_text()
    assert 'check_node_major("ring_attention", comm)' in src


def test_moe_capacity():
    m = mmoe
    assert m.moe_capacity(100, 2, 4) == 800
    assert m.moe_capacity(333, 8, 2) == 2 * 333 * 8
    assert m.moe_capacity(7, 1, 1) == 7
    assert m.moe_capacity(0, 2, 2) == 1  # never 0 rows
    assert mkernel.moe_capacity is m.moe_capacity
    for bad in ((-1, 2, 2), (10, 0, 2), (10, 2, 0), (10, 1.5, 2), ("10", 2, 2), (10, 2, None), (10.0, 2, 2)):
        with pytest.raises(ArgumentError):
            m.moe_capacity(*bad)


def test_module_and_export():
    from mkernel.core import errors

    m = mmoe
    mg = importlib.import_module("mkernel.ops.moe_gemm")
    for name in ("moe_dispatch", "moe_combine", "moe_dispatch_gemm", "moe_gemm_combine", "moe_capacity", "MoeHandle"):
        mod = mg if name in ("moe_dispatch_gemm", "moe_gemm_combine") else m
        assert getattr(mkernel, name) is getattr(mod, name), f"mkernel.{name} is not {mod.__name__}.{name}"
        assert name in mkernel.__all__
    assert mkernel.CapacityError is CapacityError and issubclass(CapacityError, MKernelError)
    assert not issubclass(CapacityError, ArgumentError)
    assert "CapacityError" in mkernel.__all__ and "CapacityError" in errors.__all__


def test_device_errors_map_to_exceptions():
    from mkernel.runtime import sync

    for where, cls in ((sync.MOE_ERR_CAPACITY, CapacityError), (sync.MOE_ERR_EXPERT_ID, ArgumentError)):
        st = sync.MkStatus(code=sync.ERR_INPUT, op=sync.OP_ID["moe_dispatch"], rank=1, peer=-1, where=where,
                           expected=64, seen=65)
        e = sync.error_from_status(st)
        assert type(e) is cls and "moe_dispatch" in str(e), (cls, e)


def test_reference_row_order_rule():
    """The tests' reference on a hand-worked example (W 2, El 2, k 2): rank 0 owns experts 0 and 1,
    rank 1 experts 2 and 3; rows by local expert, then source, then p = t * k + j."""
    ids = [np.array([[1, 2], [0, 1], [3, 0]], dtype=np.int32), np.array([[0, 3], [1, 0]], dtype=np.int32)]
    lay = _layout(ids, 2, 2, 2)
    # owner 0: expert 0 <- rank 0 pairs 2 (t1 j0), 5 (t2 j1); rank 1 pairs 0, 3. expert 1 <- rank 0 pairs 0, 3;
    # rank 1 pair 2. owner 1: expert 2 <- rank 0 pair 1; expert 3 <- rank 0 pair 4, rank 1 pair 1.
    assert lay[0][0].tolist() == [0, 0, 1, 1, 0, 0, 1] and lay[0][1].tolist() == [2, 5, 0, 3, 0, 3, 2]
    assert lay[0][2].tolist() == [[2, 2], [2, 1]]
    assert lay[1][0].tolist() == [0, 0, 1] and lay[1][1].tolist() == [1, 4, 1]
    assert lay[1][2].tolist() == [[1, 0], [1, 1]]


@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
def test_reference_self_consistency(W):
    """For every case: _layout equals an independent lexsort by (expert, source, pair); every pair
    lies in exactly one row; counts add up; the routing keeps its promises; the exact combine sums
    are representable in fp32; the capacity covers the need (or is exactly it)."""
    for c in DISPATCH_CASES + DISPATCH_SLOW:
        if c["El"] * W > 512 or (c["H"] > 1024 and W > 2):
            continue
        P = _problem(_case_name(c), W, c["dtn"], c["H"], c["El"], c["k"], c["routing"], c["T"], c["cap"])
        e_all = np.concatenate([a.reshape(-1) for a in P.ids]).astype(np.int64)
        s_all = np.concatenate([np.full(t * P.k, s) for s, t in enumerate(P.Ts)]).astype(np.int64)
        p_all = np.concatenate([np.arange(t * P.k) for t in P.Ts]).astype(np.int64)
        order = np.lexsort((p_all, s_all, e_all))
        for d in range(W):
            sel = order[(e_all[order] // P.El) == d]
            src, pair, counts = P.layout[d]
            assert src.tolist() == s_all[sel].tolist() and pair.tolist() == p_all[sel].tolist(), (c, d)
            assert counts.sum() == src.size
        assert sum(o[0].size for o in P.layout) == e_all.size
        small = sum(P.Ts) * P.k * P.H <= 4_000_000  # the combine reference's float64 rows
        Ys = _combine_values(P) if small else None
        for s in range(W):
            rows = _pair_rows(P, s)
            owner = P.ids[s].reshape(-1) // P.El
            for d in range(W):  # (owner, row) pairs distinct: one row per pair
                r = rows[owner == d]
                assert np.unique(r).size == r.size
            if c["routing"] != "repeat" and P.Ts[s]:
                assert all(np.unique(row).size == P.k for row in P.ids[s]), c
            if small:
                ref = _combine_reference(P, s, Ys)
                assert (ref.astype(np.float32).astype(np.float64) == ref).all()
            exact = P.xs[s].astype(np.float64) * P.ws[s].astype(np.float64).sum(axis=1, keepdims=True)
            assert (exact.astype(np.float32).astype(np.float64) == exact).all()  # the device's fp32 sum is exact
            assert (_roundtrip_want(P, s) == exact.astype(np.float32).astype(P.dt)).all()
        if c["routing"] == "sparse":
            assert (np.concatenate([o[2].sum(axis=1) for o in P.layout]) == 0).any()
            if W > 1:
                assert P.layout[W - 1][0].size == 0
        if c["routing"] == "rank0" and W > 1:
            assert all(P.layout[d][0].size == 0 for d in range(1, W)) and P.layout[0][0].size == P.cap
        assert P.cap >= P.need and (c["cap"] != "tight" or P.cap == P.need)
        assert c["cap"] != "slack" or P.cap > max(o[0].size for o in P.layout)
        assert (P.xcat.astype(np.float64) == np.round(P.xcat.astype(np.float64))).all()


def test_layer_reference_against_a_loop():
    """_layer_reference against a plain loop over tokens and their k experts (float64)."""
    for W in (1, 2, 3):
        P = _layer_problem("selftest layer", W, "bf16", 16, 24, 3, 2, "zipf", "ragged", cap="max")
        for me in range(W):
            y_ref, out_ref = _layer_reference(P, me)
            src, pair, _ = P.layout[me]
            for r in range(src.size):
                s, p = int(src[r]), int(pair[r])
                e = int(P.ids[s].reshape(-1)[p])
                assert e // P.El == me
                want = P.xs[s][p // P.k].astype(np.float64) @ P.W1[e].astype(np.float64)
                assert np.allclose(y_ref[r], want, rtol=1e-12, atol=1e-12)
            for t in range(P.Ts[me]):
                acc = np.zeros(P.H)
                for j in range(P.k):
                    e = int(P.ids[me][t, j])
                    h = np.maximum(P.xs[me][t].astype(np.float64) @ P.W1[e].astype(np.float64), 0)
                    acc += float(P.ws[me][t, j]) * (h @ P.W2[e].astype(np.float64))
                assert np.allclose(out_ref[t], acc, rtol=1e-12, atol=1e-12)


def _dispatch_body(comm, c):
    moe = mmoe
    me = comm.rank
    P = _build(comm, c)
    x, ids, w = _inputs(P, me)
    x_bits = _bits(x)
    buf = _poisoned((P.cap, P.H), P.dtn)
    recv, h = moe.moe_dispatch(x, ids, w, comm=comm, num_experts=P.E, capacity=P.capacity, out=buf)
    _sync(_case_name(c))
    comm.check()
    if recv is not buf:
        return False, "moe_dispatch did not return the given out"
    if h.capacity != P.cap or h.group_rows.shape != (P.El,) or str(h.group_rows.dtype) != "int32":
        return False, (f"handle: capacity {h.capacity} (want {P.cap}), "
                       f"group_rows {h.group_rows.dtype} {h.group_rows.shape}")
    ok, msg = _check_recv(P, me, recv, h)
    if not (_bits(x) == x_bits).all():
        ok, msg = False, msg + "; X MODIFIED"
    return ok, msg


def _combine_body(comm, c):
    moe = mmoe
    me = comm.rank
    P = _build(comm, c)
    x, ids, w = _inputs(P, me)
    recv, h = moe.moe_dispatch(x, ids, w, comm=comm, num_experts=P.E, capacity=P.capacity)
    Ys = _combine_values(P)
    n = P.layout[me][0].size
    y_host = np.empty((P.cap, P.H), dtype=P.dt)
    y_host.view(np.uint16)[:] = _nan_bits(P.dtn)  # rows past received: NaN (combine must not read them)
    y_host[:n] = Ys[me].astype(np.float32).astype(P.dt)
    y = _dev(y_host)
    out_buf = _poisoned((P.Ts[me], P.H), P.dtn)
    out = moe.moe_combine(y, h, comm=comm, out=out_buf)
    _sync(_case_name(c))
    comm.check()
    if out is not out_buf:
        return False, "moe_combine did not return the given out"
    if h.received() != n:
        return False, f"dispatch received {h.received()} rows, expected {n} (see test_dispatch_layout)"
    want = _combine_reference(P, me, Ys).astype(np.float32).astype(P.dt)
    return _check_exact_out(P, me, out, want)


@collective_cases.gpu_mpi
def test_dispatch_layout(comm):
    cases = _cases_for(comm, DISPATCH_CASES)
    names = list(cases)
    results = _run_cases(comm, names, lambda n: _dispatch_body(comm, cases[n]))
    _report_and_decide(comm, "moe_dispatch layout, bitwise (label: dtype H El k T capacity)", names, results)


@collective_cases.gpu_mpi
def test_combine_exact(comm):
    cases = _cases_for(comm, DISPATCH_CASES)
    names = list(cases)
    results = _run_cases(comm, names, lambda n: _combine_body(comm, cases[n]))
    _report_and_decide(comm, "moe_combine exact (integer rows, weights in {1/4, 1/2, 1, 2}), bitwise", names, results)


@pytest.mark.slow
@collective_cases.gpu_mpi
def test_dispatch_and_combine_large(comm):
    cases = _cases_for(comm, DISPATCH_SLOW)
    names = [f"{kind} {n}" for n in cases for kind in ("dispatch", "combine")]
    results = _run_cases(comm, names, lambda n: (_dispatch_body if n.startswith("dispatch") else _combine_body)(
        comm, cases[n.split(" ", 1)[1]]))
    _report_and_decide(comm, "moe_dispatch / moe_combine at H=7168, bitwise", names, results)


# ====================================================================================== the layer
LAYER_CASES = [
    # label, dtype, H, F, El, k, routing, T, capacity, w_layout
    ("uniform top-2", "bf16", 256, 512, 4, 2, "uniform", 300, "auto", "kn"),
    ("zipf(1.2) top-2", "bf16", 512, 256, 2, 2, "zipf", 400, "auto", "kn"),
    ("uniform top-8", "bf16", 128, 256, 8, 8, "uniform", 200, "auto", "kn"),
    ("zipf(1.2) top-8", "fp16", 256, 128, 8, 8, "zipf", 150, "auto", "kn"),
    ("El=64 zipf(1.2) top-8", "bf16", 128, 128, 64, 8, "zipf", 256, "auto", "kn"),
    ("empty experts (and ranks)", "bf16", 128, 256, 8, 2, "sparse", 200, "auto", "kn"),
    ("T=0 on the last rank", "fp16", 128, 128, 4, 2, "uniform", "zero-last", "max", "kn"),
    ("w_layout nk, H == F", "bf16", 256, 256, 4, 2, "uniform", 300, "auto", "nk"),
    ("w_layout nk", "fp16", 128, 384, 4, 2, "zipf", 200, "auto", "nk"),
]


def _layer_name(c):
    label, dtn, H, F, El, k, routing, T, cap, lay = c
    return f"{label}: {dtn} H={H} F={F} El={El} k={k} T={T} w={lay}"


def _layer_body(comm, c):
    label, dtn, H, F, El, k, routing, T, cap, lay = c
    W, me = comm.size, comm.rank
    P = _layer_problem(_layer_name(c), W, dtn, H, F, El, k, routing, T, cap=cap, layout=lay)
    x, ids, w = _inputs(P, me)
    w1 = P.W1[me * El:(me + 1) * El]  # [El, H, F]
    w2 = P.W2[me * El:(me + 1) * El]  # [El, F, H]
    if lay == "nk":
        w1, w2 = (np.ascontiguousarray(a.transpose(0, 2, 1)) for a in (w1, w2))
    w1, w2 = _dev(w1), _dev(w2)
    y_buf = _poisoned((P.cap, F), dtn)
    y, h = mkernel.moe_dispatch_gemm(x, ids, w, w1, comm=comm, num_experts=P.E, capacity=P.capacity, out=y_buf,
                                 w_layout=lay if lay == "nk" else None)
    act = _relu(y)
    out_buf = _poisoned((P.Ts[me], H), dtn)
    out = mkernel.moe_gemm_combine(act, w2, h, comm=comm, out=out_buf, w_layout=lay if lay == "nk" else None)
    _sync(_layer_name(c))
    comm.check()
    if y is not y_buf or out is not out_buf:
        return False, "moe_dispatch_gemm / moe_gemm_combine did not return the given out"
    y_ref, out_ref = _layer_reference(P, me)
    src, _, counts = P.layout[me]
    n = src.size
    ok, msgs = True, []
    got_n, got_counts = h.received(), np.asarray(h.counts())
    if got_n != n or not np.array_equal(got_counts, counts.sum(axis=1)):
        ok = False
        msgs.append(f"RECEIVED {got_n} rows / group_rows {got_counts[:8].tolist()}, expected {n} / "
                    f"{counts.sum(axis=1)[:8].tolist()}")
    yb = _bits(y)
    y_got = _host(y)[:n].astype(np.float64)
    tail = np.flatnonzero(~(yb[n:] == _nan_bits(dtn)).all(axis=1))
    if tail.size:
        ok = False
        msgs.append(f"{tail.size} y ROWS PAST received WRITTEN")
    if not np.isfinite(y_got).all():
        ok = False
        msgs.append(f"y NONFINITE in {int((~np.isfinite(y_got).all(axis=1)).sum())} of the received rows")
    else:
        ry = _rel(y_got, y_ref)
        per = counts.sum(axis=1)
        starts = np.concatenate([[0], np.cumsum(per)])
        worst = max(((_rel(y_got[starts[e]:starts[e + 1]], y_ref[starts[e]:starts[e + 1]]), e)
                     for e in range(El) if per[e]), default=(0.0, None))
        msgs.append(f"y rel={ry:.2e} worst expert {worst[1]}:{worst[0]:.2e}")
        ok &= ry < REL_TOL and worst[0] < REL_TOL
    o = _host(out).astype(np.float64)
    if not np.isfinite(o).all():
        ok = False
        msgs.append(f"out NONFINITE in tokens {np.flatnonzero(~np.isfinite(o).all(axis=1))[:8].tolist()}")
    else:
        ro = _rel(o, out_ref)
        num = np.linalg.norm(o - out_ref, axis=1)
        den = np.linalg.norm(out_ref, axis=1)
        tok = np.where(den > 0, num / np.where(den > 0, den, 1), np.where(num > 0, np.inf, 0.0))
        bad = np.flatnonzero(~(tok < TOKEN_TOL))
        wt = int(np.argmax(tok)) if tok.size else None
        msgs.append(f"out rel={ro:.2e} worst token {wt}:{(tok[wt] if tok.size else 0):.2e}")
        if bad.size:
            msgs.append(f"{bad.size} BAD TOKENS, first {int(bad[0])} (experts {P.ids[me][bad[0]].tolist()})")
        ok &= ro < REL_TOL and not bad.size
    return bool(ok), "; ".join(msgs)


@collective_cases.gpu_mpi
def test_layer_reference(comm):
    cases = {_layer_name(c): c for c in LAYER_CASES if c[4] * comm.size <= 512}
    names = list(cases)
    results = _run_cases(comm, names, lambda n: _layer_body(comm, cases[n]))
    _report_and_decide(comm, "moe_dispatch_gemm -> relu -> moe_gemm_combine vs float64", names, results)


# ================================================================== repeated and back-to-back launches
def _repeat_body(comm, n=20):
    """n dispatch + combine pairs on the same buffers (poisoned before each, copied after each),
    alternating two inputs of one shape (one plan: the same symmetric buffers), nothing synchronised
    in between: each equal to its solo run bitwise; the epoch moves by 2 n."""
    import cupy

    moe = mmoe
    W, me = comm.size, comm.rank
    probs = [_problem(f"repeat {i}", W, "bf16", 256, 4, 2, "zipf", 500) for i in range(2)]
    inps = [_inputs(P, me) for P in probs]
    solos, ok, msgs = [], True, []
    for P, inp in zip(probs, inps):
        rb, ob, o, m = _solo(moe, comm, P, inp)
        solos.append((rb, ob))
        ok &= o
        msgs.append(f"solo {P.name}: {m}")
    P0 = probs[0]
    rbuf = cupy.empty((P0.cap, P0.H), dtype=P0.dt)
    obuf = cupy.empty((P0.Ts[me], P0.H), dtype=P0.dt)
    e0 = comm.sync.epoch()
    snaps = []
    for i in range(n):
        P, inp = probs[i % 2], inps[i % 2]
        _poison(rbuf)
        _poison(obuf)
        recv, h = moe.moe_dispatch(*inp, comm=comm, num_experts=P.E, capacity=P.capacity, out=rbuf)
        moe.moe_combine(recv, h, comm=comm, out=obuf)
        snaps.append((rbuf.view(cupy.uint16).copy(), obuf.view(cupy.uint16).copy()))
    _sync(f"{n} repeated launches")
    comm.check()
    e1 = comm.sync.epoch()
    differ = [i for i, (r, o) in enumerate(snaps)
              if not ((cupy.asnumpy(r) == solos[i % 2][0]).all() and (cupy.asnumpy(o) == solos[i % 2][1]).all())]
    moved = (e1 - e0) % (1 << 32)
    msgs.append(f"launches differing from their solo run: {differ}; epoch moved by {moved} (want {2 * n})")
    return ok and not differ and moved == 2 * n, "; ".join(msgs)


@collective_cases.gpu_mpi
def test_repeated_launches(comm):
    _collective(comm, "20 dispatch + combine on the same buffers, two inputs alternating (bf16 H256 El4 k2 T500)",
                lambda: _repeat_body(comm))


def _b2b_body(comm, reps=5):
    """Two shapes X (bf16 H 128 k 2 El 4 uniform T 300) and Y (fp16 H 512 k 8 El 16 zipf T 200),
    dispatch + combine alternately, reps times each, into buffers of their own, all queued before
    one synchronisation: each equal bitwise to what the same call gave alone."""
    moe = mmoe
    W, me = comm.size, comm.rank
    shapes = {"X": ("bf16", 128, 4, 2, "uniform", 300), "Y": ("fp16", 512, 16, 8, "zipf", 200)}
    probs = {s: _problem(f"b2b {s}", W, *v) for s, v in shapes.items()}
    inps = {s: _inputs(P, me) for s, P in probs.items()}
    solos, ok, msgs = {}, True, []
    for s, P in probs.items():
        rb, ob, o, m = _solo(moe, comm, P, inps[s])
        solos[s] = (rb, ob)
        ok &= o
        msgs.append(f"solo {s}: {m}")
    order = ["X", "Y"] * reps
    bufs = [(_poisoned((probs[s].cap, probs[s].H), probs[s].dtn), _poisoned((probs[s].Ts[me], probs[s].H),
                                                                             probs[s].dtn)) for s in order]
    e0 = comm.sync.epoch()
    for s, (rb, ob) in zip(order, bufs):
        P = probs[s]
        recv, h = moe.moe_dispatch(*inps[s], comm=comm, num_experts=P.E, capacity=P.capacity, out=rb)
        moe.moe_combine(recv, h, comm=comm, out=ob)
    _sync("back to back", 60.0)
    comm.check()
    e1 = comm.sync.epoch()
    differ = [(i, s) for i, (s, (rb, ob)) in enumerate(zip(order, bufs))
              if not ((_bits(rb) == solos[s][0]).all() and (_bits(ob) == solos[s][1]).all())]
    moved = (e1 - e0) % (1 << 32)
    msgs.append(f"back to back {''.join(order)}: differ from solo at {differ}; epoch moved by {moved} "
                f"(want {2 * len(order)})")
    return ok and not differ and moved == 2 * len(order), "; ".join(msgs)


@collective_cases.gpu_mpi
def test_back_to_back_shapes(comm):
    _collective(comm, "two shapes back to back, 5 times each, one synchronisation", lambda: _b2b_body(comm))


# =================================================================================== stale handle
def _stale_body(comm):
    """A second dispatch of the same shape makes the first handle stale: moe_combine,
    moe_gemm_combine, received() and counts() raise ArgumentError without launching; the second
    handle combines right."""
    import cupy

    moe = mmoe
    W, me = comm.size, comm.rank
    A, B = (_problem(f"stale {i}", W, "bf16", 64, 4, 2, "uniform", 100) for i in range(2))
    recv1, h1 = moe.moe_dispatch(*_inputs(A, me), comm=comm, num_experts=A.E)
    recv2, h2 = moe.moe_dispatch(*_inputs(B, me), comm=comm, num_experts=B.E)
    _sync("two dispatches")
    comm.check()
    e0 = comm.sync.epoch()
    y2 = cupy.zeros((h1.capacity, 64), dtype=BF16)
    w2 = cupy.zeros((A.El, 64, 64), dtype=BF16)
    calls = {"moe_combine": lambda: moe.moe_combine(recv1, h1, comm=comm),
             "moe_gemm_combine": lambda: mkernel.moe_gemm_combine(y2, w2, h1, comm=comm),
             "received()": h1.received, "counts()": h1.counts}
    missed = sum(argument_errors(calls), [])
    _sync("stale calls")
    e1 = comm.sync.epoch()
    valid = (h1.valid(), h2.valid())
    out = moe.moe_combine(recv2, h2, comm=comm, out=_poisoned((B.Ts[me], B.H), "bf16"))
    _sync("fresh handle")
    comm.check()
    ok_out, m_out = _check_exact_out(B, me, out, _roundtrip_want(B, me))
    ok = not missed and e1 == e0 and valid == (False, True) and ok_out
    return ok, (f"no ArgumentError from: {missed}; valid() {valid} (want (False, True)); "
                f"{'LAUNCHED' if e1 != e0 else 'nothing launched'}; fresh handle: {m_out}")


@collective_cases.gpu_mpi
def test_stale_handle(comm):
    _collective(comm, "stale handle", lambda: _stale_body(comm))


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
