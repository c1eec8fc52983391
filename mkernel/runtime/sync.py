"""The host side of the flag protocol (``mkernel/cuda/primitives/signals.cuh``): epochs and the error word.

One :class:`SyncState` per communicator holds, in device memory, the epoch that every launch on the
communicator advances and the first error any of its kernels recorded, plus a mapped host mirror
of that error that :meth:`SyncState.check` reads without synchronising any stream.
"""

import ctypes

from mkernel.core import env
from mkernel.core.errors import ArgumentError, CapacityError, MKernelError, PeerError, TimeoutError

# MK_ERR_* of signals.cuh
ERR_NONE, ERR_TIMEOUT, ERR_PEER, ERR_ABORTED, ERR_INPUT = 0, 1, 2, 3, 4
# MkStatus.where of ERR_INPUT in the MoE kernels (MOE_ERR_* of moe_args.cuh), the decode GEMM
# (MK_DECODE_ERR_SMEM of gemm_decode_args.cuh)
MOE_ERR_CAPACITY, MOE_ERR_EXPERT_ID, DECODE_ERR_SMEM = 1, 2, 3
# MK_OP_* : one id per op, named in error messages.
OPS = ["test", "gemm", "gemm_reduce_scatter", "gemm_allreduce", "allgather_gemm", "ring_attention",
       "moe_dispatch_gemm", "moe_gemm_combine", "queue", "attention", "moe_dispatch", "moe_combine", "allreduce"]
OP_ID = {name: i for i, name in enumerate(OPS)}


class MkStatus(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint32), ("op", ctypes.c_uint32), ("rank", ctypes.c_int32),
                ("peer", ctypes.c_int32), ("where", ctypes.c_uint32), ("expected", ctypes.c_uint32),
                ("seen", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("waited_ns", ctypes.c_uint64)]


class MkSync(ctypes.Structure):
    _fields_ = [("epoch", ctypes.c_void_p), ("exit_count", ctypes.c_void_p), ("status", ctypes.c_void_p),
                ("status_host", ctypes.c_void_p), ("timeout_ns", ctypes.c_uint64), ("op", ctypes.c_uint32),
                ("rank", ctypes.c_int32), ("trace_events", ctypes.c_void_p), ("trace_count", ctypes.c_void_p),
                ("trace_capacity", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


# A timeout's hint where ranks talk through the proxy (SyncState.between_nodes).
MODULE_LOAD_HINT = (" Between nodes a CUDA module loaded by a rank while the op ran (the first use of a CuPy "
                    "kernel, a cuBLAS shape or a RawKernel) stalls the proxy's copies the same way: warm such "
                    "code up before, or synchronise the stream first (docs/TP.md, 'Module loads').")


def error_from_status(st: MkStatus, between_nodes: bool = False) -> Exception:
    op = OPS[st.op] if st.op < len(OPS) else f"op#{st.op}"
    peer = f"peer {st.peer}" if st.peer >= 0 else "no peer"
    where = (f"(wait #{st.where}: expected {st.expected}, last saw {st.seen}, after "
             f"{st.waited_ns / 1e9:.2f} s)")
    if st.code == ERR_TIMEOUT:
        return TimeoutError(f"{op} on rank {st.rank} timed out waiting for {peer} {where}. The peer may "
                            f"have died, be stuck, or be issuing ops in a different order; raise "
                            f"MKERNEL_TIMEOUT_S if it is only slow." + (MODULE_LOAD_HINT if between_nodes else ""))
    if st.code == ERR_INPUT and st.where == MOE_ERR_CAPACITY:
        return CapacityError(f"{op}: a rank would receive (or send) {st.seen} rows, more than the capacity of "
                             f"{st.expected}; nothing was sent. Pass a larger capacity "
                             f"(mkernel.moe_capacity(max_tokens, k, world) never overflows), the same on every rank.")
    if st.code == ERR_INPUT and st.where == MOE_ERR_EXPERT_ID:
        return ArgumentError(f"{op}: {st.seen} expert ids lie outside 0..{st.expected - 1} (checked on the device "
                             f"on every rank; nothing was sent)")
    if st.code == ERR_INPUT and st.where == DECODE_ERR_SMEM:
        return MKernelError(f"{op}: the decode GEMM was launched with {st.seen} bytes of shared memory and needs "
                            f"{st.expected}; nothing was computed (gemm_decode.smem_bytes disagrees with "
                            f"DecodeCfg::SMEM: a bug in mkernel, please report it)")
    return PeerError(f"{op} on rank {st.rank}: {peer} failed (code {st.code}) {where}")


class SyncState:
    """Epoch, exit counter and error word of one communicator."""

    def __init__(self, rank: int):
        import cupy

        self.rank = rank
        # epoch, exit_count, then the MkStatus, in one small device allocation.
        self._dev = cupy.zeros(8 + ctypes.sizeof(MkStatus), dtype=cupy.uint8)
        self._host_ptr = cupy.cuda.runtime.hostAlloc(ctypes.sizeof(MkStatus), 2)  # mapped, portable
        ctypes.memset(self._host_ptr, 0, ctypes.sizeof(MkStatus))
        self.host_status = MkStatus.from_address(self._host_ptr)
        self.timeout_ns = int(env.get_float("MKERNEL_TIMEOUT_S") * 1e9)
        self.between_nodes = False  # the communicator spans nodes: its timeouts name the module-load rule

    def args(self, op: str, timeout_s: float = None) -> MkSync:
        base = self._dev.data.ptr
        t = self.timeout_ns if timeout_s is None else int(timeout_s * 1e9)
        return MkSync(base, base + 4, base + 8, self._host_ptr, t, OP_ID[op], self.rank)

    def check(self) -> None:
        """Raise the first error a kernel of this communicator recorded (no synchronisation)."""
        if self.host_status.code != ERR_NONE:
            st = MkStatus.from_buffer_copy(self.host_status)
            raise error_from_status(st, self.between_nodes)

    def epoch(self) -> int:
        """The epoch of the last completed launch (synchronises: for tests and debugging)."""
        return int(self._dev[:4].view("uint32").get()[0])

    def close(self) -> None:
        if self._host_ptr:
            import cupy
            cupy.cuda.runtime.freeHost(self._host_ptr)
            self._host_ptr = 0
            self.host_status = None
            self._dev = None
