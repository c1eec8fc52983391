// AllGather+GEMM (mkernel/ops/allgather_gemm.py; design: docs/TP.md).
//
// CTAs [gemm_ctas, grid) push this rank's A shard, in chunks of 128 rows, into the gathered-A
// buffer of every rank of its node (its own first, then lrank+1, lrank+2, ...), each chunk followed
// by its flag aflag[me][chunk] = E in the receiver's workspace (after the receiver's credit for E).
// Several nodes: once a chunk is in this rank's own buffer it also leaves, as one WRITE, for the
// rank with the same local index on every other node, counted in that rank's arrival flags; and
// this rank forwards the chunks that arrive that way (blocks j * local + lrank) into its node:
// their flag in its own workspace, their rows and flags into its node's peers'. So each shard
// crosses the network once per node. CTAs [0, gemm_ctas) run the GEMM over the gathered rows in
// arrival order; the producer waits for a chunk's flag before its TMA loads, so the GEMM starts
// with the first local chunk and overlaps the rest of the gather. GEMM CTAs the controller lent
// (tp_controller.cuh) also push chunks between their tiles (TpTurn, TpPushItems); with args.join,
// push CTAs that find no item left take GEMM tiles from the same counter.
#include "tp_reduce.cuh"

// Copies `rows` rows of k elements (16-byte vectors) from src (row stride lds elements) to dst
// (row stride k), by a group of nthr threads (tid in [0, nthr)): through `st`, or U vectors in flight
// per thread in registers.
template <u32 U>
MK_DEV void tp_copy_rows(MkStage st, u8* dst, const u8* src, u32 rows, u64 k, u64 lds, u32 tid, u32 nthr) {
  const u32 vpr = (u32)(k / 8);  // 16-byte vectors per row (k % 8 == 0)
  copy_vectors<U>(
      st, rows * vpr, tid, nthr,
      [&](u32 v) {
        const u32 r = v / vpr;
        return src + ((u64)r * lds + (u64)(v - r * vpr) * 8u) * 2;
      },
      [&](u32 v, uint4 x) {
        const u32 r = v / vpr;
        st_v4(dst + ((u64)r * k + (u64)(v - r * vpr) * 8u) * 2, x);
      });
}

// Push item `item` (this rank's chunk c to local rank d: its own buffer first, then lrank + 1, ...)
// by a group of nthr threads that synchronise with bar(): the receiver's credit, the rows, the
// chunk's flag there and, once the chunk is in this rank's own buffer between nodes, its WRITE to
// every other node. Returns false when a wait failed (the error is recorded).
template <u32 U, class Bar>
MK_DEV bool tp_push_item(const TpArgs& a, u32 E, u32 item, u32 tid, u32 nthr, Bar bar, TpCommShared* sh, MkStage st) {
  const u32 me = (u32)a.me, chunks = (u32)a.tiles_mb;
  const u32 L = (u32)a.local, N = (u32)a.nodes, l = (u32)a.lrank, n = (u32)a.node;
  const MkPeers peers = tp_peers(a);
  const u64 k = (u64)a.g.k, row_bytes = k * 2;
  const u32 i = item / chunks, c = item - i * chunks;
  const u32 d = (l + i) % L;
  if (tid == 0) {
    const u64 start = tp_ctl_clock(a), t_wait = trace_start(a.g.sync);
    sh->ok = credits_wait(a.g.sync, peers, d, E) ? 1 : 0;
    tp_ctl_wait(a, &a.ctl->comm_stall_ns, start);
    trace_span(a.g.sync, MK_ROLE_WAIT, TP_TRACE_PUSH | item, t_wait);
    sh->traced = trace_start(a.g.sync);
  }
  bar();
  if (!sh->ok) return false;
  const u32 rows = min(128u, (u32)a.mb - c * 128u);
  const u64 dst_off = a.ga_off + ((u64)me * (u64)a.mb + c * 128u) * row_bytes;
  const u8* src = reinterpret_cast<const u8*>(a.a_local) + (u64)c * 128u * (u64)a.lda * 2;
  if (d != l || !a.own_copied) {  // own_copied: the rows are there already (stream order)
    tp_copy_rows<U>(st, peer_ptr<u8>(peers, d, dst_off), src, rows, k, (u64)a.lda, tid, nthr);
    __threadfence_system();
  }
  bar();
  if (tid == 0) {
    set_flag(peer_ptr<u32>(peers, d, a.aflag_off) + me * chunks + c, E);
    if (d == l)  // in this rank's own buffer now: a registered source for the other nodes
      for (u32 j = 0; j < N; ++j)
        if (j != n && tp_remote_credit(a, j, E, &sh->credited))
          tp_send_tile(a, j, dst_off, dst_off, rows * (u32)row_bytes, TP_PF_ARRIVED + n * a.xgroups + c / a.xgroup, 1u,
                       (N - 1) * chunks, E);
    trace_span(a.g.sync, d == l && N > 1 ? MK_ROLE_SEND : MK_ROLE_INTRA, TP_TRACE_PUSH | item, sh->traced);
  }
  return true;
}

// A lent GEMM CTA's turns in AG (TpTurn): pushes of this rank's shard (always ready but for the
// receiver's credit, which every rank announces at entry), 2 vectors in flight per consumer thread.
struct TpPushItems {
  static MK_DEV bool ready(const TpArgs& a, u32, u32 item) { return item < tp_ctl_items<TP_OP_AG>(a); }
  template <class Bar>
  static MK_DEV bool run(const TpArgs& a, u32 E, u32 item, u32 tid, u32 nthr, Bar bar, TpCommShared* sh) {
    return tp_push_item<TP_IN_FLIGHT_GEMM>(a, E, item, tid, nthr, bar, sh, MkStage{0, 0});
  }
};

// A push CTA's items, every thread; false when a wait failed (the error is recorded).
MK_DEV bool tp_push_cta(const TpArgs& a, const TpCommCta& cta) {
  const u32 E = cta.E;
  TpCommShared& comm = *cta.sh;
  const u32 chunks = (u32)a.tiles_mb;
  const u32 L = (u32)a.local, N = (u32)a.nodes, l = (u32)a.lrank, n = (u32)a.node;
  const MkPeers peers = tp_peers(a);
  const u64 k = (u64)a.g.k, row_bytes = k * 2;
  const u32 launch = tp_launch_count(a);
  bool ok = true;
  while (ok) {  // this rank's chunks to its node (own buffer first), then across the network
    const u32 item = tp_claim(&a.counters[TP_CNT_PUSH], &comm.item, threadIdx.x, MkBarCta());
    if (item >= tp_ctl_items<TP_OP_AG>(a)) break;
    ok = tp_push_item<TP_IN_FLIGHT>(a, E, item, threadIdx.x, blockDim.x, MkBarCta(), &comm, tp_comm_stage(a));
    if (threadIdx.x == 0) tp_ctl_tick<TP_OP_AG>(a);
  }
  while (ok) {  // several nodes: the chunks of blocks j * L + l that arrived, into this node
    const u32 item = tp_claim(&a.counters[TP_CNT_FORWARD], &comm.item, threadIdx.x, MkBarCta());
    if (item >= (N - 1) * chunks) break;
    const u32 i = item / chunks, c = item - i * chunks;
    const u32 j = (n + N - 1 - i) % N, o = j * L + l;
    if (threadIdx.x == 0) {
      const u32 g = c / a.xgroup;
      const u64 t_wait = trace_start(a.g.sync);
      int good = wait_remote_at_least(a.g.sync, a.queue, a.pflags + TP_PF_ARRIVED + j * a.xgroups + g,
                                      launch * min(a.xgroup, chunks - g * a.xgroup), (i32)o, 0x60000u + c)
                     ? 1
                     : 0;
      for (u32 p = 0; p < L && good; ++p)
        if (p != l) good = credits_wait(a.g.sync, peers, p, E) ? 1 : 0;
      comm.ok = good;
      trace_span(a.g.sync, MK_ROLE_WAIT, TP_TRACE_FORWARD | item, t_wait);
      comm.traced = trace_start(a.g.sync);
      __threadfence();
    }
    __syncthreads();
    if (!comm.ok) break;
    const u32 rows = min(128u, (u32)a.mb - c * 128u);
    const u64 off = a.ga_off + ((u64)o * (u64)a.mb + c * 128u) * row_bytes;
    for (u32 p = 0; p < L; ++p)
      if (p != l)
        tp_copy_rows<TP_IN_FLIGHT>(tp_comm_stage(a), peer_ptr<u8>(peers, p, off), peer_ptr<u8>(peers, l, off), rows, k,
                                   k, threadIdx.x, blockDim.x);
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
      for (u32 p = 0; p < L; ++p) set_flag(peer_ptr<u32>(peers, p, a.aflag_off) + o * chunks + c, E);
      trace_span(a.g.sync, MK_ROLE_RECV, TP_TRACE_FORWARD | item, comm.traced);
    }
  }
  // Unfused (no GEMM CTAs): the GEMM after this kernel reads the gathered A, so every chunk of
  // it, local peers' pushes and forwards included, must have landed before the kernel ends.
  if (ok && a.gemm_ctas == 0) {
    const u32* own = peer_ptr<u32>(peers, l, a.aflag_off);
    for (u32 f = threadIdx.x; f < (u32)a.world * chunks; f += blockDim.x)
      if (!wait_epoch(a.g.sync, own + f, E, (i32)(f / chunks), 0x70000u + f % chunks)) break;
  }
  return ok;
}

template <int DT, int BL>
__global__ void __launch_bounds__(384, 1) mk_allgather_gemm_kernel(const __grid_constant__ TpArgs args) {
  using Gemm = GemmCfg<DT, BL>;
  using Turn = TpTurn<TP_OP_AG, TpPushItems>;
  const u32 arrival = tp_arrive(args), pushers = gridDim.x - (u32)args.gemm_ctas;
  if (arrival >= pushers) {  // pushers first: the GEMM waits for the rows they bring
    tp_gemm_cta<Gemm, TP_OP_AG, TpNoJoin, Turn>(args, arrival - pushers);
    return;
  }
  const TpCommCta cta = tp_comm_enter(args);
  const bool ok = tp_push_cta(args, cta);
  // No item left: the SM takes GEMM tiles too (an index past the GEMM CTAs'). Not after an error:
  // a wait that gave up may have left a staged load in flight into the shared memory.
  if (args.join && args.gemm_ctas > 0 && !__syncthreads_or(!ok || (threadIdx.x == 0 && error_recorded(args.g.sync)))) {
    fence_proxy_async_smem();  // the stage's generic use before the GEMM's TMA loads
    __syncthreads();
    tp_gemm_cta<Gemm, TP_OP_AG, TpNoJoin, Turn>(args, (u32)args.gemm_ctas + arrival);
    return;
  }
  __syncthreads();
  if (threadIdx.x == 0) tp_counters_done(args);
  launch_exit(args.g.sync, cta.E);
}

static_assert(TP_SMEM_BYTES == 230736, "update tp.SMEM_BYTES");
static_assert(sizeof(TpArgs) == 1920, "TpArgs layout changed: update mkernel/ops/tp.py");
