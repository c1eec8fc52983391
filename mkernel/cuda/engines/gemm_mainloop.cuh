#pragma once
// The GEMM engine's pipeline: one producer warpgroup streams A and B k-blocks through a
// STAGES-deep shared-memory ring with TMA; two consumer warpgroups each multiply a 64 x BN half
// of the 128 x BN output tile (BN 256, or 192: the narrow tiles) with wgmma m64nBNk16 and hand the
// fp32 accumulators to an epilogue functor. Reusable: a fused kernel lays out GemmSmem, calls
// gemm_setup(), then runs gemm_producer() in warpgroup 0 and gemm_consumer(..., epilogue) in
// warpgroups 1 and 2.
//
// Clustered variant (Cfg::CLUSTER = 2, the standalone GEMM): the CTAs of a cluster compute the
// tiles (2p, n) and (2p + 1, n), which share their B tile: each CTA loads its own A box and 1/CLUSTER
// of B, multicast into every CTA of the cluster, so B's L2 traffic drops by that factor. The
// leader (rank 0) claims a unit of CLUSTER M-tiles and writes each CTA its tile; a stage is
// overwritten only once the consumers of every CTA released it.
//
// Barriers (all in shared memory, phase parity waits):
//   full[s]   count 1: the producer's arrive.expect_tx(STAGE_BYTES); completes when TMA has landed
//             both the A and the B box of stage s (clustered: B's slices from every CTA).
//   empty[s]  count 8 x CLUSTER: lane 0 of each consumer warp (of every CTA of the cluster, whose
//             multicasts write this stage) arrives once its wgmmas reading stage s have completed.
//   tfull[r]  count 1: the (leader's) producer published tile r of the tile ring (MkTile in shared
//             memory).
//   tempty[r] count 256 x CLUSTER + CLUSTER - 1: every consumer thread and every other CTA's
//             producer of the cluster has read tile r (only the leader's is waited for).
// Iteration i (counted over all k-blocks of all tiles of this CTA) uses stage i % STAGES with
// phase parity (i / STAGES) & 1; the producer waits for 'empty' with the opposite parity, so its
// first pass over a fresh barrier does not block.
#include "common.cuh"
#include "tma.cuh"
#include "cluster.cuh"
#include "mbar_wait.cuh"
#include "wgmma.cuh"
#include "gemm_args.cuh"
#include "tile_scheduler.cuh"
#include "trace.cuh"

// B layouts.
enum { MK_B_NK = 0, MK_B_KN = 1 };

template <int DT_, int BL_, int CLUSTER_ = 1, int BN_ = 256>
struct GemmCfg {
  static constexpr int DT = DT_, BL = BL_, CLUSTER = CLUSTER_;
  static constexpr int BM = 128, BN = BN_, BK = 64;
  static constexpr int NACC = BN / 2;  // fp32 accumulators per consumer thread (64 x BN / 128)
  static constexpr int UNIT_M = BM * CLUSTER;  // rows of one claim (a cluster's tiles)
  static constexpr int STAGES = 4;
  static constexpr int CONSUMERS = 2;
  static constexpr int THREADS = 128 * (1 + CONSUMERS);
  static constexpr int RING = 4;  // tile ring depth
  static constexpr u32 A_BYTES = BM * BK * 2;  // 16 KiB: 128 rows x 128 B, swizzled
  static constexpr u32 B_BYTES = BN * BK * 2;  // [N,K]: BN rows x 128 B; [K,N]: BN / 64 boxes of 64 K-rows x 128 B
  static constexpr u32 STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr u32 B_SLICE_BYTES = B_BYTES / CLUSTER;  // the part of B each CTA of a cluster loads
  static constexpr u32 EMPTY_ARRIVALS = CONSUMERS * 4 * CLUSTER;
  static constexpr u32 TEMPTY_ARRIVALS = CONSUMERS * 128 * CLUSTER + CLUSTER - 1;
  static constexpr u32 C_WARP_ROWS = 16;  // the epilogue works warp by warp: 16 rows each
  static constexpr u32 C_CHUNK_BYTES = C_WARP_ROWS * 128;  // one chunk: 16 rows x 128 B, swizzled
  static constexpr u32 C_BUFS = 2;  // per consumer warp (double buffered)
  static constexpr u32 OFF_A = 0;
  static constexpr u32 OFF_B = OFF_A + STAGES * A_BYTES;
  static constexpr u32 OFF_C = OFF_B + STAGES * B_BYTES;
  static constexpr u32 OFF_BAR = OFF_C + CONSUMERS * 4 * C_BUFS * C_CHUNK_BYTES;
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = 232;
  MK_STATIC_ASSERT(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * CONSUMERS <= mk_cta_register_pool(THREADS),
                   "register budget");
  MK_STATIC_ASSERT(CLUSTER == 1 || CLUSTER == 2, "clusters of 1 or 2 CTAs");
  MK_STATIC_ASSERT(BN == 256 || BN == 192, "wgmma m64n256 / m64n192 tiles");
  MK_STATIC_ASSERT(CLUSTER == 1 || BN / 64 % CLUSTER == 0, "a [K, N] B's boxes split evenly between the CTAs");
};

template <class Cfg>
struct GemmBars {
  u64 full[Cfg::STAGES];
  u64 empty[Cfg::STAGES];
  u64 tfull[Cfg::RING];
  u64 tempty[Cfg::RING];
  MkTile ring[Cfg::RING];
  u32 epoch;  // this launch's epoch
  u32 pad[3];
  // Stored parts of tiles (one per consumer warp), by tile sequence number % MK_JOIN_SLOTS: the
  // last warp to count its part publishes the tile flag and resets the slot. The consumers are
  // at most STAGES k-blocks (so at most STAGES + 2 tiles, flag deferral included) apart: 16 slots.
  u32 join[16];
};
#define MK_JOIN_SLOTS 16

// Bytes of dynamic shared memory a GEMM kernel asks for (including 1024 of alignment slack).
template <class Cfg, bool GROUPED>
__host__ __device__ constexpr u32 gemm_smem_bytes() {
  return Cfg::OFF_BAR + (u32)sizeof(GemmBars<Cfg>) + (GROUPED ? (u32)sizeof(MkGroupTable) : 0u) + 1024u;
}

template <class Cfg>
struct GemmSmem {
  u8* base;  // 1024-byte aligned
  GemmBars<Cfg>* bars;
  MkGroupTable* table;
  MK_DEV u32 a(int s) const { return smem_u32(base) + Cfg::OFF_A + s * Cfg::A_BYTES; }
  MK_DEV u32 b(int s) const { return smem_u32(base) + Cfg::OFF_B + s * Cfg::B_BYTES; }
  MK_DEV u32 c(int consumer, int warp, int buf) const {
    return smem_u32(base) + Cfg::OFF_C + ((consumer * 4 + warp) * Cfg::C_BUFS + buf) * Cfg::C_CHUNK_BYTES;
  }
};

template <class Cfg, bool GROUPED>
MK_DEV GemmSmem<Cfg> gemm_smem_carve(u8* dyn) {
  GemmSmem<Cfg> sm;
  const u32 addr = smem_u32(dyn);
  sm.base = dyn + (((addr + 1023u) & ~1023u) - addr);
  sm.bars = reinterpret_cast<GemmBars<Cfg>*>(sm.base + Cfg::OFF_BAR);
  sm.table = GROUPED ? reinterpret_cast<MkGroupTable*>(sm.base + Cfg::OFF_BAR + sizeof(GemmBars<Cfg>)) : nullptr;
  return sm;
}

// The tile space of the engine's arguments: plain (table null: sched.num_tiles tiles) or grouped
// over a table build_group_table filled from args.group_rows (its tiles: tile_base[num_groups]).
template <class Cfg>
MK_DEV MkTileSpace<Cfg::UNIT_M> gemm_tile_space(const MkGemmArgs& args, const MkGroupTable* table) {
  MkTileSpace<Cfg::UNIT_M> space;
  space.table = table;
  space.m = args.m;
  space.n = args.n;
  space.tiles_n = args.sched.tiles_n;
  space.group_m = args.sched.group_m > 0 ? args.sched.group_m : 1u;
  space.by_n = args.sched.flags & MK_SCHED_BY_N;
  space.num_groups = table ? (u32)args.num_groups : 1u;
  space.num_tiles = table ? table->tile_base[space.num_groups] : args.sched.num_tiles;
  return space;
}

// All threads of the CTA: barrier initialisation, the epoch (epoch: false leaves it 0, sparing a
// load from memory where no flag or exit uses it), the group table. Ends with __syncthreads.
// Clustered: the tile space counts units of CLUSTER M-tiles, and the barrier at the end spans the
// cluster (no CTA's multicast or remote arrival may reach a barrier not yet initialised).
template <class Cfg, bool GROUPED>
MK_DEV MkTileSpace<Cfg::UNIT_M> gemm_setup(const MkGemmArgs& args, const GemmSmem<Cfg>& sm, bool epoch = true) {
  MK_STATIC_ASSERT(!(GROUPED && Cfg::CLUSTER > 1), "the clustered GEMM is plain mode only");
  GemmBars<Cfg>* bars = sm.bars;
  if (threadIdx.x == 0) {
    for (int s = 0; s < Cfg::STAGES; ++s) {
      mbar_init(smem_u32(&bars->full[s]), 1);
      mbar_init(smem_u32(&bars->empty[s]), Cfg::EMPTY_ARRIVALS);
    }
    for (int r = 0; r < Cfg::RING; ++r) {
      mbar_init(smem_u32(&bars->tfull[r]), 1);
      mbar_init(smem_u32(&bars->tempty[r]), Cfg::TEMPTY_ARRIVALS);
    }
    bars->epoch = epoch ? launch_epoch(args.sync) : 0u;
    for (int i = 0; i < MK_JOIN_SLOTS; ++i) bars->join[i] = 0;
    mbar_fence_init();
    tma_prefetch_desc(&args.a);
    tma_prefetch_desc(&args.b);
    tma_prefetch_desc(&args.c);
  }
  if (GROUPED) {
    build_group_table<Cfg::UNIT_M>(sm.table, args.group_rows, (u32)args.num_groups, args.m, args.sched.tiles_n);
  } else {
    if (Cfg::CLUSTER > 1)
      cluster_sync();
    else
      __syncthreads();
  }
  return gemm_tile_space<Cfg>(args, GROUPED ? sm.table : nullptr);
}

// Warpgroup 0, one thread: takes tiles from a tile source, publishes them in the tile ring and
// streams their k-blocks. Publishes MK_TILE_DONE last. A source (the engine's scheduler below, or a
// fused op's own order) provides:
//   u32 claim()                         the next claim (a position or a tile id), or MK_TILE_COMM:
//                                       a communication turn for the consumers (no loads)
//   bool done(u32 claim)                no tiles are left
//   MkTile decode(u32 claim)            the claim's tile
//   void before_loads(const MkTile&)    runs before the tile reaches the consumers and its loads
//                                       are issued (a fused op waits there for the tile's inputs)
//   i32 b_index(const MkTile&)          which B matrix the tile multiplies (grouped mode's group)
//
// Clustered (Cfg::CLUSTER > 1), plain mode: the leader's producer claims a unit of CLUSTER M-tiles
// and writes CTA q its tile q of the unit (cluster_part) into q's ring; the other producers read
// their tile from their own ring like the consumers. Each producer loads its A box and its slice
// of B, multicast to every CTA (B's TMA box is then BN / CLUSTER rows for [N, K]). A part past M
// (odd tiles_m) is still loaded (zeros; its B slice is the other CTAs' too) and never stored.
template <class Cfg>
MK_DEV void gemm_load_stage(const MkGemmArgs& args, const GemmSmem<Cfg>& sm, const MkTile& t, i32 bi, int s, i32 k0,
                            u32 rank) {
  const u32 full = smem_u32(&sm.bars->full[s]);
  mbar_arrive_expect_tx(full, Cfg::STAGE_BYTES);
  tma_load_2d(sm.a(s), &args.a, full, k0, t.m0);
  if (Cfg::CLUSTER == 1) {
    if (Cfg::BL == MK_B_NK) {
      tma_load_3d(sm.b(s), &args.b, full, k0, t.n0, bi);
    } else {
#pragma unroll
      for (int j = 0; j < Cfg::BN / 64; ++j)
        tma_load_3d(sm.b(s) + j * (64 * Cfg::BK * 2), &args.b, full, t.n0 + 64 * j, k0, bi);
    }
    return;
  }
  const u16 all = (u16)((1u << Cfg::CLUSTER) - 1);
  if (Cfg::BL == MK_B_NK) {  // rows n0 + rank * BN / CLUSTER ... of the [N, K] box: contiguous in smem
    tma_load_3d_multicast(sm.b(s) + rank * Cfg::B_SLICE_BYTES, &args.b, full, k0,
                          t.n0 + (i32)rank * (Cfg::BN / Cfg::CLUSTER), bi, all);
  } else {  // this CTA's share of the BN / 64 boxes of 64 N-columns
    constexpr int PER = Cfg::BN / 64 / Cfg::CLUSTER;
#pragma unroll
    for (int jj = 0; jj < PER; ++jj) {
      const int j = (int)rank * PER + jj;
      tma_load_3d_multicast(sm.b(s) + j * (64 * Cfg::BK * 2), &args.b, full, t.n0 + 64 * j, k0, bi, all);
    }
  }
}

// The k-blocks [kb0, kb1) of tile t: all of K, or (split K: args.splits > 1) its range t.pad[0],
// ceil(kblocks / splits) k-blocks each (the host picks splits so that none is empty).
MK_DEV void gemm_k_range(const MkGemmArgs& args, const MkTile& t, int kblocks, int& kb0, int& kb1) {
  kb0 = 0;
  kb1 = kblocks;
  if (args.splits > 1) {
    const int per = (kblocks + (int)args.splits - 1) / (int)args.splits;
    kb0 = (int)t.pad[0] * per;
    kb1 = min(kblocks, kb0 + per);
  }
}

template <class Cfg>
MK_DEV void gemm_ring_put(const GemmSmem<Cfg>& sm, u32 r, const MkTile& t, u32 rank) {
  const uint4* v = reinterpret_cast<const uint4*>(&t);
  const u32 slot = smem_u32(&sm.bars->ring[r]);
  st_cluster_v4(slot, rank, v[0]);
  st_cluster_v4(slot + 16, rank, v[1]);
  mbar_arrive_cluster(smem_u32(&sm.bars->tfull[r]), rank);
}

template <class Cfg, class Source>
MK_DEV void gemm_producer_loop(const MkGemmArgs& args, const GemmSmem<Cfg>& sm, Source& src) {
  MK_STATIC_ASSERT(sizeof(MkTile) == 32, "gemm_ring_put copies MkTile as two 16-byte words");
  GemmBars<Cfg>* bars = sm.bars;
  const int kblocks = (args.k + Cfg::BK - 1) / Cfg::BK;
  const u32 rank = Cfg::CLUSTER > 1 ? cluster_ctarank() : 0u;
  u32 it = 0, tile_it = 0;
  bool loads = true;  // false once a stage's bytes never landed: no stage is armed again
  for (;;) {
    const u32 r = tile_it % Cfg::RING;
    MkTile t;
    if (rank == 0) {
      const u32 claim = src.claim();
      const bool turn = claim == MK_TILE_COMM;
      const bool done = !turn && src.done(claim);
      mbar_wait_timed(smem_u32(&bars->tempty[r]), ((tile_it / Cfg::RING) & 1) ^ 1, args.sync, MK_WAIT_TILE);
      if (done || turn) {
        t.m0 = t.n0 = t.rows = t.group = 0;
        t.id = turn ? MK_TILE_COMM : MK_TILE_DONE;
        t.pad[0] = t.pad[1] = 0;
      } else {
        t = src.decode(claim);
      }
      t.seq = tile_it;
      if (!done && !turn) src.before_loads(t);
      for (u32 q = 1; q < (u32)Cfg::CLUSTER; ++q)
        gemm_ring_put<Cfg>(sm, r, cluster_part<Cfg::BM, Cfg::CLUSTER>(t, q, args.sched.tiles_n), q);
      t = cluster_part<Cfg::BM, Cfg::CLUSTER>(t, 0, args.sched.tiles_n);
      bars->ring[r] = t;
      mbar_arrive(smem_u32(&bars->tfull[r]));
    } else {
      mbar_wait_timed<true>(smem_u32(&bars->tfull[r]), (tile_it / Cfg::RING) & 1, args.sync, MK_WAIT_TILE + 2);
      t = bars->ring[r];
      mbar_arrive_remote(smem_u32(&bars->tempty[r]), 0);
    }
    ++tile_it;
    if (t.id == MK_TILE_DONE) break;
    if (t.id == MK_TILE_COMM) continue;
    const i32 bi = src.b_index(t);
    int kb0, kb1;
    gemm_k_range(args, t, kblocks, kb0, kb1);
    for (int kb = kb0; kb < kb1; ++kb, ++it) {
      const int s = it % Cfg::STAGES;
      const u32 ph = ((it / Cfg::STAGES) & 1) ^ 1;
      mbar_wait_timed(smem_u32(&bars->empty[s]), ph, args.sync, MK_WAIT_EMPTY);
      loads = loads && mbar_can_arm(smem_u32(&bars->full[s]), ph, args.sync, MK_WAIT_LANDED);
      if (loads) gemm_load_stage<Cfg>(args, sm, t, bi, s, kb * Cfg::BK, rank);
    }
  }
  mbar_drain_landed(smem_u32(&bars->full[0]), Cfg::STAGES, it);
}

// The engine's tile source: the persistent scheduler (tile order, role words), group = B index;
// SPLIT (plain mode), when args.splits > 1: claims of (tile, range of K) (clustered: (unit of
// CLUSTER M-tiles, range), every part of the unit on the same range), the range in MkTile::pad[0].
// MK_SCHED_OWN_FIRST (the standalone engine's host sets it): each claimer's first position is its own.
template <class Cfg, bool SPLIT = false>
struct MkSchedTiles {
  const MkGemmArgs& args;
  const MkTileSpace<Cfg::UNIT_M>& space;
  u32 claims = 0;  // this claimer's claims so far
  MK_DEV u32 claim() {
    const MkSplitOrder<MkTileSpace<Cfg::UNIT_M> > split{space, args.splits, space.num_tiles};
    if (args.sched.flags & MK_SCHED_OWN_FIRST) {
      const u32 c = blockIdx.x / Cfg::CLUSTER, claimers = gridDim.x / Cfg::CLUSTER, k = claims++;
      return SPLIT && args.splits > 1 ? sched_next_own_first(args.sched, split, c, claimers, k)
                                      : sched_next_own_first(args.sched, space, c, claimers, k);
    }
    return SPLIT && args.splits > 1 ? sched_next(args.sched, split, args.sync)
                                    : sched_next(args.sched, space, args.sync);
  }
  MK_DEV bool done(u32 id) const { return id == MK_TILE_DONE; }
  MK_DEV MkTile decode(u32 id) const {
    if (!SPLIT || args.splits <= 1) return space.template decode<Cfg::BN>(id);
    MkTile t = space.template decode<Cfg::BN>(id / args.splits);
    t.pad[0] = id % args.splits;
    return t;
  }
  MK_DEV void before_loads(const MkTile&) const {}
  MK_DEV i32 b_index(const MkTile& t) const { return t.group; }
};

template <class Cfg, bool GROUPED>
MK_DEV void gemm_producer(const MkGemmArgs& args, const GemmSmem<Cfg>& sm, const MkTileSpace<Cfg::UNIT_M>& space) {
  MkSchedTiles<Cfg, !GROUPED> src{args, space};
  gemm_producer_loop<Cfg>(args, sm, src);
}

// Descriptors of k-step kk (16 elements of K) of stage s for consumer warpgroup wg.
template <class Cfg>
MK_DEV u64 gemm_desc_a(const GemmSmem<Cfg>& sm, int s, int wg, int kk) {
  return wgmma_desc(sm.a(s) + wg * (64 * 128) + kk * 32, 16, 1024);
}
template <class Cfg>
MK_DEV u64 gemm_desc_b(const GemmSmem<Cfg>& sm, int s, int kk) {
  if (Cfg::BL == MK_B_NK) return wgmma_desc(sm.b(s) + kk * 32, 16, 1024);
  return wgmma_desc(sm.b(s) + kk * (16 * 128), 64 * Cfg::BK * 2, 1024);  // LBO: next 64 N columns (next box)
}

// Lane 0 of a consumer warp: stage s may be refilled (by every CTA of the cluster that writes it).
template <class Cfg>
MK_DEV void gemm_release_stage(const GemmSmem<Cfg>& sm, int s) {
  const u32 bar = smem_u32(&sm.bars->empty[s]);
  if constexpr (Cfg::CLUSTER == 1) {
    mbar_arrive(bar);
  } else {
#pragma unroll
    for (u32 q = 0; q < (u32)Cfg::CLUSTER; ++q) mbar_arrive_remote(bar, q);
  }
}

// Warpgroups 1..CONSUMERS (wg = 0..CONSUMERS-1), every thread: for each tile of the ring, the
// mainloop into acc, then epi(acc, tile, wg). Returns after the MK_TILE_DONE entry.
// Epilogue functor interface:
//   epi(float (&acc)[Cfg::NACC], const MkTile& t, int wg)  the tile's accumulators, every consumer thread
//   epi.after_issue()  called once per tile inside the next tile's mainloop, right after the
//                      wgmmas of k-block min(2, kblocks - 1) are issued (the tensor cores are
//                      busy): where an epilogue finishes deferred work (TMA store completion and
//                      the previous tile's flag) without stalling the MMA pipe.
//   epi.comm_turn(t)   an MK_TILE_COMM entry of the ring, every consumer thread (a fused op's
//                      communication turn, between two tiles)
template <class Cfg, class Epi>
MK_DEV void gemm_consumer(const MkGemmArgs& args, const GemmSmem<Cfg>& sm, int wg, Epi& epi) {
  GemmBars<Cfg>* bars = sm.bars;
  const int kblocks = (args.k + Cfg::BK - 1) / Cfg::BK;
  const u32 lane = threadIdx.x & 31;
  float acc[Cfg::NACC];
  u32 it = 0, tile_it = 0;
  for (;;) {
    const u32 r = tile_it % Cfg::RING;
    mbar_wait_timed<(Cfg::CLUSTER > 1)>(smem_u32(&bars->tfull[r]), (tile_it / Cfg::RING) & 1, args.sync,
                                        MK_WAIT_TILE + 1);
    const MkTile t = bars->ring[r];
    if (Cfg::CLUSTER > 1)
      mbar_arrive_remote(smem_u32(&bars->tempty[r]), 0);  // the leader's producer refills every ring
    else
      mbar_arrive(smem_u32(&bars->tempty[r]));
    ++tile_it;
    if (t.id == MK_TILE_DONE) break;
    if (t.id == MK_TILE_COMM) {
      epi.comm_turn(t);
      __syncwarp();  // the turn's leader branches: converge before the next tile's .aligned wgmma
      continue;
    }
    const u64 t_start = args.sync.trace_events ? globaltimer_ns() : 0;
    int kb0, kb1;
    gemm_k_range(args, t, kblocks, kb0, kb1);
    const int pub_kb = kb0 + (kb1 - kb0 - 1 < 2 ? kb1 - kb0 - 1 : 2);
    for (int kb = kb0; kb < kb1; ++kb, ++it) {
      const int s = it % Cfg::STAGES;
      mbar_wait_timed(smem_u32(&bars->full[s]), (it / Cfg::STAGES) & 1, args.sync, MK_WAIT_FULL);
#pragma unroll
      for (int i = 0; i < Cfg::NACC; ++i) wgmma_fence_operand(acc[i]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Cfg::BK / 16; ++kk)
        wgmma_ss<Cfg::DT, Cfg::BL>(acc, gemm_desc_a<Cfg>(sm, s, wg, kk), gemm_desc_b<Cfg>(sm, s, kk),
                                   (kb > kb0 || kk > 0) ? 1u : 0u);
      wgmma_commit();
#pragma unroll
      for (int i = 0; i < Cfg::NACC; ++i) wgmma_fence_operand(acc[i]);
      if (kb == pub_kb) {
        epi.after_issue();
        __syncwarp();  // lane 0 may have diverged: converge before the .aligned wait
      }
      wgmma_wait<1>();  // the previous k-block's group is complete: release its stage
      if (kb > kb0 && lane == 0) gemm_release_stage<Cfg>(sm, (it + Cfg::STAGES - 1) % Cfg::STAGES);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < Cfg::NACC; ++i) wgmma_fence_operand(acc[i]);
    if (kb1 > kb0 && lane == 0) gemm_release_stage<Cfg>(sm, (it + Cfg::STAGES - 1) % Cfg::STAGES);
    if (kb1 == kb0) {
#pragma unroll
      for (int i = 0; i < Cfg::NACC; ++i) acc[i] = 0.f;
    }
    epi(acc, t, wg);
    if (wg == 0 && (threadIdx.x & 127) == 0) trace_span(args.sync, MK_ROLE_COMPUTE, t.id, t_start);
    __syncwarp();  // converge before the next tile's .aligned wgmma instructions
  }
}
