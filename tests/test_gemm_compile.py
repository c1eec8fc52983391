"""CPU: every GEMM instantiation compiles with NVRTC for sm_90a, without spills, stack or the
ptxas warnings that mean wgmma was serialised (C7510-C7515) or registers were misallocated
(C7508); the cubin's SASS has HGMMA in every kernel and no local memory (when cuobjdump exists)."""

import os
import re
import shutil
import subprocess
import tempfile

import pytest

from mkernel import compile as mkc
import importlib

gemm = importlib.import_module("mkernel.gemm")  # the module (mkernel.gemm is also the function)


@pytest.fixture(scope="module")
def compiled():
    return mkc.compile_spec(gemm.SPEC, use_cache=False)


def test_every_instantiation_compiles(compiled):
    assert set(compiled.lowered) == set(gemm.EXPRESSIONS)
    funcs = compiled.resources["functions"]
    assert len(funcs) == len(gemm.EXPRESSIONS), funcs
    for name, res in sorted(funcs.items()):
        print(f"{name}: {res}")
        assert res.get("stack", 0) == 0, (name, res)
        assert res.get("spill_stores", 0) == 0 and res.get("spill_loads", 0) == 0, (name, res)
        # 384 threads x 168 registers at launch; setmaxnreg moves them to the consumers.
        assert res.get("registers", 0) <= 168, (name, res)


def test_no_wgmma_or_register_warnings(compiled):
    bad = [w for w in compiled.resources["warnings"] if re.search(r"C75(0[0-9]|1[0-9])", w)]
    assert not bad, bad
    assert not compiled.resources["warnings"], compiled.resources["warnings"]


def _cuobjdump():
    for cand in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"):
        if cand and os.path.exists(cand):
            return cand
    try:  # the nvidia-cuda-cuobjdump wheel
        import nvidia  # noqa: F401
        for root in nvidia.__path__:
            for sub in ("cu13/bin/cuobjdump", "cuda_cuobjdump/bin/cuobjdump"):
                p = os.path.join(root, sub)
                if os.path.exists(p):
                    return p
    except ImportError:
        pass
    return None


def _tool_env(tool):
    """cuobjdump runs nvdisasm, which the wheels install beside it."""
    return dict(os.environ, PATH=os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", ""))


def test_sass_has_hgmma_and_no_local_memory(compiled):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump, or set CUOBJDUMP)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.cubin)
        f.flush()
        sass = subprocess.run(env=_tool_env(tool), args=[tool, "-sass", f.name], check=True, capture_output=True, text=True).stdout
    kernels = re.split(r"\n\s*Function : ", sass)[1:]
    assert len(kernels) == len(gemm.EXPRESSIONS)
    for k in kernels:
        name = k.split("\n", 1)[0].strip()
        assert "HGMMA.64x256x16.F32" in k, name
        assert not re.search(r"\b(LDL|STL)\b", k), f"local memory in {name}"
        assert "USETMAXREG" in k, name
        tnsp = re.search(r"mk_gemm_kernelILi\dELi(\d)E", name).group(1) == "1"
        assert (".tnspB" in k) == tnsp, name


_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def _reachable_max_register(func_sass: str, start_marker: str) -> int:
    """Highest Rn used by the instructions reachable from the first `start_marker` instruction
    (following branches and fall-through): the code a warpgroup runs after its setmaxnreg."""
    ins, order = {}, []
    for m in _INS.finditer(func_sass):
        a = int(m.group(1), 16)
        ins[a] = m.group(2).strip()
        order.append(a)
    nxt = dict(zip(order, order[1:]))
    start = next(a for a in order if start_marker in ins[a])
    seen, todo = set(), [start]
    while todo:
        a = todo.pop()
        if a in seen or a not in ins:
            continue
        seen.add(a)
        t = ins[a]
        m = re.search(r"\bBRA(?:\.[A-Z.]+)?\s+0x([0-9a-f]+)", t)
        if m:
            todo.append(int(m.group(1), 16))
        predicated = t.startswith("@")
        if (m or t.startswith("EXIT")) and not predicated:
            continue
        if a in nxt:
            todo.append(nxt[a])
    return max((int(r) for a in seen for r in re.findall(r"\bR(\d+)\b", ins[a])), default=0)


def test_setmaxnreg_regions_fit(compiled):
    """ptxas allocates per setmaxnreg region: the producer's code must stay below its 40 registers
    and the consumers' below 232 (checked on the SASS, since the ptxas report gives one number)."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump, or set CUOBJDUMP)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.cubin)
        f.flush()
        sass = subprocess.run(env=_tool_env(tool), args=[tool, "-sass", f.name], check=True, capture_output=True, text=True).stdout
    for k in re.split(r"\n\s*Function : ", sass)[1:]:
        name = k.split("\n", 1)[0].strip()
        prod = _reachable_max_register(k, "USETMAXREG.DEALLOC")
        cons = _reachable_max_register(k, "USETMAXREG.TRY_ALLOC")
        print(f"{name}: producer max R{prod}, consumer max R{cons}")
        assert prod < 40, (name, prod)
        assert cons < 232, (name, cons)


def test_smem_constants_fit():
    assert gemm.SMEM_GROUPED <= 227 * 1024
    assert gemm.SMEM_PLAIN <= gemm.SMEM_GROUPED
