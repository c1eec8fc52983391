"""``gemm_allreduce(a, b, *, comm)``: the full sum over ranks of ``a_r @ b_r`` on every rank, by one
fused kernel: the ReduceScatter mechanism of gemm_reduce_scatter (each rank reduces its row
block tile by tile), then an AllGather phase of the reduced tiles inside the same kernel
(design: docs/TP.md). Importable without CuPy; the kernels are registered at import.
"""

from mkernel.ops import tp
from mkernel.ops.gemm_reduce_scatter import gemm_reduce

OP = "gemm_allreduce"
KERNEL = "mk_gemm_ar_kernel"
SPEC = tp.register(OP, "gemm_allreduce.cu", KERNEL)


def gemm_allreduce(a, b, *, comm, out=None, stream=None, b_layout=None, comm_sms=None, deterministic=True,
                   path=None, join=None):
    """Sum over ranks of ``a_r @ b_r``: returns ``[M, N]``, the same bits on every rank.

    Arguments as :func:`mkernel.gemm_reduce_scatter` (M a multiple of the world size, except on the
    latency path); ``out`` is ``[M, N]``. Inside one node at most ``config.tp_latency_max_rows``
    rows (256) take ``path="latency"`` by default: the decode GEMM into the one-shot all-reduce's
    scratch, then :func:`mkernel.allreduce` (any M; the same sum and bits rule).
    Each row block is reduced once, by its owner (fp32 sum in rank order, rounded once), and copied
    to every rank, so all ranks hold identical bits. ``comm_sms``: CTAs that reduce and gather,
    ``"auto"`` by default (:mod:`mkernel.split.search`), or an integer; ``join``: the GEMM CTAs also
    reduce and gather once their tiles are done (default: ``mkernel.config.get().tp_join_reduce``,
    "auto": inside one node).

    Between nodes, hierarchically: the ReduceScatter between nodes of gemm_reduce_scatter, then
    each reduced tile goes to this node's peers over NVLink and once to every other node (to the
    rank with the same local index, which passes it on to its node's peers): each rank sends
    ``2 * (nodes - 1) * M / world * N`` elements across the network, the minimum.
    """
    return gemm_reduce(OP, SPEC, KERNEL, True, a, b, comm=comm, out=out, stream=stream, b_layout=b_layout,
                       comm_sms=comm_sms, deterministic=deterministic, path=path, join=join)
