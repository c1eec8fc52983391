// The attention forward kernel: persistent, warp-specialized (1 TMA producer warpgroup + 2 wgmma
// consumer warpgroups of 64 query rows), 128 x 128 tiles (query rows x keys), K and V double
// buffered. See attn_mainloop.cuh and docs/ATTENTION.md.
//
// Template parameters: DT (MK_DT_BF16 / MK_DT_F16), D (head dim, 64 or 128), CAUSAL.
#include "common.cuh"
#include "signals.cuh"
#include "attn_args.cuh"
#include "attn_mainloop.cuh"

template <int DT, int D, bool CAUSAL>
__global__ void __launch_bounds__(384, 1) mk_attention_kernel(const __grid_constant__ MkAttnArgs args) {
  using Cfg = AttnCfg<DT, D, CAUSAL>;
  extern __shared__ __align__(1024) u8 mk_smem[];
  const AttnSmem<Cfg> sm = attn_smem_carve<Cfg>(mk_smem);
  attn_setup<Cfg>(args, sm);
  warpgroup_roles<Cfg>(
      [&] {
        const AttnTileSpace space{args, args.sched.num_tiles};
        attn_producer<Cfg>(args, sm, AttnPlainTiles<Cfg>{args, space});
        sched_finish(args.sched);
      },
      [&](int wg) { attn_consumer<Cfg>(args, sm, wg, AttnStoreEpi<Cfg>{args, sm}); });
  launch_exit(args.sync, sm.bars->epoch);  // read at the end: not held in a register all along
}

// mkernel/engines/attention.py launches with these dynamic shared memory sizes (SMEM[D]).
static_assert(attn_smem_bytes<AttnCfg<0, 128, false> >() == 197848, "update SMEM in mkernel/engines/attention.py");
static_assert(attn_smem_bytes<AttnCfg<0, 64, false> >() == 99544, "update SMEM in mkernel/engines/attention.py");
static_assert(sizeof(MkAttnArgs) == 704, "MkAttnArgs layout changed: update mkernel/engines/attention.py");
