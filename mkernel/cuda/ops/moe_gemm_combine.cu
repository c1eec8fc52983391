// The experts' second grouped GEMM fused with combine (mkernel/ops/moe_gemm.py; design: docs/MOE.md).
//
// The first gemm_ctas CTAs to arrive run the GEMM engine in grouped mode (A: y2, B: the experts'
// weights, one group per local expert with the dispatch's group_rows); its epilogue stores every row
// of a tile straight into row t * k + j of the row's source's return buffer (meta word of the
// dispatch; MoeReturnDest, a ROWS destination), after that source's credit, and sets the tile's flag
// (tile_flags[id] = epoch) once its stores are performed. The later arrivals watch the M-tiles in the
// GEMM's order (counters[MOE_CNT_RET]): once every N-tile of one is flagged its rows are back, and are
// counted; a GEMM CTA out of tiles watches too (the M-tiles it claims are then computed or held by
// running CTAs: any resident part of the grid finishes). Once every row is counted, retflag[me] is
// set on every rank. Then every CTA sums its share of this rank's tokens (moe_combine.cuh): the same
// sums, in the same order, as mk_moe_combine_kernel.
// Between nodes (a.send_sums) the M-tiles with forwarded rows go first (moe_tiles.cuh), each one's
// forwarded rows counted at their sources per piece once flagged; a source sums its forwarded tokens
// piece by piece as their rows are back (moe_forward_sums: between M-tiles, then all that is left past
// them), each group of chunks WRITten once summed, while the GEMM goes on with the own-origin rows; the
// final sums then cover this rank's tokens only.
#include "moe_combine.cuh"
#include "moe_tiles.cuh"
#include "moe_gemm_args.cuh"

constexpr u32 MOE_GC_THREADS = 384;  // the GEMM engine's CTA

// The GEMM's epilogue destination: each row of a tile at its return slot (meta: source rank << 24 |
// row t * k + j), on that rank once it entered this epoch (a leader waits once per CTA).
struct MoeReturnDest {
  static constexpr bool ROWS = true;
  const MkGemmArgs& g;
  const MkMoeArgs& a;
  MkPeers peers;
  u32 epoch;
  bool credited = false;  // leader: every rank's credit for this epoch was seen

  MK_DEV const TmaDesc* map(const MkTile&) const { return &g.c; }  // (not used: ROWS)
  MK_DEV i32 row(const MkTile& t) const { return t.m0; }
  MK_DEV u8* row_at(const MkTile& t, i32 r) const {
    const u32 m = ld_cg(peer_ptr<const u32>(peers, (u32)a.me, a.meta_off) + t.m0 + r);
    return peer_ptr<u8>(peers, m >> 24, a.ret_off) + (u64)(m & 0xFFFFFFu) * (u32)a.H * 2u;
  }
  MK_DEV u32* flag(const MkTile& t) const { return g.tile_flags + t.id; }
  MK_DEV bool flags() const { return true; }
  MK_DEV bool add() const { return false; }
  // A rank whose credit never came may be gone: nothing is written into any rank after that.
  MK_DEV bool before_store(const MkTile&) {
    if (!credited) credited = moe_credits_all(a, peers, epoch);
    return credited;
  }
  MK_DEV void published(u32) const {}
  MK_DEV void comm_turn(const MkTile&) const {}
};

// A GEMM CTA's tiles: its producer warpgroup claims them from MoeTiles, its consumers store each
// tile's rows at their return slots and set its flag.
template <class Cfg>
MK_DEV void moe_combine_tiles(const MkMoeArgs& a, const MkGemmArgs& g, const GemmSmem<Cfg>& sm,
                              const MkTileSpace<Cfg::UNIT_M>& space, const MkPeers& peers, u32 epoch) {
  warpgroup_roles<Cfg>(
      [&] {
        MoeTiles<Cfg, false> src{a, space, epoch};
        gemm_producer_loop<Cfg>(g, sm, src);
      },
      [&](int wg) {
        MkTileEpilogue<Cfg::DT, Cfg, true, MoeReturnDest> epi{g, sm, epoch, MoeReturnDest{g, a, peers, epoch}};
        gemm_consumer<Cfg>(g, sm, wg, epi);
        epi.finish();
      });
}

// A watching CTA's shared state (in the dynamic shared memory the GEMM CTAs use for the pipeline).
struct MoeReturnShared {
  MkGroupTable table;
  u32 own[MK_GEMM_MAX_GROUPS];  // between nodes: own-origin rows per group (its first rows)
  u32 fwd[MOE_MAX_WORLD];  // between nodes: forwarded rows of the current M-tile per source
  MoeFwdSums fs;  // between nodes: this rank's forwarded sums
  u32 claim;
  int ok;
  int back;
};

// Watching the returned rows, every CTA (after its GEMM tiles for a GEMM CTA): M-tiles (a group's
// 128-row blocks, in the GEMM's order) claimed one by one; once every N-tile of one is flagged
// (tiles_n flags), its rows are at their sources and are counted there. Between nodes, an M-tile's
// forwarded rows are counted at their sources (per piece); before each claim the CTA sums the
// forwarded chunks already back, and at its first claim past the M-tiles with forwarded rows, every
// chunk left (moe_forward_sums).
template <class Cfg>
MK_DEV void moe_watch_rows(const MkMoeGemmArgs& args, MoeReturnShared& rs, const MkPeers& peers, u32 Ep) {
  const MkMoeArgs& a = args.m;
  const MkGemmArgs& g = args.g;
  const u32 tid = threadIdx.x, W = (u32)a.world, El = (u32)a.e_local;
  const bool nodes = a.send_sums != 0;
  build_group_table<Cfg::BM>(&rs.table, g.group_rows, (u32)g.num_groups, g.m, g.sched.tiles_n);
  const MkTileSpace<Cfg::UNIT_M> space = gemm_tile_space<Cfg>(g, &rs.table);
  if (nodes) {  // own-origin rows per group, from every source's count row; none counted yet
    const u32* counts = peer_ptr<const u32>(peers, (u32)a.me, a.counts_off) + MOE_ROW_OWN(a.E) + (u32)a.me * El;
    for (u32 le = tid; le < El; le += MOE_GC_THREADS) {
      u32 own = 0;
      for (u32 s = 0; s < W; ++s) own += ld_cg(counts + (u64)s * MOE_ROW_WORDS(a.E) + le);
      rs.own[le] = own;
    }
    if (tid < MOE_MAX_WORLD) rs.fwd[tid] = 0;
    moe_fwd_sums_setup(a, peers, rs.fs);
  }
  if (tid == 0) rs.ok = moe_credits_all(a, peers, Ep) ? 1 : 0;  // (retflag is set on every rank below)
  __syncthreads();
  if (!rs.ok) return;
  const u32* meta = peer_ptr<const u32>(peers, (u32)a.me, a.meta_off);
  const u32 tiles_n = space.tiles_n, units = space.num_tiles / tiles_n;  // a group's tiles: M-tiles x tiles_n
  u32 fwd_units = units;  // between nodes the M-tiles with forwarded rows: the first fwd_units claims
  for (u32 le = 0; nodes && le < El; ++le) fwd_units -= rs.own[le] / Cfg::BM;
  bool summed = !nodes;  // past the M-tiles with forwarded rows: every chunk of sums left was taken
  u32 mine = 0;  // rows this CTA counted
  for (;;) {
    if (!summed) moe_forward_sums<Cfg::DT>(a, peers, rs.fs, false, Ep);  // the chunks already back
    if (tid == 0) rs.claim = atomicAdd(&a.counters[MOE_CNT_RET], 1u);
    __syncthreads();
    const u32 unit = rs.claim;
    const u64 t0 = trace_start(a.sync);
    if (!summed && unit >= fwd_units) {
      summed = true;
      moe_forward_sums<Cfg::DT>(a, peers, rs.fs, true, Ep);
    }
    if (unit >= units) break;
    const u32 mt = a.tile_m ? moe_mtile_at(a, units, unit, true) : unit;
    const MkTile t = space.template decode<Cfg::BN>(mt * tiles_n);  // its first N-tile: rows m0 .. m0 + rows
    if (tid == 0) {
      int good = 1;
      for (u32 nt = 0; nt < tiles_n && good; ++nt)
        good = wait_epoch(a.sync, g.tile_flags + t.id + nt, Ep, -1, MOE_WAIT_TILE_STORED + t.id + nt) ? 1 : 0;
      rs.ok = good;
    }
    __syncthreads();
    if (!rs.ok) break;
    const u32 fwd_row =
        nodes ? (u32)space.row_base(t.group) + rs.own[t.group] : ~0u;  // its group's first forwarded row
    if ((u32)t.m0 + (u32)t.rows > fwd_row) {  // its forwarded rows counted at their sources
      for (u32 row = max((u32)t.m0, fwd_row) + tid; row < (u32)t.m0 + (u32)t.rows; row += MOE_GC_THREADS)
        atomicAdd(&rs.fwd[meta[row] >> 24], 1u);
      __syncthreads();
      if (tid == 0) {
        __threadfence_system();  // the flags' acquire before the counts' release at the sources
        const u32 x = (u32)a.me * El + (u32)t.group;  // the M-tile's node expert
        for (u32 s = 0; s < W; ++s)
          if (rs.fwd[s]) atomicAdd(peer_ptr<u32>(peers, s, a.fwdret_off) + moe_row_piece(a, x, s), rs.fwd[s]);
        for (u32 s = 0; s < W; ++s) rs.fwd[s] = 0;
      }
    }
    mine += (u32)t.rows;
    if (tid == 0) trace_span(a.sync, MK_ROLE_INTRA, MOE_TRACE_RETURN | unit, t0);
    __syncthreads();  // rs.claim and rs.ok are read before thread 0 writes them again
  }
  moe_returned(a, peers, mine, (u32)space.row_base(space.num_groups), Ep);
}

template <int DT, int BL>
__global__ void __launch_bounds__(MOE_GC_THREADS, 1)
    mk_moe_gemm_combine_kernel(const __grid_constant__ MkMoeGemmArgs args) {
  using Cfg = GemmCfg<DT, BL>;
  extern __shared__ __align__(1024) u8 mk_smem[];  // no static shared memory (see moe_dispatch_gemm.cu)
  const MkMoeArgs& a = args.m;
  const MkPeers peers = moe_peers(a);
  const GemmSmem<Cfg> sm = gemm_smem_carve<Cfg, true>(mk_smem);
  MoeReturnShared& rs = *reinterpret_cast<MoeReturnShared*>(sm.base);  // below the GEMM's barriers
  const u64 t_in = trace_start(a.sync);
  const u32 arrival = moe_arrival(a, reinterpret_cast<volatile u32*>(sm.base));
  fence_proxy_async_smem();  // that word's generic use before the stages' TMA loads
  u32 epoch;
  if (arrival < (u32)args.gemm_ctas) {
    const MkTileSpace<Cfg::UNIT_M> space = gemm_setup<Cfg, true>(args.g, sm);  // the group table of group_rows
    epoch = sm.bars->epoch;
    if (arrival == 0 && threadIdx.x == 0) {
      credits_announce(peers, epoch);  // this rank entered the epoch
      if (a.send_sums) moe_sums_route(a).credit(epoch);  // this rank's precv is free (its sums were read)
      trace_span(a.sync, MK_ROLE_CONTROL, MOE_TRACE_ANNOUNCE | epoch, t_in);
    }
    moe_combine_tiles<Cfg>(a, args.g, sm, space, peers, epoch);
    warpgroup_rejoin<MOE_GC_THREADS>();
    fence_proxy_async_smem();  // the pipeline's async-proxy use of the stages before generic use
    __syncthreads();
    if (threadIdx.x == 0) trace_span(a.sync, MK_ROLE_COMPUTE, MOE_TRACE_GEMM | arrival, t_in);
  } else {
    epoch = launch_epoch(a.sync);
  }
  moe_watch_rows<Cfg>(args, rs, peers, epoch);
  moe_weighted_sum<DT>(a, peers, a.send_sums ? (u32)a.T : moe_tokens(a), blockIdx.x, gridDim.x, threadIdx.x,
                       MOE_GC_THREADS, MkBarCta(), &rs.back, epoch);
  __syncthreads();
  if (threadIdx.x == 0 && counters_reset_by_last_block(a.counters, MOE_CNT_WORDS, MOE_CNT_DONE) && a.send_sums) {
    for (u32 q = 0; q < MOE_MAX_PIECES; ++q)  // every count of this launch is in (or it failed)
      peer_ptr<u32>(peers, (u32)a.me, a.fwdret_off)[q] = 0;
    for (u32 g = 0; g < rs.fs.grp0[rs.fs.cells]; ++g) a.fwdgrp[g] = 0;
  }
  if (threadIdx.x == 0) trace_span(a.sync, MK_ROLE_CONTROL, MOE_TRACE_EXIT | blockIdx.x, t_in);
  launch_exit(a.sync, epoch);
}

static_assert(gemm_smem_bytes<GemmCfg<0, 0>, true>() == 231768, "update gemm.SMEM_GROUPED");
static_assert(sizeof(MoeReturnShared) <= GemmCfg<0, 0>::OFF_BAR,
              "a watching CTA's state lies below the GEMM's barriers");
