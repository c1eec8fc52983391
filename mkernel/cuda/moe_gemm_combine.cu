// The experts' second grouped GEMM fused with combine (mkernel/moe_gemm.py; design: docs/MOE.md).
//
// CTAs [0, gemm_ctas) run the GEMM engine in grouped mode (A: y2, B: the experts' weights, one group
// per local expert with the dispatch's group_rows) into a staging buffer z of this rank, each tile's
// flag (tile_flags[id] = epoch) set once its stores are performed. CTAs [gemm_ctas, grid) claim
// tiles in the GEMM's own order (counters[MOE_CNT_RET]), wait for a tile's flag and send each of its
// rows' 256-column slice to row t * k + j of the row's source's return buffer (meta word of the
// dispatch), so the return trip starts with the first finished tiles; the last of them sets
// retflag[me] on every rank. Then every CTA (the GEMM CTAs' consumer warpgroups after their last
// tile) sums its share of this rank's tokens (moe_combine.cuh): the same sums, in the same order,
// as mk_moe_combine_kernel.
#include "moe_combine.cuh"
#include "gemm_mainloop.cuh"
#include "gemm_epilogue.cuh"
#include "moe_gemm_args.cuh"

constexpr u32 MOE_GC_THREADS = 384;  // the GEMM engine's CTA
constexpr u32 MOE_RET_UNROLL = 8;    // 16-byte vectors a returning thread has in flight

// A returning CTA's shared state (in the dynamic shared memory the GEMM CTAs use for the pipeline).
struct MoeReturnShared {
  MkGroupTable table;
  u32 claim;
  int ok;
  int back;
};

// A returning CTA: the GEMM's tiles as their flags arrive, each row's slice to its source.
template <class Cfg>
MK_DEV void moe_return_tiles(const MkMoeGemmArgs& args, MoeReturnShared& rs, const MkPeers& peers, MoeCtas ctas,
                             u32 Ep) {
  const MkMoeArgs& a = args.m;
  const MkGemmArgs& g = args.g;
  const u32 tid = threadIdx.x;
  build_group_table<Cfg::BM>(&rs.table, g.group_rows, (u32)g.num_groups, g.m, g.sched.tiles_n);
  const MkTileSpace<Cfg::UNIT_M> space = gemm_tile_space<Cfg>(g, &rs.table);
  if (tid == 0) rs.ok = moe_credits_all(a, peers, Ep) ? 1 : 0;
  __syncthreads();
  if (!rs.ok) return;
  const u32* meta = peer_ptr<const u32>(peers, (u32)a.me, a.meta_off);
  const u8* z = reinterpret_cast<const u8*>(g.c_ptr);
  const u64 row_bytes = (u64)a.H * 2u, ldz_bytes = (u64)g.ldc * 2u;
  for (;;) {
    if (tid == 0) rs.claim = atomicAdd(&a.counters[MOE_CNT_RET], 1u);
    __syncthreads();
    const u32 pos = rs.claim;
    if (pos >= space.num_tiles) break;
    const MkTile t = space.template decode<Cfg::BN>(space.builtin_id(pos));
    if (tid == 0) rs.ok = wait_epoch(a.sync, g.tile_flags + t.id, Ep, -1, MOE_WAIT_TILE_STORED + t.id) ? 1 : 0;
    __syncthreads();
    if (!rs.ok) break;
    const u32 vpr = (u32)min(Cfg::BN, g.n - t.n0) / 8u;  // 16-byte vectors of a row's slice
    const u32 n = (u32)t.rows * vpr;
    for (u32 v0 = tid; v0 < n; v0 += MOE_GC_THREADS * MOE_RET_UNROLL) {
      uint4 val[MOE_RET_UNROLL];
      u8* dst[MOE_RET_UNROLL];
#pragma unroll
      for (u32 u = 0; u < MOE_RET_UNROLL; ++u) {
        const u32 v = v0 + u * MOE_GC_THREADS;
        if (v >= n) break;
        const u32 r = v / vpr, c = v - r * vpr;
        const u32 row = (u32)t.m0 + r;
        const u32 m = meta[row];
        const u64 col = (u64)t.n0 * 2u + c * 16u;
        val[u] = __ldcg(reinterpret_cast<const uint4*>(z + row * ldz_bytes + col));
        dst[u] = peer_ptr<u8>(peers, m >> 24, a.ret_off) + (u64)(m & 0xFFFFFFu) * row_bytes + col;
      }
#pragma unroll
      for (u32 u = 0; u < MOE_RET_UNROLL; ++u)
        if (v0 + u * MOE_GC_THREADS < n) st_v4(dst[u], val[u]);
    }
  }
  moe_returned(a, peers, ctas, Ep);
}

template <int DT, int BL>
__global__ void __launch_bounds__(MOE_GC_THREADS, 1) mk_moe_gemm_combine_kernel(const __grid_constant__ MkMoeGemmArgs args) {
  using Cfg = GemmCfg<DT, BL>;
  extern __shared__ __align__(1024) u8 mk_smem[];  // no static shared memory (see moe_dispatch_gemm.cu)
  const MkMoeArgs& a = args.m;
  const MkPeers peers = moe_peers(a);
  const u32 G = (u32)args.gemm_ctas;
  u32 epoch;
  if (blockIdx.x < G) {
    const GemmSmem<Cfg> sm = gemm_smem_carve<Cfg, true>(mk_smem);
    const MkTileSpace<Cfg::UNIT_M> space = gemm_setup<Cfg, true>(args.g, sm);  // the group table of group_rows
    epoch = sm.bars->epoch;
    if (blockIdx.x == 0 && threadIdx.x == 0) credits_announce(peers, epoch);  // this rank entered the epoch
    if (threadIdx.x < 128) {
      setmaxnreg_dec<Cfg::PRODUCER_REGS>();
      if (threadIdx.x == 0) gemm_producer<Cfg, true>(args.g, sm, space);
    } else {
      setmaxnreg_inc<Cfg::CONSUMER_REGS>();
      MkTmaEpilogue<Cfg::DT, Cfg, true> epi{args.g, sm, epoch, MkGemmDest{args.g}};
      gemm_consumer<Cfg>(args.g, sm, (int)(threadIdx.x / 128) - 1, epi);
      epi.finish();
      // The pipeline's shared memory is free now: its first word broadcasts the weighted sum's wait.
      moe_weighted_sum<DT>(a, peers, blockIdx.x, gridDim.x, threadIdx.x - 128, 256, MkBarConsumers(),
                           reinterpret_cast<volatile int*>(sm.base), epoch);
    }
  } else {
    MoeReturnShared& rs = *reinterpret_cast<MoeReturnShared*>(mk_smem);
    epoch = launch_epoch(a.sync);
    moe_return_tiles<Cfg>(args, rs, peers, MoeCtas{blockIdx.x - G, gridDim.x - G}, epoch);
    moe_weighted_sum<DT>(a, peers, blockIdx.x, gridDim.x, threadIdx.x, MOE_GC_THREADS, MkBarCta(), &rs.back, epoch);
  }
  __syncthreads();
  if (threadIdx.x == 0) counters_reset_by_last_block(a.counters, MOE_CNT_WORDS, MOE_CNT_DONE);
  launch_exit(a.sync, epoch);
}

static_assert(gemm_smem_bytes<GemmCfg<0, 0>, true>() == 231768, "update gemm.SMEM_GROUPED");
static_assert(sizeof(MoeReturnShared) <= 231768, "a returning CTA's state fits");
