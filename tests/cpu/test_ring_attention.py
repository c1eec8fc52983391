"""CPU tests of mkernel.ring_attention: the argument structs' layout, the module and its export. The GPU
tests are tests/gpu/test_ring_attention_gpu.py, test_ring_attention_errors_gpu.py and
test_ring_attention_worlds_gpu.py."""

import importlib

from tests.helpers.ring_cases import mra


def test_args_layout_matches_host_compiler(tmp_path):
    """MkRingArgs and MkAttnPos mirrors against ring_args.cuh / attn_args.cuh (g++); alignof of the
    64-byte aligned struct is checked apart (ctypes cannot express alignas(64))."""
    from tests.helpers.c_layout import c_offsets, py_offsets

    ma = importlib.import_module("mkernel.engines.attention")
    for header, cls, align in (("ring_args.cuh", mra.MkRingArgs, 64), ("attn_args.cuh", ma.MkAttnPos, 4)):
        c = c_offsets(header, cls.__name__, [name for name, *_ in cls._fields_], tmp_path)
        py = py_offsets(cls)
        assert c.pop("alignof") == align
        py.pop("alignof")
        assert c == py, f"{cls.__name__} mirror differs from {header}"


def test_module_and_export():
    import mkernel as mk

    assert callable(mra.ring_attention)
    assert mk.ring_attention is mra.ring_attention, \
        "mkernel.ring_attention is not the function (not exported in mkernel/__init__.py?)"
    assert "ring_attention" in mk.__all__
