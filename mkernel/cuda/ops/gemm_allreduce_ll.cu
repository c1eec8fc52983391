// gemm_allreduce's fused latency path (mkernel/ops/gemm_allreduce_ll.py): the decode GEMM pushes
// each finished value, as LL words (ll.cuh; layout: gemm_allreduce_ll_args.cuh), into slot [me] of
// every rank's LL buffer while its other row blocks are still computed (after each destination's
// credit for the launch's epoch E: that rank is done with its last launch's words); then the
// reduce kernel waits for every rank's word of each (token pair, column), adds them in rank order
// in fp32 and rounds once: the same bits on every rank. No flag round trip and no fence: a word
// carries its epoch, so the sum kernel may also be launched to overlap the GEMM's tail
// (programmatic serialization). The LL buffer is the plan's own (zeroed at first use; only this
// plan writes it), so a word whose epoch is E is this launch's.
#include "gemm_decode.cuh"
#include "ll.cuh"
#include "peers.cuh"
#include "tp_reduce.cuh"
#include "gemm_allreduce_ll_args.cuh"

// The decode GEMM's epilogue: every finished pair of values to every rank, once its credit is seen.
template <int DT>
struct DecodePush {
  const MkDecodePushArgs& a;
  u32* s_epoch;
  int* s_ok;
  MK_DEV MkPeers peers() const { return MkPeers{a.peer_base, (u32)a.world, (u32)a.me}; }
  MK_DEV void begin() {
    if (threadIdx.x != 0) return;
    const u64 t = trace_start(a.g.sync);  // trace mode: tools/ll_phases.py
    *s_epoch = launch_epoch(a.g.sync);
    if (atomicAdd(&a.counters[LL_CNT_ENTER], 1u) == 0) credits_announce(peers(), *s_epoch);
    trace_span(a.g.sync, MK_ROLE_CONTROL, *s_epoch, t);
  }
  template <class Bar>
  MK_DEV bool ready(Bar bar) {
    bar();
    if (threadIdx.x == 0) {  // a row block is finished: its pushes follow the credits
      const u64 t = trace_start(a.g.sync);
      int ok = 1;
      for (u32 d = 0; d < (u32)a.world && ok; ++d) ok = credits_wait(a.g.sync, peers(), d, *s_epoch) ? 1 : 0;
      *s_ok = ok;
      trace_span(a.g.sync, MK_ROLE_WAIT, LL_TRACE_PUSH, t);
    }
    bar();
    return *s_ok != 0;
  }
  template <class Cfg>
  MK_DEV bool staged(float (&)[Cfg::ACC], u32, u64) {
    return false;
  }
  MK_DEV void previous(int, u64, u64, u64, float (&)[4]) {}
  MK_DEV void end() {}
  MK_DEV void finish(int, u64 tok, u64 r0, u64 r1, const float (&v)[4]) {
    const u64 N = (u64)a.g.n, pairs = (u64)a.pairs, pair = tok / 2, E = *s_epoch;
    if (pair >= pairs) return;
    const u64 w0 = ll_word(pack2_out(DT, v[0], v[1]), (u32)E), w1 = ll_word(pack2_out(DT, v[2], v[3]), (u32)E);
    for (u32 d = 0; d < (u32)a.world; ++d) {  // pair-major: a warp's 8 rows of one pair are 64 B
      u64* ll = peer_ptr<u64>(peers(), d, a.ll_off) + ((u64)a.me * pairs + pair) * N;
      if (r0 < N) ll_store(ll + r0, w0);
      if (r1 < N) ll_store(ll + r1, w1);
    }
  }
};

template <int DT, int MT, int ROWS>
__global__ void __launch_bounds__(DecodeCfg<MT, ROWS>::THREADS, 1)
    mk_gemm_allreduce_ll_push(const __grid_constant__ MkDecodePushArgs args) {
  __shared__ u32 s_epoch;
  __shared__ int s_ok;
  griddep_launch_dependents();  // the sum kernel may start (config.tp_latency_ll_overlap)
  DecodePush<DT> epi{args, &s_epoch, &s_ok};
  decode_gemm<DT, MT, ROWS>(args.g, epi);
}

// The values of word i of every rank (LL_UNROLL words per thread at a time: ll_sum), added in rank
// order; out stored row by row (coalesced).
template <int DT>
__global__ void __launch_bounds__(LL_REDUCE_THREADS, 1)
    mk_allreduce_ll_reduce(const __grid_constant__ MkAllreduceLLArgs a) {
  __shared__ u32 s_epoch;
  const u64 t_enter = trace_start(a.sync);
  if (threadIdx.x == 0) {
    s_epoch = launch_epoch(a.sync);
    trace_span(a.sync, MK_ROLE_CONTROL, LL_TRACE_REDUCE | s_epoch, t_enter);
  }
  __syncthreads();
  const u64 t_sum = trace_start(a.sync);
  const u32 E = s_epoch, W = (u32)a.world;
  const MkPeers peers{a.peer_base, W, (u32)a.me};
  const u64 N = (u64)a.n, words = N * (u64)a.pairs, ldo = (u64)a.ldo, M = (u64)a.m;
  const u64* ll = peer_ptr<u64>(peers, (u32)a.me, a.ll_off);
  u16* out = reinterpret_cast<u16*>(a.out);
  const u64 step = (u64)gridDim.x * blockDim.x;
  for (u64 i0 = (u64)blockIdx.x * blockDim.x + threadIdx.x; i0 < words; i0 += LL_UNROLL * step) {
    float lo[LL_UNROLL], hi[LL_UNROLL];
    if (!ll_sum<DT, false>(a.sync, ll, words, W, i0, step, words, E, lo, hi)) break;
#pragma unroll
    for (int u = 0; u < LL_UNROLL; ++u) {
      const u64 i = i0 + u * step;
      if (i >= words) continue;
      const u64 pair = i / N, col = i - pair * N, tok = 2 * pair;
      out[tok * ldo + col] = (u16)(pack2_out(DT, lo[u], 0.f) & 0xFFFFu);
      if (tok + 1 < M) out[(tok + 1) * ldo + col] = (u16)(pack2_out(DT, hi[u], 0.f) & 0xFFFFu);
    }
  }
  if (threadIdx.x == 0) trace_span(a.sync, MK_ROLE_INTRA, blockIdx.x, t_sum);  // thread 0's words summed
  // Launched overlapped, the GEMM may still be running: it ends before the counters it uses reset.
  griddep_wait();
  launch_exit(a.sync, E, a.counters, LL_CNT_WORDS);
}

static_assert(sizeof(MkDecodePushArgs) == 640,
              "MkDecodePushArgs layout changed: update mkernel/ops/gemm_allreduce_ll.py");
static_assert(sizeof(MkAllreduceLLArgs) == 136,
              "MkAllreduceLLArgs layout changed: update mkernel/ops/gemm_allreduce_ll.py");
