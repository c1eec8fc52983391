"""Reading the SASS of a compiled cubin in CPU tests: cuobjdump (the nvidia-cuda-cuobjdump and
-nvdisasm wheels, CUOBJDUMP, or a CUDA install), one text per kernel, and the registers a
setmaxnreg region really uses."""

import os
import re
import shutil
import subprocess
import tempfile

import pytest


def cuobjdump():
    for cand in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"):
        if cand and os.path.exists(cand):
            return cand
    try:  # the nvidia-cuda-cuobjdump wheel
        import nvidia
        for root in nvidia.__path__:
            for sub in ("cu13/bin/cuobjdump", "cuda_cuobjdump/bin/cuobjdump"):
                if os.path.exists(os.path.join(root, sub)):
                    return os.path.join(root, sub)
    except ImportError:
        pass
    return None


def kernels(cubin: bytes) -> dict:
    """{kernel name: its SASS}; skips the test where no cuobjdump exists."""
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, or set CUOBJDUMP)")
    env = dict(os.environ, PATH=os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", ""))  # nvdisasm beside it
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], env=env, check=True, capture_output=True, text=True).stdout
    parts = re.split(r"\n\s*Function : ", text)[1:]
    return {k.split("\n", 1)[0].strip(): k for k in parts}


_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def reachable_max_register(func_sass: str, start_marker: str) -> int:
    """Highest Rn used by the instructions reachable from the first `start_marker` instruction
    (following branches and fall-through): the code a warpgroup runs after its setmaxnreg. ptxas
    reports one register count per kernel, so the per-region budget is checked here."""
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
        if (m or t.startswith("EXIT")) and not t.startswith("@"):
            continue
        if a in nxt:
            todo.append(nxt[a])
    return max((int(r) for a in seen for r in re.findall(r"\bR(\d+)\b", ins[a])), default=0)


def check_warp_specialized(cubin: bytes, expected_kernels: int, producer_regs: int = 40, consumer_regs: int = 232,
                           tile_n: int = 256):
    """Every kernel: HGMMA 64 x tile_n present, no local memory, setmaxnreg regions within their budgets."""
    ks = kernels(cubin)
    assert len(ks) == expected_kernels, sorted(ks)
    for name, k in ks.items():
        assert f"HGMMA.64x{tile_n}x16.F32" in k, name
        assert not re.search(r"\b(LDL|STL)\b", k), f"local memory in {name}"
        assert "USETMAXREG" in k, name
        prod = reachable_max_register(k, "USETMAXREG.DEALLOC")
        cons = reachable_max_register(k, "USETMAXREG.TRY_ALLOC")
        print(f"{name}: producer max R{prod}, consumer max R{cons}")
        assert prod < producer_regs, (name, prod)
        assert cons < consumer_regs, (name, cons)
    return ks
