// Expert-parallel MoE inside a node (mkernel/moe.py; design: docs/MOE.md): dispatch routes every
// (token, expert) pair of this rank to the rank owning the expert; combine returns each received
// row to its token's rank and sums a token's rows weighted by its routing weights.
//
// Row order on a receiving rank: by local expert, then source rank, then the source's pair order
// (t * k + j), so that every rank computes every row's place from the exchanged count rows alone and
// the layout (and the combine's sum order) is the same from run to run.
//
// Dispatch, one persistent launch (all CTAs resident: they meet at one grid barrier):
//   1. each CTA counts the pairs of its range per expert (hist[cta][e]); grid barrier;
//   2. each CTA ranks its pairs among this rank's pairs to the same expert (earlier CTAs' counts,
//      then warp by warp with __match_any_sync: deterministic); CTA 0 sends the count row to every
//      rank (after its credit) and sets cflag[me] there;
//   3. every CTA waits for all count rows, computes where its pairs go, checks the capacities and
//      expert ids (every rank sees the same rows, so all decide an error alike and skip the data),
//      copies each pair's token row into its owner's receive buffer with its meta word; the last
//      CTA to finish sets rflag[me] on every rank;
//   4. every CTA waits for all rflags and copies the received rows to `out`; CTA 0 writes the
//      per-expert row counts (the grouped GEMM's group_rows) and the total.
// Combine: rows go back to t * k + j of their source's return buffer (retflag as above), then a
// warp per token sums its k rows in fp32, j ascending, and rounds once.
#include "common.cuh"
#include "signals.cuh"
#include "peers.cuh"
#include "moe_args.cuh"

constexpr u32 MOE_THREADS = 512;
constexpr u32 MOE_WARPS = MOE_THREADS / 32;

// Wait ids (MkStatus::where) of the kernels' waits.
enum : u32 { MOE_WAIT_GRID = 0xA000u, MOE_WAIT_COUNTS = 0xA100u, MOE_WAIT_ROWS = 0xA200u, MOE_WAIT_RET = 0xA300u };

MK_DEV MkPeers moe_peers(const MkMoeArgs& a) { return MkPeers{a.peer_base, (u32)a.world, (u32)a.me}; }

// This CTA's share [lo, hi) of n items (contiguous, in order).
MK_DEV void cta_range(u32 n, u32& lo, u32& hi) {
  lo = (u32)((u64)n * blockIdx.x / gridDim.x);
  hi = (u32)((u64)n * (blockIdx.x + 1) / gridDim.x);
}

// Global loads of data other CTAs or ranks wrote during this launch: past L1, which is not coherent.
MK_DEV u32 ld_cg(const u32* p) { return __ldcg(p); }

// Thread 0: this CTA's writes (every thread fenced them) are published: counts this CTA on
// counters[c] and returns true in the CTA that finished last.
MK_DEV bool moe_last_cta(unsigned int* counters, u32 c) {
  __threadfence_system();
  return atomicAdd(&counters[c], 1u) == gridDim.x - 1;
}

// Thread 0: waits for the epoch-E flag of every rank in the array at `off` of this rank's workspace.
MK_DEV bool moe_wait_all(const MkMoeArgs& a, const MkPeers& p, u64 off, u32 E, u32 where) {
  const u32* f = peer_ptr<const u32>(p, p.me, off);
  for (u32 s = 0; s < p.size; ++s)
    if (!wait_epoch(a.sync, f + s, E, (i32)s, where + s)) return false;
  return true;
}

// Copies one row of `bytes` (a multiple of 16) with the calling warp.
MK_DEV void warp_copy_row(u8* dst, const u8* src, u32 bytes, u32 lane, bool src_remote) {
  for (u32 o = lane * 16u; o < bytes; o += 32u * 16u) {
    const uint4 v = src_remote ? __ldcg(reinterpret_cast<const uint4*>(src + o)) : *reinterpret_cast<const uint4*>(src + o);
    st_v4(dst + o, v);
  }
}

struct MoeShared {
  u32 hist[MOE_MAX_EXPERTS];       // this CTA's pairs per expert; then the running rank per expert
  u32 rowbase[MOE_MAX_EXPERTS];    // dispatch: first row of this rank's pairs to expert e at its owner
  u16 wcnt[MOE_WARPS][MOE_MAX_EXPERTS];  // a chunk's pairs per (warp, expert), then the warp's base
  u32 total_me;                    // rows this rank receives
  u32 bad;                         // pairs of this CTA with an expert id out of range
  u32 epoch;
  int ok;
};

// Steps 1-2 for this CTA's pairs [lo, hi): pair_rank[i] = pairs before i (in order) to its expert.
MK_DEV bool moe_rank_pairs(const MkMoeArgs& a, MoeShared& sh, u32 lo, u32 hi) {
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const u32 E = (u32)a.E;
  for (u32 e = tid; e < E; e += MOE_THREADS) sh.hist[e] = 0;
  for (u32 i = tid; i < MOE_WARPS * MOE_MAX_EXPERTS; i += MOE_THREADS) (&sh.wcnt[0][0])[i] = 0;
  if (tid == 0) sh.bad = 0;
  __syncthreads();
  for (u32 i = lo + tid; i < hi; i += MOE_THREADS) {
    const int e = a.topk_ids[i];
    if (e >= 0 && (u32)e < E) atomicAdd(&sh.hist[e], 1u); else atomicAdd(&sh.bad, 1u);
  }
  __syncthreads();
  for (u32 e = tid; e < E; e += MOE_THREADS) a.hist[(u64)blockIdx.x * E + e] = sh.hist[e];
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    atomicAdd(&a.counters[MOE_CNT_HIST], 1u);
    sh.ok = wait_at_least(a.sync, &a.counters[MOE_CNT_HIST], gridDim.x, -1, MOE_WAIT_GRID) ? 1 : 0;
  }
  __syncthreads();
  if (!sh.ok) return false;
  for (u32 e = tid; e < E; e += MOE_THREADS) {  // running rank: the pairs of earlier CTAs
    u32 b = 0;
    for (u32 c = 0; c < blockIdx.x; ++c) b += ld_cg(&a.hist[(u64)c * E + e]);
    sh.hist[e] = b;
  }
  __syncthreads();
  for (u32 c0 = lo; c0 < hi; c0 += MOE_THREADS) {
    const u32 i = c0 + tid;
    int e = i < hi ? a.topk_ids[i] : -1;
    if (e < 0 || (u32)e >= E) e = -1;
    const u32 same = __match_any_sync(0xFFFFFFFFu, e);
    const u32 before = same & ((1u << lane) - 1u);
    const bool leader = before == 0;
    if (leader && e >= 0) sh.wcnt[warp][e] = (u16)__popc(same);
    __syncthreads();
    for (u32 x = tid; x < E; x += MOE_THREADS) {  // per expert: bases of the warps, in warp order
      u32 acc = sh.hist[x];
      for (u32 w = 0; w < MOE_WARPS; ++w) {
        const u32 c = sh.wcnt[w][x];
        sh.wcnt[w][x] = c ? (u16)(acc - sh.hist[x]) : (u16)0;  // relative to the chunk's start (fits 16 bits)
        acc += c;
      }
      sh.rowbase[x] = acc;  // the running rank after this chunk (rowbase is free until step 3)
    }
    __syncthreads();
    // pair_rank has capacity entries: more pairs than that end in a capacity error (step 3), unread.
    if (e >= 0 && i < (u32)a.capacity) a.pair_rank[i] = (int)(sh.hist[e] + sh.wcnt[warp][e] + __popc(before));
    __syncthreads();
    if (leader && e >= 0) sh.wcnt[warp][e] = 0;
    for (u32 x = tid; x < E; x += MOE_THREADS) sh.hist[x] = sh.rowbase[x];
    __syncthreads();
  }
  return true;
}

__global__ void __launch_bounds__(MOE_THREADS, 1) mk_moe_dispatch_kernel(const __grid_constant__ MkMoeArgs a) {
  __shared__ MoeShared sh;
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const MkPeers peers = moe_peers(a);
  const u32 W = (u32)a.world, me = (u32)a.me, E = (u32)a.E, El = (u32)a.e_local, K = (u32)a.k;
  const u32 P = (u32)a.T * K, RW = MOE_ROW_WORDS(E);
  if (tid == 0) {
    sh.epoch = launch_epoch(a.sync);
    if (blockIdx.x == 0) credits_announce(peers, sh.epoch);
  }
  __syncthreads();
  const u32 Ep = sh.epoch;
  u32 lo, hi;
  cta_range(P, lo, hi);
  bool ok = moe_rank_pairs(a, sh, lo, hi);

  // CTA 0: this rank's count row to every rank.
  if (ok && blockIdx.x == 0) {
    for (u32 e = tid; e < E; e += MOE_THREADS) {
      u32 n = 0;
      for (u32 c = 0; c < gridDim.x; ++c) n += ld_cg(&a.hist[(u64)c * E + e]);
      sh.rowbase[e] = n;
    }
    if (tid == 0) sh.total_me = 0;
    __syncthreads();
    for (u32 e = tid; e < E; e += MOE_THREADS) atomicAdd(&sh.total_me, sh.rowbase[e]);  // pairs with valid ids
    __syncthreads();
    for (u32 d = 0; d < W; ++d) {
      if (tid == 0) sh.ok = credits_wait(a.sync, peers, d, Ep) ? 1 : 0;
      __syncthreads();
      if (!sh.ok) {
        ok = false;
        break;  // every thread, at the same d
      }
      u32* row = peer_ptr<u32>(peers, d, a.counts_off) + (u64)me * RW;
      for (u32 e = tid; e < E; e += MOE_THREADS) row[e] = sh.rowbase[e];
      if (tid == 0) {
        row[MOE_ROW_T(E)] = (u32)a.T;
        row[MOE_ROW_BAD(E)] = P - sh.total_me;  // pairs whose id was out of range
      }
      __threadfence_system();
      __syncthreads();
      if (tid == 0) set_flag(peer_ptr<u32>(peers, d, a.cflag_off) + me, Ep);
    }
  }

  // Every CTA: the count rows of all ranks; where this rank's pairs go; the input checks.
  __syncthreads();  // every thread has read sh.ok (above, on every path) before thread 0 writes it
  if (tid == 0) sh.ok = ok && moe_wait_all(a, peers, a.cflag_off, Ep, MOE_WAIT_COUNTS) ? 1 : 0;
  __syncthreads();
  ok = sh.ok != 0;
  const u32* counts = peer_ptr<const u32>(peers, me, a.counts_off);
  if (ok) {
    for (u32 e = tid; e < E; e += MOE_THREADS) {
      u32 n = 0, before = 0;
      for (u32 s = 0; s < W; ++s) {
        const u32 c = ld_cg(&counts[(u64)s * RW + e]);
        n += c;
        if (s < me) before += c;
      }
      sh.hist[e] = n;         // rows of expert e in all
      sh.rowbase[e] = before; // rows of expert e from ranks before this one
    }
    __syncthreads();
    if (tid == 0) {  // per owner: expert bases (a scan), capacity; every rank's tokens and ids
      u32 err_where = 0, err_expected = 0, err_seen = 0;
      for (u32 d = 0; d < W; ++d) {
        u32 base = 0;
        for (u32 e = d * El; e < (d + 1) * El; ++e) {
          const u32 n = sh.hist[e];
          sh.rowbase[e] += base;
          base += n;
        }
        if (d == me) sh.total_me = base;
        if (base > (u32)a.capacity && !err_where) { err_where = MOE_ERR_CAPACITY; err_expected = a.capacity; err_seen = base; }
      }
      for (u32 s = 0; s < W; ++s) {
        const u32 ts = ld_cg(&counts[(u64)s * RW + MOE_ROW_T(E)]);
        const u32 bad = ld_cg(&counts[(u64)s * RW + MOE_ROW_BAD(E)]);
        if (bad && !err_where) { err_where = MOE_ERR_EXPERT_ID; err_expected = E; err_seen = bad; }
        if ((u64)ts * K > (u64)a.capacity && !err_where) { err_where = MOE_ERR_CAPACITY; err_expected = a.capacity; err_seen = ts * K; }
      }
      if (err_where) {
        if (blockIdx.x == 0) record_error(a.sync, MK_ERR_INPUT, -1, err_where, err_expected, err_seen, 0);
        sh.ok = 0;
      }
      for (u32 d = 0; d < W && sh.ok; ++d) sh.ok = credits_wait(a.sync, peers, d, Ep) ? 1 : 0;  // rows may go
    }
    __syncthreads();
    ok = sh.ok != 0;
  }

  // Every CTA: its pairs' token rows to their experts' owners.
  if (ok) {
    const u32 row_bytes = (u32)a.H * 2u;
    const u8* x = reinterpret_cast<const u8*>(a.x);
    for (u32 i = lo + warp; i < hi; i += MOE_WARPS) {
      const u32 e = (u32)a.topk_ids[i];
      const u32 d = e / El;
      const u32 row = sh.rowbase[e] + (u32)a.pair_rank[i];
      const u32 t = i / K;
      warp_copy_row(peer_ptr<u8>(peers, d, a.recv_off) + (u64)row * row_bytes, x + (u64)t * (u64)a.ldx * 2u,
                    row_bytes, lane, false);
      if (lane == 0) peer_ptr<u32>(peers, d, a.meta_off)[row] = (me << 24) | i;
    }
    __threadfence_system();
    __syncthreads();
    if (tid == 0 && moe_last_cta(a.counters, MOE_CNT_SENT))
      for (u32 d = 0; d < W; ++d) set_flag(peer_ptr<u32>(peers, d, a.rflag_off) + me, Ep);
    // Every CTA: once every rank's rows are here, its share of them to `out`.
    if (tid == 0) sh.ok = moe_wait_all(a, peers, a.rflag_off, Ep, MOE_WAIT_ROWS) ? 1 : 0;
    __syncthreads();
    if (sh.ok) {
      const u32 vpr = row_bytes / 16u;
      const uint4* src = reinterpret_cast<const uint4*>(peer_ptr<u8>(peers, me, a.recv_off));
      u8* out = reinterpret_cast<u8*>(a.out);
      const u64 n = (u64)sh.total_me * vpr;
      for (u64 v = (u64)blockIdx.x * MOE_THREADS + tid; v < n; v += (u64)gridDim.x * MOE_THREADS) {
        const u64 r = v / vpr, c = v - r * vpr;
        *reinterpret_cast<uint4*>(out + r * (u64)a.ldo * 2u + c * 16u) = __ldcg(src + v);
      }
      if (blockIdx.x == 0) {
        for (u32 e = tid; e < El; e += MOE_THREADS) a.group_rows[e] = (int)sh.hist[me * El + e];
        if (tid == 0) a.received[0] = (int)sh.total_me;
      }
    }
  }
  __syncthreads();
  if (tid == 0) counters_reset_by_last_block(a.counters, MOE_CNT_WORDS, MOE_CNT_DONE);
  launch_exit(a.sync, Ep);
}

template <int DT>
MK_DEV float half_to_float(u16 h) {
  if (DT == 0) return __uint_as_float((u32)h << 16);  // bfloat16
  float f;
  asm("{ .reg .f16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
  return f;
}

template <int DT>
__global__ void __launch_bounds__(MOE_THREADS, 1) mk_moe_combine_kernel(const __grid_constant__ MkMoeArgs a) {
  __shared__ u32 s_epoch;
  __shared__ int s_ok;
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const MkPeers peers = moe_peers(a);
  const u32 W = (u32)a.world, K = (u32)a.k;
  const u32 row_bytes = (u32)a.H * 2u;
  if (tid == 0) {
    s_epoch = launch_epoch(a.sync);
    if (blockIdx.x == 0) credits_announce(peers, s_epoch);
    s_ok = 1;
    for (u32 d = 0; d < W && s_ok; ++d) s_ok = credits_wait(a.sync, peers, d, s_epoch) ? 1 : 0;
  }
  __syncthreads();
  const u32 Ep = s_epoch;
  if (s_ok) {
    const u32* meta = peer_ptr<const u32>(peers, (u32)a.me, a.meta_off);
    const u8* y = reinterpret_cast<const u8*>(a.y);
    u32 lo, hi;
    cta_range((u32)a.received[0], lo, hi);
    for (u32 i = lo + warp; i < hi; i += MOE_WARPS) {
      const u32 m = ld_cg(&meta[i]);
      warp_copy_row(peer_ptr<u8>(peers, m >> 24, a.ret_off) + (u64)(m & 0xFFFFFFu) * row_bytes,
                    y + (u64)i * (u64)a.ldy * 2u, row_bytes, lane, false);
    }
    __threadfence_system();
    __syncthreads();
    if (tid == 0 && moe_last_cta(a.counters, MOE_CNT_SENT))
      for (u32 d = 0; d < W; ++d) set_flag(peer_ptr<u32>(peers, d, a.retflag_off) + (u32)a.me, Ep);
    if (tid == 0) s_ok = moe_wait_all(a, peers, a.retflag_off, Ep, MOE_WAIT_RET) ? 1 : 0;
    __syncthreads();
  }
  if (s_ok) {  // a warp per token: out[t] = sum over j ascending of w[t, j] * ret[t * k + j], fp32, one rounding
    const u8* ret = peer_ptr<const u8>(peers, (u32)a.me, a.ret_off);
    u8* out = reinterpret_cast<u8*>(a.out);
    u32 lo, hi;
    cta_range((u32)a.T, lo, hi);
    for (u32 t = lo + warp; t < hi; t += MOE_WARPS) {
      for (u32 o = lane * 16u; o < row_bytes; o += 32u * 16u) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (u32 j = 0; j < K; ++j) {
          const float w = a.topk_w[(u64)t * K + j];
          const uint4 v = __ldcg(reinterpret_cast<const uint4*>(ret + ((u64)t * K + j) * row_bytes + o));
          const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            acc[2 * q] = fmaf(w, half_to_float<DT>((u16)(words[q] & 0xFFFFu)), acc[2 * q]);
            acc[2 * q + 1] = fmaf(w, half_to_float<DT>((u16)(words[q] >> 16)), acc[2 * q + 1]);
          }
        }
        uint4 r;
        r.x = pack2<DT>(acc[0], acc[1]);
        r.y = pack2<DT>(acc[2], acc[3]);
        r.z = pack2<DT>(acc[4], acc[5]);
        r.w = pack2<DT>(acc[6], acc[7]);
        *reinterpret_cast<uint4*>(out + (u64)t * (u64)a.ldo * 2u + o) = r;
      }
    }
  }
  __syncthreads();
  if (tid == 0) counters_reset_by_last_block(a.counters, MOE_CNT_WORDS, MOE_CNT_DONE);
  launch_exit(a.sync, Ep);
}

static_assert(sizeof(MkMoeArgs) == 272, "MkMoeArgs layout changed: update mkernel/moe.py");
