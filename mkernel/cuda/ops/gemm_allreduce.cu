// GEMM+AllReduce inside a node: the ReduceScatter mechanism of tp_reduce.cuh, then an AllGather
// phase of the reduced tiles in the same kernel (mkernel/ops/gemm_allreduce.py; design: docs/TP.md).
#include "tp_reduce.cuh"

template <int DT, int BL>
__global__ void __launch_bounds__(384, 1) mk_gemm_ar_kernel(const __grid_constant__ TpArgs args) {
  tp_reduce_kernel_body<DT, BL, TP_OP_AR>(args);
}

static_assert(TP_SMEM_BYTES == 230736, "update tp.SMEM_BYTES");
static_assert(sizeof(TpArgs) == 1920, "TpArgs layout changed: update mkernel/ops/tp.py");
