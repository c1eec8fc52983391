#pragma once
// The argument struct of the decode GEMM (gemm_decode.cu), shared with Python
// (mkernel/engines/gemm_decode.py mirrors it with ctypes; a CPU test compares the layouts).
// Plain fixed-width fields only, so that a host C++ compiler reads it too.

// Rows of B (output columns) one CTA covers: 8 warps of 16.
#define MK_DECODE_ROWS 128
#define MK_DECODE_THREADS 256

struct MkDecodeArgs {
  const void* a;  // [m, k] rows contiguous, row stride lda elements (the tokens)
  const void* b;  // [n, k] rows contiguous, row stride ldb elements (the weights, w as stored)
  void* out;  // [m, n] row stride ldc elements
  float* partial;  // splits > 1: [splits][m][n] fp32 partial sums (transient)
  unsigned int* counts;  // splits > 1: [token groups][ceil(n / MK_DECODE_ROWS)] arrivals, zero between launches
  long long lda;
  long long ldb;
  long long ldc;
  int m;
  int n;
  int k;
  int splits;  // K ranges, one per blockIdx.y
  int k_split;  // elements of K per range (a multiple of 32 x the unroll)
  unsigned int epi_op;  // MK_EPI_STORE or MK_EPI_ADD (gemm_args.cuh)
  unsigned int pad[2];
};
