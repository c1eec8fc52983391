#pragma once
// The argument struct of the expert-parallel kernels (MoE dispatch and combine, mkernel/cuda/ops/moe.cu),
// shared with Python (mkernel/ops/moe.py mirrors it with ctypes; tests/cpu/test_moe.py compares the layouts
// with g++). Plain fixed-width fields only.
#include "sync_args.cuh"
#include "queue_layout.cuh"

#define MOE_MAX_WORLD 8
#define MOE_MAX_EXPERTS 512  // global experts (shared-memory tables of the kernels)
#define MOE_MAX_TOPK 8
#define MOE_MAX_NODES 8
#define MOE_MAX_PIECES 8  // between nodes, WRITEs of a bundle's rows at most (MkMoeArgs::pieces)

// Words of one rank's count row: pairs per global expert, then its token count, then how many of its
// expert ids were out of range (every rank reads every row, so all decide an error alike), then its
// own-origin pairs per expert (between nodes: of its own tokens, not forwarded; else all of them).
#define MOE_ROW_T(E) (E)
#define MOE_ROW_BAD(E) ((E) + 1)
#define MOE_ROW_OWN(E) ((E) + 2)
#define MOE_ROW_WORDS(E) (2 * (E) + 2)

// Between nodes, the node plan's proxy flags (relative to its block; moe_nodes.cu and the dispatch's
// waits): CREDIT + s (rank s entered the exchange: its count row and bundle buffers may be written),
// GCOUNT + s (s's count row arrived), DESC / ROWS + n (node n's bundle of routing words / rows
// arrived), FLUSH + r (this rank's exchange commands to r applied), PCREDIT + n, PFLUSH + n: the same
// for the partial sums going back; PART + n counts the tokens whose sums node n WRITes here.
// Each kind has MOE_MAX_WORLD slots (ranks or nodes: at most that many), but ROWS + n * MOE_MAX_PIECES
// + q: piece q of node n's bundle of rows arrived.
enum {
  MOE_PF_CREDIT = 0,
  MOE_PF_GCOUNT = MOE_MAX_WORLD,
  MOE_PF_DESC = 2 * MOE_MAX_WORLD,
  MOE_PF_FLUSH = 3 * MOE_MAX_WORLD,
  MOE_PF_PCREDIT = 4 * MOE_MAX_WORLD,
  MOE_PF_PART = 5 * MOE_MAX_WORLD,
  MOE_PF_PFLUSH = 6 * MOE_MAX_WORLD,
  MOE_PF_ROWS = 7 * MOE_MAX_WORLD,
  MOE_PF_WORDS = 7 * MOE_MAX_WORLD + MOE_MAX_NODES * MOE_MAX_PIECES
};

// Between nodes, forwarded tokens the fused combine sums per claim (a chunk; sums_group chunks a WRITE).
enum { MOE_FWD_SUM_TOKENS = 32 };

// Between nodes, vseg's words: the segments' first tokens (MOE_MAX_NODES), then per forwarded segment
// i the first token of each piece q of its bundle, relative to vseg[i], and its size (q = MOE_MAX_PIECES).
#define MOE_VPST(i, q) (MOE_MAX_NODES + (i) * (MOE_MAX_PIECES + 1) + (q))
#define MOE_VSEG_WORDS MOE_VPST(MOE_MAX_NODES - 1, 0)
// (piece, segment) cells of the fused combine's forwarded sums (moe_combine.cuh): a group of chunks lies in one.
#define MOE_FWD_CELLS ((MOE_MAX_NODES - 1) * MOE_MAX_PIECES)

// Device counters of one plan, zero between launches (the last CTA resets them). A CTA takes its
// role by arrival (ARRIVE) and every piece of work is claimed (CLAIM_*, RUN, TILE, RET), so any
// resident subset of the grid finishes (docs/MOE.md "Residency"): HIST and ORDER count the chunks
// counted and ranked, SENT and RETURNED the rows sent and returned, PLAN is step 3's verdict,
// FWD_CLAIM the forwarded tokens' chunks of sums claimed (fused combine, between nodes).
enum {
  MOE_CNT_HIST = 0,
  MOE_CNT_SENT = 1,
  MOE_CNT_DONE = 2,
  MOE_CNT_ORDER = 3,
  MOE_CNT_PLAN = 4,
  MOE_CNT_TILE = 5,
  MOE_CNT_RET = 6,
  MOE_CNT_GEMM_DONE = 7,
  MOE_CNT_ARRIVE = 8,
  MOE_CNT_CLAIM_HIST = 9,
  MOE_CNT_CLAIM_ORDER = 10,
  MOE_CNT_RUN = 11,
  MOE_CNT_RETURNED = 12,
  MOE_CNT_FWD_CLAIM = 13,
  MOE_CNT_WORDS = 14
};

// MkStatus::where of the errors the kernels detect in their inputs (MK_ERR_INPUT).
enum { MOE_ERR_CAPACITY = 1, MOE_ERR_EXPERT_ID = 2 };

struct MkMoeArgs {
  MkSync sync;
  const unsigned long long* peer_base;  // the communicator's peer_table (workspace base per rank)
  // Symmetric workspace (offsets into every rank's workspace).
  unsigned long long counts_off;  // u32 [W][MOE_ROW_WORDS(E)]: row s, written by rank s
  unsigned long long cflag_off;  // u32 [W]: count row s arrived (epoch)
  unsigned long long recv_off;  // 16-bit [capacity][H]: rows received, by expert, then origin class (own-origin
      // first; between nodes forwarded rows after them), then source, then pair
  unsigned long long meta_off;  // u32 [capacity]: (source << 24) | (t * k + j) of each received row
  unsigned long long rflag_off;  // u32 [W]: every row from rank s arrived (epoch)
  unsigned long long ret_off;  // 16-bit [capacity][H]: combine: this rank's pairs' rows, at t * k + j
  unsigned long long retflag_off;  // u32 [W]: every row returned by rank s arrived (epoch)
  unsigned long long eflag_off;  // u32 [2][W][E_local]: every row of class c from rank s to local expert le arrived
  // Local device memory.
  const void* x;  // dispatch: [T, H] tokens (16-bit), row stride ldx
  const int* topk_ids;  // [T, k] global expert ids
  const float* topk_w;  // combine: [T, k] weights
  void* out;  // dispatch: [capacity, H] received rows; combine: [T, H]
  const void* y;  // combine: [capacity, H] rows to return (as received), row stride ldy
  int* send_order;  // [capacity] scratch: this rank's pair indices in send order
  unsigned int* esent;  // [2][E] scratch, zero between launches: rows sent per origin class and expert
  unsigned int* hist;  // [chunks][E] scratch: pairs per expert in each chunk of pairs
  int* group_rows;  // [E_local]: rows received per local expert (the grouped GEMM's counts)
  int* received;  // [1]: rows received in all (combine reads it)
  unsigned int* counters;  // MOE_CNT_WORDS words, zero between launches
  long long ldx, ldo, ldy;  // row strides (elements)
  int T, H, k, E;  // this rank's tokens, hidden size, experts per token, global experts
  int e_local, world, me, capacity;
  // Between nodes (moe_nodes.cu, docs/MOE.md "Between nodes"): the kernels above run on the node's
  // ranks (world, me, E: the node's), over virtual tokens: this rank's T, then the tokens of the
  // same-index ranks of the other nodes that it forwards (segment i: vseg[i] .. vseg[i + 1], rows at
  // xfwd + i * fwd_rows); topk_ids / topk_w are then the virtual pairs' (-1: not this node's).
  const unsigned int* vseg;  // [MOE_VSEG_WORDS]: vseg[0] = T, vseg[nseg] = virtual tokens, then pieces
  const void* xfwd;  // forwarded rows (16-bit, H per row)
  long long fwd_rows;  // rows per forwarded segment
  int nseg;  // forwarded segments (nodes - 1); 0 inside one node
  int partial_out;  // combine: out is fp32 [virtual tokens, H] partials (ldo in floats)
  // Between nodes, dispatch: a forwarded row is sent once the piece of its bundle that holds it is in
  // (a proxy flag), after this rank's own ones (docs/MOE.md "Overlap"); the exchange's epoch is in xepoch[0].
  const unsigned int* vown;  // [E]: this rank's own pairs per node expert (the exchange's count)
  const unsigned int* xepoch;  // [1]: the epoch of the exchange's proxy flags
  unsigned int* tile_order;  // fused GEMM: its M-tiles in claim order (own-origin-only ones of every group first)
  struct MkQueue queue;  // the proxy's queue (flag ids relative to the node plan's block)
  const unsigned int* pflags;  // the node plan's proxy flags (MOE_PF_*)
  int node;  // this rank's node (global rank = node * world + me)
  int tile_m;  // fused GEMMs: their M-tile's rows; 0: the engine's order (no tile_order)
  // Between nodes, the fused GEMM + combine sends the forwarded tokens' sums itself (send_sums): once
  // fwdret counts every row of a piece's tokens back, chunks of them are summed into part (16-bit rows),
  // each group of sums_group chunks WRITten to its source's precv once summed (docs/MOE.md "Overlap").
  unsigned long long part_off;  // the node plan's part (as out: fp32 rows of this rank's tokens, then 16-bit)
  unsigned long long precv_off;  // the node plan's precv [N - 1][fwd_rows][H] at the sources
  unsigned long long fwdret_off;  // u32 [MOE_MAX_PIECES]: forwarded rows back here per piece of their expert
  int send_sums;  // 1: the fused GEMM + combine between nodes (the partials kernel then only adds)
  int sums_group;  // chunks of forwarded sums per WRITE (consecutive; the last group's CTA sends it)
  unsigned int* fwdgrp;  // [chunks / sums_group + MOE_FWD_CELLS]: chunks summed per group (zeroed by the last CTA)
  int pieces;  // between nodes: a bundle's rows cross in that many WRITEs (1..MOE_MAX_PIECES; the plan's)
};
