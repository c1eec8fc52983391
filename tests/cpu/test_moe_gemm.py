"""CPU tests of the fused MoE kernels (dispatch + grouped GEMM, grouped GEMM + combine); the GPU tests
are tests/gpu/test_moe_gemm_gpu.py."""

import pytest


@pytest.mark.parametrize("spec", ["moe_gemm", "moe_gemm_combine"])
def test_fused_kernel_has_no_static_shared_memory(spec):
    """The fused kernels launch with the grouped GEMM's dynamic shared memory (gemm.SMEM_GROUPED, 1 KiB
    under the SM's limit); any static __shared__ variable would be padded to the dynamic part's
    1024-byte alignment and make every launch fail (CUDA_ERROR_INVALID_VALUE)."""
    from mkernel.runtime import compile as mkc

    log = mkc.compile_spec(mkc.REGISTRY[spec]).log
    assert "ptxas info" in log and "bytes smem" not in log, [line for line in log.splitlines() if "smem" in line]


@pytest.mark.parametrize("nodes, combine", [(1, "unfused"), (2, "fused"), (3, "fused")])
def test_default_paths(nodes, combine):
    """path=None: the fused dispatch + GEMM everywhere; the fused GEMM + combine only between nodes
    (inside one node it is slower than its blocks)."""
    import types

    from mkernel.ops import moe_gemm

    comm = types.SimpleNamespace(num_nodes=nodes)
    assert moe_gemm.default_path("moe_dispatch_gemm", comm) == "fused"
    assert moe_gemm.default_path("moe_gemm_combine", comm) == combine


def _order_words(rows, own, bm=128, block=8):
    """Mirror of moe_dispatch.cuh moe_tile_order: tile_order's words for groups of `rows` rows whose
    first `own` are own-origin (every group's own-origin-only M-tiles first, then the others)."""
    tm = [-(-r // bm) for r in rows]
    early = [o // bm for o in own]
    words = [0] * sum(tm)
    for g in range(len(rows)):
        mb, eb, et, e = sum(tm[:g]), sum(early[:g]), sum(early), early[g]
        for i in range(tm[g]):
            j, n = (i, e) if i < e else (i - e, tm[g] - e)
            b = j // block * block
            words[eb + i if i < e else et + (mb - eb) + (i - e)] = mb + i | (j - b) << 24 | min(block, n - b) << 28
    return words


@pytest.mark.parametrize("rows, own, tn", [([1016, 1030, 0, 129], [508, 1030, 0, 0], 28),
                                           ([300, 130], [260, 0], 3), ([5000], [2000], 2), ([1, 1, 1], [0, 1, 0], 1)])
@pytest.mark.parametrize("backward", [False, True])
def test_claim_order_walks_blocks_of_one_group(rows, own, tn, backward):
    """The fused GEMMs' claim order (moe_tiles.cuh moe_tile_id, mirrored by moe_nodes.claim_order):
    every group's own-origin-only M-tiles, then every group's others, each such run cut into blocks
    of at most 8 from its start, N-tile by N-tile inside a block; read backward, the blocks reversed."""
    from mkernel.ops import moe_nodes

    words = _order_words(rows, own)
    tm = [-(-r // 128) for r in rows]
    runs = [list(range(sum(tm[:g]), sum(tm[:g]) + own[g] // 128)) for g in range(len(rows))] + \
           [list(range(sum(tm[:g]) + own[g] // 128, sum(tm[:g + 1]))) for g in range(len(rows))]
    blocks = [run[i:i + 8] for run in runs for i in range(0, len(run), 8)]
    assert [w & 0xFFFFFF for w in words] == [m for b in blocks for m in b]
    if backward:
        blocks = [b[::-1] for b in reversed(blocks)]
    want = [m * tn + nt for b in blocks for nt in range(tn) for m in b]
    assert moe_nodes.claim_order(words, tn, backward) == want
