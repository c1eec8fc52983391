#pragma once
// Trace mode: blocks append spans (role, id, start, end on %globaltimer) to a device buffer that
// mkernel/runtime/trace.py turns into Chrome trace JSON, one track per SM. Off, it costs one uniform branch.
#include "common.cuh"
#include "sync_args.cuh"

constexpr u32 MK_TRACE_WORDS = 4;  // start ns, end ns, sm << 32 | block, role << 32 | id

enum : u32 {
  MK_ROLE_COMPUTE = 0,
  MK_ROLE_INTRA = 1,
  MK_ROLE_SEND = 2,
  MK_ROLE_RECV = 3,
  MK_ROLE_WAIT = 4,
  MK_ROLE_CONTROL = 5
};

// A span's start: the clock when tracing, else 0 (no timer read).
MK_DEV u64 trace_start(const MkSync& s) { return s.trace_events ? globaltimer_ns() : 0ull; }

// A span that ended at end_ns (stamped earlier: writing one costs an atomic's round trip). Trace mode only.
MK_DEV void trace_span_at(const MkSync& s, u32 role, u32 id, u64 start_ns, u64 end_ns) {
  const u32 slot = atomicAdd(s.trace_count, 1u);
  if (slot >= s.trace_capacity) return;  // full: later spans are dropped, and the count says how many
  u64* e = s.trace_events + (u64)slot * MK_TRACE_WORDS;
  const u32 block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  e[0] = start_ns;
  e[1] = end_ns;
  e[2] = ((u64)sm_id() << 32) | block;
  e[3] = ((u64)role << 32) | id;
}

MK_DEV void trace_span(const MkSync& s, u32 role, u32 id, u64 start_ns) {
  if (s.trace_events == nullptr) return;
  trace_span_at(s, role, id, start_ns, globaltimer_ns());
}
