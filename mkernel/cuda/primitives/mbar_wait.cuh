#pragma once
// Pipeline waits (mbarriers inside one CTA) with the protocol's deadline. They can only hang on a
// bug (a TMA that never lands, a miscounted arrival), but a hung kernel takes the process and its
// peers with it, so they too give up after the communicator's timeout: the first such wait records
// MK_ERR_TIMEOUT (peer -1, where = the caller's wait id, expected = the parity) and returns; so do
// later waits of any CTA once an error is recorded. The kernel then runs to its end on garbage and
// the host raises the error instead of returning the result; producers never arm a stage whose
// last TMA bytes have not landed (mbar_can_arm). The fast path is one try_wait.
#include "tma.cuh"
#include "signals.cuh"

// Wait ids (MkStatus::where) of the pipeline waits, per kernel family.
enum : u32 { MK_WAIT_FULL = 0xF000u, MK_WAIT_EMPTY = 0xF100u, MK_WAIT_TILE = 0xF200u, MK_WAIT_LANDED = 0xF300u };

// True: the phase completed; false: the wait gave up (an error is recorded).
template <bool CLUSTER_SCOPE = false>
MK_DEV bool mbar_wait_timed(u32 bar, u32 parity, const MkSync& s, u32 where) {
  if (mbar_try_wait<CLUSTER_SCOPE>(bar, parity)) return true;
  const u64 start = globaltimer_ns();
  for (;;) {
#pragma unroll 1  // a cold path: keep it small
    for (u32 i = 0; i < MK_POLL_BATCH; ++i)
      if (mbar_try_wait<CLUSTER_SCOPE>(bar, parity)) return true;
    if (error_recorded(s)) return false;
    const u64 waited = globaltimer_ns() - start;
    if (waited > s.timeout_ns) {
      record_error(s, MK_ERR_TIMEOUT, -1, where, parity, 0, waited);
      return false;
    }
  }
}

// Before a producer arms `full` (arrive.expect_tx) again: the phase it armed last has completed.
// Consumers that gave up (an error) release stages whose bytes are still landing, and a second
// arrival in a phase that awaits bytes traps the GPU. The fast path is one try_wait; the bytes land
// within microseconds, so the wait is bounded and holds even with an error recorded.
constexpr u64 MK_LANDED_NS = 100000000ull;
MK_DEV bool mbar_wait_landed(u32 full, u32 parity) {
  if (mbar_try_wait<false>(full, parity)) return true;
  const u64 start = globaltimer_ns();
  while (globaltimer_ns() - start < MK_LANDED_NS)
    if (mbar_try_wait<false>(full, parity)) return true;
  return false;
}

// A producer's check before arming `full` for a phase of parity parity ^ 1: false (and an error
// recorded) when the previous phase's bytes never landed; the stage must then not be armed.
MK_DEV bool mbar_can_arm(u32 full, u32 parity, const MkSync& s, u32 where) {
  if (mbar_wait_landed(full, parity)) return true;
  record_error(s, MK_ERR_TIMEOUT, -1, where, parity, 0, MK_LANDED_NS);
  return false;
}

// A producer leaving after `uses` arms of the ring of barriers full[0..stages) (8 bytes apart, use
// j on full[j % stages]): their bytes have landed, so no CTA exits while TMA writes its shared memory.
MK_DEV void mbar_drain_landed(u32 full0, u32 stages, u32 uses) {
  for (u32 j = uses > stages ? uses - stages : 0u; j < uses; ++j)
    mbar_wait_landed(full0 + 8u * (j % stages), (j / stages) & 1u);
}
