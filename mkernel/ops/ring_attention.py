"""Ring attention: ``ring_attention`` (design: docs/RING_ATTENTION.md).

Sequence parallelism: each rank holds ``S_local`` rows of the sequence and attends its queries to
every rank's keys and values. One persistent kernel (``mkernel/cuda/ops/ring_attention.cu``): most CTAs
run the attention engine (``mkernel.attention``'s kernel) over tiles (step, batch, head, query
block), step s against the key/value block of rank (me - s) mod world; a few CTAs forward each
block to the next rank (two receive slots in the symmetric workspace, flow-controlled by per-step
flags) while the others compute: over NVLink inside a node; between nodes the ring is node-major
and a node's last rank sends through ``comm.proxy`` to the next node's first. Partial results
merge in fp32 by the log-sum-exp rule, in step order, so results are bitwise reproducible.

Layout: causal attention uses the zigzag layout (``mkernel.shard_sequence(x, rank, world,
causal=True)``): the global sequence in 2 * world chunks, rank r holding chunks r and
2 * world - 1 - r, so every rank has the same causal work. Non-causal: any split (contiguous).

Verified with 2 to 6 ranks sharing one GPU, inside a node and as emulated nodes (correctness);
see README for what ran where.
"""

import ctypes

from mkernel.comm import proxy as _proxy
from mkernel.comm.communicator import Communicator
from mkernel.core import config
from mkernel.core.errors import ArgumentError
from mkernel.engines import attention as _attn
from mkernel.engines import gemm as _gemm
from mkernel.ops import buffers as _buffers
from mkernel.ops import calls as _calls
from mkernel.runtime import compile as _compile
from mkernel.runtime import launch
from mkernel.runtime import tma as _tma
from mkernel.runtime.arrays import as_cupy
from mkernel.runtime.launch import launch_persistent, persistent_grid

MAX_WORLD = 8             # RING_MAX_WORLD
CNT_WORDS = 2 + 3 * MAX_WORLD
FLAG_WORDS = 2 * MAX_WORLD
CHUNK_BYTES = 256 << 10   # bytes of K (and as many of V) per forwarding chunk
PF_CHUNK = 1 + 2 * MAX_WORLD  # RING_PF_CHUNK: the first chunk-arrival flag of the proxy flags
PROXY_CHUNK_FLAGS = 1024  # chunk-arrival flags of one plan (steps x chunks): sets the chunk size


def kernel_expr(dt: int, d: int, causal: bool) -> str:
    return f"mk_ring_attention_kernel<{dt},{d},{'true' if causal else 'false'}>"


EXPRESSIONS = tuple(kernel_expr(dt, d, c) for dt in (0, 1) for d in _attn.HEAD_DIMS for c in (False, True))
SPEC = _compile.register("ring_attention", "ring_attention.cu", EXPRESSIONS, hot=True)


class MkRingArgs(ctypes.Structure):
    """Mirror of ``MkRingArgs`` (mkernel/cuda/ops/ring_args.cuh); 1536 bytes, 64-byte aligned in C."""
    _fields_ = [("a", _attn.MkAttnArgs), ("k_slot", _tma.TensorMap * 2), ("v_slot", _tma.TensorMap * 2),
                ("peer_base", ctypes.c_void_p), ("kslot_off", ctypes.c_uint64 * 2),
                ("vslot_off", ctypes.c_uint64 * 2), ("flags_off", ctypes.c_uint64), ("k_own", ctypes.c_void_p),
                ("v_own", ctypes.c_void_p), ("own_stride_b", ctypes.c_int64), ("own_stride_s", ctypes.c_int64),
                ("o_acc", ctypes.c_void_p), ("m_acc", ctypes.c_void_p), ("l_acc", ctypes.c_void_p),
                ("tile_flags", ctypes.c_void_p), ("counters", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("out_stride_b", ctypes.c_int64), ("out_stride_s", ctypes.c_int64), ("world", ctypes.c_int32),
                ("me", ctypes.c_int32), ("attn_ctas", ctypes.c_int32), ("zigzag", ctypes.c_int32),
                ("tiles_per_step", ctypes.c_uint32), ("chunk_rows", ctypes.c_uint32),
                ("queue", _proxy.QueueArgs), ("pflags", ctypes.c_void_p), ("stage_off", ctypes.c_uint64),
                ("next_remote", ctypes.c_int32), ("prev_remote", ctypes.c_int32), ("chunks", ctypes.c_uint32),
                ("chunk_bytes", ctypes.c_uint32), ("kv_bytes", ctypes.c_uint64), ("local", ctypes.c_int32),
                ("lrank", ctypes.c_int32), ("comm_staged", ctypes.c_int32), ("src0_rows", ctypes.c_uint32),
                ("pad", ctypes.c_uint32 * 8)]


def _rows_contiguous(x):
    """[B, S, H, D]: each (b, s) row of H * D elements is contiguous."""
    B, S, H, D = x.shape
    return (D == 1 or x.strides[3] == x.itemsize) and (H == 1 or x.strides[2] == D * x.itemsize)


def ring_attention(q, k, v, *, comm, causal=False, softmax_scale=None, return_lse=False, out=None, stream=None,
                   comm_sms=None):
    """Attention of this rank's queries against every rank's keys and values.

    q: ``[S_local, H_q, D]`` or ``[B, S_local, H_q, D]``; k, v: ``[S_local, H_kv, D]`` (or with B);
    bfloat16 or float16; D 64 or 128; H_q % H_kv == 0. The same shapes on every rank. The local
    rows are this rank's part of the sequence: causal=True expects the zigzag layout
    (``mkernel.shard_sequence(x, rank, world, causal=True)``; S_local even) and masks by global
    position; causal=False takes any split. Returns out ``[S_local, H_q, D]`` (q's shape and
    dtype), or ``(out, lse)`` with lse float32 ``[B, H_q, S_local]`` (``[H_q, S_local]`` for 3-D).
    comm_sms: forwarding CTAs (default: config.ring_comm_sms, 2). Collective: every rank calls it with
    the same shapes.
    """
    c = _check(comm, q, k, v, out, stream, causal, softmax_scale, comm_sms)
    if comm.size == 1:  # the same checks at every world size, then the engine on the one block
        return _attn.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                               out=out, stream=stream)
    out, lse = _launch(comm, _plan(comm, c), c, return_lse, stream)
    if return_lse:
        return out, (lse[0] if c.q.ndim == 3 else lse)
    return out


class _Call:
    """One call's checked arguments (4-D views q4, k4, v4; ``out`` as given or None)."""
    __slots__ = ("q", "q4", "k4", "v4", "out", "causal", "scale", "comm_sms")

    def __init__(self, **fields):
        for name, value in fields.items():
            setattr(self, name, value)


def _check(comm, q, k, v, out, stream, causal, softmax_scale, comm_sms):
    """Typed errors before anything launches; the shapes and options, agreed by every rank."""
    import cupy

    if not isinstance(comm, Communicator):
        raise ArgumentError(f"ring_attention needs comm= an mkernel Communicator (mkernel.init()); got "
                            f"{type(comm).__name__}")
    W = comm.size
    _calls.check_node_major("ring_attention", comm)  # the ring follows the ranks
    if W > MAX_WORLD:
        raise ArgumentError(f"ring_attention: at most {MAX_WORLD} ranks; this communicator has {W}")
    if comm_sms is None:
        comm_sms = config.get().ring_comm_sms
    if not isinstance(comm_sms, int) or isinstance(comm_sms, bool) or comm_sms < 1:
        raise ArgumentError(f"ring_attention: comm_sms must be a positive integer; got {comm_sms!r}")
    _attn._check_device(cupy)
    q, k, v = (as_cupy(x, n, stream=stream) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    if out is not None:
        out = as_cupy(out, "out", stream=stream)
    q4, k4, v4 = _attn._check(cupy, q, k, v, out, None, None)
    B, S, Hq, D = q4.shape
    Hkv = k4.shape[2]
    if k4.shape[1] != S:
        raise ArgumentError(f"ring_attention: q and k/v must hold the same local rows; got {S} and {k4.shape[1]}")
    if causal and S % 2:
        raise ArgumentError(f"ring_attention: causal attention takes the zigzag layout (two chunks per rank), so "
                            f"S_local must be even; got {S}")
    if out is not None and W > 1 and not _rows_contiguous(_attn._as4d(out, "out")):
        raise ArgumentError("ring_attention: out's (head, dim) part must be contiguous")
    scale = float(softmax_scale) if softmax_scale is not None else D ** -0.5
    if W > 1:
        key = ("ring_attention", B, S, Hq, Hkv, D, q.dtype.str, bool(causal), scale, comm_sms)
        comm.agree(key, key)
        if not (_rows_contiguous(k4) and _rows_contiguous(v4) and k4.strides == v4.strides):
            k4, v4 = cupy.ascontiguousarray(k4), cupy.ascontiguousarray(v4)  # the forwarders copy whole rows
    return _Call(q=q, q4=q4, k4=k4, v4=v4, out=out, causal=bool(causal), scale=scale, comm_sms=comm_sms)


def _plan(comm, c):
    """(plan, launch template) of this shape (the plan: buffers.plan_buffers, cached in comm.plans, built
    collectively): the receive slots and this rank's fp32 accumulators in the scratch, flags in
    symmetric memory, tile flags and scheduler words in device memory, and every argument but the
    call's q, k, v, out and lse. Between nodes (remote) also a staging copy of this rank's own block
    (a WRITE source must lie in a registered region)."""
    import cupy

    B, S, Hq, D = c.q4.shape
    k4 = c.k4
    Hkv = k4.shape[2]
    remote = comm.num_nodes > 1  # the ranks at a node's ends send / receive blocks through the proxy
    kv_shape = (2, B, S, Hkv, D)  # one buffer per slot: K then V (one range for WRITEs between nodes)
    f32 = cupy.float32
    sizes = [("slot0", kv_shape, k4.dtype), ("slot1", kv_shape, k4.dtype), ("flags", (FLAG_WORDS,), cupy.uint32),
             ("o_acc", (B, S, Hq, D), f32), ("m_acc", (B, Hq, S), f32), ("l_acc", (B, Hq, S), f32)]
    if remote:
        sizes.append(("stage", kv_shape, k4.dtype))
    plan = _buffers.plan_buffers("ring_attention", comm, ("buffers", "ring_attention", B, S, Hq, Hkv, D, k4.dtype.name),
                                 sizes, {"counters": CNT_WORDS})
    if "tiles" not in plan:  # first use of this shape
        tiles = B * Hq * -(-S // _attn.BLOCK_M)
        plan["tile_flags"] = cupy.zeros(2 * tiles, dtype=cupy.uint32)
        plan["sched"] = cupy.zeros(4, dtype=cupy.uint32)  # tile_counter, done_count
        plan["tiles"] = tiles
        if remote:  # (starts the proxy on first use: collective, like this whole branch)
            plan["pflags"] = comm.proxy_flag_block(PF_CHUNK + PROXY_CHUNK_FLAGS)
        cupy.cuda.runtime.deviceSynchronize()
    key = (c.causal, c.scale, c.comm_sms, launch.full_share(comm, "ring_attention"))  # attn_ctas follows the grid
    return plan, _buffers.launch_template(plan, key, lambda: _static_args(comm, plan, c))


def _static_args(comm, plan, c):
    B, S, Hq, D = c.q4.shape
    k4 = c.k4
    Hkv = k4.shape[2]
    W, me, node_of = comm.size, comm.rank, comm.topology.node_of  # the ring's order is the ranks' (node-major)
    r = MkRingArgs()
    a = r.a
    sched = plan["sched"].data.ptr
    a.sched = _gemm.MkGemmSched(None, sched, sched + 4, None, W * plan["tiles"], 0, 0, 0)
    a.batch, a.heads_q, a.heads_kv, a.seq_q, a.seq_kv = B, Hq, Hkv, S, S
    a.q_blocks = -(-S // _attn.BLOCK_M)
    a.scale, a.scale_log2 = c.scale, c.scale * _attn.LOG2E
    half = S // 2
    a.qpos = (_attn.MkAttnPos(half, me * half, (2 * W - 1 - me) * half - half, 0) if c.causal
              else _attn.positions(me * S))
    a.kpos = a.qpos  # (per step in the kernel; this one only fills the end-of-work tile)
    half_bytes = B * S * Hkv * D * k4.itemsize  # one of K or V
    for i in range(2):
        slot = plan[f"slot{i}"]
        r.k_slot[i], r.v_slot[i] = _attn._tensor_map(slot[0], _attn.BLOCK_N), _attn._tensor_map(slot[1], _attn.BLOCK_N)
        r.kslot_off[i] = comm.offset_of(slot)
        r.vslot_off[i] = r.kslot_off[i] + half_bytes
    r.peer_base = comm.peer_table.data.ptr
    r.flags_off = comm.offset_of(plan["flags"])
    r.o_acc, r.m_acc, r.l_acc = plan["o_acc"].data.ptr, plan["m_acc"].data.ptr, plan["l_acc"].data.ptr
    r.tile_flags, r.counters = plan["tile_flags"].data.ptr, plan["counters"].data.ptr
    grid = _grid(comm, c)
    r.world, r.me, r.attn_ctas, r.zigzag = W, me, grid - min(c.comm_sms, grid - 1), int(c.causal)
    r.local, r.lrank = comm.local_size, comm.local_rank
    r.tiles_per_step = plan["tiles"]
    r.chunk_rows = max(1, CHUNK_BYTES // (Hkv * D * k4.itemsize))
    r.src0_rows = rows_sent_of_rank0(B, S, c.causal)
    if comm.num_nodes > 1:
        base = plan["pflags"].offset
        r.queue = comm.proxy_queue_args(flag_base=base)
        r.pflags = comm.proxy_flags[0] + 4 * base
        r.stage_off = comm.offset_of(plan["stage"])
        r.next_remote = int(node_of[(me + 1) % W] != comm.node)
        r.prev_remote = int(node_of[(me - 1) % W] != comm.node)
        r.kv_bytes = 2 * half_bytes
        r.chunk_bytes, r.chunks = remote_chunks(half_bytes, W)
    return r


def rows_sent_of_rank0(B, S, causal):
    """Rows (b, s) of rank 0's key/value block that travel the ring (ring_rows_sent): under the
    zigzag with one batch only its first chunk's key blocks, since its second chunk (the sequence's
    last positions) is seen by rank 0's own queries only; else all."""
    return min(S, -(-(S // 2) // _attn.BLOCK_N) * _attn.BLOCK_N) if causal and B == 1 else B * S


def remote_chunks(half_bytes, world):
    """(chunk bytes, WRITEs of a whole block) between nodes: K's bytes in chunks, then V's; a chunk of
    at least 2 * CHUNK_BYTES, the flags of world - 1 steps within PROXY_CHUNK_FLAGS."""
    per_half = PROXY_CHUNK_FLAGS // (world - 1) // 2
    chunk = -(-max(2 * CHUNK_BYTES, -(-half_bytes // per_half)) // 16) * 16
    return chunk, 2 * -(-half_bytes // chunk)


def _grid(comm, c):
    """CTAs of the launch (cached): roles go by arrival and tiles are claimed, so any resident
    subset finishes; under MPS the whole share (launch.full_share)."""
    return persistent_grid(_function(c), _attn.THREADS, _attn.SMEM[c.q4.shape[3]], what="ring_attention",
                           full_share=launch.full_share(comm, "ring_attention"))


def _function(c):
    D = c.q4.shape[3]
    return _compile.module(SPEC).function(kernel_expr(_attn.DT[c.q.dtype.name], D, c.causal))


def _launch(comm, planned, c, return_lse, stream):
    """This call's q, k, v, out and lse into a copy of the template; between nodes the staging copy
    of the own block; the launch. Returns (out, lse or None)."""
    import cupy

    q4, k4, v4 = c.q4, c.k4, c.v4
    B, S, Hq, D = q4.shape
    out = c.out if c.out is not None else cupy.empty(c.q.shape, dtype=c.q.dtype)
    o4 = _attn._as4d(out, "out")
    lse = cupy.empty((B, Hq, S), dtype=cupy.float32) if return_lse else None
    plan, template = planned
    r = MkRingArgs.from_buffer_copy(template["args"])
    a = r.a
    maps = (("q", q4, _attn.BLOCK_M), ("k", k4, _attn.BLOCK_N), ("v", v4, _attn.BLOCK_N), ("o", o4, 64))
    for role, x, box in maps:
        setattr(a, role, _buffers.operand_map(template, role, (x.data.ptr, x.strides),
                                         lambda x=x, box=box: _attn._tensor_map(x, box)))
    a.sync = comm.sync_args("ring_attention")
    a.lse = lse.data.ptr if lse is not None else None
    r.k_own, r.v_own = k4.data.ptr, v4.data.ptr
    r.own_stride_b = k4.strides[0] if B > 1 else S * k4.shape[2] * D * k4.itemsize
    r.own_stride_s = k4.strides[1] if S > 1 else k4.shape[2] * D * k4.itemsize
    r.out = o4.data.ptr
    r.comm_staged = int(config.get().comm_staged)
    r.out_stride_b = o4.strides[0] // o4.itemsize if B > 1 else S * Hq * D
    r.out_stride_s = o4.strides[1] // o4.itemsize if S > 1 else Hq * D
    if r.next_remote:  # only a rank sending across reads the staged block
        stage = plan["stage"]
        # a CuPy copy: its first use loads a module, which must not happen behind a launch of ours
        _calls.quiesced_first_use(comm, plan, ("stage copy", k4.dtype.str, k4.strides, v4.strides))
        with _calls.on_stream(stream):  # the block of step 0 must lie in a registered region
            stage[0][...] = k4
            stage[1][...] = v4
    fn = _function(c)
    launch_persistent(fn, (_grid(comm, c),), (_attn.THREADS,), r, smem=_attn.SMEM[D], stream=stream)
    return out, lse
