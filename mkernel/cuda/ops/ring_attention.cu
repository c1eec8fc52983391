// Ring attention inside a node (mkernel/ops/ring_attention.py; design: docs/RING_ATTENTION.md).
//
// Each rank holds S local rows of the sequence (causal: zigzag, chunks me and 2W-1-me). Step s
// attends the local queries to the key/value block of rank (me - s) mod W: step 0 to the rank's
// own, step s >= 1 to receive slot s % 2 of the symmetric workspace.
// A CTA's role is its arrival rank (counter RING_CNT_ARRIVE), not its index: the first
// grid - attn_ctas to start forward, so forwarders run whichever CTAs are resident (a GPU shared
// under MPS may run part of the grid only), and the first of them announces this rank's credit;
// the others turn to attention where forwarding would wait on it (ring_forward_cta).
// Forwarders: at step s (0..W-2) they copy the block of step s (own, or slot
// s % 2 once it arrived) into rank me+1's slot (s+1) % 2 and set its flag ARRIVED[s+1] = E. Before
// writing a slot they wait until rank me+1 is done with it: from step s = 2 on, its flag FREE[s-1]
// (here) is E; at steps 0 and 1 its credit (it entered epoch E, so it finished the last launch).
// The other CTAs run the attention engine over tiles (step, batch, head, query block) in step
// order; the producer waits for ARRIVED[step] before loading a step's keys. The epilogue merges
// each half tile into fp32 accumulators (log-sum-exp rule) after the same half tile of the
// previous step (tile_flags), and at the last step writes the normalised output and the lse.
// When every half tile of step s has merged (and the block was forwarded), rank me tells rank
// me-1 that slot s % 2 is free (FREE[s] there). Waits: compute on arrivals and on earlier claims,
// forwarding on arrivals and on the next rank's earlier steps: no cycle.
#include "common.cuh"
#include "signals.cuh"
#include "peers.cuh"
#include "copy.cuh"
#include "ring_args.cuh"
#include "queue.cuh"
#include "attn_mainloop.cuh"
#include "trace.cuh"

// 16-byte loads in flight per forwarding thread (copy_vectors), in registers; or, with
// args.comm_staged, through RING_STAGE_BYTES of the forwarder's shared memory (idle until it turns
// to attention; every staged copy has landed by then).
constexpr u32 RING_IN_FLIGHT = 4;
// Loads of the previous step's accumulators in flight per merging thread (registers: 2 each).
constexpr int RING_MERGE_LOADS = 8;
template <int D>
constexpr u32 RING_STAGE_BYTES = (D == 128 ? 192u : 96u) << 10;

// The node's ranks (IPC-mapped workspaces). The ring is node-major, so a ring rank on this node is
// peer rank % local; a neighbour on another node is reached through the proxy (next_remote,
// prev_remote): only the ranks at a node's ends, so each block crosses each node boundary once.
MK_DEV MkPeers ring_peers(const MkRingArgs& r) { return MkPeers{r.peer_base, (u32)r.local, (u32)r.lrank}; }
MK_DEV u32* ring_flags(const MkRingArgs& r, u32 rank) {
  return peer_ptr<u32>(ring_peers(r), rank % (u32)r.local, r.flags_off);
}
MK_DEV u32 ring_src(const MkRingArgs& r, u32 step) { return ((u32)r.me + (u32)r.world - step) % (u32)r.world; }

// Positions of rank `rank`'s rows: zigzag (chunks rank and 2W-1-rank of S/2 rows) or contiguous.
MK_DEV MkAttnPos ring_positions(const MkRingArgs& r, u32 rank) {
  const int S = r.a.seq_kv, W = r.world;
  MkAttnPos p;
  p.pad = 0;
  if (r.zigzag) {
    const int half = S / 2;
    p.half = half;
    p.off0 = (int)rank * half;
    p.off1 = (2 * W - 1 - (int)rank) * half - half;
  } else {
    p.half = 0x7fffffff;
    p.off0 = p.off1 = (int)rank * S;
  }
  return p;
}

// Rows (b, s) of a step's block that travel: of rank 0's, under the zigzag (B = 1), src0_rows: its
// second chunk holds the sequence's last positions, which only rank 0's own queries see.
MK_DEV u32 ring_rows_sent(const MkRingArgs& r, u32 step) {
  return ring_src(r, step) == 0 ? r.src0_rows : (u32)r.a.batch * (u32)r.a.seq_kv;
}
// Between nodes: bytes of one row (b, s) of K (or V), and a step's WRITEs (K's rows sent in
// chunks of chunk_bytes, then V's as many).
MK_DEV u64 ring_row_bytes(const MkRingArgs& r) { return r.kv_bytes / 2 / ((u64)r.a.batch * (u64)r.a.seq_kv); }
MK_DEV u32 ring_remote_chunks(const MkRingArgs& r, u32 step) {
  return 2u * (u32)(((u64)ring_rows_sent(r, step) * ring_row_bytes(r) + r.chunk_bytes - 1) / r.chunk_bytes);
}

// A slot step's completion: every half tile merged (2 per tile) and, for steps W-2 and before,
// the block forwarded. The last to count tells the previous rank the slot is free, when it will
// write that slot again (step + 2 < W).
MK_DEV void ring_step_done(const MkRingArgs& r, u32 step, u32 E) {
  const u32 W = (u32)r.world;
  const u32 target = 2u * r.tiles_per_step + (step + 1 < W ? 1u : 0u);
  if (atomicAdd(&r.counters[RING_CNT_STEP + step], 1u) + 1 == target && step >= 1 && step + 2 < W) {
    const u32 prev = ((u32)r.me + W - 1) % W;
    if (r.prev_remote)
      queue_push(r.a.sync, r.queue, mk_signal_cmd(prev, RING_PF_FREE + step, E, MK_FLAG_SET));
    else
      set_flag(ring_flags(r, prev) + RING_FLAG_FREE + step, E);
  }
}

template <class Cfg>
struct RingTiles {
  const MkRingArgs& r;
  const AttnTileSpace& space;  // num_tiles = world * tiles_per_step
  u32 E;
  MK_DEV u32 claim() const { return sched_next(r.a.sched, space, r.a.sync); }
  MK_DEV AttnTile decode(u32 id) const {
    const u32 step = id / r.tiles_per_step;
    return space.template decode<Cfg>(id - step * r.tiles_per_step, step, ring_positions(r, ring_src(r, step)));
  }
  MK_DEV void before_loads(const AttnTile& t) const {
    if (t.step > 0)
      wait_epoch(r.a.sync, ring_flags(r, (u32)r.me) + RING_FLAG_ARRIVED + t.step, E, (i32)ring_src(r, t.step),
                 0x5200u + t.step);
  }
  MK_DEV const TmaDesc* kmap(const AttnTile& t) const { return t.step == 0 ? &r.a.k : &r.k_slot[t.step % 2]; }
  MK_DEV const TmaDesc* vmap(const AttnTile& t) const { return t.step == 0 ? &r.a.v : &r.v_slot[t.step % 2]; }
};

// Merges one half tile (64 rows of one consumer) into the accumulators, in step order.
template <class Cfg>
struct RingMergeEpi {
  const MkRingArgs& r;
  u32 E;
  MK_DEV void operator()(const AttnTile& t, const AttnRows& st, const float (&o)[Cfg::D / 2], int row0, int wg) const {
    constexpr int D = Cfg::D;
    const MkAttnArgs& a = r.a;
    const u32 tid = threadIdx.x & 127, lane = tid & 31;
    const int S = a.seq_q, H = a.heads_q;
    const bool first = t.step == 0, last = t.step + 1 == (u32)r.world;
    unsigned int* flag = r.tile_flags + 2 * t.id + wg;
    const u64 t0 = trace_start(a.sync);
    if (!first) {
      if (tid == 0) wait_epoch(a.sync, flag, E * 16u + t.step - 1u, -1, 0x5300u + t.step);
      named_bar_sync(MK_BAR_EPI + wg, 128);
    }
    const float NEG = MK_NEG_INF;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 8 * h;
      const float l = quad_sum(st.l[h]);  // (a warp shuffle: every lane, before any lane leaves)
      if (row >= S) continue;
      const i64 mi = ((i64)t.b * H + t.h) * S + row;
      float* acc = r.o_acc + (((i64)t.b * S + row) * H + t.h) * D + 2 * (lane & 3);
      // Loads go before stores, RING_MERGE_LOADS at a time: interleaved, each waited a round trip.
      float mo = NEG, lo = 0.f;
      if (!first) {
        mo = __ldcg(r.m_acc + mi);
        lo = __ldcg(r.l_acc + mi);
      }
      const float mc = l > 0.f ? st.m[h] * a.scale_log2 : NEG;  // this step (log2 units)
      const float mn = fmaxf(mo, mc);
      const float ao = mo == NEG ? 0.f : ex2_approx(mo - mn);
      const float ac = mc == NEG ? 0.f : ex2_approx(mc - mn);
      const float ln = lo * ao + l * ac;
      const float inv = ln > 0.f ? 1.f / ln : 0.f;
      u8* out = reinterpret_cast<u8*>(r.out) +
                ((i64)t.b * r.out_stride_b + (i64)row * r.out_stride_s + (i64)t.h * D + 2 * (lane & 3)) * 2;
#pragma unroll
      for (int j0 = 0; j0 < D / 8; j0 += RING_MERGE_LOADS) {
        float2 prev[RING_MERGE_LOADS];
        if (!first) {
#pragma unroll
          for (int j = 0; j < RING_MERGE_LOADS; ++j)
            prev[j] = __ldcg(reinterpret_cast<const float2*>(acc + 8 * (j0 + j)));
        }
#pragma unroll
        for (int j = 0; j < RING_MERGE_LOADS; ++j) {
          float x0 = o[4 * (j0 + j) + 2 * h] * ac, x1 = o[4 * (j0 + j) + 2 * h + 1] * ac;
          if (!first) {
            x0 += prev[j].x * ao;
            x1 += prev[j].y * ao;
          }
          if (last)
            *reinterpret_cast<u32*>(out + 16 * (j0 + j)) = pack2<Cfg::DT>(x0 * inv, x1 * inv);
          else
            *reinterpret_cast<float2*>(acc + 8 * (j0 + j)) = make_float2(x0, x1);
        }
      }
      if ((lane & 3) == 0) {
        if (last) {
          if (a.lse) a.lse[mi] = ln > 0.f ? mn * 0.69314718f + __logf(ln) : NEG;
        } else {
          r.m_acc[mi] = mn;
          r.l_acc[mi] = ln;
        }
      }
    }
    // The barrier orders the warpgroup's stores before thread 0's release (cumulative): no fence each.
    named_bar_sync(MK_BAR_EPI + wg, 128);
    if (tid == 0) {
      if (!last) set_flag(flag, E * 16u + t.step);
      ring_step_done(r, t.step, E);
      if (wg == 0) trace_span(a.sync, MK_ROLE_COMPUTE, RING_TRACE_MERGE | t.step << 16 | (t.id & 0xffffu), t0);
    }
  }
};

// A forwarding CTA: copies blocks to the next rank, chunk by chunk (chunk_rows rows (b, s) of
// K and V), step by step. Rows are H_kv * D contiguous elements (16-byte vectors).
// Previous rank on another node, first forwarding CTA: once every chunk flag of step s arrived
// (the proxy set them), publish ARRIVED[s] in device memory, where the producers and the other
// forwarders wait for it.
MK_DEV bool ring_receive_remote(const MkRingArgs& r, u32 step, u32 E) {
  __shared__ int s_bad;
  if (threadIdx.x == 0) s_bad = 0;
  __syncthreads();
  const u32 prev = ((u32)r.me + (u32)r.world - 1) % (u32)r.world;
  const u32* f = r.pflags + RING_PF_CHUNK + (step - 1) * r.chunks;
  const u64 t0 = trace_start(r.a.sync);
  const u32 n = ring_remote_chunks(r, step);
  for (u32 c = threadIdx.x; c < n; c += blockDim.x) {
    if (!wait_remote_epoch(r.a.sync, r.queue, f + c, E, (i32)prev, 0x5600u + step)) s_bad = 1;
    trace_span(r.a.sync, MK_ROLE_RECV, RING_TRACE_RECV | step << 16 | c, t0);
  }
  __syncthreads();
  if (threadIdx.x == 0 && !s_bad) {
    set_flag(ring_flags(r, (u32)r.me) + RING_FLAG_ARRIVED + step, E);
    trace_span(r.a.sync, MK_ROLE_CONTROL, RING_TRACE_ARRIVED | step << 16, t0);
  }
  return !s_bad;
}

// The FLUSH of a step's WRITEs completed: the step's source (staging or slot) may be reused.
MK_DEV void ring_flush_done(const MkRingArgs& r, u32 step, u32 E, u64 t0) {
  const u32 next = ((u32)r.me + 1) % (u32)r.world;
  if (wait_remote_epoch(r.a.sync, r.queue, r.pflags + RING_PF_FLUSH + step, E, (i32)next, 0x5700u + step)) {
    ring_step_done(r, step, E);
    trace_span(r.a.sync, MK_ROLE_CONTROL, RING_TRACE_FLUSH | step << 16, t0);
  }
}

// Next rank on another node: one WRITE per chunk of K's rows sent, then of V's (each with its own
// arrival flag there); the CTA that enqueued the last chunk of a step flushes and waits for it,
// or with defer (the receiver: its next receipt comes first) returns true in thread 0.
MK_DEV bool ring_send_remote(const MkRingArgs& r, u32 step, u32 E, u32* s_item, bool defer) {
  bool pending = false;
  const u32 W = (u32)r.world, me = (u32)r.me, next = (me + 1) % W;
  const u64 src = step == 0 ? r.stage_off : r.kslot_off[step % 2];
  const u64 dst = r.kslot_off[(step + 1) % 2];
  const u64 half = r.kv_bytes / 2, seg = (u64)ring_rows_sent(r, step) * ring_row_bytes(r);
  const u32 n = ring_remote_chunks(r, step);
  for (;;) {
    if (threadIdx.x == 0) *s_item = atomicAdd(&r.counters[RING_CNT_CLAIM + step], 1u);
    __syncthreads();
    const u32 c = *s_item;
    __syncthreads();
    if (c >= n) break;
    if (threadIdx.x == 0) {
      const u64 t0 = trace_start(r.a.sync);
      const u64 in_seg = (u64)(c % (n / 2)) * r.chunk_bytes, off = (c < n / 2 ? 0 : half) + in_seg;
      const u32 bytes = (u32)min((u64)r.chunk_bytes, seg - in_seg);
      queue_push(
          r.a.sync, r.queue,
          mk_write_cmd(next, 0, src + off, 0, dst + off, bytes, RING_PF_CHUNK + step * r.chunks + c, E, MK_FLAG_SET));
      trace_span(r.a.sync, MK_ROLE_SEND, RING_TRACE_SEND | step << 16 | c, t0);
      if (atomicAdd(&r.counters[RING_CNT_SENT + step], 1u) + 1 == n &&
          queue_push(r.a.sync, r.queue, mk_flush_cmd(next, RING_PF_FLUSH + step, E))) {
        if (defer)
          pending = true;
        else
          ring_flush_done(r, step, E, t0);
      }
    }
  }
  return pending;
}

// This rank entered epoch E: its node's peers may write its slots, and so may the previous rank
// on another node (through the proxy).
MK_DEV void ring_announce(const MkRingArgs& r, u32 E) {
  credits_announce(ring_peers(r), E);
  if (r.prev_remote)
    queue_push(r.a.sync, r.queue,
               mk_signal_cmd(((u32)r.me + (u32)r.world - 1) % (u32)r.world, RING_PF_CREDIT, E, MK_FLAG_SET));
}

// True: this CTA attends (W = 1; or, from step 2 on, no attention CTA of this rank has arrived: a
// forwarder but the first turns to attention, as forwarding waits on the next rank's attention).
template <int D>
MK_DEV bool ring_forward_cta(const MkRingArgs& r, u32 E, u32 role, u32 forwarders) {
  __shared__ u32 s_item;
  __shared__ int s_ok;
  const u32 W = (u32)r.world, me = (u32)r.me, next = (me + 1) % W;
  const bool receiver = r.prev_remote && role == 0;
  const MkPeers peers = ring_peers(r);
  const u32 S = (u32)r.a.seq_kv;
  const u32 row_bytes = (u32)r.a.heads_kv * D * 2, vpr = row_bytes / 16;
  extern __shared__ __align__(1024) u8 mk_smem[];
  const MkStage st =
      r.comm_staged ? MkStage{(u32)__cvta_generic_to_shared(mk_smem), RING_STAGE_BYTES<D>} : MkStage{0, 0};
  u32 flush = 0;  // thread 0 of the receiver: its FLUSH still to wait for, step + 1 (0: none)
  for (u32 step = 0; step < W; ++step) {
    if (receiver && step > 0 && !ring_receive_remote(r, step, E)) return false;
    if (flush) {  // (the receiver's last step is a receipt: none is left)
      ring_flush_done(r, flush - 1, E, trace_start(r.a.sync));
      flush = 0;
    }
    if (step + 1 == W) break;
    if (step >= 2 && role != 0) {
      if (threadIdx.x == 0) s_ok = ld_relaxed_sys(&r.counters[RING_CNT_ARRIVE]) <= forwarders ? 2 : 1;
      __syncthreads();
      if (s_ok == 2) return true;
    }
    if (threadIdx.x == 0) {
      bool ok = true;
      if (step > 0)  // the block to forward is in my slot once it arrived
        ok = wait_epoch(r.a.sync, ring_flags(r, me) + RING_FLAG_ARRIVED + step, E, (i32)ring_src(r, step),
                        0x5400u + step);
      // The block goes into the next rank's slot (step + 1) % 2, which that rank last read at
      // step - 1 (it says so with FREE + step - 1, from step 1 on) or, for steps 0 and 1, in the
      // previous launch (its credit, waited for at step 0: it has entered this epoch).
      if (ok && step != 1 && r.next_remote) {  // its proxy flags
        ok = step >= 2 ? wait_remote_epoch(r.a.sync, r.queue, r.pflags + RING_PF_FREE + (step - 1), E, (i32)next,
                                           0x5500u + step)
                       : wait_remote_epoch(r.a.sync, r.queue, r.pflags + RING_PF_CREDIT, E, (i32)next, 0x5500u);
      } else if (ok && step != 1) {
        ok = step >= 2
                 ? wait_epoch(r.a.sync, ring_flags(r, me) + RING_FLAG_FREE + (step - 1), E, (i32)next, 0x5500u + step)
                 : credits_wait(r.a.sync, peers, next % (u32)r.local, E);
      }
      s_ok = ok ? 1 : 0;
    }
    __syncthreads();
    if (!s_ok) return false;
    if (r.next_remote) {
      if (ring_send_remote(r, step, E, &s_item, receiver)) flush = step + 1;
      continue;
    }
    const int slot = (int)((step + 1) % 2);
    const u32 dl = next % (u32)r.local, ml = (u32)r.lrank;
    u8* dk = peer_ptr<u8>(peers, dl, r.kslot_off[slot]);
    u8* dv = peer_ptr<u8>(peers, dl, r.vslot_off[slot]);
    const u8* sk = step == 0 ? reinterpret_cast<const u8*>(r.k_own) : peer_ptr<u8>(peers, ml, r.kslot_off[step % 2]);
    const u8* sv = step == 0 ? reinterpret_cast<const u8*>(r.v_own) : peer_ptr<u8>(peers, ml, r.vslot_off[step % 2]);
    const u32 rows = ring_rows_sent(r, step), chunks = (rows + r.chunk_rows - 1) / r.chunk_rows;
    const i64 sb = step == 0 ? r.own_stride_b : (i64)S * row_bytes;
    const i64 ss = step == 0 ? r.own_stride_s : (i64)row_bytes;
    for (;;) {
      if (threadIdx.x == 0) s_item = atomicAdd(&r.counters[RING_CNT_CLAIM + step], 1u);
      __syncthreads();
      const u32 c = s_item;
      __syncthreads();
      if (c >= chunks) break;
      const u64 t0 = trace_start(r.a.sync);
      const u32 r0 = c * r.chunk_rows, nr = min(r.chunk_rows, rows - r0);
      const u32 nv = nr * vpr;  // vectors of k; those of v follow
      const auto at = [&](u32 v, i64& src_off, i64& dst_off) {
        const u32 w = v < nv ? v : v - nv, row = r0 + w / vpr, b = row / S, srow = row - b * S;
        const u32 off = (w % vpr) * 16;
        src_off = (i64)b * sb + (i64)srow * ss + off;
        dst_off = (i64)row * row_bytes + off;
      };
      copy_vectors<RING_IN_FLIGHT>(
          st, 2 * nv, threadIdx.x, blockDim.x,
          [&](u32 v) {
            i64 s, d;
            at(v, s, d);
            return (v < nv ? sk : sv) + s;
          },
          [&](u32 v, uint4 x) {
            i64 s, d;
            at(v, s, d);
            st_v4((v < nv ? dk : dv) + d, x);
          });
      __threadfence_system();
      __syncthreads();
      if (threadIdx.x == 0) trace_span(r.a.sync, MK_ROLE_INTRA, RING_TRACE_SEND | step << 16 | c, t0);
      if (threadIdx.x == 0 && atomicAdd(&r.counters[RING_CNT_SENT + step], 1u) + 1 == chunks) {
        set_flag(ring_flags(r, next) + RING_FLAG_ARRIVED + step + 1, E);
        ring_step_done(r, step, E);  // the block of this step has left: my slot may be reused
      }
    }
  }
  return W == 1;
}

template <int DT, int D, bool CAUSAL>
__global__ void __launch_bounds__(384, 1) mk_ring_attention_kernel(const __grid_constant__ MkRingArgs r) {
  using Cfg = AttnCfg<DT, D, CAUSAL>;
  static_assert(RING_STAGE_BYTES<D> <= attn_smem_bytes<Cfg>(), "the forwarders' stage fits the launch's shared memory");
  extern __shared__ __align__(1024) u8 mk_smem[];
  const MkAttnArgs& a = r.a;
  __shared__ u32 s_role;
  if (threadIdx.x == 0) s_role = atomicAdd(&r.counters[RING_CNT_ARRIVE], 1u);
  __syncthreads();
  const u32 role = s_role, forwarders = gridDim.x - (u32)r.attn_ctas;
  bool attend = role >= forwarders;
  if (!attend) {
    __shared__ u32 s_epoch;
    if (threadIdx.x == 0) {
      s_epoch = launch_epoch(a.sync);
      if (role == 0) {
        ring_announce(r, s_epoch);
        trace_span(a.sync, MK_ROLE_CONTROL, RING_TRACE_ANNOUNCE | s_epoch, trace_start(a.sync));
      }
    }
    __syncthreads();
    attend = ring_forward_cta<D>(r, s_epoch, role, forwarders);
    __syncthreads();
  }
  if (attend) {  // (the epoch is still this launch's: this CTA has not left)
    const AttnSmem<Cfg> sm = attn_smem_carve<Cfg>(mk_smem);
    attn_setup<Cfg>(a, sm);
    const u32 E = sm.bars->epoch;
    warpgroup_roles<Cfg>(
        [&] {
          const AttnTileSpace space{a, a.sched.num_tiles};
          attn_producer<Cfg>(a, sm, RingTiles<Cfg>{r, space, E});
        },
        [&](int wg) { attn_consumer<Cfg>(a, sm, wg, RingMergeEpi<Cfg>{r, E}); });
    __syncthreads();  // the consumers' merges count in the step counters: reset only after them
  }
  if (threadIdx.x == 0) {
    sched_finish(a.sched);
    trace_span(a.sync, MK_ROLE_CONTROL, RING_TRACE_EXIT | blockIdx.x, trace_start(a.sync));
    counters_reset_by_last_block(r.counters, RING_CNT_WORDS, RING_CNT_DONE);
  }
  launch_exit(a.sync, launch_epoch(a.sync));
}

static_assert(sizeof(MkRingArgs) == 1536, "MkRingArgs layout changed: update mkernel/ops/ring_attention.py");
