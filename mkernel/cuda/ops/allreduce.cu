// One-shot all-reduce inside a node (mkernel/ops/allreduce.py): every rank pushes its data, chunk by
// chunk, into slot [me] of every rank's scratch (its own included), each chunk followed by its flag
// flags[me][c] = E there (after that rank's credit for E); then each chunk c of the output is the
// fp32 sum of slots [0..world) in rank order, rounded once: the same bits on every rank, one round
// of stores for the latency of small messages. CTAs claim push items, then reduce items, from one
// counter, so any resident part of the grid finishes (a CTA pushes before it waits).
// LL (small messages): the same items, but a push stores LL words (ll.cuh: 4 bytes of data and E
// in one 8-byte word) into slot [me] of that rank's LL buffer and sets no flag; a reduce polls its
// words until they carry E. No fence and no flag round trip; the same sums and bits.
// Two-shot (large messages, more than 2 ranks): chunk c goes to its owner c % W only; the owner sums
// it (the same order and bits), stores it into out and its results row, and sets its result flag;
// the others copy it from there: 2 (W - 1) / W of the data a rank sends, not W - 1.
// DT: MK_OUT_BF16, MK_OUT_F16 or MK_OUT_F32 (the element type). A chunk's last count % (16 / size)
// elements (a partial vector) go one per thread.
#include "tp_reduce.cuh"
#include "ll.cuh"
#include "allreduce_args.cuh"

template <int DT>
struct ArElem {
  static constexpr u32 BYTES = DT == MK_OUT_F32 ? 4 : 2;
  static constexpr u32 PER_VEC = 16 / BYTES;
  static MK_DEV float load(const u8* p) {
    if constexpr (DT == MK_OUT_F32) {
      return __ldcg(reinterpret_cast<const float*>(p));
    } else {
      float lo, hi;
      unpack2<DT>(__ldcg(reinterpret_cast<const unsigned short*>(p)), lo, hi);
      return lo;
    }
  }
  static MK_DEV void store(u8* p, float v) {
    if constexpr (DT == MK_OUT_F32)
      *reinterpret_cast<float*>(p) = v;
    else
      *reinterpret_cast<u16*>(p) = (u16)(pack2_out(DT, v, 0.f) & 0xFFFFu);
  }
};

// Vectors [0, vecs) at byte `base` of the output (and of `row` where not null): the fp32 sums of
// every rank's slot in rank order, rounded once; AR_REDUCE_VECS vectors of 2 ranks a thread in flight.
template <int DT>
MK_DEV void ar_reduce_span(const u8* slots, u64 slot_bytes, u32 W, u64 base, u64 vecs, u8* out, u8* row) {
  constexpr u32 U = AR_REDUCE_VECS;
  const u64 nthr = blockDim.x;
  for (u64 v0 = threadIdx.x; v0 < vecs; v0 += U * nthr) {
    const u32 here = (u32)min((u64)U, (vecs - v0 + nthr - 1) / nthr);
    float s[U][8];
#pragma unroll
    for (u32 u = 0; u < U; ++u)
#pragma unroll
      for (int e = 0; e < 8; ++e) s[u][e] = 0.f;
    tp_add_partials<DT, U, 2>(s, W, here,
                              [&](u32 r, u32 u) { return slots + r * slot_bytes + base + (v0 + u * nthr) * 16; });
#pragma unroll
    for (u32 u = 0; u < U; ++u) {
      if (u >= here) continue;
      const uint4 x = tp_pack8<DT>(s[u]);
      st_v4(out + base + (v0 + u * nthr) * 16, x);
      if (row) st_v4(row + base + (v0 + u * nthr) * 16, x);  // two-shot: the owner's results row
    }
  }
}

// The 4 data bytes of LL word w: bytes [4w, 4w + 4) of src, of which `bytes` exist (a 16-bit
// element count may be odd: the last word's high half is then zero).
MK_DEV u32 ar_ll_data(const u8* src, u64 w, u64 bytes) {
  if (4 * w + 4 <= bytes) return __ldcg(reinterpret_cast<const unsigned int*>(src + 4 * w));
  return __ldcg(reinterpret_cast<const unsigned short*>(src + 4 * w));
}

// The LL words [w0, w1) of a chunk of n elements of `bytes` each from element `first` (a multiple of 8).
MK_DEV void ar_ll_words(u64 first, u64 n, u64 bytes, u64& w0, u64& w1) {
  w0 = first * bytes / 4;
  w1 = (first * bytes + n * bytes + 3) / 4;
}

// Words [w0, w1) of src as LL words of epoch E into dst (LL_UNROLL loads in flight per thread).
MK_DEV void ar_ll_push(u64* dst, const u8* src, u64 w0, u64 w1, u64 bytes, u32 E) {
  for (u64 w = w0 + threadIdx.x; w < w1; w += LL_UNROLL * blockDim.x) {
    u32 v[LL_UNROLL];
#pragma unroll
    for (int u = 0; u < LL_UNROLL; ++u)
      v[u] = w + u * blockDim.x < w1 ? ar_ll_data(src, w + u * blockDim.x, bytes) : 0u;
#pragma unroll
    for (int u = 0; u < LL_UNROLL; ++u)
      if (w + u * blockDim.x < w1) ll_store(dst + w + u * blockDim.x, ll_word(v[u], E));
  }
}

// Words [w0, w1) of the output: every rank's LL word added in rank order in fp32 (ll_sum),
// rounded once. False on a recorded error.
template <int DT>
MK_DEV bool ar_ll_reduce(const MkAllreduceArgs& a, const u8* slots, u64 w0, u64 w1, u64 bytes, u32 E, u8* out) {
  constexpr bool F32 = DT == MK_OUT_F32;
  for (u64 w = w0 + threadIdx.x; w < w1; w += LL_UNROLL * blockDim.x) {
    float lo[LL_UNROLL], hi[LL_UNROLL];
    if (!ll_sum<DT, F32>(a.sync, reinterpret_cast<const u64*>(slots), a.slot_bytes / 8, (u32)a.world, w, blockDim.x, w1,
                         E, lo, hi))
      return false;
#pragma unroll
    for (int u = 0; u < LL_UNROLL; ++u) {
      const u64 i = w + u * blockDim.x;
      if (i >= w1) continue;
      if (F32)
        *reinterpret_cast<float*>(out + 4 * i) = lo[u];
      else if (4 * i + 4 <= bytes)
        *reinterpret_cast<u32*>(out + 4 * i) = pack2_out(DT, lo[u], hi[u]);
      else
        *reinterpret_cast<u16*>(out + 4 * i) = (u16)(pack2_out(DT, lo[u], 0.f) & 0xFFFFu);
    }
  }
  return true;
}

// Push item `item`: chunk c to rank d (one-shot: own slot first, then me + 1, ...; two-shot: chunk
// `item` to its owner), once d entered epoch E.
template <int DT, int LL>
MK_DEV void ar_push(const MkAllreduceArgs& a, const MkPeers& peers, u32 E, u32 item, int& s_ok) {
  using El = ArElem<DT>;
  const u32 W = (u32)a.world, me = (u32)a.me;
  const u32 c = a.twoshot ? item : item / W, d = a.twoshot ? item % W : (me + item % W) % W;
  const u64 t_wait = trace_start(a.sync);
  if (threadIdx.x == 0) {
    s_ok = credits_wait(a.sync, peers, d, E) ? 1 : 0;
    trace_span(a.sync, MK_ROLE_WAIT, d, t_wait);
  }
  __syncthreads();
  const u64 t_push = trace_start(a.sync);
  if (!s_ok) return;
  const u64 first = (u64)c * a.chunk, n = min((u64)a.chunk, a.count - first), whole = n / El::PER_VEC * 16;
  if (LL) {
    u64 w0, w1;
    ar_ll_words(first, n, El::BYTES, w0, w1);
    ar_ll_push(reinterpret_cast<u64*>(peer_ptr<u8>(peers, d, a.slots_off) + me * a.slot_bytes),
               reinterpret_cast<const u8*>(a.src), w0, w1, a.count * El::BYTES, E);
    __syncthreads();  // every load of src done (in place, out may be written once all are)
    if (threadIdx.x == 0) {
      if (a.in_place) atomicAdd(&a.counters[AR_CNT_PUSHED], 1u);
      trace_span(a.sync, MK_ROLE_SEND, item, t_push);
    }
    return;
  }
  const u8* src = reinterpret_cast<const u8*>(a.src) + first * El::BYTES;
  u8* dst = peer_ptr<u8>(peers, d, a.slots_off) + me * a.slot_bytes + first * El::BYTES;
  const bool move = !(a.src_is_slot && d == me);  // the own slot may hold the data already
  if (move) copy_span<TP_IN_FLIGHT>(dst, src, whole, threadIdx.x, blockDim.x);
  if (move && threadIdx.x < n % El::PER_VEC) {  // the partial vector: one element per thread
    const u64 o = whole + threadIdx.x * El::BYTES;
    if (El::BYTES == 4)
      *reinterpret_cast<u32*>(dst + o) = __ldcg(reinterpret_cast<const u32*>(src + o));
    else
      *reinterpret_cast<u16*>(dst + o) = __ldcg(reinterpret_cast<const unsigned short*>(src + o));
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    set_flag(peer_ptr<u32>(peers, d, a.flags_off) + me * a.chunks + c, E);
    if (a.in_place) atomicAdd(&a.counters[AR_CNT_PUSHED], 1u);
    trace_span(a.sync, MK_ROLE_SEND, item, t_push);
  }
}

// In place (out is src), before a CTA's first write of out: every chunk of src has left (claimed
// pushes finish). Thread 0.
MK_DEV bool ar_pushes_done(const MkAllreduceArgs& a, int& s_pushed) {
  const bool good =
      !a.in_place || s_pushed ||
      wait_at_least(a.sync, &a.counters[AR_CNT_PUSHED], a.twoshot ? a.chunks : a.chunks * (u32)a.world, a.me, 0x10000u);
  s_pushed = 1;
  return good;
}

// Reduce item c: chunk c of the output, every rank's slot in rank order (two-shot: also into this
// rank's results row, then its result flag).
template <int DT, int LL>
MK_DEV void ar_reduce(const MkAllreduceArgs& a, const MkPeers& peers, u32 E, u32 c, int& s_ok, int& s_pushed) {
  using El = ArElem<DT>;
  const u32 W = (u32)a.world, me = (u32)a.me, chunks = a.chunks;
  const u8* slots = peer_ptr<u8>(peers, me, a.slots_off);
  u8* out = reinterpret_cast<u8*>(a.out);
  const u64 t_flags = trace_start(a.sync);
  if (threadIdx.x == 0) {
    int good = ar_pushes_done(a, s_pushed) ? 1 : 0;
    const u32* flags = peer_ptr<u32>(peers, me, a.flags_off);
    for (u32 s = 0; s < W && good && !LL; ++s) good = wait_epoch(a.sync, flags + s * chunks + c, E, (i32)s, c) ? 1 : 0;
    s_ok = good;
    trace_span(a.sync, MK_ROLE_WAIT, 0x100u + c, t_flags);
  }
  __syncthreads();
  if (!s_ok) return;
  const u64 t_sum = trace_start(a.sync);
  const u64 first = (u64)c * a.chunk, n = min((u64)a.chunk, a.count - first), vecs = n / El::PER_VEC;
  if (LL) {
    u64 w0, w1;
    ar_ll_words(first, n, El::BYTES, w0, w1);
    if (!ar_ll_reduce<DT>(a, slots, w0, w1, a.count * El::BYTES, E, out)) s_ok = 0;  // any thread: a benign race
  } else {
    const u64 base = first * El::BYTES;
    u8* row = a.twoshot ? peer_ptr<u8>(peers, me, a.slots_off) + W * a.slot_bytes : nullptr;
    ar_reduce_span<DT>(slots, a.slot_bytes, W, base, vecs, out, row);
    if (threadIdx.x < n % El::PER_VEC) {
      const u64 o = base + vecs * 16 + threadIdx.x * El::BYTES;
      float s = 0.f;
      for (u32 r = 0; r < W; ++r) s += El::load(slots + r * a.slot_bytes + o);
      El::store(out + o, s);
      if (row) El::store(row + o, s);
    }
    if (row) __threadfence_system();  // the results row before the flag (cumulative with the barrier)
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (a.twoshot && !LL) set_flag(peer_ptr<u32>(peers, me, a.flags_off) + W * chunks + c, E);
    trace_span(a.sync, MK_ROLE_INTRA, c, t_sum);
  }
}

// Two-shot gather item: chunk c of the output, copied from its owner's results row once its result
// flag carries E.
template <int DT>
MK_DEV void ar_gather(const MkAllreduceArgs& a, const MkPeers& peers, u32 E, u32 c, int& s_ok, int& s_pushed) {
  using El = ArElem<DT>;
  const u32 W = (u32)a.world, owner = c % W;
  const u64 t_flag = trace_start(a.sync);
  if (threadIdx.x == 0) {
    s_ok = ar_pushes_done(a, s_pushed) &&
           wait_epoch(a.sync, peer_ptr<u32>(peers, owner, a.flags_off) + W * a.chunks + c, E, (i32)owner, c);
    trace_span(a.sync, MK_ROLE_WAIT, 0x200u + c, t_flag);
  }
  __syncthreads();
  if (!s_ok) return;
  const u64 t_copy = trace_start(a.sync);
  const u64 first = (u64)c * a.chunk, n = min((u64)a.chunk, a.count - first), whole = n / El::PER_VEC * 16;
  const u8* src = peer_ptr<u8>(peers, owner, a.slots_off) + W * a.slot_bytes + first * El::BYTES;
  u8* dst = reinterpret_cast<u8*>(a.out) + first * El::BYTES;
  copy_span<TP_IN_FLIGHT>(dst, src, whole, threadIdx.x, blockDim.x);
  if (threadIdx.x < n % El::PER_VEC) {
    const u64 o = whole + threadIdx.x * El::BYTES;
    El::store(dst + o, El::load(src + o));
  }
  __syncthreads();
  if (threadIdx.x == 0) trace_span(a.sync, MK_ROLE_RECV, c, t_copy);
}

// Two-shot: the chunks this rank owns (me, me + W, ...), then the others by owner me + 1, me + 2, ...
MK_DEV u32 ar_owned(u32 chunks, u32 W, u32 r) { return r < chunks ? (chunks - r + W - 1) / W : 0u; }
MK_DEV u32 ar_gather_chunk(u32 g, u32 chunks, u32 W, u32 me) {
  for (u32 j = 1;; ++j) {
    const u32 o = (me + j) % W, n = ar_owned(chunks, W, o);
    if (g < n) return o + g * W;
    g -= n;
  }
}

template <int DT, int LL>
__global__ void __launch_bounds__(AR_THREADS, 1) mk_allreduce_kernel(const __grid_constant__ MkAllreduceArgs a) {
  __shared__ u32 s_epoch, s_item;
  __shared__ int s_ok, s_pushed;
  const MkPeers peers{a.peer_base, (u32)a.world, (u32)a.me};
  const u64 t_enter = trace_start(a.sync);  // trace mode: the phases' spans (tools/allreduce_phases.py)
  if (threadIdx.x == 0) {
    s_epoch = launch_epoch(a.sync);
    credits_announce(peers, s_epoch);  // by every block: a few stores, and no arrival round trip
    s_ok = 1;
    s_pushed = 0;
    trace_span(a.sync, MK_ROLE_CONTROL, s_epoch, t_enter);  // id: the launch
  }
  __syncthreads();
  const u32 W = (u32)a.world, E = s_epoch, two = !LL && a.twoshot;
  const u32 pushes = two ? a.chunks : a.chunks * W, reduces = two ? ar_owned(a.chunks, W, (u32)a.me) : a.chunks;
  const u32 items = two ? 2 * a.chunks : pushes + a.chunks;
  // One counter hands out every push item before any reduce item (two-shot: then every gather): a
  // CTA that may wait for peers' data has pushed, and a gather waits only for reduces, which wait
  // only for pushes; every item is claimed by a running CTA. The last item's CTA claims no more.
  for (u32 item = 0; s_ok && item != items - 1;) {
    item = tp_claim(&a.counters[AR_CNT_ITEM], &s_item, threadIdx.x, MkBarCta());
    if (item >= items) break;
    if (item < pushes)
      ar_push<DT, LL>(a, peers, E, item, s_ok);
    else if (item < pushes + reduces)
      ar_reduce<DT, LL>(a, peers, E, two ? (u32)a.me + (item - pushes) * W : item - pushes, s_ok, s_pushed);
    else if (two)
      ar_gather<DT>(a, peers, E, ar_gather_chunk(item - pushes - reduces, a.chunks, W, (u32)a.me), s_ok, s_pushed);
  }
  launch_exit(a.sync, E, a.counters, AR_CNT_WORDS);
}

static_assert(sizeof(MkAllreduceArgs) == 168, "MkAllreduceArgs layout changed: update mkernel/ops/allreduce.py");
