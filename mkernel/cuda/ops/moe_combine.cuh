#pragma once
// The combine role of the expert-parallel kernels (design: docs/MOE.md): every received row goes
// back to row t * k + j of its source's return buffer (ret); once every rank's rows are back
// (retflag), every token's k rows are summed, weighted by its routing weights, in fp32, j
// ascending, one rounding: bitwise reproducible. mk_moe_combine_kernel (moe.cu) returns rows as
// the user's y holds them; mk_moe_gemm_combine_kernel (moe_gemm_combine.cu) returns each GEMM tile
// as soon as it is stored.
#include "moe_dispatch.cuh"
#include "copy.cuh"
#include "convert.cuh"

// Loads in flight per lane when a warp copies one row (copy_span over its 32 lanes).
constexpr u32 MOE_COPY_UNROLL = 8;
// Rows of a token a lane loads before it adds them (the weighted sum; one at a time is latency-bound).
constexpr u32 MOE_SUM_IN_FLIGHT = 4;

// Thread 0: every rank entered this epoch (its return buffer may be written).
MK_DEV bool moe_credits_all(const MkMoeArgs& a, const MkPeers& peers, u32 Ep) {
  for (u32 d = 0; d < (u32)a.world; ++d)
    if (!credits_wait(a.sync, peers, d, Ep)) return false;
  return true;
}

// Every thread of a returning CTA, after its last row (`mine` rows of the `n` to return): once all
// are back, retflag[me] on every rank (moe_all_done; none after an error of this rank: a CTA that
// gave up on a wait returned only part of its rows, and the peers' waits then time out and raise).
MK_DEV void moe_returned(const MkMoeArgs& a, const MkPeers& peers, u32 mine, u32 n, u32 Ep) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    if (mine) atomicAdd(&a.counters[MOE_CNT_RETURNED], mine);
    moe_all_done(a, peers, MOE_CNT_RETURNED, n, a.retflag_off, Ep);
  }
}

// Once every rank's rows are back, a warp per token of this worker's share (`part` of `parts`,
// tokens split evenly): out[t] = sum over j ascending of w[t, j] * ret[t * k + j], fp32, one
// rounding. A worker is nthr threads (tid in [0, nthr)) that meet at bar(); `slot` is a shared word
// to broadcast thread 0's wait. (A whole CTA; or a GEMM CTA's consumer warpgroups after their tiles.)
// Between nodes (a.nseg): over the virtual tokens, pairs of other nodes (id -1) skipped, and with
// a.partial_out (out: the node sums, moe_nodes.cu adds them) this rank's tokens' sums are stored
// unrounded (fp32 rows, ldo floats apart), the forwarded ones' rounded (16-bit rows after them:
// they cross the network, at half the bytes).
template <int DT, class Bar>
MK_DEV void moe_weighted_sum(const MkMoeArgs& a, const MkPeers& peers, u32 part, u32 parts, u32 tid, u32 nthr, Bar bar,
                             volatile int* slot, u32 Ep) {
  const u32 lane = tid & 31, warp = tid >> 5, K = (u32)a.k;
  const u32 row_bytes = (u32)a.H * 2u;
  bar();
  if (tid == 0) *slot = moe_wait_all(a, peers, a.retflag_off, Ep, MOE_WAIT_RET) ? 1 : 0;
  bar();
  if (!*slot) return;
  const u8* ret = peer_ptr<const u8>(peers, (u32)a.me, a.ret_off);
  u8* out = reinterpret_cast<u8*>(a.out);
  u32 lo, hi;
  cta_range(moe_tokens(a), MoeCtas{part, parts}, lo, hi);
  for (u32 t = lo + warp; t < hi; t += nthr / 32) {
    for (u32 o = lane * 16u; o < row_bytes; o += 32u * 16u) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (u32 j0 = 0; j0 < K; j0 += MOE_SUM_IN_FLIGHT) {  // loads first, then the sums in j order
        uint4 v[MOE_SUM_IN_FLIGHT];
        float w[MOE_SUM_IN_FLIGHT];
        bool in[MOE_SUM_IN_FLIGHT];  // a row here: not past k, not another node's pair (id -1)
#pragma unroll
        for (u32 u = 0; u < MOE_SUM_IN_FLIGHT; ++u)
          in[u] = j0 + u < K && !(a.nseg && a.topk_ids[(u64)t * K + j0 + u] < 0);
#pragma unroll
        for (u32 u = 0; u < MOE_SUM_IN_FLIGHT; ++u) {
          const u64 pair = (u64)t * K + j0 + u;
          if (in[u]) {
            w[u] = a.topk_w[pair];
            v[u] = __ldcg(reinterpret_cast<const uint4*>(ret + pair * row_bytes + o));
          }
        }
#pragma unroll
        for (u32 u = 0; u < MOE_SUM_IN_FLIGHT; ++u) {
          if (!in[u]) continue;
          const u32 words[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            acc[2 * q] = fmaf(w[u], half_to_float<DT>((u16)(words[q] & 0xFFFFu)), acc[2 * q]);
            acc[2 * q + 1] = fmaf(w[u], half_to_float<DT>((u16)(words[q] >> 16)), acc[2 * q + 1]);
          }
        }
      }
      if (a.partial_out && t < (u32)a.T) {
        float4* p = reinterpret_cast<float4*>(out + (u64)t * (u64)a.ldo * 4u + o * 2u);
        p[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        p[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        continue;
      }
      uint4 r;
      r.x = pack2<DT>(acc[0], acc[1]);
      r.y = pack2<DT>(acc[2], acc[3]);
      r.z = pack2<DT>(acc[4], acc[5]);
      r.w = pack2<DT>(acc[6], acc[7]);
      const u64 at = a.partial_out ? moe_fwd_sum_offset((u32)a.T, a.ldo, row_bytes, t) : (u64)t * (u64)a.ldo * 2u;
      *reinterpret_cast<uint4*>(out + at + o) = r;
    }
  }
}
