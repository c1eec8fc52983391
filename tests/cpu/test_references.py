"""Every ``module.name`` a file of the package, its tools, benchmarks, examples and tests reads
resolves, where ``module`` is one of mkernel's own modules imported in that file
(``from mkernel.x import y as z``, ``import mkernel.x as z``).

GPU-only paths are never run on a CPU machine; a name left dangling by a refactor (a function
renamed or moved) would otherwise surface only on a GPU, as an AttributeError inside an op."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(p for d in ("mkernel", "tools", "bench", "examples", "tests") for p in (ROOT / d).rglob("*.py")
               if "build" not in p.parts)


def _module_aliases(tree, here):
    """{alias: module name} of the file's imports of mkernel modules (not of names in them)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("mkernel") and a.asname:
                    out[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mkernel"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                try:
                    importlib.import_module(full)
                except ImportError:
                    continue  # a name inside a module, not a module
                out[a.asname or a.name] = full
    return out


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_attributes_resolve(path):
    tree = ast.parse(path.read_text())
    aliases = _module_aliases(tree, path)
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            mod = importlib.import_module(aliases[node.value.id])
            if not hasattr(mod, node.attr) and isinstance(node.ctx, ast.Load):
                missing.append(f"line {node.lineno}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    assert not missing, "dangling references:\n" + "\n".join(missing)


def test_docstrings_name_modules_that_exist():
    """Every :mod:`mkernel...` a docstring names imports (when the package moved into its layers,
    public docstrings kept pointing at the old flat modules)."""
    import re

    missing = []
    for path in (p for p in FILES if p.parts[len(ROOT.parts)] == "mkernel"):
        for m in re.finditer(r":mod:`(mkernel[\w.]*)`", path.read_text()):
            try:
                importlib.import_module(m.group(1))
            except ModuleNotFoundError:
                missing.append(f"{path.relative_to(ROOT)}: {m.group(1)}")
    assert not missing, "docstrings name modules that do not exist:\n" + "\n".join(missing)
