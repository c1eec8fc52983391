#pragma once
// GEMM+ReduceScatter and GEMM+AllReduce: one mechanism (OP = TP_OP_RS or TP_OP_AR).
//
// CTAs [0, gemm_ctas) run the GEMM (tp_epilogue.cuh): every rank computes its partial of every
// row block, peers' blocks first, and stores each tile of block o into rank o's receive slot for
// this sender (recv[me]), then sets rflag[me][tl] = E in rank o's workspace.
// CTAs [gemm_ctas, grid) reduce: they claim this rank's tiles one by one (counter TP_CNT_REDUCE,
// in the order the GEMM produces them), wait until every sender's flag of the tile is E, add the W
// partials in rank order in fp32 and round once (the same order on every rank and in every run:
// bitwise reproducible), and store the tile into `out`. AllReduce also pushes each reduced tile
// into every peer's gather buffer (gath[me], flag gflag[me][tl]), then copies the peers' reduced
// tiles from its own gather buffer into `out` as their flags arrive (counter TP_CNT_COPY).
// Waits: reducers wait on GEMM tiles only, copiers on reducers only, and the GEMM on credits only:
// no cycle.
#include "tp_epilogue.cuh"

template <int DT>
MK_DEV uint4 tp_sum_partials(const u8* first, u64 stride_bytes, u32 world) {
  float s[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = 0.f;
  for (u32 p = 0; p < world; ++p) {  // rank order: deterministic
    const uint4 v = ld_cg_v4(first + p * stride_bytes);
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float lo, hi;
      unpack2<DT>(w[i], lo, hi);
      s[2 * i] += lo;
      s[2 * i + 1] += hi;
    }
  }
  uint4 r;
  r.x = pack2_out(DT, s[0], s[1]);
  r.y = pack2_out(DT, s[2], s[3]);
  r.z = pack2_out(DT, s[4], s[5]);
  r.w = pack2_out(DT, s[6], s[7]);
  return r;
}

// The reduction (and, AR, the gather copies) by a group of nthr threads (tid in [0, nthr)) that
// synchronise with bar(): a communication CTA from the start, or a GEMM CTA's consumers after
// their tiles. Items are claimed from the shared counters, so any number of groups cooperate.
template <int DT, int OP, class Bar>
MK_DEV void tp_reduce_work(const TpArgs& a, u32 E, u32 tid, u32 nthr, Bar bar) {
  __shared__ u32 s_item;
  __shared__ int s_ok;
  const u32 W = (u32)a.world, me = (u32)a.me, tb = tp_tiles_blk(a);
  const MkPeers peers = tp_peers(a);
  const u64 n = (u64)a.g.n;
  const u64 blk_bytes = (u64)a.mb * n * 2;  // one row block of 16-bit elements
  const u8* recv = peer_ptr<u8>(peers, me, a.recv_off);
  const u32* rflag = peer_ptr<u32>(peers, me, a.rflag_off);
  u8* out = reinterpret_cast<u8*>(a.out);
  bool ok = true;
  if (OP == TP_OP_AR) {  // every peer's gather buffer may be written once it entered this epoch
    bar();
    if (tid == 0) {
      int good = 1;
      for (u32 p = 0; p < W; ++p)
        if (p != me) good &= credits_wait(a.g.sync, peers, p, E) ? 1 : 0;
      s_ok = good;
    }
    bar();
    ok = s_ok != 0;
  }
  while (ok) {
    const u32 item = tp_claim(&a.counters[TP_CNT_REDUCE], &s_item, tid, bar);
    if (item >= tb) break;
    const u32 tl = tp_block_tile(item, (u32)a.tiles_mb, (u32)a.tiles_n);
    if (tid == 0) {
      int good = 1;
      for (u32 s = 0; s < W && good; ++s) good = wait_epoch(a.g.sync, rflag + s * tb + tl, E, (i32)s, tl) ? 1 : 0;
      __threadfence();
      s_ok = good;
    }
    bar();
    if (!s_ok) break;
    const u32 mt = tl / (u32)a.tiles_n, nt = tl - mt * (u32)a.tiles_n;
    const u32 rows = min(128u, (u32)a.mb - mt * 128u);
    const u32 vpr = (min(256u, (u32)(n - nt * 256u))) / 8u;  // 16-byte vectors per row (n % 8 == 0)
    for (u32 v = tid; v < rows * vpr; v += nthr) {
      const u32 r = v / vpr;
      const u64 row = mt * 128u + r, col = nt * 256u + (v - r * vpr) * 8u;
      const u64 off = (row * n + col) * 2;
      const uint4 sum = tp_sum_partials<DT>(recv + off, blk_bytes, W);
      const u64 orow = OP == TP_OP_AR ? (u64)me * (u64)a.mb + row : row;
      st_v4(out + (orow * (u64)a.ldo + col) * 2, sum);
      if (OP == TP_OP_AR) {
        for (u32 p = 0; p < W; ++p)
          if (p != me) st_v4(peer_ptr<u8>(peers, p, a.gath_off) + me * blk_bytes + off, sum);
      }
    }
    if (OP == TP_OP_AR) {
      __threadfence_system();  // each thread's pushes before the flags (cumulative with the barrier)
      bar();
      if (tid == 0)
        for (u32 p = 0; p < W; ++p)
          if (p != me) set_flag(peer_ptr<u32>(peers, p, a.gflag_off) + me * tb + tl, E);
    }
  }
  if (OP == TP_OP_AR) {
    const u8* gath = peer_ptr<u8>(peers, me, a.gath_off);
    const u32* gflag = peer_ptr<u32>(peers, me, a.gflag_off);
    while (ok) {
      const u32 item = tp_claim(&a.counters[TP_CNT_COPY], &s_item, tid, bar);
      if (item >= (W - 1) * tb) break;
      const u32 i = item / tb;
      const u32 o = (me + 1 + i) % W;
      const u32 tl = tp_block_tile(item - i * tb, (u32)a.tiles_mb, (u32)a.tiles_n);
      if (tid == 0) {
        s_ok = wait_epoch(a.g.sync, gflag + o * tb + tl, E, (i32)o, 0x10000u + tl) ? 1 : 0;
        __threadfence();
      }
      bar();
      if (!s_ok) break;
      const u32 mt = tl / (u32)a.tiles_n, nt = tl - mt * (u32)a.tiles_n;
      const u32 rows = min(128u, (u32)a.mb - mt * 128u);
      const u32 vpr = (min(256u, (u32)(n - nt * 256u))) / 8u;
      for (u32 v = tid; v < rows * vpr; v += nthr) {
        const u32 r = v / vpr;
        const u64 row = mt * 128u + r, col = nt * 256u + (v - r * vpr) * 8u;
        const uint4 x = ld_cg_v4(gath + o * blk_bytes + (row * n + col) * 2);
        st_v4(out + (((u64)o * (u64)a.mb + row) * (u64)a.ldo + col) * 2, x);
      }
    }
  }
  bar();
}

// A communication CTA of GEMM+RS / GEMM+AR: reduces from the start.
template <int DT, int OP>
MK_DEV void tp_reduce_cta(const TpArgs& a) {
  __shared__ u32 s_epoch;
  if (threadIdx.x == 0) s_epoch = launch_epoch(a.g.sync);
  __syncthreads();
  const u32 E = s_epoch;
  tp_reduce_work<DT, OP>(a, E, threadIdx.x, blockDim.x, TpBarCta());
  if (threadIdx.x == 0) tp_counters_done(a);
  launch_exit(a.g.sync, E);
}

// The consumers of a GEMM CTA join the reduction once their tiles are stored (args.join).
template <int DT, int OP>
struct TpJoinReduce {
  MK_DEV void operator()(const TpArgs& a, u32 E) const {
    if (a.join) tp_reduce_work<DT, OP>(a, E, threadIdx.x - 128, 256, TpBarConsumers());
  }
};

// The fused kernel of GEMM+RS / GEMM+AR. One CTA per SM, 384 threads, TP_SMEM_BYTES of dynamic
// shared memory; all CTAs must be resident (launched cooperatively).
template <int DT, int BL, int OP>
MK_DEV void tp_reduce_kernel_body(const TpArgs& args) {
  if (blockIdx.x == 0 && threadIdx.x == 0) credits_announce(tp_peers(args), launch_epoch(args.g.sync));
  if ((int)blockIdx.x < args.gemm_ctas)
    tp_gemm_cta<GemmCfg<DT, BL>, OP>(args, TpJoinReduce<DT, OP>());
  else
    tp_reduce_cta<DT, OP>(args);
}
