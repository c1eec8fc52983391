"""Device-array helpers the GPU tests share: host <-> device copies that also work where CuPy lacks
bfloat16 transfers or casts, raw bits, and NaN-poisoned outputs (poison every output before a run);
and what the attention and ring-attention tests share: inputs, the reference, and its checks."""

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"bf16": BF16, "fp16": np.dtype(np.float16)}
NAN_BITS = {"bf16": (np.uint16, 0x7FC0), "fp16": (np.uint16, 0x7E00), "f32": (np.uint32, 0x7FC00000)}


def dev(x):
    """A NumPy array on the device (contiguous)."""
    import cupy

    x = np.ascontiguousarray(x)
    try:
        return cupy.asarray(x)
    except Exception:  # noqa: BLE001  (a CuPy without bfloat16 transfers)
        return cupy.asarray(x.view(np.uint16)).view(x.dtype)


def host(x):
    import cupy

    try:
        return cupy.asnumpy(x)
    except Exception:  # noqa: BLE001
        return cupy.asnumpy(x.view(cupy.uint16)).view(x.dtype)


def bits(x):
    """The raw bits of a device array, on the host (uint16 for 16-bit data, uint32 for float32)."""
    import cupy

    return cupy.asnumpy(x.view(cupy.uint16 if x.dtype.itemsize == 2 else cupy.uint32))


def f32(x):
    """A device bf16 / fp16 array as float32 (on the device)."""
    import cupy

    try:
        return x.astype(cupy.float32)
    except Exception:  # noqa: BLE001  (a CuPy without bfloat16 casts: do it on the bits)
        return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)


def kind(dt):
    dt = np.dtype(dt)
    return "bf16" if dt == BF16 else "fp16" if dt == np.float16 else "f32"


def poison(x):
    """Fills a device bf16 / fp16 / float32 array (a view too) with NaN."""
    word, nan = NAN_BITS[kind(x.dtype)]
    x.view(word).fill(nan)


def poisoned(shape, kind_):
    """A new device array of kind 'bf16', 'fp16' or 'f32', filled with NaN."""
    import cupy

    out = cupy.empty(shape, dtype={"bf16": BF16, "fp16": np.float16, "f32": np.float32}[kind_])
    poison(out)
    return out


# ------------------------------------------------------------------------------------- attention
TILE = 128          # query rows per tile (the attention kernel's tiles are (batch, head, 128-row block))
REL_TOL = 1e-2      # relative Frobenius error, whole output and per tile
MAX_TOL = 3e-2      # max |error| / max |reference|
LSE_TOL = 1e-3      # |lse - ref| / (1 + |ref|)
NUMPY_REF_MAX = 4_000_000  # B * H_q * S_q * S_kv up to which a host reference is float64 NumPy


def random_qkv(seed, dt, B, Sq, Skv, Hq, Hkv, D):
    """Host (q, k, v) of dtype dt, [B, S, H, D] (B None: 3-D), standard normal from seed (a seed or a
    NumPy Generator)."""
    rng = np.random.default_rng(seed)
    lead = () if B is None else (B,)
    q = rng.standard_normal(lead + (Sq, Hq, D)).astype(dt)
    k = rng.standard_normal(lead + (Skv, Hkv, D)).astype(dt)
    v = rng.standard_normal(lead + (Skv, Hkv, D)).astype(dt)
    return q, k, v


def _attention(xp, q, k, v, causal, scale, offset):
    """Attention in the precision of q (float64 NumPy or float32 CuPy), [B, S, H, D] inputs."""
    Sq, Hq = q.shape[1], q.shape[2]
    Skv, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qh = q.transpose(0, 2, 1, 3)
    kh = xp.repeat(k.transpose(0, 2, 1, 3), g, axis=1)  # query head h reads kv head h // g
    vh = xp.repeat(v.transpose(0, 2, 1, 3), g, axis=1)
    s = (qh @ kh.transpose(0, 1, 3, 2)) * scale
    if causal:
        i = xp.arange(Sq)[:, None]
        j = xp.arange(Skv)[None, :]
        s = xp.where(j <= i + offset, s, -xp.inf)
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0)
    p = xp.exp(s - m)
    l_ = p.sum(axis=-1, keepdims=True)
    seen = l_ > 0
    o = (p @ vh) / xp.where(seen, l_, 1)
    lse = xp.where(seen[..., 0], m[..., 0] + xp.log(xp.where(seen, l_, 1)[..., 0]), -xp.inf)
    return o.transpose(0, 2, 1, 3), lse


def attention_reference(q, k, v, causal, scale, offset=0):
    """(out [B, S_q, H_q, D], lse [B, H_q, S_q]) as float64 host arrays (3-D inputs get B = 1) of
    q [B, S_q, H_q, D], k / v [B, S_kv, H_kv, D]; causal: key j is visible to query i iff
    j <= i + offset, and a row that sees no key gives 0 and -inf. Host arrays are computed in
    float64 with NumPy (up to NUMPY_REF_MAX scores), device bf16 / fp16 arrays and larger host ones
    in float32 with CuPy."""
    import cupy

    q4, k4, v4 = (x if x.ndim == 4 else x[None] for x in (q, k, v))
    B, Sq, Hq, _ = q4.shape
    if isinstance(q4, np.ndarray) and B * Hq * Sq * k4.shape[1] <= NUMPY_REF_MAX:
        return _attention(np, q4.astype(np.float64), k4.astype(np.float64), v4.astype(np.float64), causal, scale,
                          offset)
    q4, k4, v4 = (f32(dev(x) if isinstance(x, np.ndarray) else x) for x in (q4, k4, v4))
    o, lse = _attention(cupy, q4, k4, v4, causal, np.float32(scale), offset)
    return cupy.asnumpy(o).astype(np.float64), cupy.asnumpy(lse).astype(np.float64)


def host_result(out, lse=None):
    """(out [B, S, H_q, D], lse [B, H_q, S] or None) of an attention call as float64 host arrays; a
    3-D output gets B = 1."""
    got = host(out).astype(np.float64)
    got_lse = None if lse is None else np.asarray(lse.get(), dtype=np.float64)
    if out.ndim == 3:
        got = got[None]
        got_lse = None if got_lse is None else got_lse[None]
    return got, got_lse


def compare_attention(out, lse, ref, ref_lse, n_empty=0):
    """(ok, message) of a host output [B, S_q, H_q, D] (float64) against the reference: the whole
    output and every (batch, head, TILE-row tile); lse [B, H_q, S_q] unless None; the first n_empty
    rows see no key (0 and -inf)."""
    msgs, ok = [], True
    if not np.isfinite(out).all():
        bad = ~np.isfinite(out)
        rows = np.unique(np.nonzero(bad)[1])
        return False, f"nonfinite={int(bad.sum())} in rows {rows[:8].tolist()}{'...' if len(rows) > 8 else ''}"
    B, Sq, Hq, _ = ref.shape
    nref = np.linalg.norm(ref)
    if nref == 0:
        rel = 0.0 if not out.any() else float("inf")
        mx = float(np.abs(out).max())
    else:
        rel = float(np.linalg.norm(out - ref) / nref)
        mx = float(np.abs(out - ref).max() / np.abs(ref).max())
    msgs.append(f"rel={rel:.2e} max={mx:.2e}")
    ok &= rel < REL_TOL and (mx < MAX_TOL if nref else mx == 0)
    worst, bad_tiles = (0.0, None), []
    for t0 in range(0, Sq, TILE):
        d = out[:, t0:t0 + TILE] - ref[:, t0:t0 + TILE]
        num = np.sqrt((d * d).sum(axis=(1, 3)))
        den = np.sqrt((ref[:, t0:t0 + TILE] ** 2).sum(axis=(1, 3)))
        trel = np.where(den > 0, num / np.where(den > 0, den, 1), np.where(num > 0, np.inf, 0.0))
        for b in range(B):
            for h in range(Hq):
                if trel[b, h] > worst[0]:
                    worst = (float(trel[b, h]), (b, h, t0 // TILE))
                if not trel[b, h] < REL_TOL:
                    bad_tiles.append((b, h, t0 // TILE))
    msgs.append(f"worst-tile(b,h,t)={worst[1]}:{worst[0]:.2e}")
    if bad_tiles:
        ok = False
        msgs.append(f"bad-tiles={len(bad_tiles)}:{bad_tiles[:6]}")
    if n_empty:
        nz = int((out[:, :n_empty] != 0).sum())
        if nz:
            ok = False
            msgs.append(f"empty-rows-nonzero={nz}")
    if lse is not None:
        if lse.shape != ref_lse.shape:
            return False, f"lse shape {lse.shape}, expected {ref_lse.shape}"
        if n_empty and not np.isneginf(lse[..., :n_empty]).all():
            ok = False
            msgs.append(f"empty-rows-lse-not-minus-inf={int((~np.isneginf(lse[..., :n_empty])).sum())}")
        seen_l, seen_r = lse[..., n_empty:], ref_lse[..., n_empty:]
        if seen_l.size:
            if not np.isfinite(seen_l).all():
                ok = False
                msgs.append(f"lse-nonfinite={int((~np.isfinite(seen_l)).sum())}")
            else:
                e = float((np.abs(seen_l - seen_r) / (1 + np.abs(seen_r))).max())
                msgs.append(f"lse={e:.1e}")
                ok &= e < LSE_TOL
        if n_empty:
            msgs.append(f"empty-rows={n_empty}")
    return bool(ok), " ".join(msgs)


def compare_exact(got, got_lse, expect, ref_lse):
    """(ok, message, mismatches) of a host output got [B, S, H_q, D] that must be expect [B, H_q, D]
    bit for bit on every row, and of its lse (within LSE_TOL); mismatches is got's boolean mask."""
    bad = got != expect[:, None, :, :]
    tiles = sorted({(int(b), int(h), int(s) // TILE) for b, s, h, _ in zip(*np.nonzero(bad))})
    lse_err = float((np.abs(got_lse - ref_lse) / (1 + np.abs(ref_lse))).max()) if np.isfinite(got_lse).all() \
        else float("inf")
    ok = not tiles and lse_err < LSE_TOL
    return ok, (f"{int(bad.sum())} mismatching elements in {len(tiles)} (b, h, tile)s {tiles[:8]}; "
                f"lse err {lse_err:.1e}"), bad
