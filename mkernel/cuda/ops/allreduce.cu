// One-shot all-reduce inside a node (mkernel/ops/allreduce.py): every rank pushes its data, chunk by
// chunk, into slot [me] of every rank's scratch (its own included), each chunk followed by its flag
// flags[me][c] = E there (after that rank's credit for E); then each chunk c of the output is the
// fp32 sum of slots [0..world) in rank order, rounded once: the same bits on every rank, one round
// of stores for the latency of small messages. CTAs claim push items, then reduce items, from
// counters, so any resident part of the grid finishes (a CTA pushes before it waits).
#include "tp_reduce.cuh"
#include "allreduce_args.cuh"

template <int DT>
__global__ void __launch_bounds__(AR_THREADS) mk_allreduce_kernel(const __grid_constant__ MkAllreduceArgs a) {
  __shared__ u32 s_epoch, s_item;
  __shared__ int s_ok;
  const MkPeers peers{a.peer_base, (u32)a.world, (u32)a.me};
  if (threadIdx.x == 0) {
    s_epoch = launch_epoch(a.sync);
    if (atomicAdd(&a.counters[AR_CNT_ENTER], 1u) == 0) credits_announce(peers, s_epoch);
    s_ok = 1;
  }
  __syncthreads();
  const u32 E = s_epoch, W = (u32)a.world, me = (u32)a.me, chunks = a.chunks;
  const u64 row_bytes = a.count * 2;  // one rank's slot
  while (s_ok) {  // chunk c to rank d (own slot first, then me + 1, ...)
    const u32 item = tp_claim(&a.counters[AR_CNT_PUSH], &s_item, threadIdx.x, MkBarCta());
    if (item >= chunks * W) break;
    const u32 c = item / W, d = (me + item % W) % W;
    if (threadIdx.x == 0) s_ok = credits_wait(a.sync, peers, d, E) ? 1 : 0;
    __syncthreads();
    if (!s_ok) break;
    const u64 first = (u64)c * a.chunk, n = min((u64)a.chunk, a.count - first);
    const u8* src = reinterpret_cast<const u8*>(a.src) + first * 2;
    u8* dst = peer_ptr<u8>(peers, d, a.slots_off) + me * row_bytes + first * 2;
    copy_span<TP_IN_FLIGHT>(dst, src, n * 2, threadIdx.x, blockDim.x);
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) set_flag(peer_ptr<u32>(peers, d, a.flags_off) + me * chunks + c, E);
  }
  const u8* slots = peer_ptr<u8>(peers, me, a.slots_off);
  const u32* flags = peer_ptr<u32>(peers, me, a.flags_off);
  while (s_ok) {  // chunk c of the output: every rank's slot, in rank order
    const u32 c = tp_claim(&a.counters[AR_CNT_REDUCE], &s_item, threadIdx.x, MkBarCta());
    if (c >= chunks) break;
    if (threadIdx.x == 0) {
      int good = 1;
      for (u32 s = 0; s < W && good; ++s) good = wait_epoch(a.sync, flags + s * chunks + c, E, (i32)s, c) ? 1 : 0;
      s_ok = good;
    }
    __syncthreads();
    if (!s_ok) break;
    const u64 first = (u64)c * a.chunk, vecs = min((u64)a.chunk, a.count - first) / 8;
    for (u64 v = threadIdx.x; v < vecs; v += blockDim.x) {
      float s[1][8] = {{0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}};
      const u64 off[1] = {(first + v * 8) * 2};
      tp_add_partials<DT, 1>(s, slots, row_bytes, W, off, 1);
      st_v4(reinterpret_cast<u8*>(a.out) + off[0], tp_pack8<DT>(s[0]));
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) counters_reset_by_last_block(a.counters, AR_CNT_WORDS, AR_CNT_DONE);
  launch_exit(a.sync, E);
}

static_assert(sizeof(MkAllreduceArgs) == 152, "MkAllreduceArgs layout changed: update mkernel/ops/allreduce.py");
