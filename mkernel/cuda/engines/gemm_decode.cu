// The decode GEMM engine's kernel (mkernel/engines/gemm_decode.py): decode_gemm (gemm_decode.cuh)
// storing its values into out, or adding them to it (accumulate). OUT: MK_OUT_* (the input dtype or f32).
#include "gemm_decode.cuh"

template <int OUT>
struct DecodeStore {
  const MkDecodeArgs& args;
  MK_DEV void begin() {}
  template <class Bar>
  MK_DEV bool ready(Bar) {
    return true;
  }
  MK_DEV void previous(int, u64 tok, u64 r0, u64 r1, float (&v)[4]) {  // accumulate: out's values added
    if (args.epi_op != MK_EPI_ADD) return;
    const u64 ldc = (u64)args.ldc, N = (u64)args.n, M = (u64)args.m;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const u64 tk = tok + (e & 1), row = e < 2 ? r0 : r1;
      if (tk < M && row < N) v[e] += load_out<OUT>(args.out, tk * ldc + row);
    }
  }
  MK_DEV void finish(int, u64 tok, u64 r0, u64 r1, const float (&v)[4]) {
    const u64 ldc = (u64)args.ldc, N = (u64)args.n, M = (u64)args.m;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const u64 tk = tok + (e & 1), row = e < 2 ? r0 : r1;
      if (tk < M && row < N) store_out<OUT>(args.out, tk * ldc + row, v[e]);
    }
  }
};

template <int DT, int OUT, int MT, int ROWS>
__global__ void __launch_bounds__(DecodeCfg<MT, ROWS>::THREADS, 1)
    mk_gemm_decode_kernel(const __grid_constant__ MkDecodeArgs args) {
  DecodeStore<OUT> epi{args};
  decode_gemm<DT, MT, ROWS>(args, epi);
}

static_assert(sizeof(MkDecodeArgs) == 448, "MkDecodeArgs layout changed: update mkernel/engines/gemm_decode.py");
