#pragma once
// Peers of the node and the credit rule that keeps a fast sender from overwriting a slow receiver.
//
// Every rank's workspace starts with a control area (symmetric.CONTROL_BYTES) whose first words are
// credits. When rank r enters launch E it sets word r of every peer's control area to E: r has then
// consumed everything it received in E-1. A sender writes into r's receive buffers in epoch E only
// after word r of its own control area is at least E.
#include "signals.cuh"

constexpr u32 MK_MAX_LOCAL = 64;  // ranks per node the control area has room for
constexpr u32 MK_CREDIT_WORDS = MK_MAX_LOCAL;

struct MkPeers {
  const u64* base;  // workspace base of every rank of the node (the communicator's peer_table)
  u32 size;  // ranks in the node
  u32 me;  // this rank's index in the node
};

template <typename T>
MK_DEV T* peer_ptr(const MkPeers& p, u32 rank, u64 offset) {
  return reinterpret_cast<T*>(p.base[rank] + offset);
}

// Thread-level: tell every peer this rank entered epoch E (at a launch's start, by one thread or
// more). Relaxed: a credit publishes no data; this rank's reads of E - 1 ended with that launch.
MK_DEV void credits_announce(const MkPeers& p, u32 E) {
  for (u32 r = 0; r < p.size; ++r) st_relaxed_sys(peer_ptr<u32>(p, r, 0) + p.me, E);
}

// Thread-level: wait until `rank` has entered epoch E, so its receive buffers may be written.
MK_DEV bool credits_wait(const MkSync& s, const MkPeers& p, u32 rank, u32 E) {
  const u32* credit = peer_ptr<u32>(p, p.me, 0) + rank;
  return wait_at_least(s, credit, E, (i32)rank, rank);
}
