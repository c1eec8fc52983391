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

Collective discipline (as tests/gpu/test_ring_attention_gpu.py): every rank runs the same cases in the same
order, each guarded (an exception is caught and recorded); after every case the ranks exchange their
outcomes on a duplicate of the communicator's MPI communicator; if one rank raised where another did
not, or a peer error or timeout was raised, all ranks stop running cases. Per-case tables are
printed, then pass / fail is decided with tests.helpers.ranks.all_ranks. A device hang ends the process after
45 s (sync_or_exit). Each test frees its MoE buffers at its end (comm.release_plans).

The CPU tests are this file; the GPU tests are tests/gpu/test_moe_gpu.py (dispatch, combine, the
layer, repeated and back-to-back launches, stale handles) and tests/gpu/test_moe_errors_gpu.py
(argument errors, disagreeing arguments, device-detected errors); the problems, references and
checks they share are tests/helpers/moe_cases.py.

    python3 -m pytest tests/cpu/test_moe.py tests/gpu/test_moe_gpu.py tests/gpu/test_moe_errors_gpu.py -q -s
    mpirun -n 2 --oversubscribe python3 -m pytest tests/gpu/test_moe_gpu.py tests/gpu/test_moe_errors_gpu.py -q -s \
        -m "gpu and mpi"
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
from mkernel.runtime import launch

from tests.helpers.moe_cases import (
    DISPATCH_CASES,
    DISPATCH_SLOW,
    _case_name,
    _combine_reference,
    _combine_values,
    _layer_problem,
    _layer_reference,
    _layout,
    _pair_rows,
    _problem,
    _roundtrip_want,
    mmoe,
)


def test_args_layout_matches_host_compiler(tmp_path):
    """MkMoeArgs (moe.py) against the C struct of moe_args.cuh, as g++ lays it out (320 bytes)."""
    import ctypes

    from tests.helpers.c_layout import assert_same_layout

    m = mmoe
    assert_same_layout("moe_args.cuh", m.MkMoeArgs, tmp_path)
    assert ctypes.sizeof(m.MkMoeArgs) == 472


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
    assert ctypes.sizeof(mirror) == 1088


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
    assert c["MOE_ROW_WORDS"] == m.row_words(10) == 22
    enum = re.findall(r"MOE_CNT_([A-Z_]+) = (\d+)", cuda_files()["moe_args.cuh"].read_text())
    assert [(n.lower(), int(v)) for n, v in enum if n != "WORDS"] == [(n, i) for i, n in enumerate(m.CNT_NAMES)]
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
                                            "MOE_GROW_WORDS(10)", "MOE_FWD_SUM_TOKENS", "MOE_MAX_PIECES",
                                            "MOE_VSEG_WORDS", "MOE_FWD_CELLS"], tmp_path)
    assert c["MOE_MAX_NODES"] == n.MAX_NODES and c["MOE_PF_WORDS"] == n.PF_WORDS
    assert c["MOE_FWD_SUM_TOKENS"] == n.FWD_SUM_TOKENS and c["MOE_MAX_PIECES"] == n.MAX_PIECES
    assert c["MOE_VSEG_WORDS"] == n.VSEG_WORDS and c["MOE_FWD_CELLS"] == n.FWD_CELLS
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
    attention and the TP ops share the check), a bundle's sums within one 32-bit WRITE."""
    from mkernel.ops import calls as op_calls

    n = importlib.import_module("mkernel.ops.moe_nodes")
    mmoe._check_comm("moe_dispatch", _fake_comm((0, 0, 1, 1), 2))  # node-major: accepted
    for node_of, L in (((0, 1, 0, 1), 2), ((0, 0, 0, 1), 3), ((1, 1, 0, 0), 2)):
        with pytest.raises(ArgumentError, match="node-major"):
            mmoe._check_comm("moe_dispatch", _fake_comm(node_of, L))
        with pytest.raises(ArgumentError, match="node-major"):
            op_calls.check_node_major("ring_attention", _fake_comm(node_of, L))
    mg = importlib.import_module("mkernel.ops.moe_gemm")
    monkeypatch.setattr(launch, "sm_count", lambda full_share=False: 132)  # comm_sms is checked against it
    with pytest.raises(ArgumentError, match="handle must be the MoeHandle"):  # the fused path runs between nodes
        mg.moe_gemm_combine(None, None, None, comm=_fake_comm((0, 1), 1), path="fused")
    n.check_sizes("moe_dispatch", 8192, 1, 1 << 17)  # 16-bit sums of 131072 tokens x 8192: 2 GiB
    with pytest.raises(ArgumentError, match="WRITE"):
        n.check_sizes("moe_dispatch", 16384, 1, 1 << 17)  # 4 GiB
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


def test_combine_sum_has_every_row_load_in_flight():
    """The combine's weighted sum issues a 16-byte load of each of a token's rows here (up to
    MOE_MAX_TOPK) before the FMAs that use them: one at a time (LDG.128, then its 8 FFMA, repeated) it
    was latency-bound, four at a time it reached ~0.8 TB/s between nodes (half of them skipped pairs)."""
    from mkernel.runtime import compile as mkc

    from tests.helpers import sass

    n = mmoe.MAX_TOPK
    for name, text in sass.kernels(mkc.compile_spec(mmoe.SPEC).cubin).items():
        if "combine" not in name:
            continue
        loads, before_sums, prev = 0, [], None  # 16-byte loads since the last store or FMA, at each run of FMAs
        for op in re.findall(r"\b(LDG\.E\.128|STG\.E\.128|FFMA)\b", text):
            if op == "FFMA" and prev != "FFMA":
                before_sums.append(loads)
            loads = loads + 1 if op == "LDG.E.128" else 0
            prev = op
        assert before_sums and max(before_sums) >= n, (name, before_sums)


def test_the_sanitizer_summarises_which_gemm_tiles_finished_at_a_stall():
    import numpy as np

    from mkernel.diagnostics.sanitize import compute_span_summary

    def row(block, role, tile):  # (start, end, sm << 32 | block, role << 32 | id), as trace.cuh writes
        return (1, 2, (7 << 32) | block, (role << 32) | tile)
    spans = np.array([row(0, 0, 0), row(0, 0, 2), row(5, 0, 3), row(5, 4, 1), row(9, 2, 4)], dtype=np.uint64)
    assert compute_span_summary(spans, 6) == (5, [1, 4, 5], 2)  # tile 1 only waited, 4 only sent
    assert compute_span_summary(spans[:0], 2) == (0, [0, 1], 0)


@pytest.mark.parametrize("grid,dispatch,combine,combine2", [(132, 16, 8, 2), (66, 16, 8, 2), (33, 8, 4, 2),
                                                          (12, 3, 1, 1), (3, 1, 1, 1)])
def test_moe_default_comm_sms_follow_the_knobs_up_to_a_share_of_the_grid(monkeypatch, grid, dispatch, combine,
                                                                         combine2):
    """comm_sms=None: the op's knob, at most 1/4 (dispatch) or 1/8 (combine) of the grid, never 0."""
    mg = importlib.import_module("mkernel.ops.moe_gemm")
    monkeypatch.setattr(launch, "sm_count", lambda full_share=False: 132)
    monkeypatch.setattr(launch, "grid_sms", lambda comm, op: grid)
    comm = _fake_comm((0, 1), 1)
    assert mg._check_path("moe_dispatch_gemm", None, None, comm) == ("fused", dispatch)
    assert mg._check_path("moe_gemm_combine", "fused", None, comm) == ("fused", combine)
    assert mg._check_path("moe_gemm_combine", "fused", 16, comm) == ("fused", 16)  # an explicit count stays
    with mkernel.config.override(moe_combine_comm_sms=2):
        assert mg._check_path("moe_gemm_combine", "fused", None, comm)[1] == combine2
