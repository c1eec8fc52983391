"""CPU: the exceptions a communicator raises from a kernel's recorded status (runtime/sync.py)."""

from mkernel.core.errors import TimeoutError as MkTimeout
from mkernel.runtime import sync


def test_timeouts_name_op_rank_peer_and_between_nodes_the_module_load_rule():
    st = sync.MkStatus(code=sync.ERR_TIMEOUT, op=sync.OP_ID["gemm_allreduce"], rank=1, peer=0, where=0x50000,
                       expected=1, seen=0, waited_ns=10 ** 10)
    inside, between = sync.error_from_status(st), sync.error_from_status(st, between_nodes=True)
    assert type(inside) is MkTimeout and type(between) is MkTimeout
    for e in (inside, between):
        assert "gemm_allreduce on rank 1" in str(e) and "peer 0" in str(e) and "expected 1, last saw 0" in str(e)
    assert "Module loads" not in str(inside) and "Module loads" in str(between)
