#pragma once
// The device side of the command queue: GPU threads (communication warps of a persistent kernel)
// enqueue WRITE / SIGNAL / FLUSH commands that the host proxy turns into network operations.
// Layout and protocol: queue_layout.cuh; docs/TRANSPORT.md.
//
// Ordering, per command: the ticket comes from a device-memory counter (GPU atomics on host memory
// are not native on our machines); the body is written with plain stores; seq is published last with
// st.release.sys, so the proxy's acquire load of seq sees the whole body. Data a command points at
// must be visible at system scope before the command is published: written by the publishing thread,
// or by its block before a __syncthreads() (release is cumulative).
//
// Between reserving a ticket and publishing it a producer must wait on nothing but queue space: the
// proxy consumes in ticket order, so a held ticket that is never published stalls every later one.
#include "common.cuh"
#include "queue_layout.cuh"
#include "signals.cuh"

MK_STATIC_ASSERT(sizeof(MkCmd) == MK_CMD_BYTES, "MkCmd is 32 bytes");
MK_STATIC_ASSERT(sizeof(MkQueueHeader) == 128, "MkQueueHeader is two 64-byte lines");

// MkStatus.where of a producer that timed out waiting for queue space (or saw the proxy fail).
constexpr u32 MK_WHERE_QUEUE_SPACE = 0xFFFFFF01u;
// MkStatus.where of a flag wait that saw the proxy fail.
constexpr u32 MK_WHERE_PROXY = 0xFFFFFF02u;

MK_DEV MkCmd mk_cmd(u32 type, u32 peer, u32 flag_op, u32 flag_id, u32 flag_value) {
  MkCmd c;
  c.seq = 0;
  c.type = (u8)type;
  c.flag_op = (u8)flag_op;
  c.peer = (u16)peer;
  c.bytes = 0;
  c.flag_value = flag_value;
  c.flag_id = (u16)flag_id;
  c.src_region = 0;
  c.dst_region = 0;
  c.src_off_hi = 0;
  c.dst_off_hi = 0;
  c.src_off_lo = 0;
  c.dst_off_lo = 0;
  return c;
}

// bytes from this rank's (src_region, src_off) to peer's (dst_region, dst_off); then the peer's flag_id
// gets flag_value (MK_FLAG_SET: an epoch) or is incremented by it (MK_FLAG_ADD).
MK_DEV MkCmd mk_write_cmd(u32 peer, u32 src_region, u64 src_off, u32 dst_region, u64 dst_off, u32 bytes, u32 flag_id,
                          u32 flag_value, u32 flag_op = MK_FLAG_SET) {
  MkCmd c = mk_cmd(MK_CMD_WRITE, peer, flag_op, flag_id, flag_value);
  c.bytes = bytes;
  c.src_region = (u8)src_region;
  c.dst_region = (u8)dst_region;
  c.src_off_hi = MK_OFFSET_HI(src_off);
  c.src_off_lo = MK_OFFSET_LO(src_off);
  c.dst_off_hi = MK_OFFSET_HI(dst_off);
  c.dst_off_lo = MK_OFFSET_LO(dst_off);
  return c;
}

// The peer's flag_id is set to or incremented by flag_value; not ordered after earlier WRITEs (FLUSH first).
MK_DEV MkCmd mk_signal_cmd(u32 peer, u32 flag_id, u32 flag_value, u32 flag_op) {
  return mk_cmd(MK_CMD_SIGNAL, peer, flag_op, flag_id, flag_value);
}

// Once everything enqueued before it to `peer` is applied there, this rank's own flag_id gets flag_value.
MK_DEV MkCmd mk_flush_cmd(u32 peer, u32 local_flag_id, u32 flag_value) {
  return mk_cmd(MK_CMD_FLUSH, peer, MK_FLAG_SET, local_flag_id, flag_value);
}

MK_DEV bool proxy_failed(const MkQueue& q) { return ld_relaxed_sys(&q.header->error) != 0; }

// Records the proxy's failure in the launch's error word (the host raises the proxy's own message).
MK_DEV void record_proxy_error(const MkSync& s, const MkQueue& q, i32 peer, u32 where, u32 expected) {
  const u32 code = ld_relaxed_sys(&q.header->error);
  record_error(s, code == MK_ERR_TIMEOUT ? MK_ERR_TIMEOUT : MK_ERR_PEER, peer, where, expected, code, 0);
}

// The tail as last seen by any producer, cached in device memory (reserve[1]): most reservations
// are checked against it without a read across PCIe.
MK_DEV u64 cached_tail(const MkQueue& q) { return *(volatile const u64*)(q.reserve + 1); }

// Reads the proxy's tail from host memory and raises the cache to it.
MK_DEV u64 fresh_tail(const MkQueue& q) {
  const u64 tail = ld_acquire_sys64(&q.header->tail);
  atomicMax(q.reserve + 1, tail);
  return tail;
}

// Waits until ticket t has a free slot (t < tail + capacity). False once a timeout is recorded, or an
// error is seen (this launch's or the proxy's). Polls back off, so that thousands of waiting warps do
// not flood PCIe with reads of the line the proxy writes.
MK_DEV bool queue_wait_space(const MkSync& s, const MkQueue& q, u64 t) {
  if (t <= cached_tail(q) + q.mask) return true;
  u64 tail = fresh_tail(q);
  if (t <= tail + q.mask) return true;
  const u64 start = globaltimer_ns();
  u32 pause = 64;
  for (;;) {
    for (u32 i = 0; i < MK_POLL_BATCH / 8; ++i) {
      __nanosleep(pause);
      tail = fresh_tail(q);
      if (t <= tail + q.mask) return true;
      pause = pause < 4096 ? pause * 2 : pause;
    }
    if (error_recorded(s)) return false;
    if (proxy_failed(q)) {
      record_proxy_error(s, q, -1, MK_WHERE_QUEUE_SPACE, (u32)t);
      return false;
    }
    const u64 waited = globaltimer_ns() - start;
    if (waited > s.timeout_ns) {
      record_error(s, MK_ERR_TIMEOUT, -1, MK_WHERE_QUEUE_SPACE, (u32)t, (u32)tail, waited);
      return false;
    }
  }
}

// The communicator's names -> the proxy's: rank, workspace offsets, flag id (see MkQueue).
MK_DEV MkCmd queue_translate(const MkQueue& q, MkCmd c) {
  if (q.ranks) c.peer = q.ranks[c.peer];
  c.flag_id = (unsigned short)(c.flag_id + q.flag_base);
  if (c.type == MK_CMD_WRITE) {
    const u64 src =
        MK_CMD_OFFSET(c.src_off_hi, c.src_off_lo) + (c.src_region == MK_WORKSPACE_REGION ? q.workspace_base : 0);
    const u64 dst =
        MK_CMD_OFFSET(c.dst_off_hi, c.dst_off_lo) + (c.dst_region == MK_WORKSPACE_REGION ? q.workspace_base : 0);
    c.src_off_hi = MK_OFFSET_HI(src);
    c.src_off_lo = MK_OFFSET_LO(src);
    c.dst_off_hi = MK_OFFSET_HI(dst);
    c.dst_off_lo = MK_OFFSET_LO(dst);
  }
  return c;
}

// Body first (words 1..7), then seq with a system-scope release.
MK_DEV void queue_write_slot(const MkQueue& q, u64 t, const MkCmd& cmd) {
  MkCmd* slot = q.slots + (t & q.mask);
  u32* w = reinterpret_cast<u32*>(slot);
  const MkCmd c = queue_translate(q, cmd);
  const u32* src = reinterpret_cast<const u32*>(&c);
#pragma unroll
  for (int i = 1; i < 8; ++i) w[i] = src[i];
  st_release_sys(&slot->seq, (u32)t + 1);
}

// One thread, one command.
MK_DEV bool queue_push(const MkSync& s, const MkQueue& q, const MkCmd& c) {
  const u64 t = atomicAdd(q.reserve, 1ull);
  if (!queue_wait_space(s, q, t)) return false;
  queue_write_slot(q, t, c);
  return true;
}

// The whole warp calls it together; lanes with `active` enqueue their command. One reservation and
// one wait for the warp. Returns the same answer on every lane.
MK_DEV bool queue_push_warp(const MkSync& s, const MkQueue& q, const MkCmd& c, bool active) {
  const u32 lane = threadIdx.x & 31;
  const u32 ballot = __ballot_sync(0xffffffffu, active);
  if (!ballot) return true;
  const u32 n = __popc(ballot);
  u64 base = 0;
  bool ok = true;
  if (lane == 0) {
    base = atomicAdd(q.reserve, (u64)n);
    ok = queue_wait_space(s, q, base + n - 1);  // space for the last implies space for all
  }
  base = __shfl_sync(0xffffffffu, base, 0);
  ok = __shfl_sync(0xffffffffu, ok, 0);
  if (ok && active) queue_write_slot(q, base + __popc(ballot & ((1u << lane) - 1)), c);
  return ok;
}

// Polls of mapped host memory cross PCIe: of the waiters of one flag only one (the claim in its relay
// words) reads the host, backing off from the first to the last pause (ns), and passes each value it
// reads on in device memory, where the others poll; so waiters leave the link to the data.
constexpr u32 MK_REMOTE_PAUSE_FIRST_NS = 128, MK_REMOTE_PAUSE_LAST_NS = 4096, MK_REMOTE_ERROR_EVERY = 8;

// A proxy flag's relay words: [0] the last value a waiter read from the host, [1] 1 while one polls it.
MK_DEV u32* remote_relay(const MkQueue& q, const u32* flag) { return q.relay + 2 * (flag - q.flags); }

// A proxy flag's value as its waiters last relayed it (device memory only; may lag the host).
MK_DEV u32 remote_peek(const MkQueue& q, const u32* flag) { return ld_acquire_sys(remote_relay(q, flag)); }

// Waits for a flag a peer's proxy sets (in mapped host memory) to satisfy done(); gives up,
// recording it, when the proxy reports a failure instead of waiting out the timeout.
template <typename Done>
MK_DEV bool wait_remote(const MkSync& s, const MkQueue& q, const u32* flag, Done done, u32 expected, i32 peer,
                        u32 where) {
  u32* relay = remote_relay(q, flag);
  u32 v = ld_acquire_sys(relay);
  if (done(v)) return true;
  bool polls = false;  // this waiter holds the claim: it reads the host flag and relays it
  bool ok = false;
  const u64 start = globaltimer_ns();
  for (u32 i = 0, pause = MK_REMOTE_PAUSE_FIRST_NS;; ++i) {
    if (!polls && atomicCAS(relay + 1, 0u, 1u) == 0u) polls = true;
    if (polls) {
      const u32 h = ld_acquire_sys(flag);
      if (h != v) st_release_sys(relay, h);  // cumulative: what the host flag published is visible too
      v = h;
    } else {
      v = ld_acquire_sys(relay);
    }
    if (done(v)) {
      ok = true;
      break;
    }
    if (error_recorded(s)) break;
    if (polls && i % MK_REMOTE_ERROR_EVERY == 0 && ld_relaxed_sys(&q.header->error) != 0) {
      ok = done(ld_acquire_sys(flag));
      if (!ok) record_proxy_error(s, q, peer, MK_WHERE_PROXY, expected);
      break;
    }
    const u64 waited = globaltimer_ns() - start;
    if (waited > s.timeout_ns) {
      record_error(s, MK_ERR_TIMEOUT, peer, where, expected, v, waited);
      break;
    }
    __nanosleep(pause);
    pause = pause < MK_REMOTE_PAUSE_LAST_NS ? pause * 2 : pause;
  }
  if (polls) st_release_sys(relay + 1, 0u);  // the next waiter that still waits takes the claim
  return ok;
}
MK_DEV bool wait_remote_epoch(const MkSync& s, const MkQueue& q, const u32* flag, u32 epoch, i32 peer, u32 where) {
  return wait_remote(s, q, flag, [epoch](u32 v) { return v == epoch; }, epoch, peer, where);
}
// A counting flag (ADD) at or past the target.
MK_DEV bool wait_remote_at_least(const MkSync& s, const MkQueue& q, const u32* flag, u32 target, i32 peer, u32 where) {
  return wait_remote(s, q, flag, [target](u32 v) { return epoch_reached(v, target); }, target, peer, where);
}
