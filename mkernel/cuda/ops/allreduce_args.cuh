#pragma once
// The argument struct of the one-shot all-reduce (allreduce.cu), shared with Python
// (mkernel/ops/allreduce.py mirrors it with ctypes; a CPU test compares the layouts).
#include "sync_args.cuh"

// Device counters (zero between launches: launch_exit's last block resets them).
#define AR_CNT_ITEM 0  // items claimed: every push item, then every reduce item
#define AR_CNT_PUSHED 1  // push items finished (in place: out may be written once all are)
#define AR_CNT_WORDS 2
#define AR_THREADS 512
#define AR_REDUCE_VECS 4  // output vectors a reducing thread sums at once (2 ranks' loads each in flight)

struct MkAllreduceArgs {
  MkSync sync;
  const unsigned long long* peer_base;  // the node's workspace bases (the communicator's peer table)
  unsigned long long slots_off;  // [world][slot_bytes] in every rank's scratch (LL: the plan's own LL words)
  unsigned long long flags_off;  // [world][chunks] u32, the plan's own (symmetric; LL: unused)
  const void* src;  // [count], 16-byte aligned
  void* out;  // [count], 16-byte aligned; may be src (in place)
  unsigned int* counters;  // [AR_CNT_WORDS]
  unsigned long long count;  // elements
  unsigned long long slot_bytes;  // one rank's slot: count elements, padded to 16 bytes (LL: 8 per 4 of data)
  unsigned int chunk;  // elements per chunk: a multiple of 8
  unsigned int chunks;
  int world;
  int me;
  unsigned int in_place;  // out == src: a CTA reduces only once every push of this rank is done
  unsigned int src_is_slot;  // src is this rank's own slot (written before the launch): no own push
  // Two-shot: chunk c is pushed to its owner c % world only, which sums it into out and into its
  // results row (slot row `world`) and sets its result flag (flags [world][chunks] then [chunks]);
  // every other rank copies the result from the owner's row.
  unsigned int twoshot;
  unsigned int pad;
};
