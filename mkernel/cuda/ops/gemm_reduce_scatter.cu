// GEMM+ReduceScatter inside a node (mkernel/ops/gemm_reduce_scatter.py; design: docs/TP.md).
// Template parameters: DT (MK_DT_BF16 / MK_DT_F16), BL (MK_B_NK / MK_B_KN).
#include "tp_reduce.cuh"

template <int DT, int BL>
__global__ void __launch_bounds__(384, 1) mk_gemm_rs_kernel(const __grid_constant__ TpArgs args) {
  tp_reduce_kernel_body<DT, BL, TP_OP_RS>(args);
}

static_assert(TP_SMEM_BYTES == 230736, "update tp.SMEM_BYTES");
static_assert(sizeof(TpArgs) == 1920, "TpArgs layout changed: update mkernel/ops/tp.py");
