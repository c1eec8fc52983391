#pragma once
// The combine role of the expert-parallel kernels (design: docs/MOE.md): every received row goes
// back to row t * k + j of its source's return buffer (ret); once every rank's rows are back
// (retflag), every token's k rows are summed, weighted by its routing weights, in fp32, j
// ascending, one rounding: bitwise reproducible. mk_moe_combine_kernel (moe.cu) returns rows as
// the user's y holds them; mk_moe_gemm_combine_kernel (moe_gemm_combine.cu) stores each GEMM tile's
// rows there from its epilogue.
#include "moe_dispatch.cuh"
#include "copy.cuh"
#include "convert.cuh"

// Loads in flight per lane when a warp copies one row (copy_span over its 32 lanes).
constexpr u32 MOE_COPY_UNROLL = 8;
// Thread 0: every rank entered this epoch (its return buffer may be written).
MK_DEV bool moe_credits_all(const MkMoeArgs& a, const MkPeers& peers, u32 Ep) {
  for (u32 d = 0; d < (u32)a.world; ++d)
    if (!credits_wait(a.sync, peers, d, Ep)) return false;
  return true;
}

// Every thread of a returning (or watching) CTA, after its last row (`mine` rows of the `n` to
// return): once all are back, retflag[me] on every rank (moe_all_done; none after an error of this
// rank: a CTA that gave up on a wait counted only part of its rows, so the peers' waits time out).
MK_DEV void moe_returned(const MkMoeArgs& a, const MkPeers& peers, u32 mine, u32 n, u32 Ep) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    if (mine) atomicAdd(&a.counters[MOE_CNT_RETURNED], mine);
    moe_all_done(a, peers, MOE_CNT_RETURNED, n, a.retflag_off, Ep);
  }
}

// A warp per token of [lo, hi) (tid in [0, nthr)): out[t] = sum over j ascending of w[t, j] *
// ret[t * k + j], fp32, one rounding. Between nodes (a.nseg): over the virtual tokens, pairs of other
// nodes (id -1) skipped, and with a.partial_out (out: the node sums, moe_nodes.cu adds them) this
// rank's tokens' sums are stored unrounded (fp32 rows, ldo floats apart), the forwarded ones' rounded
// (16-bit rows after them: they cross the network, at half the bytes).
template <int DT>
MK_DEV void moe_sum_tokens(const MkMoeArgs& a, const u8* ret, u32 lo, u32 hi, u32 tid, u32 nthr) {
  const u32 lane = tid & 31, warp = tid >> 5, K = (u32)a.k;
  const u32 row_bytes = (u32)a.H * 2u;
  u8* out = reinterpret_cast<u8*>(a.out);
  for (u32 t = lo + warp; t < hi; t += nthr / 32) {
    const u64 pair0 = (u64)t * K;
    const bool here = lane < K && !(a.nseg && a.topk_ids[pair0 + lane] < 0);  // not another node's pair
    const float wl = lane < K ? a.topk_w[pair0 + lane] : 0.f;
    const u32 valid = __ballot_sync(~0u, here), n = __popc(valid);
    u32 js[MOE_MAX_TOPK];  // the token's rows here, j ascending, and their weights
    float ws[MOE_MAX_TOPK];
    u32 m = valid;
#pragma unroll
    for (u32 u = 0; u < MOE_MAX_TOPK; ++u) {
      js[u] = m ? (u32)__ffs(m) - 1u : 0u;
      ws[u] = __shfl_sync(~0u, wl, js[u]);
      m &= m - 1u;
    }
    for (u32 o = lane * 16u; o < row_bytes; o += 32u * 16u) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      uint4 v[MOE_MAX_TOPK];  // every row's 16 bytes in flight, then the sums in j order
#pragma unroll
      for (u32 u = 0; u < MOE_MAX_TOPK; ++u)
        if (u < n) v[u] = __ldcg(reinterpret_cast<const uint4*>(ret + (pair0 + js[u]) * row_bytes + o));
#pragma unroll
      for (u32 u = 0; u < MOE_MAX_TOPK; ++u) {
        if (u >= n) break;
        const u32 words[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          acc[2 * q] = fmaf(ws[u], half_to_float<DT>((u16)(words[q] & 0xFFFFu)), acc[2 * q]);
          acc[2 * q + 1] = fmaf(ws[u], half_to_float<DT>((u16)(words[q] >> 16)), acc[2 * q + 1]);
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

// Once every rank's rows are back, this worker's share (`part` of `parts`, contiguous) of the first
// `tokens` tokens. A worker is nthr threads that meet at bar() (a whole CTA; or a GEMM CTA's
// consumer warpgroups after their tiles); `slot`: a shared word to broadcast thread 0's wait.
template <int DT, class Bar>
MK_DEV void moe_weighted_sum(const MkMoeArgs& a, const MkPeers& peers, u32 tokens, u32 part, u32 parts, u32 tid,
                             u32 nthr, Bar bar, volatile int* slot, u32 Ep) {
  const u64 t0 = trace_start(a.sync);
  bar();
  if (tid == 0) *slot = moe_wait_all(a, peers, a.retflag_off, Ep, MOE_WAIT_RET) ? 1 : 0;
  bar();
  if (!*slot) return;
  u32 lo, hi;
  cta_range(tokens, MoeCtas{part, parts}, lo, hi);
  moe_sum_tokens<DT>(a, peer_ptr<const u8>(peers, (u32)a.me, a.ret_off), lo, hi, tid, nthr);
  bar();
  if (tid == 0) trace_span(a.sync, MK_ROLE_RECV, MOE_TRACE_SUM | part, t0);
}

// Between nodes, where this rank's node sums of the tokens it forwards go: segment i of vseg (the i-th
// other node j) to rank (j, lrank)'s precv, from part past its T fp32 rows (16-bit rows). The partials
// kernel sends them, or the fused combine (moe_gemm_combine.cu) does; thread 0 only. PART counts the
// tokens whose sums landed (ADD: WRITEs are unordered), so any split into WRITEs is waited for alike.
struct MoeSumsRoute {
  const MkSync& sync;
  const MkQueue& queue;
  const u32* pflags;  // the node plan's proxy flags
  const u32* vseg;
  u32 nodes, node, L, lrank, T, H, R;  // R: fwd_rows
  u64 part_off, precv_off;
  // To rank (j, lrank) of every other node: this rank's precv may be written (its sums were read).
  MK_DEV void credit(u32 Ep) const {
    for (u32 j = 0; j < nodes; ++j)
      if (j != node) queue_push(sync, queue, mk_signal_cmd(j * L + lrank, MOE_PF_PCREDIT + node, Ep, MK_FLAG_SET));
  }
  // The sums of virtual tokens [lo, hi) (forwarded: lo >= T), one WRITE per segment they cross, each
  // once its destination's credit of epoch Ep (or later) is in.
  MK_DEV bool send(u32 lo, u32 hi, u32 Ep) const {
    const u32 row_bytes = H * 2u;
    for (u32 i = 0; i + 1 < nodes; ++i) {
      const u32 j = moe_seg_node(i, node), r = j * L + lrank;
      const u32 s0 = max(lo, vseg[i]), s1 = min(hi, vseg[i + 1]);
      const u32 there = moe_seg_of(node, j);  // this node's segment at j
      if (s0 < s1 &&
          !(wait_remote_at_least(sync, queue, pflags + MOE_PF_PCREDIT + j, Ep, (i32)r, MOE_WAIT_SUMS_CREDIT + j) &&
            queue_push(sync, queue,
                       mk_write_cmd(r, MK_WORKSPACE_REGION, part_off + moe_fwd_sum_offset(T, H, row_bytes, s0),
                                    MK_WORKSPACE_REGION, precv_off + ((u64)there * R + (s0 - vseg[i])) * row_bytes,
                                    (s1 - s0) * row_bytes, MOE_PF_PART + node, s1 - s0, MK_FLAG_ADD))))
        return false;
    }
    return true;
  }
};

MK_DEV MoeSumsRoute moe_sums_route(const MkMoeArgs& a) {
  return MoeSumsRoute{a.sync,    a.queue,  a.pflags, a.vseg,          (u32)a.nseg + 1u, (u32)a.node, (u32)a.world,
                      (u32)a.me, (u32)a.T, (u32)a.H, (u32)a.fwd_rows, a.part_off,       a.precv_off};
}

// Between nodes, the fused combine's forwarded sums, piece by piece. The tokens of piece q of a bundle
// (vseg's piece starts) have their first bucket in q and the rest later, so they are all back here once
// every forwarded row of the node experts placed in pieces >= q is (fwdret per piece): the GEMM's order
// (tile_order read backward: later experts first) brings the last pieces first. Chunks of
// MOE_FWD_SUM_TOKENS tokens lie in (piece, segment) cells, cells by piece from the last, then segment;
// sums_group chunks of one cell are WRITten at once (MoeSumsRoute::send).
struct MoeFwdSums {
  u32 lo[MOE_FWD_CELLS];  // a cell's first virtual token
  u32 hi[MOE_FWD_CELLS];
  u32 chunk0[MOE_FWD_CELLS + 1];  // its first chunk; [cells]: every chunk
  u32 grp0[MOE_FWD_CELLS + 1];  // its first group; [cells]: every group (fwdgrp's words used)
  u32 piece[MOE_FWD_CELLS];
  u32 expect[MOE_MAX_PIECES];  // forwarded rows of this rank whose expert is placed in piece q
  u32 cells;
  u32 ready;  // every piece >= ready is back
  int claim;  // thread 0's claim (a chunk), or -1
  u32 cell;
};

// The piece of node expert x's rows forwarded by node rank s: where s's bundles place x (moe_send_place).
MK_DEV u32 moe_row_piece(const MkMoeArgs& a, u32 x, u32 s) {
  return moe_piece_of(moe_send_place(x, (u32)a.e_local, (u32)a.world, s), (u32)a.pieces, (u32)a.E);
}

// Every thread of a CTA: the cells and the rows each piece waits for, from this rank's count row.
MK_DEV void moe_fwd_sums_setup(const MkMoeArgs& a, const MkPeers& peers, MoeFwdSums& fs) {
  const u32 tid = threadIdx.x, E = (u32)a.E;
  if (tid < MOE_MAX_PIECES) fs.expect[tid] = 0;
  __syncthreads();
  const u32* row = peer_ptr<const u32>(peers, (u32)a.me, a.counts_off) + (u64)a.me * MOE_ROW_WORDS(E);
  for (u32 x = tid; x < E; x += blockDim.x) {
    const u32 f = ld_cg(row + x) - ld_cg(row + MOE_ROW_OWN(E) + x);
    if (f) atomicAdd(&fs.expect[moe_row_piece(a, x, (u32)a.me)], f);
  }
  if (tid == 0) {
    const u32 G = (u32)a.sums_group;
    u32 c = 0, chunks = 0, groups = 0;
    for (u32 q = (u32)a.pieces; q-- > 0;)
      for (u32 i = 0; i < (u32)a.nseg; ++i) {
        const u32 lo = a.vseg[i] + a.vseg[MOE_VPST(i, q)], hi = a.vseg[i] + a.vseg[MOE_VPST(i, q + 1)];
        if (lo == hi) continue;
        const u32 n = (hi - lo + MOE_FWD_SUM_TOKENS - 1) / MOE_FWD_SUM_TOKENS;
        fs.lo[c] = lo;
        fs.hi[c] = hi;
        fs.piece[c] = q;
        fs.chunk0[c] = chunks;
        fs.grp0[c++] = groups;
        chunks += n;
        groups += (n + G - 1) / G;
      }
    fs.chunk0[c] = chunks;
    fs.grp0[c] = groups;
    fs.cells = c;
    fs.ready = (u32)a.pieces;
  }
  __syncthreads();
}

// Thread 0: every forwarded row of the pieces >= q is back here; waited for (time-bounded) if `wait`.
MK_DEV bool moe_fwd_ready(const MkMoeArgs& a, const MkPeers& peers, MoeFwdSums& fs, u32 q, bool wait) {
  const u32* back = peer_ptr<const u32>(peers, (u32)a.me, a.fwdret_off);
  for (; fs.ready > q; --fs.ready) {
    const u32 p = fs.ready - 1;
    if (ld_acquire_sys(back + p) >= fs.expect[p]) continue;
    if (!wait) return false;
    const u64 t0 = trace_start(a.sync);
    if (!wait_at_least(a.sync, back + p, fs.expect[p], -1, MOE_WAIT_FWD_BACK + p)) return false;
    trace_span(a.sync, MK_ROLE_WAIT, MOE_TRACE_FWD_WAIT | p, t0);
  }
  return true;
}

// Every thread of a CTA: chunks of forwarded sums claimed in order, each summed (16-bit, into part),
// and the group of its cell sent by the CTA that sums the group's last chunk, so the WRITEs stream
// while the GEMM goes on. wait = false (a CTA with M-tiles to return): only chunks whose piece is back;
// true (past every M-tile with forwarded rows): every chunk left, each waited for.
template <int DT>
MK_DEV void moe_forward_sums(const MkMoeArgs& a, const MkPeers& peers, MoeFwdSums& fs, bool wait, u32 Ep) {
  const u32 tid = threadIdx.x, G = (u32)a.sums_group, chunks = fs.chunk0[fs.cells];
  u32* claims = &a.counters[MOE_CNT_FWD_CLAIM];
  const u8* ret = peer_ptr<const u8>(peers, (u32)a.me, a.ret_off);
  for (;;) {
    __syncthreads();  // every thread read the last claim before thread 0 writes the next
    if (tid == 0) {
      fs.claim = -1;
      for (u32 c = ld_cg(claims); c < chunks;) {
        const u32 c1 = wait ? atomicAdd(claims, 1u) : c;
        if (c1 >= chunks) break;
        u32 i = 0;
        while (fs.chunk0[i + 1] <= c1) ++i;
        if (!moe_fwd_ready(a, peers, fs, fs.piece[i], wait)) break;
        if (!wait && (c = atomicCAS(claims, c1, c1 + 1u)) != c1) continue;  // taken: try the next
        fs.claim = (int)c1;
        fs.cell = i;
        break;
      }
    }
    __syncthreads();
    if (fs.claim < 0) return;
    const u64 t0 = trace_start(a.sync);
    const u32 c = (u32)fs.claim, i = fs.cell, k = c - fs.chunk0[i];
    const u32 lo = fs.lo[i] + k * MOE_FWD_SUM_TOKENS;
    moe_sum_tokens<DT>(a, ret, lo, min(fs.hi[i], lo + MOE_FWD_SUM_TOKENS), tid, blockDim.x);
    __threadfence_system();
    __syncthreads();  // the chunk's sums (every thread's, fenced) before it is counted in its group
    if (tid == 0) {
      const u32 g = k / G, in_grp = min(G, fs.chunk0[i + 1] - fs.chunk0[i] - g * G);
      if (atomicAdd(&a.fwdgrp[fs.grp0[i] + g], 1u) + 1u == in_grp) {  // the group's last chunk: its WRITEs
        __threadfence_system();  // the other chunks' sums (each CTA fenced before counting)
        const u32 g0 = fs.lo[i] + g * G * MOE_FWD_SUM_TOKENS;
        moe_sums_route(a).send(g0, min(fs.hi[i], g0 + G * MOE_FWD_SUM_TOKENS), Ep);
      }
      trace_span(a.sync, MK_ROLE_SEND, MOE_TRACE_FWD_SUM | c, t0);
    }
  }
}
