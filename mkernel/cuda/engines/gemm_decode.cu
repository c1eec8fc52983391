// The decode GEMM engine's kernel (mkernel/engines/gemm_decode.py): decode_gemm (gemm_decode.cuh)
// storing its values into out, or adding them to it (accumulate). OUT: MK_OUT_* (the input dtype or f32).
#include "gemm_decode.cuh"
#include "stmatrix.cuh"

template <int OUT>
struct DecodeStore {
  const MkDecodeArgs& args;
  MK_DEV bool tma_out() const { return OUT != MK_OUT_F32 && (args.flags & MK_DECODE_TMA_OUT) != 0; }
  MK_DEV void begin() {}
  template <class Bar>
  MK_DEV bool ready(Bar) {
    return true;
  }
  // The warp's 16 rows x MT tokens transposed into out's layout (32 B a token) in its stage, then
  // one TMA store (the map clips rows past n and tokens past m): coalesced, unlike 2-byte stores.
  template <class Cfg>
  MK_DEV bool staged(float (&acc)[Cfg::ACC], u32 smem, u64 row0) {
    if (!Cfg::OUT_STAGED || !tma_out()) return false;
    constexpr int DT = OUT == MK_OUT_BF16 ? MK_DT_BF16 : MK_DT_F16;
    const u32 lane = threadIdx.x & 31, q = lane >> 3;  // lane gives line lane % 8 of matrix q
    const u32 stage = smem + Cfg::OFF_OUT + (threadIdx.x >> 5) * Cfg::OUT_WARP;
    // matrix q: token block j + q / 2, rows 8 (q % 2) ..; its line i is token 8 (j + q / 2) + i
    const u32 line = stage + ((q >> 1) * 8 + (lane & 7)) * 32 + (q & 1) * 16;
    if (lane == 0) bulk_wait_read<0>();  // the warp's last block has left the stage
    __syncwarp();
#pragma unroll
    for (int j = 0; j < Cfg::BLOCKS; j += 2) {
      const u32 m0 = pack2<DT>(acc[4 * j], acc[4 * j + 1]), m1 = pack2<DT>(acc[4 * j + 2], acc[4 * j + 3]);
      if (j + 1 < Cfg::BLOCKS)
        stmatrix_x4_trans(line + j * 256, m0, m1, pack2<DT>(acc[4 * j + 4], acc[4 * j + 5]),
                          pack2<DT>(acc[4 * j + 6], acc[4 * j + 7]));
      else
        stmatrix_x2_trans(line + j * 256, m0, m1);
    }
    fence_proxy_async_smem();  // the generic writes before the async proxy's read
    __syncwarp();
    if (lane == 0) {
      tma_store_2d(&args.out_map, stage, (i32)row0, 0);
      bulk_commit();
    }
    return true;
  }
  MK_DEV void end() {  // the stages stay until the stores have read them
    if (tma_out() && (threadIdx.x & 31) == 0) bulk_wait_read<0>();
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

static_assert(sizeof(MkDecodeArgs) == 576, "MkDecodeArgs layout changed: update mkernel/engines/gemm_decode.py");
// mkernel/engines/gemm_decode.py's smem_bytes(128, 128, True) and out_staged() mirror these.
static_assert(DecodeCfg<128, 128>::SMEM_OUT == 230528 && DecodeCfg<128, 128>::OUT_STAGED,
              "update smem_bytes in mkernel/engines/gemm_decode.py");
static_assert(!DecodeCfg<256, 64>::OUT_STAGED && !DecodeCfg<16, 128>::OUT_STAGED && DecodeCfg<32, 64>::OUT_STAGED,
              "update out_staged in mkernel/engines/gemm_decode.py");
