#pragma once
// wgmma (Hopper warpgroup MMA) wrappers: shared-memory matrix descriptors, the fence / commit /
// wait trio, and m64n256k16 with fp32 accumulation for bf16 and fp16 inputs.
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

// Input element types.
enum { MK_DT_BF16 = 0, MK_DT_F16 = 1 };

// d (64 x 256 fp32 per warpgroup, 128 registers per thread) = A(64x16) * B(16x256) + (scale_d ? d : 0).
// Accumulator fragment: register 4*j + i of thread (warp w, lane l) holds row 16*w + l/4 + 8*(i/2),
// column 8*j + 2*(l%4) + (i%2).
template <int DT, int TNSP_B>
MK_DEV void wgmma_m64n256k16(float (&d)[128], u64 desc_a, u64 desc_b, u32 scale_d);

#define MK_WGMMA_N256(TY, TNSP)                                                                    \
  asm volatile(                                                                                    \
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"                                             \
      " wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, " TNSP ";\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
      "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
      "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
      "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
      "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
      "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
      "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
      "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
      "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
      "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
      "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
      "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
      "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])                                                                                       \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d))

template <>
MK_DEV void wgmma_m64n256k16<MK_DT_BF16, 0>(float (&d)[128], u64 desc_a, u64 desc_b, u32 scale_d) {
  MK_WGMMA_N256("bf16", "0");
}
template <>
MK_DEV void wgmma_m64n256k16<MK_DT_BF16, 1>(float (&d)[128], u64 desc_a, u64 desc_b, u32 scale_d) {
  MK_WGMMA_N256("bf16", "1");
}
template <>
MK_DEV void wgmma_m64n256k16<MK_DT_F16, 0>(float (&d)[128], u64 desc_a, u64 desc_b, u32 scale_d) {
  MK_WGMMA_N256("f16", "0");
}
template <>
MK_DEV void wgmma_m64n256k16<MK_DT_F16, 1>(float (&d)[128], u64 desc_a, u64 desc_b, u32 scale_d) {
  MK_WGMMA_N256("f16", "1");
}
#undef MK_WGMMA_N256
