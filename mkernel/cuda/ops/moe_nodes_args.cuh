#pragma once
// The argument struct of the MoE kernels between nodes (mkernel/cuda/ops/moe_nodes.cu), shared with
// Python (mkernel/ops/moe_nodes.py mirrors it; tests/cpu/test_moe.py compares the layouts with g++).
// Ranks are node-major: rank = node * local + lrank; between nodes only ranks of the same lrank talk.
#include "sync_args.cuh"
#include "queue_layout.cuh"
#include "moe_args.cuh"

// Words of a rank's global count row: pairs per global expert, its tokens, its pairs with an expert
// id out of range, then per node j the tokens with a pair on node j (the bundle it sends there).
#define MOE_GROW_T(E) (E)
#define MOE_GROW_BAD(E) ((E) + 1)
#define MOE_GROW_BUNDLE(E, j) ((E) + 2 + (j))
#define MOE_GROW_WORDS(E) ((E) + 2 + MOE_MAX_NODES)

// Counters of one plan (zero between launches): the exchange's CTAs done staging, the CTAs done.
enum { MOE_NCNT_STAGED = 0, MOE_NCNT_DONE = 1, MOE_NCNT_ARRIVE = 2, MOE_NCNT_WORDS = 3 };

struct MkMoeNodeArgs {
  MkSync sync;
  const unsigned long long* peer_base;  // the node's workspaces (the communicator's peer_table)
  struct MkQueue queue;  // the proxy's queue, flag ids relative to this plan's block
  unsigned int* pflags;  // this plan's proxy flags (mapped host memory), MOE_PF_*
  // Symmetric workspace (offsets into every rank's workspace). Segment i of a [N - 1] array: the
  // i-th other node in node order.
  unsigned long long gcounts_off;  // u32 [W][MOE_GROW_WORDS(E)]: row s, written by rank s
  unsigned long long gcflag_off;  // u32 [W]: row s of a same-node rank arrived (epoch)
  unsigned long long xsend_off;  // 16-bit [N - 1][fwd_rows][H]: this rank's tokens for each other node
  unsigned long long dsend_off;  // u32 [N - 1][fwd_rows][2k]: their ids there (node-local, -1: not there), weights
  unsigned long long xrecv_off;  // 16-bit [N - 1][fwd_rows][H]: the tokens this rank forwards, per source node
  unsigned long long drecv_off;  // u32 [N - 1][fwd_rows][2k]
  unsigned long long part_off;  // the node's weighted sums of the virtual tokens: T fp32 rows, then 16-bit ones
  unsigned long long precv_off;  // 16-bit [N - 1][fwd_rows][H]: the other nodes' sums of this rank's tokens
  // Local device memory.
  const void* x;  // [T, H] (16-bit), row stride ldx
  const int* topk_ids;  // [T, k] global expert ids
  const float* topk_w;  // [T, k]
  void* out;  // partials kernel: [T, H] (16-bit), row stride ldo
  int* vids;  // [fwd_rows * k]: the virtual pairs' node-local expert ids (-1: another node's)
  float* vw;  // [fwd_rows * k]: their weights
  unsigned int* vseg;  // [MOE_VSEG_WORDS]: MkMoeArgs::vseg (segments, then their pieces)
  int* slots;  // [N - 1][fwd_rows]: token t's row in this rank's bundle to each other node (-1: none)
  unsigned int* verdict;  // [1]: MOE_PLAN_OK / MOE_PLAN_FAILED of the last exchange
  unsigned int* xepoch;  // [1]: the last exchange's epoch (MkMoeArgs::xepoch)
  unsigned int* vown;  // [E / nodes]: this rank's own pairs per expert of its node (MkMoeArgs::vown)
  unsigned int* part_total;  // [N]: tokens whose sums node j WRITes here, over this plan's launches (PART's target)
  unsigned int* counters;  // MOE_NCNT_WORDS, zero between launches
  long long ldx, ldo;
  int T, H, k, E;  // this rank's tokens, hidden size, experts per token, global experts
  int e_local, world, me, capacity;
  int node, nodes, local, lrank;
  int fwd_rows;  // capacity / k: tokens of one bundle, virtual tokens of one rank
  int sent;  // partials kernel: 1 if the fused combine sent the forwarded tokens' sums (else it sends them)
  int pieces;  // MkMoeArgs::pieces
};
