#pragma once
// 16-bit floats of the input dtype (MK_DT_BF16 / MK_DT_F16) to fp32: one value, or both halves of
// a 32-bit word (low half first). The one conversion every kernel that reads them back uses.
#include "common.cuh"

template <int DT>
MK_DEV float half_to_float(u16 h) {
  if (DT == MK_DT_BF16) return __uint_as_float((u32)h << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

template <int DT>
MK_DEV void unpack2(u32 w, float& lo, float& hi) {
  if (DT == MK_DT_BF16) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xFFFF0000u);
  } else {
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}\n"
        : "=f"(lo), "=f"(hi)
        : "r"(w));
  }
}
