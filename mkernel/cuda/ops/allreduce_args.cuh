#pragma once
// The argument struct of the one-shot all-reduce (allreduce.cu), shared with Python
// (mkernel/ops/allreduce.py mirrors it with ctypes; a CPU test compares the layouts).
#include "sync_args.cuh"

// Device counters (zero between launches: the last CTA resets them).
#define AR_CNT_ENTER 0
#define AR_CNT_PUSH 1
#define AR_CNT_REDUCE 2
#define AR_CNT_DONE 3
#define AR_CNT_WORDS 4
#define AR_THREADS 512

struct MkAllreduceArgs {
  MkSync sync;
  const unsigned long long* peer_base;  // the node's workspace bases (the communicator's peer table)
  unsigned long long slots_off;  // [world][count] of the input dtype, in every rank's scratch
  unsigned long long flags_off;  // [world][chunks] u32, the plan's own (symmetric)
  const void* src;  // [count]
  void* out;  // [count]
  unsigned int* counters;  // [AR_CNT_WORDS]
  unsigned long long count;  // elements, a multiple of 8
  unsigned int chunk;  // elements per chunk, a multiple of 8
  unsigned int chunks;
  int world;
  int me;
  unsigned int pad[2];
};
