#pragma once
// The in-call controller of the fused tensor-parallel kernels (docs/CONTROLLER.md, loop 2).
//
// Roles. CTAs [gemm_ctas, grid) communicate from the start (the static split the host chose). A GEMM
// CTA is *lent* when its index is in [gemm_ctas - lent, gemm_ctas): before each claim its producer
// checks whether a communication item can run without waiting and, if so, claims a turn
// (MK_TILE_COMM in the tile ring) instead of its next tile; its consumers take that item between two
// tiles. With no ready item it goes on with GEMM tiles: a lent CTA never idles, and never waits on a
// tile that it (or a CTA that is waiting like it) would have to compute; a turn waits at most for
// credits, which every rank announces at launch entry.
//
// Windows. After each item a comm group's leader (a comm CTA's thread 0, or a joined GEMM CTA's
// consumer leader) that sees a window of TP_CTL_WINDOW_NS passed takes the try-lock, builds the window's
// MkSplitWindow (the claim counters' progress, what is left, the CTA-ns lent CTAs spent on turns, the
// measured waits) and steps the policy (mk_split_ctl_step: work balance, stall rules, damping); the
// comm CTA count it returns, minus the static comm CTAs, is the new `lent`: at most ctl_lend_max
// (gemm_ctas / 2), so every rank keeps GEMM CTAs computing the tiles its peers wait for. The
// pattern mode lends every odd GEMM CTA without windows (its record's lent counts stay 0).
//
// Ranks need not agree: which CTA reduces or pushes an item changes who does the work and when, not
// what crosses the wire (tiles, flags and bytes are fixed by tile ids).
//
// The live state is reset by the launch's last CTA (tp_ctl_finish, after every CTA's last claim),
// which also keeps the launch's record for the host (TpCtl::last). Fields only the lock holder
// touches, and `lent`, go through volatile accesses (other SMs' L1 lines are never trusted).
#include "common.cuh"
#include "signals.cuh"
#include "tp_args.cuh"

constexpr u64 TP_CTL_WINDOW_NS = 10000;  // 10 us: ~50 tile completions at full width (~25 us tiles)
constexpr i32 TP_CTL_STEP_MAX = 8;  // the largest move of one step (halves at reversals)
constexpr u32 TP_CTL_HYST_PERMILLE = 125;  // no move within 12.5% of the current count
constexpr u32 TP_CTL_STALL_PERMILLE = 300;  // a role waiting 30% of its time is starved
constexpr u32 TP_CTL_NO_ITEM = 0xFFFFFFFFu;  // a turn that found nothing ready

// The comm items a lent GEMM CTA may take: RS / AR the node's reductions of this rank's blocks
// (TP_CNT_REDUCE), AG this rank's pushes into its node (TP_CNT_PUSH).
template <int OP>
MK_DEV u32 tp_ctl_counter() {
  return OP == TP_OP_AG ? (u32)TP_CNT_PUSH : (u32)TP_CNT_REDUCE;
}
template <int OP>
MK_DEV u32 tp_ctl_items(const TpArgs& a) {
  return OP == TP_OP_AG ? (u32)a.local * (u32)a.tiles_mb : (u32)a.nodes * (u32)a.tiles_mb * (u32)a.tiles_n;
}

MK_DEV u32 ld_volatile(const u32* p) { return *reinterpret_cast<const volatile u32*>(p); }
MK_DEV u64 ld_volatile(const u64* p) { return *reinterpret_cast<const volatile u64*>(p); }
template <class T>
MK_DEV void st_volatile(T* p, T v) {
  *reinterpret_cast<volatile T*>(p) = v;
}

// GEMM CTA `cta` (of gemm_ctas) prefers ready comm items to its next tile.
MK_DEV bool tp_ctl_lent(const TpArgs& a, u32 cta) {
  if (a.ctl_mode == TP_CTL_PATTERN) return (cta & 1u) != 0;
  return a.ctl_mode == TP_CTL_ADAPT && cta + ld_volatile(&a.ctl->lent) >= (u32)a.gemm_ctas;
}

// Claims item v of `counter` if it is ready(v) and nobody took it first; else TP_CTL_NO_ITEM.
template <class Ready>
MK_DEV u32 tp_try_claim(unsigned int* counter, Ready ready) {
  const u32 v = ld_volatile(counter);
  if (!ready(v)) return TP_CTL_NO_ITEM;
  return atomicCAS(counter, v, v + 1) == v ? v : TP_CTL_NO_ITEM;
}

// Window sums (any thread; only while the controller adapts).
MK_DEV void tp_ctl_wait(const TpArgs& a, unsigned long long* sum, u64 start) {
  if (a.ctl_mode == TP_CTL_ADAPT) atomicAdd(sum, (unsigned long long)(globaltimer_ns() - start));
}
MK_DEV u64 tp_ctl_clock(const TpArgs& a) { return a.ctl_mode == TP_CTL_ADAPT ? globaltimer_ns() : 0ull; }

// A lent CTA's turn ended (its leader): its time counts as communication; `took`: it ran an item.
MK_DEV void tp_ctl_turn_done(const TpArgs& a, u64 start, bool took) {
  if (a.ctl_mode == TP_CTL_OFF) return;
  if (took) atomicAdd(&a.ctl->turns, 1u);
  if (a.ctl_mode == TP_CTL_ADAPT) atomicAdd(&a.ctl->turn_ns, (unsigned long long)(globaltimer_ns() - start));
}

// The policy's state in and out of registers, field by field (through volatile pointers to the
// device state only, so the local copy stays in registers): only the lock holder does either.
#define TP_CTL_FIELDS(X) \
  X(total) X(lo) X(hi) X(n_comm) X(step_lim) X(last_dir) X(dead_extra) X(reversals) X(hyst_permille) X(stall_permille)
MK_DEV MkSplitCtl tp_ctl_load(const volatile MkSplitCtl* s) {
  MkSplitCtl c;
#define TP_CTL_LOAD(f) c.f = s->f;
  TP_CTL_FIELDS(TP_CTL_LOAD)
#undef TP_CTL_LOAD
  return c;
}
MK_DEV void tp_ctl_store(volatile MkSplitCtl* d, const MkSplitCtl& c) {
#define TP_CTL_STORE(f) d->f = c.f;
  TP_CTL_FIELDS(TP_CTL_STORE)
#undef TP_CTL_STORE
}

// One thread at a task boundary: steps the controller once a window has passed (and this thread
// wins the lock); otherwise returns at the cost of a clock read and one load.
template <int OP>
MK_DEV void tp_ctl_tick(const TpArgs& a) {
  if (a.ctl_mode != TP_CTL_ADAPT) return;
  TpCtl* c = a.ctl;
  const u64 seen = ld_volatile(&c->window_start);
  if (seen != 0 && (i64)(globaltimer_ns() - seen) < (i64)TP_CTL_WINDOW_NS) return;  // signed: a later start
  if (atomicCAS(&c->lock, 0u, 1u) != 0u) return;
  __threadfence();
  const u64 start = ld_volatile(&c->window_start);
  const u64 now = globaltimer_ns();  // after the lock: never before the start another holder stored
  const i32 comm_ctas = (i32)gridDim.x - a.gemm_ctas;
  const u32 tiles_total = (u32)a.world * (u32)a.tiles_mb * (u32)a.tiles_n, items_total = tp_ctl_items<OP>(a);
  const u32 tiles = min(ld_volatile(&a.counters[TP_CNT_TILE]), tiles_total);
  const u32 items = min(ld_volatile(&a.counters[tp_ctl_counter<OP>()]), items_total);
  MkSplitCtl ctl;
  bool moved = start == 0;
  if (start == 0) {  // the launch's first tick: the window opens, the policy starts at the static split
    mk_split_ctl_init(ctl, (i32)gridDim.x, comm_ctas, comm_ctas + a.ctl_lend_max, comm_ctas, TP_CTL_STEP_MAX,
                      TP_CTL_HYST_PERMILLE, TP_CTL_STALL_PERMILLE);
    atomicExch(&c->turn_ns, 0ull);
    atomicExch(&c->comm_stall_ns, 0ull);
    atomicExch(&c->gemm_stall_ns, 0ull);
  } else if ((i64)(now - start) >= (i64)TP_CTL_WINDOW_NS) {
    ctl = tp_ctl_load(&c->ctl);
    const MkSplitWindow w = mk_split_window(now - start, a.gemm_ctas, comm_ctas, atomicExch(&c->turn_ns, 0ull),
                                            atomicExch(&c->gemm_stall_ns, 0ull), atomicExch(&c->comm_stall_ns, 0ull),
                                            tiles - ld_volatile(&c->tiles_at), items - ld_volatile(&c->items_at),
                                            tiles_total - tiles, items_total - items);
    const u32 lent = (u32)(mk_split_ctl_step(ctl, w) - comm_ctas);
    st_volatile(&c->windows, ld_volatile(&c->windows) + 1);
    if (tiles < tiles_total) st_volatile(&c->gemm_windows, ld_volatile(&c->gemm_windows) + 1);
    if (lent != ld_volatile(&c->lent)) {
      st_volatile(&c->steps, ld_volatile(&c->steps) + 1);
      st_volatile(&c->lent_peak, max(lent, ld_volatile(&c->lent_peak)));
      st_volatile(&c->lent, lent);
    }
    moved = true;
  }
  if (moved) {  // else another thread stepped this window between our two reads
    tp_ctl_store(&c->ctl, ctl);
    st_volatile(&c->tiles_at, tiles);
    st_volatile(&c->items_at, items);
    st_volatile(&c->window_start, now | 1ull);  // never 0 once open
  }
  __threadfence();
  atomicExch(&c->lock, 0u);
}

// The launch's last CTA (thread 0), after every CTA's last claim: the launch's record, then the
// live state back to zero for the next launch.
MK_DEV void tp_ctl_finish(const TpArgs& a) {
  TpCtl* c = a.ctl;
  TpCtlStats s;
  s.turns = ld_volatile(&c->turns);
  s.steps = ld_volatile(&c->steps);
  s.windows = ld_volatile(&c->windows);
  s.gemm_windows = ld_volatile(&c->gemm_windows);
  s.lent_peak = ld_volatile(&c->lent_peak);
  s.lent_last = ld_volatile(&c->lent);
  s.gemm_ctas = (u32)a.gemm_ctas;
  s.comm_ctas = gridDim.x - (u32)a.gemm_ctas;
  s.launches = ld_volatile(&c->last.launches) + 1;
  s.pad[0] = s.pad[1] = s.pad[2] = 0;
  const u32* w = reinterpret_cast<const u32*>(&s);
  for (u32 i = 0; i < sizeof(TpCtlStats) / 4; ++i) st_volatile(reinterpret_cast<u32*>(&c->last) + i, w[i]);
  u32* live = reinterpret_cast<u32*>(c);  // everything before `last`, the struct's final field
  for (u32 i = 0; i < (sizeof(TpCtl) - sizeof(TpCtlStats)) / 4; ++i) st_volatile(live + i, 0u);
  __threadfence();
}
