#pragma once
// Thread-block clusters (sm_90): the CTA's rank in its cluster, addresses in a peer CTA's shared
// memory (DSMEM), arrivals on a peer's mbarrier, and the cluster-wide barrier. The GEMM engine's
// clustered variant uses them to share one B tile between the CTAs of a cluster (docs/GEMM.md).
#include "common.cuh"

MK_DEV u32 cluster_ctarank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// The shared::cluster address of the same byte as local shared address `addr`, in CTA `rank`.
MK_DEV u32 mapa_shared(u32 addr, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}

// Arrives on the mbarrier at local offset `bar` of CTA `rank` (this CTA included), releasing this
// thread's earlier writes at cluster scope.
MK_DEV void mbar_arrive_cluster(u32 bar, u32 rank) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(mapa_shared(bar, rank)) : "memory");
}

// As mbar_arrive_cluster, with the default semantics (release at CTA scope), for the hot path: a
// consumer releasing a stage while its next wgmma group runs. ptxas puts a MEMBAR.ALL.CTA before a
// cluster-scope release, which waits for the warp's wgmma in flight and halved the clustered GEMM's
// speed (bench/NOTES.md); the wgmma reads of the released stage are complete (wgmma.wait_group)
// before the arrival either way, which is all the peer's TMA overwrite needs (CUTLASS's
// ClusterBarrier::arrive(cta_id) is this instruction too).
MK_DEV void mbar_arrive_remote(u32 bar, u32 rank) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(mapa_shared(bar, rank)) : "memory");
}

// A 16-byte store into CTA `rank`'s shared memory at local offset `addr`.
MK_DEV void st_cluster_v4(u32 addr, u32 rank, uint4 v) {
  asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(mapa_shared(addr, rank)), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// Every thread of every CTA of the cluster. Not .aligned: the threads of a warp may arrive from
// different places (the producer warp's idle lanes arrive long before lane 0).
MK_DEV void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}
