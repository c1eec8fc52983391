"""Compare a ctypes mirror with the C layout of an ``*_args.cuh`` struct, using the host C++ compiler."""

import ctypes
import shutil
import subprocess
from pathlib import Path

from mkernel.runtime.compile import include_dirs


def c_offsets(header: str, struct: str, fields, tmp_path: Path) -> dict:
    """{'sizeof': n, 'alignof': a, field: offset} as g++ lays out `struct` from `header`."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        import pytest
        pytest.skip("no host C++ compiler to read the C layout")
    lines = [f'#include "{header}"', "#include <cstdio>", "#include <cstddef>", "int main() {",
             f'  std::printf("sizeof %zu\\n", sizeof({struct}));',
             f'  std::printf("alignof %zu\\n", alignof({struct}));']
    lines += [f'  std::printf("{f} %zu\\n", offsetof({struct}, {f}));' for f in fields]
    lines.append("}")
    src = tmp_path / f"layout_{struct}.cpp"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / f"layout_{struct}"
    subprocess.run([cxx, "-std=c++17", *(f"-I{d}" for d in include_dirs()), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def py_offsets(cls) -> dict:
    d = {"sizeof": ctypes.sizeof(cls), "alignof": ctypes.alignment(cls)}
    d.update({name: getattr(cls, name).offset for name, *_ in cls._fields_})
    return d


def assert_same_layout(header: str, cls, tmp_path: Path, struct: str = None, c_align: int = None):
    """c_align: the C struct's alignment where ctypes cannot express it (alignas(64) of tensor maps)."""
    fields = [name for name, *_ in cls._fields_]
    c, py = c_offsets(header, struct or cls.__name__, fields, tmp_path), py_offsets(cls)
    if c_align is not None:
        assert c.pop("alignof") == c_align
        py.pop("alignof")
    assert c == py, f"{cls.__name__} mirror differs from {header}"
