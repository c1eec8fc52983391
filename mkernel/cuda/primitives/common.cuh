#pragma once
// Types and small device helpers shared by every mkernel source. Only mkernel's own headers are
// included (no system headers): NVRTC receives exactly the files the kernel cache hashes.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

#define MK_DEV __device__ __forceinline__

// Input element types of the GEMM and attention kernels.
enum { MK_DT_BF16 = 0, MK_DT_F16 = 1 };
#define MK_STATIC_ASSERT(cond, msg) static_assert(cond, msg)

// Registers a CTA of `threads` threads (launch bounds (threads, 1)) owns: ptxas gives every thread
// floor(65536 / threads) rounded down to a multiple of 8, and setmaxnreg can only redistribute that
// pool. Warpgroup budgets that add up to more make setmaxnreg.inc wait forever.
__host__ __device__ constexpr int mk_cta_register_pool(int threads) { return ((65536 / threads) & ~7) * threads; }

MK_DEV u64 globaltimer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

MK_DEV u32 sm_id() {
  u32 id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// Programmatic dependent launch (a kernel launched overlapped, runtime/launch.py): wait blocks until
// the kernels before it in the stream completed and their writes are visible (a no-op otherwise).
MK_DEV void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// The next kernel, if launched overlapped, may start once every CTA of this one ran this or ended.
MK_DEV void griddep_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;"); }

// Memory-model primitives. System scope reaches peer GPUs over NVLink and mapped host memory.
MK_DEV u32 ld_acquire_sys(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
MK_DEV u64 ld_acquire_sys64(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
MK_DEV u32 ld_relaxed_sys(const u32* p) {
  u32 v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
MK_DEV void st_release_sys(u32* p, u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
MK_DEV void st_release_sys64(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
MK_DEV void st_relaxed_sys(u32* p, u32 v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
MK_DEV u32 atom_add_release_sys(u32* p, u32 v) {
  u32 old;
  asm volatile("atom.add.release.sys.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
MK_DEV void fence_sys() { asm volatile("fence.sc.sys;" ::: "memory"); }
MK_DEV void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
MK_DEV void fence_acq_rel_cta() { asm volatile("fence.acq_rel.cta;" ::: "memory"); }

// A 16-byte global store (peer memory over NVLink included).
MK_DEV void st_v4(void* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Packs two floats as bf16x2 (DT 0) / f16x2 (DT 1), rounded to nearest: the first in the low half.
template <int DT>
MK_DEV u32 pack2(float lo, float hi) {
  u32 r;
  if (DT == 0)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Wrap-safe comparison of 32-bit epochs: true when a is at or after b.
MK_DEV bool epoch_reached(u32 a, u32 b) { return (i32)(a - b) >= 0; }
