#pragma once
// Arguments of the runtime's protocol kernels (runtime_test.cu); mirrored in mkernel/runtime_test.py.
#include "sync_args.cuh"

struct RuntimeTestArgs {
  MkSync sync;
  const unsigned long long* peers;  // workspace base of every rank of the node (device table)
  unsigned long long flags_off;  // offset of this test's flag area in every workspace
  unsigned long long slots_off;  // offset of the slots: [local_size senders][words] u32
  unsigned int* mismatches;  // device counter of words that arrived wrong
  unsigned int* first_mismatch;  // device [5]: set, epoch, sender, index, value seen (the first one)
  unsigned int* host_area;  // litmus over mapped host memory: [words] data, then flag, ack
  unsigned int local_size;
  unsigned int local_rank;
  unsigned int words;  // per slot
  unsigned int rounds;  // ping-pong round trips, or litmus rounds
  unsigned int consume_delay_ns;  // this rank waits this long before reading what arrived
  unsigned int skip_credit;  // negative control: senders ignore credits (overwrites expected)
};
