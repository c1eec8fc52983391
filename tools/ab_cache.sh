#!/usr/bin/env bash
# A kernel cache for an A/B call that fits the device tool's 64 MiB carry beside scratch/branch:
# the named kernels of this tree and of the tree at scratch/branch (git archive <ref> there), in .kcache_ab.
#   bash tools/ab_cache.sh moe moe_nodes moe_gemm moe_gemm_combine gemm
# Then carry [".whl", ".kcache_ab", "scratch/branch"] with MKERNEL_CACHE_DIR=$PWD/.kcache_ab.
set -eu
[ $# -gt 0 ] || { echo "usage: $0 KERNEL... (python -m mkernel precompile's names)" >&2; exit 2; }
[ -d scratch/branch ] || { echo "no scratch/branch: git archive <ref> | tar -x -C scratch/branch first" >&2; exit 2; }
rm -rf .kcache_ab
MKERNEL_CACHE_DIR=$PWD/.kcache_ab python3 -m mkernel precompile "$@"
(cd scratch/branch && MKERNEL_CACHE_DIR=$OLDPWD/.kcache_ab python3 -m mkernel precompile "$@")
du -sh .kcache_ab scratch/branch
