#pragma once
// The argument struct of the fused tensor-parallel kernels (GEMM+ReduceScatter, GEMM+AllReduce,
// AllGather+GEMM), shared with Python (mkernel/tp.py mirrors it with ctypes; tests/test_tp_compile.py
// compares the two layouts with g++). Plain fixed-width fields only.
#include "gemm_args.cuh"

// Ranks of one node a fused TP op supports (one output tensor map per destination block).
#define TP_MAX_WORLD 8

// Fused ops (the OP template parameter of the kernels).
enum { TP_OP_RS = 0, TP_OP_AR = 1, TP_OP_AG = 2 };

// Device counters of one (op, shape) plan, zero between launches (the last CTA resets them).
enum { TP_CNT_TILE = 0, TP_CNT_DONE = 1, TP_CNT_REDUCE = 2, TP_CNT_COPY = 3, TP_CNT_PUSH = 4, TP_CNT_WORDS = 8 };

struct TpArgs {
  // The GEMM engine's arguments: a (TMA map of A: the local A for RS/AR, the gathered-A buffer
  // for AG), b, sync, k, n; c is set to dst[0] (prefetched by gemm_setup, never stored through).
  MkGemmArgs g;
  // Destination of the tiles of row block o (TMA store maps, box {64 cols, 16 rows}, 128B swizzle,
  // rows [0, mb) of the block): RS/AR: rank o's receive slot for this sender; AG: out rows of block o.
  TmaDesc dst[TP_MAX_WORLD];
  const unsigned long long* peer_base;  // the communicator's peer_table (workspace base per local rank)
  unsigned long long recv_off;   // RS/AR: partials [W senders][mb][n] (input dtype)
  unsigned long long rflag_off;  // RS/AR: partial-tile flags [W senders][tiles_blk]
  unsigned long long gath_off;   // AR: reduced tiles [W owners][mb][n]
  unsigned long long gflag_off;  // AR: reduced-tile flags [W owners][tiles_blk]
  unsigned long long ga_off;     // AG: gathered A [W * mb][k]
  unsigned long long aflag_off;  // AG: chunk flags [W senders][chunks_blk]
  void* out;                     // RS: [mb, n]; AR, AG: [W * mb, n]
  const void* a_local;           // AG: this rank's shard [mb, k]
  unsigned int* counters;        // TP_CNT_WORDS device words, zero between launches
  long long ldo;                 // out row stride (elements)
  long long lda;                 // AG: a_local row stride (elements)
  int world;                     // ranks (== local ranks: one node)
  int me;                        // this rank's index
  int mb;                        // rows of one row block (M / world)
  int tiles_mb;                  // ceil(mb / 128)
  int tiles_n;                   // ceil(n / 256)
  int gemm_ctas;                 // CTAs [0, gemm_ctas) run GEMM tiles; the rest communicate
  int join;                      // RS / AR: GEMM CTAs' consumers join the reduction after their tiles
  int pad;                       // explicit tail: sizeof is a multiple of 64
};
