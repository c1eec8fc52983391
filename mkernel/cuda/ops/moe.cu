// Expert-parallel MoE inside a node (mkernel/ops/moe.py; design: docs/MOE.md): dispatch routes every
// (token, expert) pair of this rank to the rank owning the expert; combine returns each received
// row to its token's rank and sums a token's rows weighted by its routing weights.
//
// Row order on a receiving rank: by local expert, then source rank, then the source's pair order
// (t * k + j), so that every rank computes every row's place from the exchanged count rows alone and
// the layout (and the combine's sum order) is the same from run to run.
//
// Dispatch (mk_moe_dispatch_kernel): the dispatch role (moe_dispatch.cuh, steps 1-4) on every
// CTA, then every CTA waits for all rflags and copies its stripe of the received rows to `out`.
// Every CTA's role and items go by arrival and claims: any resident part of the grid finishes.
// (mk_moe_dispatch_gemm_kernel, moe_dispatch_gemm.cu, runs the same role beside a grouped GEMM.)
// Combine: rows go back to t * k + j of their source's return buffer (retflag as above), then a
// warp per token sums its k rows in fp32, j ascending, and rounds once.
#include "moe_dispatch.cuh"
#include "moe_combine.cuh"

constexpr u32 MOE_THREADS = 512;
constexpr u32 MOE_WARPS = MOE_THREADS / 32;

// The standalone dispatch: the role on every CTA, then (step 5) once every rank's rows are here,
// each CTA's stripe of them to `out`.
__global__ void __launch_bounds__(MOE_THREADS, 1) mk_moe_dispatch_kernel(const __grid_constant__ MkMoeArgs a) {
  __shared__ MoeShared<MOE_THREADS> sh;
  extern __shared__ __align__(128) u8 moe_stage[];  // the copiers' buffers: MoeShared<>::STAGE_BYTES
  const u32 tid = threadIdx.x;
  const MkPeers peers = moe_peers(a);
  const MoeCtas ctas{moe_arrival(a, &sh.claim), gridDim.x};
  if (moe_dispatch_role<MOE_THREADS>(a, sh, ctas, moe_stage)) {
    if (tid == 0) sh.ok = moe_wait_all(a, peers, a.rflag_off, sh.epoch, MOE_WAIT_ROWS) ? 1 : 0;
    __syncthreads();
    if (sh.ok) {
      const u32 vpr = (u32)a.H / 8u;  // 16-byte vectors per row
      const u8* src = peer_ptr<u8>(peers, (u32)a.me, a.recv_off);
      u8* out = reinterpret_cast<u8*>(a.out);
      copy_vectors<MOE_COPY_UNROLL>(  // the receive buffer (in the workspace) holds < 2^32 vectors
          sh.total_me * vpr, blockIdx.x * MOE_THREADS + tid, gridDim.x * MOE_THREADS,
          [&](u32 v) { return src + (u64)v * 16u; },
          [&](u32 v, uint4 x) {
            const u32 r = v / vpr;
            st_v4(out + (u64)r * (u64)a.ldo * 2u + (u64)(v - r * vpr) * 16u, x);
          });
    }
  }
  __syncthreads();
  if (tid == 0) counters_reset_by_last_block(a.counters, MOE_CNT_WORDS, MOE_CNT_DONE);
  launch_exit(a.sync, sh.epoch);
}

// Rows of the received buffer a combine CTA claims at a time.
constexpr u32 MOE_RET_ROWS = 4 * MOE_WARPS;

// The standalone combine: the received rows back to their sources (blocks of MOE_RET_ROWS claimed
// in order, a warp per row), then the weighted sum of every token (moe_combine.cuh).
template <int DT>
__global__ void __launch_bounds__(MOE_THREADS, 1) mk_moe_combine_kernel(const __grid_constant__ MkMoeArgs a) {
  __shared__ u32 s_epoch, s_slot;
  __shared__ int s_ok, s_back;
  const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const MkPeers peers = moe_peers(a);
  const u32 first = moe_arrival(a, &s_slot) == 0;
  const u32 row_bytes = (u32)a.H * 2u;
  if (tid == 0) {
    s_epoch = launch_epoch(a.sync);
    if (first) credits_announce(peers, s_epoch);
    s_ok = moe_credits_all(a, peers, s_epoch) ? 1 : 0;
  }
  __syncthreads();
  const u32 Ep = s_epoch;
  if (s_ok) {
    const u32* meta = peer_ptr<const u32>(peers, (u32)a.me, a.meta_off);
    const u8* y = reinterpret_cast<const u8*>(a.y);
    const u32 n = (u32)a.received[0];
    u32 mine = 0;  // rows this CTA returned
    for (;;) {
      if (tid == 0) s_slot = atomicAdd(&a.counters[MOE_CNT_RET], 1u) * MOE_RET_ROWS;
      __syncthreads();
      const u32 lo = s_slot, hi = min(n, lo + MOE_RET_ROWS);
      __syncthreads();  // every thread has read s_slot
      if (lo >= n) break;
      for (u32 i = lo + warp; i < hi; i += MOE_WARPS) {
        const u32 m = ld_cg(&meta[i]);
        copy_span<MOE_COPY_UNROLL>(peer_ptr<u8>(peers, m >> 24, a.ret_off) + (u64)(m & 0xFFFFFFu) * row_bytes,
                                   y + (u64)i * (u64)a.ldy * 2u, row_bytes, lane, 32);
      }
      mine += hi - lo;
    }
    moe_returned(a, peers, mine, n, Ep);
  }
  if (s_ok)
    moe_weighted_sum<DT>(a, peers, moe_tokens(a), blockIdx.x, gridDim.x, tid, MOE_THREADS, MkBarCta(), &s_back, Ep);
  __syncthreads();
  if (tid == 0) counters_reset_by_last_block(a.counters, MOE_CNT_WORDS, MOE_CNT_DONE);
  launch_exit(a.sync, Ep);
}

static_assert(MoeShared<MOE_THREADS>::STAGE_BYTES == 131072, "update moe.DISPATCH_SMEM");
static_assert(sizeof(MkMoeArgs) == 472, "MkMoeArgs layout changed: update mkernel/ops/moe.py");
