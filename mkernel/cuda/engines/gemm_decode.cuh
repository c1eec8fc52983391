// The decode GEMM: out[m, n] = a[m, k] . b[n, k] for few rows m (tokens, at most 64), bound by
// reading the weights b once. Swap-AB on mma.sync.m16n8k16: b's rows take the 16-row side, the
// tokens the 8-column side. Each warp streams 16 rows of b along K with 16-byte loads (4 lanes
// read 64 contiguous bytes of a row per 32 elements of K, U such steps in flight); a CTA is 8
// warps (128 rows of b: blockIdx.y) over one K range (blockIdx.z of `splits`) and MT tokens (group
// blockIdx.x: tokens x * MT ...), the groups innermost so that those reading the same rows of b run
// side by side and the second read hits L2. The tokens' slice of a for a step is staged once per
// CTA in shared memory (cp.async, two stages), not once per warp.
//
// K order inside a 32-element step: lane t's 16 bytes (elements 8t..8t+7) feed the k-slots
// {2t, 2t+1, 2t+8, 2t+9} of two mmas (elements 8t..8t+3, then 8t+4..8t+7). The same bijection
// for a and b, so each mma sums the right products; the order is fixed: bitwise reproducible.
//
// Splits > 1: each CTA stores its fp32 partial, then counts its arrival for its 128 rows; the
// last to arrive adds the splits' partials in split order (not arrival order) and stores out.
//
// Template parameters: DT (MK_DT_BF16 / MK_DT_F16), MT (token columns: 8, 16, 32 or 64), U
// (32-element steps of K in flight), Epi (what becomes of the finished values: the engine's store,
// gemm_decode.cu; gemm_allreduce's push to every rank, ops/allreduce.cu).
#pragma once
#include "common.cuh"
#include "copy.cuh"
#include "gemm_args.cuh"
#include "gemm_decode_args.cuh"

// U: 32-element steps of K in flight per lane (b: 2 x U 16-byte registers; the host picks it,
// gemm_decode.unroll). A's stage: MT rows of STEP elements, each row padded by 64 B so that the two
// rows of one 8-lane phase of a 16-byte shared load fall in different banks.
template <int MT, int U_>
struct DecodeCfg {
  static constexpr int BLOCKS = MT / 8;  // n8 column blocks of tokens
  static constexpr int U = U_;
  static constexpr int STEP = 32 * U;  // K elements per iteration
  static constexpr int ROW_BYTES = STEP * 2 + 64;
  static constexpr int STAGE_BYTES = MT * ROW_BYTES;
  static constexpr int VECS = MT * STEP / 8;  // 16-byte vectors of one stage
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

// Streamed once: do not keep b in L1.
MK_DEV uint4 ld_stream_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
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
  const u8* b0p = reinterpret_cast<const u8*>(args.b) + (r0 < args.n ? r0 : 0) * args.ldb * 2;
  const u8* b1p = reinterpret_cast<const u8*>(args.b) + (r1 < args.n ? r1 : 0) * args.ldb * 2;
  const bool b0ok = r0 < args.n, b1ok = r1 < args.n;
  float acc[Cfg::BLOCKS][4];
#pragma unroll
  for (int j = 0; j < Cfg::BLOCKS; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  __shared__ __align__(16) u8 sa[2][Cfg::STAGE_BYTES];
  const u32 sa0 = (u32)__cvta_generic_to_shared(&sa[0][0]);

  stage_a<MT, U>(args, sa0, tok0, k_begin, k_end);
  cp_async_commit();
  u32 s = 0;
  for (i64 k0 = k_begin; k0 < k_end; k0 += Cfg::STEP, s ^= 1) {
    cp_async_wait<0>();
    __syncthreads();  // stage s is every thread's; the other stage's readers are done
    uint4 bv[Cfg::U][2];
#pragma unroll
    for (int u = 0; u < Cfg::U; ++u) {  // every b load of the step first: U x 64 B per row in flight
      const i64 k = k0 + 32 * u + 8 * t;
      const bool in = k < k_end;  // K, k_begin, k_end are multiples of 8: a vector is all in or all out
      bv[u][0] = in && b0ok ? ld_stream_v4(b0p + k * 2) : zero;
      bv[u][1] = in && b1ok ? ld_stream_v4(b1p + k * 2) : zero;
    }
    if (k0 + Cfg::STEP < k_end) stage_a<MT, U>(args, sa0 + (s ^ 1) * Cfg::STAGE_BYTES, tok0, k0 + Cfg::STEP, k_end);
    cp_async_commit();
    const u32 base = sa0 + s * Cfg::STAGE_BYTES + g * Cfg::ROW_BYTES + t * 16;
#pragma unroll
    for (int u = 0; u < Cfg::U; ++u)
#pragma unroll
      for (int j = 0; j < Cfg::BLOCKS; ++j) {
        const uint4 av = lds_v4(base + j * 8 * Cfg::ROW_BYTES + u * 64);
        mma_16816<DT>(acc[j], bv[u][0].x, bv[u][1].x, bv[u][0].y, bv[u][1].y, av.x, av.y);
        mma_16816<DT>(acc[j], bv[u][0].z, bv[u][1].z, bv[u][0].w, bv[u][1].w, av.z, av.w);
      }
  }

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
