#pragma once
// The argument struct of the fused dispatch + grouped GEMM (mkernel/cuda/ops/moe_dispatch_gemm.cu),
// shared with Python (mkernel/ops/moe_gemm.py mirrors it; tests/cpu/test_moe.py compares the layouts with g++):
// the GEMM engine's arguments (A: this rank's receive buffer, B: its experts' weights, C: y) and the
// dispatch's. CTAs [0, gemm_ctas) run the GEMM, the others dispatch.
#include "gemm_args.cuh"
#include "moe_args.cuh"

struct MkMoeGemmArgs {
  MkGemmArgs g;
  MkMoeArgs m;
  int gemm_ctas;
  int join;  // dispatch: nonzero, the dispatch CTAs join the GEMM once their rows are sent
};
