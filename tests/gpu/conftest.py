"""The GPU tests' communicator: one per module (workspace: the module's WORKSPACE when it has one),
with the collective driver's own MPI communicator (tests/helpers/collective_cases.py)."""

import pytest


@pytest.fixture(scope="module")
def comm(request):
    import mkernel

    from tests.helpers import collective_cases

    c = collective_cases.with_driver(mkernel.init(workspace_bytes=getattr(request.module, "WORKSPACE", None)))
    yield c
    collective_cases.close(c)
