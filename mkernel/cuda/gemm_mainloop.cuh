#pragma once
// The GEMM engine's pipeline: one producer warpgroup streams A and B k-blocks through a
// STAGES-deep shared-memory ring with TMA; two consumer warpgroups each multiply a 64 x 256 half
// of the 128 x 256 output tile with wgmma m64n256k16 and hand the fp32 accumulators to an
// epilogue functor. Reusable: a fused kernel lays out GemmSmem, calls gemm_setup(), then runs
// gemm_producer() in warpgroup 0 and gemm_consumer(..., epilogue) in warpgroups 1 and 2.
//
// Barriers (all in shared memory, phase parity waits):
//   full[s]   count 1: the producer's arrive.expect_tx(STAGE_BYTES); completes when TMA has landed
//             both the A and the B box of stage s.
//   empty[s]  count 8: lane 0 of each of the 8 consumer warps arrives once that warpgroup's
//             wgmmas reading stage s have completed (wgmma.wait_group).
//   tfull[r]  count 1: the producer published tile r of the tile ring (MkTile in shared memory).
//   tempty[r] count 256: every consumer thread has read tile r.
// Iteration i (counted over all k-blocks of all tiles of this CTA) uses stage i % STAGES with
// phase parity (i / STAGES) & 1; the producer waits for 'empty' with the opposite parity, so its
// first pass over a fresh barrier does not block.
#include "common.cuh"
#include "tma.cuh"
#include "mbar_wait.cuh"
#include "wgmma.cuh"
#include "gemm_args.cuh"
#include "tile_scheduler.cuh"
#include "trace.cuh"

// B layouts.
enum { MK_B_NK = 0, MK_B_KN = 1 };

template <int DT_, int BL_>
struct GemmCfg {
  static constexpr int DT = DT_, BL = BL_;
  static constexpr int BM = 128, BN = 256, BK = 64;
  static constexpr int STAGES = 4;
  static constexpr int CONSUMERS = 2;
  static constexpr int THREADS = 128 * (1 + CONSUMERS);
  static constexpr int RING = 4;  // tile ring depth
  static constexpr u32 A_BYTES = BM * BK * 2;  // 16 KiB: 128 rows x 128 B, swizzled
  static constexpr u32 B_BYTES = BN * BK * 2;  // 32 KiB: [N,K]: 256 rows x 128 B; [K,N]: 4 boxes of 64 K-rows x 128 B
  static constexpr u32 STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr u32 C_WARP_ROWS = 16;          // the epilogue works warp by warp: 16 rows each
  static constexpr u32 C_CHUNK_BYTES = C_WARP_ROWS * 128;  // one chunk: 16 rows x 128 B, swizzled
  static constexpr u32 C_BUFS = 2;                // per consumer warp (double buffered)
  static constexpr u32 OFF_A = 0;
  static constexpr u32 OFF_B = OFF_A + STAGES * A_BYTES;
  static constexpr u32 OFF_C = OFF_B + STAGES * B_BYTES;
  static constexpr u32 OFF_BAR = OFF_C + CONSUMERS * 4 * C_BUFS * C_CHUNK_BYTES;
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = 232;
  MK_STATIC_ASSERT(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * CONSUMERS <= mk_cta_register_pool(THREADS), "register budget");
};

template <class Cfg>
struct GemmBars {
  u64 full[Cfg::STAGES];
  u64 empty[Cfg::STAGES];
  u64 tfull[Cfg::RING];
  u64 tempty[Cfg::RING];
  MkTile ring[Cfg::RING];
  u32 epoch;      // this launch's epoch
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

// All threads of the CTA: barrier initialisation, the epoch, the group table. Ends with __syncthreads.
template <class Cfg, bool GROUPED>
MK_DEV MkTileSpace<Cfg::BM> gemm_setup(const MkGemmArgs& args, const GemmSmem<Cfg>& sm) {
  GemmBars<Cfg>* bars = sm.bars;
  if (threadIdx.x == 0) {
    for (int s = 0; s < Cfg::STAGES; ++s) {
      mbar_init(smem_u32(&bars->full[s]), 1);
      mbar_init(smem_u32(&bars->empty[s]), Cfg::CONSUMERS * 4);
    }
    for (int r = 0; r < Cfg::RING; ++r) {
      mbar_init(smem_u32(&bars->tfull[r]), 1);
      mbar_init(smem_u32(&bars->tempty[r]), Cfg::CONSUMERS * 128);
    }
    bars->epoch = launch_epoch(args.sync);
    for (int i = 0; i < MK_JOIN_SLOTS; ++i) bars->join[i] = 0;
    mbar_fence_init();
    tma_prefetch_desc(&args.a);
    tma_prefetch_desc(&args.b);
    tma_prefetch_desc(&args.c);
  }
  MkTileSpace<Cfg::BM> space;
  space.table = sm.table;
  space.m = args.m;
  space.n = args.n;
  space.tiles_n = args.sched.tiles_n;
  space.group_m = args.sched.group_m > 0 ? args.sched.group_m : 1u;
  space.by_n = args.sched.group_n;
  space.num_groups = GROUPED ? (u32)args.num_groups : 1u;
  if (GROUPED) {
    build_group_table<Cfg::BM>(sm.table, args.group_rows, space.num_groups, args.m, space.tiles_n);
    space.num_tiles = sm.table->tile_base[space.num_groups];
  } else {
    __syncthreads();
    space.num_tiles = args.sched.num_tiles;
  }
  return space;
}

// Warpgroup 0, one thread: takes tiles from a tile source, publishes them in the tile ring and
// streams their k-blocks. Publishes MK_TILE_DONE last. A source (the engine's scheduler below, or a
// fused op's own order) provides:
//   u32 claim()                         the next claim (a position or a tile id)
//   bool done(u32 claim)                no tiles are left
//   MkTile decode(u32 claim)            the claim's tile
//   void before_loads(const MkTile&)    runs before the tile reaches the consumers and its loads
//                                       are issued (a fused op waits there for the tile's inputs)
//   i32 b_index(const MkTile&)          which B matrix the tile multiplies (grouped mode's group)
template <class Cfg, class Source>
MK_DEV void gemm_producer_loop(const MkGemmArgs& args, const GemmSmem<Cfg>& sm, Source& src) {
  GemmBars<Cfg>* bars = sm.bars;
  const int kblocks = (args.k + Cfg::BK - 1) / Cfg::BK;
  u32 it = 0, tile_it = 0;
  for (;;) {
    const u32 claim = src.claim();
    const bool done = src.done(claim);
    const u32 r = tile_it % Cfg::RING;
    mbar_wait_timed(smem_u32(&bars->tempty[r]), ((tile_it / Cfg::RING) & 1) ^ 1, args.sync, MK_WAIT_TILE);
    MkTile t;
    if (done) {
      t.m0 = t.n0 = t.rows = t.group = 0;
      t.id = MK_TILE_DONE;
      t.pad[0] = t.pad[1] = 0;
    } else {
      t = src.decode(claim);
    }
    t.seq = tile_it;
    if (!done) src.before_loads(t);
    bars->ring[r] = t;
    mbar_arrive(smem_u32(&bars->tfull[r]));
    ++tile_it;
    if (done) break;
    const i32 bi = src.b_index(t);
    for (int kb = 0; kb < kblocks; ++kb, ++it) {
      const int s = it % Cfg::STAGES;
      const u32 full = smem_u32(&bars->full[s]);
      mbar_wait_timed(smem_u32(&bars->empty[s]), ((it / Cfg::STAGES) & 1) ^ 1, args.sync, MK_WAIT_EMPTY);
      mbar_arrive_expect_tx(full, Cfg::STAGE_BYTES);
      const i32 k0 = kb * Cfg::BK;
      tma_load_2d(sm.a(s), &args.a, full, k0, t.m0);
      if (Cfg::BL == MK_B_NK) {
        tma_load_3d(sm.b(s), &args.b, full, k0, t.n0, bi);
      } else {
#pragma unroll
        for (int j = 0; j < Cfg::BN / 64; ++j)
          tma_load_3d(sm.b(s) + j * (64 * Cfg::BK * 2), &args.b, full, t.n0 + 64 * j, k0, bi);
      }
    }
  }
}

// The engine's tile source: the persistent scheduler (tile order, role words), group = B index.
template <class Cfg>
struct MkSchedTiles {
  const MkGemmArgs& args;
  const MkTileSpace<Cfg::BM>& space;
  MK_DEV u32 claim() const { return sched_next(args.sched, space, args.sync); }
  MK_DEV bool done(u32 id) const { return id == MK_TILE_DONE; }
  MK_DEV MkTile decode(u32 id) const { return space.template decode<Cfg::BN>(id); }
  MK_DEV void before_loads(const MkTile&) const {}
  MK_DEV i32 b_index(const MkTile& t) const { return t.group; }
};

template <class Cfg, bool GROUPED>
MK_DEV void gemm_producer(const MkGemmArgs& args, const GemmSmem<Cfg>& sm, const MkTileSpace<Cfg::BM>& space) {
  MkSchedTiles<Cfg> src{args, space};
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

// Warpgroups 1..CONSUMERS (wg = 0..CONSUMERS-1), every thread: for each tile of the ring, the
// mainloop into acc, then epi(acc, tile, wg). Returns after the MK_TILE_DONE entry.
// Epilogue functor interface:
//   epi(float (&acc)[128], const MkTile& t, int wg)  the tile's accumulators, every consumer thread
//   epi.after_issue()  called once per tile inside the next tile's mainloop, right after the
//                      wgmmas of k-block min(2, kblocks - 1) are issued (the tensor cores are
//                      busy): where an epilogue finishes deferred work (TMA store completion and
//                      the previous tile's flag) without stalling the MMA pipe.
template <class Cfg, class Epi>
MK_DEV void gemm_consumer(const MkGemmArgs& args, const GemmSmem<Cfg>& sm, int wg, Epi& epi) {
  GemmBars<Cfg>* bars = sm.bars;
  const int kblocks = (args.k + Cfg::BK - 1) / Cfg::BK;
  const u32 lane = threadIdx.x & 31;
  float acc[128];
  u32 it = 0, tile_it = 0;
  const int pub_kb = kblocks - 1 < 2 ? kblocks - 1 : 2;
  for (;;) {
    const u32 r = tile_it % Cfg::RING;
    mbar_wait_timed(smem_u32(&bars->tfull[r]), (tile_it / Cfg::RING) & 1, args.sync, MK_WAIT_TILE + 1);
    const MkTile t = bars->ring[r];
    mbar_arrive(smem_u32(&bars->tempty[r]));
    ++tile_it;
    if (t.id == MK_TILE_DONE) break;
    const u64 t_start = args.sync.trace_events ? globaltimer_ns() : 0;

    for (int kb = 0; kb < kblocks; ++kb, ++it) {
      const int s = it % Cfg::STAGES;
      mbar_wait_timed(smem_u32(&bars->full[s]), (it / Cfg::STAGES) & 1, args.sync, MK_WAIT_FULL);
#pragma unroll
      for (int i = 0; i < 128; ++i) wgmma_fence_operand(acc[i]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Cfg::BK / 16; ++kk)
        wgmma_m64n256k16<Cfg::DT, Cfg::BL>(acc, gemm_desc_a<Cfg>(sm, s, wg, kk), gemm_desc_b<Cfg>(sm, s, kk),
                                           (kb > 0 || kk > 0) ? 1u : 0u);
      wgmma_commit();
#pragma unroll
      for (int i = 0; i < 128; ++i) wgmma_fence_operand(acc[i]);
      if (kb == pub_kb) {
        epi.after_issue();
        __syncwarp();  // lane 0 may have diverged: converge before the .aligned wait
      }
      wgmma_wait<1>();  // the previous k-block's group is complete: release its stage
      if (kb > 0 && lane == 0) mbar_arrive(smem_u32(&bars->empty[(it + Cfg::STAGES - 1) % Cfg::STAGES]));
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 128; ++i) wgmma_fence_operand(acc[i]);
    if (kblocks > 0 && lane == 0) mbar_arrive(smem_u32(&bars->empty[(it + Cfg::STAGES - 1) % Cfg::STAGES]));
    if (kblocks == 0) {
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    }
    epi(acc, t, wg);
    if (wg == 0 && (threadIdx.x & 127) == 0) trace_span(args.sync, MK_ROLE_COMPUTE, t.id, t_start);
    __syncwarp();  // converge before the next tile's .aligned wgmma instructions
  }
}
