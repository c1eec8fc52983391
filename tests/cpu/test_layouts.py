"""Every kernel argument struct's ctypes mirror has the C layout (read with the host compiler)."""

import pytest

from mkernel.diagnostics import selftest
from mkernel.runtime import sync

from tests.helpers.c_layout import assert_same_layout


@pytest.mark.parametrize("header,cls", [
    ("sync_args.cuh", sync.MkStatus),
    ("sync_args.cuh", sync.MkSync),
    ("runtime_test_args.cuh", selftest.RuntimeTestArgs),
])
def test_mirror_matches_c_layout(header, cls, tmp_path):
    assert_same_layout(header, cls, tmp_path)
