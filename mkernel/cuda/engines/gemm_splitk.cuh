#pragma once
// Split K for the plain GEMM (mkernel/engines/gemm_plan.py picks MkGemmArgs::splits > 1 when the output
// has too few tiles to fill the SMs and K is long): the scheduler hands out (tile, range of K)
// claims (MkSplitOrder, MkSchedTiles), the mainloop runs the range's k-blocks (gemm_k_range), and
// this epilogue wrapper, warp by warp, stores the warp's 16 x BN fp32 slice of the range's partial
// in split_ws, counts its arrival for (tile, slice), and the last of the ranges to arrive adds the
// ranges' values in range order (all read back, its own too) and hands the sum to the inner
// epilogue: bitwise reproducible, whichever range is last. Warps whose 16 rows lie past M move no
// partial (at 33-64 rows, half the tile). No barrier spans more than one warp.
//
// split_ws: 8 arrival counts per tile (zero between launches: the last arrival resets its count) in
// a fixed region of MK_SPLIT_MAX_TILES tiles, so that no call's partials overlap another call's
// counts, then the partials [tile][range][slice][value 0..NACC-1][lane 0..31] (NACC = BN / 2).
#include "common.cuh"
#include "gemm_args.cuh"
#include "tile_scheduler.cuh"

constexpr u32 MK_SPLIT_MAX_TILES = 128;  // splits >= 2 only where tiles * 2 <= 132 (mkernel/engines/gemm_plan.py)
constexpr u64 MK_SPLIT_COUNTS_BYTES = MK_SPLIT_MAX_TILES * 8u * 4u;

template <class Inner>
struct MkSplitEpilogue {
  const MkGemmArgs& args;
  Inner inner;
  MK_DEV void after_issue() { inner.after_issue(); }
  MK_DEV void comm_turn(const MkTile& t) { inner.comm_turn(t); }
  MK_DEV void finish() { inner.finish(); }

  template <int NACC>
  MK_DEV void operator()(float (&acc)[NACC], const MkTile& t, int wg) {
    if (args.splits <= 1 || reduce(acc, t, wg)) inner(acc, t, wg);
  }

  // Split K: this range's partial out, and in the last range to arrive, acc = the sum of all
  // ranges in range order (true: store it).
  template <int NACC>
  MK_DEV bool reduce(float (&acc)[NACC], const MkTile& t, int wg) {
    constexpr u64 SLICE = NACC * 32;  // floats of one warp's 16 x BN slice
    const u32 S = args.splits;
    const u32 lane = threadIdx.x & 31, slice = (u32)wg * 4 + ((threadIdx.x & 127) >> 5), own = t.pad[0];
    // No row of this warp is in the tile (M's last tile, or a clustered unit's part past M, whose id is
    // MK_TILE_NONE): no partial to move; range 0 alone runs the inner epilogue, which stores nothing.
    if (16 * (i32)slice >= t.rows) return own == 0;
    u8* ws = reinterpret_cast<u8*>(args.split_ws);
    u32* count = reinterpret_cast<u32*>(ws) + (u64)t.id * 8 + slice;
    const float* part = reinterpret_cast<const float*>(ws + MK_SPLIT_COUNTS_BYTES) +
                        ((u64)t.id * S * 8 + slice) * SLICE + lane;  // range r's values: part + r * 8 * SLICE
    float* mine = const_cast<float*>(part) + (u64)own * 8 * SLICE;
#pragma unroll
    for (int i = 0; i < NACC; ++i) __stcg(mine + i * 32, acc[i]);
    __threadfence();
    __syncwarp();
    u32 last = 0;
    if (lane == 0) last = atomicAdd(count, 1u) + 1 == S ? 1u : 0u;
    if (!__shfl_sync(0xffffffffu, last, 0)) return false;
    __threadfence();  // every range's partial (published before its arrival) is visible now
    if (lane == 0) *count = 0;  // zero for the next launch (stream ordered)
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = __ldcg(part + i * 32);  // range 0 (this one's too: reread)
#pragma unroll 1
    for (u32 r = 1; r < S; ++r) {
      const float* pr = part + (u64)r * 8 * SLICE;
#pragma unroll
      for (int i = 0; i < NACC; ++i) acc[i] += __ldcg(pr + i * 32);
    }
    return true;
  }
};
