#pragma once
// Online softmax on wgmma accumulator fragments (one warpgroup, 64 query rows x BN keys).
//
// Fragment (wgmma.cuh): register 4*j + i of a thread holds row lane/4 + 8*(i/2) of its warp's 16
// rows, key column 8*j + 2*(lane%4) + (i%2). So each thread holds 2 rows ("row 0" and "row 1"),
// and the 4 threads of a quad together hold a row: row reductions are two xor-shuffles.
//
// Scores are kept unscaled; probabilities are exp2(s * scale_log2 - m * scale_log2) with m the
// running row maximum of the unscaled scores (one FFMA and one MUFU.EX2 per score). A row whose
// keys are all masked so far has m = -inf; it is treated as m = 0 for the exponent (every p is 0)
// and its rescale factor is 1, so no NaN appears.
#include "common.cuh"
#include "attn_args.cuh"

#define MK_NEG_INF __int_as_float(0xff800000)

MK_DEV float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

MK_DEV float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
MK_DEV float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Masks the scores of keys a row must not see with -inf. key0: the block's first key; lim0 / lim1:
// the positions of this thread's two query rows; a key is visible iff its position (kp) is at
// most the row's. Keys >= seq_kv are always masked.
template <int BN, bool CAUSAL>
MK_DEV void attn_mask(float (&s)[BN / 2], int key0, int seq_kv, const MkAttnPos& kp, int lim0, int lim1) {
  const int c0 = key0 + 2 * (int)(threadIdx.x & 3);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = c0 + 8 * j + (i & 1);
      const int lim = (i < 2) ? lim0 : lim1;
      if (c >= seq_kv || (CAUSAL && c + (c < kp.half ? kp.off0 : kp.off1) > lim)) s[4 * j + i] = MK_NEG_INF;
    }
  }
}

// Per-thread state of the two rows: running max (unscaled), partial row sums (this thread's
// columns only: reduced over the quad once, at the end).
struct AttnRows {
  float m[2];
  float l[2];
};

// One block: updates the running max with the block's scores, turns s into probabilities in
// place, returns the factors by which O and l must be rescaled (alpha) and adds the block's
// partial sums to l after that rescale. The caller rescales O (after its pending P.V is done).
template <int BN>
MK_DEV void attn_softmax_block(float (&s)[BN / 2], AttnRows& st, float scale_log2, float (&alpha)[2], bool first) {
  float mx[2] = {st.m[0], st.m[1]};
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    mx[0] = fmaxf(mx[0], fmaxf(s[4 * j + 0], s[4 * j + 1]));
    mx[1] = fmaxf(mx[1], fmaxf(s[4 * j + 2], s[4 * j + 3]));
  }
  float msc[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = quad_max(mx[r]);
    const bool none = mx[r] == MK_NEG_INF;
    msc[r] = none ? 0.f : mx[r] * scale_log2;
    // (old - new) * scale, not fma(old, scale, -msc): an unchanged maximum gives exactly 1.
    alpha[r] = (first || none) ? 1.f : ex2_approx((st.m[r] - mx[r]) * scale_log2);
    st.m[r] = mx[r];
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float p = ex2_approx(fmaf(s[4 * j + i], scale_log2, -msc[i >> 1]));
      s[4 * j + i] = p;
      sum[i >> 1] += p;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) st.l[r] = (first ? 0.f : st.l[r] * alpha[r]) + sum[r];
}

// Probabilities -> the A operand of P.V (wgmma with A in registers): k-slice kk (keys 16kk..16kk+15)
// is accumulator columns 8*(2kk) .. 8*(2kk+1)+7, packed in pairs.
template <int DT, int BN>
MK_DEV void attn_pack_p(const float (&s)[BN / 2], u32 (&p)[BN / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
    for (int q = 0; q < 4; ++q) p[kk][q] = pack2<DT>(s[8 * kk + 2 * q], s[8 * kk + 2 * q + 1]);
  }
}

template <int N>
MK_DEV void attn_rescale(float (&o)[N / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    o[4 * j + 0] *= alpha[0];
    o[4 * j + 1] *= alpha[0];
    o[4 * j + 2] *= alpha[1];
    o[4 * j + 3] *= alpha[1];
  }
}
