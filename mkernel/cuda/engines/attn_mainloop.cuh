#pragma once
// The attention engine (forward): one producer warpgroup streams Q, K and V with TMA; two
// consumer warpgroups each own 64 query rows of a 128-row tile and run, per key block j,
// S = Q K_j^T (wgmma, Q and K from shared memory), the online softmax in registers, and
// O += P V (wgmma with P from registers, V transposed from shared memory). See docs/ATTENTION.md.
//
// Overlap. Inside a warpgroup, block j's S = Q K_j^T is issued together with block j-1's P V, and
// the softmax of S_j runs while P V still executes. Between the two warpgroups, a ping-pong pair
// of named barriers hands the tensor cores back and forth: a warpgroup issues its two MMAs only in
// its turn, so one warpgroup's softmax runs under the other's MMAs.
//
// Barriers (shared memory, phase parity):
//   q_full   count 1 (+ tx): the tile's Q landed.       q_empty  count 8: every consumer warp's last
//                                                                 Q K^T of the tile completed.
//   k_full[s], v_full[s]   count 1 (+ tx).              k_empty[s], v_empty[s]  count 8 (one lane per
//                                                                 consumer warp, after its MMA completed).
//   tfull[r] count 1 / tempty[r] count 256: the tile ring (AttnTile, claimed by the producer).
// K and V blocks are counted over all tiles of the CTA: block number it uses stage it % STAGES,
// parity (it / STAGES) & 1; the producer waits on 'empty' with the opposite parity.
//
// Reuse by a fused kernel (ring attention): lay out AttnSmem, call attn_setup(), run
// attn_producer() in one thread of warpgroup 0 and attn_consumer() in warpgroups 1 and 2 of the
// CTAs given to attention; the tile source decides which (batch, head, query block, key range)
// tiles these CTAs take, so the other CTAs of the same kernel are free for other roles.
#include "common.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "mbar_wait.cuh"
#include "attn_args.cuh"
#include "attn_softmax.cuh"
#include "tile_scheduler.cuh"

template <int DT_, int D_, bool CAUSAL_>
struct AttnCfg {
  static constexpr int DT = DT_, D = D_;
  static constexpr bool CAUSAL = CAUSAL_;
  static constexpr int BM = 128, BN = 128;  // query rows per tile (64 per consumer), keys per block
  static constexpr int STAGES = 2;
  static constexpr int RING = 2;
  static constexpr int CONSUMERS = 2;
  static constexpr int THREADS = 128 * (1 + CONSUMERS);
  static constexpr int DCHUNKS = D / 64;  // 128-byte swizzle: TMA boxes are 64 elements wide
  static constexpr u32 Q_BYTES = BM * D * 2;
  static constexpr u32 KV_BYTES = BN * D * 2;
  static constexpr u32 O_BYTES = 64 * D * 2;  // one consumer's staging buffer
  static constexpr u32 OFF_Q = 0;
  static constexpr u32 OFF_K = OFF_Q + Q_BYTES;
  static constexpr u32 OFF_V = OFF_K + STAGES * KV_BYTES;
  static constexpr u32 OFF_O = OFF_V + STAGES * KV_BYTES;
  static constexpr u32 OFF_BAR = OFF_O + CONSUMERS * O_BYTES;
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = 232;
  MK_STATIC_ASSERT(D == 64 || D == 128, "head dim 64 or 128");
  MK_STATIC_ASSERT(PRODUCER_REGS * 128 + CONSUMER_REGS * 128 * CONSUMERS <= mk_cta_register_pool(THREADS),
                   "register budget");
};

// Named barriers: 0 is __syncthreads; the ping-pong pair; one per consumer for its epilogue.
enum : u32 { MK_BAR_TURN = 1, MK_BAR_EPI = 3 };

// One tile as the producer hands it to the consumers.
struct AttnTile {
  i32 b, h, q0;  // batch, query head, first query row
  i32 blocks;  // key blocks to visit (0: no key visible to any row of the tile)
  u32 id;  // MK_TILE_DONE after the last tile
  u32 step;  // ring attention: which key/value block (0: the rank's own); 0 otherwise
  u32 pad[2];
  MkAttnPos kpos;  // causal: positions of this tile's keys
};

MK_DEV int attn_pos(const MkAttnPos& p, int i) { return i + (i < p.half ? p.off0 : p.off1); }

// Key blocks a causal tile visits: positions increase with the key index, so the visible keys of
// the tile's last row (the largest position) are a prefix of the keys.
template <int BN>
MK_DEV int attn_causal_blocks(const MkAttnPos& kp, int seq_kv, int last_row_pos) {
  const int end0 = min(kp.half, seq_kv);  // keys of the first segment: [0, end0)
  int last = min(end0 - 1, last_row_pos - kp.off0);
  if (end0 < seq_kv) {
    const int last1 = min(seq_kv - 1, last_row_pos - kp.off1);
    if (last1 >= end0) last = last1;
  }
  return last < 0 ? 0 : last / BN + 1;
}

template <class Cfg>
struct AttnBars {
  u64 q_full, q_empty;
  u64 k_full[Cfg::STAGES], k_empty[Cfg::STAGES];
  u64 v_full[Cfg::STAGES], v_empty[Cfg::STAGES];
  u64 tfull[Cfg::RING], tempty[Cfg::RING];
  AttnTile ring[Cfg::RING];
  u32 epoch;
};

template <class Cfg>
__host__ __device__ constexpr u32 attn_smem_bytes() {
  return Cfg::OFF_BAR + (u32)sizeof(AttnBars<Cfg>) + 1024u;
}

template <class Cfg>
struct AttnSmem {
  u8* base;  // 1024-byte aligned
  AttnBars<Cfg>* bars;
  MK_DEV u32 q() const { return smem_u32(base) + Cfg::OFF_Q; }
  MK_DEV u32 k(int s) const { return smem_u32(base) + Cfg::OFF_K + s * Cfg::KV_BYTES; }
  MK_DEV u32 v(int s) const { return smem_u32(base) + Cfg::OFF_V + s * Cfg::KV_BYTES; }
  MK_DEV u32 o(int wg) const { return smem_u32(base) + Cfg::OFF_O + wg * Cfg::O_BYTES; }
};

template <class Cfg>
MK_DEV AttnSmem<Cfg> attn_smem_carve(u8* dyn) {
  AttnSmem<Cfg> sm;
  const u32 addr = smem_u32(dyn);
  sm.base = dyn + (((addr + 1023u) & ~1023u) - addr);
  sm.bars = reinterpret_cast<AttnBars<Cfg>*>(sm.base + Cfg::OFF_BAR);
  return sm;
}

// The engine's tile space. Tile ids walk each (batch, head) through its query blocks, so the CTAs
// running at one time share that head's K and V in L2; causal tiles go longest first inside a head
// (the last query blocks see the most keys), which also balances the persistent CTAs' work.
// decode(local id, step, key positions) is shared with ring attention (one tile space per step).
struct AttnTileSpace {
  const MkAttnArgs& args;
  u32 num_tiles;
  MK_DEV u32 builtin_id(u32 pos) const { return pos; }
  template <class Cfg>
  MK_DEV AttnTile decode(u32 id, u32 step, const MkAttnPos& kpos) const {
    const u32 qb_raw = id % args.q_blocks, bh = id / args.q_blocks;
    const u32 qb = Cfg::CAUSAL ? args.q_blocks - 1 - qb_raw : qb_raw;
    AttnTile t;
    t.h = (i32)(bh % (u32)args.heads_q);
    t.b = (i32)(bh / (u32)args.heads_q);
    t.q0 = (i32)(qb * Cfg::BM);
    if (Cfg::CAUSAL) {
      const int last_row = min(t.q0 + Cfg::BM, args.seq_q) - 1;
      t.blocks = attn_causal_blocks<Cfg::BN>(kpos, args.seq_kv, attn_pos(args.qpos, last_row));
    } else {
      t.blocks = (args.seq_kv + Cfg::BN - 1) / Cfg::BN;
    }
    t.id = id;
    t.step = step;
    t.pad[0] = t.pad[1] = 0;
    t.kpos = kpos;
    return t;
  }
};

// The plain engine's tile source: every tile against args.k / args.v.
//   claim() -> tile id or MK_TILE_DONE;  decode(id);  before_loads(tile) (a fused op waits there
//   for the tile's keys and values);  kmap(tile), vmap(tile): the tensor maps to load them from.
template <class Cfg>
struct AttnPlainTiles {
  const MkAttnArgs& args;
  const AttnTileSpace& space;
  MK_DEV u32 claim() const { return sched_next(args.sched, space, args.sync); }
  MK_DEV AttnTile decode(u32 id) const { return space.template decode<Cfg>(id, 0, args.kpos); }
  MK_DEV void before_loads(const AttnTile&) const {}
  MK_DEV const TmaDesc* kmap(const AttnTile&) const { return &args.k; }
  MK_DEV const TmaDesc* vmap(const AttnTile&) const { return &args.v; }
};

// All threads: barrier initialisation and the epoch. Ends with __syncthreads.
template <class Cfg>
MK_DEV void attn_setup(const MkAttnArgs& args, const AttnSmem<Cfg>& sm) {
  AttnBars<Cfg>* bars = sm.bars;
  if (threadIdx.x == 0) {
    mbar_init(smem_u32(&bars->q_full), 1);
    mbar_init(smem_u32(&bars->q_empty), Cfg::CONSUMERS * 4);
    for (int s = 0; s < Cfg::STAGES; ++s) {
      mbar_init(smem_u32(&bars->k_full[s]), 1);
      mbar_init(smem_u32(&bars->v_full[s]), 1);
      mbar_init(smem_u32(&bars->k_empty[s]), Cfg::CONSUMERS * 4);
      mbar_init(smem_u32(&bars->v_empty[s]), Cfg::CONSUMERS * 4);
    }
    for (int r = 0; r < Cfg::RING; ++r) {
      mbar_init(smem_u32(&bars->tfull[r]), 1);
      mbar_init(smem_u32(&bars->tempty[r]), Cfg::CONSUMERS * 128);
    }
    bars->epoch = launch_epoch(args.sync);
    mbar_fence_init();
    tma_prefetch_desc(&args.q);
    tma_prefetch_desc(&args.k);
    tma_prefetch_desc(&args.v);
    tma_prefetch_desc(&args.o);
  }
  __syncthreads();
}

// Warpgroup 0, one thread: takes tiles from the source, publishes them in the tile ring, streams
// Q, K and V.
template <class Cfg, class Src>
MK_DEV void attn_producer(const MkAttnArgs& args, const AttnSmem<Cfg>& sm, const Src& src) {
  AttnBars<Cfg>* bars = sm.bars;
  const int group = args.heads_q / args.heads_kv;
  u32 it = 0, tile_it = 0, q_it = 0;
  bool loads = true;  // false once a stage's bytes never landed: no stage is armed again
  for (;;) {
    const u32 id = src.claim();
    const u32 r = tile_it % Cfg::RING;
    mbar_wait_timed(smem_u32(&bars->tempty[r]), ((tile_it / Cfg::RING) & 1) ^ 1, args.sync, MK_WAIT_TILE);
    AttnTile t;
    if (id == MK_TILE_DONE) {
      t.b = t.h = t.q0 = t.blocks = 0;
      t.id = MK_TILE_DONE;
      t.step = t.pad[0] = t.pad[1] = 0;
      t.kpos = args.kpos;
    } else {
      t = src.decode(id);
      if (t.blocks > 0) src.before_loads(t);
    }
    bars->ring[r] = t;
    mbar_arrive(smem_u32(&bars->tfull[r]));
    ++tile_it;
    if (id == MK_TILE_DONE) break;
    if (t.blocks == 0) continue;
    const i32 hk = t.h / group;
    const TmaDesc* kmap = src.kmap(t);
    const TmaDesc* vmap = src.vmap(t);
    const u32 qf = smem_u32(&bars->q_full);
    const u32 qph = (q_it & 1) ^ 1;
    ++q_it;
    mbar_wait_timed(smem_u32(&bars->q_empty), qph, args.sync, MK_WAIT_EMPTY);
    if ((loads = loads && mbar_can_arm(qf, qph, args.sync, MK_WAIT_LANDED))) {
      mbar_arrive_expect_tx(qf, Cfg::Q_BYTES);
#pragma unroll
      for (int c = 0; c < Cfg::DCHUNKS; ++c)
        tma_load_4d(sm.q() + c * (Cfg::BM * 128), &args.q, qf, 64 * c, t.q0, t.h, t.b);
    }
    for (int j = 0; j < t.blocks; ++j, ++it) {
      const int s = it % Cfg::STAGES;
      const u32 ph = ((it / Cfg::STAGES) & 1) ^ 1;
      const u32 kf = smem_u32(&bars->k_full[s]), vf = smem_u32(&bars->v_full[s]);
      mbar_wait_timed(smem_u32(&bars->k_empty[s]), ph, args.sync, MK_WAIT_EMPTY + 1);
      if ((loads = loads && mbar_can_arm(kf, ph, args.sync, MK_WAIT_LANDED + 1))) {
        mbar_arrive_expect_tx(kf, Cfg::KV_BYTES);
#pragma unroll
        for (int c = 0; c < Cfg::DCHUNKS; ++c)
          tma_load_4d(sm.k(s) + c * (Cfg::BN * 128), kmap, kf, 64 * c, j * Cfg::BN, hk, t.b);
      }
      mbar_wait_timed(smem_u32(&bars->v_empty[s]), ph, args.sync, MK_WAIT_EMPTY + 2);
      if ((loads = loads && mbar_can_arm(vf, ph, args.sync, MK_WAIT_LANDED + 2))) {
        mbar_arrive_expect_tx(vf, Cfg::KV_BYTES);
#pragma unroll
        for (int c = 0; c < Cfg::DCHUNKS; ++c)
          tma_load_4d(sm.v(s) + c * (Cfg::BN * 128), vmap, vf, 64 * c, j * Cfg::BN, hk, t.b);
      }
    }
  }
  mbar_drain_landed(smem_u32(&bars->k_full[0]), Cfg::STAGES, it);
  mbar_drain_landed(smem_u32(&bars->v_full[0]), Cfg::STAGES, it);
  mbar_drain_landed(smem_u32(&bars->q_full), 1, q_it);
}

// Shared-memory descriptors (128-byte swizzle; every box is BM or BN rows of 128 bytes).
// Q (A, K-major): consumer wg's 64 rows, k-step kk of the head dim.
template <class Cfg>
MK_DEV u64 attn_desc_q(const AttnSmem<Cfg>& sm, int wg, int kk) {
  return wgmma_desc(sm.q() + (kk / 4) * (Cfg::BM * 128) + wg * (64 * 128) + (kk % 4) * 32, 16, 1024);
}
// K (B of Q K^T, K-major: rows are keys), k-step kk of the head dim.
template <class Cfg>
MK_DEV u64 attn_desc_k(const AttnSmem<Cfg>& sm, int s, int kk) {
  return wgmma_desc(sm.k(s) + (kk / 4) * (Cfg::BN * 128) + (kk % 4) * 32, 16, 1024);
}
// V (B of P V, MN-major: the head dim is contiguous), k-step kk over keys. LBO: next 64 columns.
template <class Cfg>
MK_DEV u64 attn_desc_v(const AttnSmem<Cfg>& sm, int s, int kk) {
  return wgmma_desc(sm.v(s) + kk * (16 * 128), Cfg::BN * 128, 1024);
}

template <int N>
MK_DEV void fence_acc(float (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) wgmma_fence_operand(a[i]);
}

// One consumer's 64 rows of a finished tile: O / l through a 128B-swizzled staging buffer and a
// TMA store (rows past seq_q are clipped by the tensor map), and the log-sum-exp when asked.
template <class Cfg>
MK_DEV void attn_epilogue(const MkAttnArgs& args, const AttnSmem<Cfg>& sm, int wg, const AttnTile& t,
                          const AttnRows& st, const float (&o)[Cfg::D / 2], int row0) {
  const u32 tid = threadIdx.x & 127, lane = tid & 31, warp = tid / 32;
  float inv[2], lse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(st.l[r]);
    inv[r] = l > 0.f ? 1.f / l : 0.f;
    lse[r] = l > 0.f ? st.m[r] * args.scale + __logf(l) : MK_NEG_INF;
  }
  if (tid == 0) bulk_wait_read<0>();  // the previous tile's store has read the staging buffer
  named_bar_sync(MK_BAR_EPI + wg, 128);
  const u32 base = sm.o(wg);
#pragma unroll
  for (int j = 0; j < Cfg::D / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u32 row = warp * 16 + lane / 4 + 8 * h;  // row & 7 == lane / 4
      const u32 addr = base + (j / 8) * (64 * 128) + row * 128 + ((u32)(j % 8) ^ (lane / 4)) * 16 + 4 * (lane & 3);
      const u32 v = pack2<Cfg::DT>(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]);
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
    }
  }
  fence_proxy_async_smem();
  named_bar_sync(MK_BAR_EPI + wg, 128);
  if (tid == 0) {
#pragma unroll
    for (int c = 0; c < Cfg::DCHUNKS; ++c)
      tma_store_4d(&args.o, base + c * (64 * 128), 64 * c, t.q0 + wg * 64, t.h, t.b);
    bulk_commit();
  }
  if (args.lse && (lane & 3) == 0) {
    float* out = args.lse + ((i64)t.b * args.heads_q + t.h) * args.seq_q;
    if (row0 < args.seq_q) out[row0] = lse[0];
    if (row0 + 8 < args.seq_q) out[row0 + 8] = lse[1];
  }
}

// The plain engine's epilogue: normalise, store O (and the log-sum-exp).
template <class Cfg>
struct AttnStoreEpi {
  const MkAttnArgs& args;
  const AttnSmem<Cfg>& sm;
  MK_DEV void operator()(const AttnTile& t, const AttnRows& st, const float (&o)[Cfg::D / 2], int row0, int wg) const {
    attn_epilogue<Cfg>(args, sm, wg, t, st, o, row0);
  }
};

// Warpgroups 1..2 (wg = 0, 1), every thread. epi(tile, rows, o, row0, wg) receives each finished
// tile: the unnormalised O of this thread's fragment, the running maxima and partial row sums.
template <class Cfg, class Epi>
MK_DEV void attn_consumer(const MkAttnArgs& args, const AttnSmem<Cfg>& sm, int wg, const Epi& epi) {
  constexpr int BN = Cfg::BN, D = Cfg::D, DT = Cfg::DT;
  AttnBars<Cfg>* bars = sm.bars;
  const u32 lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3, tid = threadIdx.x & 127;
  const MkSync& sync = args.sync;
  const float sl2 = args.scale_log2;
  const u32 my_turn = MK_BAR_TURN + wg, other_turn = MK_BAR_TURN + (wg ^ 1);
  if (wg == 1) named_bar_arrive(MK_BAR_TURN, 2 * 128);  // warpgroup 0 takes the first turn
  float s[BN / 2], o[D / 2];
  u32 p[BN / 16][4];
  u32 it = 0, tile_it = 0, q_it = 0;
  for (;;) {
    const u32 r = tile_it % Cfg::RING;
    mbar_wait_timed(smem_u32(&bars->tfull[r]), (tile_it / Cfg::RING) & 1, sync, MK_WAIT_TILE + 1);
    const AttnTile t = bars->ring[r];
    mbar_arrive(smem_u32(&bars->tempty[r]));
    ++tile_it;
    if (t.id == MK_TILE_DONE) break;
    const int row0 = t.q0 + wg * 64 + (int)(warp * 16 + lane / 4);  // this thread's rows: row0, row0 + 8
    const int lim0 = attn_pos(args.qpos, row0), lim1 = attn_pos(args.qpos, row0 + 8);  // positions
    const int first_pos = attn_pos(args.qpos, t.q0 + wg * 64);
    AttnRows st;
    st.m[0] = st.m[1] = MK_NEG_INF;
    st.l[0] = st.l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    if (t.blocks > 0) {
      mbar_wait_timed(smem_u32(&bars->q_full), q_it & 1, sync, MK_WAIT_FULL);
      ++q_it;
      // wgmma batches are kept out of data-dependent branches (ptxas serialises them otherwise):
      // block 0 is peeled, and lane-0 work is followed by __syncwarp.
      auto stage = [&](int j) { return (int)((it + j) % Cfg::STAGES); };
      auto parity = [&](int j) { return ((it + j) / Cfg::STAGES) & 1; };
      auto issue_s = [&](int sk) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
          wgmma_ss<DT, 0>(s, attn_desc_q<Cfg>(sm, wg, kk), attn_desc_k<Cfg>(sm, sk, kk), kk > 0 ? 1u : 0u);
        wgmma_commit();
      };
      auto issue_pv = [&](int sv) {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs<DT, 1>(o, p[kk], attn_desc_v<Cfg>(sm, sv, kk), 1u);
        wgmma_commit();
      };
      auto scores_done = [&](int j) {  // S of block j is in registers: release K (and Q after the last)
        fence_acc(s);
        if (lane == 0) {
          mbar_arrive(smem_u32(&bars->k_empty[stage(j)]));
          if (j == t.blocks - 1) mbar_arrive(smem_u32(&bars->q_empty));
        }
        __syncwarp();
        const int key0 = j * BN;
        if (key0 + BN > args.seq_kv || (Cfg::CAUSAL && attn_pos(t.kpos, min(key0 + BN, args.seq_kv) - 1) > first_pos))
          attn_mask<BN, Cfg::CAUSAL>(s, key0, args.seq_kv, t.kpos, lim0, lim1);
      };
      auto pv_done = [&](int j) {  // P V of block j is complete: release V
        fence_acc(o);
        if (lane == 0) mbar_arrive(smem_u32(&bars->v_empty[stage(j)]));
        __syncwarp();
      };
      float alpha[2];
      mbar_wait_timed(smem_u32(&bars->k_full[stage(0)]), parity(0), sync, MK_WAIT_FULL + 1);
      __syncwarp();
      named_bar_sync(my_turn, 2 * 128);
      fence_acc(s);
      wgmma_fence();
      issue_s(stage(0));
      named_bar_arrive(other_turn, 2 * 128);
      wgmma_wait<0>();
      scores_done(0);
      attn_softmax_block<BN>(s, st, sl2, alpha, true);
      attn_pack_p<DT, BN>(s, p);
      for (int j = 1; j < t.blocks; ++j) {
        mbar_wait_timed(smem_u32(&bars->k_full[stage(j)]), parity(j), sync, MK_WAIT_FULL + 1);
        mbar_wait_timed(smem_u32(&bars->v_full[stage(j - 1)]), parity(j - 1), sync, MK_WAIT_FULL + 2);
        __syncwarp();
        named_bar_sync(my_turn, 2 * 128);
        fence_acc(s);
        fence_acc(o);
        wgmma_fence();
        issue_s(stage(j));
        issue_pv(stage(j - 1));
        named_bar_arrive(other_turn, 2 * 128);
        wgmma_wait<1>();  // S of block j is ready; P V of block j-1 may still run
        scores_done(j);
        attn_softmax_block<BN>(s, st, sl2, alpha, false);
        wgmma_wait<0>();
        pv_done(j - 1);
        attn_rescale<D>(o, alpha);
        attn_pack_p<DT, BN>(s, p);
      }
      const int last = t.blocks - 1;
      mbar_wait_timed(smem_u32(&bars->v_full[stage(last)]), parity(last), sync, MK_WAIT_FULL + 2);
      __syncwarp();
      fence_acc(o);
      wgmma_fence();
      issue_pv(stage(last));
      wgmma_wait<0>();
      pv_done(last);
      it += t.blocks;
    }
    epi(t, st, o, row0, wg);
  }
  if (tid == 0) bulk_wait<0>();  // the last tile's stores are done before the CTA exits
}
