// Kernels that exercise the runtime's protocol between ranks: writes into peers' symmetric memory
// through the pointer table, epoch flags, credits (a slow receiver is never overwritten), timeouts.
#include "peers.cuh"
#include "runtime_test_args.cuh"
#include "trace.cuh"

// Word offsets in this test's flag area of every workspace.
constexpr u32 ARRIVED = 0;  // [sender]: sender's slot data of epoch E is complete
constexpr u32 PING = MK_MAX_LOCAL;
constexpr u32 PONG = MK_MAX_LOCAL + 1;

MK_DEV MkPeers peers_of(const RuntimeTestArgs& a) { return MkPeers{a.peers, a.local_size, a.local_rank}; }
MK_DEV u32* flags_of(const RuntimeTestArgs& a, u32 rank) { return peer_ptr<u32>(peers_of(a), rank, a.flags_off); }
// Slot in `owner`'s workspace that `sender` writes.
MK_DEV u32* slot_of(const RuntimeTestArgs& a, u32 owner, u32 sender) {
  return peer_ptr<u32>(peers_of(a), owner, a.slots_off) + (u64)sender * a.words;
}
MK_DEV u32 pattern(u32 epoch, u32 sender, u32 i) { return (epoch * 2654435761u) ^ (sender << 24) ^ i; }

MK_DEV void spin_ns(u32 ns) {
  const u64 until = globaltimer_ns() + ns;
  while (globaltimer_ns() < until) __nanosleep(256);
}

// Block-wide: thread 0 waits, everybody learns the result.
template <typename Wait>
MK_DEV bool block_wait(Wait wait) {
  __shared__ int ok;
  __syncthreads();
  if (threadIdx.x == 0) ok = wait();
  __syncthreads();
  return ok;
}

// Every rank writes a fresh pattern into its slot of every peer, then checks what it received.
MK_DEV bool exchange_body(const RuntimeTestArgs& a, u32 E) {
  const u32 me = a.local_rank;
  const MkPeers peers = peers_of(a);
  u32* mine = flags_of(a, me);
  if (threadIdx.x == 0) credits_announce(peers, E);
  for (u32 p = 0; p < a.local_size; ++p) {
    if (!a.skip_credit && !block_wait([&] { return credits_wait(a.sync, peers, p, E); })) return false;
    u32* dst = slot_of(a, p, me);
    for (u32 i = threadIdx.x; i < a.words; i += blockDim.x) dst[i] = pattern(E, me, i);
    __threadfence_system();  // each writer's data before the flag (cumulative with the barrier)
    __syncthreads();
    if (threadIdx.x == 0) set_flag(flags_of(a, p) + ARRIVED + me, E);
  }
  for (u32 p = 0; p < a.local_size; ++p) {
    // Without credits a sender may already be an epoch ahead: wait for "at least" so that the
    // negative control shows overwritten data instead of timing out.
    const bool arrived = block_wait([&] {
      return a.skip_credit ? wait_at_least(a.sync, mine + ARRIVED + p, E, (i32)p, ARRIVED + p)
                           : wait_epoch(a.sync, mine + ARRIVED + p, E, (i32)p, ARRIVED + p);
    });
    if (!arrived) return false;
    if (a.consume_delay_ns && threadIdx.x == 0) spin_ns(a.consume_delay_ns);
    __syncthreads();
    const u32* src = slot_of(a, me, p);
    u32 bad = 0;
    for (u32 i = threadIdx.x; i < a.words; i += blockDim.x) {
      const u32 v = src[i];
      if (v != pattern(E, p, i)) {
        if (bad++ == 0 && atomicCAS(a.first_mismatch, 0u, 1u) == 0u) {
          a.first_mismatch[1] = E;
          a.first_mismatch[2] = p;
          a.first_mismatch[3] = i;
          a.first_mismatch[4] = v;
        }
      }
    }
    if (bad) atomicAdd(a.mismatches, bad);
  }
  return true;
}

extern "C" __global__ void __launch_bounds__(256, 1) exchange(const __grid_constant__ RuntimeTestArgs a) {
  const u32 E = launch_epoch(a.sync);
  const u64 t0 = globaltimer_ns();
  exchange_body(a, E);
  if (threadIdx.x == 0) trace_span(a.sync, MK_ROLE_INTRA, E, t0);
  launch_exit(a.sync, E);
}

// Rounds of ping (rank 0 -> 1) and pong (1 -> 0) inside one launch; values are unique per round.
extern "C" __global__ void pingpong(const __grid_constant__ RuntimeTestArgs a) {
  const u32 E = launch_epoch(a.sync);
  if (threadIdx.x == 0 && a.local_rank < 2 && a.local_size >= 2) {
    const u32 me = a.local_rank, peer = 1 - me;
    const u32 base = E * a.rounds;
    for (u32 i = 0; i < a.rounds; ++i) {
      const u32 v = base + i;
      if (me == 0) {
        set_flag(flags_of(a, peer) + PING, v);
        if (!wait_epoch(a.sync, flags_of(a, me) + PONG, v, (i32)peer, PONG)) break;
      } else {
        if (!wait_epoch(a.sync, flags_of(a, me) + PING, v, (i32)peer, PING)) break;
        set_flag(flags_of(a, peer) + PONG, v);
      }
    }
  }
  launch_exit(a.sync, E);
}

// Message passing through mapped host memory: block 0 writes data then a flag; block 1 must never
// see the flag without the data; an ack paces the rounds.
extern "C" __global__ void litmus_host(const __grid_constant__ RuntimeTestArgs a) {
  const u32 E = launch_epoch(a.sync);
  u32* data = a.host_area;
  u32* flag = a.host_area + a.words;
  u32* ack = flag + 1;
  for (u32 r = 0; r < a.rounds; ++r) {
    const u32 v = E * a.rounds + r;
    if (blockIdx.x == 0) {
      for (u32 i = threadIdx.x; i < a.words; i += blockDim.x) data[i] = pattern(v, 0, i);
      __threadfence_system();
      __syncthreads();
      if (threadIdx.x == 0) set_flag(flag, v);
      if (!block_wait([&] { return wait_epoch(a.sync, ack, v, -1, 1); })) break;
    } else {
      if (!block_wait([&] { return wait_epoch(a.sync, flag, v, -1, 0); })) break;
      u32 bad = 0;
      for (u32 i = threadIdx.x; i < a.words; i += blockDim.x) bad += ld_relaxed_sys(data + i) != pattern(v, 0, i);
      if (bad) atomicAdd(a.mismatches, bad);
      __syncthreads();
      if (threadIdx.x == 0) set_flag(ack, v);
    }
  }
  launch_exit(a.sync, E);
}

// Waits on a flag nobody sets: must end with a recorded timeout, not a hang.
extern "C" __global__ void stuck_wait(const __grid_constant__ RuntimeTestArgs a) {
  const u32 E = launch_epoch(a.sync);
  if (threadIdx.x == 0)
    wait_epoch(a.sync, flags_of(a, a.local_rank) + PING, E + 12345u, (i32)((a.local_rank + 1) % a.local_size), PING);
  launch_exit(a.sync, E);
}
