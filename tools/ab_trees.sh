#!/bin/bash
# A/B of source trees on the device: bench/<BENCH>.py (world 1) in each tree in turn, in one call, so
# their rows share the machine's state. Usage on the device, after `source .whl/prepare.sh`:
#   MAIN_COMMIT=<hash> bash tools/ab_trees.sh attention:scratch/old attention:. moe:scratch/old moe:.
# A tree is a worktree carried with the call (git worktree add scratch/old <commit>; echo <commit> >
# scratch/old/.abcommit; in it `python3 setup.py build_ext --inplace` for the proxy extension). Every
# tree compiles into MKERNEL_CACHE_DIR (default .kcache). JSON and logs in $OUT/ab.tar.gz.
set -u
export NCCL_NVLS_ENABLE=0 MKERNEL_CACHE_DIR=${MKERNEL_CACHE_DIR:-$PWD/.kcache}
i=0
for bt in "$@"; do
  b=${bt%%:*} t=${bt#*:}
  i=$((i + 1)) d=$OUT/ab/$i-$b-$(cat "$t/.abcommit" 2>/dev/null || basename "$(cd "$t" && pwd)")  # named by commit
  mkdir -p "$d"
  (cd "$t" && export PYTHONPATH=$PWD BENCH_COMMIT=$(cat .abcommit 2>/dev/null || echo "${MAIN_COMMIT:-main}") &&
    timeout 150 python3 "bench/$b.py" >"$d/$b.log" 2>&1
    cp bench/results/"$b"*-1gpu.json "$d/" 2>/dev/null)
  echo "$i $b $t: $(tail -1 "$d/$b.log" | cut -c1-150)"
  tar -C "$OUT" -czf "$OUT/ab.tar.gz" ab  # after every tree: a cut-off call still reports
done
rm -rf "$OUT/ab"
