// The standalone and grouped GEMM kernels: persistent, warp-specialized (1 TMA producer
// warpgroup + 2 wgmma consumer warpgroups), 128 x BN x 64 tiles, 4 stages; plain mode may split K
// (gemm_splitk.cuh). See docs/GEMM.md.
//
// Template parameters: DT (MK_DT_BF16 / MK_DT_F16), BL (MK_B_NK: B is [N, K]; MK_B_KN: B is
// [K, N]), OUT (MK_OUT_BF16 / MK_OUT_F16 / MK_OUT_F32), GROUPED (per-group row counts on device),
// BN (256, or 192: the narrow tiles of plain mode, module gemm_narrow).
// mk_gemm_cluster_kernel: plain mode in clusters of 2 CTAs sharing each B tile (TMA multicast).
#include "common.cuh"
#include "signals.cuh"
#include "gemm_args.cuh"
#include "gemm_mainloop.cuh"
#include "gemm_epilogue.cuh"
#include "gemm_splitk.cuh"

#define MK_GEMM_CLUSTER 2

// Consumer warpgroup wg: the mainloop and the store epilogue (plain mode: behind split K's).
template <class Cfg, int OUT, bool GROUPED>
MK_DEV void gemm_consumers(const MkGemmArgs& args, const GemmSmem<Cfg>& sm, int wg, u32 epoch) {
  MkTmaEpilogue<OUT, Cfg, GROUPED> store{args, sm, epoch, MkGemmDest{args}};
  if constexpr (!GROUPED) {
    MkSplitEpilogue<MkTmaEpilogue<OUT, Cfg, GROUPED> > epi{args, store};
    gemm_consumer<Cfg>(args, sm, wg, epi);
    epi.finish();
  } else {
    gemm_consumer<Cfg>(args, sm, wg, store);
    store.finish();
  }
}

// Only flags and role words use the launch epoch: a call with neither reads no epoch and counts no
// exit (two memory round trips fewer).
template <int DT, int BL, int OUT, bool GROUPED, int CLUSTER, int BN>
MK_DEV void gemm_cta(const MkGemmArgs& args) {
  using Cfg = GemmCfg<DT, BL, CLUSTER, BN>;
  extern __shared__ __align__(1024) u8 mk_smem[];
  // Launched overlapped (config.gemm_overlap, plain calls), the kernel before may still run: no
  // memory is touched before it completed; a next overlapped kernel may set up as these CTAs leave.
  griddep_launch_dependents();
  griddep_wait();
  const bool epochs = args.tile_flags != nullptr || args.sched.roles != nullptr;
  const GemmSmem<Cfg> sm = gemm_smem_carve<Cfg, GROUPED>(mk_smem);
  const MkTileSpace<Cfg::UNIT_M> space = gemm_setup<Cfg, GROUPED>(args, sm, epochs);
  const u32 epoch = sm.bars->epoch;
  warpgroup_roles<Cfg>(
      [&] {
        gemm_producer<Cfg, GROUPED>(args, sm, space);
        sched_finish(args.sched);
      },
      [&](int wg) { gemm_consumers<Cfg, OUT, GROUPED>(args, sm, wg, epoch); });
  if (CLUSTER > 1) cluster_sync();  // no CTA leaves while another can still write into it
  if (epochs) launch_exit(args.sync, epoch);
}

template <int DT, int BL, int OUT, bool GROUPED, int BN>
__global__ void __launch_bounds__(384, 1) mk_gemm_kernel(const __grid_constant__ MkGemmArgs args) {
  gemm_cta<DT, BL, OUT, GROUPED, 1, BN>(args);
}

template <int DT, int BL, int OUT, int BN>
__global__ void __cluster_dims__(MK_GEMM_CLUSTER, 1, 1) __launch_bounds__(384, 1)
    mk_gemm_cluster_kernel(const __grid_constant__ MkGemmArgs args) {
  gemm_cta<DT, BL, OUT, false, MK_GEMM_CLUSTER, BN>(args);
}

// mkernel/engines/gemm.py launches with these dynamic shared memory sizes (SMEM_PLAIN, SMEM_GROUPED).
static_assert(sizeof(GemmBars<GemmCfg<0, 0> >) == 336, "GemmBars size changed: update mkernel/engines/gemm.py");
static_assert(sizeof(GemmBars<GemmCfg<0, 0, MK_GEMM_CLUSTER> >) == 336,
              "GemmBars size changed: update mkernel/engines/gemm.py");
static_assert(gemm_smem_bytes<GemmCfg<0, 0>, false>() == 230736, "update SMEM_PLAIN in mkernel/engines/gemm.py");
static_assert(gemm_smem_bytes<GemmCfg<0, 0>, true>() == 231768, "update SMEM_GROUPED in mkernel/engines/gemm.py");
static_assert(gemm_smem_bytes<GemmCfg<0, 0>, true>() <= 232448, "more than 227 KiB of shared memory");
static_assert(gemm_smem_bytes<GemmCfg<0, 0, 1, 192>, false>() == 197968,
              "update SMEM_PLAIN (narrow tiles) in mkernel/engines/gemm.py");
static_assert(MK_SPLIT_COUNTS_BYTES == 4096, "update SPLIT_COUNTS_BYTES in mkernel/engines/gemm_plan.py");
static_assert(sizeof(MkGemmArgs) == 576, "MkGemmArgs layout changed: update mkernel/engines/gemm.py");
