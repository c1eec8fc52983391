#pragma once
// TMA (cp.async.bulk.tensor) loads, stores and reductions, and the mbarrier primitives that pace
// them. sm_90a PTX only; every function is a thin wrapper of one or two instructions.
#include "common.cuh"

MK_DEV u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// ---------------------------------------------------------------------------------- mbarriers
MK_DEV void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes barrier initialisation visible to the async proxy (TMA) and to other threads; follow it
// with a CTA barrier before any thread or TMA touches the barriers.
MK_DEV void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// Before the barrier's shared memory serves anything else (no arrival or transaction pending).
MK_DEV void mbar_inval(u32 bar) { asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(bar) : "memory"); }

MK_DEV void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
MK_DEV void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// CLUSTER_SCOPE: acquires what other CTAs of the cluster released with their arrivals (a tile they
// wrote into this CTA's shared memory); otherwise what this CTA's threads and TMA released.
template <bool CLUSTER_SCOPE = false>
MK_DEV bool mbar_try_wait(u32 bar, u32 parity) {
  u32 ok;
  if (CLUSTER_SCOPE)
    asm volatile(
        "{\n .reg .pred p;\n"
        " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
  else
    asm volatile(
        "{\n .reg .pred p;\n"
        " mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
  return ok != 0;
}
// Waits (with the protocol's deadline) are in mbar_wait.cuh. A freshly initialised barrier is in
// phase 0, so waiting for parity 1 returns at once (the producer's first pass over 'empty').

// ------------------------------------------------------------------------------------- proxies
// Generic-proxy writes to shared memory become visible to the async proxy (TMA store source).
MK_DEV void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Orders async-proxy global accesses (completed TMA stores) with later generic accesses.
MK_DEV void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

MK_DEV void tma_prefetch_desc(const void* desc) {
  asm volatile("prefetch.tensormap [%0];" ::"l"((u64)desc) : "memory");
}

// ---------------------------------------------------------------------------------- TMA loads
// Coordinates are element indices, innermost first. Out-of-bounds elements are zero filled and
// still count towards the transaction bytes of the barrier. Each wrapper expands the one load
// instruction with its dst, desc and bar: N dimensions, QUAL extra qualifiers, CRD the coordinate
// operands, TAIL operands after the barrier, then the asm inputs from %3 on.
#define MK_TMA_LOAD(N, QUAL, CRD, TAIL, ...)                                                                \
  asm volatile("cp.async.bulk.tensor." #N "d.shared::cluster.global.tile.mbarrier::complete_tx::bytes" QUAL \
               " [%0], [%1, " CRD "], [%2]" TAIL ";" ::"r"(dst),                                            \
               "l"((u64)desc), "r"(bar), __VA_ARGS__                                                        \
               : "memory")

MK_DEV void tma_load_2d(u32 dst, const void* desc, u32 bar, i32 c0, i32 c1) {
  MK_TMA_LOAD(2, "", "{%3, %4}", "", "r"(c0), "r"(c1));
}
MK_DEV void tma_load_3d(u32 dst, const void* desc, u32 bar, i32 c0, i32 c1, i32 c2) {
  MK_TMA_LOAD(3, "", "{%3, %4, %5}", "", "r"(c0), "r"(c1), "r"(c2));
}
// The same box delivered to every CTA of the cluster in cta_mask, at the same shared-memory offset
// in each, and completing the mbarrier at the same offset in each (bytes count in every receiver).
MK_DEV void tma_load_3d_multicast(u32 dst, const void* desc, u32 bar, i32 c0, i32 c1, i32 c2, u16 cta_mask) {
  MK_TMA_LOAD(3, ".multicast::cluster", "{%3, %4, %5}", ", %6", "r"(c0), "r"(c1), "r"(c2), "h"(cta_mask));
}
MK_DEV void tma_load_4d(u32 dst, const void* desc, u32 bar, i32 c0, i32 c1, i32 c2, i32 c3) {
  MK_TMA_LOAD(4, "", "{%3, %4, %5, %6}", "", "r"(c0), "r"(c1), "r"(c2), "r"(c3));
}
#undef MK_TMA_LOAD

// --------------------------------------------------------------------- TMA stores / reductions
// Out-of-bounds elements of the box are not written. Each wrapper expands the one store
// instruction with its desc and src: OP "cp" (store) or "cp.reduce" (reduction), N dimensions,
// QUAL extra qualifiers, CRD the coordinate operands, then the asm inputs from %2 on.
#define MK_TMA_STORE(OP, N, QUAL, CRD, ...)                                                    \
  asm volatile(OP ".async.bulk.tensor." #N "d.global.shared::cta" QUAL ".bulk_group [%0, " CRD \
                  "], [%1];" ::"l"((u64)desc),                                                 \
               "r"(src), __VA_ARGS__                                                           \
               : "memory")

MK_DEV void tma_store_2d(const void* desc, u32 src, i32 c0, i32 c1) {
  MK_TMA_STORE("cp", 2, "", "{%2, %3}", "r"(c0), "r"(c1));
}
MK_DEV void tma_store_4d(const void* desc, u32 src, i32 c0, i32 c1, i32 c2, i32 c3) {
  MK_TMA_STORE("cp", 4, "", "{%2, %3, %4, %5}", "r"(c0), "r"(c1), "r"(c2), "r"(c3));
}
// Element-wise add of the box into global memory (type from the tensor map: bf16, f16 or f32).
MK_DEV void tma_add_2d(const void* desc, u32 src, i32 c0, i32 c1) {
  MK_TMA_STORE("cp.reduce", 2, ".add.tile", "{%2, %3}", "r"(c0), "r"(c1));
}
#undef MK_TMA_STORE
// ------------------------------------------------------------------------ 1-D bulk copies
// `bytes` (a multiple of 16, 16-byte aligned addresses) from global memory into shared memory,
// completing `bar`'s transaction bytes; and from shared memory to global memory (a bulk group).
MK_DEV void bulk_load_1d(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"((u64)src), "r"(bytes), "r"(bar)
               : "memory");
}
MK_DEV void bulk_store_1d(void* dst, u32 src, u32 bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"((u64)dst), "r"(src), "r"(bytes)
               : "memory");
}
MK_DEV void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// At most N committed groups still read their shared-memory source.
template <int N>
MK_DEV void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// At most N committed groups not complete (their global writes performed).
template <int N>
MK_DEV void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}

// ------------------------------------------------------------------------------ named barriers
MK_DEV void named_bar_sync(u32 id, u32 threads) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory"); }
// Counts towards the barrier without waiting (the producer side of a hand-off between warpgroups).
MK_DEV void named_bar_arrive(u32 id, u32 threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Barriers of a whole CTA, and of a CTA's THREADS consumer threads (named barrier 1; the producer
// never takes part; the engine itself uses none): the GEMM's two warpgroups, the decode CTA's.
struct MkBarCta {
  MK_DEV void operator()() const { __syncthreads(); }
};
template <u32 THREADS = 256>
struct MkBarConsumers {
  MK_DEV void operator()() const { named_bar_sync(1, THREADS); }
};

// --------------------------------------------------------------------- register reallocation
template <u32 N>
MK_DEV void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <u32 N>
MK_DEV void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

// The warp-specialised CTA of the GEMM and attention engines: the first warpgroup gives registers
// back (Cfg::PRODUCER_REGS) and its thread 0 runs produce(); the others take them
// (Cfg::CONSUMER_REGS) and run consume(wg), wg = 0, 1, ... their consumer index. The budgets
// must fit the launch's register pool (mk_cta_register_pool, common.cuh).
template <class Cfg, class Produce, class Consume>
MK_DEV void warpgroup_roles(Produce&& produce, Consume&& consume) {
  if (threadIdx.x < 128) {
    setmaxnreg_dec<Cfg::PRODUCER_REGS>();
    if (threadIdx.x == 0) produce();
  } else {
    setmaxnreg_inc<Cfg::CONSUMER_REGS>();
    consume((int)(threadIdx.x / 128) - 1);
  }
}

// After warpgroup_roles, every warp back to the launch's even share. Producers take theirs once all
// consumers gave theirs: earlier, they may take what a late consumer's first increase awaits (a hang).
constexpr u32 MK_BAR_REJOIN = 5;  // named barrier of the hand-back (0 .. 4 are taken)
template <u32 THREADS>
MK_DEV void warpgroup_rejoin() {
  constexpr u32 EVEN = (u32)mk_cta_register_pool((int)THREADS) / THREADS;
  __syncwarp();
  if (threadIdx.x < 128) {
    named_bar_sync(MK_BAR_REJOIN, THREADS);
    setmaxnreg_inc<EVEN>();
  } else {
    setmaxnreg_dec<EVEN>();
    named_bar_sync(MK_BAR_REJOIN, THREADS);  // not arrive: racecheck lost barrier 0's order after it
  }
}
