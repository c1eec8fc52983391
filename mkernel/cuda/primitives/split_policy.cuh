#pragma once
// The compute / communication split policy (docs/CONTROLLER.md), plain integer C++ that compiles as
// device code (NVRTC, included by the fused kernels' controller) and as host code (g++: mkernel/split/policy.py
// builds it into a small shared library to test it and to run the cross-call search on the host).
//
// Two parts:
//  - MkSplitCtl / mk_split_ctl_step: the in-call controller step. From one window of per-role counters
//    it computes the comm CTA count that makes both roles finish together (work balance), then moves
//    towards it by a bounded, damped step with hysteresis; every direction reversal halves the step
//    (at step 1 it widens the dead band instead), so the number of reversals on any input is bounded.
//  - MkSplitSearch / mk_split_search_*: the cross-call search over integer comm CTA counts for one key.
//    It starts at a model prior (mk_split_prior), expands by doubling steps until the time gets worse
//    (a bracket), bisects the bracket's larger side around the incumbent, re-measures the incumbent
//    (noise: the first sample of a winner is optimistic), then holds; it re-opens only when several
//    consecutive calls in a row differ from the held time by a large factor.
// Integer arithmetic only (no floating point, no timing inside): ranks given the same inputs decide
// the same, which is what makes agreeing the inputs (the slowest rank's call time) enough.

#ifdef __CUDACC__
#include "common.cuh"
#define MK_SPLIT_FN __host__ __device__ __forceinline__
#else
// Host build (g++): no system headers needed; the same fixed-width names as common.cuh.
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;
#define MK_SPLIT_FN inline
#endif

#define MK_SPLIT_VERSION 1
#define MK_SPLIT_MAX_POINTS 24

MK_SPLIT_FN i32 mk_split_clamp(i32 x, i32 lo, i32 hi) { return x < lo ? lo : (x > hi ? hi : x); }
MK_SPLIT_FN i32 mk_split_iabs(i32 x) { return x < 0 ? -x : x; }

// ------------------------------------------------------------------------------ model prior
// The first call on a key: the smallest comm CTA count n minimising max(gemm(total - n), comm(n)) with
// gemm(g) = gemm_sm_ns / g (ideal SM scaling) and comm(n) = bytes / min(n * cta_rate, link_rate).
// Ties go to the smallest n (past link saturation more CTAs only slow the GEMM). Rates in bytes per us.
struct MkSplitModel {
  u64 comm_bytes;  // bytes this rank moves (or pulls) in the op
  u64 cta_bytes_per_us;  // one comm CTA's rate (pulling: half the pushing rate)
  u64 link_bytes_per_us;  // saturated link rate
  u64 gemm_sm_ns;  // GEMM time at full width times the SMs it had (SM-ns of work)
  i32 total;  // CTAs in both roles
  i32 lo, hi;  // bounds on comm CTAs
  i32 pad;
};

MK_SPLIT_FN u64 mk_split_model_ns(const MkSplitModel& m, i32 n) {
  const i32 g = m.total - n;
  const u64 gemm = g > 0 ? m.gemm_sm_ns / (u64)g : ~0ull;
  u64 rate = (u64)n * m.cta_bytes_per_us;
  if (rate > m.link_bytes_per_us) rate = m.link_bytes_per_us;
  const u64 comm = rate ? m.comm_bytes * 1000ull / rate : ~0ull;  // bytes / (bytes/us) * 1000 = ns
  return gemm > comm ? gemm : comm;
}

MK_SPLIT_FN i32 mk_split_prior(const MkSplitModel& m) {
  const i32 hi = m.hi < m.total - 1 ? m.hi : m.total - 1;
  i32 best = m.lo;
  u64 best_ns = mk_split_model_ns(m, m.lo);
  for (i32 n = m.lo + 1; n <= hi; ++n) {
    const u64 t = mk_split_model_ns(m, n);
    if (t < best_ns) {
      best_ns = t;
      best = n;
    }
  }
  return best;
}

// ------------------------------------------------------------------------------ in-call step
// One window of counters, summed over the CTAs of each role (device: mk_split_window from the TP
// kernels' claim counters and atomics, read and cleared by the thread that steps the controller).
struct MkSplitWindow {
  u64 gemm_done, comm_done;  // tasks (tiles / reduction items) finished in the window
  u64 gemm_busy_ns, comm_busy_ns;  // CTA-ns spent on those tasks
  u64 gemm_stall_ns, comm_stall_ns;  // CTA-ns spent waiting: GEMM on credits / arrivals, comm on flags
  u64 gemm_left, comm_left;  // tasks not yet claimed
};

// A window as the fused kernels count it: its length, the role sizes, the CTA-ns GEMM CTAs spent on
// communication turns, the measured waits, claims and what is left. Busy CTA-ns per role are the
// role's CTAs times the window, turns moved from the GEMM side to the comm side, waits taken out
// (each clamped so that noise in the timers cannot wrap an unsigned count).
MK_SPLIT_FN u64 mk_split_sub(u64 a, u64 b) { return a > b ? a - b : 0ull; }
MK_SPLIT_FN MkSplitWindow mk_split_window(u64 dt_ns, i32 gemm_ctas, i32 comm_ctas, u64 turn_ns, u64 gemm_stall_ns,
                                          u64 comm_stall_ns, u64 gemm_done, u64 comm_done, u64 gemm_left,
                                          u64 comm_left) {
  MkSplitWindow w;
  const u64 gemm_ns = mk_split_sub((u64)gemm_ctas * dt_ns, turn_ns);
  const u64 comm_ns = (u64)comm_ctas * dt_ns + turn_ns;
  w.gemm_stall_ns = gemm_stall_ns < gemm_ns ? gemm_stall_ns : gemm_ns;
  w.comm_stall_ns = comm_stall_ns < comm_ns ? comm_stall_ns : comm_ns;
  w.gemm_busy_ns = gemm_ns - w.gemm_stall_ns;
  w.comm_busy_ns = comm_ns - w.comm_stall_ns;
  w.gemm_done = gemm_done;
  w.comm_done = comm_done;
  w.gemm_left = gemm_left;
  w.comm_left = comm_left;
  return w;
}

struct MkSplitCtl {
  i32 total;  // CTAs in both roles
  i32 lo, hi;  // bounds on comm CTAs
  i32 n_comm;  // current comm CTAs
  i32 step_lim;  // the largest move of one step; halves at each direction reversal
  i32 last_dir;  // -1, 0, +1: the direction of the last move
  i32 dead_extra;  // hysteresis added by reversals once step_lim is 1
  i32 reversals;  // direction reversals so far (diagnostics and tests)
  u32 hyst_permille;  // no move while |target - n| <= n * hyst / 1000 + dead_extra
  u32 stall_permille;  // a role waiting this share of its time is starved: more CTAs cannot help it
};

MK_SPLIT_FN void mk_split_ctl_init(MkSplitCtl& c, i32 total, i32 lo, i32 hi, i32 n_comm, i32 step_max,
                                   u32 hyst_permille, u32 stall_permille) {
  c.total = total;
  c.lo = lo;
  c.hi = hi < total - 1 ? hi : total - 1;
  c.n_comm = mk_split_clamp(n_comm, c.lo, c.hi);
  c.step_lim = step_max > 1 ? step_max : 1;
  c.last_dir = 0;
  c.dead_extra = 0;
  c.reversals = 0;
  c.hyst_permille = hyst_permille;
  c.stall_permille = stall_permille;
}

// The comm CTA count that finishes both roles' remaining work at the same time:
// n_c = total * Wc / (Wg + Wc), W = tasks left * measured CTA-ns per task (the paper's rule).
MK_SPLIT_FN i32 mk_split_balance(const MkSplitCtl& c, const MkSplitWindow& w) {
  u64 wg = w.gemm_left * (w.gemm_busy_ns / w.gemm_done + 1);
  u64 wc = w.comm_left * (w.comm_busy_ns / w.comm_done + 1);
  while (wg >= (1ull << 40) || wc >= (1ull << 40)) {
    wg >>= 1;
    wc >>= 1;
  }  // total * W stays in 64 bits
  const u64 sum = wg + wc;
  if (sum == 0) return c.n_comm;
  return (i32)(((u64)c.total * wc + sum / 2) / sum);
}

MK_SPLIT_FN u32 mk_split_share(u64 part, u64 other) {  // part / (part + other) in permille
  const u64 s = part + other;
  return s ? (u32)((part >> 8) * 1000ull / ((s >> 8) + 1)) : 0u;
}

// Returns (and stores) the new comm CTA count. The caller applies it at tile boundaries (the TP
// kernels: GEMM CTAs lent to communication, tp_controller.cuh).
MK_SPLIT_FN i32 mk_split_ctl_step(MkSplitCtl& c, const MkSplitWindow& w) {
  // No GEMM work left: the tail belongs to the join path; a window without completions says nothing.
  if (w.gemm_left == 0 || w.gemm_done == 0 || w.comm_done == 0) return c.n_comm;
  i32 target = mk_split_balance(c, w);
  // Stalls: a role that waits a share s of its time needs only (1 - s) of its CTAs (comm waiting on
  // tiles); a GEMM waiting on communication (credits, AG arrivals) needs that share more comm CTAs.
  const u32 cs = mk_split_share(w.comm_stall_ns, w.comm_busy_ns);
  const u32 gs = mk_split_share(w.gemm_stall_ns, w.gemm_busy_ns);
  if (cs > c.stall_permille && gs <= c.stall_permille) {
    const i32 need = (i32)(((u32)c.n_comm * (1000u - cs) + 999u) / 1000u);
    if (target > need) target = need;
  } else if (gs > c.stall_permille && cs <= c.stall_permille) {
    const i32 more = (i32)((u32)c.n_comm * gs / 1000u);
    const i32 need = c.n_comm + (more > 1 ? more : 1);
    if (target < need) target = need;
  }
  target = mk_split_clamp(target, c.lo, c.hi);
  const i32 delta = target - c.n_comm;
  // Hysteresis relative to n (a step of one CTA matters at 5 comm CTAs, not at 60), widened by reversals.
  const i32 dead = (i32)((u32)c.n_comm * c.hyst_permille / 1000u) + c.dead_extra;
  if (mk_split_iabs(delta) <= dead || delta == 0) return c.n_comm;
  const i32 dir = delta > 0 ? 1 : -1;
  if (c.last_dir != 0 && dir != c.last_dir) {
    ++c.reversals;
    if (c.step_lim > 1)
      c.step_lim >>= 1;
    else if (c.dead_extra < c.hi - c.lo)
      ++c.dead_extra;
  }
  i32 move = (mk_split_iabs(delta) + 1) / 2;  // half way: a damped approach, never past the target
  if (move > c.step_lim) move = c.step_lim;
  c.n_comm = mk_split_clamp(c.n_comm + dir * move, c.lo, c.hi);
  c.last_dir = dir;
  return c.n_comm;
}

// ------------------------------------------------------------------------------ cross-call search
enum { MK_SS_PRIOR = 0, MK_SS_UP = 1, MK_SS_DOWN = 2, MK_SS_REFINE = 3, MK_SS_CONFIRM = 4, MK_SS_HOLD = 5 };

struct MkSplitPoint {
  i32 n;
  u32 count;
  u64 sum_ns;
};

struct MkSplitSearch {
  u32 version;  // MK_SPLIT_VERSION (persisted states of another version are discarded)
  i32 lo, hi;  // bounds on comm CTAs
  i32 phase;  // MK_SS_*
  i32 pending;  // the count the next call runs
  i32 best;  // the incumbent
  i32 a, b;  // the bracket known to hold the optimum (unimodal curves)
  i32 step;  // expansion step
  i32 confirms;  // re-measurements done in CONFIRM
  u32 observations;  // observations since the search (re)opened
  u32 npts;
  u32 drift;  // HOLD: consecutive calls far from ref_ns
  u32 max_obs;  // the search holds after this many observations, whatever remains
  u32 reopen_permille;  // HOLD: a call this far from ref_ns counts as drift
  u32 reopen_calls;  // ... and this many in a row re-open the search
  u64 ref_ns;  // HOLD: the incumbent's mean when the search converged
  u32 reopens;  // diagnostics
  i32 prior;  // the count the search (re)opened at
  MkSplitPoint pts[MK_SPLIT_MAX_POINTS];
};

MK_SPLIT_FN void mk_split_search_init(MkSplitSearch& s, i32 lo, i32 hi, i32 prior) {
  s.version = MK_SPLIT_VERSION;
  s.lo = lo;
  s.hi = hi < lo ? lo : hi;
  s.phase = MK_SS_PRIOR;
  s.pending = s.best = mk_split_clamp(prior, s.lo, s.hi);
  s.a = s.lo;
  s.b = s.hi;
  s.step = 1;
  s.confirms = 0;
  s.observations = 0;
  s.npts = 0;
  s.drift = 0;
  s.max_obs = 10;
  s.reopen_permille = 250;
  s.reopen_calls = 3;
  s.ref_ns = 0;
  s.reopens = 0;
  s.prior = s.pending;
  for (i32 i = 0; i < MK_SPLIT_MAX_POINTS; ++i) {
    s.pts[i].n = -1;
    s.pts[i].count = 0;
    s.pts[i].sum_ns = 0;
  }
}

MK_SPLIT_FN i32 mk_split_search_find(const MkSplitSearch& s, i32 n) {
  for (u32 i = 0; i < s.npts; ++i)
    if (s.pts[i].n == n) return (i32)i;
  return -1;
}

MK_SPLIT_FN u64 mk_split_search_mean(const MkSplitSearch& s, i32 n) {  // ~0 when never measured
  const i32 i = mk_split_search_find(s, n);
  return (i < 0 || s.pts[i].count == 0) ? ~0ull : s.pts[i].sum_ns / s.pts[i].count;
}

MK_SPLIT_FN void mk_split_search_record(MkSplitSearch& s, i32 n, u64 ns) {
  i32 i = mk_split_search_find(s, n);
  if (i < 0) {
    if (s.npts == MK_SPLIT_MAX_POINTS) return;  // cannot happen within max_obs; drop rather than overwrite
    i = (i32)s.npts++;
    s.pts[i].n = n;
    s.pts[i].count = 0;
    s.pts[i].sum_ns = 0;
  }
  if (s.pts[i].count >= 16) {  // a long hold: keep the mean, forget old samples slowly
    s.pts[i].sum_ns >>= 1;
    s.pts[i].count >>= 1;
  }
  s.pts[i].sum_ns += ns;
  s.pts[i].count += 1;
}

// The measured point with the lowest mean (ties: the smaller count of comm CTAs).
MK_SPLIT_FN i32 mk_split_search_argmin(const MkSplitSearch& s) {
  i32 best = s.best;
  u64 best_ns = mk_split_search_mean(s, best);
  for (u32 i = 0; i < s.npts; ++i) {
    if (!s.pts[i].count) continue;
    const u64 m = s.pts[i].sum_ns / s.pts[i].count;
    if (m < best_ns || (m == best_ns && s.pts[i].n < best)) {
      best_ns = m;
      best = s.pts[i].n;
    }
  }
  return best;
}

// The measured point with the lowest mean other than the incumbent, or -1.
MK_SPLIT_FN i32 mk_split_search_challenger(const MkSplitSearch& s) {
  i32 c = -1;
  u64 c_ns = ~0ull;
  for (u32 i = 0; i < s.npts; ++i) {
    if (!s.pts[i].count || s.pts[i].n == s.best) continue;
    const u64 m = s.pts[i].sum_ns / s.pts[i].count;
    if (m < c_ns || (m == c_ns && s.pts[i].n < c)) {
      c_ns = m;
      c = s.pts[i].n;
    }
  }
  return c;
}

MK_SPLIT_FN void mk_split_search_hold(MkSplitSearch& s) {
  s.best = mk_split_search_argmin(s);
  s.pending = s.best;
  s.ref_ns = mk_split_search_mean(s, s.best);
  s.drift = 0;
  s.phase = MK_SS_HOLD;
}

// A measured point x narrows the bracket [a, b]: better than the incumbent, it becomes the incumbent
// (the old one bounds its side); worse, it bounds its own side.
MK_SPLIT_FN void mk_split_search_take(MkSplitSearch& s, i32 x, bool better) {
  if (better) {
    if (x > s.best)
      s.a = s.best;
    else
      s.b = s.best;
    s.best = x;
  } else if (x > s.best) {
    s.b = x;
  } else {
    s.a = x;
  }
}

// REFINE: bisect the larger side of the bracket around the incumbent; points already measured
// decide without a call. Ends in CONFIRM when both sides are down to one step.
MK_SPLIT_FN void mk_split_search_refine(MkSplitSearch& s) {
  for (i32 guard = 0; guard < 64; ++guard) {
    const i32 left = s.best - s.a, right = s.b - s.best;
    if (left <= 1 && right <= 1) break;
    const i32 x = right >= left ? s.best + (right + 1) / 2 : s.best - (left + 1) / 2;
    const u64 fx = mk_split_search_mean(s, x);
    if (fx == ~0ull) {
      s.phase = MK_SS_REFINE;
      s.pending = x;
      return;
    }
    mk_split_search_take(s, x, fx < mk_split_search_mean(s, s.best));
  }
  s.phase = MK_SS_CONFIRM;
  s.confirms = 0;
  s.pending = s.best;
}

// The expansion step from the prior: a quarter of it (the curves are roughly scale-free in n).
MK_SPLIT_FN i32 mk_split_search_step0(i32 x) { return x >= 8 ? x / 4 : 1; }

// Feeds one call's time (ns; the slowest rank's, the same on every rank) at comm CTA count n.
// Returns the count for the next call. A time for a count other than the pending one is recorded
// (it informs the means) but does not advance the search.
MK_SPLIT_FN i32 mk_split_search_observe(MkSplitSearch& s, i32 n, u64 ns) {
  mk_split_search_record(s, n, ns);
  if (n != s.pending) return s.pending;
  if (s.phase == MK_SS_HOLD) {
    const u64 ref = s.ref_ns;
    const u64 diff = ns > ref ? ns - ref : ref - ns;
    s.drift = diff > ref / 1000ull * s.reopen_permille ? s.drift + 1 : 0;
    if (s.drift >= s.reopen_calls) {  // a large, persistent change: search again from the incumbent
      const u32 reopens = s.reopens + 1;
      const i32 lo = s.lo, hi = s.hi, x = s.best;
      mk_split_search_init(s, lo, hi, x);
      s.reopens = reopens;
    }
    return s.pending;
  }
  ++s.observations;
  const u64 fb = mk_split_search_mean(s, s.best);
  const u64 fn = mk_split_search_mean(s, n);
  switch (s.phase) {
    case MK_SS_PRIOR:
      s.step = mk_split_search_step0(n);
      s.a = s.lo;
      s.b = s.hi;
      if (n >= s.hi) {
        s.phase = MK_SS_DOWN;
        s.pending = mk_split_clamp(n - s.step, s.lo, s.hi);
      } else {
        s.phase = MK_SS_UP;
        s.pending = mk_split_clamp(n + s.step, s.lo, s.hi);
      }
      if (s.pending == n) mk_split_search_hold(s);  // lo == hi
      break;
    case MK_SS_UP:
      if (fn < fb) {  // better: the optimum is above the old incumbent
        s.a = s.best;
        s.best = n;
        s.step = s.step * 3 / 2 > s.step ? s.step * 3 / 2
                                         : s.step + 1;  // grow, but gently: far probes on a flat side waste calls
        if (n >= s.hi) {
          s.b = s.hi;
          mk_split_search_refine(s);
        } else
          s.pending = mk_split_clamp(n + s.step, s.lo, s.hi);
      } else {
        s.b = n;
        if (s.best == s.prior && s.observations == 2 && s.best > s.lo) {
          // the first probe up lost: try below the prior before bracketing
          s.phase = MK_SS_DOWN;
          s.step = mk_split_search_step0(s.best);
          s.pending = mk_split_clamp(s.best - s.step, s.lo, s.hi);
          if (mk_split_search_mean(s, s.pending) != ~0ull) mk_split_search_refine(s);
        } else {
          mk_split_search_refine(s);
        }
      }
      break;
    case MK_SS_DOWN:
      if (fn < fb) {
        s.b = s.best;
        s.best = n;
        s.step = s.step * 3 / 2 > s.step ? s.step * 3 / 2
                                         : s.step + 1;  // grow, but gently: far probes on a flat side waste calls
        if (n <= s.lo) {
          s.a = s.lo;
          mk_split_search_refine(s);
        } else
          s.pending = mk_split_clamp(n - s.step, s.lo, s.hi);
      } else {
        s.a = n;
        mk_split_search_refine(s);
      }
      break;
    case MK_SS_REFINE:
      mk_split_search_take(s, n, fn < fb);
      mk_split_search_refine(s);
      break;
    case MK_SS_CONFIRM: {
      // Noise: the incumbent's first sample is optimistic (it won a comparison). Re-measure it, then
      // the best other point once, and hold at the lower mean.
      ++s.confirms;
      const i32 c = s.confirms == 1 ? mk_split_search_challenger(s) : -1;
      if (c >= 0)
        s.pending = c;
      else
        mk_split_search_hold(s);
      break;
    }
    default:
      break;
  }
  // The budget: the last two observations re-measure the incumbent (and a challenger), then hold.
  if (s.phase != MK_SS_HOLD && s.phase != MK_SS_CONFIRM && s.observations + 2 >= s.max_obs) {
    s.best = mk_split_search_argmin(s);
    s.phase = MK_SS_CONFIRM;
    s.confirms = 0;
    s.pending = s.best;
  }
  if (s.phase != MK_SS_HOLD && s.observations >= s.max_obs) mk_split_search_hold(s);
  return s.pending;
}
