#pragma once
// Pipeline waits (mbarriers inside one CTA) with the protocol's deadline. They can only hang on a
// bug (a TMA that never lands, a miscounted arrival), but a hung kernel takes the process and its
// peers with it, so they too give up after the communicator's timeout: the first such wait records
// MK_ERR_TIMEOUT (peer -1, where = the caller's wait id, expected = the parity) and returns; so do
// later waits of any CTA once an error is recorded. The kernel then runs to its end on garbage and
// the host raises the error instead of returning the result. The fast path is one try_wait.
#include "tma.cuh"
#include "signals.cuh"

// Wait ids (MkStatus::where) of the pipeline waits, per kernel family.
enum : u32 { MK_WAIT_FULL = 0xF000u, MK_WAIT_EMPTY = 0xF100u, MK_WAIT_TILE = 0xF200u };

template <bool CLUSTER_SCOPE = false>
MK_DEV void mbar_wait_timed(u32 bar, u32 parity, const MkSync& s, u32 where) {
  if (mbar_try_wait<CLUSTER_SCOPE>(bar, parity)) return;
  const u64 start = globaltimer_ns();
  for (;;) {
#pragma unroll 1  // a cold path: keep it small
    for (u32 i = 0; i < MK_POLL_BATCH; ++i)
      if (mbar_try_wait<CLUSTER_SCOPE>(bar, parity)) return;
    if (error_recorded(s)) return;
    const u64 waited = globaltimer_ns() - start;
    if (waited > s.timeout_ns) {
      record_error(s, MK_ERR_TIMEOUT, -1, where, parity, 0, waited);
      return;
    }
  }
}
