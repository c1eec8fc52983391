#!/usr/bin/env bash
# One device call that does everything a session needs on the GPU machine (build, suite, sanitizer,
# benchmarks), logs under $OUT, then a summary last. Usage on the device:
#   source .whl/prepare.sh || exit 1; bash tools/device_session.sh [steps...]
# Steps (default: all): info suite main sanitizer gemm transport
# A kernel cache built on a CPU machine (python -m mkernel precompile) is used when carried as .kcache.
set -u
OUT=${OUT:-/tmp/mkernel-out}
LOGS=$(mktemp -d)/logs  # only the tarball, the summary and results JSON go to $OUT (8 files come back)
mkdir -p "$LOGS" "$OUT"
[ -d .kcache ] && export MKERNEL_CACHE_DIR=$PWD/.kcache
export MKERNEL_CACHE_DIR=${MKERNEL_CACHE_DIR:-$HOME/.cache/mkernel} PYTHONPATH=${PYTHONPATH:-}
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
steps=${*:-info suite main sanitizer gemm transport}
summary=()
step() {  # step NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
  summary+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) "$(tail -1 "$LOGS/$name.log" | cut -c1-150)")")
}
for s in $steps; do
  case $s in
    info) step info 60 python3 -m mkernel info ;;
    suite) step suite 420 bash tests/run_gpu.sh ;;
    main) step main 120 mpirun -n 2 --oversubscribe -x MKERNEL_CACHE_DIR -x NCCL_NVLS_ENABLE python3 -m mkernel --quick ;;
    sanitizer) step sanitizer 240 bash tools/sanitize.sh ;;
    gemm) step gemm 240 python3 bench/gemm.py ;;
    transport) step transport 180 mpirun -n 2 --oversubscribe -x MKERNEL_CACHE_DIR -x NCCL_NVLS_ENABLE python3 bench/transport.py ;;
  esac
done
grep -h "compiling " "$LOGS"/*.log | sort | uniq -c > "$LOGS/compiles.txt" || true
cp bench/results/*.json "$OUT"/ 2>/dev/null
tar -C "$(dirname "$LOGS")" -czf "$OUT/logs.tar.gz" logs
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
