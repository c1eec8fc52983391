#!/usr/bin/env bash
# The GPU suite, on a machine with one or two H200s (mkernel installed, e.g. by .whl/prepare.sh):
# every gpu-marked test at one rank, then the ones meaningful at several ranks (marked mpi) at two
# ranks (one GPU each, or sharing GPU 0) and at four (sharing the GPUs): several code paths only
# exist from three ranks on (a ring of four steps, blocks owned by a rank that is neither me nor
# my one peer), and a bug there went unseen for sessions while the suite stopped at two.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export MKERNEL_CACHE_DIR=${MKERNEL_CACHE_DIR:-$HOME/.cache/mkernel} PYTHONPATH=${PYTHONPATH:-}
# Each pass has a wall-clock limit: a rank left inside a collective its peer never reaches (a test
# bug) would otherwise hold the machine until the caller's own limit.
LIMIT=${MKERNEL_SUITE_PASS_TIMEOUT_S:-300}
rc=0
pass_rc() {  # the pass's status into rc; a pass stopped by its limit says so
  local r=$1
  [ "$r" = 124 ] && echo "run_gpu.sh: the $2 pass ran past ${LIMIT} s (MKERNEL_SUITE_PASS_TIMEOUT_S) and was stopped"
  [ "$r" != 0 ] && rc=$r
  return 0
}
timeout -k 10 "$LIMIT" "$PY" -m pytest -q -m "gpu and not (mpi and multi_gpu)" tests "$@"; pass_rc $? "1-rank"
for n in 2 4; do
  timeout -k 10 "$LIMIT" mpirun -n $n --oversubscribe -x NCCL_NVLS_ENABLE -x PYTHONPATH -x MKERNEL_CACHE_DIR \
    "$PY" -m pytest -q -m "gpu and mpi and not slow" tests "$@"; pass_rc $? "$n-rank"
done
exit $rc
