#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over every kernel at a small shape (tools/sanitize_targets.py),
# then ring attention with 2 ranks sharing the GPU (its kernel needs a peer) and the MoE path between
# nodes with 2 ranks as 2 emulated nodes (host transport).
set -u
rc=0
MPI2="mpirun -n 2 --oversubscribe -x MKERNEL_CACHE_DIR -x NCCL_NVLS_ENABLE"
for tool in memcheck racecheck; do
  echo "== $tool =="
  compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 python3 tools/sanitize_targets.py || rc=$?
  echo "== $tool: ring_attention, 2 ranks =="
  $MPI2 compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
    python3 -c "from mkernel.diagnostics import sanitize; sanitize.target_ring_attention(); print('ring_attention: ok')" || rc=$?
  echo "== $tool: moe between nodes, 2 ranks as 2 emulated nodes =="
  $MPI2 compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
    python3 -c "from mkernel.diagnostics import sanitize; sanitize.target_moe_nodes(); print('moe_nodes: ok')" || rc=$?
done
exit $rc
