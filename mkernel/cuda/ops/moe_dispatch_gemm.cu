// MoE dispatch fused with the experts' grouped GEMM (mkernel/ops/moe_gemm.py; design: docs/MOE.md).
//
// The first grid - gemm_ctas CTAs to arrive run the dispatch role (moe_dispatch.cuh): rows leave
// local expert by local expert, and the flag eflag[c][s][le] in the owner's workspace says that every
// row of origin class c from rank s to its local expert le is in its receive buffer. With `join` they then take GEMM
// tiles too (their SM would idle otherwise). The later arrivals run the GEMM engine in grouped
// mode straight on that receive buffer (A), one group per local expert (B: its weights), into y:
// they wait for the dispatch's verdict (counters[MOE_CNT_PLAN], after the count rows of every rank
// are in: the group sizes are then known, and written to group_rows), build the group table from
// group_rows and claim tiles group by group (counters[MOE_CNT_TILE]); before a tile's loads the
// producer waits for the flags of the sources whose rows the tile holds. So the GEMM starts on the
// first experts' rows while the later ones are in flight. Between nodes the tiles of own-origin rows
// only go first (moe_tiles.cuh): they run while the forwarded rows still cross the network. Dispatch
// goes to the first arrivals because the GEMM waits on it: any resident part of the grid finishes.
#include "moe_tiles.cuh"
#include "moe_gemm_args.cuh"

constexpr u32 MOE_GEMM_THREADS = 384;  // the GEMM engine's CTA (1 producer + 2 consumer warpgroups)
// A dispatch CTA's copier buffers, after its MoeShared (128-byte aligned for the bulk copies).
constexpr u32 MOE_STAGE_OFFSET = (sizeof(MoeShared<MOE_GEMM_THREADS>) + 127u) & ~127u;

template <class Cfg>
MK_DEV u32 moe_gemm_cta(const MkMoeGemmArgs& args) {
  extern __shared__ __align__(1024) u8 mk_smem[];  // no static shared memory: the GEMM's layout takes all
  const MkMoeArgs& a = args.m;
  const GemmSmem<Cfg> sm = gemm_smem_carve<Cfg, true>(mk_smem);
  gemm_setup<Cfg, false>(args.g, sm);  // barriers, epoch (the group table follows the verdict)
  const u32 epoch = sm.bars->epoch;
  // The group sizes are known (and in group_rows) once the dispatch decided; thread 0 waits.
  const bool ok = __syncthreads_or(threadIdx.x == 0 &&
                                   wait_flag(
                                       a.sync, &a.counters[MOE_CNT_PLAN], [](u32 v) { return v != 0u; }, MOE_PLAN_OK,
                                       -1, MOE_WAIT_PLAN) &&
                                   ld_acquire_sys(&a.counters[MOE_CNT_PLAN]) == MOE_PLAN_OK) != 0;
  build_group_table<Cfg::UNIT_M>(sm.table, a.group_rows, (u32)args.g.num_groups, args.g.m, args.g.sched.tiles_n);
  MkTileSpace<Cfg::UNIT_M> space = gemm_tile_space<Cfg>(args.g, sm.table);
  if (!ok) space.num_tiles = 0;
  moe_gemm_tiles<Cfg, true>(args.g, a, sm, space, epoch);
  return epoch;
}

template <int DT, int BL>
__global__ void __launch_bounds__(MOE_GEMM_THREADS, 1)
    mk_moe_dispatch_gemm_kernel(const __grid_constant__ MkMoeGemmArgs args) {
  extern __shared__ __align__(1024) u8 mk_smem[];
  const u32 ndisp = gridDim.x - (u32)args.gemm_ctas;
  const u64 t_in = trace_start(args.m.sync);
  MoeShared<MOE_GEMM_THREADS>& sh = *reinterpret_cast<MoeShared<MOE_GEMM_THREADS>*>(mk_smem);
  const u32 arrival = moe_arrival(args.m, &sh.claim);
  fence_proxy_async_smem();  // that word's generic use before a GEMM CTA's TMA loads
  u32 epoch;
  if (arrival >= ndisp) {
    epoch = moe_gemm_cta<GemmCfg<DT, BL> >(args);
  } else {  // the GEMM's shared memory is free in a dispatch CTA: its state, then the copiers' buffers
    moe_dispatch_role<MOE_GEMM_THREADS>(args.m, sh, MoeCtas{arrival, ndisp}, mk_smem + MOE_STAGE_OFFSET);
    epoch = sh.epoch;
    if (threadIdx.x == 0) trace_span(args.m.sync, MK_ROLE_SEND, MOE_TRACE_DISPATCH | arrival, t_in);
    // Its rows are sent (their copies complete): the SM takes GEMM tiles too. Not after an error on
    // this rank: a copier wait that gave up may have left a bulk load in flight into this memory.
    if (args.join && !__syncthreads_or(threadIdx.x == 0 && error_recorded(args.m.sync))) {
      if (threadIdx.x == 0)
        for (u32 w = 0; w < MoeShared<MOE_GEMM_THREADS>::WARPS; ++w) {
          mbar_inval(smem_u32(&sh.copy_bar[w][0]));
          mbar_inval(smem_u32(&sh.copy_bar[w][1]));
        }
      fence_proxy_async_smem();  // the dispatch's generic stores here before the GEMM's TMA loads
      __syncthreads();
      moe_gemm_cta<GemmCfg<DT, BL> >(args);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    counters_reset_by_last_block(args.m.counters, MOE_CNT_WORDS, MOE_CNT_DONE);
    if (arrival == 0) trace_span(args.m.sync, MK_ROLE_CONTROL, MOE_TRACE_ANNOUNCE | epoch, t_in);  // (its start)
    trace_span(args.m.sync, MK_ROLE_CONTROL, MOE_TRACE_EXIT | blockIdx.x, t_in);
  }
  launch_exit(args.m.sync, epoch);
}

// mkernel/ops/moe_gemm.py passes tile_m = gemm.BM: the tile space's M unit (tile_order's).
static_assert(GemmCfg<0, 0>::UNIT_M == 128 && GemmCfg<1, 1>::UNIT_M == 128, "update moe_gemm.py's tile_m");
// mkernel/ops/moe_gemm.py launches with the grouped GEMM's shared memory (gemm.SMEM_GROUPED).
static_assert(gemm_smem_bytes<GemmCfg<0, 0>, true>() == 231768, "update gemm.SMEM_GROUPED");
static_assert(MOE_STAGE_OFFSET + MoeShared<MOE_GEMM_THREADS>::STAGE_BYTES <= 231768 - 1024,
              "a dispatch CTA's state and buffers fit in the GEMM's shared memory");
// (the kernel declares no static shared memory: with the 1024-byte aligned dynamic part it would
// push the total past the SM's 227 KiB; tests/cpu/test_moe_gemm.py reads ptxas's report to keep it so)
static_assert(sizeof(MkMoeGemmArgs) == 1088, "MkMoeGemmArgs layout changed: update mkernel/ops/moe_gemm.py");
