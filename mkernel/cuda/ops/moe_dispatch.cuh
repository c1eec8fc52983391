#pragma once
// The dispatch role of the expert-parallel kernels (design: docs/MOE.md), run by a set of CTAs
// (MoeCtas: all of mk_moe_dispatch_kernel's, the first arrivals of mk_moe_dispatch_gemm_kernel) of
// THREADS threads each, ctas.idx being the CTA's arrival rank among them. Work is claimed, never
// dealt by index, so that any resident subset of the CTAs finishes (docs/MOE.md "Residency"):
//   1. the pairs form ctas.n chunks; CTAs claim chunks and count each one's pairs per expert
//      (hist[chunk][e]); every CTA waits until every chunk is counted;
//   2. CTAs claim chunks again and rank each one's pairs among this rank's pairs to the same expert
//      (earlier chunks' counts, then warp by warp with __match_any_sync: deterministic), writing each
//      pair's index at its place in the send order (send_order); the first CTA sends the count row
//      to every rank (after its credit) and sets cflag[me] there;
//   3. every CTA waits for all count rows, computes where this rank's rows go at their owners,
//      checks the capacities and expert ids (every rank sees the same rows, so all decide an error
//      alike and skip the data); the first CTA writes the per-expert row counts (group_rows, the
//      grouped GEMM's) and the verdict counters[MOE_CNT_PLAN] that a fused GEMM waits for;
//   4. once every chunk is ranked, the CTAs' warps claim runs of MOE_SEND_RUN positions of the send
//      order in turn (each warp's lane 0 moves its rows by TMA bulk copies, MoeCopier), so rows
//      leave local expert by local expert: a (source, expert) block is complete early and its flag
//      eflag[me][le] at the owner (set by the warp that completed the block) lets the owner's GEMM
//      start on it while the later experts' rows are in flight. Once every run is sent, rflag[me]
//      is set on every rank (all of this rank's rows are there).
//
// Send order: origin class (own-origin pairs, then between nodes forwarded ones), then local expert
// index le ascending, then owner d = me, me + 1, ... (mod W), then the pair order t * k + j: every
// owner gets its first experts first, and between nodes the rows already here go before the
// forwarded ones, whose bundles are still crossing the network (docs/MOE.md "Overlap"). At the owner
// an expert's rows are by class, then source, then pair order: one class per block and flag.
#include "common.cuh"
#include "signals.cuh"
#include "peers.cuh"
#include "mbar_wait.cuh"
#include "queue.cuh"
#include "trace.cuh"
#include "moe_args.cuh"

// Trace span ids (trace mode, tools/moe_trace.py): the launch's announce and each CTA's exit (as the TP
// ops'), then per kind in the top byte, the item in the rest.
enum : u32 {
  MOE_TRACE_ANNOUNCE = 0x80000000u,  // | epoch
  MOE_TRACE_EXIT = 0x40000000u,  // | block
  MOE_TRACE_GEMM = 0x01000000u,  // a GEMM CTA's tiles
  MOE_TRACE_RETURN = 0x02000000u,  // | M-tile unit: its wait and counts
  MOE_TRACE_FWD_WAIT = 0x03000000u,  // forwarded rows back (fwdret)
  MOE_TRACE_FWD_SUM = 0x04000000u,  // | chunk of forwarded sums, summed and its WRITEs queued
  MOE_TRACE_SUM = 0x05000000u,  // a CTA's final sums (their wait included)
  MOE_TRACE_PART_WAIT = 0x06000000u,  // partials kernel: the other nodes' sums in
  MOE_TRACE_DISPATCH = 0x07000000u,  // | arrival: a dispatch CTA's rows sent (the fused kernel's)
  MOE_TRACE_BUNDLE_WAIT = 0x08000000u,  // | source node: a sending warp's wait for its bundle
  MOE_TRACE_PART_ADD = 0x09000000u,  // | block: partials kernel, a CTA's tokens added and stored
  MOE_TRACE_PART_FLUSH = 0x0A000000u  // partials kernel: this rank's WRITEs flushed (its first CTA)
};

// Wait ids (MkStatus::where) of the kernels' waits.
enum : u32 {
  MOE_WAIT_GRID = 0xA000u,
  MOE_WAIT_COUNTS = 0xA100u,
  MOE_WAIT_ROWS = 0xA200u,
  MOE_WAIT_RET = 0xA300u,
  MOE_WAIT_ORDER = 0xA400u,
  MOE_WAIT_PLAN = 0xA500u,
  MOE_WAIT_EXPERT = 0xA600u,
  MOE_WAIT_COPY = 0xA700u,
  MOE_WAIT_BUNDLE_ROWS = 0xC280u,  // + node: its bundle's rows (the exchange's ROWS flag)
  MOE_WAIT_FLUSH = 0xC300u,  // + rank: the exchange's commands to it applied
  MOE_WAIT_FWD_BACK = 0xC600u,  // the fused combine: every forwarded pair's row back here
  MOE_WAIT_SUMS_CREDIT = 0xC680u,  // + node: its rank's combine entered the epoch (its precv is free)
  MOE_WAIT_TILE_STORED = 0xB0000u  // + tile id (the fused combine's wait for a GEMM tile)
};

// Verdict of step 3 (counters[MOE_CNT_PLAN]): zero until the first CTA decided.
enum : u32 { MOE_PLAN_OK = 1, MOE_PLAN_FAILED = 2 };

// The CTAs running one role: this one's index among them and their number.
struct MoeCtas {
  u32 idx, n;
};

// Every thread: this CTA's arrival rank in the launch (roles go by arrival, not by index: a CTA
// that has arrived runs, so the first arrivals' duties are done whatever part of the grid is
// resident). `slot`: a shared word.
MK_DEV u32 moe_arrival(const MkMoeArgs& a, volatile u32* slot) {
  if (threadIdx.x == 0) *slot = atomicAdd(&a.counters[MOE_CNT_ARRIVE], 1u);
  __syncthreads();
  const u32 r = *slot;
  __syncthreads();
  return r;
}

MK_DEV MkPeers moe_peers(const MkMoeArgs& a) { return MkPeers{a.peer_base, (u32)a.world, (u32)a.me}; }

// This CTA's share [lo, hi) of n items (contiguous, in order).
MK_DEV void cta_range(u32 n, MoeCtas c, u32& lo, u32& hi) {
  lo = (u32)((u64)n * c.idx / c.n);
  hi = (u32)((u64)n * (c.idx + 1) / c.n);
}

// Global loads of data other CTAs or ranks wrote during this launch: past L1, which is not coherent.
MK_DEV u32 ld_cg(const u32* p) { return __ldcg(p); }

// Tokens the kernel routes or sums: this rank's, or between nodes the virtual tokens (this rank's,
// then those it forwards), counted on the device by the exchange (moe_nodes.cu).
MK_DEV u32 moe_tokens(const MkMoeArgs& a) { return a.nseg ? a.vseg[a.nseg] : (u32)a.T; }

// Between nodes, the byte offset in the node sums (MkMoeArgs::partial_out) of forwarded virtual
// token t >= T: past this rank's T fp32 rows (ldo floats apart), 16-bit rows row_bytes apart.
MK_DEV u64 moe_fwd_sum_offset(u32 T, long long ldo, u32 row_bytes, u32 t) {
  return (u64)T * (u64)ldo * 4u + (u64)(t - T) * row_bytes;
}

// Between nodes, node j's segment in node `node`'s [N - 1] arrays (j != node), and the node of segment i.
MK_DEV u32 moe_seg_of(u32 j, u32 node) { return j < node ? j : j - 1; }
MK_DEV u32 moe_seg_node(u32 i, u32 node) { return i < node ? i : i + 1; }

// The forwarded segment i (of nseg) that holds virtual token t >= vseg[0]: vseg[i] <= t < vseg[i + 1].
MK_DEV u32 moe_fwd_segment(const u32* vseg, u32 nseg, u32 t) {
  u32 i = 0;
  while (i + 1 < nseg && t >= vseg[i + 1]) ++i;
  return i;
}

// The row of virtual token t: this rank's x, or a forwarded segment's (vseg: a copy of a.vseg).
MK_DEV const u8* moe_token_row(const MkMoeArgs& a, const u32* vseg, u32 t) {
  if (t < (u32)a.T) return reinterpret_cast<const u8*>(a.x) + (u64)t * (u64)a.ldx * 2u;
  const u32 i = moe_fwd_segment(vseg, (u32)a.nseg, t);
  return reinterpret_cast<const u8*>(a.xfwd) + ((u64)i * (u64)a.fwd_rows + (t - vseg[i])) * (u64)a.H * 2u;
}

// Thread 0 of every CTA of a role, after its share: once counters[c] (items done, each counted
// after its writes' system fence) reaches n, flag[me] = E on every rank (whichever CTAs see it;
// with n = 0, all). Not after an error of this rank: the peers' waits then time out and raise.
MK_DEV void moe_all_done(const MkMoeArgs& a, const MkPeers& peers, u32 c, u32 n, u64 flag_off, u32 E) {
  if (atomicAdd(&a.counters[c], 0u) != n || error_recorded(a.sync)) return;
  __threadfence_system();
  for (u32 d = 0; d < (u32)a.world; ++d) set_flag(peer_ptr<u32>(peers, d, flag_off) + (u32)a.me, E);
}

// Thread 0: waits for the epoch-E flag of every rank in the array at `off` of this rank's workspace.
MK_DEV bool moe_wait_all(const MkMoeArgs& a, const MkPeers& p, u64 off, u32 E, u32 where) {
  const u32* f = peer_ptr<const u32>(p, p.me, off);
  for (u32 s = 0; s < p.size; ++s)
    if (!wait_epoch(a.sync, f + s, E, (i32)s, where + s)) return false;
  return true;
}

// Positions of the send order a warp sends between two completions (its flags wait for those).
constexpr u32 MOE_SEND_RUN = 8;

// Between nodes, the place of node expert x (of L ranks x El) in the order the node's rank `me` sends
// rows (local expert, then owner from that rank on: the send order above). A bundle is sorted by its
// tokens' bucket, the least place of their experts there, and cut into P pieces of consecutive
// buckets: bucket b (of epn) is in piece b P / epn (moe_nodes.cu).
MK_DEV u32 moe_send_place(u32 x, u32 El, u32 L, u32 me) {
  const u32 d = x / El;
  return (x - d * El) * L + (d + L - me) % L;
}
MK_DEV u32 moe_piece_of(u32 b, u32 P, u32 epn) { return b * P / epn; }
// A token's bucket at node rank `me`: the least place of its experts (ids: node-local, -1 elsewhere);
// `none` if it has no pair there.
MK_DEV u32 moe_token_bucket(const int* ids, u32 K, u32 El, u32 L, u32 me, u32 none) {
  u32 b = none;
  for (u32 q = 0; q < K; ++q) {
    const int x = __ldcg(ids + q);
    if (x >= 0) b = min(b, moe_send_place((u32)x, El, L, me));
  }
  return b;
}

// Between nodes, lane 0 of a sending warp: the piece of the bundle that holds forwarded virtual
// token t has landed (its ROWS flag; `seen`: the (segment, piece)s known to be in). A timeout is
// recorded, no flag follows.
MK_DEV void moe_wait_bundle(const MkMoeArgs& a, const u32* vseg, u32 t, u32 xE, u64& seen) {
  const u32 i = moe_fwd_segment(vseg, (u32)a.nseg, t), K = (u32)a.k;
  const u32 b = moe_token_bucket(a.topk_ids + (u64)t * K, K, (u32)a.e_local, (u32)a.world, (u32)a.me, (u32)a.E);
  const u32 q = moe_piece_of(b, (u32)a.pieces, (u32)a.E), bit = i * MOE_MAX_PIECES + q;
  if ((seen >> bit) & 1u) return;
  const u64 t0 = trace_start(a.sync);
  const u32 j = moe_seg_node(i, (u32)a.node);
  wait_remote_epoch(a.sync, a.queue, a.pflags + MOE_PF_ROWS + j * MOE_MAX_PIECES + q, xE,
                    (i32)(j * (u32)a.world + (u32)a.me), MOE_WAIT_BUNDLE_ROWS + j);
  fence_proxy_async_global();  // rows the proxy stored, before the copier's bulk loads read them
  seen |= 1ull << bit;
  trace_span(a.sync, MK_ROLE_WAIT, MOE_TRACE_BUNDLE_WAIT | j, t0);
}
static_assert((MOE_MAX_NODES - 1) * MOE_MAX_PIECES <= 64, "moe_wait_bundle's pieces seen: one word");

// Between nodes, thread 0 of the first CTA once its rows are sent: the exchange's commands to every
// rank of the other nodes are applied, so the next exchange may restage their sources.
MK_DEV void moe_wait_flushed(const MkMoeArgs& a, u32 xE) {
  const u32 L = (u32)a.world;
  for (u32 r = 0; r < ((u32)a.nseg + 1) * L; ++r)
    if (r / L != (u32)a.node &&
        !wait_remote_epoch(a.sync, a.queue, a.pflags + MOE_PF_FLUSH + r, xE, (i32)r, MOE_WAIT_FLUSH + r))
      return;
}

// A warp's bulk copier, run by lane 0: pieces (dst, src, bytes <= CHUNK) go through two shared-memory
// buffers by TMA, the next piece's load in flight while the current one is stored, so that one
// thread keeps 2 x CHUNK bytes of every warp moving (a register copy keeps one 16-byte load per lane
// in flight: ~1 GB/s a warp, 10-20 GB/s a CTA measured in the fused kernel's first runs).
template <u32 CHUNK>
struct MoeCopier {
  u32 buf;  // shared address of buffer 0; buffer 1 follows
  u32 bar;  // shared address of mbarrier 0 (8 bytes); mbarrier 1 follows
  const MkSync& sync;
  u32 k = 0;  // pieces put so far (piece k uses buffer and mbarrier k % 2)
  void* last_dst = nullptr;  // piece k - 1 while its store is pending, else null
  u32 last_bytes = 0;

  MK_DEV void store_previous() {  // piece k - 1: wait for its load, store it
    const u32 b = (k - 1) & 1;
    if (!mbar_wait_timed(bar + 8 * b, ((k - 1) >> 1) & 1, sync, MOE_WAIT_COPY))
      mbar_wait_landed(bar + 8 * b, ((k - 1) >> 1) & 1);  // its buffer is stored and re-armed next
    bulk_store_1d(last_dst, buf + b * CHUNK, last_bytes);
    bulk_commit();
  }
  MK_DEV void put(void* dst, const void* src, u32 bytes) {
    const u32 b = k & 1;
    if (k >= 2) bulk_wait_read<0>();  // the store of piece k - 2 has read buffer b
    mbar_arrive_expect_tx(bar + 8 * b, bytes);
    bulk_load_1d(buf + b * CHUNK, src, bytes, bar + 8 * b);
    if (last_dst != nullptr) store_previous();
    last_dst = dst;
    last_bytes = bytes;
    ++k;
  }
  // Every piece put is stored and its writes performed, visible to the generic proxy and (after the
  // system fence) to whoever acquires a flag this thread sets next.
  MK_DEV void finish() {
    if (last_dst != nullptr) store_previous();
    last_dst = nullptr;
    bulk_wait<0>();
    fence_proxy_async_global();
    fence_sys();
  }
};

template <u32 THREADS>
struct MoeShared {
  static constexpr u32 WARPS = THREADS / 32;
  static constexpr u32 CHUNK = THREADS >= 512 ? 4096u : 8192u;  // bytes of one copier buffer
  static constexpr u32 STAGE_BYTES = WARPS * 2u * CHUNK;  // the copiers' buffers (beside this struct)
  u64 copy_bar[WARPS][2];  // each warp's copier mbarriers
  u32 hist[MOE_MAX_EXPERTS];  // this CTA's pairs per expert; then the running rank per expert
  u32 total[MOE_MAX_EXPERTS];  // this rank's pairs per expert; from step 3 on, all ranks' rows
  u32 sbase[MOE_MAX_EXPERTS];  // first position of expert e's pairs in the send order
  u32 rowbase[MOE_MAX_EXPERTS];  // step 3: first row of this rank's pairs to expert e at its owner
  u32 own[MOE_MAX_EXPERTS];  // this rank's own-origin pairs per expert (all of them inside a node)
  u32 sbase2[MOE_MAX_EXPERTS];  // sbase and rowbase of its forwarded pairs
  u32 rowbase2[MOE_MAX_EXPERTS];
  u32 aux[MOE_MAX_EXPERTS];  // step 3: own-origin rows of expert e from all ranks
  u16 wcnt[WARPS][MOE_MAX_EXPERTS];  // a chunk's pairs per (warp, expert), then the warp's base
  u32 vseg[MOE_MAX_NODES];  // between nodes: a.vseg (the forwarded segments' first tokens)
  u32 mine;  // this rank's pairs with a valid expert id
  u32 mine_own;  // of those, own-origin: the send order's first positions
  u32 total_me;  // rows this rank receives
  u32 claim;  // the CTA's last claim (moe_claim)
  u32 epoch;
  u32 xepoch;  // between nodes: the exchange's epoch (its proxy flags')
  int ok;
};

// Step 2 for the pairs [lo, hi) of one chunk, sh.hist[e] holding the pairs of earlier chunks to e:
// every pair's index at its place in the send order, warp by warp (__match_any_sync: deterministic).
template <u32 THREADS>
MK_DEV void moe_rank_chunk(const MkMoeArgs& a, MoeShared<THREADS>& sh, u32 lo, u32 hi) {
  constexpr u32 WARPS = MoeShared<THREADS>::WARPS;
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, E = (u32)a.E;
  for (u32 c0 = lo; c0 < hi; c0 += THREADS) {
    const u32 i = c0 + tid;
    int e = i < hi ? a.topk_ids[i] : -1;
    if (e < 0 || (u32)e >= E) e = -1;
    const u32 same = __match_any_sync(0xFFFFFFFFu, e);
    const u32 before = same & ((1u << lane) - 1u);
    const bool leader = before == 0;
    if (leader && e >= 0) sh.wcnt[warp][e] = (u16)__popc(same);
    __syncthreads();
    for (u32 x = tid; x < E; x += THREADS) {  // per expert: bases of the warps, in warp order
      u32 acc = sh.hist[x];
      for (u32 w = 0; w < WARPS; ++w) {
        const u32 c = sh.wcnt[w][x];
        sh.wcnt[w][x] = c ? (u16)(acc - sh.hist[x]) : (u16)0;  // relative to the chunk's start (fits 16 bits)
        acc += c;
      }
      sh.rowbase[x] = acc;  // the running rank after this chunk (rowbase is free until step 3)
    }
    __syncthreads();
    // send_order has capacity entries: more pairs than that end in a capacity error (step 3), unread.
    if (e >= 0) {  // own-origin pairs precede forwarded ones in pair order: the rank tells the class
      const u32 rank = sh.hist[e] + sh.wcnt[warp][e] + __popc(before);
      const u32 pos = rank < sh.own[e] ? sh.sbase[e] + rank : sh.sbase2[e] + (rank - sh.own[e]);
      if (pos < (u32)a.capacity) a.send_order[pos] = (int)i;
    }
    __syncthreads();
    if (leader && e >= 0) sh.wcnt[warp][e] = 0;
    for (u32 x = tid; x < E; x += THREADS) sh.hist[x] = sh.rowbase[x];
    __syncthreads();
  }
}

// Thread 0 claims the next item of counters[c] for the CTA; every thread gets it (sh.claim).
template <u32 THREADS>
MK_DEV u32 moe_claim(const MkMoeArgs& a, MoeShared<THREADS>& sh, u32 c) {
  __syncthreads();  // every thread has read the previous claim
  if (threadIdx.x == 0) sh.claim = atomicAdd(&a.counters[c], 1u);
  __syncthreads();
  return sh.claim;
}

// Steps 1-2. The role's pairs form ctas.n chunks, claimed in order twice: (1) each chunk's pairs
// per expert into hist[chunk][e]; once every chunk is counted (chunks are held by running CTAs
// only, so the wait ends with any resident subset), (2) each chunk's pairs ranked: send_order[sbase[e]
// + rank] = i, rank = pairs before i (in order) to its expert. Leaves sh.total and sh.sbase.
template <u32 THREADS>
MK_DEV bool moe_rank_pairs(const MkMoeArgs& a, MoeShared<THREADS>& sh, MoeCtas ctas) {
  constexpr u32 WARPS = MoeShared<THREADS>::WARPS;
  const u32 tid = threadIdx.x;
  const u32 E = (u32)a.E, El = (u32)a.e_local, W = (u32)a.world, me = (u32)a.me;
  const u32 P = moe_tokens(a) * (u32)a.k;
  for (u32 i = tid; i < WARPS * MOE_MAX_EXPERTS; i += THREADS) (&sh.wcnt[0][0])[i] = 0;
  for (u32 c; (c = moe_claim<THREADS>(a, sh, MOE_CNT_CLAIM_HIST)) < ctas.n;) {
    u32 lo, hi;
    cta_range(P, MoeCtas{c, ctas.n}, lo, hi);
    for (u32 e = tid; e < E; e += THREADS) sh.hist[e] = 0;
    __syncthreads();
    for (u32 i = lo + tid; i < hi; i += THREADS) {
      const int e = a.topk_ids[i];
      if (e >= 0 && (u32)e < E) atomicAdd(&sh.hist[e], 1u);
    }
    __syncthreads();
    for (u32 e = tid; e < E; e += THREADS) a.hist[(u64)c * E + e] = sh.hist[e];
    __threadfence();
    __syncthreads();
    if (tid == 0) atomicAdd(&a.counters[MOE_CNT_HIST], 1u);
  }
  if (tid == 0) sh.ok = wait_at_least(a.sync, &a.counters[MOE_CNT_HIST], ctas.n, -1, MOE_WAIT_GRID) ? 1 : 0;
  __syncthreads();
  if (!sh.ok) return false;
  for (u32 e = tid; e < E; e += THREADS) {  // this rank's pairs per expert
    u32 t = 0;
    for (u32 c = 0; c < ctas.n; ++c) t += ld_cg(&a.hist[(u64)c * E + e]);
    sh.total[e] = t;
    sh.own[e] = a.nseg ? min(t, ld_cg(a.vown + e)) : t;  // (the exchange's count: a previous launch)
  }
  __syncthreads();
  if (tid == 0) {  // the send order's expert bases: class, local index, then owner from this rank on
    u32 p = 0;
    for (u32 c = 0; c < 2; ++c) {
      for (u32 le = 0; le < El; ++le)
        for (u32 q = 0; q < W; ++q) {
          const u32 e = ((me + q) % W) * El + le;
          (c ? sh.sbase2 : sh.sbase)[e] = p;
          p += c ? sh.total[e] - sh.own[e] : sh.own[e];
        }
      if (c == 0) sh.mine_own = p;
    }
    sh.mine = p;
  }
  for (u32 ch; (ch = moe_claim<THREADS>(a, sh, MOE_CNT_CLAIM_ORDER)) < ctas.n;) {
    u32 lo, hi;
    cta_range(P, MoeCtas{ch, ctas.n}, lo, hi);
    for (u32 e = tid; e < E; e += THREADS) {  // running rank: the pairs of earlier chunks
      u32 b = 0;
      for (u32 c = 0; c < ch; ++c) b += ld_cg(&a.hist[(u64)c * E + e]);
      sh.hist[e] = b;
    }
    __syncthreads();
    moe_rank_chunk<THREADS>(a, sh, lo, hi);
    __threadfence();
    __syncthreads();
    if (tid == 0) atomicAdd(&a.counters[MOE_CNT_ORDER], 1u);  // send_order of this chunk's pairs written
  }
  return true;
}

// Step 2, the first CTA: this rank's count row to every rank.
template <u32 THREADS>
MK_DEV bool moe_send_counts(const MkMoeArgs& a, MoeShared<THREADS>& sh, const MkPeers& peers, u32 Ep) {
  const u32 tid = threadIdx.x, E = (u32)a.E, W = (u32)a.world, me = (u32)a.me, RW = MOE_ROW_WORDS(E);
  const u32 T = moe_tokens(a), P = T * (u32)a.k;
  for (u32 d = 0; d < W; ++d) {
    if (tid == 0) sh.ok = credits_wait(a.sync, peers, d, Ep) ? 1 : 0;
    __syncthreads();
    if (!sh.ok) return false;  // every thread, at the same d
    u32* row = peer_ptr<u32>(peers, d, a.counts_off) + (u64)me * RW;
    for (u32 e = tid; e < E; e += THREADS) {
      row[e] = sh.total[e];
      row[MOE_ROW_OWN(E) + e] = sh.own[e];
    }
    if (tid == 0) {
      row[MOE_ROW_T(E)] = T;
      // pairs whose id was out of range; between nodes -1 marks another node's pair (the exchange
      // checked every id)
      row[MOE_ROW_BAD(E)] = a.nseg ? 0u : P - sh.mine;
    }
    __threadfence_system();
    __syncthreads();
    if (tid == 0) set_flag(peer_ptr<u32>(peers, d, a.cflag_off) + me, Ep);
    __syncthreads();  // every thread has read sh.ok before thread 0 writes it again
  }
  return true;
}

// M-tiles of one group and phase that the fused GEMMs claim together, N-tile by N-tile (moe_tiles.cuh).
constexpr u32 MOE_TILE_BLOCK = 8;
static_assert(MOE_TILE_BLOCK >= 1 && MOE_TILE_BLOCK <= 15, "a block's size and places fit tile_order's 4-bit fields");
// tile_order's word for M-tile mt, the i-th of a run of n (one group's M-tiles of one phase): mt, then
// its place in its block of the run (bits 24-27) and the block's size (bits 28-31).
MK_DEV u32 moe_order_word(u32 mt, u32 i, u32 n) {
  const u32 b = i / MOE_TILE_BLOCK * MOE_TILE_BLOCK;
  return mt | (i - b) << 24 | min(MOE_TILE_BLOCK, n - b) << 28;
}

// Step 3, the first CTA for a fused GEMM (tile_m): its M-tiles (global index over the groups) in claim
// order: every group's tiles of own-origin rows only (its first aux / tile_m), then the others; each
// group's run of either phase cut into blocks of MOE_TILE_BLOCK (a block never spans two groups' B).
template <u32 THREADS>
MK_DEV void moe_tile_order(const MkMoeArgs& a, const MoeShared<THREADS>& sh) {
  const u32 El = (u32)a.e_local, bm = (u32)a.tile_m;
  const u32* rows = sh.total + (u32)a.me * El;  // rows per local expert
  const u32* own = sh.aux + (u32)a.me * El;  // of them own-origin, first
  for (u32 le = threadIdx.x; le < El; le += THREADS) {
    u32 mb = 0, eb = 0, et = 0;  // M-tiles of the groups before, their early ones; all early ones
    for (u32 g = 0; g < El; ++g) {
      if (g < le) {
        mb += (rows[g] + bm - 1) / bm;
        eb += own[g] / bm;
      }
      et += own[g] / bm;
    }
    const u32 tm = (rows[le] + bm - 1) / bm, e = own[le] / bm;
    for (u32 i = 0; i < tm; ++i)
      a.tile_order[i < e ? eb + i : et + (mb - eb) + (i - e)] =
          i < e ? moe_order_word(mb + i, i, e) : moe_order_word(mb + i, i - e, tm - e);
  }
}

// Step 3, every CTA of the role: sh.total[e] = rows of expert e from all ranks, sh.rowbase[e] =
// first row of this rank's pairs to e at its owner, sh.total_me; the input checks; the credits of
// every owner. The first CTA also writes group_rows and the verdict for a fused GEMM.
template <u32 THREADS>
MK_DEV bool moe_plan_rows(const MkMoeArgs& a, MoeShared<THREADS>& sh, const MkPeers& peers, MoeCtas ctas, u32 Ep,
                          bool ok) {
  const u32 tid = threadIdx.x, E = (u32)a.E, El = (u32)a.e_local, W = (u32)a.world, me = (u32)a.me;
  const u32 K = (u32)a.k, RW = MOE_ROW_WORDS(E);
  __syncthreads();  // every thread has read sh.ok (on every path) before thread 0 writes it
  if (tid == 0) sh.ok = ok && moe_wait_all(a, peers, a.cflag_off, Ep, MOE_WAIT_COUNTS) ? 1 : 0;
  __syncthreads();
  ok = sh.ok != 0;
  const u32* counts = peer_ptr<const u32>(peers, me, a.counts_off);
  if (ok) {
    for (u32 e = tid; e < E; e += THREADS) {
      u32 n = 0, before = 0, own = 0, own_before = 0;
      for (u32 s = 0; s < W; ++s) {
        const u32 c = ld_cg(&counts[(u64)s * RW + e]), o = ld_cg(&counts[(u64)s * RW + MOE_ROW_OWN(E) + e]);
        n += c;
        own += o;
        if (s < me) {
          before += c;
          own_before += o;
        }
      }
      sh.total[e] = n;  // rows of expert e in all
      sh.aux[e] = own;  // of them own-origin: the expert's first rows
      sh.rowbase[e] = own_before;  // own-origin rows of expert e from ranks before this one
      sh.rowbase2[e] = own + (before - own_before);  // then its forwarded rows from ranks before this one
    }
    __syncthreads();
    if (tid == 0) {  // per owner: expert bases (a scan), capacity; every rank's tokens and ids
      u32 err_where = 0, err_expected = 0, err_seen = 0;
      for (u32 d = 0; d < W; ++d) {
        u32 base = 0;
        for (u32 e = d * El; e < (d + 1) * El; ++e) {
          const u32 n = sh.total[e];
          sh.rowbase[e] += base;
          sh.rowbase2[e] += base;
          base += n;
        }
        if (d == me) sh.total_me = base;
        if (base > (u32)a.capacity && !err_where) {
          err_where = MOE_ERR_CAPACITY;
          err_expected = a.capacity;
          err_seen = base;
        }
      }
      for (u32 s = 0; s < W; ++s) {
        const u32 ts = ld_cg(&counts[(u64)s * RW + MOE_ROW_T(E)]);
        const u32 bad = ld_cg(&counts[(u64)s * RW + MOE_ROW_BAD(E)]);
        if (bad && !err_where) {
          err_where = MOE_ERR_EXPERT_ID;
          err_expected = E;
          err_seen = bad;
        }
        if ((u64)ts * K > (u64)a.capacity && !err_where) {
          err_where = MOE_ERR_CAPACITY;
          err_expected = a.capacity;
          err_seen = ts * K;
        }
      }
      if (err_where) {
        if (ctas.idx == 0) record_error(a.sync, MK_ERR_INPUT, -1, err_where, err_expected, err_seen, 0);
        sh.ok = 0;
      }
    }
    __syncthreads();
    ok = sh.ok != 0;
  }
  if (ctas.idx == 0) {  // the counts of this rank's experts, then the verdict a fused GEMM waits for
    if (ok)
      for (u32 e = tid; e < El; e += THREADS) a.group_rows[e] = (int)sh.total[me * El + e];
    if (ok && a.tile_m) moe_tile_order(a, sh);
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      if (ok) a.received[0] = (int)sh.total_me;
      __threadfence();
      st_release_sys(&a.counters[MOE_CNT_PLAN], ok ? MOE_PLAN_OK : MOE_PLAN_FAILED);
    }
  }
  __syncthreads();  // every thread has read sh.ok above before thread 0 rewrites it
  if (ok && tid == 0)  // rows may go once every owner entered this epoch
    for (u32 d = 0; d < W && sh.ok; ++d) sh.ok = credits_wait(a.sync, peers, d, Ep) ? 1 : 0;
  __syncthreads();
  return ok && sh.ok != 0;
}

// Step 4, every CTA of the role: its warps' positions of the send order, copied by each warp's
// copier through its buffers in `stage` (shared memory, STAGE_BYTES, 128-byte aligned); the
// per-(source, expert) flags; rflag[me] everywhere once every run is sent. `mine`: this rank's pairs
// per expert (step 1).
template <u32 THREADS>
MK_DEV void moe_send_rows(const MkMoeArgs& a, MoeShared<THREADS>& sh, const u32* mine, const MkPeers& peers,
                          MoeCtas ctas, u32 Ep, u8* stage) {
  using Sh = MoeShared<THREADS>;
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const u32 me = (u32)a.me, El = (u32)a.e_local, K = (u32)a.k, E = (u32)a.E;
  const u32 row_bytes = (u32)a.H * 2u;
  __syncthreads();  // every thread has read sh.ok (moe_plan_rows) before thread 0 writes it
  if (tid == 0)  // every chunk's part of send_order is written
    sh.ok = wait_at_least(a.sync, &a.counters[MOE_CNT_ORDER], ctas.n, -1, MOE_WAIT_ORDER) ? 1 : 0;
  __syncthreads();
  if (!sh.ok) return;
  const u32 n = sh.mine, n_own = sh.mine_own;
  // A warp sends runs of MOE_SEND_RUN consecutive positions (one fence per run), claimed in order.
  MoeCopier<Sh::CHUNK> copier{smem_u32(stage) + warp * 2u * Sh::CHUNK, smem_u32(&sh.copy_bar[warp][0]), a.sync};
  u64 seen = 0;
  for (u32 p0; lane == 0 && (p0 = atomicAdd(&a.counters[MOE_CNT_RUN], 1u) * MOE_SEND_RUN) < n;) {
    const u32 p1 = min(n, p0 + MOE_SEND_RUN);
    for (u32 p = p0; p < p1; ++p) {
      const u32 i = (u32)__ldcg(&a.send_order[p]);
      const u32 e = (u32)a.topk_ids[i];
      const u32 d = e / El;
      const bool fwd = p >= n_own;  // a forwarded pair (positions from n_own on)
      const u32 row = fwd ? sh.rowbase2[e] + (p - sh.sbase2[e]) : sh.rowbase[e] + (p - sh.sbase[e]);
      u8* dst = peer_ptr<u8>(peers, d, a.recv_off) + (u64)row * row_bytes;
      if (fwd) moe_wait_bundle(a, sh.vseg, i / K, sh.xepoch, seen);
      const u8* src = moe_token_row(a, sh.vseg, i / K);
      for (u32 o = 0; o < row_bytes; o += Sh::CHUNK) copier.put(dst + o, src + o, min(Sh::CHUNK, row_bytes - o));
      peer_ptr<u32>(peers, d, a.meta_off)[row] = (me << 24) | i;
    }
    copier.finish();
    {  // count the run per (class, expert) (it is sorted so); a complete block gets its flag
      for (u32 p = p0; p < p1;) {
        const u32 e = (u32)a.topk_ids[__ldcg(&a.send_order[p])];
        const u32 fwd = p >= n_own ? 1u : 0u;
        u32 c = 1;
        while (p + c < p1 && (p + c >= n_own) == (fwd != 0) && (u32)a.topk_ids[__ldcg(&a.send_order[p + c])] == e) ++c;
        p += c;
        u32* sent = a.esent + fwd * E + e;
        if (atomicAdd(sent, c) + c == (fwd ? mine[e] - sh.own[e] : sh.own[e])) {  // block (me, e, class) complete
          const u32 d = e / El;
          *sent = 0;  // every count of this launch is in: zero for the next one
          __threadfence_system();
          // No flag after an error of this rank (a copy wait that timed out stored whatever its
          // buffer held): the owner's wait then times out and raises instead of using the rows.
          if (!error_recorded(a.sync))
            set_flag(peer_ptr<u32>(peers, d, a.eflag_off) + (fwd * (u32)a.world + me) * El + (e - d * El), Ep);
        }
      }
    }
    atomicAdd(&a.counters[MOE_CNT_SENT], p1 - p0);  // after the run's system fence (copier.finish)
  }
  __syncwarp();
  __syncthreads();
  if (tid == 0) moe_all_done(a, peers, MOE_CNT_SENT, n, a.rflag_off, Ep);
}

// Steps 1-4 by the role's CTAs (sh and the copiers' stage in shared memory). Returns whether the
// rows were sent.
template <u32 THREADS>
MK_DEV bool moe_dispatch_role(const MkMoeArgs& a, MoeShared<THREADS>& sh, MoeCtas ctas, u8* stage) {
  const u32 tid = threadIdx.x;
  const MkPeers peers = moe_peers(a);
  if (tid == 0) {
    sh.epoch = launch_epoch(a.sync);
    if (ctas.idx == 0) credits_announce(peers, sh.epoch);
    for (u32 w = 0; w < MoeShared<THREADS>::WARPS; ++w) {  // the copiers' mbarriers (step 4)
      mbar_init(smem_u32(&sh.copy_bar[w][0]), 1);
      mbar_init(smem_u32(&sh.copy_bar[w][1]), 1);
    }
    mbar_fence_init();
  }
  for (u32 i = tid; a.nseg && i <= (u32)a.nseg; i += THREADS) sh.vseg[i] = a.vseg[i];
  if (tid == 0) sh.xepoch = a.nseg ? ld_cg(a.xepoch) : 0u;
  __syncthreads();
  const u32 Ep = sh.epoch;
  bool ok = moe_rank_pairs<THREADS>(a, sh, ctas);
  if (ok && ctas.idx == 0) ok = moe_send_counts<THREADS>(a, sh, peers, Ep);
  // sh.total is overwritten with all ranks' rows by step 3: keep this rank's counts (in `hist`,
  // free after the ranking) for the completion counts of step 4.
  for (u32 e = tid; e < (u32)a.E; e += THREADS) sh.hist[e] = sh.total[e];
  ok = moe_plan_rows<THREADS>(a, sh, peers, ctas, Ep, ok);
  if (ok) moe_send_rows<THREADS>(a, sh, sh.hist, peers, ctas, Ep, stage);
  if (a.nseg && ctas.idx == 0 && tid == 0 && !error_recorded(a.sync)) moe_wait_flushed(a, sh.xepoch);
  return ok;
}
