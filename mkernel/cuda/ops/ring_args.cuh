#pragma once
// The argument struct of the ring attention kernel, shared with Python (mkernel/ops/ring_attention.py
// mirrors it with ctypes; tests/cpu/test_ring_attention.py compares the layouts with g++).
#include "attn_args.cuh"
#include "queue_layout.cuh"

#define RING_MAX_WORLD 8

// Device counters of one plan (ring.counters), zero between launches (the last CTA resets them).
enum {
  RING_CNT_DONE = 0,  // CTAs finished
  RING_CNT_CLAIM = 1,  // [RING_MAX_WORLD] forwarding chunks claimed, per step
  RING_CNT_SENT = 1 + RING_MAX_WORLD,  // [RING_MAX_WORLD] forwarding chunks copied, per step
  RING_CNT_STEP = 1 + 2 * RING_MAX_WORLD,  // [RING_MAX_WORLD] tile halves merged (+1 forward), per step
  RING_CNT_ARRIVE = 1 + 3 * RING_MAX_WORLD,  // CTAs started (a CTA's role is its arrival rank)
  RING_CNT_WORDS = 2 + 3 * RING_MAX_WORLD
};

// Flags in the symmetric workspace (uint32 words at flags_off of every rank), set to the epoch.
enum {
  RING_FLAG_ARRIVED = 0,  // [step]: the key/value block of this step is in my slot
  RING_FLAG_FREE = RING_MAX_WORLD,  // [step]: the next rank is done with the slot of this step
  RING_FLAG_WORDS = 2 * RING_MAX_WORLD
};

struct MkRingArgs {
  MkAttnArgs a;  // the engine: q, o, this rank's own k / v (step 0), sync, sched, sizes
  TmaDesc k_slot[2];  // receive slots (symmetric workspace, [B, S, H_kv, D]): step s uses slot s % 2
  TmaDesc v_slot[2];
  const unsigned long long* peer_base;  // the communicator's peer_table
  unsigned long long kslot_off[2];  // symmetric offsets of the slots (the copy destinations)
  unsigned long long vslot_off[2];
  unsigned long long flags_off;  // RING_FLAG_WORDS words
  const void* k_own;  // this rank's k / v: rows (b, s) of H_kv * D contiguous elements
  const void* v_own;
  long long own_stride_b;  // bytes between batches of k_own / v_own
  long long own_stride_s;  // bytes between rows
  float* o_acc;  // [B, S, H_q, D] fp32: merged, unnormalised O of the steps so far
  float* m_acc;  // [B, H_q, S] fp32: merged maxima (log2 units, scaled)
  float* l_acc;  // [B, H_q, S] fp32: merged sums
  unsigned int* tile_flags;  // [tiles per step][2]: E * 16 + step after a half-tile's merge
  unsigned int* counters;  // RING_CNT_WORDS
  void* out;  // [B, S, H_q, D] of the input dtype (row-major: rows (b, s), heads, dims)
  long long out_stride_b;  // elements
  long long out_stride_s;  // elements
  int world;
  int me;
  int attn_ctas;  // CTAs that compute; the first grid - attn_ctas to arrive forward key/value blocks
  int zigzag;  // causal layout: a rank holds chunks me and 2 * world - 1 - me
  unsigned int tiles_per_step;
  unsigned int chunk_rows;  // rows (b, s) per forwarding chunk (next rank on this node)
  // Next or previous rank on another node: blocks travel as WRITE commands through the proxy.
  MkQueue queue;  // the communicator's proxy queue
  unsigned int* pflags;  // mapped host memory: this rank's proxy flags (RING_PF_*), set to the epoch
  unsigned long long stage_off;  // workspace offset of this rank's k | v (a WRITE source needs a region)
  int next_remote;
  int prev_remote;
  unsigned int chunks;  // WRITEs of a whole block (K's rows in chunk_bytes, then V's): the flags' stride per step
  unsigned int chunk_bytes;
  unsigned long long kv_bytes;  // bytes of one combined K | V block (2 * B * S * H_kv * D * 2)
  int local;  // ranks per node (node-major ring: rank = node * local + lrank)
  int lrank;  // this rank's index in its node (its peer_base entry)
  int comm_staged;  // forwarders stage their loads in shared memory (RING_STAGE_BYTES, ring_forward_cta)
  unsigned int src0_rows;  // rows (b, s) of rank 0's block sent on (ring_rows_sent)
  unsigned int pad[8];  // explicit tail: sizeof is a multiple of 64
};

// Trace span ids (MKERNEL_TRACE; tools/ring_trace.py): kind << 24 | step << 16 | item.
enum : unsigned int {
  RING_TRACE_ANNOUNCE = 0x80000000u,  // | epoch: the first forwarder entered
  RING_TRACE_EXIT = 0x40000000u,  // | block
  RING_TRACE_SEND = 0x01000000u,  // a chunk copied into the next rank (in a node) or its WRITE queued
  RING_TRACE_RECV = 0x02000000u,  // a chunk from another node landed (the receiver saw its flag)
  RING_TRACE_ARRIVED = 0x03000000u,  // a step's block is all here (ARRIVED set)
  RING_TRACE_FLUSH = 0x04000000u,  // a step's WRITEs landed there (FLUSH done)
  RING_TRACE_MERGE = 0x05000000u  // | tile: a half tile (consumer 0's) merged; from its merge wait
};

// Proxy flags (RingArgs::pflags): set by the neighbours' commands, or by this rank's FLUSHes.
enum {
  RING_PF_CREDIT = 0,  // the next rank entered the epoch
  RING_PF_FREE = 1,  // [step]: the next rank is done with that step's slot
  RING_PF_FLUSH = 1 + RING_MAX_WORLD,  // [step]: this rank's WRITEs of that step have landed
  RING_PF_CHUNK = 1 + 2 * RING_MAX_WORLD  // [(step - 1) * chunks + chunk]: a chunk of that step arrived
};
