#pragma once
// The argument struct of the fused tensor-parallel kernels (GEMM+ReduceScatter, GEMM+AllReduce,
// AllGather+GEMM), shared with Python (mkernel/ops/tp.py mirrors it with ctypes; tests/cpu/test_tp_compile.py
// compares the two layouts with g++). Plain fixed-width fields only.
#include "gemm_args.cuh"
#include "queue_layout.cuh"
#include "split_policy.cuh"

// Ranks of one node a fused TP op supports (one output tensor map per destination block).
#define TP_MAX_WORLD 8

// Fused ops (the OP template parameter of the kernels).
enum { TP_OP_RS = 0, TP_OP_AR = 1, TP_OP_AG = 2 };

// Device counters of one (op, shape) plan, zero between launches (the last CTA resets them), then
// one that is never reset: the plan's launches so far (targets of the counting flags between nodes).
enum {
  TP_CNT_TILE = 0,
  TP_CNT_DONE = 1,
  TP_CNT_REDUCE = 2,
  TP_CNT_COPY = 3,
  TP_CNT_PUSH = 4,
  TP_CNT_SENT = 5,
  TP_CNT_FORWARD = 6,
  TP_CNT_ENTER = 7,
  TP_CNT_WORDS = 8,
  TP_CNT_LAUNCHES = TP_CNT_WORDS
};

// A node partial crossing the network: one tile, compact (rows x cols of the tile, row-major).
#define TP_TILE_BYTES (128 * 256 * 2)

// A plan's proxy flags (TpArgs::pflags; command flag ids are relative to them):
//   CREDIT + j: rank (j, lrank) entered this epoch (SET to E): its receive tiles may be written;
//   FLUSH + j: this rank's WRITEs to (j, lrank) have all landed (SET to E);
//   ARRIVED + j * xgroups + g: tiles of node j's partial of this rank's block, group g, arrived
//   (ADD 1 per tile: launch P of the plan is complete at P * tiles in the group);
//   ARRIVED + (nodes + j) * xgroups + g (AR): reduced tiles of block j * local + lrank, group g.
enum { TP_PF_CREDIT = 0, TP_PF_FLUSH = TP_MAX_WORLD, TP_PF_ARRIVED = 2 * TP_MAX_WORLD };

// The in-call controller (TpArgs::ctl_mode, tp_controller.cuh): off (the split is static), adaptive
// (windows of counters step mk_split_ctl_step, which lends GEMM CTAs to communication), or a fixed
// pattern for tests (every odd GEMM CTA lent from the start: the turn path without timing).
enum { TP_CTL_OFF = 0, TP_CTL_ADAPT = 1, TP_CTL_PATTERN = 2 };

// One launch's controller record, copied by the launch's last CTA (TpCtl::last; the host reads it).
struct TpCtlStats {
  unsigned int turns;  // communication items GEMM CTAs took between their tiles
  unsigned int steps;  // controller steps that changed the number of lent GEMM CTAs
  unsigned int windows;  // windows the controller evaluated
  unsigned int gemm_windows;  // of those, windows with GEMM tiles left to claim (where a move is possible)
  unsigned int lent_peak;  // most GEMM CTAs lent at once
  unsigned int lent_last;  // GEMM CTAs lent at the end
  unsigned int gemm_ctas;  // the launch's static split
  unsigned int comm_ctas;
  unsigned int launches;  // launches recorded so far
  unsigned int pad[3];
};

// A plan's controller state (device memory, zero before the first launch). The live part is reset
// by each launch's last CTA (after every CTA's last claim), so a launch starts from zero without
// the host; only the lock holder writes ctl, window_start and the *_at fields (every ticking
// thread reads window_start), and lent (every GEMM producer reads it).
struct TpCtl {
  unsigned int lock;  // try-lock: the thread that takes it steps the controller
  unsigned int lent;  // GEMM CTAs [gemm_ctas - lent, gemm_ctas) prefer ready comm items
  unsigned int tiles_at;  // GEMM tile claims at the window's start
  unsigned int items_at;  // comm item claims at the window's start
  unsigned long long window_start;  // globaltimer at the window's start; 0 before the launch's first tick
  unsigned long long turn_ns;  // window sums (atomics): CTA-ns of GEMM CTAs' comm turns,
  unsigned long long comm_stall_ns;  //   comm CTAs waiting on their inputs,
  unsigned long long gemm_stall_ns;  //   GEMM producers waiting on theirs (AG arrivals)
  unsigned int turns, steps, windows, gemm_windows, lent_peak;  // this launch so far
  MkSplitCtl ctl;  // the policy's state
  unsigned int pad[5];
  TpCtlStats last;  // the last completed launch's record
};

struct TpArgs {
  // The GEMM engine's arguments: a (TMA map of A: the local A for RS/AR, the gathered-A buffer
  // for AG), b, sync, k, n; c is set to dst[0] (prefetched by gemm_setup, never stored through).
  MkGemmArgs g;
  // Destination of the tiles of row block o (TMA store maps, box {64 cols, 16 rows}, 128B swizzle,
  // rows [0, mb) of the block): RS/AR: the receive slot recv[lrank][o / local] of rank (node, o % local);
  // AG: out rows of block o.
  TmaDesc dst[TP_MAX_WORLD];
  const unsigned long long* peer_base;  // the communicator's peer_table (workspace base per local rank)
  unsigned long long recv_off;  // RS/AR: partials [local senders][nodes blocks][mb][n] (input dtype)
  unsigned long long rflag_off;  // RS/AR: partial-tile flags [local senders][nodes blocks][tiles_blk]
  unsigned long long gath_off;  // AR: reduced tiles [W owners][mb][n]
  unsigned long long gflag_off;  // AR: reduced-tile flags [W owners][tiles_blk]
  unsigned long long ga_off;  // AG: gathered A [W * mb][k]
  unsigned long long aflag_off;  // AG: chunk flags [W senders][chunks_blk]
  void* out;  // RS: [mb, n]; AR, AG: [W * mb, n]
  const void* a_local;  // AG: this rank's shard [mb, k]
  unsigned int* counters;  // TP_CNT_WORDS device words, zero between launches
  long long ldo;  // out row stride (elements)
  long long lda;  // AG: a_local row stride (elements)
  int world;  // ranks (nodes x local, node-major)
  int me;  // this rank's index
  int mb;  // rows of one row block (M / world)
  int tiles_mb;  // ceil(mb / 128)
  int tiles_n;  // ceil(n / 256)
  int gemm_ctas;  // CTAs [0, gemm_ctas) run GEMM tiles; the rest communicate
  int join;  // RS / AR: GEMM CTAs' consumers join the reduction after their tiles; AG: push CTAs
      // take GEMM tiles after their items
  // Nodes: world = nodes * local ranks, me = node * local + lrank (node-major). One node: nodes 1,
  // local = world. Between nodes (RS): block o's partials are first summed on node n by its rank
  // (n, o % local) (receive slot recv[sender lrank][o / local]); that rank sends the node partial
  // of a block owned on another node to its owner through the proxy (xrecv there, by node).
  int nodes;
  int local;
  int lrank;
  int node;
  unsigned int xgroup;  // tiles per arrival counter (TP_PF_ARRIVED)
  unsigned int xgroups;  // arrival counters per source node: ceil(tiles_blk / xgroup)
  unsigned int* xstaged;  // RS / AR: [2 kinds][nodes][xgroups] tiles staged so far, over the plan's launches
  MkQueue queue;  // the proxy queue, flag ids relative to pflags
  unsigned int* pflags;  // this plan's proxy flags (mapped host memory), TP_PF_*
  // [nodes][tiles_blk * TP_TILE_BYTES], each node's tiles packed in the GEMM's order (TpTileShape::packed):
  unsigned long long stage_off;  // node partials to send
  unsigned long long xrecv_off;  // node partials received, by source node
  unsigned long long xgath_off;  // AR: reduced tiles received, by source node
  const void* partial;  // RS / AR unfused (the baseline that isolates overlap): this rank's whole
      // partial [W * mb][n], computed before the launch; CTAs [0, gemm_ctas)
      // then copy its tiles where the GEMM epilogue would store them
  long long ldp;  // partial's row stride (elements)
  TpCtl* ctl;  // the plan's controller state
  int ctl_mode;  // TP_CTL_*
  int ctl_lend_max;  // adaptive: at most this many GEMM CTAs lent at once
  int own_copied;  // AG: this rank's shard is in its own gathered rows already (copied before the launch)
  int comm_staged;  // communication CTAs stage their loads in shared memory (tp_comm_stage)
  int join_staged;  // joined GEMM CTAs stage theirs in the GEMM's freed stages (tp_join_stage)
  int pad[5];  // explicit tail: sizeof is a multiple of 64
};
