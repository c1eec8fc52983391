// Compile check of split_policy.cuh as device code (tests/cpu/test_split_policy.py, tests/cpu/test_compile.py):
// one thread runs the prior, a controller step and a search observation, so that NVRTC instantiates
// every function the fused kernels' controller warp will call. Not launched by any op.
#include "common.cuh"
#include "split_policy.cuh"

struct SplitPolicyTestArgs {
  MkSplitModel model;
  MkSplitWindow window;
  MkSplitCtl* ctl;
  MkSplitSearch* search;
  i32* out;  // [prior, controller step, next search count]
  u64 ns;
};

__global__ void split_policy_test(const __grid_constant__ SplitPolicyTestArgs a) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  a.out[0] = mk_split_prior(a.model);
  a.out[1] = mk_split_ctl_step(*a.ctl, a.window);
  if (a.search->version != MK_SPLIT_VERSION) mk_split_search_init(*a.search, a.model.lo, a.model.hi, a.out[0]);
  a.out[2] = mk_split_search_observe(*a.search, a.search->pending, a.ns);
}
