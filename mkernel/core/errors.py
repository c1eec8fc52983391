"""The exceptions mkernel raises. Every one derives from :class:`MKernelError`."""

import builtins


class MKernelError(Exception):
    """Base of every error mkernel raises on purpose."""


class ArgumentError(MKernelError, ValueError):
    """An argument has the wrong dtype, shape, layout or device, or disagrees across ranks.

    Raised before anything is launched."""


class CompileError(MKernelError):
    """A CUDA source failed to compile with NVRTC; the message holds the compiler log."""


class NoGPUError(MKernelError):
    """No usable CUDA GPU (or not one of compute capability 9.0) is visible to this process."""


class NoRDMADeviceError(MKernelError):
    """The verbs transport was asked for, but no active RDMA port (or no libibverbs) exists here."""


_peer_failures = [0]  # PeerError / TimeoutError raised in this process so far


def peer_failures() -> int:
    """How many PeerError / TimeoutError this process has made (a communicator that saw one may
    have a dead peer: its close() checks before waiting for anyone)."""
    return _peer_failures[0]


class _PeerFailure(MKernelError):
    def __init__(self, *args):
        super().__init__(*args)
        _peer_failures[0] += 1


class PeerError(_PeerFailure):
    """A peer rank failed, disconnected or stopped answering; names the op, rank and peer."""


class TimeoutError(_PeerFailure, builtins.TimeoutError):
    """A device spin-wait or a proxy wait ran past its limit; names the op, rank and peer."""


class CapacityError(MKernelError):
    """An op's receive buffers are too small for what the ranks would send (MoE dispatch capacity);
    detected on the device by every rank alike, raised by the next check on the communicator."""


class WorkspaceError(MKernelError):
    """No range of the symmetric workspace is large enough, and it could not grow (a legacy-IPC or
    sub-communicator workspace, a running proxy, MKERNEL_WORKSPACE_MAX_BYTES reached, or the GPU
    out of memory: the message then says what this rank holds)."""


class ClosedError(MKernelError):
    """The communicator (or memory it owned) was used after ``close()``."""


__all__ = [
    "MKernelError",
    "ArgumentError",
    "CompileError",
    "NoGPUError",
    "NoRDMADeviceError",
    "PeerError",
    "TimeoutError",
    "ClosedError",
    "CapacityError",
    "WorkspaceError",
]
