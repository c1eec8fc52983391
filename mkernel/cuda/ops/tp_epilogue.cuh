#pragma once
// The GEMM side of the fused tensor-parallel kernels: the tile space cut into row blocks, the tile
// order (what a peer needs first), a tile source for the engine's producer loop (that order and, for
// AllGather+GEMM, a wait on the A chunk's arrival flag before its TMA loads), and a destination for
// the engine's epilogue: each tile goes through the tensor map of its row block's destination (a
// peer's receive slot, or a block of the local output) and its flag is published there.
//
// Engine internals this header relies on (mkernel/cuda/engines/gemm_mainloop.cuh, gemm_epilogue.cuh): the
// GemmBars ring protocol (tfull / tempty / full / empty barriers and their parities, MkTile in
// bars->ring), the join slots bars->join[seq % MK_JOIN_SLOTS], GemmSmem::a/b/c addresses, the
// 128B-swizzled epilogue chunk layout of MkTileEpilogue (16-bit output), gemm_consumer's functor
// interface (operator(), after_issue()), gemm_setup() and pack2_out(). See docs/TP.md.
//
// Tile space. Rows of the GEMM are W row blocks of mb rows (block o = rows [o*mb, (o+1)*mb)).
// Tiles never straddle blocks: block o has tiles_mb = ceil(mb / 128) M-tiles; a tile's block-local
// id is tl = mt * tiles_n + nt (the index of its flags). The last M-tile of a block may load rows of
// the next block (or past M: zeros); those rows are outside the destination map and never stored.
#include "common.cuh"
#include "signals.cuh"
#include "peers.cuh"
#include "tma.cuh"
#include "copy.cuh"
#include "convert.cuh"
#include "gemm_mainloop.cuh"
#include "gemm_epilogue.cuh"
#include "tp_args.cuh"
#include "tp_controller.cuh"

constexpr u32 TP_GROUP_M = 16;  // inside a block, tiles run in groups of 16 M-tiles (L2 reuse)

MK_DEV MkPeers tp_peers(const TpArgs& a) { return MkPeers{a.peer_base, (u32)a.local, (u32)a.lrank}; }
MK_DEV u32 tp_tiles_blk(const TpArgs& a) { return (u32)a.tiles_mb * (u32)a.tiles_n; }

// Position r inside one block, in the GEMM's order (bands of TP_GROUP_M M-tiles, N inside): its
// M-tile, N-tile, and its band's first M-tile and M-tiles.
struct TpBlockPos {
  u32 mt, nt, first, band;
  MK_DEV TpBlockPos(u32 r, u32 tiles_mb, u32 tiles_n) {
    const u32 span = TP_GROUP_M * tiles_n, g = r / span, rr = r - g * span;
    first = g * TP_GROUP_M;
    band = min(TP_GROUP_M, tiles_mb - first);
    mt = first + rr % band;
    nt = rr / band;
  }
};

// Position r inside one block -> block-local tile id.
MK_DEV u32 tp_block_tile(u32 r, u32 tiles_mb, u32 tiles_n) {
  const TpBlockPos b(r, tiles_mb, tiles_n);
  return b.mt * tiles_n + b.nt;
}

// The block the i-th group of GEMM tiles belongs to. RS / AR: peers' blocks first, those of other
// nodes before this node's (node + 1, node + 2, ...; inside a node lrank + 1, lrank + 2, ...), own
// block last, so that partials leave while the rest is computed, the ones with the longest way
// first. AG: the arrival order: own shard first (it is local), then this node's lrank - 1, lrank -
// 2, ... (rank p pushes to p + 1 first), then the other nodes' (node - 1, node - 2, ...).
template <int OP>
MK_DEV u32 tp_block_order(u32 i, const TpArgs& a) {
  const u32 L = (u32)a.local, N = (u32)a.nodes;
  if (OP == TP_OP_AG) return ((u32)a.node + N - i / L % N) % N * L + ((u32)a.lrank + L - i % L) % L;
  return ((u32)a.node + 1 + i / L) % N * L + ((u32)a.lrank + 1 + i % L) % L;
}

// GEMM position -> tile (group = row block, id = block-local tile id).
template <int OP, int BM, int BN>
MK_DEV MkTile tp_decode(const TpArgs& a, u32 pos) {
  const u32 tb = tp_tiles_blk(a);
  const u32 i = pos / tb;
  const u32 o = tp_block_order<OP>(i, a);
  const u32 tl = tp_block_tile(pos - i * tb, (u32)a.tiles_mb, (u32)a.tiles_n);
  const u32 mt = tl / (u32)a.tiles_n, nt = tl - mt * (u32)a.tiles_n;
  MkTile t;
  t.m0 = (i32)(o * (u32)a.mb + mt * BM);
  t.n0 = (i32)(nt * BN);
  t.rows = min(BM, a.mb - (i32)(mt * BM));
  t.group = (i32)o;
  t.id = tl;
  t.seq = 0;
  t.pad[0] = t.pad[1] = 0;
  return t;
}

// Per-CTA state of the communication work a group of threads does (shared memory; one per CTA,
// shared by a GEMM CTA's turns and its join).
struct TpCommShared {
  u32 queued;  // turns the producer put in the tile ring that the consumers have not finished
  u32 item;  // the group's claimed item (every thread of the group reads it)
  u32 credited;  // bit j: rank (j, lrank)'s remote credit for this epoch was seen (several nodes)
  u32 local_ok;  // AR: every local peer's credit was seen (their gather buffers may be written)
  int ok;  // the group's last wait succeeded
  u32 cta;  // a GEMM CTA's index among the GEMM CTAs (by arrival: tp_arrive)
  u64 traced;  // trace mode, the group's thread 0: when the current item's work began
};

// Trace ids of the TP kernels' spans (tools/tp_trace.py reads them): the kind in the top byte.
enum : u32 {
  TP_TRACE_REDUCE = 0x00000000u,  // | reduction item: WAIT, then SEND (a node partial) or INTRA (own tile)
  TP_TRACE_FORWARD = 0x01000000u,  // | forward item (between nodes): WAIT, then RECV
  TP_TRACE_COPY = 0x02000000u,  // | AR gather copy item: WAIT, then INTRA
  TP_TRACE_PUSH = 0x03000000u,  // | AG push item: WAIT (credit), then INTRA (to a peer) or SEND (own, then WRITEs)
  TP_TRACE_TILE =
      0x04000000u  // | GEMM tile: COMPUTE at its flag (RS / AR), WAIT for its A chunk (AG: group << 16 | mt)
};
MK_DEV void tp_comm_shared_init(TpCommShared* sh) {
  sh->queued = 0;
  sh->item = 0;
  sh->credited = 0;
  sh->local_ok = 0;
  sh->ok = 1;
  sh->cta = 0;
  sh->traced = 0;
}

// A communication CTA's entry, every thread: this launch's epoch and the CTA's shared state.
struct TpCommCta {
  u32 E;
  TpCommShared* sh;
};
MK_DEV TpCommCta tp_comm_enter(const TpArgs& a) {
  __shared__ u32 s_epoch;
  __shared__ TpCommShared comm;
  if (threadIdx.x == 0) {
    s_epoch = launch_epoch(a.g.sync);
    tp_comm_shared_init(&comm);
  }
  __syncthreads();
  return {s_epoch, &comm};
}

// What a lent GEMM CTA does between two tiles (tp_controller.cuh): ready(args, E, ahead) on the
// producer thread (the item `ahead` places after the next unclaimed one can run without waiting:
// the turns already queued in this CTA's tile ring will take those before it), run(args, E,
// shared) on the 256 consumer threads (claim the next ready item if one is left, run it).
struct TpNoTurn {
  static MK_DEV bool ready(const TpArgs&, u32, u32) { return false; }
  static MK_DEV void run(const TpArgs&, u32, TpCommShared*) {}
};

// The turn over the op's comm items (counter tp_ctl_counter<OP>()). Items provides
//   static bool ready(args, E, item)                          item can run without waiting
//   static bool run(args, E, item, tid, nthr, bar, shared)    the one-item step (false: a wait failed)
// RS / AR: TpReduceItems (tp_reduce.cuh); AG: TpPushItems (allgather_gemm.cu).
template <int OP, class Items>
struct TpTurn {
  static MK_DEV bool ready(const TpArgs& a, u32 E, u32 ahead) {
    return Items::ready(a, E, ld_volatile(&a.counters[tp_ctl_counter<OP>()]) + ahead);
  }
  static MK_DEV void run(const TpArgs& a, u32 E, TpCommShared* sh) {
    const u32 tid = threadIdx.x - 128;
    const u64 start = globaltimer_ns();
    const MkBarConsumers<> bar;
    bar();  // the group's previous use of sh->item is over
    if (tid == 0)
      sh->item = tp_try_claim(&a.counters[tp_ctl_counter<OP>()], [&](u32 v) { return Items::ready(a, E, v); });
    bar();
    const u32 item = sh->item;
    const bool took = item != TP_CTL_NO_ITEM && Items::run(a, E, item, tid, 256u, bar, sh);
    if (tid == 0) tp_ctl_turn_done(a, start, took);
  }
};

// The tile source of the fused kernels for the engine's producer loop: tiles claimed from
// counters[TP_CNT_TILE] in the TP order, or, for a lent CTA, a turn when a comm item is ready for
// it (the item counter moves only when a turn runs, so with q turns queued in the ring it asks for
// the item q places ahead: no marker is queued for an item another marker will take); for AG,
// before a tile's loads, the wait on the arrival flag of its A chunk (block o, M-tile mt), then a
// proxy fence so the TMA (async proxy) sees the rows that peers stored (generic proxy). B is a
// single matrix.
template <class Cfg, int OP, class Turn = TpNoTurn>
struct TpTiles {
  const TpArgs& args;
  u32 epoch;
  TpCommShared* comm;
  MK_DEV u32 claim() const {
    if (args.ctl_mode != TP_CTL_OFF && tp_ctl_lent(args, comm->cta) &&
        Turn::ready(args, epoch, *reinterpret_cast<volatile u32*>(&comm->queued))) {
      atomicAdd(&comm->queued, 1u);
      return MK_TILE_COMM;
    }
    return atomicAdd(&args.counters[TP_CNT_TILE], 1u);
  }
  MK_DEV bool done(u32 pos) const { return pos >= (u32)args.world * tp_tiles_blk(args); }
  MK_DEV MkTile decode(u32 pos) const { return tp_decode<OP, Cfg::BM, Cfg::BN>(args, pos); }
  MK_DEV void before_loads(const MkTile& t) const {
    if (OP != TP_OP_AG) return;
    const u32 mt = t.id / (u32)args.tiles_n;
    const u32* flag =
        peer_ptr<u32>(tp_peers(args), (u32)args.lrank, args.aflag_off) + (u32)t.group * (u32)args.tiles_mb + mt;
    const u64 start = tp_ctl_clock(args), t_wait = trace_start(args.g.sync);
    wait_epoch(args.g.sync, flag, epoch, t.group, mt);  // on a timeout the error is recorded; go on
    tp_ctl_wait(args, &args.ctl->gemm_stall_ns, start);
    trace_span(args.g.sync, MK_ROLE_WAIT, TP_TRACE_TILE | ((u32)t.group << 16) | mt, t_wait);
    fence_proxy_async_global();
  }
  MK_DEV i32 b_index(const MkTile&) const { return 0; }
};

// The fused kernels' epilogue destination: the tensor map of the tile's row block (args.dst[o]: the
// receive slot recv[lrank][o / local] of rank o % local of this node for RS / AR, a block of the
// local output for AG) at block-local rows, and (RS / AR) the tile's flag in that rank's workspace,
// rflag[lrank][o / local][tl]. Before the first store into a rank in this launch, a warp's leader
// waits for its credit. A turn (MK_TILE_COMM) runs Turn with the CTA's comm state.
template <int OP, class Turn = TpNoTurn>
struct TpDest {
  static constexpr bool ROWS = false;
  const TpArgs& args;
  u32 epoch;
  TpCommShared* comm = nullptr;
  u32 credited = 0;  // leader: bit o set once rank o's credit for this epoch was seen

  MK_DEV const TmaDesc* map(const MkTile& t) const { return &args.dst[t.group]; }
  MK_DEV i32 row(const MkTile& t) const { return t.m0 - t.group * args.mb; }
  MK_DEV u32* flag(const MkTile& t) const {
    if (OP == TP_OP_AG) return nullptr;
    const u32 o = (u32)t.group, L = (u32)args.local;
    return peer_ptr<u32>(tp_peers(args), o % L, args.rflag_off) +
           ((u32)args.lrank * (u32)args.nodes + o / L) * tp_tiles_blk(args) + t.id;
  }
  MK_DEV bool flags() const { return OP != TP_OP_AG; }
  MK_DEV bool add() const { return false; }
  // A rank whose credit never came may be gone or stalled: nothing is written into it after that
  // (a resumed rank must time out, not find this launch's tiles and flags).
  MK_DEV bool before_store(const MkTile& t) {
    const u32 d = (u32)t.group % (u32)args.local;
    if (OP == TP_OP_AG || ((credited >> d) & 1u)) return true;
    if (!credits_wait(args.g.sync, tp_peers(args), d, epoch)) return false;
    fence_proxy_async_global();
    credited |= 1u << d;
    return true;
  }
  MK_DEV void published(u32 id) const {
    trace_span(args.g.sync, MK_ROLE_COMPUTE, TP_TRACE_TILE | id, trace_start(args.g.sync));  // no timer read when off
  }
  MK_DEV u8* row_at(const MkTile&, i32) const { return nullptr; }  // (not ROWS)
  MK_DEV void comm_turn(const MkTile&) const {
    Turn::run(args, epoch, comm);
    if (threadIdx.x == 128) atomicSub(&comm->queued, 1u);  // after the group's last barrier of the turn
  }
};

// Outputs are in the input dtype (MK_OUT_BF16 / MK_OUT_F16 have the MK_DT_* values).
template <class Cfg, int OP, class Turn>
using TpEpilogue = MkTileEpilogue<Cfg::DT, Cfg, false, TpDest<OP, Turn> >;

// ------------------------------------------------------------------------------ communication
// Vectors a thread has in flight in the communication loops: a loop with one 16-byte load at a
// time is latency-bound (10-13 GB/s a CTA, measured in the MoE dispatch and in the TP reduction at
// world 1), so each thread issues TP_IN_FLIGHT loads before it uses the first.
// A reduction has TP_REDUCE_IN_FLIGHT vectors of TP_PARTIALS_IN_FLIGHT partials in flight (its fp32
// sums take registers too). A GEMM CTA's consumers (turns, join) keep their accumulators live: fewer.
constexpr u32 TP_IN_FLIGHT = 8;
constexpr u32 TP_REDUCE_IN_FLIGHT = 4;
constexpr u32 TP_PARTIALS_IN_FLIGHT = 2;
constexpr u32 TP_IN_FLIGHT_GEMM = 2;
// With args.comm_staged, a communication CTA (no GEMM: the launch's dynamic shared memory is idle
// there) stages its loads in TP_COMM_STAGE_BYTES of it (cp.async): 4x the bytes in flight.
constexpr u32 TP_COMM_STAGE_BYTES = 192u << 10;
MK_DEV MkStage tp_comm_stage(const TpArgs& a) {
  extern __shared__ __align__(1024) u8 mk_smem[];
  return a.comm_staged ? MkStage{(u32)__cvta_generic_to_shared(mk_smem), TP_COMM_STAGE_BYTES} : MkStage{0, 0};
}

// Every CTA, thread 0, after its last claim: the last CTA resets the plan's counters and the
// controller's live state, and counts the launch.
MK_DEV void tp_counters_done(const TpArgs& a) {
  trace_span(a.g.sync, MK_ROLE_CONTROL, 0x40000000u | blockIdx.x, globaltimer_ns());  // when each CTA left
  if (counters_reset_by_last_block(a.counters, TP_CNT_WORDS, TP_CNT_DONE)) {
    tp_ctl_finish(a);
    atomicAdd(&a.counters[TP_CNT_LAUNCHES], 1u);
  }
}

// Claim of the next item of a counter by a group of threads (the CTA, or the 256 consumer
// threads of a GEMM CTA): every thread of the group gets the same value.
template <class Bar>
MK_DEV u32 tp_claim(unsigned int* counter, u32* s_item, u32 tid, Bar bar) {
  bar();
  if (tid == 0) *s_item = atomicAdd(counter, 1u);
  bar();
  return *s_item;
}

struct TpNoJoin {
  MK_DEV void operator()(const TpArgs&, u32, TpCommShared*) const {}
};

// A GEMM CTA of a fused kernel (`cta`: its index among them): the engine's setup and consumers,
// the TP producer and epilogue.
// Between tiles, a lent CTA's consumers take Turn's comm items; after their last tile, the consumer
// threads (256) run join(args, epoch, comm) (RS / AR: they join the reduction). The CTA's counter
// bookkeeping is its last act before launch_exit.
template <class Cfg, int OP, class Join = TpNoJoin, class Turn = TpNoTurn>
MK_DEV void tp_gemm_cta(const TpArgs& args, u32 cta, Join join = Join()) {
  extern __shared__ __align__(1024) u8 mk_smem[];
  __shared__ TpCommShared comm;
  if (threadIdx.x == 0) {  // before gemm_setup's barrier
    tp_comm_shared_init(&comm);
    comm.cta = cta;
  }
  const GemmSmem<Cfg> sm = gemm_smem_carve<Cfg, false>(mk_smem);
  gemm_setup<Cfg, false>(args.g, sm);  // barriers, epoch; its tile space is not used
  const u32 epoch = sm.bars->epoch;
  warpgroup_roles<Cfg>(
      [&] {
        TpTiles<Cfg, OP, Turn> src{args, epoch, &comm};
        gemm_producer_loop<Cfg>(args.g, sm, src);
      },
      [&](int wg) {
        TpEpilogue<Cfg, OP, Turn> epi{args.g, sm, epoch, TpDest<OP, Turn>{args, epoch, &comm}};
        gemm_consumer<Cfg>(args.g, sm, wg, epi);
        epi.finish();  // this CTA's flags are published before it waits for anybody's
        __syncwarp();
        join(args, epoch, &comm);
      });
  __syncthreads();
  if (threadIdx.x == 0) tp_counters_done(args);
  launch_exit(args.g.sync, epoch);
}

// Shared memory the fused kernels launch with (the engine's plain GEMM layout).
#define TP_SMEM_BYTES (gemm_smem_bytes<GemmCfg<0, 0>, false>())
static_assert(TP_COMM_STAGE_BYTES <= TP_SMEM_BYTES, "the comm CTAs' stage fits the launch's shared memory");
