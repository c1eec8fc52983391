#pragma once
// The fused MoE GEMMs' tile order and tile source (moe_dispatch_gemm.cu, moe_gemm_combine.cu): the
// engine's grouped order (expert by expert), or between nodes (a.tile_m) the M-tiles in the
// dispatch's tile_order, read forward by the dispatch's GEMM (every group's own-origin-only M-tiles
// first: their rows are here while the forwarded ones cross the network) and backward by the
// combine's (M-tiles holding forwarded rows first: their sums cross it). docs/MOE.md "Overlap".
#include "moe_dispatch.cuh"
#include "gemm_mainloop.cuh"
#include "gemm_epilogue.cuh"

// Between nodes, tile_order's word at index u (of mtiles) of a fused GEMM's claim order (written
// before the dispatch's verdict, read past L1), and its M-tile.
MK_DEV u32 moe_order_at(const MkMoeArgs& a, u32 mtiles, u32 u, bool backward) {
  return ld_cg(a.tile_order + (backward ? mtiles - 1u - u : u));
}
MK_DEV u32 moe_mtile_at(const MkMoeArgs& a, u32 mtiles, u32 u, bool backward) {
  return moe_order_at(a, mtiles, u, backward) & 0xFFFFFFu;
}

// Between nodes, the tile id at claim position pos: the order's blocks (at most MOE_TILE_BLOCK M-tiles
// of one group), N-tile by N-tile inside a block: CTAs running together share B's columns, and a
// block never reads two groups' B. Positions [first * tn, (first + n) * tn) are its block's.
template <class Space>
MK_DEV u32 moe_tile_id(const MkMoeArgs& a, const Space& space, u32 pos, bool backward) {
  const u32 tn = space.tiles_n, mtiles = space.num_tiles / tn, u = pos / tn;
  const u32 w = moe_order_at(a, mtiles, u, backward), n = w >> 28, off = (w >> 24) & 15u;
  const u32 first = backward ? u - (n - 1u - off) : u - off;  // backward: the block reversed, u its off-th last
  const u32 r = pos - first * tn;
  return moe_mtile_at(a, mtiles, first + r % n, backward) * tn + r / n;
}

// The tile source. DISPATCH: before a tile's loads, the arrival flags of the (class, source, expert)
// blocks its rows come from, then a proxy fence so that the TMA (async proxy) sees the rows the
// senders stored; the combine's rows (y2) are all there at launch.
template <class Cfg, bool DISPATCH>
struct MoeTiles {
  const MkMoeArgs& a;
  const MkTileSpace<Cfg::UNIT_M>& space;
  u32 epoch;
  MK_DEV u32 claim() const { return atomicAdd(&a.counters[MOE_CNT_TILE], 1u); }
  MK_DEV bool done(u32 pos) const { return pos >= space.num_tiles; }
  MK_DEV MkTile decode(u32 pos) const {
    return space.template decode<Cfg::BN>(a.tile_m ? moe_tile_id(a, space, pos, !DISPATCH) : space.builtin_id(pos));
  }
  MK_DEV void before_loads(const MkTile& t) const {
    if (!DISPATCH) return;
    const MkPeers peers = moe_peers(a);
    const u32 W = (u32)a.world, me = (u32)a.me, El = (u32)a.e_local, g = (u32)t.group, RW = MOE_ROW_WORDS(a.E);
    const u32* counts = peer_ptr<const u32>(peers, me, a.counts_off) + me * El + g;
    const u32* eflag = peer_ptr<const u32>(peers, me, a.eflag_off) + g;
    const u32 r0 = (u32)(t.m0 - space.row_base(g)), r1 = r0 + (u32)t.rows;  // the tile's rows in its group
    u32 first = 0;  // block b = (class, source)'s rows of the group: [first, first + n); own-origin ones first
    for (u32 b = 0; b < 2 * W && first < r1; ++b) {
      const u32* row = counts + (u64)(b < W ? b : b - W) * RW;
      const u32 own = ld_cg(row + MOE_ROW_OWN(a.E));
      const u32 n = b < W ? own : ld_cg(row) - own;
      if (n != 0 && first + n > r0) wait_epoch(a.sync, eflag + b * El, epoch, (i32)(b % W), MOE_WAIT_EXPERT + g);
      first += n;  // on a timeout the error is recorded; the tile is computed from whatever is there
    }
    fence_proxy_async_global();
  }
  MK_DEV i32 b_index(const MkTile& t) const { return t.group; }
};

// A GEMM CTA's tiles: its producer warpgroup claims them from MoeTiles, its consumers store each by
// TMA and set its flag (g.tile_flags, when set).
template <class Cfg, bool DISPATCH>
MK_DEV void moe_gemm_tiles(const MkGemmArgs& g, const MkMoeArgs& a, const GemmSmem<Cfg>& sm,
                           const MkTileSpace<Cfg::UNIT_M>& space, u32 epoch) {
  warpgroup_roles<Cfg>(
      [&] {
        MoeTiles<Cfg, DISPATCH> src{a, space, epoch};
        gemm_producer_loop<Cfg>(g, sm, src);
      },
      [&](int wg) {
        MkTmaEpilogue<Cfg::DT, Cfg, true> epi{g, sm, epoch, MkGemmDest{g}};
        gemm_consumer<Cfg>(g, sm, wg, epi);
        epi.finish();
      });
}
