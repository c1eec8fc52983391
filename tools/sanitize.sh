#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over every kernel at a small shape (tools/sanitize_targets.py),
# then with 2 ranks sharing the GPU: the TP kernels and ring attention (with a peer) and the MoE path
# between nodes with 2 ranks as 2 emulated nodes (host transport). Ranks run under MPS when a daemon
# runs (tools/mps.sh; pass CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), time-sliced otherwise.
# MKERNEL_SANITIZE_ONLY=tp / allreduce: only the TP ops' / the all-reduce's 2-rank target (both tools).
set -u
rc=0
MPI2="mpirun -n 2 --oversubscribe --bind-to none -x MKERNEL_CACHE_DIR -x NCCL_NVLS_ENABLE -x MKERNEL_TIMEOUT_S"
MPI2+=" ${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:+-x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE -x CUDA_MPS_PIPE_DIRECTORY}"
export MKERNEL_TIMEOUT_S=${MKERNEL_TIMEOUT_S:-120}  # kernels run many times slower under the tools
for tool in memcheck racecheck; do
  if [ "${MKERNEL_SANITIZE_ONLY:-}" = allreduce ]; then
    $MPI2 compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
      python3 -c "from mkernel.diagnostics import sanitize; sanitize.target_allreduce(); print('allreduce: ok')" || rc=$?
    continue
  fi
  echo "== $tool: TP ops, 2 ranks =="
  $MPI2 compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
    python3 -c "from mkernel.diagnostics import sanitize; sanitize.target_tp_world(); print('tp: ok')" || rc=$?
  [ "${MKERNEL_SANITIZE_ONLY:-}" = tp ] && continue
  echo "== $tool =="
  compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 python3 tools/sanitize_targets.py || rc=$?
  echo "== $tool: allreduce, 2 ranks =="
  $MPI2 compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
    python3 -c "from mkernel.diagnostics import sanitize; sanitize.target_allreduce(); print('allreduce: ok')" || rc=$?
  echo "== $tool: ring_attention, 2 ranks =="
  $MPI2 compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
    python3 -c "from mkernel.diagnostics import sanitize; sanitize.target_ring_attention(); print('ring_attention: ok')" || rc=$?
  echo "== $tool: moe between nodes, 2 ranks as 2 emulated nodes =="
  $MPI2 compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
    python3 -c "from mkernel.diagnostics import sanitize; sanitize.target_moe_nodes(); print('moe_nodes: ok')" || rc=$?
done
exit $rc
