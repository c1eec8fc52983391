"""The verbs transport's tests run where an RDMA port is active: soft-RoCE in a VM on the CPU
machines (tools/verbs_vm.sh), a NIC elsewhere; they skip, saying so, on every other machine."""

import pytest

from mkernel.comm.proxy import probe_rdma

NEEDS_RDMA = pytest.mark.skipif(probe_rdma()[0] <= 0,
                                reason="no active RDMA port: tools/verbs_vm.sh runs these over soft-RoCE")
VERBS = pytest.param("verbs", marks=NEEDS_RDMA)  # a transport parameter
