// The decode GEMM: out[m, n] = a[m, k] . b[n, k] for few rows m (tokens, at most 64), bound by
// reading the weights b once. Swap-AB on mma.sync.m16n8k16: b's rows take the 16-row side, the
// tokens the 8-column side. Each warp streams 16 rows of b along K (U 32-element steps a stage;
// lane (g, t) of an mma takes rows g, g + 8 and elements 8t..8t+7 of each step); a CTA is 8 warps (128 rows of b:
// blockIdx.y) over one K range (blockIdx.z of `splits`) and MT tokens (group blockIdx.x: tokens
// x * MT ...), the groups innermost so that those reading the same rows of b run side by side and
// the second read hits L2.
//
// Loads: a ring of STAGES stages in shared memory filled by cp.async, STAGES - 1 ahead of the
// mmas, so the loads in flight never drain between steps. b's loads run along rows (64 x U
// contiguous bytes of a row per load), each vector stored where its mma lane reads it; a's slice
// is staged once per CTA.
//
// K order inside a 32-element step: lane t's 16 bytes (elements 8t..8t+7) feed the k-slots
// {2t, 2t+1, 2t+8, 2t+9} of two mmas (elements 8t..8t+3, then 8t+4..8t+7). The same bijection
// for a and b, so each mma sums the right products; the order is fixed: bitwise reproducible.
//
// Splits > 1: each CTA stores its fp32 partial, then counts its arrival for its 128 rows; the
// last to arrive adds the splits' partials in split order (not arrival order) and stores out.
//
// Template parameters: DT (MK_DT_BF16 / MK_DT_F16), MT (token columns: 8, 16, 32 or 64), U
// (32-element steps of K a stage), Epi (what becomes of the finished values: the engine's store,
// gemm_decode.cu; gemm_allreduce's push to every rank, ops/gemm_allreduce_ll.cu). The kernel is
// launched with MK_DECODE_SMEM bytes of dynamic shared memory.
#pragma once
#include "common.cuh"
#include "copy.cuh"
#include "gemm_args.cuh"
#include "gemm_decode_args.cuh"

// U: 32-element steps of K a stage (the host picks it, gemm_decode.unroll). A stage: a's slice, MT
// rows of STEP elements, each row padded by 64 B so that the two rows of one 8-lane phase of a
// 16-byte shared load fall in different banks; then b's, per warp U x 2 rows x 32 lanes x 16 B.
template <int MT, int U_>
struct DecodeCfg {
  static constexpr int BLOCKS = MT / 8;  // n8 column blocks of tokens
  static constexpr int U = U_;
  static constexpr int STEP = 32 * U;  // K elements a stage
  static constexpr int ROW_BYTES = STEP * 2 + 64;
  static constexpr int A_BYTES = MT * ROW_BYTES;
  static constexpr int WARP_B_BYTES = U * 2 * 32 * 16;
  static constexpr int STAGE_BYTES = A_BYTES + (MK_DECODE_THREADS / 32) * WARP_B_BYTES;
  static constexpr int STAGES = MK_DECODE_SMEM / STAGE_BYTES < 8 ? MK_DECODE_SMEM / STAGE_BYTES : 8;
  static constexpr int VECS = MT * STEP / 8;  // 16-byte vectors of a's slice
  static_assert(STAGES >= 2, "a decode stage must fit twice in MK_DECODE_SMEM");
};

template <int DT>
MK_DEV void mma_16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  if (DT == MK_DT_BF16)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A's slice [tok0, tok0 + MT) x [k0, k0 + STEP) into a stage, every thread of the CTA (tokens past
// m and K past k_end read as zeros).
template <int MT, int U>
MK_DEV void stage_a(const MkDecodeArgs& args, u32 stage, i64 tok0, i64 k0, i64 k_end) {
  using Cfg = DecodeCfg<MT, U>;
  constexpr int PER_ROW = Cfg::STEP / 8;
#pragma unroll
  for (int i = 0; i < (Cfg::VECS + MK_DECODE_THREADS - 1) / MK_DECODE_THREADS; ++i) {
    const int v = i * MK_DECODE_THREADS + (int)threadIdx.x;
    if (Cfg::VECS % MK_DECODE_THREADS && v >= Cfg::VECS) break;
    const int tok = v / PER_ROW, c = v - tok * PER_ROW;
    const i64 k = k0 + 8 * c;
    const bool in = tok0 + tok < args.m && k < k_end;
    const u8* src = reinterpret_cast<const u8*>(args.a) + (in ? ((tok0 + tok) * args.lda + k) * 2 : 0);
    cp_async_16(stage + tok * Cfg::ROW_BYTES + c * 16, src, in);
  }
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

// The decode GEMM of one CTA. Epi: begin() first (every thread), then, in the CTA that finishes a
// row block (the only one, or the last of its K ranges), ready() (every thread: false skips the
// rest) and finish(j, tok, r0, r1, v) per token block j: v[0..1] the values of rows r0 and tokens
// tok, tok + 1, v[2..3] those of row r1 (tokens past m and rows past n included: Epi skips them).
template <int DT, int MT, int U, class Epi>
MK_DEV void decode_gemm(const MkDecodeArgs& args, Epi& epi) {
  using Cfg = DecodeCfg<MT, U>;
  epi.begin();
  const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const u32 g = lane >> 2, t = lane & 3;
  const i64 r0 = (i64)blockIdx.y * MK_DECODE_ROWS + warp * 16 + g, r1 = r0 + 8;  // rows of b
  const i64 K = args.k, k_begin = (i64)blockIdx.z * args.k_split, tok0 = (i64)blockIdx.x * MT;
  const i64 k_end = k_begin + args.k_split < K ? k_begin + args.k_split : K;
  float acc[Cfg::BLOCKS][4];
#pragma unroll
  for (int j = 0; j < Cfg::BLOCKS; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  extern __shared__ __align__(128) u8 mk_decode_smem[];
  const u32 ring = (u32)__cvta_generic_to_shared(mk_decode_smem);
  const u32 b_warp = Cfg::A_BYTES + warp * Cfg::WARP_B_BYTES;
  // b's vectors: a load instruction covers LPR lanes x 16 B contiguous of each of RPI rows; each
  // lands in the slot of the mma lane that uses it (rows g ^ u: 4 wavefronts both ways).
  constexpr int LPR = 4 * Cfg::U, RPI = 32 / LPR;
  const u32 pu = (lane % LPR) / 4, pt = lane % 4;
  const i64 prow = (i64)blockIdx.y * MK_DECODE_ROWS + warp * 16 + lane / LPR;
  const u8* bp = reinterpret_cast<const u8*>(args.b) + (prow < args.n ? prow : 0) * args.ldb * 2;
  // Stage `slot` <- a's and the warp's b's vectors of [k0, k0 + STEP) (past k_end or n: zeros).
  auto load = [&](u32 slot, i64 k0) {
    const u32 st = ring + slot * Cfg::STAGE_BYTES;
    stage_a<MT, U>(args, st, tok0, k0, k_end);
    const i64 k = k0 + 32 * pu + 8 * pt;
#pragma unroll
    for (int q = 0; q < 16 / RPI; ++q) {
      const u32 i = q * RPI + lane / LPR;  // row warp * 16 + i: mma row g = i % 8 of half r = i / 8
      const bool in = k < k_end && prow + q * RPI < args.n;  // K, k_begin, k_end: multiples of 8
      const u32 dst = st + b_warp + (((pu * 2 + i / 8) * 32 + ((i % 8) ^ pu) * 4 + pt) * 16);
      cp_async_16(dst, bp + (in ? ((i64)q * RPI * args.ldb + k) * 2 : 0), in);
    }
  };
#pragma unroll
  for (int p = 0; p < Cfg::STAGES - 1; ++p) {  // one group per stage, empty past k_end: the count stays fixed
    if (k_begin + p * Cfg::STEP < k_end) load(p, k_begin + p * Cfg::STEP);
    cp_async_commit();
  }
  u32 slot = 0, fill = Cfg::STAGES - 1;
  for (i64 k0 = k_begin; k0 < k_end; k0 += Cfg::STEP) {
    cp_async_wait<Cfg::STAGES - 2>();  // this thread's vectors of stage `slot` have landed
    __syncthreads();  // every thread's a of `slot` too; every thread is done reading stage `fill`
    const i64 kn = k0 + (Cfg::STAGES - 1) * Cfg::STEP;
    if (kn < k_end) load(fill, kn);
    cp_async_commit();
    const u32 st = ring + slot * Cfg::STAGE_BYTES;
    const u32 base = st + g * Cfg::ROW_BYTES + t * 16;
#pragma unroll
    for (int u = 0; u < Cfg::U; ++u) {
      const u32 bs = st + b_warp + ((g ^ u) * 4 + t) * 16;
      const uint4 b0 = lds_v4(bs + (u * 2) * 512), b1 = lds_v4(bs + (u * 2 + 1) * 512);
#pragma unroll
      for (int j = 0; j < Cfg::BLOCKS; ++j) {
        const uint4 av = lds_v4(base + j * 8 * Cfg::ROW_BYTES + u * 64);
        mma_16816<DT>(acc[j], b0.x, b1.x, b0.y, b1.y, av.x, av.y);
        mma_16816<DT>(acc[j], b0.z, b1.z, b0.w, b1.w, av.z, av.w);
      }
    }
    slot = slot + 1 == Cfg::STAGES ? 0 : slot + 1;
    fill = fill + 1 == Cfg::STAGES ? 0 : fill + 1;
  }
  cp_async_wait<0>();  // no copy into the ring outlives the loop (the empty groups included)

  // acc[j]: {row r0: tokens 8j + 2t, 8j + 2t + 1; row r1: the same tokens}
  const u64 N = (u64)args.n, M = (u64)args.m;
  if (args.splits == 1) {
    if (!epi.ready()) return;
#pragma unroll
    for (int j = 0; j < Cfg::BLOCKS; ++j) epi.finish(j, (u64)tok0 + j * 8 + 2 * t, (u64)r0, (u64)r1, acc[j]);
    return;
  }
  float* part = args.partial;
#pragma unroll
  for (int j = 0; j < Cfg::BLOCKS; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const u64 tok = (u64)tok0 + j * 8 + 2 * t + (e & 1), row = (u64)(e < 2 ? r0 : r1);
      if (tok < M && row < N) __stcg(part + ((u64)blockIdx.z * M + tok) * N + row, acc[j][e]);
    }
  __threadfence();
  __syncthreads();
  __shared__ u32 s_last;
  u32* count = args.counts + blockIdx.y * gridDim.x + blockIdx.x;  // this CTA's rows and tokens
  if (threadIdx.x == 0) s_last = atomicAdd(count, 1u) + 1 == (u32)args.splits;
  __syncthreads();
  if (!s_last) return;
  __threadfence();  // every split's partial (published before its arrival) is visible now
  if (threadIdx.x == 0) *count = 0;  // zero for the next launch (stream ordered)
  if (!epi.ready()) return;
  const u32 S = (u32)args.splits;
#pragma unroll
  for (int j = 0; j < Cfg::BLOCKS; ++j) {
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const u64 tok = (u64)tok0 + j * 8 + 2 * t + (e & 1), row = (u64)(e < 2 ? r0 : r1);
      v[e] = 0.f;
      if (tok < M && row < N)
        for (u32 s = 0; s < S; ++s) v[e] += __ldcg(part + ((u64)s * M + tok) * N + row);
    }
    epi.finish(j, (u64)tok0 + j * 8 + 2 * t, (u64)r0, (u64)r1, v);
  }
}
