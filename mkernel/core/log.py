"""The 'mkernel' logger. Every line carries the rank, so interleaved mpirun output stays readable."""

import logging
import os

from mkernel.core import env

_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", "MV2_COMM_WORLD_RANK")


class _RankFilter(logging.Filter):
    rank = next((os.environ[v] for v in _RANK_VARS if v in os.environ), "0")

    def filter(self, record):
        record.rank = self.rank
        return True


_filter = _RankFilter()
logger = logging.getLogger("mkernel")
if not logger.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[mkernel rank %(rank)s] %(levelname)s %(message)s"))
    _handler.addFilter(_filter)
    logger.addHandler(_handler)
    logger.propagate = False
logger.setLevel(env.get("MKERNEL_LOG_LEVEL").upper())


def set_rank(rank: int) -> None:
    """Called by the communicator once MPI has said which rank this process is."""
    _filter.rank = str(rank)


def get_logger(name: str) -> logging.Logger:
    return logger.getChild(name)
