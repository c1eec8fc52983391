// AllGather+GEMM inside a node (mkernel/allgather_gemm.py; design: docs/TP.md).
//
// CTAs [gemm_ctas, grid) push this rank's A shard, in chunks of 128 rows, into every rank's
// gathered-A buffer (its own first, then me+1, me+2, ...), each chunk followed by its flag
// aflag[me][chunk] = E in the receiver's workspace (after the receiver's credit for E). CTAs
// [0, gemm_ctas) run the GEMM over the gathered rows, own shard first, then me-1, me-2, ... (the
// order the chunks arrive in); the producer waits for a chunk's flag before its TMA loads, so the
// GEMM starts with the first local chunk and overlaps the rest of the gather.
#include "tp_epilogue.cuh"

MK_DEV void tp_push_cta(const TpArgs& a) {
  __shared__ u32 s_item, s_epoch;
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_epoch = launch_epoch(a.g.sync);
  __syncthreads();
  const u32 E = s_epoch;
  const u32 W = (u32)a.world, me = (u32)a.me, chunks = (u32)a.tiles_mb;
  const MkPeers peers = tp_peers(a);
  const u64 k = (u64)a.g.k;
  const u32 vpr = (u32)(k / 8);  // 16-byte vectors per row (k % 8 == 0)
  const u8* src = reinterpret_cast<const u8*>(a.a_local);
  for (;;) {
    const u32 item = tp_claim(&a.counters[TP_CNT_PUSH], &s_item, threadIdx.x, TpBarCta());
    if (item >= W * chunks) break;
    const u32 i = item / chunks, c = item - i * chunks;
    const u32 d = (me + i) % W;
    if (threadIdx.x == 0) s_ok = credits_wait(a.g.sync, peers, d, E) ? 1 : 0;
    __syncthreads();
    if (!s_ok) break;
    const u32 rows = min(128u, (u32)a.mb - c * 128u);
    u8* dst = peer_ptr<u8>(peers, d, a.ga_off) + ((u64)me * (u64)a.mb + c * 128u) * k * 2;
    const u8* s0 = src + (u64)c * 128u * (u64)a.lda * 2;
    for (u32 v = threadIdx.x; v < rows * vpr; v += blockDim.x) {
      const u32 r = v / vpr;
      const u64 col = (u64)(v - r * vpr) * 8u;
      const uint4 x = *reinterpret_cast<const uint4*>(s0 + ((u64)r * (u64)a.lda + col) * 2);
      st_v4(dst + ((u64)r * k + col) * 2, x);
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) set_flag(peer_ptr<u32>(peers, d, a.aflag_off) + me * chunks + c, E);
  }
  __syncthreads();
  if (threadIdx.x == 0) tp_counters_done(a);
  launch_exit(a.g.sync, E);
}

template <int DT, int BL>
__global__ void __launch_bounds__(384, 1) mk_allgather_gemm_kernel(const __grid_constant__ TpArgs args) {
  if (blockIdx.x == 0 && threadIdx.x == 0) credits_announce(tp_peers(args), launch_epoch(args.g.sync));
  if ((int)blockIdx.x < args.gemm_ctas)
    tp_gemm_cta<GemmCfg<DT, BL>, TP_OP_AG>(args);
  else
    tp_push_cta(args);
}

static_assert(TP_SMEM_BYTES == 230736, "update tp.SMEM_BYTES");
static_assert(sizeof(TpArgs) == 1920, "TpArgs layout changed: update mkernel/tp.py");
