#pragma once
// The kernels' one 16-byte copy loop: every copy of rows, tiles, chunks and spans between this
// rank's memory and its peers' goes through copy_vectors (the MoE kernels' TMA bulk copies aside),
// its data in registers or, where a CTA has shared memory to spare, staged there (MkStage).
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

// 16 bytes global -> shared through L2 (cp.async.cg, as ld_cg_v4 reads), zero-filled when !in (no
// bytes read then): the data in flight takes no registers. After cp_async_commit, cp_async_wait<N>
// leaves at most N of this thread's groups in flight; the landed ones are visible to it.
MK_DEV void cp_async_16(u32 dst, const void* src, bool in = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(in ? 16 : 0) : "memory");
}
MK_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
MK_DEV void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
MK_DEV uint4 lds_v4(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// Shared memory that copy loops stage vectors in (bytes 0: none). Slot (u, tid) of a group of nthr
// threads is addr + (u * nthr + tid) * 16: a thread reads back only what it staged, so no barrier.
struct MkStage {
  u32 addr, bytes;
  MK_DEV u32 per(u32 nthr, u32 lanes = 1) const { return bytes / (16u * nthr * lanes); }  // slots a thread has
  MK_DEV u32 slot(u32 u, u32 tid, u32 nthr) const { return addr + (u * nthr + tid) * 16u; }
};

// The staged sources of one vector of a thread: at(q) reads source q (stage_vectors).
struct MkStaged {
  MkStage st;
  u32 per, u, tid, nthr;
  MK_DEV uint4 operator()(u32 q) const { return lds_v4(st.slot(q * per + u, tid, nthr)); }
};

// Vectors [0, n) of `lanes` sources each (src(q, v): source q of vector v), by a group of nthr
// threads through `st`, which must hold per = st.per(nthr, lanes) >= 1 vectors of every source a
// thread: each thread stages per vectors' sources (cp.async), then use(v, at) reads source q as at(q).
template <class Src, class Use>
MK_DEV void stage_vectors(MkStage st, u32 lanes, u32 n, u32 tid, u32 nthr, Src src, Use use) {
  const u32 per = st.per(nthr, lanes);
  for (u32 v0 = tid; v0 < n; v0 += per * nthr) {
    const u32 cnt = min(per, (n - v0 + nthr - 1) / nthr);
    for (u32 u = 0; u < cnt; ++u)
      for (u32 q = 0; q < lanes; ++q) cp_async_16(st.slot(q * per + u, tid, nthr), src(q, v0 + u * nthr));
    cp_async_commit();
    cp_async_wait<0>();
    for (u32 u = 0; u < cnt; ++u) use(v0 + u * nthr, MkStaged{st, per, u, tid, nthr});
  }
}

// copy_vectors through `st` where it holds at least one vector a thread (stage_vectors), otherwise
// U a thread in registers.
template <u32 U, class Src, class Store>
MK_DEV void copy_vectors(MkStage st, u32 n, u32 tid, u32 nthr, Src src, Store store) {
  if (st.per(nthr) == 0) return copy_vectors<U>(n, tid, nthr, src, store);
  stage_vectors(
      st, 1, n, tid, nthr, [&](u32, u32 v) { return src(v); }, [&](u32 v, const MkStaged& at) { store(v, at(0)); });
}

// A contiguous span of `bytes` (a multiple of 16).
template <u32 U>
MK_DEV void copy_span(u8* dst, const u8* src, u64 bytes, u32 tid, u32 nthr) {
  copy_vectors<U>((u32)(bytes / 16), tid, nthr, [&](u32 v) { return src + (u64)v * 16; },
                  [&](u32 v, uint4 x) { st_v4(dst + (u64)v * 16, x); });
}
