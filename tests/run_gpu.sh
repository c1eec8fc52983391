#!/usr/bin/env bash
# The GPU suite, on a machine with one or two H200s (mkernel installed, e.g. by .whl/prepare.sh):
# every gpu-marked test at one rank, then the ones meaningful at several ranks (marked mpi) at two
# and at four ranks: several code paths only exist from three ranks on.
#
# Ranks that share a GPU run under CUDA MPS (tools/mps.sh) by default, so that they truly run at
# once (2 ranks at 50% of the SMs, 4 at 25%); time-sliced ranks move in lockstep and hide races.
# The daemon is started if none runs and stopped only if this script started it. One client's GPU
# fault takes down every client: after a pass that saw one, the daemon is restarted (and it is said).
#   MKERNEL_SUITE_MPS=0         run the multi-rank passes time-sliced instead
#   MKERNEL_SUITE_TIMESLICED=1  add a time-sliced 2-rank pass (needs a daemon this script may stop)
#   MKERNEL_SUITE_PASSES="1 2 4" the passes to run, in order (rank counts)
#   MKERNEL_SUITE_DURATIONS=12  the slowest tests each pass names (those over 2 s)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export MKERNEL_CACHE_DIR=${MKERNEL_CACHE_DIR:-$HOME/.cache/mkernel} PYTHONPATH=${PYTHONPATH:-}
# Each pass has a wall-clock limit: a rank left inside a collective its peer never reaches (a test
# bug) would otherwise hold the machine until the caller's own limit.
LIMIT=${MKERNEL_SUITE_PASS_TIMEOUT_S:-360}
source tools/mps.sh
ngpus=$("$PY" -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())" 2>/dev/null || echo 1)
use_mps=0
if [ "${MKERNEL_SUITE_MPS:-1}" = 1 ] && [ "$ngpus" -lt 4 ]; then  # the 4-rank pass shares GPUs
  if mps_start; then use_mps=1; else echo "run_gpu.sh: MPS could not start: time-sliced passes"; fi
fi
# Every kernel compiled before the passes, 8 at a time (a pass then times its tests, not NVRTC; cached
# kernels cost nothing): session 55's 1-rank pass took 294 s with half the kernels compiled inside it.
t0=$SECONDS
"$PY" -m mkernel precompile --jobs 8 >/dev/null 2>&1 || echo "run_gpu.sh: precompile failed (each test compiles what it needs)"
echo "run_gpu.sh: kernels compiled or found cached in $((SECONDS - t0)) s"
rc=0
log=$(mktemp)
pass() {  # pass NAME RANKS CMD...: runs one pass, records its status, restarts MPS after a GPU fault
  local name=$1 n=$2; shift 2
  local pct=100
  [ "$use_mps" = 1 ] && [ "$n" -gt "$ngpus" ] && pct=$((100 * ngpus / n))  # ranks per GPU share its SMs
  echo "== $name pass ($n rank(s), $([ "$use_mps" = 1 ] && echo "MPS, ${pct}% of the SMs each" || echo time-sliced)) =="
  if [ "$use_mps" = 1 ]; then export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct; else unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; fi
  timeout -k 10 "$LIMIT" "$@" 2>&1 | tee "$log"
  local r=${PIPESTATUS[0]}
  [ "$r" = 124 ] && echo "run_gpu.sh: the $name pass ran past ${LIMIT} s (MKERNEL_SUITE_PASS_TIMEOUT_S) and was stopped"
  [ "$r" != 0 ] && rc=$r
  if [ "$use_mps" = 1 ] && grep -qE "cudaErrorLaunchFailure|cudaErrorIllegalAddress|CUDA_ERROR_LAUNCH_FAILED|CUDA_ERROR_ILLEGAL|cudaErrorDevicesUnavailable" "$log"; then
    echo "run_gpu.sh: the $name pass saw a GPU fault: restarting the MPS daemon"
    mps_restart || { echo "run_gpu.sh: MPS did not restart"; use_mps=0; }
  fi
  return 0
}
# A test past this limit dumps every thread's stack and ends its process (pytest-timeout's thread
# method): a rank stuck inside a C call (a blocking MPI collective) is seen instead of hanging the pass.
TEST_LIMIT=(--timeout="${MKERNEL_SUITE_TEST_TIMEOUT_S:-150}" -o timeout_method=thread)
# Each pass names its slowest tests, so that a pass that grows shows where (the budget is 8 minutes).
TEST_LIMIT+=(--durations="${MKERNEL_SUITE_DURATIONS:-12}" --durations-min=2)
MPIRUN=(mpirun --oversubscribe --bind-to none -x NCCL_NVLS_ENABLE -x PYTHONPATH -x MKERNEL_CACHE_DIR -x CUDA_MPS_PIPE_DIRECTORY)
for n in ${MKERNEL_SUITE_PASSES:-1 2 4}; do
  if [ "$n" = 1 ]; then
    pass 1-rank 1 "$PY" -m pytest -q "${TEST_LIMIT[@]}" -m "gpu and not (mpi and multi_gpu)" tests "$@"
  else
    pass "$n-rank" "$n" "${MPIRUN[@]}" $([ "$use_mps" = 1 ] && echo -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) -n "$n" "$PY" -m pytest -q "${TEST_LIMIT[@]}" -m "gpu and mpi and not slow" tests "$@"
  fi
done
if [ "${MKERNEL_SUITE_TIMESLICED:-0}" = 1 ]; then
  if [ "$use_mps" = 1 ] && [ "$MKERNEL_MPS_STARTED" != 1 ]; then
    echo "run_gpu.sh: an MPS daemon this script did not start is running: no time-sliced pass"
  else
    mps_stop; use_mps=0
    pass "2-rank time-sliced" 2 "${MPIRUN[@]}" -n 2 "$PY" -m pytest -q "${TEST_LIMIT[@]}" -m "gpu and mpi and not slow" tests "$@"
  fi
fi
mps_stop
rm -f "$log"
exit $rc
