"""The tuning knobs (mkernel/core/config.py): one frozen object, set for the process or for a block,
checked when set."""

import dataclasses

import pytest

import mkernel
from mkernel import config
from mkernel.core.errors import ArgumentError


def test_override_sets_the_knobs_for_a_block_and_restores_them():
    base = config.get()
    with config.override(tp_controller="pattern", moe_join_gemm=False) as cfg:
        assert config.get() is cfg and cfg.tp_controller == "pattern" and not cfg.moe_join_gemm
        assert cfg.tp_comm_sms == base.tp_comm_sms  # the rest unchanged
    assert config.get() is base


def test_configure_sets_the_knobs_for_the_process():
    base = config.get()
    try:
        assert config.configure(ring_comm_sms=4).ring_comm_sms == 4 and config.get().ring_comm_sms == 4
    finally:
        config._current[0] = base


@pytest.mark.parametrize("changes,match", [({"tp_controller": "sometimes"}, "tp_controller"),
                                           ({"ring_comm_sms": 0}, "ring_comm_sms"),
                                           ({"tp_join_reduce": 1}, "tp_join_reduce"),
                                           ({"tp_join_reduce": "sometimes"}, "tp_join_reduce"),
                                           ({"tp_join_min_gemm_share": -1}, "tp_join_min_gemm_share"),
                                           ({"tp_join_min_gemm_share": "0.3"}, "tp_join_min_gemm_share"),
                                           ({"mps_full_share": "sometimes"}, "mps_full_share"),
                                           ({"mps_full_share": 1}, "mps_full_share"),
                                           ({"moe_bundle_pieces": 0}, "moe_bundle_pieces"),
                                           ({"moe_bundle_pieces": 9}, "moe_bundle_pieces"),
                                           ({"moe_bundle_pieces": True}, "moe_bundle_pieces"),
                                           ({"no_such_knob": 1}, "unknown configuration")])
def test_bad_values_raise_where_they_are_set(changes, match):
    with pytest.raises(ArgumentError, match=match):
        with config.override(**changes):
            pass
    assert config.get() == config.Config()


def test_the_object_and_its_tables_are_read_only():
    cfg = config.get()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tp_controller = "off"
    with pytest.raises(TypeError):
        cfg.tp_comm_sms["gemm_allreduce"] = 1
    assert mkernel.config is config


def test_the_whole_mps_share_in_a_node_between_nodes_but_for_ar_at_one_rank_a_node_and_everywhere_when_always(
        monkeypatch):
    from types import SimpleNamespace

    from mkernel.runtime import launch

    comms = [SimpleNamespace(num_nodes=n, local_size=L) for n, L in ((1, 2), (2, 1), (2, 2))]
    monkeypatch.setattr(launch, "sm_count", lambda full_share=False: 66 if full_share else 57)
    ops = ("ring_attention", "gemm_allreduce", "gemm_reduce_scatter", "allgather_gemm", "moe_dispatch_gemm")
    wants = {True: ((True,) * 5, (True, False, True, True, True), (True,) * 5), False: ((False,) * 5,) * 3,
             "always": ((True,) * 5,) * 3}
    for setting, want in wants.items():
        with config.override(mps_full_share=setting):
            got = tuple(tuple(launch.full_share(c, op) for op in ops) for c in comms)
            assert got == want, setting
            assert [launch.grid_sms(c, op) for c in comms for op in ops] == [66 if f else 57 for r in want for f in r]
