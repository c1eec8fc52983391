"""The Hopper GEMM engine: ``gemm`` and ``grouped_gemm`` (design and alignment rule: docs/GEMM.md).

A persistent, warp-specialized kernel (``mkernel/cuda/engines/gemm.cu``): TMA loads into a 4-stage
shared-memory ring, one producer warpgroup, two consumer warpgroups issuing ``wgmma.m64n256k16``,
fp32 accumulation, 128 x 256 x 64 tiles (plain mode may take 128 x 192: tile_width), epilogue
through 128B-swizzled shared memory and TMA store (or TMA reduce-add). The tile order, the CTAs
that run tiles (a role word per CTA) and the per-tile flags are parameters, so fused ops drive the
same kernel.

Alignment rule (what TMA can address): K and N multiples of 8 (rows of 16-bit data are multiples of
16 bytes), every base address 16-byte aligned, rows contiguous (unit element stride) with row
strides that are multiples of 16 bytes. M is free. Edges (M, N, K not multiples of the tile) are
handled by TMA: out-of-bounds loads read zeros, out-of-bounds stores are dropped.

CuPy is imported lazily, so that this module (and its kernel registration) imports without it.
"""

import ctypes
import threading

from mkernel.core import config
from mkernel.core.errors import ArgumentError
from mkernel.engines import gemm_decode as _decode
from mkernel.engines.gemm_plan import (
    BK,
    BM,
    BN,
    BN_NARROW,
    CLUSTER,
    ROW_LINE,
    default_ctas,
    sched_flags,
    split_bytes,
    split_k,
    tile_width,
    tiles,
    units,
    use_cluster,
)
from mkernel.runtime import compile as _compile
from mkernel.runtime import tma as _tma
from mkernel.runtime.arrays import DT, check_matrix, cupy_mod, row_stride
from mkernel.runtime.gpu import require_hopper
from mkernel.runtime.launch import PlanCache, call_key, launch, sm_count  # all SMs: its CTAs never wait on each other
from mkernel.runtime.launch import device_sms as _num_sms
from mkernel.runtime.sync import MkStatus, MkSync, SyncState  # noqa: F401  (MkStatus: the layout test)

# ---------------------------------------------------------------------------- kernel registry
THREADS = 384
STAGES = 4
MAX_GROUPS = 128
B_NK, B_KN = 0, 1
OUT_BF16, OUT_F16, OUT_F32 = 0, 1, 2
EPI_STORE, EPI_ADD = 0, 1
SCHED_LEAVE, SCHED_GEMM = 0, 1  # role words (MK_SCHED_*)
DEFAULT_GROUP_M = 8  # built-in tile order: M-tiles per group (8 beat 16 on the rows: bench/NOTES.md)


_C_STAGING_BYTES = 2 * 4 * 2 * 2048  # consumer warps x 2 chunk buffers of 16 rows x 128 B
_BARS_BYTES = 336
_GROUP_TABLE_BYTES = 2 * 4 * (MAX_GROUPS + 1)


def smem_bytes(grouped: bool, bn: int = BN) -> int:
    """Dynamic shared memory of a GEMM kernel (gemm_smem_bytes<> in gemm_mainloop.cuh; gemm.cu
    static_asserts the values)."""
    off_bar = STAGES * (BM * BK * 2) + STAGES * (bn * BK * 2) + _C_STAGING_BYTES
    return off_bar + _BARS_BYTES + (_GROUP_TABLE_BYTES if grouped else 0) + 1024


SMEM_PLAIN = smem_bytes(False)
SMEM_GROUPED = smem_bytes(True)


def kernel_expr(dt: int, layout: int, out: int, grouped: bool, cluster: bool = False, bn: int = BN) -> str:
    if cluster:
        return f"mk_gemm_cluster_kernel<{dt},{layout},{out},{bn}>"
    return f"mk_gemm_kernel<{dt},{layout},{out},{'true' if grouped else 'false'},{bn}>"


EXPRESSIONS = tuple(kernel_expr(dt, bl, out, g)
                    for dt in (0, 1) for bl in (B_NK, B_KN) for out in (dt, OUT_F32) for g in (False, True)) + \
    tuple(kernel_expr(dt, bl, out, False, cluster=True)
          for dt in (0, 1) for bl in (B_NK, B_KN) for out in (dt, OUT_F32))
SPEC = _compile.register("gemm", "gemm.cu", EXPRESSIONS, hot=True)
# The narrow tiles in a module of their own: compiled at the first call that takes them.
NARROW_EXPRESSIONS = tuple(kernel_expr(dt, bl, out, False, bn=BN_NARROW)
                           for dt in (0, 1) for bl in (B_NK, B_KN) for out in (dt, OUT_F32))
NARROW_SPEC = _compile.register("gemm_narrow", "gemm.cu", NARROW_EXPRESSIONS, hot=True)


# --------------------------------------------------------------------- argument struct mirror
class MkGemmSched(ctypes.Structure):
    _fields_ = [("tile_order", ctypes.c_void_p), ("tile_counter", ctypes.c_void_p),
                ("done_count", ctypes.c_void_p), ("roles", ctypes.c_void_p), ("num_tiles", ctypes.c_uint32),
                ("tiles_n", ctypes.c_uint32), ("group_m", ctypes.c_uint32), ("flags", ctypes.c_uint32)]


_ARGS_FIELDS = [("a", _tma.TensorMap), ("b", _tma.TensorMap), ("c", _tma.TensorMap), ("sync", MkSync),
                ("sched", MkGemmSched), ("c_ptr", ctypes.c_void_p), ("group_rows", ctypes.c_void_p),
                ("tile_flags", ctypes.c_void_p), ("tile_counts", ctypes.c_void_p), ("ldc", ctypes.c_int64),
                ("m", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
                ("num_groups", ctypes.c_int32), ("epi_op", ctypes.c_uint32), ("splits", ctypes.c_uint32),
                ("split_ws", ctypes.c_void_p)]


class MkGemmArgs(ctypes.Structure):
    # The C struct is 64-byte aligned (TmaDesc is alignas(64)); ctypes cannot say so, which only
    # matters for its size (explicitly padded to a multiple of 64) since it is passed by copy.
    _fields_ = _ARGS_FIELDS

# ------------------------------------------------------------------------ per-stream workspace
class _Workspace:
    """What a standalone GEMM launch (no communicator) needs, one per (device, stream): a private
    SyncState (epoch, exit counter, error word with its mapped host mirror) and the scheduler's
    two counters (zero between launches; the kernel's last CTA resets them)."""
    COUNTER, DONE = 0, 4

    def __init__(self):
        import cupy

        self.sync_state = SyncState(rank=0)
        self.sched_mem = cupy.zeros(16, dtype=cupy.uint32)
        self.base = self.sched_mem.data.ptr
        self.partials = None  # the decode path's (gemm_decode.Partials), grown to a call's need
        self.split = None  # split K's counts and partials (gemm_splitk.cuh), grown to a call's need

    @staticmethod
    def _zeroed(make):
        """A new zeroed buffer (its counts must be zero before a launch uses it); the launch plans
        that hold the one it replaces keep that alive."""
        import cupy

        buf = make()
        cupy.cuda.runtime.deviceSynchronize()  # zeroed on CuPy's current stream: done before our stream's launch
        return buf

    def decode_partials(self, nbytes: int, blocks: int):
        """The decode path's buffer, replaced by a larger one when a call needs more."""
        if self.partials is None or not self.partials.fits(nbytes, blocks):
            old_bytes, old_blocks = (self.partials.nbytes, self.partials.blocks) if self.partials else (0, 0)
            self.partials = self._zeroed(lambda: _decode.Partials(max(nbytes, old_bytes), max(blocks, old_blocks)))
        return self.partials

    def split_buffer(self, nbytes: int):
        """Split K's counts and partials, replaced by a larger buffer when a call needs more."""
        import cupy

        if self.split is None or self.split.nbytes < nbytes:
            old = self.split.nbytes if self.split is not None else 0
            self.split = self._zeroed(lambda: cupy.zeros(max(nbytes, old), cupy.uint8))
        return self.split

    def sync(self) -> MkSync:
        return self.sync_state.args("gemm")

    def epoch(self) -> int:
        """The epoch of the last completed launch (synchronises with the device)."""
        return self.sync_state.epoch()

    def check(self) -> None:
        self.sync_state.check()


_workspaces = {}
_ws_lock = threading.Lock()


def workspace(stream=None) -> _Workspace:
    import cupy

    s = stream if stream is not None else cupy.cuda.get_current_stream()
    key = (cupy.cuda.runtime.getDevice(), s.ptr)
    with _ws_lock:
        ws = _workspaces.get(key)
        if ws is None:
            ws = _workspaces[key] = _Workspace()
        return ws


def check(stream=None) -> None:
    """Raises the error (mkernel.TimeoutError) a standalone GEMM on this stream recorded, if any:
    a CTA told to leave GEMM work (roles) that waited longer than MKERNEL_TIMEOUT_S. No sync."""
    workspace(stream).check()


# ------------------------------------------------------------------------------- validation


def _dtype_name(x):
    return x.dtype.name



def _check_inputs(a, b_shape_ok, K, N):
    if _dtype_name(a) not in DT:
        raise ArgumentError(f"inputs must be bfloat16 or float16; got {a.dtype}")
    if K % 8:
        raise ArgumentError(f"K = {K} must be a multiple of 8 (TMA rows must be multiples of 16 bytes)")
    if N % 8:
        raise ArgumentError(f"N = {N} must be a multiple of 8 (TMA rows must be multiples of 16 bytes)")


def _resolve_b_2d(b, K, layout):
    """(layout code, array whose rows are contiguous, N) for a 2-D B."""
    if b.ndim != 2:
        raise ArgumentError(f"b must be 2-D; got shape {b.shape}")
    if layout is None:
        if b.shape[0] != K:
            raise ArgumentError(f"b has shape {b.shape}; expected [K={K}, N] (or pass b_layout='nk' for [N, K])")
        if b.shape[1] > 1 and b.strides[1] != b.itemsize and b.strides[0] == b.itemsize:
            return B_NK, b.T, b.shape[1]  # the transpose of a row-major [N, K] (weights): w.T
        return B_KN, b, b.shape[1]
    if layout == "kn":
        if b.shape[0] != K:
            raise ArgumentError(f"b_layout='kn' needs b of shape [K={K}, N]; got {b.shape}")
        return B_KN, b, b.shape[1]
    if layout == "nk":
        if b.shape[1] != K:
            raise ArgumentError(f"b_layout='nk' needs b of shape [N, K={K}]; got {b.shape}")
        return B_NK, b, b.shape[0]
    raise ArgumentError(f"b_layout must be None, 'kn' or 'nk'; got {layout!r}")


def _out_code(a_dtype_name, out_dtype_name):
    if out_dtype_name == "float32":
        return OUT_F32
    if out_dtype_name != a_dtype_name:
        raise ArgumentError(f"output dtype must be the input dtype ({a_dtype_name}) or float32; got {out_dtype_name}")
    return OUT_BF16 if a_dtype_name == "bfloat16" else OUT_F16


def _prepare_out(cupy, out, shape, a, out_dtype):
    """(out, its MK_OUT_* code): ``out`` checked, or a new array of out_dtype (default a's dtype)."""
    dtype = out.dtype if out is not None else cupy.dtype(out_dtype) if out_dtype is not None else a.dtype
    out_code = _out_code(_dtype_name(a), cupy.dtype(dtype).name)
    if out is None:
        return cupy.empty(shape, dtype=dtype), out_code
    if not isinstance(out, cupy.ndarray):
        raise ArgumentError("out must be a cupy.ndarray")
    if tuple(out.shape) != tuple(shape):
        raise ArgumentError(f"out must have shape {tuple(shape)}; got {out.shape}")
    check_matrix(out, "out", dtypes=None)
    return out, out_code


_hopper_devices = set()


def _check_device(cupy):
    """NoGPUError unless the current device is an sm_90 GPU (checked once per device)."""
    try:
        dev = cupy.cuda.runtime.getDevice()
    except Exception:  # noqa: BLE001  (no driver or no device: require_hopper says which)
        dev = None
    if dev is not None and dev in _hopper_devices:
        return

    require_hopper()
    _hopper_devices.add(dev)


def _u32_array(cupy, x, n, what):
    if x is None:
        return None
    if not isinstance(x, cupy.ndarray) or x.dtype.itemsize != 4 or x.ndim != 1 or not x.flags.c_contiguous:
        raise ArgumentError(f"{what} must be a contiguous 1-D cupy array of 32-bit words")
    if x.size < n:
        raise ArgumentError(f"{what} needs at least {n} entries; got {x.size}")
    return x.data.ptr


def c_map(out, out_code):
    """The output's TMA store map (box 128 bytes of columns x 16 rows, 128B swizzle)."""
    esize = 4 if out_code == OUT_F32 else 2
    dt = {OUT_BF16: _tma.DTYPE_BFLOAT16, OUT_F16: _tma.DTYPE_FLOAT16, OUT_F32: _tma.DTYPE_FLOAT32}[out_code]
    M, N = out.shape
    return _tma.encode_tiled(dt, out.data.ptr, (N, M), (row_stride(out),), (128 // esize, 16))


def a_map(dtype_name, ptr, rows, K, row_bytes):
    """A's TMA map: [rows, K] with rows ``row_bytes`` apart (box BK x BM)."""
    tdt = _tma.DTYPE_BFLOAT16 if dtype_name == "bfloat16" else _tma.DTYPE_FLOAT16
    return _tma.encode_tiled(tdt, ptr, (K, rows), (row_bytes,), (BK, BM))


def b_map(b_arr, layout, K, N, G=1, step=1, bn=BN):
    """B's 3-D tensor map (G matrices; a 2-D B is G = 1): [N, K] rows (layout B_NK, box 64 x bn / step
    rows: a cluster's CTAs load bn / step each) or [K, N] rows (B_KN, boxes of 64 columns)."""
    tdt = _tma.DTYPE_BFLOAT16 if _dtype_name(b_arr) == "bfloat16" else _tma.DTYPE_FLOAT16
    ldb = row_stride(b_arr) if b_arr.ndim == 2 else b_arr.strides[1]
    gstride = max(16, ldb * b_arr.shape[0]) if b_arr.ndim == 2 else b_arr.strides[0]
    if layout == B_NK:  # rows of B are N, contiguous along K
        return _tma.encode_tiled(tdt, b_arr.data.ptr, (K, N, G), (ldb, gstride), (BK, bn // step, 1))
    return _tma.encode_tiled(tdt, b_arr.data.ptr, (N, K, G), (ldb, gstride), (64, BK, 1))  # rows are K


def check_grouped_b(b_arr, what="b"):
    """The strides a grouped B ([G, N, K] or [G, K, N], rows contiguous) needs for its tensor map."""
    if b_arr.strides[2] != b_arr.itemsize or b_arr.strides[1] % 16 or b_arr.strides[0] % 16:
        raise ArgumentError(f"{what} must have contiguous rows and 16-byte multiple strides; got {b_arr.strides}")
    if b_arr.data.ptr % 16:
        raise ArgumentError(f"{what} must start at a 16-byte aligned address")


# ------------------------------------------------------------------------------------ launch
def _launch(cupy, *, a, b_arr, layout, N, K, M, G, out, out_code, group_rows, epi_op, stream, sms,
            tile_order, roles, tile_flags, tile_counts, group_m, num_tiles_host, max_tiles, order="m",
            cluster=False, splits=1, bn=BN, overlapped=False):
    step = CLUSTER if cluster else 1  # CTAs per claim
    if sms is None:
        sms = step * default_ctas(num_tiles_host, _num_sms() // step) if num_tiles_host and roles is None \
            else _num_sms() // step * step
    if not step <= int(sms) <= _num_sms() or int(sms) % step:
        raise ArgumentError(f"sms must be {'an even number in ' if cluster else ''}{step}..{_num_sms()}; got {sms}")
    dt_name = _dtype_name(a)
    args = MkGemmArgs()
    args.a = a_map(dt_name, a.data.ptr, M, K, row_stride(a))
    args.b = b_map(b_arr, layout, K, N, G, step, bn)
    args.c = c_map(out, out_code)
    ws = workspace(stream)
    args.sync = ws.sync()
    tiles_n = -(-N // bn)
    grid = int(sms) if num_tiles_host is None else max(step, min(int(sms), step * num_tiles_host))
    args.sched = MkGemmSched(_u32_array(cupy, tile_order, max_tiles, "tile_order"), ws.base + ws.COUNTER,
                             ws.base + ws.DONE, _u32_array(cupy, roles, grid, "roles"), num_tiles_host or 0, tiles_n,
                             int(group_m), sched_flags(order, roles is not None, grid, sm_count()))
    args.c_ptr = out.data.ptr
    args.group_rows = group_rows
    args.tile_flags = _u32_array(cupy, tile_flags, max_tiles, "tile_flags")
    args.tile_counts = _u32_array(cupy, tile_counts, max_tiles, "tile_counts")
    args.ldc = row_stride(out) // out.itemsize
    args.m, args.n, args.k, args.num_groups = M, N, K, G
    args.epi_op = epi_op
    buffer = None
    if splits > 1:
        buffer = ws.split_buffer(split_bytes(M, N, splits, bn))
        args.splits, args.split_ws = splits, buffer.data.ptr
    grouped = group_rows is not None
    spec = SPEC if bn == BN else NARROW_SPEC
    fn = _compile.module(spec).function(kernel_expr(DT[dt_name], layout, out_code, grouped, cluster, bn))
    plan = (fn, (grid,), (THREADS,), args, smem_bytes(grouped, bn), buffer)
    return plan, launch(fn, (grid,), (THREADS,), args, smem=plan[4], overlapped=overlapped, stream=stream)


def _launch_decode(a, b_arr, out, out_code, *, M, N, K, accumulate, stream):
    """The decode path's launch; returns its plan (the buffer it uses rides along, kept alive) and Launch."""
    ws = workspace(stream)
    d = _decode.build(a, b_arr, out, out_code, M=M, N=N, K=K, accumulate=accumulate, sync=ws.sync(),
                      partial=ws.decode_partials)
    overlapped = config.get().gemm_overlap  # griddep_wait in the kernel before any memory access
    return (d.fn, d.grid, d.block, d.args, d.smem, d.buffer), launch(d.fn, d.grid, d.block, d.args, smem=d.smem,
                                                                     overlapped=overlapped, stream=stream)


# Launch plans of gemm() calls that passed `out` (launch.PlanCache).
_plans = PlanCache()


def _ptr(x):
    return None if x is None else x.data.ptr


def _key(cupy, stream, a, b, out, b_layout, out_dtype, accumulate, sms, tile_order, roles, tile_flags, tile_counts,
         group_m, order, cluster):
    c = config.get()
    knobs = _decode.knobs() + (c.gemm_split_k, c.gemm_tile_n, c.gemm_overlap)  # they pick the kernel, grid, launch
    return call_key(cupy, stream, (a, b, out), (b_layout, out_dtype, accumulate, sms, _ptr(tile_order), _ptr(roles),
                                                _ptr(tile_flags), _ptr(tile_counts), group_m, order, cluster, knobs))


def release_plans() -> None:
    """Drops the launch plans kept for repeated ``gemm`` calls, and the buffers they keep alive (a
    stream's split K and decode partials): each call builds its plan again at its next call."""
    _plans.clear()


def kept_plan(a, b, out, *, stream=None, b_layout=None):
    """``(plan, Launch)`` that a plain ``gemm(a, b, out=out, stream=stream, b_layout=b_layout)`` call
    keeps (plan: ``(fn, grid, block, args, smem[, buffer])``), or None: for an op that records the
    Launch in its own call (and keeps the plan, which holds its buffer)."""
    cupy = cupy_mod()
    return _plans.get(_key(cupy, stream, a, b, out, b_layout, None, False, None, None, None, None, None,
                           DEFAULT_GROUP_M, None, None))


def gemm(a, b, *, out=None, stream=None, b_layout=None, out_dtype=None, accumulate=False, sms=None,
         tile_order=None, roles=None, tile_flags=None, tile_counts=None, group_m=DEFAULT_GROUP_M, order=None,
         cluster=None):
    """``out = a @ b`` (or ``out += a @ b`` with accumulate=True) on an H100/H200.

    a: [M, K] bfloat16 or float16 with contiguous rows. b: by default [K, N] (``a @ b``); a
    transposed view of a row-major [N, K] (``w.T``) is recognised and read as the weights layout;
    b_layout='nk' takes b as [N, K] explicitly (``a @ b.T``). out: [M, N] of the input dtype, or
    float32 (out_dtype or the dtype of ``out``). Alignment rule: K % 8 == 0, N % 8 == 0, 16-byte
    aligned bases and row strides.

    Controls used by fused ops and tests: ``sms`` (CTAs = SMs running tiles), ``tile_order``
    (device uint32 array: the tile ids, ``mt * ceil(N/256) + nt``, in run order), ``roles``
    (device uint32 per CTA, 1 = run tiles, 0 = leave GEMM work at the next tile boundary),
    ``tile_flags`` (device uint32 per tile, set to the launch epoch once the tile is stored),
    ``tile_counts`` (tests: counts the flag stores), ``group_m`` (built-in order, tiles per group),
    ``order`` (built-in order: 'm' (default) groups M-tiles, 'n' groups N-tiles; bench/NOTES.md:
    neither wins reliably at the shapes measured), ``cluster`` (None: by shape (use_cluster);
    True / False: the clustered kernel or not; clustered, ``sms`` must be even). Tile ids count
    128 x 256 tiles; without controls a call may run 128 x 192 tiles (config.gemm_tile_n).
    """
    cupy = cupy_mod()
    key = None
    if out is not None and isinstance(a, cupy.ndarray) and isinstance(b, cupy.ndarray) \
            and isinstance(out, cupy.ndarray):
        key = _key(cupy, stream, a, b, out, b_layout, out_dtype, accumulate, sms, tile_order, roles, tile_flags,
                   tile_counts, group_m, order, cluster)
        if _plans.launch(key, stream):
            return out
    _check_device(cupy)
    if not isinstance(a, cupy.ndarray) or not isinstance(b, cupy.ndarray):
        raise ArgumentError("a and b must be cupy.ndarray")
    if a.dtype != b.dtype:
        raise ArgumentError(f"a and b must have the same dtype; got {a.dtype} and {b.dtype}")
    if a.ndim != 2:
        raise ArgumentError(f"a must be 2-D [M, K]; got shape {a.shape}")
    M, K = a.shape
    layout, b_arr, N = _resolve_b_2d(b, K, b_layout)
    _check_inputs(a, None, K, N)
    out, out_code = _prepare_out(cupy, out, (M, N), a, out_dtype)
    if M == 0 or N == 0:
        return out
    if K == 0:
        if not accumulate:
            out.fill(0)
        return out
    check_matrix(a, "a", dtypes=None)
    check_matrix(b_arr, "b", dtypes=None)
    if group_m < 1:
        raise ArgumentError("group_m must be >= 1")
    if order not in (None, "m", "n"):
        raise ArgumentError(f"order must be None, 'm' or 'n'; got {order!r}")
    order = order or "m"
    controls = any(x is not None for x in (sms, tile_order, roles, tile_flags, tile_counts))
    if _decode.eligible(M, N, K, layout == B_NK, controls=controls or bool(cluster)):
        plan, launched = _launch_decode(a, b_arr, out, out_code, M=M, N=N, K=K, accumulate=accumulate, stream=stream)
        if key is not None:
            _plans.add(key, plan, launched)
        return out
    nt = tiles(M, N)
    bn = BN if controls or cluster else tile_width(M, N, K)  # the controls address 256-wide tiles
    clustered = bn == BN and use_cluster(M, N, K, cluster, tile_order=tile_order, roles=roles, sms=sms,
                                         aligned=row_stride(a) % ROW_LINE == 0 and row_stride(b_arr) % ROW_LINE == 0)
    splits = 1 if controls else split_k(M, N, K, cluster=clustered, bn=bn)
    # Clustered, the scheduler claims units of CLUSTER M-tiles (group_m counts M-tiles either way);
    # split K, (tile or unit, range of K) pairs.
    claims = units(M, N, clustered, bn) * splits
    plan, launched = _launch(cupy, a=a, b_arr=b_arr, layout=layout, N=N, K=K, M=M, G=1, out=out, out_code=out_code,
                   group_rows=None, epi_op=EPI_ADD if accumulate else EPI_STORE, stream=stream, sms=sms,
                   tile_order=tile_order, roles=roles, tile_flags=tile_flags, tile_counts=tile_counts,
                   group_m=max(1, group_m // CLUSTER) if clustered and order == "m" else group_m, num_tiles_host=claims,
                   max_tiles=nt, order=order, cluster=clustered, splits=splits, bn=bn,
                   overlapped=config.get().gemm_overlap and not controls)
    if key is not None:
        _plans.add(key, plan, launched)
    return out


def grouped_tiles_bound(M: int, N: int, G: int) -> int:
    """Upper bound of the tiles of a grouped GEMM of M rows in G groups (tile_flags length)."""
    return (-(-M // BM) + G) * -(-N // BN)


def grouped_gemm(a, b, group_rows, *, out=None, stream=None, b_layout=None, out_dtype=None, accumulate=False,
                 sms=None, tile_order=None, roles=None, tile_flags=None, tile_counts=None, group_m=DEFAULT_GROUP_M):
    """Grouped GEMM: ``out[rows of g] = a[rows of g] @ B[g]`` for G groups sharing K and N.

    a: [M, K], the groups' rows concatenated (group g has group_rows[g] rows, starting after those
    of groups 0..g-1). group_rows: device int32 array of G counts (G <= 128), read by the kernel
    (no host synchronisation); counts are clamped to be >= 0 and to fit in M; rows of ``out`` past
    the sum are not written. b: [G, K, N] by default, or [G, N, K] with b_layout='nk' (a transposed
    view of a contiguous [G, N, K] is recognised). out: [M, N]. Tile ids (flags, tile_order) run
    group after group: base(g) + mt * ceil(N/256) + nt with base(g) = sum of ceil(rows/128) *
    ceil(N/256) over the earlier groups; at most grouped_tiles_bound(M, N, G) of them.
    """
    cupy = cupy_mod()
    _check_device(cupy)
    for x, what in ((a, "a"), (b, "b"), (group_rows, "group_rows")):
        if not isinstance(x, cupy.ndarray):
            raise ArgumentError(f"{what} must be a cupy.ndarray")
    if a.dtype != b.dtype:
        raise ArgumentError(f"a and b must have the same dtype; got {a.dtype} and {b.dtype}")
    if a.ndim != 2 or b.ndim != 3:
        raise ArgumentError(f"a must be [M, K] and b [G, K, N] or [G, N, K]; got {a.shape} and {b.shape}")
    M, K = a.shape
    G = b.shape[0]
    if not 1 <= G <= MAX_GROUPS:
        raise ArgumentError(f"grouped_gemm supports 1..{MAX_GROUPS} groups; got {G}")
    if group_rows.dtype != cupy.int32 or group_rows.shape != (G,) or not group_rows.flags.c_contiguous:
        raise ArgumentError(f"group_rows must be a contiguous int32 array of {G} entries")
    if b_layout is None:
        if b.shape[1] != K:
            raise ArgumentError(f"b has shape {b.shape}; expected [G, K={K}, N] (or b_layout='nk' for [G, N, K])")
        if b.shape[2] > 1 and b.strides[2] != b.itemsize and b.strides[1] == b.itemsize:
            layout, b_arr = B_NK, b.transpose(0, 2, 1)
        else:
            layout, b_arr = B_KN, b
        N = b.shape[2]
    elif b_layout == "kn":
        if b.shape[1] != K:
            raise ArgumentError(f"b_layout='kn' needs b of shape [G, K={K}, N]; got {b.shape}")
        layout, b_arr, N = B_KN, b, b.shape[2]
    elif b_layout == "nk":
        if b.shape[2] != K:
            raise ArgumentError(f"b_layout='nk' needs b of shape [G, N, K={K}]; got {b.shape}")
        layout, b_arr, N = B_NK, b, b.shape[1]
    else:
        raise ArgumentError(f"b_layout must be None, 'kn' or 'nk'; got {b_layout!r}")
    _check_inputs(a, None, K, N)
    check_grouped_b(b_arr)
    out, out_code = _prepare_out(cupy, out, (M, N), a, out_dtype)
    if M == 0 or N == 0:
        return out
    if K == 0:
        raise ArgumentError("grouped_gemm needs K >= 8")
    check_matrix(a, "a", dtypes=None)
    _launch(cupy, a=a, b_arr=b_arr, layout=layout, N=N, K=K, M=M, G=G, out=out, out_code=out_code,
                   group_rows=group_rows.data.ptr, epi_op=EPI_ADD if accumulate else EPI_STORE, stream=stream,
                   sms=sms, tile_order=tile_order, roles=roles, tile_flags=tile_flags, tile_counts=tile_counts,
                   group_m=group_m, num_tiles_host=None, max_tiles=grouped_tiles_bound(M, N, G) if
                   (tile_order is not None or tile_flags is not None or tile_counts is not None) else 0)
    return out
