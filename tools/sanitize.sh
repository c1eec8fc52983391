#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over every kernel at a small shape (tools/sanitize_targets.py),
# then with 2 ranks sharing the GPU: the TP kernels and ring attention (with a peer) and the MoE path
# between nodes with 2 ranks as 2 emulated nodes (host transport). Ranks run under MPS when a daemon
# runs (tools/mps.sh; pass CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), time-sliced otherwise.
# MKERNEL_SANITIZE_ONLY=tp / allreduce: only the TP ops' / the all-reduce's 2-rank target (both tools);
# =moe_gemm: only target_moe_gemm (below); =moe: target_moe, target_moe_nodes (2 ranks), target_moe_gemm;
# =ring: ring attention's 2-rank targets, in a node and between 2 emulated nodes.
# target_moe_gemm runs last under each tool, cut at MKERNEL_SANITIZE_MOE_GEMM_S (it froze under both tools
# from session 31 to 43, a register hand-back since fixed: bench/NOTES.md), so that a stall cannot keep the
# others from running.
set -u
rc=0
MPI2="mpirun -n 2 --oversubscribe --bind-to none -x MKERNEL_CACHE_DIR -x NCCL_NVLS_ENABLE -x MKERNEL_TIMEOUT_S"
MPI2+=" ${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:+-x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE -x CUDA_MPS_PIPE_DIRECTORY}"
export MKERNEL_TIMEOUT_S=${MKERNEL_TIMEOUT_S:-120}  # kernels run many times slower under the tools
source "$(dirname "$0")/mps.sh"
ranks2() {  # tool, NAME: sanitize.target_NAME() with 2 ranks
  echo "== $1: $2, 2 ranks =="
  $MPI2 compute-sanitizer --tool "$1" --error-exitcode 3 --print-limit 20 \
    python3 -c "from mkernel.diagnostics import sanitize; sanitize.target_$2(); print('$2: ok')" || rc=$?
}
for tool in memcheck racecheck; do
  case ${MKERNEL_SANITIZE_ONLY:-} in
    moe_gemm) break ;;
    tp) ranks2 "$tool" tp_world; continue ;;
    allreduce) ranks2 "$tool" allreduce; continue ;;
    ring) for t in ring_attention ring_attention_nodes; do ranks2 "$tool" $t; done; continue ;;
    moe)
      echo "== $tool: target_moe =="
      compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 python3 tools/sanitize_targets.py target_moe \
        || rc=$?
      ranks2 "$tool" moe_nodes; continue ;;
  esac
  ranks2 "$tool" tp_world
  echo "== $tool =="
  compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 python3 tools/sanitize_targets.py -target_moe_gemm \
    || rc=$?
  for t in allreduce ring_attention ring_attention_nodes moe_nodes; do ranks2 "$tool" $t; done
done
case ${MKERNEL_SANITIZE_ONLY:-} in tp | allreduce | ring) exit $rc ;; esac  # moe and moe_gemm go on to target_moe_gemm
limit=${MKERNEL_SANITIZE_MOE_GEMM_S:-90}
moe_gemm() {  # tool, extra options; its device timeout a third of the cut (not the 120 s above), so
  # that a stuck wait shows in the error word the target logs
  MKERNEL_TIMEOUT_S=$((limit / 3)) MKERNEL_SANITIZE_STACKS_S=$((limit - 10)) timeout -k 5 "$limit" \
    compute-sanitizer --tool "$1" "${@:2}" --error-exitcode 3 --print-limit 20 \
    python3 tools/sanitize_targets.py target_moe_gemm
  local r=$?
  # a client killed at the cut leaves an MPS server refusing the next (cudaErrorDevicesUnavailable)
  if [ $r = 124 ] || [ $r = 137 ]; then mps_running && mps_restart; fi
  return $r
}
stalled=
for tool in memcheck racecheck; do
  if [ -n "$stalled" ]; then
    # memcheck stalled: racecheck would too; instead memcheck with the fused combine left
    # uninstrumented (sessions 41-43 used it to tell the kernel's own stall from the tool's)
    if compute-sanitizer --help 2>&1 | grep -q -- --kernel-name-exclude; then
      echo "== memcheck, mk_moe_gemm_combine not instrumented: target_moe_gemm (cut at ${limit} s) =="
      moe_gemm memcheck --kernel-name-exclude kns=mk_moe_gemm_combine
      r=$?
      [ $r = 124 ] || [ $r = 137 ] && echo "target_moe_gemm with the fused combine uninstrumented: did not finish either"
      [ $r = 0 ] && echo "target_moe_gemm with the fused combine uninstrumented: finished (the stall is its own under the tool)"
    fi
    break
  fi
  echo "== $tool: target_moe_gemm (cut at ${limit} s) =="
  moe_gemm "$tool"
  r=$?
  [ $r = 124 ] || [ $r = 137 ] && echo "target_moe_gemm under $tool: did not finish in ${limit} s" && stalled=1
  [ $r = 0 ] || rc=$r
done
exit $rc
