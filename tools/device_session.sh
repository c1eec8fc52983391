#!/usr/bin/env bash
# One device call that does everything a session needs on the GPU machine (build, suite, sanitizer,
# benchmarks), logs under $OUT, then a summary last. Usage on the device:
#   source .whl/prepare.sh || exit 1; bash tools/device_session.sh [steps...]
# Steps (default: info suite main sanitizer gemm transport); finer ones: decode accab hostprof phases ncu (tools/ncu_gemm.py under Nsight Compute, NCU_SHAPES) ncusrc (ncu's stall samples per SASS instruction, as text) tpdecode arphases arfloor arbig4 llphases decseq ringmps nodesdiag runtime
# ringnodes / ringnodes4: bench/ring_attention.py between 2 emulated nodes (2 ranks; 2 x 2 ranks)
# test1 / test2: the pytest arguments in TEST_ARGS at 1 rank, and at 2 ranks (under MPS)
# moetcp / copiestest: MoE between 2 emulated nodes over tcp, and a caller's copies behind an op between nodes (2 ranks)
# faultsd (tools/faults.py scenario d for every op with a path between nodes, time-sliced)
# tptrace: tools/tp_trace.py (TRACE_ARGS: --op, --shape, --nodes, --comm-sms; default AR between 2 nodes), traces in logs
# suite1 / suite24: the suite's 1-rank pass / its 2- and 4-rank passes (the suite over two calls on a slow host)
# sanidecode: memcheck and racecheck of target_gemm_decode alone
# runtime2 queue queue2 tpnodes4 nodestest nodesrate suitets maints (tools/nodes_rate.py: small WRITEs and the TP ops between 2 emulated nodes)
# mpi2 gemmtest tp attention ring ringbench tpbench tpnodes moebench controller controllernodes (the last six want 2 GPUs) controllernodes4 (2 x 2 under MPS)
# controller1: bench/controller.py at world 1 (the comm is a local tile copy; the mechanism, not the issue's rows).
# branchmoe: a branch's fused MoE kernels under memcheck at world 1, then its MoE tests between 2 emulated nodes
# branchsuite / branchnodes / branchtpbench / branchtpnodes / branchringnodes / branchringmps / branchmoenodes: the GPU suite / its tests between nodes (2 ranks) / bench/tp.py (in a node / 2 emulated nodes) / ringnodes / ringmps / moebenchnodes of a branch checked out at $BRANCH_DIR
# (default scratch/branch: git worktree add scratch/branch <branch>; carry it), results in $OUT/branch.tar.gz (the A/B of
# a branch against main's tpbench). moe: the MoE tests at
# 1 and 2 ranks; moebench1: bench/moe.py at world 1; moenodes: tests/gpu/test_moe_nodes_gpu.py (its
# child jobs at 3 and 4 ranks, then 2 ranks as 2 nodes); moebenchnodes / moebenchnodes4: bench/moe.py --nodes 2 at 2 ranks / 2 x 2 ranks (MPS).
# A kernel cache built on a CPU machine (python -m mkernel precompile) is used when carried as .kcache.
# The copy on the device has no .git of its own (in session 6 git there reported the session's first
# commit, "-dirty"): write BENCH_COMMIT=<local HEAD's hash> into the command (a literal: a
# $(git rev-parse ...) would run on the device) so that results JSON name the commit that ran.
set -u
OUT=${OUT:-/tmp/mkernel-out}
LOGS=$(mktemp -d)/logs  # $OUT gets logs.tar.gz, results.tar.gz and summary.txt (8 files come back at most)
# A second session in the same call writes logs-2.tar.gz, results-2.tar.gz, summary-2.txt (not over the first's).
SFX=""
for i in 2 3 4 5 6 7 8 9; do [ -e "$OUT/summary$SFX.txt" ] || [ -e "$OUT/logs$SFX.tar.gz" ] || break; SFX=-$i; done
BRANCH_OUT=$(dirname "$LOGS")/branch  # a branch's results, as branch.tar.gz (loose files count against the 8)
mkdir -p "$LOGS" "$OUT"
touch "$LOGS/.start"  # results.tar.gz holds only the results this call wrote
collect() {  # after every step: a cut-off run still reports
  tar -C "$(dirname "$LOGS")" -czf "$OUT/logs$SFX.tar.gz" logs
  find bench/results -newer "$LOGS/.start" \( -name '*.json' -o -name '*.png' \) -print0 |
    tar --null -T - -czf "$OUT/results$SFX.tar.gz"
  [ -d "$BRANCH_OUT" ] && tar -C "$(dirname "$LOGS")" -czf "$OUT/branch$SFX.tar.gz" branch
  return 0
}
[ -d .kcache ] && export MKERNEL_CACHE_DIR=$PWD/.kcache
export MKERNEL_CACHE_DIR=${MKERNEL_CACHE_DIR:-$HOME/.cache/mkernel} PYTHONPATH=${PYTHONPATH:-}
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
steps=${*:-info suite main sanitizer gemm transport}
summary=()
step() {  # step NAME[_i] TIMEOUT CMD...; LIMIT_<NAME>=seconds overrides TIMEOUT
  local name=$1 v=LIMIT_${1%%_*}; local limit=${!v:-$2}; shift 2
  local t0=$SECONDS rc=0
  timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then  # a cut step's ranks outlive its shell: they would share the next step's GPU
    pkill -9 -f "python3 -m pytest" ; pkill -9 mpirun ; pkill -9 prted ; sleep 2
    echo "(step $name cut at ${limit}s: its leftover processes were killed)" >>"$LOGS/$name.log"
    [ "${MKERNEL_MPS_STARTED:-0}" = 1 ] && mps_restart  # killed clients can leave the server refusing new ones
  fi
  summary+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) "$(tail -1 "$LOGS/$name.log" | cut -c1-150)")")
  echo "${summary[-1]}"
}
# Two ranks on one GPU run under MPS (50% of the SMs each: at once, not time-sliced) unless
# MKERNEL_SESSION_MPS=0; tests/run_gpu.sh manages MPS for the suite itself.
source tools/mps.sh
MPI2="mpirun -n 2 --oversubscribe --bind-to none -x MKERNEL_CACHE_DIR -x NCCL_NVLS_ENABLE -x PYTHONPATH"
MPI4=${MPI2/-n 2/-n 4}
if [ "${MKERNEL_SESSION_MPS:-1}" = 1 ] && mps_start; then
  MPI2="env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 $MPI2 -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
  MPI4="env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 $MPI4 -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
fi
PYT="python3 -m pytest -q -p no:cacheprovider"
BRANCH_DIR=${BRANCH_DIR:-scratch/branch}  # the branch steps' tree (relative to the repository root)
branch_bench() {  # branch_bench NAME LIMIT BENCH ARGS...: a benchmark of the tree at $BRANCH_DIR, results in $BRANCH_OUT
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" bash -c "cd $BRANCH_DIR && python3 setup.py build_ext --inplace >/dev/null && \
    BENCH_COMMIT=${BRANCH_COMMIT:-${BENCH_COMMIT:-}} PYTHONPATH=\$PWD $MPI2 -x BENCH_COMMIT python3 $* --out $BRANCH_OUT"
}
for s in $steps; do
  case $s in
    info) step info 30 python3 -m mkernel info ;;
    suite) step suite 560 bash tests/run_gpu.sh ${SUITE_ARGS:-} ;;  # SUITE_ARGS: pytest arguments (word-split), e.g. -k tp_
    suite1) step suite1 400 env MKERNEL_SUITE_PASSES=1 bash tests/run_gpu.sh ${SUITE_ARGS:-} ;;  # the suite over two calls
    suite24) step suite24 400 env MKERNEL_SUITE_PASSES="2 4" bash tests/run_gpu.sh ${SUITE_ARGS:-} ;;  # (a slow host: 541 s whole)
    runtime) step runtime 90 $PYT -m gpu tests/gpu/test_comm_gpu.py ;;
    queue) step queue 60 $PYT -m "gpu and not (mpi and multi_gpu)" tests/gpu/test_queue_gpu.py ;;
    runtime2) step runtime2 90 $MPI2 $PYT -m "gpu and mpi and not slow" tests/gpu/test_comm_gpu.py ;;
    queue2) step queue2 90 $MPI2 $PYT -m "gpu and mpi" tests/gpu/test_queue_gpu.py ;;
    mpi2) step mpi2 150 $MPI2 $PYT -m "gpu and mpi and not slow" tests/gpu/test_comm_gpu.py tests/gpu/test_queue_gpu.py ;;
    gemmtest) step gemmtest 150 $PYT -s tests/cpu/test_gemm.py tests/gpu/test_gemm_gpu.py tests/cpu/test_gemm_compile.py ;;
    tp) step tp 150 bash -c "$PYT -m 'gpu and not (mpi and multi_gpu)' tests/gpu/test_tp_gpu.py tests/gpu/test_tp_controller_gpu.py; r=\$?; \
      $MPI2 $PYT -m 'gpu and mpi' tests/gpu/test_tp_gpu.py tests/gpu/test_tp_controller_gpu.py && exit \$r" ;;
    tpdiag) step tpdiag 60 python3 tools/tp_diag.py ;;
    main) step main 60 $MPI2 python3 -m mkernel --quick ;;
    suitets|maints)  # issue 24: the 2-rank suite pass and the main job time-sliced (no MPS daemon)
      [ "${MKERNEL_MPS_STARTED:-0}" = 1 ] && mps_quit
      if [ $s = suitets ]; then step suitets 300 env MKERNEL_SUITE_PASSES=" " MKERNEL_SUITE_TIMESLICED=1 bash tests/run_gpu.sh
      else step maints 120 mpirun -n 2 --oversubscribe --bind-to none -x MKERNEL_CACHE_DIR python3 -m mkernel; fi
      [ "${MKERNEL_MPS_STARTED:-0}" = 1 ] && mps_start ;;
    sanitizer) step sanitizer 480 bash tools/sanitize.sh ;;  # target_moe_gemm last, 2 x 90 s at most
    faultsd)  # scenario d time-sliced (under MPS a client that dies with a kernel in flight faults every client)
      [ "${MKERNEL_MPS_STARTED:-0}" = 1 ] && mps_quit
      step faultsd 300 env MKERNEL_TIMEOUT_S=5 python3 tools/faults.py --scenarios d --logs "$LOGS/faults" \
        --ops "${FAULT_OPS:-ring,rs,ar,ag,moe_dispatch_gemm,moe_gemm_combine}"
      [ "${MKERNEL_MPS_STARTED:-0}" = 1 ] && mps_start ;;
    faultsar)  # the all-reduce (data + flags, LL words) and the LL latency path: a, b, e under MPS, c time-sliced
      step faultsar_mps 270 env MKERNEL_TIMEOUT_S=5 python3 tools/faults.py --scenarios abe --ops "${FAULT_OPS:-allreduce,allreduce_ll,allreduce_2shot,ar_latency}"
      [ "${MKERNEL_MPS_STARTED:-0}" = 1 ] && mps_quit
      step faultsar_ts 160 env MKERNEL_TIMEOUT_S=5 python3 tools/faults.py --scenarios c --ops "${FAULT_OPS:-allreduce,allreduce_ll,allreduce_2shot,ar_latency}"
      [ "${MKERNEL_MPS_STARTED:-0}" = 1 ] && mps_start ;;
    gemm) step gemm 120 python3 bench/gemm.py ;;
    decode) step decode 120 python3 bench/gemm.py --decode ;;
    accab) step accab 200 bash -c "(cd $BRANCH_DIR && python3 setup.py build_ext --inplace >/dev/null) && \
      for t in \$PWD \$PWD/$BRANCH_DIR \$PWD; do PYTHONPATH=\$t python3 -P tools/accumulate_ab.py; done" ;;  # accumulate=True: this tree, main at $BRANCH_DIR, this tree
    ncu) step ncu 200 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
      python3 tools/ncu_gemm.py ${NCU_ARGS:-} ${NCU_SHAPES:-1x8192x8192 16x8192x8192 128x8192x8192} ;;  # not under MPS: MKERNEL_SESSION_MPS=0
    ncusrc) step ncusrc 240 bash -c "ncu --clock-control none --profile-from-start off --section SourceCounters \
      --section WarpStateStats --section SpeedOfLight --section MemoryWorkloadAnalysis -o $LOGS/ncusrc -f \
      python3 tools/ncu_gemm.py ${NCU_SHAPES:-64x8192x8192 128x8192x8192} && ncu -i $LOGS/ncusrc.ncu-rep --print-summary none \
      > $LOGS/ncusrc_details.txt && ncu -i $LOGS/ncusrc.ncu-rep --page source --csv --print-source sass > $LOGS/ncusrc_sass.csv" ;;  # per-instruction stall samples (SASS) of each kernel, MKERNEL_SESSION_MPS=0
    tpdecode) step tpdecode 200 $MPI2 python3 bench/tp_decode.py ;;
    arphases) step arphases 90 $MPI2 python3 tools/allreduce_phases.py ${PHASES_ARGS:-} ;;
    arfloor) step arfloor 90 $MPI2 python3 tools/allreduce_floor.py ${FLOOR_ARGS:-} ;;  # what bounds a small all-reduce (device and host)
    arbig4) step arbig4 150 $MPI4 python3 tools/allreduce_floor.py --sizes 16 --chunks "" ${BIG_ARGS:-} ;;  # 4 ranks: one-shot against two-shot (BIG_ARGS: --big sizes)
    llphases) step llphases 90 $MPI2 python3 tools/ll_phases.py ;;  # the LL latency path's phases from its trace spans
    phases) step phases 150 python3 tools/gemm_phases.py ${PHASES_GEMM_ARGS:-} ;;  # where a GEMM call's time goes: the decode and engine kernels' trace spans (MKERNEL_SESSION_MPS=0)
    hostprof) step hostprof 120 $MPI2 python3 tools/host_profile.py ${HOSTPROF_ARGS:-} ;;  # a steady-state call's host time by function (cProfile)
    decseq) step decseq 120 $MPI2 python3 tools/decode_sequences.py ${SEQ_ARGS:-} ;;  # kernel sequences at decode sizes (graphs)
    ringmps) step ringmps 300 $MPI2 python3 bench/ring_attention.py --quick --kv-heads 8 ${RING_ARGS:-} ;;
    ringnodes) step ringnodes 300 $MPI2 python3 bench/ring_attention.py --quick --kv-heads 8 --nodes 2 ${RING_ARGS:-} ;;
    ringnodes4) step ringnodes4 300 $MPI4 python3 bench/ring_attention.py --quick --kv-heads 8 --nodes 2 ${RING_ARGS:-} ;;
    nodesdiag) step nodesdiag 200 bash -c 'for s in ${NODESDIAG_SEQS:-grown first pregrow}; do CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=33 \
      mpirun -n 3 --oversubscribe --bind-to none -x MKERNEL_CACHE_DIR -x MKERNEL_TIMEOUT_S -x CUDA_MPS_PIPE_DIRECTORY \
      -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE python3 tools/nodes_diag.py --seq $s; done' ;;
    nodesrate) step nodesrate 240 $MPI2 python3 tools/nodes_rate.py ${NODESRATE_ARGS:-} ;;
    attention) step attention 150 python3 bench/attention.py ;;
    ring) step ring 240 $MPI2 $PYT -m "gpu and mpi" tests/gpu/test_ring_attention_gpu.py tests/gpu/test_ring_attention_errors_gpu.py tests/gpu/test_ring_attention_worlds_gpu.py ;;
    ringbench) step ringbench 360 $MPI2 python3 bench/ring_attention.py --kv-heads 8 ${RING_ARGS:-} ;;  # issue 25 heads (32/8): the same file as ringmps
    transport) step transport 90 $MPI2 python3 bench/transport.py ;;
    tpbench) step tpbench 400 $MPI2 python3 bench/tp.py ${TP_ARGS:-} ;;
    tpnodes) step tpnodes 300 $MPI2 python3 bench/tp.py --nodes 2 ${TP_ARGS:-} ;;
    tpnodes4) step tpnodes4 300 $MPI4 python3 bench/tp.py --nodes 2 ${TP_ARGS:-} ;;  # 2 nodes x 2 ranks, 33 SMs each
    nodestest) step nodestest 150 $PYT -rfE tests/gpu/test_tp_nodes_gpu.py ;;
    test1) step test1 200 $PYT -rfE ${TEST_ARGS:?TEST_ARGS: the pytest arguments} ;;  # word-split: no spaces inside -k
    test2) step test2 200 $MPI2 $PYT -rfE ${TEST_ARGS:?TEST_ARGS: the pytest arguments} ;;  # and at 2 (MPS)
    # test4: at 4 (MPS, 25% each), REPEAT times (logs test4_1, ...); the between-nodes files run their
    # 4-rank layouts as child jobs of test1 instead (at 4 ranks every case skips)
    test4) for i in $(seq "${REPEAT:-1}"); do
        step "test4_$i" 200 $MPI4 $PYT -rfE ${TEST_ARGS:?TEST_ARGS: the pytest arguments}; done ;;
    sanitp) step sanitp 240 env MKERNEL_SANITIZE_ONLY=tp bash tools/sanitize.sh ;;  # the TP ops' 2-rank target only
    saniring) step saniring 300 env MKERNEL_SANITIZE_ONLY=ring bash tools/sanitize.sh ;;  # ring attention's, in a node and between nodes
    saniar) step saniar 240 env MKERNEL_SANITIZE_ONLY=allreduce bash tools/sanitize.sh ;;  # the all-reduce's (and latency paths')
    sanidecode) for t in memcheck racecheck; do  # the decode GEMM's target alone (world 1)
        step "sanidecode_$t" 150 compute-sanitizer --tool $t --error-exitcode 3 --print-limit 20 \
          python3 tools/sanitize_targets.py target_gemm_decode; done ;;
    sanimoe) step sanimoe 420 env MKERNEL_SANITIZE_ONLY=moe bash tools/sanitize.sh ;;  # the MoE targets: world 1, 2 ranks as 2 nodes, target_moe_gemm
    sanimoegemm) step sanimoegemm 240 env MKERNEL_SANITIZE_ONLY=moe_gemm bash tools/sanitize.sh ;;  # target_moe_gemm only (memcheck, then its diagnosis)
    moetcp) step moetcp 120 $MPI2 $PYT -rfE -k 'emulated_nodes and tcp' tests/gpu/test_moe_nodes_gpu.py ;;
    copiestest) step copiestest 120 $MPI2 $PYT -rfE -k caller_copies tests/gpu/test_tp_nodes_gpu.py ;;
    moebench) step moebench 300 $MPI2 python3 bench/moe.py ;;
    moebench1) step moebench1 200 python3 bench/moe.py ;;
    moe) step moe 200 bash -c "$PYT -m gpu tests/gpu/test_moe_gpu.py tests/gpu/test_moe_errors_gpu.py tests/gpu/test_moe_gemm_gpu.py && \
      $MPI2 $PYT -m 'gpu and mpi and not slow' tests/gpu/test_moe_gpu.py tests/gpu/test_moe_errors_gpu.py tests/gpu/test_moe_gemm_gpu.py" ;;
    moebenchnodes) step moebenchnodes 300 $MPI2 python3 bench/moe.py --nodes 2 ;;
    moebenchnodes4) step moebenchnodes4 300 $MPI4 python3 bench/moe.py --nodes 2 ;;  # 2 nodes x 2 ranks
    moenodes) step moenodes 400 bash -c "$PYT -m gpu tests/gpu/test_moe_nodes_gpu.py; r=\$?; \
      $MPI2 $PYT -m 'gpu and mpi' tests/gpu/test_moe_nodes_gpu.py && exit \$r" ;;
    branchsuite) step branchsuite 420 bash -c "cd $BRANCH_DIR && python3 setup.py build_ext --inplace >/dev/null && \
      PYTHONPATH=\$PWD bash tests/run_gpu.sh" ;;
    branchnodes) step branchnodes 300 bash -c "cd $BRANCH_DIR && python3 setup.py build_ext --inplace >/dev/null && \
      PYTHONPATH=\$PWD $MPI2 $PYT -rfE -m 'gpu and mpi and not slow' tests/gpu/test_queue_gpu.py tests/gpu/test_tp_nodes_gpu.py \
      tests/gpu/test_moe_nodes_gpu.py tests/gpu/test_ring_attention_worlds_gpu.py" ;;
    branchmoe) step branchmoe 300 bash -c "cd $BRANCH_DIR && python3 setup.py build_ext --inplace >/dev/null && \
      export PYTHONPATH=\$PWD MKERNEL_TIMEOUT_S=30 && compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 10 \
      python3 tools/sanitize_targets.py target_moe_gemm; $MPI2 $PYT -rfE -x -m 'gpu and mpi' tests/gpu/test_moe_nodes_gpu.py" ;;  # before its A/B (2 ranks under MPS)
    branchtpbench) branch_bench branchtpbench 400 bench/tp.py ;;
    branchtpnodes) branch_bench branchtpnodes 300 bench/tp.py --nodes 2 ;;
    branchringnodes) branch_bench branchringnodes 300 bench/ring_attention.py --quick --kv-heads 8 --nodes 2 ;;
    branchringmps) branch_bench branchringmps 300 bench/ring_attention.py --quick --kv-heads 8 ${RING_ARGS:-} ;;
    branchmoenodes) branch_bench branchmoenodes 300 bench/moe.py --nodes 2 ;;
    tptrace) step tptrace 120 $MPI2 python3 tools/tp_trace.py --out "$LOGS/trace" ${TRACE_ARGS:-} ;;  # one traced TP call per SM
    ringtrace) step ringtrace 120 $MPI2 python3 tools/ring_trace.py --out "$LOGS/ringtrace" ${RINGTRACE_ARGS:---causal} ;;  # ring attention between 2 emulated nodes, traced
    copyorder) step copyorder 60 $MPI2 python3 tools/copy_order.py --out "$LOGS/copyorder" ;;  # do 2 ranks' host copies run at once?
    ringtrace4) step ringtrace4 120 $MPI4 python3 tools/ring_trace.py --out "$LOGS/ringtrace4" ${RINGTRACE_ARGS:---causal} ;;  # at 2 x 2 ranks
    moetrace) step moetrace 120 $MPI2 python3 tools/moe_trace.py --out "$LOGS/moetrace" ${MOETRACE_ARGS:-} ;;  # the fused MoE GEMM + combine between 2 emulated nodes, traced
    moetrace4) step moetrace4 150 $MPI4 python3 tools/moe_trace.py --out "$LOGS/moetrace4" ${MOETRACE_ARGS:-} ;;  # the same at 2 nodes x 2 ranks
    tptrace4) step tptrace4 120 $MPI4 python3 tools/tp_trace.py --out "$LOGS/trace4" ${TRACE_ARGS:-} ;;  # at 2 x 2 ranks
    controller) step controller 500 $MPI2 python3 bench/controller.py ${CONTROLLER_ARGS:-} ;;  # e.g. --op allgather_gemm
    controller1) step controller1 500 python3 bench/controller.py ;;
    controllernodes) step controllernodes 500 $MPI2 python3 bench/controller.py --nodes 2 ;;
    controllernodes4) step controllernodes4 500 $MPI4 python3 bench/controller.py --nodes 2 ${CONTROLLER_ARGS:-} ;;  # 2 x 2 (e.g. --op gemm_allreduce)
    *) summary+=("unknown step $s") ;;
  esac
  collect
done
mps_stop
grep -h "compiling " "$LOGS"/*.log | sort | uniq -c > "$LOGS/compiles.txt" || true
collect
echo "== summary =="
printf '%s\n' "${summary[@]}" | tee "$OUT/summary$SFX.txt"
