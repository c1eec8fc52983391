"""The compile check (every kernel, exactly the run-time options, no GPU) and the kernel cache."""

import json
import multiprocessing
import re

import pytest

import mkernel
from mkernel.runtime import compile as kc

WGMMA_SERIALISED = re.compile(r"C75\d\d")  # C7510-C7515 (warnings), C7520 (an info line)
FRONT_END_WARNING = re.compile(r"warning #\d+-D.*")  # NVRTC's own (missing return, unreachable code)
SPECS = sorted(kc.REGISTRY)


def test_some_kernels_are_registered():
    assert SPECS, "importing mkernel registered no kernel"


@pytest.mark.parametrize("name", SPECS)
def test_kernel_compiles_clean(name, kernel_cache):
    spec = kc.REGISTRY[name]
    c = kc.compile_spec(spec)
    assert c.cubin[:4] == b"\x7fELF"
    assert set(c.lowered) == set(spec.name_expressions)
    res = c.resources
    bad = [w for w in res["warnings"] if WGMMA_SERIALISED.search(w)]
    assert not bad, f"{name}: wgmma serialised: {bad}"
    front = FRONT_END_WARNING.findall(c.log)
    assert not front, f"{name}: NVRTC warnings: {front}"
    assert res["functions"], f"{name}: no ptxas report parsed"
    for fn, r in res["functions"].items():
        assert r.get("spill_stores", 0) == 0 and r.get("spill_loads", 0) == 0, f"{name}: {fn} spills: {r}"
        if spec.hot:
            assert r.get("stack", 0) == 0, f"{name}: hot kernel {fn} uses local memory: {r}"


def _toy(tmp_path, header_text):
    d = tmp_path / "cuda"
    d.mkdir(exist_ok=True)
    (d / "toy_inner.cuh").write_text(header_text)
    (d / "toy_outer.cuh").write_text('#pragma once\n#include "toy_inner.cuh"\n')
    (d / "toy.cu").write_text('#include "toy_outer.cuh"\n'
                              "template <int N> __global__ void fill(int* out) { out[threadIdx.x] = N + TOY_VALUE; }\n")
    return d, kc.KernelSpec("toy", "toy.cu", ("fill<3>",))


def test_header_change_recompiles_and_reverting_hits(tmp_path, kernel_cache, monkeypatch):
    calls = []
    real = kc.nvrtc.compile_cubin
    monkeypatch.setattr(kc.nvrtc, "compile_cubin", lambda *a, **k: calls.append(1) or real(*a, **k))
    d, spec = _toy(tmp_path, "#pragma once\n#define TOY_VALUE 1\n")
    first = kc.compile_spec(spec, d)
    assert kc.compile_spec(spec, d).key == first.key and len(calls) == 1  # a hit compiles nothing
    (d / "toy_inner.cuh").write_text("#pragma once\n#define TOY_VALUE 2\n")  # two includes deep
    second = kc.compile_spec(spec, d)
    assert second.key != first.key and len(calls) == 2 and second.cubin != first.cubin
    (d / "toy_inner.cuh").write_text("#pragma once\n#define TOY_VALUE 1\n")
    assert kc.compile_spec(spec, d).cubin == first.cubin and len(calls) == 2


def test_version_and_options_are_in_the_key(tmp_path, kernel_cache, monkeypatch):
    d, spec = _toy(tmp_path, "#pragma once\n#define TOY_VALUE 1\n")
    files = kc.include_closure(spec.source, d)
    k1 = kc.cache_key(spec, files)
    assert kc.cache_key(kc.KernelSpec("toy", "toy.cu", ("fill<3>",), (("X", "1"),)), files) != k1
    monkeypatch.setattr(kc, "__version__", "0.0.0-other")
    assert kc.cache_key(spec, files) != k1


def test_compile_error_is_typed(tmp_path, kernel_cache):
    d, spec = _toy(tmp_path, "#pragma once\n#define TOY_VALUE undefined_name\n")
    with pytest.raises(mkernel.CompileError, match="undefined_name"):
        kc.compile_spec(spec, d)


def _compile_in_child(cuda_dir, cache, queue):
    import os
    os.environ["MKERNEL_CACHE_DIR"] = cache
    from mkernel.runtime import compile as kc2
    spec = kc2.KernelSpec("toy", "toy.cu", ("fill<3>",))
    queue.put(kc2.compile_spec(spec, __import__("pathlib").Path(cuda_dir)).key)


def test_two_processes_compiling_at_once_leave_a_valid_cache(tmp_path, kernel_cache):
    d, spec = _toy(tmp_path, "#pragma once\n#define TOY_VALUE 7\n")
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_compile_in_child, args=(str(d), str(kernel_cache), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    keys = {q.get(timeout=5), q.get(timeout=5)}
    assert len(keys) == 1
    entries = list((kernel_cache / "kernels").glob("toy-*.json"))
    assert len(entries) == 1 and not list((kernel_cache / "kernels").glob("*.tmp"))
    assert kc._read_cached(entries[0].with_suffix("")) is not None
    assert json.loads(entries[0].read_text())["key"] == keys.pop()


def test_ptxas_report_parsing():
    log = ("ptxas info    : Compiling entry function '_Z4fillILi3EEvPi' for 'sm_90a'\n"
           "ptxas info    : Function properties for _Z4fillILi3EEvPi\n"
           "ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 0 barriers\n"
           "ptxas warning : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized\n")
    r = kc.parse_ptxas(log)
    assert r["functions"]["_Z4fillILi3EEvPi"] == {"stack": 8, "spill_stores": 4, "spill_loads": 4, "registers": 40}
    assert len(r["warnings"]) == 1 and "C7515" in r["warnings"][0]
    info = ("ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
            "to program dependence on compiler-inserted WG.AR in divergent path in the function 'k'\n")
    assert WGMMA_SERIALISED.search(kc.parse_ptxas(info)["warnings"][0])  # an info line, still caught
