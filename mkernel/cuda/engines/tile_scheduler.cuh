#pragma once
// The persistent tile scheduler of the GEMM engine.
//
// Tile ids. Output tiles are BM x BN (128 x 256). In plain mode tile id = mt * tiles_n + nt. In
// grouped mode the groups' tiles are laid end to end: id = tile_base[g] + mt * tiles_n + nt with
// tile_base[g] = sum over h < g of ceil(rows[h] / BM) * tiles_n. Per-tile flags are indexed by id.
//
// Order. The order in which tiles run is a list of positions 0..num_tiles-1 mapped to tile ids:
// either MkGemmSched::tile_order[pos] (a device array the fused op fills with the tiles a peer
// needs first) or the built-in order, which walks each group in blocks of group_m M-tiles, N-tile
// by N-tile inside a block (so that the CTAs running at one time share A rows and B columns in L2).
//
// Claiming. A CTA claims the next position with one atomicAdd on tile_counter (with
// MK_SCHED_OWN_FIRST its first position is its index: sched_next_own_first), at tile boundaries only, so CTAs may join or leave GEMM work at any time: before each claim it reads
// its role word (roles[blockIdx.x]); a CTA whose word is not MK_SCHED_GEMM claims nothing until
// the word says GEMM again (sched_try_next returns MK_TILE_YIELD, which a fused kernel answers by
// doing other work). The last CTA to finish resets tile_counter and done_count to zero for the
// next launch (sched_finish), so the host never resets them.
#include "common.cuh"
#include "signals.cuh"
#include "gemm_args.cuh"

constexpr u32 MK_TILE_DONE = 0xFFFFFFFFu;
constexpr u32 MK_TILE_YIELD = 0xFFFFFFFEu;
constexpr u32 MK_TILE_NONE = 0xFFFFFFFDu;  // a clustered unit's part past the last row: computed, never stored
// A fused op's communication turn in the tile ring (a claim of its tile source): the producer issues
// no loads for it, the consumers run the epilogue's comm_turn() and go on with the ring.
constexpr u32 MK_TILE_COMM = 0xFFFFFFFCu;

// One tile as the producer hands it to the consumers (through the shared-memory tile ring).
struct MkTile {
  i32 m0;  // first row of the tile in A / C (grouped: in the concatenated rows)
  i32 n0;  // first column
  i32 rows;  // rows of the tile that belong to its group (<= BM); the rest are computed, never stored
  i32 group;  // group index (0 in plain mode)
  u32 id;  // tile id (flag index), MK_TILE_DONE after the last tile
  u32 seq;  // this CTA's tile sequence number (0, 1, 2, ...), the same for every consumer
  u32 pad[2];
};

// Per-group prefix sums, computed once per CTA at kernel entry (grouped mode).
struct MkGroupTable {
  u32 tile_base[MK_GEMM_MAX_GROUPS + 1];
  i32 row_base[MK_GEMM_MAX_GROUPS + 1];
};

template <int BM>
struct MkTileSpace {
  // Plain mode: one group of m rows. Grouped: a table in shared memory.
  const MkGroupTable* table;  // null in plain mode
  i32 m;  // plain mode rows
  u32 tiles_n;
  u32 num_groups;
  u32 num_tiles;
  u32 group_m;
  u32 by_n;  // the built-in order groups N-tiles (MK_SCHED_BY_N)
  i32 n;

  MK_DEV u32 group_of(u32 t) const {  // the group whose tile range holds t (t < num_tiles)
    if (!table) return 0;
    u32 lo = 0, hi = num_groups;  // tile_base[lo] <= t < tile_base[hi]
    while (hi - lo > 1) {
      const u32 mid = (lo + hi) >> 1;
      if (table->tile_base[mid] <= t)
        lo = mid;
      else
        hi = mid;
    }
    return lo;
  }
  MK_DEV u32 base(u32 g) const { return table ? table->tile_base[g] : 0u; }
  MK_DEV i32 row_base(u32 g) const { return table ? table->row_base[g] : 0; }
  MK_DEV i32 rows(u32 g) const { return table ? table->row_base[g + 1] - table->row_base[g] : m; }

  // Position in the built-in order -> tile id. M-grouped: blocks of group_m M-tiles, N-tile by N-tile
  // inside a block (CTAs running together share B columns of few A rows); N-grouped (by_n): blocks
  // of group_m N-tiles, M-tile by M-tile inside (they share A rows of few B columns).
  MK_DEV u32 builtin_id(u32 pos) const {
    const u32 g = group_of(pos);
    const u32 b = base(g), local = pos - b;
    const u32 tm = (u32)(rows(g) + BM - 1) / BM;
    if (by_n) {
      const u32 span = group_m * tm;
      const u32 blk = local / span, r = local - blk * span;
      const u32 first = blk * group_m;
      const u32 gs = min(group_m, tiles_n - first);
      return b + (r / gs) * tiles_n + first + r % gs;
    }
    const u32 span = group_m * tiles_n;
    const u32 blk = local / span, r = local - blk * span;
    const u32 first = blk * group_m;
    const u32 gs = min(group_m, tm - first);
    const u32 mt = first + r % gs, nt = r / gs;
    return b + mt * tiles_n + nt;
  }

  // Tile id -> the tile.
  template <int BN>
  MK_DEV MkTile decode(u32 id) const {
    MkTile t;
    const u32 g = group_of(id);
    const u32 local = id - base(g);
    const u32 mt = local / tiles_n, nt = local - mt * tiles_n;
    const i32 rg = rows(g);
    t.m0 = row_base(g) + (i32)(mt * BM);
    t.n0 = (i32)(nt * BN);
    t.rows = min(BM, rg - (i32)(mt * BM));
    t.group = (i32)g;
    t.id = id;
    t.seq = 0;
    t.pad[0] = t.pad[1] = 0;
    return t;
  }
};

// Clustered GEMM (plain mode): part q of a claimed unit of CLUSTER M-tiles, the unit decoded as one
// UNIT_M x BN tile of id mu * tiles_n + nt: rows q * BM on, tile id (mu * CLUSTER + q) * tiles_n + nt
// (the plain tile ids, so flags and tile counts mean the same), MK_TILE_NONE with 0 rows past M.
template <int BM, int CLUSTER>
MK_DEV MkTile cluster_part(MkTile unit, u32 q, u32 tiles_n) {
  if (CLUSTER == 1 || unit.id == MK_TILE_DONE || unit.id == MK_TILE_COMM) return unit;
  const u32 mu = unit.id / tiles_n;
  const i32 rows = unit.rows - (i32)q * BM;
  unit.m0 += (i32)q * BM;
  unit.rows = rows <= 0 ? 0 : min(rows, BM);
  unit.id = rows <= 0 ? MK_TILE_NONE : unit.id + (mu * (CLUSTER - 1) + q) * tiles_n;
  return unit;
}

// Grouped mode: fills the table from the device row counts (clamped to be >= 0 and to fit in the
// m rows of A / C). All threads of the CTA call it; ends with __syncthreads.
template <int BM>
MK_DEV void build_group_table(MkGroupTable* tab, const int* group_rows, u32 num_groups, i32 m_cap, u32 tiles_n) {
  __syncthreads();
  for (u32 g = threadIdx.x; g < num_groups; g += blockDim.x)
    tab->row_base[g + 1] =
        __ldcg(group_rows + g);  // parallel loads (L2: a fused op may have written them in this launch)
  __syncthreads();
  if (threadIdx.x == 0) {
    u32 tiles = 0;
    i32 rows = 0;
    for (u32 g = 0; g < num_groups; ++g) {
      i32 r = tab->row_base[g + 1];
      r = max(0, min(r, m_cap - rows));
      tab->tile_base[g] = tiles;
      tab->row_base[g] = rows;
      tiles += (u32)((r + BM - 1) / BM) * tiles_n;
      rows += r;
    }
    tab->tile_base[num_groups] = tiles;
    tab->row_base[num_groups] = rows;
  }
  __syncthreads();
}

// Claims the next position for this CTA. Returns the tile id, MK_TILE_DONE when every tile is
// claimed, or MK_TILE_YIELD when this CTA's role word is not MK_SCHED_GEMM. One thread calls it.
// Split K (plain mode, MkGemmArgs::splits > 1): claim c = tile * splits + range, over a tile space
// of num_tiles = tiles * splits claims; a tile's ranges are consecutive in the built-in order.
template <class Space>
struct MkSplitOrder {
  const Space& s;
  u32 splits;
  u32 num_tiles;
  MK_DEV u32 builtin_id(u32 pos) const { return s.builtin_id(pos / splits) * splits + pos % splits; }
};

// The tile at position pos of the order, MK_TILE_DONE past the last. Space: any tile space with
// num_tiles and builtin_id(pos) (the GEMM's MkTileSpace, attention's).
template <class Space>
MK_DEV u32 sched_tile_at(const MkGemmSched& s, const Space& space, u32 pos) {
  if (pos >= space.num_tiles) return MK_TILE_DONE;
  return s.tile_order ? s.tile_order[pos] : space.builtin_id(pos);
}

template <class Space>
MK_DEV u32 sched_try_next(const MkGemmSched& s, const Space& space) {
  if (s.roles && ld_acquire_sys(&s.roles[blockIdx.x]) != (u32)MK_SCHED_GEMM) {
    return ld_relaxed_sys(s.tile_counter) >= space.num_tiles ? MK_TILE_DONE : MK_TILE_YIELD;
  }
  return sched_tile_at(s, space, atomicAdd(s.tile_counter, 1u));
}

// No role words, claimers numbered by the grid (claimer c of `claimers`: a CTA, or a cluster's
// leader): claim k = 0 takes position c, later ones count on from `claimers` (no atomic's round
// trip before the first tile; positions past the last are MK_TILE_DONE, so any grid is right).
template <class Space>
MK_DEV u32 sched_next_own_first(const MkGemmSched& s, const Space& space, u32 c, u32 claimers, u32 k) {
  return sched_tile_at(s, space, k == 0 ? c : claimers + atomicAdd(s.tile_counter, 1u));
}

// As sched_try_next, but a CTA told to leave waits (time-bounded) until it is given GEMM work
// again or no tile is left. For kernels with nothing else to do (the standalone GEMM).
template <class Space>
MK_DEV u32 sched_next(const MkGemmSched& s, const Space& space, const MkSync& sync) {
  u32 t = sched_try_next(s, space);
  if (t != MK_TILE_YIELD) return t;
  const u64 start = globaltimer_ns();
  for (;;) {
    __nanosleep(256);
    t = sched_try_next(s, space);
    if (t != MK_TILE_YIELD) return t;
    if (error_recorded(sync)) return MK_TILE_DONE;
    const u64 waited = globaltimer_ns() - start;
    if (waited > sync.timeout_ns) {
      record_error(sync, MK_ERR_TIMEOUT, -1, 0xFFFFu, (u32)MK_SCHED_GEMM, ld_relaxed_sys(&s.roles[blockIdx.x]), waited);
      return MK_TILE_DONE;
    }
  }
}

// One thread per CTA, after the CTA's last claim: the last CTA resets the scheduler's counters.
MK_DEV void sched_finish(const MkGemmSched& s) {
  __threadfence();
  const u32 n = gridDim.x * gridDim.y * gridDim.z;
  if (atomicAdd(s.done_count, 1u) == n - 1) {
    atomicExch(s.tile_counter, 0u);
    atomicExch(s.done_count, 0u);
    __threadfence();
  }
}
