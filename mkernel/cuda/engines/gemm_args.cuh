#pragma once
// The argument struct of the GEMM kernels, shared with Python (mkernel/engines/gemm.py mirrors it with
// ctypes; tests/cpu/test_gemm.py compiles this header with the host g++ and compares the layouts).
// Plain fixed-width fields only, so that a host C++ compiler reads it too.
#include "sync_args.cuh"

#ifndef MK_TMADESC_DEFINED
#define MK_TMADESC_DEFINED
// A CUtensorMap (cuTensorMapEncodeTiled's output): 128 opaque bytes, 64-byte aligned.
struct alignas(64) TmaDesc {
  unsigned long long v[16];
};
#endif

// Role word values (one word per CTA, MkGemmSched::roles): the adaptive controller moves CTAs
// between GEMM tiles and other work; a CTA reads its word before claiming each tile.
enum { MK_SCHED_LEAVE = 0, MK_SCHED_GEMM = 1 };

// MkGemmSched::flags. BY_N: the built-in order groups N-tiles (group_m of them), M-tile by M-tile.
// OWN_FIRST: each claimer's first position is its own (the host sets it where no role word moves
// CTAs and every CTA of the grid is resident at once: a late CTA would run its tile last).
enum { MK_SCHED_BY_N = 1u, MK_SCHED_OWN_FIRST = 2u };

// Output element types.
enum { MK_OUT_BF16 = 0, MK_OUT_F16 = 1, MK_OUT_F32 = 2 };

// Epilogue operations (MkGemmArgs::epi_op).
enum { MK_EPI_STORE = 0, MK_EPI_ADD = 1 };

// The tile scheduler's device state and controls.
struct MkGemmSched {
  const unsigned int* tile_order;  // nullable: tile ids in run order (else the built-in grouped order)
  unsigned int* tile_counter;  // device, zero between launches: next position in the order
  unsigned int* done_count;  // device, zero between launches: CTAs that finished
  const unsigned int* roles;  // nullable: one MK_SCHED_* word per CTA (null: every CTA runs tiles)
  unsigned int num_tiles;  // plain mode: tiles_m * tiles_n; grouped mode: computed on device
  unsigned int tiles_n;  // ceil(N / 256)
  unsigned int group_m;  // built-in order: tiles grouped this many M-tiles (or N-tiles) at a time (L2)
  unsigned int flags;  // MK_SCHED_BY_N | MK_SCHED_OWN_FIRST
};

struct MkGemmArgs {
  TmaDesc a;  // A [rows, K] row-major, box {64, 128}, 128B swizzle
  TmaDesc b;  // B 3-D: [N,K] layout dims {K, N, G} box {64, 256, 1}; [K,N] layout dims {N, K, G} box {64, 64, 1}
  TmaDesc c;  // output [rows, N], box {128 bytes of columns, 16 rows}, 128B swizzle
  MkSync sync;
  MkGemmSched sched;
  void* c_ptr;  // output base (direct stores of tiles cut by a group boundary)
  const int* group_rows;  // grouped mode: device array of num_groups row counts
  unsigned int* tile_flags;  // nullable: per-tile flag, set to the launch epoch after the tile is stored
  unsigned int* tile_counts;  // nullable (tests): atomically counts how often each tile flag is set
  long long ldc;  // output row stride in elements
  int m;  // rows of A and C (grouped mode: the capacity of the concatenated rows)
  int n;
  int k;
  int num_groups;  // 1 in plain mode
  unsigned int epi_op;  // MK_EPI_STORE or MK_EPI_ADD
  unsigned int splits;  // plain mode: ranges of K per tile (0 or 1: none; gemm_splitk.cuh)
  void* split_ws;  // splits > 1: the arrival counts (8 per tile), then the fp32 partials
};  // sizeof is a multiple of 64 (the TmaDesc alignment)

// Grouped mode: at most this many groups in one launch (per-group prefix sums live in shared memory).
#define MK_GEMM_MAX_GROUPS 128
