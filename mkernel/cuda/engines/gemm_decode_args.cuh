#pragma once
// The argument struct of the decode GEMM (gemm_decode.cu), shared with Python
// (mkernel/engines/gemm_decode.py mirrors it with ctypes; a CPU test compares the layouts).
// Plain fixed-width fields only, so that a host C++ compiler reads it too.
#include "gemm_args.cuh"

// Rows of B (output columns) one row block covers: 8 consumer warps of 16; K per stage (128 bytes).
#define MK_DECODE_ROWS 128
#define MK_DECODE_BK 64
#define MK_DECODE_CONSUMERS 256
#define MK_DECODE_THREADS 288  // the consumers, then one producer warp

struct MkDecodeArgs {
  TmaDesc a_map;  // a [m, k] (the tokens): dims {k, m}, box {64, MT}, 128B swizzle
  TmaDesc b_map;  // b [n, k] (the weights as stored): dims {k, n}, box {64, 128}, 128B swizzle
  MkSync sync;  // the pipeline waits' deadline and error word
  void* out;  // [m, n] row stride ldc elements
  float* partial;  // [groups][row blocks][slots][MT x 128] fp32 partial sums of shared row blocks
  unsigned int* counts;  // [groups][row blocks] arrivals, zero between launches
  long long ldc;
  int m;
  int n;
  int k;
  int kblocks;  // ceil(k / MK_DECODE_BK)
  int ctas;  // CTAs per token group (gridDim.y): each takes an equal run of (row block, k-block) units
  int slots;  // partial slots per row block (at least its most contributing CTAs)
  unsigned int epi_op;  // MK_EPI_STORE or MK_EPI_ADD (gemm_args.cuh)
  unsigned int pad[15];
};
