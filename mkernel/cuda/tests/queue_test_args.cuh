#pragma once
// Argument structs of queue_test.cu, mirrored by ctypes in mkernel/comm/proxy.py (a CPU test compares them).
#include "queue_layout.cuh"
#include "sync_args.cuh"

struct QueueStressArgs {
  MkSync sync;
  MkQueue queue;
  unsigned int iters;  // rounds of 32 commands per warp
  unsigned int bad_first_command;  // nonzero: warp 0's first command names rank 0xFFFF (the proxy must refuse it)
};

struct TileExchangeArgs {
  MkSync sync;
  MkQueue queue;
  unsigned int* send;  // device: tiles this rank writes (registered as send_region)
  unsigned int* recv;  // device: tiles the peer writes here (registered as recv_region)
  unsigned int* flags;  // mapped host memory: the proxy's flag array (tiles + 1: the last is the FLUSH's)
  unsigned int* mismatches;  // device: words that differed from the peer's pattern
  unsigned int tiles, tile_bytes, flag_base, peer, send_region, recv_region;
  unsigned long long send_off, recv_off;  // where the tiles start inside their regions (bytes)
};
