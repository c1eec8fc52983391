// The decode GEMM: out[m, n] = a[m, k] . b[n, k] for few rows m (tokens, at most 256), bound by
// reading the weights b once. Swap-AB on wgmma m64nMTk16: b's rows take the 64-row side, the tokens
// the MT-column side, both operands from shared memory. A CTA is ROWS / 64 consumer warpgroups (64
// rows of b each: a row block of ROWS) and a producer warp whose one thread streams 64-element
// k-blocks of b (ROWS rows) and of a (all MT token rows) with TMA into a STAGES-deep ring (128B swizzle).
//
// Runs: the (row block, k-block) units, row block major, are cut into args.ctas equal runs, one per
// CTA (blockIdx.x; the host picks a multiple of the row blocks, or stream-K's one per SM); a
// function of the shape only, so the bits are the same on any number of SMs. A row block that one
// CTA covers whole is stored at once; one shared by several: each stores its fp32 partial in its
// slot (its rank among the block's CTAs) and the last to arrive adds the slots in slot order and
// stores out: bitwise reproducible run to run.
//
// Barriers: full[s] (count 1: the producer's arrive.expect_tx; TMA completes it), empty[s] (lane 0
// of each consumer warp once its wgmma group on stage s is complete). Use i (over the CTA's whole
// run) takes stage i % STAGES at parity (i / STAGES) & 1; the producer waits for 'empty' at the
// opposite parity.
//
// Template parameters: DT (MK_DT_BF16 / MK_DT_F16), MT (token columns: 8 .. 256, M_TILES of
// gemm_decode.py), ROWS (64 or 128), Epi (what becomes of the finished values: the engine's store,
// gemm_decode.cu; gemm_allreduce's push to every rank, ops/gemm_allreduce_ll.cu). One CTA per SM.
#pragma once
#include "common.cuh"
#include "tma.cuh"
#include "mbar_wait.cuh"
#include "signals.cuh"
#include "trace.cuh"
#include "wgmma.cuh"
#include "convert.cuh"
#include "gemm_args.cuh"
#include "gemm_decode_args.cuh"

template <int MT, int ROWS_>
struct DecodeCfg {
  static constexpr int ROWS = ROWS_;
  static constexpr int WARPS = ROWS / 16;  // consumer warps: ROWS / 64 warpgroups
  static constexpr int CONSUMERS = 32 * WARPS;
  static constexpr int ACC = MT / 2;  // fp32 accumulators per consumer thread (m64nMT)
  static constexpr int THREADS = CONSUMERS + 32;  // the consumers, then the producer warp
  static constexpr int BLOCKS = MT / 8;  // n8 column blocks of tokens
  static constexpr u32 B_BYTES = ROWS * MK_DECODE_BK * 2;  // ROWS rows x 128 B
  static constexpr u32 A_BYTES = MT * MK_DECODE_BK * 2;  // MT rows x 128 B
  static constexpr u32 STAGE_BYTES = A_BYTES + B_BYTES;
  // 128 KiB of b in flight, within 200 KiB of ring
  static constexpr int STAGES =
      (int)((128u * 1024u / B_BYTES) * STAGE_BYTES <= 200u * 1024u ? 128u * 1024u / B_BYTES
                                                                   : 200u * 1024u / STAGE_BYTES);
  static constexpr u32 OFF_A = STAGES * B_BYTES;
  static constexpr u32 OFF_BAR = OFF_A + STAGES * A_BYTES;
  // dynamic bytes with alignment slack (gemm_decode.smem_bytes computes the same on the host; the
  // kernel checks what it was given)
  static constexpr u32 SMEM = OFF_BAR + 2 * 8 * STAGES + 1024;
  // A staged store's room (MK_DECODE_TMA_OUT): per consumer warp MT tokens x 16 rows of 16-bit out,
  // past the barriers; where it fits beside the ring (227 KiB, less 1 KiB of static slack) and from
  // 32 columns (below, 2-byte stores take 0.5 us and staging measured 0.3-1.3% slower).
  static constexpr u32 OFF_OUT = (OFF_BAR + 2 * 8 * STAGES + 127u) & ~127u;
  static constexpr u32 OUT_WARP = MT * 32;
  static constexpr u32 SMEM_OUT = OFF_OUT + WARPS * OUT_WARP + 1024;
  static constexpr bool OUT_STAGED = MT >= 32 && SMEM_OUT + 1024 <= 232448u;
  static constexpr u32 SLOT = MT * ROWS;  // floats of one partial slot
  static constexpr int SUM_V = ACC < 32 ? ACC : 32;  // values of a slot the last CTA loads at once
  // and slots a round: at most 4 and 64 loads in flight up to 64 tokens; 32 loads above (registers)
  static constexpr int SUM_U = ACC > 32 ? 1 : (64 / SUM_V < 4 ? 64 / SUM_V : 4);
  // The last CTA adds its own slot from registers (below 128 accumulators: 128 and the sum spill)
  static constexpr bool OWN_IN_REGS = ACC < 128;
  MK_STATIC_ASSERT(ROWS == 64 || ROWS == 128, "row blocks of 64 or 128");
  MK_STATIC_ASSERT(MT % 8 == 0 && MT <= 256, "wgmma takes 8 .. 256 columns in steps of 8");
  MK_STATIC_ASSERT(A_BYTES % 1024 == 0, "stages stay 1 KiB aligned (the 128B swizzle's period)");
};

// Bytes of dynamic shared memory the launch gave this CTA.
MK_DEV u32 dynamic_smem_bytes() {
  u32 r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
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

// Token blocks whose previous output values an epilogue reads at once (4 loads each; 8 spilled at MT 256).
constexpr int MK_DECODE_READS = 4;

// The stream-K cut: CTA c's run is units [start(c), start(c + 1)), start(c) = c * U / C; the CTA
// whose run holds unit x is (x * C + C - 1) / U (ctas <= units: no run is empty).
MK_DEV u64 decode_run_start(u64 c, u64 units, u64 ctas) { return c * units / ctas; }
MK_DEV u32 decode_cta_of(u64 x, u64 units, u64 ctas) { return (u32)(((x + 1) * ctas - 1) / units); }

// Trace mode (tools/gemm_phases.py): warp 0's lane 0 stamps the end of each phase of its CTA's
// row blocks in shared memory, and writes them as spans once its run is done.
constexpr u32 MK_DECODE_STAMPS = 16;
struct DecodeStamps {
  u64 at[MK_DECODE_STAMPS + 1];  // at[0]: the CTA's entry; at[i + 1]: the end of span i
  u32 id[MK_DECODE_STAMPS];
  u32 n;
  MK_DEV void stamp(u32 phase, u64 rb) {
    if (n == MK_DECODE_STAMPS) return;
    id[n] = MK_DECODE_TRACE | (phase << 24) | (u32)rb;
    at[++n] = globaltimer_ns();
  }
  MK_DEV void write(const MkSync& s) const {
    for (u32 i = 0; i < n; ++i) trace_span_at(s, MK_ROLE_COMPUTE, id[i], at[i], at[i + 1]);
  }
};

// The producer thread: every k-block of the CTA's run, b's box and a's box into the ring.
template <class Cfg>
MK_DEV void decode_produce(const MkDecodeArgs& args, u32 smem, u64 u0, u64 u1) {
  const u64 kb = (u64)args.kblocks;
  const u32 full0 = smem + Cfg::OFF_BAR, empty0 = full0 + 8 * Cfg::STAGES;
  u32 rb = (u32)(u0 / kb), kk = (u32)(u0 - rb * kb);  // unit u = (row block rb, k-block kk)
  const u32 uses = (u32)(u1 - u0);
  u32 s = 0, ph = 1;  // use it: stage it % STAGES, awaited 'empty' at parity ((it / STAGES) & 1) ^ 1
  bool loads = true;  // false once a stage's bytes never landed: no stage is armed again
  for (u32 it = 0; it < uses; ++it) {
    mbar_wait_timed(empty0 + 8 * s, ph, args.sync, MK_WAIT_EMPTY);
    loads = loads && mbar_can_arm(full0 + 8 * s, ph, args.sync, MK_WAIT_LANDED);
    if (loads) {
      mbar_arrive_expect_tx(full0 + 8 * s, Cfg::STAGE_BYTES);
      tma_load_2d(smem + s * Cfg::B_BYTES, &args.b_map, full0 + 8 * s, (i32)kk * MK_DECODE_BK, (i32)rb * Cfg::ROWS);
      tma_load_2d(smem + Cfg::OFF_A + s * Cfg::A_BYTES, &args.a_map, full0 + 8 * s, (i32)kk * MK_DECODE_BK, 0);
    }
    if (++kk == (u32)kb) kk = 0, ++rb;
    if (++s == Cfg::STAGES) s = 0, ph ^= 1;
  }
  mbar_drain_landed(full0, Cfg::STAGES, uses);
}

// The decode GEMM of one CTA (DecodeCfg<MT, ROWS>::THREADS threads, ::SMEM bytes of dynamic shared
// memory). Epi: begin() first (every consumer thread, the producer's first loads in flight: its
// memory round trips overlap theirs); then per row block this CTA finishes (covered whole,
// or the last of its CTAs to arrive) ready(bar) (every consumer thread; bar() syncs them; false
// skips the stores), staged<Cfg>(acc, smem, row0) (the warp's 16 rows from row0 at once; true: done),
// else previous(j, tok, r0, r1, v) for every token block j (may add values read from
// memory to v), then finish(j, tok, r0, r1, v) for each: v[0..1] the values of row r0 and tokens
// tok, tok + 1, v[2..3] those of row r1 (tokens past m and rows past n included: Epi skips them);
// end() once the run is done.
template <int DT, int MT, int ROWS, class Epi>
MK_DEV void decode_gemm(const MkDecodeArgs& args, Epi& epi) {
  using Cfg = DecodeCfg<MT, ROWS>;
  extern __shared__ __align__(1024) u8 decode_dyn[];
  __shared__ u32 s_last;
  __shared__ DecodeStamps s_stamps;
  const bool stamps = threadIdx.x == 0 && args.sync.trace_events != nullptr;  // trace mode
  if (stamps) s_stamps.n = 0, s_stamps.at[0] = globaltimer_ns();
  const u32 raw = smem_u32(decode_dyn), smem = (raw + 1023u) & ~1023u;
  const u32 full0 = smem + Cfg::OFF_BAR, empty0 = full0 + 8 * Cfg::STAGES;
  const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < Cfg::STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, Cfg::WARPS);
    }
    mbar_fence_init();
  }
  if (threadIdx.x == Cfg::CONSUMERS) {
    tma_prefetch_desc(&args.a_map);
    tma_prefetch_desc(&args.b_map);
    if (args.flags & MK_DECODE_TMA_OUT) tma_prefetch_desc(&args.out_map);  // not fetched at the tail
  }
  // Launched overlapped (config.gemm_overlap), the kernel before may still run: no global
  // memory is touched before it completed (a no-op otherwise).
  griddep_wait();
  // The launch gave less shared memory than the ring needs: an error, not a write past it.
  const u32 need = Cfg::OUT_STAGED && (args.flags & MK_DECODE_TMA_OUT) ? Cfg::SMEM_OUT : Cfg::SMEM;
  const bool short_smem = dynamic_smem_bytes() < need;
  if (short_smem && threadIdx.x == 0)
    record_error(args.sync, MK_ERR_INPUT, -1, MK_DECODE_ERR_SMEM, need, dynamic_smem_bytes(), 0);
  __syncthreads();
  if (short_smem) return;
  const u64 kb = (u64)args.kblocks, blocks = ((u64)args.n + Cfg::ROWS - 1) / Cfg::ROWS;
  const u64 units = blocks * kb, C = (u64)args.ctas, cta = blockIdx.x;
  const u64 u0 = decode_run_start(cta, units, C), u1 = decode_run_start(cta + 1, units, C);
  if (threadIdx.x >= Cfg::CONSUMERS) {
    if (threadIdx.x == Cfg::CONSUMERS) decode_produce<Cfg>(args, smem, u0, u1);
    return;
  }
  epi.begin();

  const u32 g = lane >> 2, t = lane & 3, wg = warp >> 2;
  const MkBarConsumers<Cfg::CONSUMERS> bar{};
  float acc[Cfg::ACC];  // acc[4j + i]: row r0 (i < 2) or r1, tokens 8j + 2t + (i & 1)
  // Stage 0's descriptors; a stage's and a k-step's offsets add to the address field (bits 0-13,
  // address / 16: shared memory below 256 KiB never carries out of it).
  const u64 desc_b0 = wgmma_desc(smem + wg * (64 * 128), 16, 1024), desc_a0 = wgmma_desc(smem + Cfg::OFF_A, 16, 1024);
  u32 s = 0, ph = 0, prev = 0;  // the ring's next stage and its parity, the stage used last
  for (u64 u = u0; u < u1;) {
    const u64 rb = u / kb, kend = (rb + 1) * kb < u1 ? (rb + 1) * kb : u1;
    const u32 uses = (u32)(kend - u);  // this block's k-blocks in the run (at least 1)
    u = kend;
    if (stamps) {  // the block's first stage, waited for early (the loop's wait then passes at once)
      mbar_wait_timed(full0 + 8 * s, ph, args.sync, MK_WAIT_FULL);
      s_stamps.stamp(MK_DECODE_PH_FILL, rb);
    }
    __syncwarp();  // the last block's epilogue or the stamp may have diverged: converge before .aligned wgmma
#pragma unroll
    for (int i = 0; i < Cfg::ACC; ++i) acc[i] = 0.f;
    for (u32 j = 0; j < uses; ++j) {
      mbar_wait_timed(full0 + 8 * s, ph, args.sync, MK_WAIT_FULL);
      const u64 db = desc_b0 + s * (Cfg::B_BYTES >> 4), da = desc_a0 + s * (Cfg::A_BYTES >> 4);
#pragma unroll
      for (int i = 0; i < Cfg::ACC; ++i) wgmma_fence_operand(acc[i]);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < MK_DECODE_BK / 16; ++kk) wgmma_ss<DT, 0>(acc, db + 2 * kk, da + 2 * kk, 1u);
      wgmma_commit();
#pragma unroll
      for (int i = 0; i < Cfg::ACC; ++i) wgmma_fence_operand(acc[i]);
      wgmma_wait<1>();  // the previous k-block's group is complete: release its stage
      if (j > 0 && lane == 0) mbar_arrive(empty0 + 8 * prev);
      prev = s;
      if (++s == Cfg::STAGES) s = 0, ph ^= 1;
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < Cfg::ACC; ++i) wgmma_fence_operand(acc[i]);
    if (lane == 0) mbar_arrive(empty0 + 8 * prev);
    if (stamps) s_stamps.stamp(MK_DECODE_PH_MMA, rb);
    if (u == u1) griddep_launch_dependents();  // its last wgmma done: a next overlapped kernel may set up

    const u64 r0 = rb * Cfg::ROWS + warp * 16 + g, r1 = r0 + 8;
    const u32 first = decode_cta_of(rb * kb, units, C), n_ctas = decode_cta_of((rb + 1) * kb - 1, units, C) - first + 1;
    const auto hand_out = [&] {  // the block's finished values (in acc) to the epilogue
      if (epi.template staged<Cfg>(acc, smem, rb * Cfg::ROWS + warp * 16)) return;
      // Reads of previous values go before the stores, MK_DECODE_READS token blocks at a time:
      // interleaved, each waited a memory round trip.
      constexpr int G = Cfg::BLOCKS < MK_DECODE_READS ? Cfg::BLOCKS : MK_DECODE_READS;
#pragma unroll
      for (int j0 = 0; j0 < Cfg::BLOCKS; j0 += G) {
#pragma unroll
        for (int j = j0; j < j0 + G; ++j) {
          float v[4] = {acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]};
          epi.previous(j, (u64)j * 8 + 2 * t, r0, r1, v);
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[4 * j + e] = v[e];
        }
#pragma unroll
        for (int j = j0; j < j0 + G; ++j) {
          const float v[4] = {acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]};
          epi.finish(j, (u64)j * 8 + 2 * t, r0, r1, v);
        }
      }
    };
    if (n_ctas == 1) {
      if (epi.ready(bar)) hand_out();
      if (stamps) s_stamps.stamp(MK_DECODE_PH_OUT, rb);
      continue;
    }
    const u32 own = cta - first;  // the slot: this CTA's rank among the block's
    // Slots in fragment order (the reader is the same thread of the last CTA): coalesced both ways.
    const u64 block_at = rb * (u64)args.slots;
    float* mine = args.partial + (block_at + own) * Cfg::SLOT + threadIdx.x;
#pragma unroll
    for (int i = 0; i < Cfg::ACC; ++i) __stcg(mine + i * Cfg::CONSUMERS, acc[i]);
    bar();  // every thread's slot stores precede thread 0's release
    u32* count = args.counts + rb;
    if (threadIdx.x == 0) s_last = atom_add_acq_rel_gpu(count, 1u) + 1 == n_ctas;
    bar();  // the last arrival's acquire precedes every thread's slot reads
    if (stamps) s_stamps.stamp(MK_DECODE_PH_PARTIAL, rb);
    if (!s_last) continue;
    if (threadIdx.x == 0) *count = 0;  // zero for the next launch (stream ordered)
    if (!epi.ready(bar)) continue;
    // The slots added in slot order, SUM_U slots' SUM_V values in flight at once (a load per slot
    // and value per round trip would serialise them behind finish's stores); this CTA's own slot
    // is still in acc (the same values: the same bits), so only the others' are read.
    const float* slot0 = args.partial + block_at * Cfg::SLOT + threadIdx.x;
#pragma unroll
    for (int i0 = 0; i0 < Cfg::ACC; i0 += Cfg::SUM_V) {
      float sum[Cfg::SUM_V];
#pragma unroll
      for (int i = 0; i < Cfg::SUM_V; ++i) sum[i] = 0.f;
      for (u32 c = 0; c < n_ctas; c += Cfg::SUM_U) {
        float p[Cfg::SUM_U][Cfg::SUM_V];
#pragma unroll
        for (int q = 0; q < Cfg::SUM_U; ++q)
#pragma unroll
          for (int i = 0; i < Cfg::SUM_V; ++i)
            p[q][i] = c + q < n_ctas && (!Cfg::OWN_IN_REGS || c + q != own)
                          ? __ldcg(slot0 + (u64)(c + q) * Cfg::SLOT + (i0 + i) * Cfg::CONSUMERS)
                          : acc[i0 + i];
#pragma unroll
        for (int q = 0; q < Cfg::SUM_U; ++q)
#pragma unroll
          for (int i = 0; i < Cfg::SUM_V; ++i)
            if (c + q < n_ctas) sum[i] += p[q][i];
      }
#pragma unroll
      for (int i = 0; i < Cfg::SUM_V; ++i) acc[i0 + i] = sum[i];
    }
    hand_out();
    if (stamps) s_stamps.stamp(MK_DECODE_PH_OUT, rb);
  }
  epi.end();
  if (stamps) s_stamps.write(args.sync);
}
