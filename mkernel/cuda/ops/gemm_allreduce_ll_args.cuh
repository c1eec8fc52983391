#pragma once
// The argument structs of gemm_allreduce's fused latency path (gemm_allreduce_ll.cu), shared with
// Python (mkernel/ops/gemm_allreduce_ll.py mirrors them with ctypes; a CPU test compares layouts).
#include "sync_args.cuh"
#include "gemm_decode_args.cuh"

// An LL word (8 bytes, stored and loaded whole): two 16-bit values (tokens 2p, 2p + 1 of one
// output column) in the low half, the launch's epoch in the high half: data and flag arrive together.
// Plan counters (zero between launches: the reduce kernel's last block resets them).
#define LL_CNT_ENTER 0  // decode CTAs started (the first announces this rank's credit)
#define LL_CNT_WORDS 1
#define LL_REDUCE_THREADS 512
// Trace span ids (tools/ll_phases.py): a push CTA's credit waits for a finished row block; a
// reduce block's entry (ORed with the epoch; a push CTA's entry carries the epoch alone).
#define LL_TRACE_PUSH 0x200u
#define LL_TRACE_REDUCE 0x40000000u

struct MkDecodePushArgs {
  MkDecodeArgs g;  // the decode GEMM (g.out unused; g.sync the op's)
  const unsigned long long* peer_base;  // the node's workspace bases
  unsigned long long ll_off;  // [world][pairs][n] LL words in every rank's workspace (the plan's own)
  unsigned int* counters;  // [LL_CNT_WORDS]
  int pairs;  // token pairs: ceil(m / 2)
  int world;
  int me;
  unsigned int pad[7];
};

struct MkAllreduceLLArgs {
  MkSync sync;
  const unsigned long long* peer_base;
  unsigned long long ll_off;
  void* out;  // [m, n] of the input dtype, row stride ldo elements
  unsigned int* counters;  // [LL_CNT_WORDS], the same as the push's
  long long ldo;
  int m;
  int n;
  int pairs;
  int world;
  int me;
  unsigned int pad;
};
