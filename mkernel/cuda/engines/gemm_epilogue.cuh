#pragma once
// GEMM epilogues: fp32 accumulators -> output dtype -> shared memory -> TMA store (or TMA
// reduce-add) into whatever the output tensor map points at (local output, a peer's symmetric
// buffer, a reduction buffer), then the per-tile flag.
//
// Staging, warp by warp. Each consumer warp owns 16 rows of the tile and two 2 KiB chunk
// buffers (16 rows x 128 B, 128B-swizzled exactly as the TMA store box {128 B, 16 rows} expects:
// 16-byte unit u of row r lives at unit u ^ (r % 8)). Its 16 x BN slice leaves in BN / 64 chunks of
// 64 columns (16-bit output) or BN / 32 chunks of 32 columns (fp32): the lanes write a chunk, fence the
// async proxy, __syncwarp, and lane 0 issues the TMA store of that box; chunk q reuses buffer q % 2
// once lane 0's store of chunk q - 2 has finished reading it (cp.async.bulk.wait_group.read 1).
// No barrier spans more than one warp. The swizzle makes the fragment writes conflict-free: the 8
// rows a warp writes at once land in 8 different 16-byte bank groups.
//
// Tiles cut by a group boundary (grouped mode) are written with plain predicated global stores
// (or red.add) from registers, since a TMA store cannot stop at a group's last row.
// A ROWS destination puts every row at its own address (a row scatter, which a tensor map cannot
// express): the warp reads each staged chunk back, 16 bytes a lane, and stores it row by row.
//
// Flags. When tile_flags is set, lane 0 of each consumer warp remembers the tile whose stores it
// just issued, and completes it later, inside the next tile's mainloop (after_issue) or at the
// end (finish): cp.async.bulk.wait_group 0 (the writes are performed, not just the smem read),
// fence.proxy.async.global, fence.sc.sys, then it counts its part in the tile's join slot; the
// last of the 8 parts publishes flag[tile] = epoch with a system-scope release store. So a flag
// trails its tile by about two k-blocks, and the MMA pipe never waits for a store. A ROWS part is
// released to the CTA only (fence.acq_rel.cta): the last part's fence.sc.sys covers all eight.
#include "common.cuh"
#include "signals.cuh"
#include "tma.cuh"
#include "copy.cuh"
#include "gemm_mainloop.cuh"

// Two values of a 16-bit output code (MK_OUT_BF16 / MK_OUT_F16) packed by common.cuh's pack2.
MK_DEV u32 pack2_out(int out, float lo, float hi) {
  return out == MK_OUT_BF16 ? pack2<MK_DT_BF16>(lo, hi) : pack2<MK_DT_F16>(lo, hi);
}
MK_DEV void st_shared_u32(u32 addr, u32 v) { asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory"); }
MK_DEV void st_shared_v2f32(u32 addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(a), "f"(b) : "memory");
}

// Stores (or adds) two adjacent output elements at p, straight from registers.
template <int OUT>
MK_DEV void store2_global(void* p, float a, float b, u32 op) {
  if (OUT == MK_OUT_F32) {
    float* f = reinterpret_cast<float*>(p);
    if (op == MK_EPI_ADD) {
      asm volatile("red.global.add.f32 [%0], %1;" ::"l"(f), "f"(a) : "memory");
      asm volatile("red.global.add.f32 [%0], %1;" ::"l"(f + 1), "f"(b) : "memory");
    } else {
      asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(f), "f"(a), "f"(b) : "memory");
    }
  } else {
    const u32 v = pack2_out(OUT, a, b);
    if (op == MK_EPI_ADD) {
      if (OUT == MK_OUT_BF16)
        asm volatile("red.global.add.noftz.bf16x2 [%0], %1;" ::"l"(p), "r"(v) : "memory");
      else
        asm volatile("red.global.add.noftz.f16x2 [%0], %1;" ::"l"(p), "r"(v) : "memory");
    } else {
      asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
    }
  }
}

// Where the epilogue puts a tile, and what it does around the stores. The engine's own
// destination is MkGemmDest (below); a fused op passes its own (a peer's receive slot, say, with a
// credit wait before the first store into that peer). A destination provides:
//   const TmaDesc* map(const MkTile&)   the tensor map the tile is stored (or added) through
//   i32 row(const MkTile&)              the map's row of the tile's first row
//   u32* flag(const MkTile&)            where the tile's flag goes (nullptr: no flag)
//   bool flags()                        whether tiles have flags at all
//   bool add()                          reduce-add into the destination instead of storing
//   bool before_store(const MkTile&)    lane 0 of a warp with rows in the tile, before its stores;
//                                       false (a wait failed): the warp stores and flags nothing
//   void published(u32 id)              after the tile's flag was set (tests count them)
//   void comm_turn(const MkTile&)       every consumer thread, for an MK_TILE_COMM entry of the ring
//                                       (after this CTA's pending tile flags are published)
//   static bool ROWS                    true: rows go to row_at(tile, row in tile) (u8*) by generic
//                                       stores, not through the map (and are stored, never added)
template <int OUT, class Cfg, bool GROUPED, class Dest>
struct MkTileEpilogue {
  static constexpr int ESIZE = OUT == MK_OUT_F32 ? 4 : 2;
  static constexpr int CW = 128 / ESIZE;  // columns per chunk
  static constexpr int NCHUNK = Cfg::BN / CW;  // chunks per 16 x BN warp slice
  static constexpr int JPC = CW / 8;  // accumulator column groups (8 wide) per chunk
  static constexpr u32 PARTS = Cfg::CONSUMERS * 4;  // one per consumer warp

  const MkGemmArgs& args;
  GemmSmem<Cfg> sm;
  u32 epoch;
  Dest dest;
  u32* pending_flag = nullptr;  // leader: flag of the tile whose stores are issued, not yet published
  u32 pending_id = 0;
  u32 pending_seq = 0;

  // Lane 0: count this warp's part of tile (id, seq); the last part publishes the flag. ROWS: a
  // part is released to the CTA only; the last part's system fence is cumulative over all eight.
  MK_DEV void publish(u32* flag, u32 id, u32 seq) {
    if (Dest::ROWS)
      fence_acq_rel_cta();
    else
      fence_sys();
    u32* slot = &sm.bars->join[seq % MK_JOIN_SLOTS];
    if (atomicAdd(slot, 1u) == PARTS - 1) {
      atomicExch(slot, 0u);
      fence_sys();
      set_flag(flag, epoch);
      dest.published(id);
    }
  }
  // Lane 0: complete the pending tile's stores and publish it.
  MK_DEV void flush() {
    if (pending_flag != nullptr) {
      if (!Dest::ROWS) {  // (ROWS: generic stores, ordered by the warp's __syncwarp)
        bulk_wait<0>();
        fence_proxy_async_global();
      }
      publish(pending_flag, pending_id, pending_seq);
      pending_flag = nullptr;
    }
  }
  MK_DEV void after_issue() {
    if (dest.flags() && (threadIdx.x & 31) == 0) flush();
  }

  MK_DEV void operator()(float (&acc)[Cfg::NACC], const MkTile& t, int wg) {
    const u32 tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31;
    const bool leader = lane == 0;
    if (t.id == MK_TILE_NONE) return;  // a clustered unit's part past M: nothing to store or flag
    const i32 wrow = 64 * wg + 16 * warp;  // this warp's first row, inside the tile
    u32* flag = dest.flag(t);
    if (!(GROUPED && t.rows < Cfg::BM)) {
      if (wrow < t.rows) {
        // TMA: lane 0 alone stores and flags; ROWS: every lane stores, as lane 0's wait allows
        const bool ok =
            Dest::ROWS ? __shfl_sync(~0u, leader && dest.before_store(t), 0) != 0 : !leader || dest.before_store(t);
        const TmaDesc* map = dest.map(t);
        const i32 row = dest.row(t) + wrow;
        const u32 r0 = lane >> 2;  // this thread's rows in the warp's box: r0 and r0 + 8 (same r % 8)
        const u32 x = r0;  // the swizzle of both rows
        u8* rows_at[4];  // ROWS: the rows lane >> 3 + 4 i of the warp's 16, where this lane stores unit lane & 7
        if (Dest::ROWS)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const i32 r = (i32)(lane >> 3) + 4 * i;
            rows_at[i] = ok && wrow + r < t.rows ? dest.row_at(t, wrow + r) : nullptr;
          }
        if (leader) bulk_wait_read<0>();  // the previous tile's stores of this warp have read smem
#pragma unroll
        for (int q = 0; q < NCHUNK; ++q) {
          const u32 buf = sm.c(wg, warp, q & 1);
          if (q >= 2 && leader) bulk_wait_read<1>();
          __syncwarp();
#pragma unroll
          for (int jj = 0; jj < JPC; ++jj) {
            const int j = q * JPC + jj;
            if (OUT == MK_OUT_F32) {
              const u32 unit = (2 * jj + ((lane & 3) >> 1)) ^ x;
              const u32 a0 = buf + r0 * 128 + (unit << 4) + (lane & 1) * 8;
              st_shared_v2f32(a0, acc[4 * j + 0], acc[4 * j + 1]);
              st_shared_v2f32(a0 + 8 * 128, acc[4 * j + 2], acc[4 * j + 3]);
            } else {
              const u32 unit = jj ^ x;
              const u32 a0 = buf + r0 * 128 + (unit << 4) + (lane & 3) * 4;
              st_shared_u32(a0, pack2_out(OUT, acc[4 * j + 0], acc[4 * j + 1]));
              st_shared_u32(a0 + 8 * 128, pack2_out(OUT, acc[4 * j + 2], acc[4 * j + 3]));
            }
          }
          if (Dest::ROWS) {
            __syncwarp();
            const i32 col = t.n0 + q * CW + (i32)(lane & 7) * (16 / ESIZE);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const u32 r = (lane >> 3) + 4u * i;
              const uint4 v = lds_v4(buf + r * 128u + (((lane & 7) ^ (r & 7)) << 4));
              if (rows_at[i] != nullptr && col < args.n) st_v4(rows_at[i] + (i64)col * ESIZE, v);
            }
            __syncwarp();  // the lanes' reads of this buffer before its reuse, and their stores before the flag
            continue;
          }
          fence_proxy_async_smem();
          __syncwarp();
          if (leader && ok) {
            if (dest.add())
              tma_add_2d(map, buf, t.n0 + q * CW, row);
            else
              tma_store_2d(map, buf, t.n0 + q * CW, row);
            bulk_commit();
          }
        }
        if (flag != nullptr && leader && ok) {  // completed and published by after_issue() / finish()
          pending_flag = flag;
          pending_id = t.id;
          pending_seq = t.seq;
        }
      } else if (flag != nullptr && leader) {
        publish(flag, t.id, t.seq);  // no row of this warp is in range: count it at once
      }
    } else {
      // A tile cut by its group's end: predicated stores from registers (the engine's own output,
      // or a ROWS destination's rows).
      const bool ok = !Dest::ROWS || wrow >= t.rows || __shfl_sync(~0u, leader && dest.before_store(t), 0) != 0;
      char* at[2];  // this thread's rows: lr = wrow + lane / 4 + 8 h
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const i32 lr = wrow + (i32)(lane >> 2) + 8 * h;
        at[h] = !ok || lr >= t.rows ? nullptr
                : Dest::ROWS        ? reinterpret_cast<char*>(dest.row_at(t, lr))
                                    : reinterpret_cast<char*>(args.c_ptr) + (i64)(t.m0 + lr) * args.ldc * ESIZE;
      }
#pragma unroll
      for (int j = 0; j < Cfg::BN / 8; ++j) {
        const i32 col = t.n0 + 8 * j + 2 * (lane & 3);
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (col < args.n && at[h] != nullptr)
            store2_global<OUT>(at[h] + (i64)col * ESIZE, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1],
                               Dest::ROWS ? MK_EPI_STORE : args.epi_op);
      }
      if (flag != nullptr && ok) {
        __syncwarp();  // lane 0's fence and release cover the warp's stores
        if (leader) publish(flag, t.id, t.seq);
      }
    }
  }

  // A communication turn between two tiles: this warp's pending tile first (the turn may reduce it).
  MK_DEV void comm_turn(const MkTile& t) {
    if (dest.flags() && (threadIdx.x & 31) == 0) flush();
    __syncwarp();
    dest.comm_turn(t);
  }

  // After the last tile: publish what is pending; the CTA may not exit while a TMA store still
  // reads its shared memory.
  MK_DEV void finish() {
    if ((threadIdx.x & 31) == 0) {
      flush();
      bulk_wait<0>();
    }
  }
};

// The engine's destination: the output map args.c at the tile's own rows, flags in args.tile_flags.
struct MkGemmDest {
  static constexpr bool ROWS = false;
  const MkGemmArgs& args;
  MK_DEV const TmaDesc* map(const MkTile&) const { return &args.c; }
  MK_DEV i32 row(const MkTile& t) const { return t.m0; }
  MK_DEV u32* flag(const MkTile& t) const { return args.tile_flags ? args.tile_flags + t.id : nullptr; }
  MK_DEV bool flags() const { return args.tile_flags != nullptr; }
  MK_DEV bool add() const { return args.epi_op == MK_EPI_ADD; }
  MK_DEV bool before_store(const MkTile&) const { return true; }
  MK_DEV void published(u32 id) const {
    if (args.tile_counts) atomicAdd(&args.tile_counts[id], 1u);
  }
  MK_DEV void comm_turn(const MkTile&) const {}  // the engine's sources never claim turns
  MK_DEV u8* row_at(const MkTile&, i32) const { return nullptr; }  // (not ROWS)
};

template <int OUT, class Cfg, bool GROUPED>
using MkTmaEpilogue = MkTileEpilogue<OUT, Cfg, GROUPED, MkGemmDest>;
