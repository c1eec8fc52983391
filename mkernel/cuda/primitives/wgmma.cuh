#pragma once
// wgmma (Hopper warpgroup MMA): shared-memory matrix descriptors, the fence / commit / wait trio,
// and the generated m64nNk16 wrappers (fp32 accumulation, bf16 and fp16 inputs).
//
// Descriptor (PTX ISA "Matrix Descriptor Format", 64 bits):
//   bits  0-13  start address >> 4 (shared window address)
//   bits 16-29  leading dimension byte offset >> 4 (LBO)
//   bits 32-45  stride dimension byte offset >> 4 (SBO)
//   bits 49-51  base offset (0: every tile buffer is 1024-byte aligned)
//   bits 62-63  swizzle: 0 none, 1 128B, 2 64B, 3 32B
// 128B swizzle, K-major (A, and B given as [N, K]): the canonical atom is 8 rows x 128 bytes
// (8 x 64 elements); SBO = 1024 (next 8 rows); LBO unused (1). Stepping K by 16 elements inside
// the 64-wide atom adds 32 bytes to the start address (the swizzle is a function of the address).
// 128B swizzle, MN-major (B given as [K, N], imm-trans-b = 1): atom is 8 K-rows x 128 bytes
// (64 N elements contiguous); SBO = offset between 8-row K groups (1024), LBO = offset between
// 64-element N chunks (the size of one TMA box, 64 K rows x 128 B = 8192 here).
#include "common.cuh"

MK_DEV u64 wgmma_desc(u32 smem_addr, u32 lbo_bytes, u32 sbo_bytes) {
  u64 d = 0;
  d |= (u64)((smem_addr & 0x3FFFF) >> 4);
  d |= (u64)((lbo_bytes >> 4) & 0x3FFF) << 16;
  d |= (u64)((sbo_bytes >> 4) & 0x3FFF) << 32;
  d |= (u64)1 << 62;  // 128B swizzle
  return d;
}

MK_DEV void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
MK_DEV void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
MK_DEV void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads/writes across the asynchronous MMA.
MK_DEV void wgmma_fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// The wgmma instructions themselves (generated: tools/gen_wgmma.py): wgmma_ss / wgmma_rs<DT,
// TNSP_B>, one overload per m64nNk16 shape, chosen by the accumulator's size (N = 2 x registers).
// Accumulator fragment (N/2 fp32 registers per thread): register 4*j + i of thread (warp w, lane l)
// holds row 16*w + l/4 + 8*(i/2), column 8*j + 2*(l%4) + (i%2).
#include "wgmma_ops.cuh"
