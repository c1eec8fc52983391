"""The GEMM engine's plan of a shape: its tiles, what the scheduler claims, split K's ranges, the
tile width and the clustered kernel (docs/GEMM.md: the shape-to-path choice). Functions of the shape
and the config knobs only, so that the sums (and the bits) do not depend on the SMs a launch gets.
"""

from mkernel.core import config
from mkernel.core.errors import ArgumentError

BM, BN, BK = 128, 256, 64  # the kernel's tile: rows x columns x elements of K a stage
CLUSTER = 2  # CTAs per cluster of mk_gemm_cluster_kernel (MK_GEMM_CLUSTER in gemm.cu)

# Where use_cluster() picks the clustered kernel: at least 2 M-tiles (a unit's second tile is not all
# padding) and K of at least CLUSTER_MIN_K (below it a pair's CTAs wait on each other's epilogue; bench/NOTES.md),
# or rows of A or B not a multiple of 128 bytes (each box row then straddles two L2 lines, and the
# pairs halve B's reads) and at least CLUSTER_MISALIGNED_MIN_TILES tiles (a full wave).
CLUSTER_MIN_TILES_M = 2
CLUSTER_MIN_K = 2560
CLUSTER_MISALIGNED_MIN_TILES = 132
# Split K runs in pairs where a pair's range holds at least this many k-blocks: 224 gained 5%, 56-64
# lost 1.5% (256 rows, bench/NOTES.md session 34).
CLUSTER_SPLIT_MIN_KBLOCKS = 128
ROW_LINE = 128  # bytes of an L2 line


# The narrow tiles (128 x BN_NARROW, module gemm_narrow): plain mode, unclustered, no controls, where
# they fill the SMs in fewer waves (tile_width). A k-block of them costs NARROW_KBLOCK_COST of a
# 256-wide one (the A box and the issue do not shrink; one wave each: 0.80-0.81 measured, session 38).
BN_NARROW = 192
NARROW_KBLOCK_COST = 0.8
NARROW_MIN_GAIN = 0.9  # tile_width takes the narrow tiles where their estimate is below this share


def default_ctas(num_tiles: int, num_sms: int) -> int:
    """CTAs of a launch given all SMs: the fewest that keep the same number of waves (132 SMs and
    2048 tiles: 16 waves either way, so 128 CTAs; the 4 SMs left over are free for other work)."""
    waves = -(-num_tiles // num_sms)
    return -(-num_tiles // waves)


def tiles(M: int, N: int, bn: int = BN) -> int:
    """Output tiles of an M x N GEMM, 128 x bn each (at the default bn: the length of tile_order /
    tile_flags)."""
    return -(-M // BM) * -(-N // bn)


def units(M: int, N: int, cluster: bool, bn: int = BN) -> int:
    """What the scheduler claims (before split K's ranges): tiles, or clustered, units of CLUSTER M-tiles."""
    return -(-M // (BM * CLUSTER)) * -(-N // bn) if cluster else tiles(M, N, bn)


SPLIT_SMS = 132  # split K is planned for this many SMs whatever the device: the bits follow the shape
SPLIT_MIN_KBLOCKS = 8  # k-blocks (of BK) a range keeps at least: its pipeline still fills
SPLIT_MAX = 16
SPLIT_COUNTS_BYTES = 4096  # MK_SPLIT_COUNTS_BYTES: counts of up to 128 tiles, a fixed region for every call


def split_k(M: int, N: int, K: int, cluster: bool = False, bn: int = BN) -> int:
    """Ranges of K per tile of a plain GEMM (config.gemm_split_k): enough (tile, range) claims (or
    clustered, (unit of CLUSTER M-tiles, range) claims of CLUSTER CTAs each) to fill SPLIT_SMS SMs
    once, each at least SPLIT_MIN_KBLOCKS k-blocks, none empty; 1: no split."""
    if not config.get().gemm_split_k:
        return 1
    kblocks = -(-K // BK)
    ctas = units(M, N, cluster, bn) * (CLUSTER if cluster else 1)
    want = min(SPLIT_SMS // ctas, kblocks // SPLIT_MIN_KBLOCKS, SPLIT_MAX)
    if want < 2:
        return 1
    return -(-kblocks // -(-kblocks // want))  # ranges of ceil(kblocks / want): the last not empty


def split_bytes(M: int, N: int, splits: int, bn: int = BN) -> int:
    """Bytes of split K's buffer (gemm_splitk.cuh): the counts' fixed region, then the fp32 partials."""
    nt = tiles(M, N, bn)
    assert nt * 8 * 4 <= SPLIT_COUNTS_BYTES, nt  # split_k: tiles <= SPLIT_SMS // 2
    return SPLIT_COUNTS_BYTES + nt * splits * BM * bn * 4


def _wave_cost(M: int, N: int, K: int, bn: int) -> float:
    """A plain GEMM's time in the wave model: k-blocks on the busiest of SPLIT_SMS SMs (split K as
    planned), a narrow k-block counted as NARROW_KBLOCK_COST of a wide one."""
    splits = split_k(M, N, K, bn=bn)
    kblocks = -(-K // BK)
    per = -(-kblocks // splits)
    return -(-tiles(M, N, bn) * splits // SPLIT_SMS) * per * (1.0 if bn == BN else NARROW_KBLOCK_COST)


def tile_width(M: int, N: int, K: int) -> int:
    """BN of a plain GEMM's tiles where the engine plans the CTAs (config.gemm_tile_n: 256, 192, or
    "auto": BN_NARROW where the wave model puts it below NARROW_MIN_GAIN of the 256-wide plan)."""
    setting = config.get().gemm_tile_n
    if setting != "auto":
        return int(setting)
    narrow = _wave_cost(M, N, K, BN_NARROW) < NARROW_MIN_GAIN * _wave_cost(M, N, K, BN)
    return BN_NARROW if narrow else BN


def use_cluster(M: int, N: int, K: int, cluster=None, *, tile_order=None, roles=None, sms=None,
                aligned: bool = True) -> bool:
    """Whether a plain GEMM runs the clustered kernel (pairs of CTAs sharing each B tile through
    TMA multicast). cluster=None decides by shape (and by ``aligned``: the rows of A and B are
    multiples of 128 bytes), and only where the caller left the CTAs to the engine (no sms,
    tile_order or roles: the fused ops' controls address single tiles and CTAs) and where split K
    does not apply, or splits the pairs as finely into ranges of at least CLUSTER_SPLIT_MIN_KBLOCKS
    (split K fills the SMs; long ranges of pairs share B's loads too); True / False force it."""
    if cluster is None:
        wide = K >= CLUSTER_MIN_K or (not aligned and tiles(M, N) >= CLUSTER_MISALIGNED_MIN_TILES)
        kblocks, plain = -(-K // BK), split_k(M, N, K)
        per = -(-kblocks // split_k(M, N, K, cluster=True))  # k-blocks of a pair's range
        return (tile_order is None and roles is None and sms is None and -(-M // BM) >= CLUSTER_MIN_TILES_M
                and wide and (plain == 1 or per <= -(-kblocks // plain) and per >= CLUSTER_SPLIT_MIN_KBLOCKS))
    if cluster and (tile_order is not None or roles is not None):
        raise ArgumentError("cluster=True cannot take tile_order or roles (they address single tiles and CTAs)")
    return bool(cluster)


SCHED_BY_N, SCHED_OWN_FIRST = 1, 2  # MkGemmSched.flags (MK_SCHED_BY_N, MK_SCHED_OWN_FIRST in gemm_args.cuh)


def sched_flags(order: str, roles: bool, grid: int, resident: int) -> int:
    """MkGemmSched.flags of a launch: the N-grouped built-in order (order "n"), and first tiles by CTA
    index where no role word moves CTAs and all `grid` CTAs run at once (`resident`:
    launch.sm_count(); under an MPS share's margin a CTA that starts late would run its tile last)."""
    return (SCHED_BY_N if order == "n" else 0) | (SCHED_OWN_FIRST if not roles and grid <= resident else 0)
