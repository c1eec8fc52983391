#pragma once
// LL words: 4 bytes of data and the launch's epoch E in one 8-byte word (data in the low half),
// stored and loaded whole, so data and flag land together: no fence and no separate flag. A word
// whose high half is E was written by this launch (buffers are a plan's own, zeroed at first use).
#include "signals.cuh"
#include "convert.cuh"

#define LL_UNROLL 4  // LL words per thread in flight (pushes and sums)

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

// The fp32 sums, in rank order, of LL words i = i0 + u * step (u < U, i < n) of the W slots at
// base + s * slot_words (all of a rank's loads in flight before its first wait): two 16-bit values
// of DT a word (lo, hi), or one fp32 (F32: lo). False after a recorded error.
template <int DT, bool F32, int U = LL_UNROLL>
MK_DEV bool ll_sum(const MkSync& sync, const u64* base, u64 slot_words, u32 W, u64 i0, u64 step, u64 n, u32 E,
                   float (&lo)[U], float (&hi)[U]) {
  bool ok = true;
#pragma unroll
  for (int u = 0; u < U; ++u) lo[u] = hi[u] = 0.f;
  for (u32 s = 0; s < W && ok; ++s) {
    const u64* ll = base + s * slot_words;
    u64 x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) x[u] = i0 + u * step < n ? ll_load(ll + i0 + u * step) : 0;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const u64 i = i0 + u * step;
      if (i >= n) continue;
      ok = ok && ll_wait(sync, ll + i, E, (i32)s, (u32)i, x[u]);
      if constexpr (F32) {
        lo[u] += __uint_as_float((u32)x[u]);
      } else {
        float x0, x1;
        unpack2<DT>((u32)x[u], x0, x1);
        lo[u] += x0;
        hi[u] += x1;
      }
    }
  }
  return ok;
}
