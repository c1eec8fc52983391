"""Protocol kernels of the runtime (``cuda/runtime_test.cu``), for its tests and ``python -m mkernel``.

They check, on real hardware, what every fused op relies on: stores into a peer's workspace through
the pointer table, epoch flags that cannot go stale, credits that keep a fast sender from
overwriting a slow receiver, message passing through mapped host memory, and timeouts.
"""

import ctypes

from mkernel.runtime import compile as kcompile
from mkernel.runtime.launch import launch
from mkernel.runtime.sync import MkSync

SPEC = kcompile.register("runtime_test", "runtime_test.cu", ("exchange", "pingpong", "litmus_host", "stuck_wait"),
                         hot=False)
BLOCK = 256
FLAG_WORDS = 2 * 64  # ARRIVED[MK_MAX_LOCAL], PING, PONG (runtime_test.cu)


class RuntimeTestArgs(ctypes.Structure):
    _fields_ = [("sync", MkSync), ("peers", ctypes.c_void_p), ("flags_off", ctypes.c_uint64),
                ("slots_off", ctypes.c_uint64), ("mismatches", ctypes.c_void_p),
                ("first_mismatch", ctypes.c_void_p), ("host_area", ctypes.c_void_p),
                ("local_size", ctypes.c_uint32), ("local_rank", ctypes.c_uint32), ("words", ctypes.c_uint32),
                ("rounds", ctypes.c_uint32), ("consume_delay_ns", ctypes.c_uint32), ("skip_credit", ctypes.c_uint32)]


class Protocol:
    """Buffers for the protocol kernels on one communicator (collective to create)."""

    def __init__(self, comm, words: int = 4096):
        import cupy

        self.comm, self.words = comm, words
        self.flags = comm.empty(FLAG_WORDS, "uint32")
        self.slots = comm.empty((comm.local_size, words), "uint32")
        self.mismatches = cupy.zeros(1, dtype=cupy.uint32)
        self.first = cupy.zeros(5, dtype=cupy.uint32)
        self.flags.fill(0)  # comm.empty reuses memory: a stale word equal to an epoch would read as a flag
        cupy.cuda.runtime.deviceSynchronize()  # zero before this rank's first credit lets a peer set one
        self.module = kcompile.module(SPEC)

    def args(self, *, rounds=1, consume_delay_ns=0, skip_credit=False, host_area=0, timeout_s=None):
        c = self.comm
        return RuntimeTestArgs(c.sync_args("test", timeout_s), c.peer_table.data.ptr, c.offset_of(self.flags),
                               c.offset_of(self.slots), self.mismatches.data.ptr, self.first.data.ptr, host_area,
                               c.local_size, c.local_rank, self.words, rounds, consume_delay_ns, int(skip_credit))

    def run(self, kernel: str, grid=1, stream=None, **kw):
        launch(self.module.function(kernel), (grid,), (BLOCK,), self.args(**kw), stream=stream)

    def mismatch_count(self) -> int:
        return int(self.mismatches.get()[0])

    def first_mismatch(self) -> str:
        """What the first wrong word was, for failure messages: and whether it came from an earlier or a
        later epoch (a stale read, or an overwrite)."""
        import numpy as np
        f = self.first.get()
        if not f[0]:
            return "no mismatch"
        epoch, sender, index, seen = (int(x) for x in f[1:])
        def pat(e):
            return int(np.uint32((e * 2654435761) & 0xFFFFFFFF) ^ np.uint32(sender << 24) ^ np.uint32(index))
        which = {pat(epoch - 1): "the previous epoch's (stale read)", pat(epoch + 1): "the next epoch's (overwrite)"}
        return (f"epoch {epoch}, from rank {sender}, word {index}: saw {seen:#x}, expected {pat(epoch):#x}; "
                f"it is {which.get(seen, 'neither neighbour epoch')} value")
