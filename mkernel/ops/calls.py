"""The path of one op call, as every op runs it: checks of the communicator and of ``out``,
agreement of the ranks on a shape's first call, and the recorded launches that a repeated call
replays without checks (design: docs/ARCHITECTURE.md, "One call").

CuPy is imported inside functions: importing this module needs neither a GPU nor CuPy.
"""

import contextlib

from mkernel.core.errors import ArgumentError
from mkernel.core.log import get_logger
from mkernel.runtime import launch as _launch
from mkernel.runtime.arrays import check_matrix, cupy_mod, row_stride
from mkernel.runtime.launch import launch_all

log = get_logger("calls")


def check_node_major(op, comm):
    """Nodes of equal size and node-major ranks (rank = node * ranks_per_node + local rank), as every
    path between nodes assumes. Every rank sees the same node_of, so all raise alike."""
    L = comm.local_size
    if comm.size % L or comm.topology.node_of != tuple(r // L for r in range(comm.size)):
        raise ArgumentError(f"{op}: needs node-major ranks (rank = node * ranks_per_node + local rank) and the "
                            f"same number of ranks on every node; this communicator's nodes are "
                            f"{comm.topology.node_of} (launch ranks by node, or split with key=rank)")


def prepare_out(op, out, shape, dtype, comm):
    """``out`` checked (a CuPy array of ``shape`` and ``dtype``, rows contiguous, outside the
    symmetric workspace), or a new array when None."""
    cupy = cupy_mod()

    if out is None:
        return cupy.empty(shape, dtype=dtype)
    if not isinstance(out, cupy.ndarray):
        raise ArgumentError(f"{op}: out must be a cupy.ndarray")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ArgumentError(f"{op}: out must be {tuple(shape)} of {dtype}; got {tuple(out.shape)} of {out.dtype}")
    check_matrix(out, "out", dtypes=(dtype,))
    return check_outside_workspace(op, out, comm)


def check_outside_workspace(op, out, comm):
    heap = comm.heap
    if heap.base <= out.data.ptr < heap.base + heap.nbytes:
        raise ArgumentError(f"{op}: out must not lie in the symmetric workspace (the op's buffers live there)")
    return out


def agree_call(op, comm, key, reason):
    """Agrees on a call's shapes, options and path (``key``, whose last entry is the path):
    collective the first time the key is seen; ranks that disagree raise ArgumentError together."""
    first = not comm.agreed(key)
    comm.agree(key, key)
    note_path(comm, op, key[-1])
    if first:
        log.debug("%s %s: %s path (%s)", op, key[1:-1], key[-1], reason)


def note_path(comm, op, path):
    """Records the path of ``op``'s latest call (``comm.plans.state["tp.last_path"]``: tests, logs)."""
    comm.plans.state.setdefault("tp.last_path", {})[op] = path


def call_key(comm, op, stream, arrays, options):
    """The key of a call for ``comm.plans``' recorded launches, or None where a call cannot be
    recorded: an argument not a CuPy array (out not given), or tracing on (its pointers move)."""
    cupy = cupy_mod()
    if comm is None:
        return None
    for x in arrays:
        if not isinstance(x, cupy.ndarray):
            return None
    return None if comm.trace.path else _launch.call_key(cupy, stream, arrays, (op, *options))


def record_call(comm, key, op, path, launches, plans, keep=(), token=None, on_replay=None):
    """Records a call's launches for :func:`replay` (its path noted again at each replay). A fused
    TP call's ``token`` (``autosplit.choose``'s, None for a fixed comm_sms) lets a replay through
    only while its split search holds its count (nothing recorded before it does); ``on_replay()``
    runs at each replay let through."""
    if key is None:
        return
    st, n = token[:2] if token is not None else (None, None)
    if st is not None and not st.settled:
        return

    def gate():
        if st is not None and not st.steady(n):
            return False
        note_path(comm, op, path)
        if on_replay is not None:
            on_replay()
        return True
    comm.plans.record_launches(key, launches, plans, keep, gate=gate)


def replay(comm, key, stream) -> bool:
    """A repeated call: raises a pending error, then launches what ``key``'s first call recorded
    (its checks and agreement held then: the same arrays and options). False if nothing is recorded
    (or its gate refuses: the full call runs)."""
    launches = None if key is None else comm.plans.launches(key)
    if launches is None:
        return False
    comm.check()
    launch_all(launches, stream_handle=key[1])  # the key holds the stream's handle
    return True


def on_stream(stream):
    """``with on_stream(stream):`` makes CuPy work (matmul, copies) run on ``stream`` when given."""
    return stream if stream is not None else contextlib.nullcontext()


def stream_ptr(stream):
    cupy = cupy_mod()
    return (stream if stream is not None else cupy.cuda.get_current_stream()).ptr


class RowCopy:
    """A 2-D device copy that a recorded call replays like a Launch (``go(stream_handle)``)."""

    def __init__(self, *args):
        self.args = args

    def go(self, stream_handle):
        rt = cupy_mod().cuda.runtime
        rt.memcpy2DAsync(*self.args, rt.memcpyDeviceToDevice, stream_handle)


def copy_rows(dst_ptr, dst_pitch, src, rows, row_bytes, stream):
    """rows x row_bytes of ``src`` (row stride as row_stride) to dst_ptr (dst_pitch bytes apart), on
    ``stream``; returns the copy (a RowCopy) for a record."""
    copy = RowCopy(dst_ptr, dst_pitch, src.data.ptr, row_stride(src), row_bytes, rows)
    copy.go(stream_ptr(stream))
    return copy


def quiesced_first_use(comm, plan, key):
    """Between nodes, True the first time ``key`` is seen for ``plan``, after synchronising the
    device (ops of ours may run on other streams): the caller then runs host-launched work whose
    first use loads a CUDA module (cuBLAS picks a new kernel, CuPy a new elementwise kernel). A
    module load waits for the device to go idle and meanwhile blocks every CUDA call of the
    process, the proxy thread's copies included; a kernel in flight that waits on the proxy then
    never finishes (measured on the H200: allgather_gemm between nodes stalled in most fresh
    processes). So nothing of ours may be in flight when such work first runs."""
    if comm.num_nodes == 1 or key in plan.setdefault("loaded", set()):
        return False
    plan["loaded"].add(key)
    cupy_mod().cuda.runtime.deviceSynchronize()
    return True
