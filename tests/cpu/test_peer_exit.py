"""CPU: after a peer failure the process never waits in MPI_Finalize for a dead peer. Every
PeerError / TimeoutError is counted (a communicator that saw one checks its peers before waiting
for them at close); a close that finds a peer gone makes the exit hook leave without MPI_Finalize."""

import weakref

import pytest

from mkernel.comm import communicator as mcomm
from mkernel.core import errors


def test_peer_failures_are_counted():
    n = errors.peer_failures()
    errors.PeerError("rank 1 died")
    errors.TimeoutError("a wait ran past its limit")
    errors.ArgumentError("not a peer failure")
    assert errors.peer_failures() == n + 2


class _Root:
    def __init__(self, lose_peer):
        self.lose_peer, self.closed = lose_peer, False

    def close(self):
        self.closed = True
        if self.lose_peer:
            mcomm._peer_lost()


@pytest.mark.parametrize("lose_peer", [False, True])
def test_exit_hook_leaves_without_finalize_only_when_a_peer_is_gone(monkeypatch, lose_peer):
    exits = []
    monkeypatch.setattr("os._exit", lambda code: exits.append(code))
    monkeypatch.setattr(mcomm, "_finalize_unsafe", False)
    root = _Root(lose_peer)
    monkeypatch.setattr(mcomm, "_roots", [weakref.ref(root)])
    mcomm._close_all()
    assert root.closed
    assert exits == ([1] if lose_peer else [])
