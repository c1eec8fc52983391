#pragma once
// The argument struct of the attention kernels, shared with Python (mkernel/engines/attention.py mirrors it
// with ctypes; tests/cpu/test_attention.py compiles this header with the host g++ and compares the
// layouts). Plain fixed-width fields only, so that a host C++ compiler reads it too.
#include "sync_args.cuh"
#include "gemm_args.cuh"  // TmaDesc, MkGemmSched (the tile counters and role words are shared)

// Global position of local row / key i: i + (i < half ? off0 : off1), increasing in i. Causal
// masking compares positions: a query sees a key iff key position <= query position. The plain
// engine uses one segment (half = INT_MAX): queries at i + causal_offset, keys at j; ring
// attention's zigzag layout uses two (a rank's two chunks of the global sequence).
struct MkAttnPos {
  int half;
  int off0;
  int off1;
  int pad;
};

struct MkAttnArgs {
  TmaDesc q;  // Q [B, S_q, H_q, D] as dims {D, S_q, H_q, B}, box {64, 128, 1, 1}, 128B swizzle
  TmaDesc k;  // K [B, S_kv, H_kv, D] as dims {D, S_kv, H_kv, B}, box {64, BLOCK_N, 1, 1}
  TmaDesc v;  // V, as K
  TmaDesc o;  // O [B, S_q, H_q, D] as dims {D, S_q, H_q, B}, box {64, 64, 1, 1} (one warpgroup's rows)
  MkSync sync;
  // Tiles are (batch, head, 128-query block); the scheduler's tile_counter / done_count / roles
  // serve as in the GEMM (tile_order: nullable list of tile ids in run order; num_tiles set here).
  MkGemmSched sched;
  float* lse;  // nullable: [B, H_q, S_q] fp32, natural-log log-sum-exp of the scaled scores
  int batch;
  int heads_q;
  int heads_kv;  // heads_q is a multiple of it (grouped-query attention)
  int seq_q;
  int seq_kv;
  unsigned int q_blocks;  // ceil(seq_q / 128)
  float scale_log2;  // softmax scale * log2(e)
  float scale;  // softmax scale
  MkAttnPos qpos;  // causal: positions of the queries
  MkAttnPos kpos;  // causal: positions of the keys (ring attention: per step, in the tile)
  // (704 bytes: a multiple of 64, the TmaDesc alignment, with no tail padding)
};
