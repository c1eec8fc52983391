"""The ops' tuning knobs, in one frozen object (``mkernel.config.get()``), read at each call.

Change them for the whole process with :func:`configure`, or for a block with :func:`override`
(tests, benchmarks); every rank of a job must use the same values (the ones that change what
crosses the wire are agreed on with the call's shapes where they matter: the path, the split).
"""

import contextlib
import dataclasses
import types

from mkernel.core.errors import ArgumentError

CONTROLLER_SETTINGS = ("auto", "always", "pattern", "off")


@dataclasses.dataclass(frozen=True)
class Config:
    # Tensor parallel ops (docs/TP.md). Below both crossovers, on distinct GPUs, cupy.matmul + NCCL.
    tp_fuse_min_tiles: int = 32   # output tiles (128 x 256) of the call
    tp_fuse_min_k: int = 512
    # The in-call controller (docs/CONTROLLER.md): "auto" adapts the calls with comm_sms "auto",
    # "always" every fused call, "pattern" lends every odd GEMM CTA (tests), "off" never.
    tp_controller: str = "auto"
    tp_lend_share: int = 2        # it lends at most gemm_ctas / tp_lend_share GEMM CTAs
    # RS / AR: the GEMM CTAs also reduce (AR: forward, gather) after their tiles; "auto": always,
    # but at one rank per node between nodes only where the split model's GEMM time is at least
    # tp_join_min_gemm_share of its link time (else the link is the tail: bench/NOTES.md session 25)
    tp_join_reduce: object = "auto"
    tp_join_min_gemm_share: float = 0.3
    # joined GEMM CTAs stage their loads in the GEMM's A / B stages once their last tile is done
    # (False: 2 vectors a thread in registers, the GEMM CTAs' budget)
    tp_join_staged: bool = True
    # gemm_allreduce in a node at most this many rows: GEMM + one-shot all-reduce (0: never; the
    # crossover with the fused kernel is measured by bench/tp_decode.py: 256 rows ahead, session 42)
    tp_latency_max_rows: int = 256
    # ... and at most this many rows (and B as [N, K]) the fused latency kernels (gemm_allreduce_ll.py;
    # 0: the decode GEMM, then mkernel.allreduce)
    tp_latency_ll_max_rows: int = 64
    # ... their sum kernel launched to overlap the GEMM's last CTAs (programmatic stream
    # serialization; its polls of the LL words need no stream order)
    tp_latency_ll_overlap: bool = False
    # mkernel.allreduce of at most this many bytes moves LL words (data and epoch in one 8-byte
    # store: no fence, no flag round trip; twice the bytes), above it data then a flag per chunk
    # (2 ranks under MPS, graphs: LL ahead at 256 KiB, flags from 1 MiB; bench/NOTES.md session 32)
    allreduce_ll_max_bytes: int = 512 << 10
    # ... and above that limit, messages of at least this many bytes take the two-shot path (each
    # chunk summed by one owner, then copied from it; 0: never) at 3+ ranks, and of at least
    # ..._2ranks at 2 ranks (less HBM traffic there, one more round). Crossovers measured under MPS:
    # bench/NOTES.md sessions 57, 58
    allreduce_twoshot_min_bytes: int = 512 << 10
    allreduce_twoshot_min_bytes_2ranks: int = 8 << 20
    # Communication CTAs where comm_sms is not searched (the unfused baseline, the search's start).
    tp_comm_sms: types.MappingProxyType = dataclasses.field(default_factory=lambda: types.MappingProxyType(
        {"gemm_reduce_scatter": 8, "gemm_allreduce": 16, "allgather_gemm": 8}))
    # allgather_gemm copies this rank's shard into its own gathered rows (cudaMemcpy2DAsync) before
    # the kernel, whose pushes then only flag it and send it on (False: the push CTAs copy it)
    tp_ag_copy_first: bool = True
    # allgather_gemm's push CTAs take GEMM tiles once no push or forward item is left
    tp_ag_join_gemm: bool = True
    # RS / AR between nodes: node partial tiles (64 KiB each) sent in one WRITE (16: 1 MiB; a 64 KiB
    # WRITE ran the host transport at a third of its 1 MiB rate). A shape's plan keeps the value it met.
    tp_send_tiles: int = 16
    # Under MPS the fused TP, ring attention and MoE grids take the client's whole SM share, not 7/8 (any
    # resident subset finishes): in a node, and between nodes but launch.PART_SHARE_BETWEEN_NODES; "always": all
    mps_full_share: object = True
    # communication CTAs (the TP ops', ring attention's forwarders) stage their loads in their idle
    # shared memory (cp.async, copy.cuh MkStage; False: in registers, 4-8 vectors a thread)
    comm_staged: bool = True
    moe_comm_sms: int = 16        # dispatch CTAs of the fused dispatch + GEMM
    # comm CTAs of the fused GEMM + combine (they count rows, sum forwarded tokens): fewer, the GEMM is its tail
    moe_combine_comm_sms: int = 8
    moe_join_gemm: bool = True    # the dispatch CTAs take GEMM tiles once their rows are sent
    moe_sums_group: int = 4       # between nodes, the fused combine's chunks of sums (32 tokens) per WRITE
    # between nodes, a bundle's rows cross in this many WRITEs (1..8; pieces of its tokens sorted by
    # their first expert there), each flagged: a forwarded row waits for its piece, not the whole
    # bundle. A shape's plan keeps the value it met.
    moe_bundle_pieces: int = 8
    ring_comm_sms: int = 2        # ring attention's forwarding CTAs (a step's block is little next to its compute)
    # The split search's prior (mkernel/split/search.py): rates of its cost model.
    cta_gbps: float = 20.0        # bytes loaded + stored per second by one communication CTA
    # ... between nodes, where its copies also wait on the proxy's flags and stages (fitted on the 4
    # between-node rows of bench/results/controller-2rank-mps-2node.json: bench/NOTES.md session 39)
    cta_gbps_nodes: float = 10.0
    nvlink_gbps: float = 365.0    # one direction, inside a node
    transport_gbps: types.MappingProxyType = dataclasses.field(default_factory=lambda: types.MappingProxyType(
        {"host": 20.0, "tcp": 1.5, "verbs": 25.0}))
    gemm_tflops_per_sm: float = 650.0 / 132  # one SM's share of an H100 / H200's GEMM rate (650 TF/s)
    # mkernel.gemm at M up to this (0: never; at most 256) with B as [N, K] takes the decode path
    # (gemm_decode.py; past 64 rows where its runs fill the SMs); above, the engine (split K where
    # its tiles are few).
    gemm_decode_max_m: int = 128
    # The decode path's rows of B per CTA: 64 or 128; 0: by shape (gemm_decode.row_block).
    gemm_decode_rows: int = 0
    # How the decode path cuts its (row block, k-block) units: "even" (each row block in the same
    # number of runs, measured faster: bench/NOTES.md) or "stream" (equal runs over every CTA slot).
    gemm_decode_split: str = "even"
    # mkernel.gemm's plain calls (the decode kernel, the engine's) launched overlapped with the kernel
    # before (programmatic dependent launch: their CTAs start while it ends and wait for it before
    # touching memory); a decode CTA lets the next start after its last wgmma, an engine CTA at entry
    gemm_overlap: bool = False
    # mkernel.gemm splits K when the output has too few 128 x 256 tiles to fill the SMs and K is
    # long (engines/gemm_plan.py split_k); False: one CTA per tile
    gemm_split_k: bool = True
    # Width of mkernel.gemm's tiles where it plans the CTAs: "auto": 192 (narrow: plain, unclustered)
    # where they fill the SMs in fewer waves (engines/gemm_plan.py tile_width), else 256; or 256 / 192
    gemm_tile_n: object = "auto"

    def __post_init__(self):
        if self.tp_controller not in CONTROLLER_SETTINGS:
            raise ArgumentError(f"tp_controller must be one of {CONTROLLER_SETTINGS}; got {self.tp_controller!r}")
        for name in ("tp_fuse_min_tiles", "tp_fuse_min_k", "tp_lend_share", "moe_comm_sms", "moe_combine_comm_sms",
                     "moe_sums_group", "ring_comm_sms", "tp_send_tiles", "gemm_decode_max_m", "tp_latency_max_rows",
                     "tp_latency_ll_max_rows", "allreduce_ll_max_bytes", "allreduce_twoshot_min_bytes",
                     "allreduce_twoshot_min_bytes_2ranks"):
            v = getattr(self, name)
            zero_ok = name.startswith("tp_fuse") or name in ("gemm_decode_max_m", "tp_latency_max_rows",
                                                             "tp_latency_ll_max_rows", "allreduce_ll_max_bytes",
                                                             "allreduce_twoshot_min_bytes",
                                                             "allreduce_twoshot_min_bytes_2ranks")
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if zero_ok else 1):
                raise ArgumentError(f"{name} must be a {'non-negative' if zero_ok else 'positive'} integer; got {v!r}")
        if self.gemm_tile_n not in (256, 192, "auto"):
            raise ArgumentError(f"gemm_tile_n must be 256, 192 or \"auto\"; got {self.gemm_tile_n!r}")
        if self.gemm_decode_split not in ("stream", "even"):
            raise ArgumentError(f"gemm_decode_split must be \"stream\" or \"even\"; got {self.gemm_decode_split!r}")
        if self.gemm_decode_max_m > 256:
            raise ArgumentError(f"gemm_decode_max_m must be at most 256 (the decode path's widest tile); got "
                                f"{self.gemm_decode_max_m!r}")
        if self.moe_bundle_pieces not in range(1, 9) or isinstance(self.moe_bundle_pieces, bool):  # MOE_MAX_PIECES
            raise ArgumentError(f"moe_bundle_pieces must be 1..8; got {self.moe_bundle_pieces!r}")
        if self.gemm_decode_rows not in (0, 64, 128):
            raise ArgumentError(f"gemm_decode_rows must be 0, 64 or 128; got {self.gemm_decode_rows!r}")
        if not (isinstance(self.tp_join_reduce, bool) or self.tp_join_reduce == "auto"):
            raise ArgumentError(f"tp_join_reduce must be True, False or \"auto\"; got {self.tp_join_reduce!r}")
        for name in ("moe_join_gemm", "tp_latency_ll_overlap", "gemm_split_k", "gemm_overlap",
                     "tp_ag_copy_first", "tp_ag_join_gemm", "comm_staged", "tp_join_staged"):
            if not isinstance(getattr(self, name), bool):
                raise ArgumentError(f"{name} must be True or False; got {getattr(self, name)!r}")
        if not (isinstance(self.mps_full_share, bool) or self.mps_full_share == "always"):
            raise ArgumentError(f"mps_full_share must be True, False or \"always\"; got {self.mps_full_share!r}")
        v = self.tp_join_min_gemm_share
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ArgumentError(f"tp_join_min_gemm_share must be a number >= 0; got {v!r}")
        for name in ("tp_comm_sms", "transport_gbps"):  # mappings stay read-only
            object.__setattr__(self, name, types.MappingProxyType(dict(getattr(self, name))))


_current = [Config()]


def get() -> Config:
    """The knobs in force."""
    return _current[0]


def configure(**changes) -> Config:
    """Sets knobs for the rest of the process (every rank alike); returns the new configuration."""
    _current[0] = dataclasses.replace(_current[0], **_checked(changes))
    return _current[0]


@contextlib.contextmanager
def override(**changes):
    """``with mkernel.config.override(tp_controller="pattern"):`` the knobs for the calls inside."""
    old = _current[0]
    _current[0] = dataclasses.replace(old, **_checked(changes))
    try:
        yield _current[0]
    finally:
        _current[0] = old


def _checked(changes):
    names = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(changes) - names)
    if unknown:
        raise ArgumentError(f"unknown configuration field(s) {unknown}; the fields are {sorted(names)}")
    return changes
