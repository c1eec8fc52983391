// Kernels of the GPU queue tests and of bench/transport.py.
//
// queue_stress: every warp enqueues `iters` rounds of 32 verify NOPs (warp batches, or one
//   reservation per thread), the encoding the proxy's verify mode checks (host_producer.c):
//   id = (warp * iters + round) * 32 + lane.
// tile_exchange: 2 ranks as 2 nodes. Each block fills tiles of its send buffer with a pattern of
//   (rank, epoch, tile, word), enqueues a WRITE of each to the peer with the tile's flag set to the
//   epoch, then waits for the peer's tiles and checks every word, counting mismatches. Block 0 ends
//   with a FLUSH, so that the next launch may overwrite the send buffer.
#include "common.cuh"
#include "queue.cuh"
#include "queue_test_args.cuh"

template <bool kWarpBatch>
__global__ void queue_stress(const __grid_constant__ QueueStressArgs a) {
  const u32 lane = threadIdx.x & 31;
  const u64 warp = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const u32 epoch = launch_epoch(a.sync);
  for (u32 round = 0; round < a.iters; ++round) {
    const u64 id = (warp * a.iters + round) * 32 + lane;
    MkCmd c = mk_cmd(MK_CMD_NOP, 0, MK_FLAG_NONE, 0, (u32)id);
    if (a.bad_first_command && warp == 0 && round == 0 && lane == 0) c = mk_signal_cmd(0xFFFFu, 0, 1, MK_FLAG_SET);
    c.src_off_lo = (u32)(id >> 32);
    c.bytes = (u32)(id * 2654435761ull);
    c.dst_off_lo = ~(u32)id;
    const bool ok = kWarpBatch ? queue_push_warp(a.sync, a.queue, c, true) : queue_push(a.sync, a.queue, c);
    if (!__all_sync(0xffffffffu, ok)) break;
  }
  launch_exit(a.sync, epoch);
}

MK_DEV u32 tile_word(u32 rank, u32 epoch, u32 tile, u32 i) {
  return (rank * 0x9E3779B1u) ^ (epoch * 0x85EBCA77u) ^ (tile * 0xC2B2AE3Du) ^ (i * 0x27D4EB2Fu);
}

__global__ void tile_exchange(const __grid_constant__ TileExchangeArgs a) {
  const u32 epoch = launch_epoch(a.sync);
  const u32 words = a.tile_bytes / 4;
  for (u32 t = blockIdx.x; t < a.tiles; t += gridDim.x) {
    u32* tile = a.send + (u64)t * words;
    for (u32 i = threadIdx.x; i < words; i += blockDim.x) tile[i] = tile_word(a.sync.rank, epoch, t, i);
    __syncthreads();  // the block's stores, then thread 0's release publishes the WRITE that reads them
    if (threadIdx.x == 0) {
      const MkCmd c =
          mk_write_cmd(a.peer, a.send_region, a.send_off + (u64)t * a.tile_bytes, a.recv_region,
                       a.recv_off + (u64)t * a.tile_bytes, a.tile_bytes, a.flag_base + t, epoch, MK_FLAG_SET);
      queue_push(a.sync, a.queue, c);
    }
  }
  __shared__ bool arrived;
  for (u32 t = blockIdx.x; t < a.tiles; t += gridDim.x) {
    if (threadIdx.x == 0) arrived = wait_remote_epoch(a.sync, a.queue, a.flags + a.flag_base + t, epoch, a.peer, t);
    __syncthreads();
    if (!arrived) break;
    const u32* tile = a.recv + (u64)t * words;
    u32 bad = 0;
    for (u32 i = threadIdx.x; i < words; i += blockDim.x) bad += tile[i] != tile_word(a.peer, epoch, t, i);
    if (bad) atomicAdd(a.mismatches, bad);
    __syncthreads();
  }
  if (blockIdx.x == 0 && threadIdx.x == 0 &&
      queue_push(a.sync, a.queue, mk_flush_cmd(a.peer, a.flag_base + a.tiles, epoch)))
    wait_remote_epoch(a.sync, a.queue, a.flags + a.flag_base + a.tiles, epoch, a.peer, a.tiles);
  launch_exit(a.sync, epoch);
}
