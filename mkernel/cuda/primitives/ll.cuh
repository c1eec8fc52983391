#pragma once
// LL words: 4 bytes of data and the launch's epoch E in one 8-byte word (data in the low half),
// stored and loaded whole, so data and flag land together: no fence and no separate flag. A word
// whose high half is E was written by this launch (buffers are a plan's own, zeroed at first use).
#include "signals.cuh"

MK_DEV u64 ll_word(u32 data, u32 E) { return (u64)E << 32 | data; }

MK_DEV void ll_store(u64* p, u64 w) { asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(w) : "memory"); }

MK_DEV u64 ll_load(const u64* p) {
  u64 w;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(w) : "l"(p) : "memory");
  return w;
}

MK_DEV bool ll_ready(u64 w, u32 E) { return (u32)(w >> 32) == E; }

// Waits until the word at p carries E (w: its last load); false after recording a timeout (or
// on another wait's error) instead of hanging.
MK_DEV bool ll_wait(const MkSync& s, const u64* p, u32 E, i32 peer, u32 where, u64& w) {
  if (ll_ready(w, E)) return true;
  const u64 start = globaltimer_ns();
  for (;;) {
    for (u32 i = 0; i < MK_POLL_BATCH; ++i) {
      w = ll_load(p);
      if (ll_ready(w, E)) return true;
    }
    if (error_recorded(s)) return false;
    const u64 waited = globaltimer_ns() - start;
    if (waited > s.timeout_ns) {
      record_error(s, MK_ERR_TIMEOUT, peer, where, E, (u32)(w >> 32), waited);
      return false;
    }
    __nanosleep(64);
  }
}
