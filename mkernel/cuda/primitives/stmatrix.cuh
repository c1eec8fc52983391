#pragma once
// stmatrix: a warp stores 8x8 matrices of 16-bit values held as mma fragments (lane l: row l / 4,
// columns 2 (l % 4) and + 1, low half first) as 16-byte lines, line i of matrix q at the address
// lane 8q + i gives. .trans: line i holds column i (the fragment stored transposed).
#include "common.cuh"

MK_DEV void stmatrix_x4_trans(u32 addr, u32 m0, u32 m1, u32 m2, u32 m3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(m0), "r"(m1),
               "r"(m2), "r"(m3)
               : "memory");
}
// Two matrices: the addresses of lanes 0-15.
MK_DEV void stmatrix_x2_trans(u32 addr, u32 m0, u32 m1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};" ::"r"(addr), "r"(m0), "r"(m1)
               : "memory");
}
