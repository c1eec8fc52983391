"""tools/decode_sequences.py's constants for one measurement: set, then restored (also after an error),
with every kept plan dropped on both sides (a plan's key holds neither constant)."""

import pytest

from mkernel.engines import gemm as mg
from mkernel.engines import gemm_decode as dec
from mkernel.ops import allreduce as ar

from tests.helpers.tools import load_tool

decode_sequences = load_tool("decode_sequences")


class _Comm:
    def __init__(self):
        self.released = 0

    def release_plans(self):
        self.released += 1


def test_constants_are_set_then_restored_and_plans_dropped(monkeypatch):
    dropped = []
    monkeypatch.setattr(mg, "release_plans", lambda: dropped.append(1))
    sms, ctas, comm = dec.SPLIT_SMS, ar.MAX_CTAS, _Comm()
    with decode_sequences._constants(comm, {"split_sms": 57, "MAX_CTAS": 8}):
        assert (dec.SPLIT_SMS, ar.MAX_CTAS) == (57, 8) and comm.released == 1 and len(dropped) == 1
    assert (dec.SPLIT_SMS, ar.MAX_CTAS) == (sms, ctas) and comm.released == 2 and len(dropped) == 2
    with pytest.raises(RuntimeError), decode_sequences._constants(comm, {"split_sms": 7}):
        assert dec.SPLIT_SMS == 7 and ar.MAX_CTAS == ctas  # what the knob leaves out stays
        raise RuntimeError("a measurement failed")
    assert (dec.SPLIT_SMS, ar.MAX_CTAS) == (sms, ctas) and comm.released == 4
