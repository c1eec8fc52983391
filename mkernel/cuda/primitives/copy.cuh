#pragma once
// The kernels' one 16-byte copy loop: every copy of rows, tiles, chunks and spans between this
// rank's memory and its peers' goes through copy_vectors (the MoE kernels' TMA bulk copies aside).
#include "common.cuh"

// 16-byte global load through L2 (.cg): data a peer wrote is never read from a stale L1 line.
MK_DEV uint4 ld_cg_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// Vectors [0, n) by a group of nthr threads (tid in [0, nthr)): x = 16 bytes at src(v), then
// store(v, x). Each thread issues U loads before it stores the first: with one load in flight a
// copy is latency-bound (10-13 GB/s a CTA).
template <u32 U, class Src, class Store>
MK_DEV void copy_vectors(u32 n, u32 tid, u32 nthr, Src src, Store store) {
  for (u32 v0 = tid; v0 < n; v0 += U * nthr) {
    uint4 x[U];
#pragma unroll
    for (u32 u = 0; u < U; ++u)
      if (v0 + u * nthr < n) x[u] = ld_cg_v4(src(v0 + u * nthr));
#pragma unroll
    for (u32 u = 0; u < U; ++u)
      if (v0 + u * nthr < n) store(v0 + u * nthr, x[u]);
  }
}

// A contiguous span of `bytes` (a multiple of 16).
template <u32 U>
MK_DEV void copy_span(u8* dst, const u8* src, u64 bytes, u32 tid, u32 nthr) {
  copy_vectors<U>((u32)(bytes / 16), tid, nthr, [&](u32 v) { return src + (u64)v * 16; },
                  [&](u32 v, uint4 x) { st_v4(dst + (u64)v * 16, x); });
}
