#pragma once
// Flags, epochs, timeouts and the error word: the protocol every fused kernel follows.
//
// Epochs. Each communicator has one 32-bit epoch in device memory. A launch works in epoch
// E = *epoch + 1, read by every block at entry; the last block to leave stores E. Every flag a
// launch sets carries E, and every wait compares against E, so a flag left by an earlier launch
// (or an earlier replay of a captured graph) can never satisfy a wait. All ranks issue the same
// ops on a communicator in the same order, so their epochs advance in step.
//
// Timeouts. Every spin-wait has a deadline on %globaltimer. The first wait to expire (or any wait
// that sees an error already recorded) stops; the first recorded error wins and is mirrored to
// host memory, where the next call on the communicator (or comm.check()) raises it.
#include "common.cuh"
#include "sync_args.cuh"

// MK_ERR_INPUT: an input only the device can check was invalid (which one: `where`, per op).
enum : u32 { MK_ERR_NONE = 0, MK_ERR_TIMEOUT = 1, MK_ERR_PEER = 2, MK_ERR_ABORTED = 3, MK_ERR_INPUT = 4 };

// Spin iterations between two reads of the clock and of the error word.
constexpr u32 MK_POLL_BATCH = 64;

MK_DEV u32 launch_epoch(const MkSync& s) { return ld_relaxed_sys(s.epoch) + 1; }

MK_DEV bool error_recorded(const MkSync& s) { return ld_relaxed_sys(&s.status->code) != MK_ERR_NONE; }

// Records an error if none is recorded yet. Any thread may call it.
MK_DEV void record_error(const MkSync& s, u32 code, i32 peer, u32 where, u32 expected, u32 seen, u64 waited) {
  if (atomicCAS(&s.status->code, MK_ERR_NONE, code) != MK_ERR_NONE) return;
  MkStatus st;
  st.code = code;
  st.op = s.op;
  st.rank = s.rank;
  st.peer = peer;
  st.where = where;
  st.expected = expected;
  st.seen = seen;
  st.pad = 0;
  st.waited_ns = waited;
  s.status->op = st.op;
  s.status->rank = st.rank;
  s.status->peer = st.peer;
  s.status->where = st.where;
  s.status->expected = expected;
  s.status->seen = seen;
  s.status->waited_ns = waited;
  if (s.status_host) {
    volatile MkStatus* h = s.status_host;
    h->op = st.op;
    h->rank = st.rank;
    h->peer = st.peer;
    h->where = st.where;
    h->expected = expected;
    h->seen = seen;
    h->waited_ns = waited;
    __threadfence_system();
    h->code = code;  // published last: the host reads code first
    __threadfence_system();
  }
}

// Waits until the flag satisfies `done(value)`. Returns false (after recording a timeout, or on
// seeing another wait's error) instead of hanging.
template <typename Done>
MK_DEV bool wait_flag(const MkSync& s, const u32* flag, Done done, u32 expected, i32 peer, u32 where) {
  u32 v = ld_acquire_sys(flag);
  if (done(v)) return true;
  const u64 start = globaltimer_ns();
  for (;;) {
    for (u32 i = 0; i < MK_POLL_BATCH; ++i) {
      v = ld_acquire_sys(flag);
      if (done(v)) return true;
    }
    if (error_recorded(s)) return false;
    const u64 waited = globaltimer_ns() - start;
    if (waited > s.timeout_ns) {
      record_error(s, MK_ERR_TIMEOUT, peer, where, expected, v, waited);
      return false;
    }
    __nanosleep(64);  // lets a peer context sharing this GPU be scheduled
  }
}

// A data flag of this launch: set to exactly the launch's epoch.
MK_DEV bool wait_epoch(const MkSync& s, const u32* flag, u32 epoch, i32 peer, u32 where) {
  return wait_flag(s, flag, [epoch](u32 v) { return v == epoch; }, epoch, peer, where);
}

// A credit or counter: at or past the target.
MK_DEV bool wait_at_least(const MkSync& s, const u32* flag, u32 target, i32 peer, u32 where) {
  return wait_flag(s, flag, [target](u32 v) { return epoch_reached(v, target); }, target, peer, where);
}

// Data written before this by the calling thread is visible to whoever acquires the flag.
MK_DEV void set_flag(u32* flag, u32 value) { st_release_sys(flag, value); }

// An arrival that publishes what this thread observed (a bar.sync before it included: its CTA's
// stores) and acquires the earlier arrivals' (the last arrival reads what they wrote).
MK_DEV u32 atom_add_acq_rel_gpu(u32* p, u32 v) {
  u32 old;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// One thread per block, after its last use of `words` device counters (counters[done] counts the
// blocks): the last block of the grid zeroes them all for the next launch, so the host never does.
// Returns true in that last block.
MK_DEV bool counters_reset_by_last_block(unsigned int* counters, u32 words, u32 done) {
  __threadfence();
  const u32 n = gridDim.x * gridDim.y * gridDim.z;
  if (atomicAdd(&counters[done], 1u) != n - 1) return false;
  for (u32 i = 0; i < words; ++i) atomicExch(&counters[i], 0u);
  __threadfence();
  return true;
}

// Every block calls this once as its last act; the last one zeroes the op's `words` device
// counters (if any) and advances the epoch. Relaxed: the launch's end orders both before the next
// launch on the stream, and before the host's reads (after a synchronisation).
MK_DEV void launch_exit(const MkSync& s, u32 epoch, unsigned int* counters = nullptr, u32 words = 0) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const u32 nblocks = gridDim.x * gridDim.y * gridDim.z;
    if (atomicAdd(s.exit_count, 1u) == nblocks - 1) {
      for (u32 i = 0; i < words; ++i) counters[i] = 0;
      *s.exit_count = 0;
      st_relaxed_sys(s.epoch, epoch);
    }
  }
}
