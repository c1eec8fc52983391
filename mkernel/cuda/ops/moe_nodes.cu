// Expert parallelism between nodes (mkernel/ops/moe_nodes.py; design: docs/MOE.md "Between nodes").
// A token crosses the network once per destination node and fans out inside it:
//
// mk_moe_exchange_kernel, before the node's dispatch: every rank (n, l) sends its count row to
// every rank (same node: NVLink; others: a proxy WRITE), and to rank (j, l) of every other node j
// the bundle of its tokens with a pair on node j (rows, and per token its k expert ids as node j
// numbers them, -1 for pairs elsewhere, and weights), sorted so that node j's first experts' rows
// lead (stage_bundles), staged in xsend / dsend and written by one WRITE of routing words and
// `pieces` WRITEs of rows. Every rank checks the capacities and ids of every rank from the count
// rows alike, then builds its virtual tokens (its own, then the bundles it received, node by
// node): the ids and weights the node's dispatch and combine (moe.cu, moe_dispatch_gemm.cu) run on.
// It waits for the bundles' routing words only: the dispatch sends this rank's own rows first and
// waits for a bundle's rows (and for this exchange's FLUSHes) itself (docs/MOE.md, step 2).
//
// mk_moe_partials_kernel, after the node's combine (which left every virtual token's weighted sum
// of its node's pairs in part: this rank's tokens' in fp32, the forwarded ones' rounded to 16 bits):
// each bundle's sums go back to their source as one WRITE (unless the fused GEMM + combine sent them,
// in chunks: MoeSumsRoute in moe_combine.cuh; PART counts tokens), and every rank adds, per token, the
// sums of all nodes in node order (its own at its place): a fixed order, so bitwise reproducible.
#include "queue.cuh"
#include "moe_nodes_args.cuh"
#include "moe_combine.cuh"

constexpr u32 MOE_NODE_THREADS = 512;
constexpr u32 MOE_NODE_WARPS = MOE_NODE_THREADS / 32;

// Wait ids of these kernels (MkStatus::where).
enum : u32 {
  MOE_WAIT_NCREDIT = 0xC000u,
  MOE_WAIT_GCOUNT = 0xC100u,
  MOE_WAIT_DESC = 0xC200u,
  MOE_WAIT_PFLUSH = 0xC380u,
  MOE_WAIT_PART = 0xC500u
};

MK_DEV MkPeers node_peers(const MkMoeNodeArgs& a) { return MkPeers{a.peer_base, (u32)a.local, (u32)a.lrank}; }
MK_DEV u32 node_rank(const MkMoeNodeArgs& a, u32 j) { return j * (u32)a.local + (u32)a.lrank; }
MK_DEV const u32* grow(const MkMoeNodeArgs& a, u32 s) {
  return peer_ptr<const u32>(node_peers(a), (u32)a.lrank, a.gcounts_off) + (u64)s * MOE_GROW_WORDS((u32)a.E);
}

// Tokens of this rank with a pair on node j (its bundle there; the sums node j sends back).
MK_DEV u32 bundle(const MkMoeNodeArgs& a, u32 j) { return ld_cg(grow(a, (u32)a.me) + MOE_GROW_BUNDLE((u32)a.E, j)); }

// Thread 0: the epoch-E flag of a proxy flag this rank's queue knows.
MK_DEV bool wait_pf(const MkMoeNodeArgs& a, u32 flag, u32 E, u32 peer, u32 where) {
  return wait_remote_epoch(a.sync, a.queue, a.pflags + flag, E, (i32)peer, where);
}
// Thread 0: a credit (CREDIT, PCREDIT) at epoch E or later. The peer may already be in a later
// launch: one that found an input error skips its waits and leaves early, and its host may queue
// the next call; an exact wait would then time out here instead of reaching the same verdict.
MK_DEV bool wait_credit(const MkMoeNodeArgs& a, u32 flag, u32 E, u32 peer, u32 where) {
  return wait_remote_at_least(a.sync, a.queue, a.pflags + flag, E, (i32)peer, where);
}

// Every thread: whether this CTA arrived first in the launch (its duties then run whatever part of
// the grid is resident: docs/MOE.md "Residency"). `slot`: a shared word.
MK_DEV bool node_first(const MkMoeNodeArgs& a, volatile u32* slot) {
  if (threadIdx.x == 0) *slot = atomicAdd(&a.counters[MOE_NCNT_ARRIVE], 1u);
  __syncthreads();
  const bool first = *slot == 0;
  __syncthreads();
  return first;
}

// The exchange's shared state while it stages the bundles.
struct MoeStageShared {
  u32 base[MOE_MAX_NODES];  // tokens per bundle (per other node)
  u32 pstart[MOE_MAX_NODES][MOE_MAX_PIECES + 1];  // each piece's first slot (its first bucket's), then the size
  u32 run[MOE_MAX_EXPERTS];  // per key (node, bucket): tokens before it, then the running slot
  u16 wcnt[MOE_NODE_WARPS][MOE_MAX_EXPERTS];  // a chunk's tokens per (warp, key), then the warp's base
  u32 chunk[MOE_MAX_EXPERTS];  // a chunk's tokens per key
  u32 hist[MOE_MAX_EXPERTS];  // the first CTA: pairs per expert
  u32 bad;  // the first CTA: pairs whose id is out of range
};

// Per node j (registers, unrolled: no local memory): token t's bucket in its bundle to j, the least
// place there of its experts in the order node j's rank (j, lrank) sends its rows (moe_send_place),
// epn if it has no pair on j; each pair counted (`first`).
MK_DEV void bundle_buckets(const MkMoeNodeArgs& a, u32 t, bool first, MoeStageShared& st, u32 (&b)[MOE_MAX_NODES]) {
  const u32 K = (u32)a.k, E = (u32)a.E, epn = E / (u32)a.nodes, L = (u32)a.local, El = (u32)a.e_local;
#pragma unroll
  for (u32 j = 0; j < MOE_MAX_NODES; ++j) b[j] = epn;
  if (t >= (u32)a.T) return;
  for (u32 q = 0; q < K; ++q) {
    const int e = a.topk_ids[(u64)t * K + q];
    if (e < 0 || (u32)e >= E) {
      if (first) atomicAdd(&st.bad, 1u);
      continue;
    }
    if (first) atomicAdd(&st.hist[e], 1u);
    const u32 j = (u32)e / epn, key = moe_send_place((u32)e - j * epn, El, L, (u32)a.lrank);
#pragma unroll
    for (u32 i = 0; i < MOE_MAX_NODES; ++i)
      if (i == j) b[i] = min(b[i], key);
  }
}

// Every thread: every token of this rank is scanned (by every CTA: T * k ids, cheap) for the nodes
// its pairs go to. A bundle is sorted by bucket (bundle_buckets), then token, and crosses in pieces
// of consecutive buckets: node j's first experts' rows come in its first pieces, so their forwarded
// GEMM tiles can start before the whole bundle is in (docs/MOE.md "Overlap"). Token t's slot in the bundle to j: the tokens of lower buckets, then of
// its bucket before it (a scan per warp and key, as the dispatch ranks its pairs: deterministic). A
// CTA stages the rows and routing words of the warps' token ranges dealt to it; the first CTA to
// arrive also counts the pairs per expert. Leaves the bundles' sizes in st.base, their pieces in st.pstart.
MK_DEV void stage_bundles(const MkMoeNodeArgs& a, bool first, MoeStageShared& st) {
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const u32 T = (u32)a.T, K = (u32)a.k, E = (u32)a.E, N = (u32)a.nodes, node = (u32)a.node;
  const u32 epn = E / N, row_bytes = (u32)a.H * 2u, R = (u32)a.fwd_rows;
  const bool stage = T <= R;  // else a capacity error (every rank sees this T): stage nothing
  u8* xsend = peer_ptr<u8>(node_peers(a), (u32)a.lrank, a.xsend_off);
  u32* dsend = peer_ptr<u32>(node_peers(a), (u32)a.lrank, a.dsend_off);
  u32 b[MOE_MAX_NODES];
  for (u32 c0 = 0; c0 < T; c0 += MOE_NODE_THREADS) {  // 1: tokens per key (node, bucket)
    bundle_buckets(a, c0 + tid, first, st, b);
#pragma unroll
    for (u32 j = 0; j < MOE_MAX_NODES; ++j)
      if (j < N && j != node && b[j] < epn) atomicAdd(&st.run[j * epn + b[j]], 1u);
  }
  __syncthreads();
  if (tid < N) {  // the keys' first slots, node by node; the pieces' first slots; the bundles' sizes
    const u32 P = (u32)a.pieces;
    u32 acc = 0, q = 0;
    for (u32 x = 0; x < epn; ++x) {
      for (; q <= moe_piece_of(x, P, epn); ++q) st.pstart[tid][q] = acc;
      const u32 c = st.run[tid * epn + x];
      st.run[tid * epn + x] = acc;
      acc += c;
    }
    for (; q <= P; ++q) st.pstart[tid][q] = acc;
    st.base[tid] = tid == node ? 0u : acc;
  }
  __syncthreads();
  for (u32 c0 = 0; c0 < T; c0 += MOE_NODE_THREADS) {  // 2: the slots, chunk by chunk
    const u32 t = c0 + tid;
    bundle_buckets(a, t, false, st, b);
    u32 slot[MOE_MAX_NODES];
#pragma unroll
    for (u32 j = 0; j < MOE_MAX_NODES; ++j) {  // the tokens of its key before it in its warp
      const bool in = j < N && j != node && b[j] < epn;
      const int key = in ? (int)(j * epn + b[j]) : -1;
      const u32 same = __match_any_sync(0xFFFFFFFFu, key), before = same & ((1u << lane) - 1u);
      if (in && before == 0) st.wcnt[warp][key] = (u16)__popc(same);
      slot[j] = __popc(before);
    }
    __syncthreads();
    for (u32 x = tid; x < E; x += MOE_NODE_THREADS) {  // per key: the warps' bases, in warp order
      u32 acc = 0;
      for (u32 w = 0; w < MOE_NODE_WARPS; ++w) {
        const u32 c = st.wcnt[w][x];
        st.wcnt[w][x] = (u16)acc;
        acc += c;
      }
      st.chunk[x] = acc;
    }
    __syncthreads();
#pragma unroll
    for (u32 j = 0; j < MOE_MAX_NODES; ++j)
      if (j < N && j != node && b[j] < epn) slot[j] += st.run[j * epn + b[j]] + st.wcnt[warp][j * epn + b[j]];
    __syncthreads();
    for (u32 x = tid; x < E; x += MOE_NODE_THREADS) {  // the next chunk's keys start after this one's
      st.run[x] += st.chunk[x];
      for (u32 w = 0; w < MOE_NODE_WARPS; ++w) st.wcnt[w][x] = 0;
    }
    const bool mine = ((c0 / MOE_NODE_THREADS) * MOE_NODE_WARPS + warp) % gridDim.x == blockIdx.x;
    if (stage && mine) {
#pragma unroll
      for (u32 j = 0; j < MOE_MAX_NODES; ++j) {
        if (j >= N || j == node) continue;
        const u32 sg = moe_seg_of(j, node);
        const bool in = b[j] < epn;
        if (t < T) a.slots[(u64)sg * R + t] = in ? (int)slot[j] : -1;
        if (in) {  // the token's routing words as node j numbers its experts
          u32* d = dsend + ((u64)sg * R + slot[j]) * 2u * K;
          for (u32 q = 0; q < K; ++q) {
            const int e = a.topk_ids[(u64)t * K + q];
            const bool there = e >= 0 && (u32)e < E && (u32)e / epn == j;
            d[q] = there ? (u32)e - j * epn : 0xFFFFFFFFu;
            d[K + q] = __float_as_uint(a.topk_w[(u64)t * K + q]);
          }
        }
        u32 todo = __ballot_sync(0xFFFFFFFFu, in);
        while (todo) {  // the warp copies its tokens' rows one by one
          const u32 l = __ffs(todo) - 1u;
          todo &= todo - 1u;
          const u32 tl = __shfl_sync(0xFFFFFFFFu, t, l), sl = __shfl_sync(0xFFFFFFFFu, slot[j], l);
          copy_span<MOE_COPY_UNROLL>(xsend + ((u64)sg * R + sl) * row_bytes,
                                     reinterpret_cast<const u8*>(a.x) + (u64)tl * (u64)a.ldx * 2u, row_bytes, lane, 32);
        }
      }
    }
    __syncthreads();
  }
}

// The first CTA, every thread: this rank's count row to every rank (after each one's credit).
MK_DEV void send_count_row(const MkMoeNodeArgs& a, const u32* s_base, const u32* s_hist, u32 bad, u32 E, int* s_ok) {
  const u32 tid = threadIdx.x, W = (u32)a.world, RW = MOE_GROW_WORDS((u32)a.E), me = (u32)a.me;
  const MkPeers peers = node_peers(a);
  u32* own = peer_ptr<u32>(peers, (u32)a.lrank, a.gcounts_off) + (u64)me * RW;
  for (u32 e = tid; e < (u32)a.E; e += MOE_NODE_THREADS) own[e] = s_hist[e];
  if (tid < MOE_MAX_NODES)
    own[MOE_GROW_BUNDLE((u32)a.E, tid)] = tid < (u32)a.nodes && tid != (u32)a.node ? s_base[tid] : 0u;
  if (tid == 0) {
    own[MOE_GROW_T((u32)a.E)] = (u32)a.T;
    own[MOE_GROW_BAD((u32)a.E)] = bad;
  }
  __threadfence_system();
  __syncthreads();
  for (u32 d = 0; d < (u32)a.local; ++d) {  // the node's ranks, this one included
    if (tid == 0) *s_ok = credits_wait(a.sync, peers, d, E) ? 1 : 0;
    __syncthreads();
    if (!*s_ok) return;
    if (d != (u32)a.lrank) {
      u32* row = peer_ptr<u32>(peers, d, a.gcounts_off) + (u64)me * RW;
      for (u32 i = tid; i < RW; i += MOE_NODE_THREADS) row[i] = own[i];
    }
    __threadfence_system();
    __syncthreads();
    if (tid == 0) set_flag(peer_ptr<u32>(peers, d, a.gcflag_off) + me, E);
    __syncthreads();
  }
  if (tid == 0)
    for (u32 r = 0; r < W && *s_ok; ++r) {
      if (r / (u32)a.local == (u32)a.node) continue;
      const u64 off = a.gcounts_off + (u64)me * RW * 4u;
      *s_ok = wait_credit(a, MOE_PF_CREDIT + r, E, r, MOE_WAIT_NCREDIT + r) &&
              queue_push(
                  a.sync, a.queue,
                  mk_write_cmd(r, MK_WORKSPACE_REGION, off, MK_WORKSPACE_REGION, off, RW * 4u, MOE_PF_GCOUNT + me, E));
    }
  __syncthreads();
}

// The last CTA's thread 0: the bundles to their forwarders (after the credit): the routing words in
// one WRITE, the rows in `pieces` (stage_bundles' st.pstart), each setting its own flag.
MK_DEV bool send_bundles(const MkMoeNodeArgs& a, const u32* s_base, const u32 (*pstart)[MOE_MAX_PIECES + 1], u32 E) {
  const u32 N = (u32)a.nodes, node = (u32)a.node, K = (u32)a.k, R = (u32)a.fwd_rows, F = (u32)a.pieces;
  const u64 row_bytes = (u64)a.H * 2u, desc_bytes = 8u * K;
  if ((u32)a.T > R) return true;  // nothing staged: the count rows carry the capacity error
  for (u32 j = 0; j < N; ++j) {
    const u32 n = s_base[j];
    if (j == node || n == 0) continue;
    const u32 r = node_rank(a, j), sg = moe_seg_of(j, node), there = moe_seg_of(node, j);
    if (!wait_credit(a, MOE_PF_CREDIT + r, E, r, MOE_WAIT_NCREDIT + r)) return false;
    if (!queue_push(
            a.sync, a.queue,
            mk_write_cmd(r, MK_WORKSPACE_REGION, a.dsend_off + (u64)sg * R * desc_bytes, MK_WORKSPACE_REGION,
                         a.drecv_off + (u64)there * R * desc_bytes, (u32)(n * desc_bytes), MOE_PF_DESC + node, E)))
      return false;
    for (u32 q = 0; q < F; ++q) {
      const u32 s0 = pstart[j][q], s1 = pstart[j][q + 1];
      if (s0 == s1) continue;  // (no token of it: not waited for)
      if (!queue_push(a.sync, a.queue,
                      mk_write_cmd(r, MK_WORKSPACE_REGION, a.xsend_off + ((u64)sg * R + s0) * row_bytes,
                                   MK_WORKSPACE_REGION, a.xrecv_off + ((u64)there * R + s0) * row_bytes,
                                   (u32)((s1 - s0) * row_bytes), MOE_PF_ROWS + node * MOE_MAX_PIECES + q, E)))
        return false;
    }
  }
  return true;
}

// The last CTA's thread 0: every rank's count row, then the verdict every rank reaches alike.
MK_DEV bool check_rows(const MkMoeNodeArgs& a, u32 E) {
  const u32 W = (u32)a.world, L = (u32)a.local, El = (u32)a.e_local, K = (u32)a.k, Ea = (u32)a.E;
  const u32 cap = (u32)a.capacity, N = (u32)a.nodes;
  for (u32 s = 0; s < W; ++s) {
    const bool ok = s / L == (u32)a.node
                        ? wait_epoch(a.sync, peer_ptr<const u32>(node_peers(a), (u32)a.lrank, a.gcflag_off) + s, E,
                                     (i32)s, MOE_WAIT_GCOUNT + s)
                        : wait_pf(a, MOE_PF_GCOUNT + s, E, s, MOE_WAIT_GCOUNT + s);
    if (!ok) return false;
  }
  u32 where = 0, expected = 0, seen = 0;
  for (u32 d = 0; d < W && !where; ++d) {  // rows each owner receives
    u32 rows = 0;
    for (u32 s = 0; s < W; ++s)
      for (u32 e = d * El; e < (d + 1) * El; ++e) rows += ld_cg(grow(a, s) + e);
    if (rows > cap) {
      where = MOE_ERR_CAPACITY;
      expected = cap;
      seen = rows;
    }
  }
  for (u32 s = 0; s < W && !where; ++s) {
    const u32* row = grow(a, s);
    const u32 bad = ld_cg(row + MOE_GROW_BAD(Ea));
    u32 vt = ld_cg(row + MOE_GROW_T(Ea));  // rank s's virtual tokens: its own and those it forwards
    for (u32 n = 0; n < N; ++n)
      if (n != s / L) vt += ld_cg(grow(a, n * L + s % L) + MOE_GROW_BUNDLE(Ea, s / L));
    if (bad) {
      where = MOE_ERR_EXPERT_ID;
      expected = Ea;
      seen = bad;
    } else if ((u64)vt * K > cap) {
      where = MOE_ERR_CAPACITY;
      expected = cap;
      seen = vt * K;
    }
  }
  if (where) record_error(a.sync, MK_ERR_INPUT, -1, where, expected, seen, 0);
  return !where;
}

__global__ void __launch_bounds__(MOE_NODE_THREADS, 1) mk_moe_exchange_kernel(const __grid_constant__ MkMoeNodeArgs a) {
  __shared__ MoeStageShared st;
  __shared__ u32 s_epoch, s_vseg[MOE_MAX_NODES], s_pcnt[MOE_MAX_NODES - 1][MOE_MAX_PIECES];
  __shared__ int s_ok, s_last;
  __shared__ u32 s_slot;
  const u32 tid = threadIdx.x, N = (u32)a.nodes, node = (u32)a.node, K = (u32)a.k, L = (u32)a.local;
  const bool first = node_first(a, &s_slot);
  if (tid == 0) {
    s_epoch = launch_epoch(a.sync);
    if (first) {  // this rank entered the epoch: for the node's ranks and the other nodes'
      credits_announce(node_peers(a), s_epoch);
      for (u32 r = 0; r < (u32)a.world; ++r)
        if (r / L != node)
          queue_push(a.sync, a.queue, mk_signal_cmd(r, MOE_PF_CREDIT + (u32)a.me, s_epoch, MK_FLAG_SET));
    }
    st.bad = 0;
  }
  for (u32 i = tid; i < MOE_MAX_EXPERTS; i += MOE_NODE_THREADS) {
    st.hist[i] = st.run[i] = 0;
    for (u32 w = 0; w < MOE_NODE_WARPS; ++w) st.wcnt[w][i] = 0;
  }
  if (tid < MOE_FWD_CELLS) s_pcnt[tid / MOE_MAX_PIECES][tid % MOE_MAX_PIECES] = 0;
  __syncthreads();
  const u32 E = s_epoch;
  stage_bundles(a, first, st);
  if (first) {
    const u32 epn = (u32)a.E / N;  // this rank's own pairs per expert of its node, for the dispatch's order
    for (u32 e = tid; e < epn; e += MOE_NODE_THREADS) a.vown[e] = st.hist[node * epn + e];
    send_count_row(a, st.base, st.hist, st.bad, E, &s_ok);  // (a failure is recorded)
  }
  __threadfence_system();  // the staged rows and words, before the last CTA's WRITEs read them
  __syncthreads();
  if (tid == 0) {
    s_last = atomicAdd(&a.counters[MOE_NCNT_STAGED], 1u) == gridDim.x - 1;
    __threadfence();
  }
  __syncthreads();
  if (s_last) {
    if (tid == 0) {
      bool ok = !error_recorded(a.sync) && send_bundles(a, st.base, st.pstart, E) && check_rows(a, E);
      u32 v = (u32)a.T;  // the virtual tokens' segments; nothing to route after a failure
      s_vseg[0] = ok ? v : 0u;
      for (u32 n = 0, i = 1; n < N; ++n) {
        if (n == node) continue;
        const u32 cnt = ok ? ld_cg(grow(a, node_rank(a, n)) + MOE_GROW_BUNDLE((u32)a.E, node)) : 0u;
        // the routing words only: the rows are waited for by the dispatch, after this rank's own
        if (cnt && !wait_pf(a, MOE_PF_DESC + n, E, node_rank(a, n), MOE_WAIT_DESC + n)) ok = false;
        v += cnt;
        s_vseg[i++] = ok ? v : 0u;
      }
      s_ok = ok ? 1 : 0;
    }
    __syncthreads();
    const u32 epn = (u32)a.E / N, R = (u32)a.fwd_rows, T = s_ok ? (u32)a.T : 0u, VT = s_vseg[N - 1];
    const u32* drecv = peer_ptr<const u32>(node_peers(a), (u32)a.lrank, a.drecv_off);
    for (u32 p = tid; p < VT * K; p += MOE_NODE_THREADS) {  // the virtual pairs
      const u32 t = p / K, q = p - t * K;
      int e;
      float w;
      if (t < T) {  // own: the pairs on this node, in its numbering
        const int g = a.topk_ids[p];
        e = g >= 0 && (u32)g < (u32)a.E && (u32)g / epn == node ? g - (int)(node * epn) : -1;
        w = a.topk_w[p];
      } else {
        const u32 f = moe_fwd_segment(s_vseg, N - 1, t);
        const u32* d = drecv + ((u64)f * R + (t - s_vseg[f])) * 2u * K;
        e = (int)__ldcg(d + q);
        w = __uint_as_float(__ldcg(d + K + q));
      }
      a.vids[p] = e;
      a.vw[p] = w;
    }
    const u32 P = (u32)a.pieces, El = (u32)a.e_local;
    for (u32 t = T + tid; t < VT; t += MOE_NODE_THREADS) {  // forwarded tokens per piece (sorted by bucket)
      const u32 f = moe_fwd_segment(s_vseg, N - 1, t);
      const int* ids = reinterpret_cast<const int*>(drecv + ((u64)f * R + (t - s_vseg[f])) * 2u * K);
      const u32 b = moe_token_bucket(ids, K, El, L, (u32)a.lrank, epn - 1u);  // (it has a pair here)
      atomicAdd(&s_pcnt[f][moe_piece_of(b, P, epn)], 1u);
    }
    __syncthreads();
    if (tid < N) a.vseg[tid] = s_vseg[tid];
    if (tid + 1 < N) {  // each piece's first token in its segment (the fused combine sums them piece by piece)
      u32 acc = 0;
      for (u32 q = 0; q < MOE_MAX_PIECES; ++q) {
        a.vseg[MOE_VPST(tid, q)] = acc;
        if (q < P) acc += s_pcnt[tid][q];
      }
      a.vseg[MOE_VPST(tid, MOE_MAX_PIECES)] = acc;
    }
    if (tid == 0) {
      *a.xepoch = E;
      *a.verdict = s_ok ? MOE_PLAN_OK : MOE_PLAN_FAILED;
      // every command applied at its destination before the next launch restages: the dispatch
      // waits for these (the bundles are still in flight)
      for (u32 r = 0; r < (u32)a.world; ++r)
        if (r / L != node) queue_push(a.sync, a.queue, mk_flush_cmd(r, MOE_PF_FLUSH + r, E));
    }
  }
  __syncthreads();
  if (tid == 0) counters_reset_by_last_block(a.counters, MOE_NCNT_WORDS, MOE_NCNT_DONE);
  launch_exit(a.sync, E);
}

// After the node's combine: each forwarded bundle's sums back to its source; then every token of
// this rank, out[t] = round(sum over nodes j ascending of node j's sum of t's pairs).
template <int DT>
__global__ void __launch_bounds__(MOE_NODE_THREADS, 1) mk_moe_partials_kernel(const __grid_constant__ MkMoeNodeArgs a) {
  __shared__ u32 s_epoch, s_slot;
  __shared__ int s_ok;
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, N = (u32)a.nodes, node = (u32)a.node;
  const u32 R = (u32)a.fwd_rows, H = (u32)a.H;
  const u64 part_row = (u64)H * 4u, sum_row = (u64)H * 2u;  // own fp32 sums, the 16-bit ones that travel
  const bool first = node_first(a, &s_slot);
  const u64 t_in = trace_start(a.sync);
  bool flushing = false;  // thread 0: its FLUSHes queued at entry, waited for at the end
  if (tid == 0) {
    s_epoch = launch_epoch(a.sync);
    const bool send = !a.sent;  // else the fused combine sent them
    const MoeSumsRoute route{a.sync,       a.queue,  a.pflags, a.vseg, N,          node,       (u32)a.local,
                             (u32)a.lrank, (u32)a.T, H,        R,      a.part_off, a.precv_off};
    if (first && send) route.credit(s_epoch);  // this rank's precv may be written: its previous sums are done
    const bool planned = *a.verdict == MOE_PLAN_OK;
    bool ok = planned;
    if (ok && first && send) ok = route.send((u32)a.T, a.vseg[N - 1], s_epoch);  // the tokens it forwarded
    flushing = first && planned;  // part is rewritten by the next combine: its WRITEs flushed, the round trip
    for (u32 j = 0; flushing && j < N; ++j)  // behind the waits and the add below
      if (j != node) queue_push(a.sync, a.queue, mk_flush_cmd(node_rank(a, j), MOE_PF_PFLUSH + j, s_epoch));
    for (u32 j = 0; j < N && ok; ++j)  // the other nodes' sums of this rank's tokens: PART counts tokens
      if (j != node && bundle(a, j))
        ok = wait_remote_at_least(a.sync, a.queue, a.pflags + MOE_PF_PART + j, a.part_total[j] + bundle(a, j),
                                  (i32)node_rank(a, j), MOE_WAIT_PART + j);
    trace_span(a.sync, MK_ROLE_WAIT, MOE_TRACE_PART_WAIT | blockIdx.x, t_in);
    s_ok = ok ? 1 : 0;
  }
  __syncthreads();
  const u32 E = s_epoch;
  const u64 t_add = trace_start(a.sync);
  if (s_ok) {
    const u8* part = peer_ptr<const u8>(node_peers(a), (u32)a.lrank, a.part_off);
    const u8* precv = peer_ptr<const u8>(node_peers(a), (u32)a.lrank, a.precv_off);
    u8* out = reinterpret_cast<u8*>(a.out);
    u32 lo, hi;
    cta_range((u32)a.T, MoeCtas{blockIdx.x, gridDim.x}, lo, hi);
    for (u32 t = lo + warp; t < hi; t += MOE_NODE_WARPS)
      for (u32 o = lane * 8u; o < H; o += 32u * 8u) {  // 8 elements a lane
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (u32 j = 0; j < N; ++j) {
          if (j == node) {
            const float* src = reinterpret_cast<const float*>(part + (u64)t * part_row) + o;
            const float4 v0 = __ldcg(reinterpret_cast<const float4*>(src)),
                         v1 = __ldcg(reinterpret_cast<const float4*>(src) + 1);
            acc[0] += v0.x;
            acc[1] += v0.y;
            acc[2] += v0.z;
            acc[3] += v0.w;
            acc[4] += v1.x;
            acc[5] += v1.y;
            acc[6] += v1.z;
            acc[7] += v1.w;
            continue;
          }
          const u32 sg = moe_seg_of(j, node);
          const int s = a.slots[(u64)sg * R + t];
          if (s < 0) continue;
          const uint4 v = __ldcg(reinterpret_cast<const uint4*>(precv + ((u64)sg * R + (u32)s) * sum_row + o * 2u));
          const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            acc[2 * q] += half_to_float<DT>((u16)(words[q] & 0xFFFFu));
            acc[2 * q + 1] += half_to_float<DT>((u16)(words[q] >> 16));
          }
        }
        uint4 r;
        r.x = pack2<DT>(acc[0], acc[1]);
        r.y = pack2<DT>(acc[2], acc[3]);
        r.z = pack2<DT>(acc[4], acc[5]);
        r.w = pack2<DT>(acc[6], acc[7]);
        *reinterpret_cast<uint4*>(out + ((u64)t * (u64)a.ldo + o) * 2u) = r;
      }
  }
  __syncthreads();
  if (tid == 0) trace_span(a.sync, MK_ROLE_COMPUTE, MOE_TRACE_PART_ADD | blockIdx.x, t_add);
  if (flushing) {  // the FLUSHes queued at entry have landed
    const u64 t_flush = trace_start(a.sync);
    for (u32 j = 0; j < N; ++j)
      if (j != node && !wait_pf(a, MOE_PF_PFLUSH + j, E, node_rank(a, j), MOE_WAIT_PFLUSH + j)) break;
    trace_span(a.sync, MK_ROLE_WAIT, MOE_TRACE_PART_FLUSH, t_flush);
  }
  __syncthreads();
  if (tid == 0 && counters_reset_by_last_block(a.counters, MOE_NCNT_WORDS, MOE_NCNT_DONE) && *a.verdict == MOE_PLAN_OK)
    for (u32 j = 0; j < N; ++j)  // every CTA read the targets: the next launch's follow these
      if (j != node) a.part_total[j] += bundle(a, j);
  launch_exit(a.sync, E);
}

static_assert(sizeof(MkMoeNodeArgs) % 8 == 0, "MkMoeNodeArgs: mkernel/ops/moe_nodes.py mirrors it");
