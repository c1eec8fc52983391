#pragma once
// The argument struct of the decode GEMM (gemm_decode.cu), shared with Python
// (mkernel/engines/gemm_decode.py mirrors it with ctypes; a CPU test compares the layouts).
// Plain fixed-width fields only, so that a host C++ compiler reads it too.
#include "gemm_args.cuh"

// Elements of K per stage (128 bytes of a row).
#define MK_DECODE_BK 64
// MkStatus.where of MK_ERR_INPUT: launched with less dynamic shared memory than DecodeCfg::SMEM
// (mkernel/runtime/sync.py DECODE_ERR_SMEM).
#define MK_DECODE_ERR_SMEM 3u
// Trace mode (tools/gemm_phases.py): warp 0's lane 0 stamps its CTA's phases per row block as
// MK_ROLE_COMPUTE spans of id MK_DECODE_TRACE | phase << 24 | row block (phases: MK_DECODE_PH_*).
#define MK_DECODE_TRACE 0x20000000u
#define MK_DECODE_PH_FILL 0u  // from the CTA's entry (later blocks: the last one's end) to its first stage landed
#define MK_DECODE_PH_MMA 1u  // to the block's last wgmma group complete
#define MK_DECODE_PH_PARTIAL 2u  // a shared block: its slot stored and the arrival counted
#define MK_DECODE_PH_OUT 3u  // the finished values handed to the epilogue (the last CTA: after the sum)
// MkDecodeArgs.flags: a finished block leaves through shared memory and one TMA store per warp
// (out_map; 16-bit outputs stored, not added; the host checks the map's alignment and the room).
#define MK_DECODE_TMA_OUT 1u

struct MkDecodeArgs {
  TmaDesc a_map;  // a [m, k] (the tokens): dims {k, m}, box {64, MT} (all the tokens), 128B swizzle
  TmaDesc b_map;  // b [n, k] (the weights as stored): dims {k, n}, box {64, ROWS}, 128B swizzle
  TmaDesc out_map;  // out [m, n] (flags & MK_DECODE_TMA_OUT): dims {n, m}, box {16, MT}, no swizzle
  MkSync sync;  // the pipeline waits' deadline and error word
  void* out;  // [m, n] row stride ldc elements
  float* partial;  // [row blocks][slots][MT x ROWS] fp32 partial sums of shared row blocks
  unsigned int* counts;  // [row blocks] arrivals, zero between launches
  long long ldc;
  int m;
  int n;
  int k;
  int kblocks;  // ceil(k / MK_DECODE_BK)
  int ctas;  // CTAs (gridDim.x): each takes an equal run of (row block, k-block) units
  int slots;  // partial slots per row block (at least its most contributing CTAs)
  unsigned int epi_op;  // MK_EPI_STORE or MK_EPI_ADD (gemm_args.cuh)
  unsigned int flags;  // MK_DECODE_TMA_OUT
  unsigned int pad[14];
};
