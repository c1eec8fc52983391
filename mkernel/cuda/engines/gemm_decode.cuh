// The decode GEMM: out[m, n] = a[m, k] . b[n, k] for few rows m (tokens, at most 256), bound by
// reading the weights b once. Swap-AB on wgmma m64nMTk16: b's rows take the 64-row side, the tokens
// the MT-column side, both operands from shared memory. A CTA is ROWS / 64 consumer warpgroups (64
// rows of b each: a row block of ROWS) and two producer warps, one thread of each streaming
// 64-element k-blocks with TMA (128B swizzle): b's ROWS rows into ring B, a's MT token rows into ring A.
//
// Runs: the (row block, k-block) units, row block major, are cut into args.ctas equal runs, one per
// CTA (blockIdx.x; the host picks a multiple of the row blocks, or stream-K's one per SM); a
// function of the shape only, so the bits are the same on any number of SMs. A row block that one
// CTA covers whole is stored at once; one shared by several: each stores its fp32 partial in its
// slot (its rank among the block's CTAs) and the last to arrive adds the slots in slot order and
// stores out: bitwise reproducible run to run.
//
// Barriers, per ring: full[s] (count 1: the producer's arrive.expect_tx; TMA completes it), empty[s]
// (lane 0 of each consumer warp once its wgmma group on use i is complete). Use i (over the CTA's
// whole run) takes stage i % STAGES at parity (i / STAGES) & 1; the producer waits for 'empty' at
// the opposite parity.
//
// Template parameters: DT (MK_DT_BF16 / MK_DT_F16), MT (token columns: 8 .. 256, M_TILES of
// gemm_decode.py), ROWS (64 or 128), Epi (what becomes of the finished values: the engine's store,
// gemm_decode.cu; gemm_allreduce's push to every rank, ops/gemm_allreduce_ll.cu). One CTA per SM.
#pragma once
#include "common.cuh"
#include "tma.cuh"
#include "mbar_wait.cuh"
#include "wgmma.cuh"
#include "cluster.cuh"
#include "gemm_args.cuh"
#include "gemm_decode_args.cuh"

template <int MT, int ROWS_, int CL_ = 1>
struct DecodeCfg {
  static constexpr int ROWS = ROWS_;
  static constexpr int CL = CL_;  // CTAs of a cluster: each loads MT / CL token rows for all of them
  static constexpr int WARPS = ROWS / 16;  // consumer warps: ROWS / 64 warpgroups
  static constexpr int CONSUMERS = 32 * WARPS;
  static constexpr int ACC = MT / 2;  // fp32 accumulators per consumer thread (m64nMT)
  static constexpr int THREADS = CONSUMERS + 64;  // the consumers, then b's and a's producer warps
  static constexpr int BLOCKS = MT / 8;  // n8 column blocks of tokens
  static constexpr u32 B_BYTES = ROWS * MK_DECODE_BK * 2;  // ROWS rows x 128 B
  static constexpr u32 A_BYTES = MT * MK_DECODE_BK * 2;  // MT rows x 128 B
  static constexpr u32 A_SLICE_BYTES = A_BYTES / CL;  // this CTA's multicast share
  // Two rings: 128 KiB of b (from DRAM: its bytes in flight set the rate) and up to 8 stages
  // within 96 KiB of a (L2 hits, reused by every CTA: a short lead suffices).
  static constexpr int STAGES_B = (int)(128u * 1024u / B_BYTES);
  static constexpr int STAGES_A = (int)(8u * A_BYTES <= 96u * 1024u ? 8u : 96u * 1024u / A_BYTES);
  static constexpr u32 OFF_A = STAGES_B * B_BYTES;
  static constexpr u32 OFF_BAR = OFF_A + STAGES_A * A_BYTES;  // full_b, empty_b, full_a, empty_a
  // dynamic bytes with alignment slack (gemm_decode.smem_bytes computes the same on the host; the
  // kernel checks what it was given)
  static constexpr u32 SMEM = OFF_BAR + 16 * (STAGES_B + STAGES_A) + 1024;
  static constexpr u32 SLOT = MT * ROWS;  // floats of one partial slot
  MK_STATIC_ASSERT(ROWS == 64 || ROWS == 128, "row blocks of 64 or 128");
  MK_STATIC_ASSERT(MT % 8 == 0 && MT <= 256, "wgmma takes 8 .. 256 columns in steps of 8");
  MK_STATIC_ASSERT(A_SLICE_BYTES % 1024 == 0, "stages and slices stay 1 KiB aligned (the 128B swizzle's period)");
  MK_STATIC_ASSERT(CL == 1 || CL == 2 || CL == 4, "clusters of 1, 2 or 4 CTAs");
  MK_STATIC_ASSERT(STAGES_A >= 2 && SMEM <= 227u * 1024u, "one CTA per SM");
};

// Bytes of dynamic shared memory the launch gave this CTA.
MK_DEV u32 dynamic_smem_bytes() {
  u32 r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}

// The consumers' barrier (named barrier 1; the producer warp never takes part): for epilogues.
template <int CONSUMERS>
struct DecodeBar {
  MK_DEV void operator()() const { named_bar_sync(1, CONSUMERS); }
};

// An arrival that publishes what this thread observed (bar.sync included: the CTA's slot stores
// before it) and acquires the earlier arrivals' (the last arrival reads every CTA's slot).
MK_DEV u32 atom_add_acq_rel_gpu(u32* p, u32 v) {
  u32 old;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// Two 16-bit values to float (low half first).
template <int DT>
MK_DEV float half_to_float(u16 h) {
  if (DT == MK_DT_BF16) return __uint_as_float((u32)h << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

template <int OUT>
MK_DEV float load_out(const void* out, u64 i) {
  if (OUT == MK_OUT_F32) return reinterpret_cast<const float*>(out)[i];
  const u16 h = reinterpret_cast<const u16*>(out)[i];
  return half_to_float < OUT == MK_OUT_BF16 ? MK_DT_BF16 : MK_DT_F16 > (h);
}

template <int OUT>
MK_DEV void store_out(void* out, u64 i, float v) {
  if (OUT == MK_OUT_F32) {
    reinterpret_cast<float*>(out)[i] = v;
  } else if (OUT == MK_OUT_BF16) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
    reinterpret_cast<u16*>(out)[i] = h;
  } else {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    reinterpret_cast<u16*>(out)[i] = h;
  }
}

// The stream-K cut: CTA c's run is units [start(c), start(c + 1)), start(c) = c * U / C; the CTA
// whose run holds unit x is (x * C + C - 1) / U (ctas <= units: no run is empty).
MK_DEV u64 decode_run_start(u64 c, u64 units, u64 ctas) { return c * units / ctas; }
MK_DEV u32 decode_cta_of(u64 x, u64 units, u64 ctas) { return (u32)(((x + 1) * ctas - 1) / units); }

// A producer thread: every k-block of the CTA's run into one ring (b's boxes, or a's), stage bytes
// `bytes` each, barriers full0[STAGES] then empty0[STAGES]. A's ring in a cluster of CL: this CTA's
// MT / CL token rows into every CTA's stage (their empty barriers count every CTA's consumers).
template <int STAGES, bool B, int CL = 1>
MK_DEV void decode_produce(const MkDecodeArgs& args, u32 ring, u32 bytes, u32 full0, u32 rows, u64 u0, u64 u1) {
  const u64 kb = (u64)args.kblocks;
  const u32 empty0 = full0 + 8 * STAGES;
  u32 it = 0, rb = (u32)(u0 / kb), kk = (u32)(u0 - rb * kb);  // unit u = (row block rb, k-block kk)
  bool loads = true;  // false once a stage's bytes never landed: no stage is armed again
  for (u64 u = u0; u < u1; ++u, ++it) {
    const u32 s = it % STAGES, ph = ((it / STAGES) & 1) ^ 1;
    mbar_wait_timed(empty0 + 8 * s, ph, args.sync, MK_WAIT_EMPTY);
    loads = loads && mbar_can_arm(full0 + 8 * s, ph, args.sync, MK_WAIT_LANDED);
    if (loads) {
      mbar_arrive_expect_tx(full0 + 8 * s, bytes);
      if (B) {
        tma_load_2d(ring + s * bytes, &args.b_map, full0 + 8 * s, (i32)kk * MK_DECODE_BK, (i32)(rb * rows));
      } else if (CL == 1) {
        tma_load_3d(ring + s * bytes, &args.a_map, full0 + 8 * s, (i32)kk * MK_DECODE_BK, 0, 0);
      } else {
        const u32 q = cluster_ctarank(), slice = bytes / CL;
        tma_load_3d_multicast(ring + s * bytes + q * slice, &args.a_map, full0 + 8 * s, (i32)kk * MK_DECODE_BK,
                              (i32)(q * (slice / 128)), 0, (u16)((1u << CL) - 1));
      }
    }
    if (++kk == (u32)kb) kk = 0, ++rb;
  }
  mbar_drain_landed(full0, STAGES, it);
}

// Lane 0 of a consumer warp: use i's stages (b's, and a's in every CTA of the cluster) may be refilled.
template <class Cfg>
MK_DEV void decode_release(u32 empty_b, u32 empty_a, u32 i) {
  mbar_arrive(empty_b + 8 * (i % Cfg::STAGES_B));
  if (Cfg::CL == 1) {
    mbar_arrive(empty_a + 8 * (i % Cfg::STAGES_A));
    return;
  }
#pragma unroll
  for (u32 q = 0; q < (u32)Cfg::CL; ++q) mbar_arrive_remote(empty_a + 8 * (i % Cfg::STAGES_A), q);
}

// Run of CTA x of a cluster launch (even runs: C = blocks x per, run b x per + r on block b): the CL
// CTAs of a cluster take the same run r of CL consecutive row blocks, so they stream the same
// k-blocks of a in step. Without clusters the run is x.
template <int CL>
MK_DEV u64 decode_run_of(u64 x, u64 blocks, u64 C) {
  if (CL == 1) return x;
  const u64 per = C / blocks, q = x / CL, m = x % CL;
  return ((q / per) * CL + m) * per + q % per;
}

// The consumer warpgroups of decode_gemm: the wgmma mainloop over the run [u0, u1) of CTA run
// `cta`, then each finished row block's epilogue (or its partial and, last, the sum of the slots).
template <int DT, class Cfg, class Epi>
MK_DEV void decode_consumers(const MkDecodeArgs& args, Epi& epi, u32 smem, u64 cta, u64 u0, u64 u1) {
  __shared__ u32 s_last;
  const u32 full_b = smem + Cfg::OFF_BAR, empty_b = full_b + 8 * Cfg::STAGES_B;
  const u32 full_a = empty_b + 8 * Cfg::STAGES_B, empty_a = full_a + 8 * Cfg::STAGES_A;
  const u64 kb = (u64)args.kblocks, blocks = ((u64)args.n + Cfg::ROWS - 1) / Cfg::ROWS;
  const u64 units = blocks * kb, C = (u64)args.ctas;
  const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const u32 g = lane >> 2, t = lane & 3, wg = warp >> 2;
  const DecodeBar<Cfg::CONSUMERS> bar{};
  float acc[Cfg::ACC];  // acc[4j + i]: row r0 (i < 2) or r1, tokens 8j + 2t + (i & 1)
  u32 it = 0;
  for (u64 u = u0; u < u1;) {
    __syncwarp();  // the last block's epilogue may have diverged: converge before .aligned wgmma
    const u64 rb = u / kb, kend = (rb + 1) * kb < u1 ? (rb + 1) * kb : u1;
    const u32 it0 = it;
#pragma unroll
    for (int i = 0; i < Cfg::ACC; ++i) acc[i] = 0.f;
    for (; u < kend; ++u, ++it) {
      const u32 s = it % Cfg::STAGES_B, sa_i = it % Cfg::STAGES_A;
      mbar_wait_timed(full_b + 8 * s, (it / Cfg::STAGES_B) & 1, args.sync, MK_WAIT_FULL);
      mbar_wait_timed(full_a + 8 * sa_i, (it / Cfg::STAGES_A) & 1, args.sync, MK_WAIT_FULL + 1);
      const u32 sb = smem + s * Cfg::B_BYTES + wg * (64 * 128), sa = smem + Cfg::OFF_A + sa_i * Cfg::A_BYTES;
#pragma unroll
      for (int i = 0; i < Cfg::ACC; ++i) wgmma_fence_operand(acc[i]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < MK_DECODE_BK / 16; ++kk)
        wgmma_ss<DT, 0>(acc, wgmma_desc(sb + kk * 32, 16, 1024), wgmma_desc(sa + kk * 32, 16, 1024), 1u);
      wgmma_commit();
#pragma unroll
      for (int i = 0; i < Cfg::ACC; ++i) wgmma_fence_operand(acc[i]);
      wgmma_wait<1>();  // the previous k-block's group is complete: release its stages
      if (it > it0 && lane == 0) decode_release<Cfg>(empty_b, empty_a, it - 1);
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < Cfg::ACC; ++i) wgmma_fence_operand(acc[i]);
    if (lane == 0) decode_release<Cfg>(empty_b, empty_a, it - 1);

    const u64 r0 = rb * Cfg::ROWS + warp * 16 + g, r1 = r0 + 8;
    const u32 first = decode_cta_of(rb * kb, units, C), n_ctas = decode_cta_of((rb + 1) * kb - 1, units, C) - first + 1;
    if (n_ctas == 1) {
      if (epi.ready(bar))
#pragma unroll
        for (int j = 0; j < Cfg::BLOCKS; ++j) {
          const float v[4] = {acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]};
          epi.finish(j, (u64)j * 8 + 2 * t, r0, r1, v);
        }
      continue;
    }
    // Slots in fragment order (the reader is the same thread of the last CTA): coalesced both ways.
    const u64 block_at = rb * (u64)args.slots;
    float* mine = args.partial + (block_at + (cta - first)) * Cfg::SLOT + threadIdx.x;
#pragma unroll
    for (int i = 0; i < Cfg::ACC; ++i) __stcg(mine + i * Cfg::CONSUMERS, acc[i]);
    bar();  // every thread's slot stores precede thread 0's release
    u32* count = args.counts + rb;
    if (threadIdx.x == 0) s_last = atom_add_acq_rel_gpu(count, 1u) + 1 == n_ctas;
    bar();  // the last arrival's acquire precedes every thread's slot reads
    if (!s_last) continue;
    if (threadIdx.x == 0) *count = 0;  // zero for the next launch (stream ordered)
    if (!epi.ready(bar)) continue;
    const float* slot0 = args.partial + block_at * Cfg::SLOT + threadIdx.x;
#pragma unroll
    for (int j = 0; j < Cfg::BLOCKS; ++j) {
      float v[4] = {0.f, 0.f, 0.f, 0.f};
      for (u32 c = 0; c < n_ctas; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] += __ldcg(slot0 + (u64)c * Cfg::SLOT + (j * 4 + e) * Cfg::CONSUMERS);
      epi.finish(j, (u64)j * 8 + 2 * t, r0, r1, v);
    }
  }
}

// The decode GEMM of one CTA (DecodeCfg<MT, ROWS, CL>::THREADS threads, ::SMEM bytes of dynamic
// shared memory; CL > 1: a cluster launch whose grid is planned by gemm_decode.runs with every
// CL consecutive row blocks alike). Epi: begin() first (every thread); then per row block this CTA
// finishes (covered whole, or the last of its CTAs to arrive) ready(bar) (every consumer thread;
// bar() syncs them; false skips the stores) and finish(j, tok, r0, r1, v) per token block j:
// v[0..1] the values of row r0 and tokens tok, tok + 1, v[2..3] those of row r1 (tokens past m and
// rows past n included: Epi skips them).
template <int DT, int MT, int ROWS, int CL = 1, class Epi>
MK_DEV void decode_gemm(const MkDecodeArgs& args, Epi& epi) {
  using Cfg = DecodeCfg<MT, ROWS, CL>;
  extern __shared__ __align__(1024) u8 decode_dyn[];
  const u32 raw = smem_u32(decode_dyn), smem = (raw + 1023u) & ~1023u;
  const u32 full_b = smem + Cfg::OFF_BAR, empty_b = full_b + 8 * Cfg::STAGES_B;
  const u32 full_a = empty_b + 8 * Cfg::STAGES_B, empty_a = full_a + 8 * Cfg::STAGES_A;
  if (threadIdx.x == 0) {
    for (int s = 0; s < Cfg::STAGES_B; ++s) {
      mbar_init(full_b + 8 * s, 1);
      mbar_init(empty_b + 8 * s, Cfg::WARPS);
    }
    for (int s = 0; s < Cfg::STAGES_A; ++s) {
      mbar_init(full_a + 8 * s, 1);
      mbar_init(empty_a + 8 * s, Cfg::WARPS * CL);
    }
    mbar_fence_init();
  }
  if (threadIdx.x == Cfg::CONSUMERS) {
    tma_prefetch_desc(&args.a_map);
    tma_prefetch_desc(&args.b_map);
  }
  epi.begin();
  // The launch gave less shared memory than the rings need: an error, not a write past it.
  const bool short_smem = dynamic_smem_bytes() < Cfg::SMEM;
  if (short_smem && threadIdx.x == 0)
    record_error(args.sync, MK_ERR_INPUT, -1, MK_WAIT_FULL, Cfg::SMEM, dynamic_smem_bytes(), 0);
  if (CL > 1)
    cluster_sync();  // no multicast or remote arrival reaches a barrier not yet initialised
  else
    __syncthreads();
  if (short_smem) return;
  const u64 kb = (u64)args.kblocks, blocks = ((u64)args.n + Cfg::ROWS - 1) / Cfg::ROWS;
  const u64 units = blocks * kb, C = (u64)args.ctas, cta = decode_run_of<CL>(blockIdx.x, blocks, C);
  const u64 u0 = decode_run_start(cta, units, C), u1 = decode_run_start(cta + 1, units, C);
  if (threadIdx.x < Cfg::CONSUMERS)
    decode_consumers<DT, Cfg>(args, epi, smem, cta, u0, u1);
  else if (threadIdx.x == Cfg::CONSUMERS)
    decode_produce<Cfg::STAGES_B, true>(args, smem, Cfg::B_BYTES, full_b, Cfg::ROWS, u0, u1);
  else if (threadIdx.x == Cfg::CONSUMERS + 32)
    decode_produce<Cfg::STAGES_A, false, CL>(args, smem + Cfg::OFF_A, Cfg::A_BYTES, full_a, 0, u0, u1);
  if (CL > 1) cluster_sync();  // no CTA leaves while another can still write into it
}
