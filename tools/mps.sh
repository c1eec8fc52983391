# CUDA MPS for ranks sharing one GPU: under MPS they run at the same time on disjoint SM partitions
# (without it they are time-sliced and never run at once, which hides races between ranks).
# Source it, then:
#   mps_start        starts the control daemon unless one runs; MKERNEL_MPS_STARTED=1 if it did
#   mps_run N CMD... runs CMD with N ranks' share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/N)
#   mps_restart      after a GPU fault (one client's fault takes down every client on the GPU)
#   mps_stop         quits the daemon only if mps_start started it
# Starting the daemon needs the right to run nvidia-cuda-mps-control -d (root on the test machines).
# CUDA's own default directories, so that a daemon someone else started is found, not doubled.
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps} CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/var/log/nvidia-mps}
mps_running() { echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; }
mps_start() {
  MKERNEL_MPS_STARTED=${MKERNEL_MPS_STARTED:-0}
  mps_running && return 0
  command -v nvidia-cuda-mps-control >/dev/null || { echo "mps: nvidia-cuda-mps-control not found" >&2; return 1; }
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || return 1
  MKERNEL_MPS_STARTED=1
  for _ in 1 2 3 4 5 6 7 8 9 10; do mps_running && return 0; sleep 0.2; done
  echo "mps: the daemon did not answer" >&2; return 1
}
mps_quit() {  # quit waits for clients to exit: bounded, so a stray client cannot hang the caller
  echo quit | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1; for _ in $(seq 50); do mps_running || return 0; sleep 0.2; done; }
mps_stop() { [ "${MKERNEL_MPS_STARTED:-0}" = 1 ] && mps_quit; MKERNEL_MPS_STARTED=0; return 0; }
mps_restart() { mps_quit; pkill -f nvidia-cuda-mps-server 2>/dev/null; sleep 1; MKERNEL_MPS_STARTED=0; mps_start; }
mps_run() { local n=$1; shift; CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / n)) "$@"; }
