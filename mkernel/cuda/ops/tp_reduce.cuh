#pragma once
// GEMM+ReduceScatter and GEMM+AllReduce: one mechanism (OP = TP_OP_RS or TP_OP_AR).
//
// CTAs [0, gemm_ctas) run the GEMM (tp_epilogue.cuh): every rank computes its partial of every
// row block, peers' blocks first, and stores each tile of block o into the receive slot of rank
// o % local of its node (recv[lrank][o / local]), then sets its flag there.
// CTAs [gemm_ctas, grid) reduce: they claim tiles one by one (counter TP_CNT_REDUCE, in the order
// the GEMM produces them), wait until every local sender's flag of the tile is E and add the
// partials in fp32. One node: that is every partial of this rank's block, in rank order, rounded
// once and stored into `out` (the same order on every rank and in every run: bitwise
// reproducible). Several nodes (RS, hierarchical): this rank sums its node's partials of the
// blocks b with b % local == lrank, one per node; a node partial of a block owned on another node
// is rounded, staged compactly and sent to its owner as one WRITE per tile (the network carries
// each node's partial of a block once: the minimum), counting in the owner's arrival flag; the
// own block's tiles (last) add, in node order, this node's partials and the other nodes' node
// partials as their arrival counters reach this launch's target, then round once into `out`.
// AllReduce also pushes each reduced tile into every peer's gather buffer (gath[me], flag
// gflag[me][tl]), forwards the other nodes' reduced tiles of its blocks (TP_CNT_FORWARD) and copies
// the peers' reduced tiles from its own gather buffer into `out` as their flags arrive (TP_CNT_COPY).
// Waits: reducers wait on GEMM tiles only, copiers on reducers only, and the GEMM on credits only:
// no cycle. GEMM CTAs the controller lent (tp_controller.cuh) take reduction items between their
// tiles only when the item's inputs are already in (TpTurn, TpReduceItems): a turn never waits on a
// tile (at most on credits, announced by every rank at entry).
#include "tp_epilogue.cuh"
#include "queue.cuh"

// s[u] += the 8 elements of x[u] (u < count), in the input dtype (MK_OUT_F32: 4 elements, s[u][0..3]).
template <int DT, u32 U>
MK_DEV void tp_add_vectors(float (&s)[U][8], const uint4 (&x)[U], u32 count) {
#pragma unroll
  for (u32 u = 0; u < U; ++u) {
    if (u >= count) break;
    const u32 w[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (DT == MK_OUT_F32) {
        s[u][i] += __uint_as_float(w[i]);
        continue;
      }
      float lo, hi;
      unpack2<DT>(w[i], lo, hi);
      s[u][2 * i] += lo;
      s[u][2 * i + 1] += hi;
    }
  }
}

// s[u] += partials p = 0 .. count - 1 of vector u (u < vecs), at src(p, u), in p order (deterministic);
// the loads of PB partials' vecs vectors are in flight together (a round trip costs 2-5 us under a GEMM's load).
template <int DT, u32 U, u32 PB, class Src>
MK_DEV void tp_add_partials(float (&s)[U][8], u32 count, u32 vecs, Src src) {
  for (u32 p0 = 0; p0 < count; p0 += PB) {
    uint4 x[PB][U];
#pragma unroll
    for (u32 q = 0; q < PB; ++q)
#pragma unroll
      for (u32 u = 0; u < U; ++u)
        if (p0 + q < count && u < vecs) x[q][u] = ld_cg_v4(src(p0 + q, u));
#pragma unroll
    for (u32 q = 0; q < PB; ++q)
      if (p0 + q < count) tp_add_vectors<DT, U>(s, x[q], vecs);
  }
}

template <int DT>
MK_DEV uint4 tp_pack8(const float (&s)[8]) {
  if constexpr (DT == MK_OUT_F32)
    return make_uint4(__float_as_uint(s[0]), __float_as_uint(s[1]), __float_as_uint(s[2]), __float_as_uint(s[3]));
  uint4 r;
  r.x = pack2_out(DT, s[0], s[1]);
  r.y = pack2_out(DT, s[2], s[3]);
  r.z = pack2_out(DT, s[4], s[5]);
  r.w = pack2_out(DT, s[6], s[7]);
  return r;
}

// Thread 0 of the first CTA to arrive (tp_arrive).
MK_DEV void tp_announce(const TpArgs& a, u64 t0) {
  const u32 E = launch_epoch(a.g.sync);
  credits_announce(tp_peers(a), E);
  trace_span(a.g.sync, MK_ROLE_CONTROL, 0x80000000u | E, t0);
  for (u32 j = 0; j < (u32)a.nodes; ++j)
    if (j != (u32)a.node)
      queue_push(a.g.sync, a.queue, mk_signal_cmd(j * a.local + a.lrank, TP_PF_CREDIT + a.node, E, MK_FLAG_SET));
}

// Every thread at launch entry: this CTA's arrival rank (its role goes by it, not by its index:
// an arrived CTA runs, whatever part of the grid is resident). The first CTA to arrive says this
// rank entered the epoch, for its node's peers (credits) and for the ranks (j, lrank) of the other
// nodes that WRITE into this rank.
MK_DEV u32 tp_arrive(const TpArgs& a) {
  __shared__ u32 s_arrival;
  if (threadIdx.x == 0) {
    const u64 t0 = a.g.sync.trace_events ? globaltimer_ns() : 0;
    s_arrival = atomicAdd(&a.counters[TP_CNT_ENTER], 1u);
    trace_span(a.g.sync, MK_ROLE_CONTROL, blockIdx.x, t0);  // when and on which SM each CTA started
    if (s_arrival == 0) tp_announce(a, t0);
  }
  __syncthreads();
  return s_arrival;
}

// Reducer thread 0, several nodes: before the first WRITE of a launch to rank (j, lrank), its credit.
MK_DEV bool tp_remote_credit(const TpArgs& a, u32 j, u32 E, u32* credited) {
  if ((*credited >> j) & 1u) return true;
  const bool ok =
      wait_remote_epoch(a.g.sync, a.queue, a.pflags + TP_PF_CREDIT + j, E, (i32)(j * a.local + a.lrank), 0x20000u + j);
  *credited |= 1u << j;
  return ok;
}

MK_DEV u32 tp_launch_count(const TpArgs& a) {  // this launch's number (targets of the counting flags between nodes)
  return a.nodes > 1 ? ld_relaxed_sys(&a.counters[TP_CNT_LAUNCHES]) + 1 : 0u;
}

// Several nodes: the arrival counter (first of its kind: `base`) from node j of the tile at position
// p of its block (groups of consecutive positions), and the count it reaches once launch `launch`
// of the plan delivered every tile of p's group.
MK_DEV const u32* tp_arrival_flag(const TpArgs& a, u32 base, u32 j, u32 p) {
  return a.pflags + base + j * a.xgroups + p / a.xgroup;
}
MK_DEV u32 tp_arrival_target(const TpArgs& a, u32 p, u32 launch) {
  const u32 g = p / a.xgroup;
  return launch * min(a.xgroup, tp_tiles_blk(a) - g * a.xgroup);
}

// Reducer thread 0, several nodes: the arrival counters (first: `base`) of position p from every other node.
MK_DEV bool tp_remote_arrivals(const TpArgs& a, u32 base, u32 p, u32 launch) {
  for (u32 j = 0; j < (u32)a.nodes; ++j)
    if (j != (u32)a.node &&
        !wait_remote_at_least(a.g.sync, a.queue, tp_arrival_flag(a, base, j, p), tp_arrival_target(a, p, launch),
                              (i32)(j * a.local + a.lrank), 0x30000u + p))
      return false;
  return true;
}

// Thread 0, AR: every local peer entered this epoch, so its gather buffer may be written (once per
// group state).
MK_DEV bool tp_local_credits(const TpArgs& a, u32 E, TpCommShared* sh) {
  if (sh->local_ok) return true;
  bool good = true;
  for (u32 p = 0; p < (u32)a.local && good; ++p)
    if (p != (u32)a.lrank) good = credits_wait(a.g.sync, tp_peers(a), p, E);
  sh->local_ok = good ? 1u : 0u;
  return good;
}

// Reducer thread 0, several nodes, after the launch's last WRITE: FLUSH to every destination and
// wait until all landed (the staged tiles may then be rewritten by the next launch).
MK_DEV void tp_remote_flush(const TpArgs& a, u32 E) {
  for (u32 j = 0; j < (u32)a.nodes; ++j)
    if (j != (u32)a.node) queue_push(a.g.sync, a.queue, mk_flush_cmd(j * a.local + a.lrank, TP_PF_FLUSH + j, E));
  for (u32 j = 0; j < (u32)a.nodes; ++j)
    if (j != (u32)a.node && !wait_remote_epoch(a.g.sync, a.queue, a.pflags + TP_PF_FLUSH + j, E,
                                               (i32)(j * a.local + a.lrank), 0x40000u + j))
      return;
}

// The tile at position p of a block (the GEMM's order, TpBlockPos): its id, rows, columns and 16-byte
// vectors per row (n % 8 == 0); `packed`: its byte offset among the block's tiles stored densely in
// that order (rows of cols), so a group of consecutive positions is one span, complete as the GEMM goes.
struct TpTileShape {
  u32 tl, mt, nt, rows, cols, vpr;
  u64 packed;
  MK_DEV TpTileShape(const TpArgs& a, u32 p) {
    const TpBlockPos b(p, (u32)a.tiles_mb, (u32)a.tiles_n);
    const u64 n = (u64)a.g.n, band_rows = min((u64)b.band * 128u, (u64)a.mb - (u64)b.first * 128u);
    mt = b.mt;
    nt = b.nt;
    tl = mt * (u32)a.tiles_n + nt;
    rows = min(128u, (u32)a.mb - mt * 128u);
    cols = min(256u, (u32)a.g.n - nt * 256u);
    vpr = cols / 8u;
    // Earlier bands (whole rows), this band's earlier columns (256 wide: only the last is narrower),
    // this column's earlier M-tiles (128 rows: only the last is shorter).
    packed = ((u64)b.first * 128u * n + (u64)nt * 256u * band_rows + (u64)(mt - b.first) * 128u * cols) * 2;
  }
};

// Thread 0: a WRITE from this rank's workspace to rank (j, lrank)'s, adding `value` to its arrival
// counter `counter`; the launch's last one (of `sends`) flushes.
MK_DEV void tp_send_tile(const TpArgs& a, u32 j, u64 src_off, u64 dst_off, u32 bytes, u32 counter, u32 value, u32 sends,
                         u32 E) {
  queue_push(a.g.sync, a.queue,
             mk_write_cmd(j * a.local + a.lrank, MK_WORKSPACE_REGION, src_off, MK_WORKSPACE_REGION, dst_off, bytes,
                          counter, value, MK_FLAG_ADD));
  if (atomicAdd(&a.counters[TP_CNT_SENT], 1u) + 1 == sends) tp_remote_flush(a, E);
}

// Thread 0, after the tile at position p of stream `kind` (0: node partials, 1: AR's reduced tiles) to
// node j is staged (fenced): the CTA that stages a group's last tile WRITEs the group's slots at once.
MK_DEV void tp_send_staged(const TpArgs& a, u32 kind, u32 j, u32 p, u64 src_base, u64 dst_base, u32 counter, u32 sends,
                           u32 E) {
  const u32 first = p / a.xgroup * a.xgroup, count = min(a.xgroup, tp_tiles_blk(a) - first);
  const u32 k = (kind * (u32)a.nodes + j) * a.xgroups + p / a.xgroup;
  if (atomicAdd(&a.xstaged[k], 1u) + 1 != tp_launch_count(a) * count) return;  // counts over the plan's launches
  __threadfence();  // the other CTAs' tiles of the group (fenced before their counts) before the WRITE
  const TpTileShape head(a, first), last(a, first + count - 1);
  const u32 bytes = (u32)(last.packed + last.rows * last.cols * 2 - head.packed);
  tp_send_tile(a, j, src_base + head.packed, dst_base + head.packed, bytes, counter, count, sends, E);
}

// Reduction item `item` of this rank: node block j (other nodes' first, own last), the tile's position
// p in it (send groups, packed slots) and its id tl (flags inside the node).
struct TpReduceItem {
  u32 j, p, tl;
  bool own;
  MK_DEV TpReduceItem(const TpArgs& a, u32 item) {
    const u32 tb = tp_tiles_blk(a), N = (u32)a.nodes, n = (u32)a.node;
    const u32 i = item / tb;
    j = (n + 1 + i) % N;
    own = j == n;
    p = item - i * tb;
    tl = tp_block_tile(p, (u32)a.tiles_mb, (u32)a.tiles_n);
  }
};

// Whether reduction item `item` can run without waiting: every local sender's partial of its tile
// is in and, between nodes, the other nodes' partials (own block) or the destination's credit (a
// node partial to send). A lent GEMM CTA takes only such items.
MK_DEV bool tp_reduce_ready(const TpArgs& a, u32 E, u32 item) {
  const u32 tb = tp_tiles_blk(a), N = (u32)a.nodes, L = (u32)a.local;
  if (item >= N * tb) return false;
  const TpReduceItem it(a, item);
  const u32* rflag = peer_ptr<u32>(tp_peers(a), (u32)a.lrank, a.rflag_off);
  for (u32 s = 0; s < L; ++s)
    if (ld_acquire_sys(rflag + (s * N + it.j) * tb + it.tl) != E) return false;
  if (N == 1) return true;
  if (!it.own) return remote_peek(a.queue, a.pflags + TP_PF_CREDIT + it.j) == E;  // no PCIe read
  const u32 launch = tp_launch_count(a);
  for (u32 jj = 0; jj < N; ++jj)
    if (jj != (u32)a.node && !epoch_reached(remote_peek(a.queue, tp_arrival_flag(a, TP_PF_ARRIVED, jj, it.p)),
                                            tp_arrival_target(a, it.p, launch)))
      return false;
  return true;
}

// One claimed reduction item by a group of nthr threads (tid in [0, nthr)) that synchronise with
// bar(): the waits for its inputs (thread 0), the fp32 sums, the stores, flags and sends. Loads in
// flight: through `st` where it holds a vector of every partial a thread, else U vectors of PB
// partials in registers (a GEMM CTA's consumers, whose accumulators stay live, afford fewer than a
// comm CTA). Returns false when a wait failed (the error is recorded).
template <int DT, int OP, u32 U, u32 PB, class Bar>
MK_DEV bool tp_reduce_item(const TpArgs& a, u32 E, u32 item, u32 tid, u32 nthr, Bar bar, TpCommShared* sh, MkStage st) {
  const u32 me = (u32)a.me, tb = tp_tiles_blk(a);
  const u32 L = (u32)a.local, N = (u32)a.nodes, l = (u32)a.lrank, n = (u32)a.node;
  const MkPeers peers = tp_peers(a);
  const u64 ncol = (u64)a.g.n;
  const u64 blk_bytes = (u64)a.mb * ncol * 2;  // one row block of 16-bit elements
  const u8* recv = peer_ptr<u8>(peers, l, a.recv_off);  // [L senders][N blocks][mb][n]
  const u32* rflag = peer_ptr<u32>(peers, l, a.rflag_off);  // [L][N][tb]
  const u8* xrecv = peer_ptr<u8>(peers, l, a.xrecv_off);  // [N][tb] compact tiles (N > 1)
  u8* stage = peer_ptr<u8>(peers, l, a.stage_off);  // [N][tb] compact tiles (N > 1)
  const u32 sends = (OP == TP_OP_AR ? 2u : 1u) * (N - 1) * a.xgroups;  // WRITEs of this rank per launch
  const u32 gathered = TP_PF_ARRIVED + N * a.xgroups;  // AR: counters of reduced tiles, by node
  u8* out = reinterpret_cast<u8*>(a.out);
  const TpReduceItem it(a, item);
  const u32 j = it.j, tl = it.tl;
  const bool own = it.own;
  if (tid == 0) {
    const u64 start = tp_ctl_clock(a), t_wait = trace_start(a.g.sync);
    bool good = OP != TP_OP_AR || tp_local_credits(a, E, sh);
    for (u32 s = 0; s < L && good; ++s)
      good = wait_epoch(a.g.sync, rflag + (s * N + j) * tb + tl, E, (i32)(n * L + s), tl);
    if (good && N > 1)
      good = own ? tp_remote_arrivals(a, TP_PF_ARRIVED, it.p, tp_launch_count(a))
                 : tp_remote_credit(a, j, E, &sh->credited);
    tp_ctl_wait(a, &a.ctl->comm_stall_ns, start);
    trace_span(a.g.sync, MK_ROLE_WAIT, TP_TRACE_REDUCE | item, t_wait);
    sh->traced = trace_start(a.g.sync);
    __threadfence();
    sh->ok = good ? 1 : 0;
  }
  bar();
  if (!sh->ok) return false;
  const TpTileShape ts(a, it.p);
  const u64 tile_off = (u64)j * tb * TP_TILE_BYTES + ts.packed;  // own: the reduced tile to send (AR)
  const u32 nv = ts.rows * ts.vpr, P = own ? N - 1 + L : L;
  // Partial q of the vector at tile row r, column c: own block, node order (nodes before n, this
  // node's L ranks in rank order, the rest); another node's block, this node's ranks.
  const auto src = [&](u32 q, u32 r, u32 c) -> const u8* {
    const u32 s_l = own ? q - n : q;  // local rank, when q is one of this node's partials
    if (s_l < L) return recv + (u64)(s_l * N + j) * blk_bytes + (((u64)ts.mt * 128u + r) * ncol + ts.nt * 256u + c) * 2;
    const u32 jj = q < n ? q : q - L + 1;
    return xrecv + (u64)jj * tb * TP_TILE_BYTES + ts.packed + ((u64)r * ts.cols + c) * 2;
  };
  const auto finish = [&](u32 r, u32 c, const float(&s)[8]) {  // the rounded sum, where it goes
    const uint4 sum = tp_pack8<DT>(s);
    if (!own || (OP == TP_OP_AR && N > 1)) st_v4(stage + tile_off + ((u64)r * ts.cols + c) * 2, sum);
    if (!own) return;
    const u64 row = ts.mt * 128u + r, col = ts.nt * 256u + c;
    const u64 orow = OP == TP_OP_AR ? (u64)me * (u64)a.mb + row : row;
    st_v4(out + (orow * (u64)a.ldo + col) * 2, sum);
    if (OP == TP_OP_AR)
      for (u32 p = 0; p < L; ++p)
        if (p != l) st_v4(peer_ptr<u8>(peers, p, a.gath_off) + me * blk_bytes + (row * ncol + col) * 2, sum);
  };
  if (st.per(nthr, P) > 0) {  // staged: every partial of several vectors in flight a thread, summed in q order
    stage_vectors(
        st, P, nv, tid, nthr,
        [&](u32 q, u32 v) {
          const u32 r = v / ts.vpr;
          return src(q, r, (v - r * ts.vpr) * 8u);
        },
        [&](u32 v, const MkStaged& at) {
          const u32 r = v / ts.vpr;
          float s[1][8] = {};
          for (u32 q = 0; q < P; ++q) {
            const uint4 x[1] = {at(q)};
            tp_add_vectors<DT, 1>(s, x, 1);
          }
          finish(r, (v - r * ts.vpr) * 8u, s[0]);
        });
  } else {
    for (u32 v0 = tid; v0 < nv; v0 += U * nthr) {  // U vectors per thread at a time
      const u32 vecs = min(U, (nv - v0 + nthr - 1) / nthr);
      u32 rc[U];  // vector u's row in the tile (high half) and column (low half)
      float s[U][8];
#pragma unroll
      for (u32 u = 0; u < U; ++u) {
        const u32 v = v0 + u * nthr, r = v / ts.vpr;
        rc[u] = r << 16 | (v - r * ts.vpr) * 8u;
#pragma unroll
        for (int e = 0; e < 8; ++e) s[u][e] = 0.f;
      }
      tp_add_partials<DT, U, PB>(s, P, vecs, [&](u32 q, u32 u) { return src(q, rc[u] >> 16, rc[u] & 0xFFFFu); });
#pragma unroll
      for (u32 u = 0; u < U; ++u)
        if (u < vecs) finish(rc[u] >> 16, rc[u] & 0xFFFFu, s[u]);
    }
  }
  if (!own || OP == TP_OP_AR) {
    __threadfence_system();  // each thread's stores before the flags and WRITEs (cumulative with the barrier)
    bar();
  }
  if (tid == 0) {
    const u32 g = it.p / a.xgroup;
    if (!own)  // the node partial, counted in its owner's arrivals
      tp_send_staged(a, 0, j, it.p, a.stage_off + (u64)j * tb * TP_TILE_BYTES,
                     a.xrecv_off + (u64)n * tb * TP_TILE_BYTES, TP_PF_ARRIVED + n * a.xgroups + g, sends, E);
    if (own && OP == TP_OP_AR) {  // the reduced tile: to this node's peers, and once to every other node
      for (u32 p = 0; p < L; ++p)
        if (p != l) set_flag(peer_ptr<u32>(peers, p, a.gflag_off) + me * tb + tl, E);
      for (u32 jj = 0; jj < N; ++jj)
        if (jj != n && tp_remote_credit(a, jj, E, &sh->credited))
          tp_send_staged(a, 1, jj, it.p, a.stage_off + (u64)j * tb * TP_TILE_BYTES,
                         a.xgath_off + (u64)n * tb * TP_TILE_BYTES, gathered + n * a.xgroups + g, sends, E);
    }
    trace_span(a.g.sync, own ? MK_ROLE_INTRA : MK_ROLE_SEND, TP_TRACE_REDUCE | item, sh->traced);
  }
  return true;
}

// One AR item by a group as tp_reduce_item's; false: a wait failed. Forward (several nodes): the
// reduced tile at position pos of block o = jj * L + l that node jj sent, into `out` and this
// node's peers' gather buffers (it crosses the network once). Copy: the reduced tile of block o
// (owned or forwarded by a local peer) from this rank's gather buffer into `out`.
template <u32 C, class Bar>
MK_DEV bool tp_move_item(const TpArgs& a, u32 E, bool forward, u32 item, u32 tid, u32 nthr, Bar bar, TpCommShared* sh,
                         MkStage st) {
  const u32 W = (u32)a.world, L = (u32)a.local, l = (u32)a.lrank, tb = tp_tiles_blk(a), i = item / tb;
  const MkPeers peers = tp_peers(a);
  const u64 ncol = (u64)a.g.n, blk_bytes = (u64)a.mb * ncol * 2;
  const u32 pos = item - i * tb;
  u32 o = (u32)a.me, jj = 0;  // the block, and (forward) the node that sent it
  if (forward) {
    jj = ((u32)a.node + 1 + i) % (u32)a.nodes;
    o = jj * L + l;
  } else {
    for (u32 d = 0, seen = 0; seen <= i; ++d) {  // the i-th block after me whose local index is not l
      o = ((u32)a.me + 1 + d) % W;
      if (o % L != l) ++seen;
    }
  }
  const TpTileShape ts(a, pos);
  if (tid == 0) {
    const u64 t_wait = trace_start(a.g.sync);
    if (forward) {  // node jj's reduced tiles are counted by groups of positions
      const u32* arrived = tp_arrival_flag(a, TP_PF_ARRIVED + (u32)a.nodes * a.xgroups, jj, pos);
      sh->ok = tp_local_credits(a, E, sh) &&
               wait_remote_at_least(a.g.sync, a.queue, arrived, tp_arrival_target(a, pos, tp_launch_count(a)), (i32)o,
                                    0x50000u + pos);
    } else {
      const u32* gflag = peer_ptr<u32>(peers, l, a.gflag_off) + o * tb + ts.tl;
      sh->ok = wait_epoch(a.g.sync, gflag, E, (i32)o, 0x10000u + ts.tl);
    }
    trace_span(a.g.sync, MK_ROLE_WAIT, (forward ? TP_TRACE_FORWARD : TP_TRACE_COPY) | item, t_wait);
    sh->traced = trace_start(a.g.sync);
    __threadfence();
  }
  bar();
  if (!sh->ok) return false;
  // Forward: from the compact tile in xgath[jj]; copy: from the block's rows in this rank's gather buffer.
  const u8* src =
      forward ? peer_ptr<u8>(peers, l, a.xgath_off) + (u64)jj * tb * TP_TILE_BYTES + ts.packed
              : peer_ptr<u8>(peers, l, a.gath_off) + o * blk_bytes + ((u64)ts.mt * 128u * ncol + ts.nt * 256u) * 2;
  const u64 src_ld = forward ? ts.cols : ncol;
  u8* out = reinterpret_cast<u8*>(a.out);
  copy_vectors<C>(
      st, ts.rows * ts.vpr, tid, nthr,
      [&](u32 v) {
        const u32 r = v / ts.vpr;
        return src + ((u64)r * src_ld + (v - r * ts.vpr) * 8u) * 2;
      },
      [&](u32 v, uint4 x) {
        const u32 r = v / ts.vpr;
        const u64 row = ts.mt * 128u + r, col = ts.nt * 256u + (v - r * ts.vpr) * 8u;
        st_v4(out + (((u64)o * (u64)a.mb + row) * (u64)a.ldo + col) * 2, x);
        if (forward)
          for (u32 p = 0; p < L; ++p)
            if (p != l) st_v4(peer_ptr<u8>(peers, p, a.gath_off) + o * blk_bytes + (row * ncol + col) * 2, x);
      });
  if (forward) {
    __threadfence_system();
    bar();
  }
  if (tid == 0) {
    if (forward)
      for (u32 p = 0; p < L; ++p)
        if (p != l) set_flag(peer_ptr<u32>(peers, p, a.gflag_off) + o * tb + ts.tl, E);
    trace_span(a.g.sync, forward ? MK_ROLE_RECV : MK_ROLE_INTRA, (forward ? TP_TRACE_FORWARD : TP_TRACE_COPY) | item,
               sh->traced);
  }
  return true;
}

// The reduction (and, AR, the forwards and gather copies) by a group of nthr threads (tid in
// [0, nthr)) that synchronise with bar(): a communication CTA from the start, or a GEMM CTA's
// consumers after their tiles. Items are claimed in order from the shared counters, so any number
// of groups cooperate; a failed wait ends the group's work (the error is recorded).
template <int DT, int OP, u32 U, u32 PB, u32 C, class Bar>
MK_DEV void tp_reduce_work(const TpArgs& a, u32 E, u32 tid, u32 nthr, Bar bar, TpCommShared* sh, MkStage st) {
  const u32 W = (u32)a.world, N = (u32)a.nodes, tb = tp_tiles_blk(a);
  bool ok = true;
  while (ok) {  // reductions: blocks j * L + l (other nodes' first, own last)
    const u32 item = tp_claim(&a.counters[TP_CNT_REDUCE], &sh->item, tid, bar);
    if (item >= N * tb) break;
    ok = tp_reduce_item<DT, OP, U, PB>(a, E, item, tid, nthr, bar, sh, st);
    if (tid == 0) tp_ctl_tick<OP>(a);
  }
  while (OP == TP_OP_AR && ok && N > 1) {  // forwards of the other nodes' reduced tiles
    const u32 item = tp_claim(&a.counters[TP_CNT_FORWARD], &sh->item, tid, bar);
    if (item >= (N - 1) * tb) break;
    ok = tp_move_item<C>(a, E, true, item, tid, nthr, bar, sh, st);
  }
  while (OP == TP_OP_AR && ok) {  // gather copies of the blocks this node's other ranks hold
    const u32 item = tp_claim(&a.counters[TP_CNT_COPY], &sh->item, tid, bar);
    if (item >= (W - N) * tb) break;
    ok = tp_move_item<C>(a, E, false, item, tid, nthr, bar, sh, st);
  }
  bar();
}

// A lent GEMM CTA's turns in RS / AR (TpTurn): reduction items, 2 vectors in flight per consumer thread.
template <int DT, int OP>
struct TpReduceItems {
  static MK_DEV bool ready(const TpArgs& a, u32 E, u32 item) { return tp_reduce_ready(a, E, item); }
  template <class Bar>
  static MK_DEV bool run(const TpArgs& a, u32 E, u32 item, u32 tid, u32 nthr, Bar bar, TpCommShared* sh) {
    return tp_reduce_item<DT, OP, TP_IN_FLIGHT_GEMM, 1>(a, E, item, tid, nthr, bar, sh, MkStage{0, 0});
  }
};

// A communication CTA of GEMM+RS / GEMM+AR: reduces from the start.
template <int DT, int OP>
MK_DEV void tp_reduce_cta(const TpArgs& a) {
  const TpCommCta c = tp_comm_enter(a);
  tp_reduce_work<DT, OP, TP_REDUCE_IN_FLIGHT, TP_PARTIALS_IN_FLIGHT, TP_IN_FLIGHT>(a, c.E, threadIdx.x, blockDim.x,
                                                                                   MkBarCta(), c.sh, tp_comm_stage(a));
  if (threadIdx.x == 0) tp_counters_done(a);
  launch_exit(a.g.sync, c.E);
}

// RS / AR unfused: a CTA that moves tiles of the precomputed partial (args.partial) to the same
// receive slots, with the same flags and credits, in the same order as the GEMM CTAs' epilogue
// would: the same collective, after the GEMM instead of overlapped with it.
template <int OP>
MK_DEV void tp_partial_cta(const TpArgs& a) {
  __shared__ u32 s_epoch, s_pos;
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_epoch = launch_epoch(a.g.sync);
  __syncthreads();
  const u32 E = s_epoch;
  const MkPeers peers = tp_peers(a);
  const u64 ncol = (u64)a.g.n;
  TpDest<OP> dest{a, E};  // thread 0: flags and credits, as the epilogue's leaders use them
  for (;;) {
    if (threadIdx.x == 0) s_pos = atomicAdd(&a.counters[TP_CNT_TILE], 1u);
    __syncthreads();
    const u32 pos = s_pos;
    if (pos >= (u32)a.world * tp_tiles_blk(a)) break;
    const MkTile t = tp_decode<OP, 128, 256>(a, pos);
    if (threadIdx.x == 0) {
      const u32 d = (u32)t.group % (u32)a.local;
      s_ok = credits_wait(a.g.sync, peers, d, E) ? 1 : 0;
    }
    __syncthreads();
    if (!s_ok) break;
    const u32 o = (u32)t.group, L = (u32)a.local, cols = min(256u, (u32)(ncol - (u64)t.n0)), vpr = cols / 8u;
    u8* dst = peer_ptr<u8>(peers, o % L, a.recv_off) +
              (((u64)a.lrank * a.nodes + o / L) * (u64)a.mb + (u64)dest.row(t)) * ncol * 2;
    const u8* src = reinterpret_cast<const u8*>(a.partial) + (u64)t.m0 * (u64)a.ldp * 2;
    const auto col_of = [&](u32 v, u32& r) {
      r = v / vpr;
      return (u64)t.n0 + (v - r * vpr) * 8u;
    };
    copy_vectors<TP_IN_FLIGHT>(
        tp_comm_stage(a), (u32)t.rows * vpr, threadIdx.x, blockDim.x,
        [&](u32 v) {
          u32 r;
          const u64 col = col_of(v, r);
          return src + ((u64)r * (u64)a.ldp + col) * 2;
        },
        [&](u32 v, uint4 x) {
          u32 r;
          const u64 col = col_of(v, r);
          st_v4(dst + ((u64)r * ncol + col) * 2, x);
        });
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) set_flag(dest.flag(t), E);
  }
  __syncthreads();
  if (threadIdx.x == 0) tp_counters_done(a);
  launch_exit(a.g.sync, E);
}

// With args.join_staged, the joined consumers (every consumer thread calls this) stage their loads
// in the GEMM's A / B stages: after this barrier both warpgroups' last wgmma waited, every load landed.
template <class Cfg>
MK_DEV MkStage tp_join_stage(const TpArgs& a) {
  static_assert(Cfg::CLUSTER == 1, "a peer CTA's multicast could still land in the stages");
  extern __shared__ __align__(1024) u8 mk_smem[];
  if (!a.join_staged) return MkStage{0, 0};
  MkBarConsumers<>()();
  fence_proxy_async_smem();  // the stages were the async proxy's (TMA, wgmma); cp.async writes them now
  return MkStage{gemm_smem_carve<Cfg, false>(mk_smem).a(0), Cfg::OFF_C - Cfg::OFF_A};
}

// The consumers of a GEMM CTA join the reduction once their tiles are stored (args.join).
template <int DT, int OP>
struct TpJoinReduce {
  MK_DEV void operator()(const TpArgs& a, u32 E, TpCommShared* sh) const {
    if (a.join)
      tp_reduce_work<DT, OP, TP_IN_FLIGHT_GEMM, 1, TP_IN_FLIGHT_GEMM>(a, E, threadIdx.x - 128, 256, MkBarConsumers<>(),
                                                                      sh, tp_join_stage<GemmCfg<DT, 0> >(a));
  }
};

// The fused kernel of GEMM+RS / GEMM+AR. One CTA per SM, 384 threads, TP_SMEM_BYTES of dynamic
// shared memory. Roles go by arrival and work is claimed from counters, so any CTAs that are
// resident finish it.
template <int DT, int BL, int OP>
MK_DEV void tp_reduce_kernel_body(const TpArgs& args) {
  const u32 arrival = tp_arrive(args);  // GEMM first: the reducers wait for its tiles
  if (arrival >= (u32)args.gemm_ctas)
    tp_reduce_cta<DT, OP>(args);
  else if (args.partial)
    tp_partial_cta<OP>(args);
  else
    tp_gemm_cta<GemmCfg<DT, BL>, OP, TpJoinReduce<DT, OP>, TpTurn<OP, TpReduceItems<DT, OP> > >(args, arrival);
}
