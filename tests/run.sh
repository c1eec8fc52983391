#!/usr/bin/env bash
# The README's test command. Installs what the suite needs (the package with its `test` extra: an
# MPI wheel, NVRTC 13.0, pytest), then runs the suite at one rank and the MPI tests at 2 and 4 ranks,
# then the verbs transport's tests over soft-RoCE in a VM (tools/verbs_vm.sh).
# GPU tests skip with a reason where no sm_90 GPU is visible. Extra arguments go to the 1-rank pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# rdma-core headers let the proxy extension build its verbs transport; without them it still builds.
if [ ! -f /usr/include/infiniband/verbs.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs-dev; } >/dev/null 2>&1 ||
    echo "tests/run.sh: libibverbs-dev could not be installed; the verbs transport is built out"
fi
"$PY" -m pip install -q --disable-pip-version-check -e '.[test]'

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
# pytest exits 5 when a selection holds no test: not a failure for the MPI passes.
pytest_ok() { local rc=0; "$@" || rc=$?; [ "$rc" -eq 5 ] && rc=0; return "$rc"; }

"$PY" -m ruff check .  # lint (pyproject.toml [tool.ruff]): fails the command like a failing test
# C and CUDA format (.clang-format; the generated wgmma_ops.cuh excepted): clang-format -i to fix
git ls-files 'mkernel/cuda/*.cu' 'mkernel/cuda/*.cuh' 'mkernel/verbs/*.c' 'mkernel/verbs/*.h' | grep -v wgmma_ops.cuh |
  xargs "$PY" -c "import sys, clang_format; sys.argv[0] = 'clang-format'; clang_format.clang_format()" --dry-run --Werror
"$PY" -c "import sys; from importlinter.cli import lint_imports_command as c; sys.argv[1:] = ['--no-cache']; c()"  # the layers (pyproject.toml [tool.importlinter]): no package imports one above it
pytest_ok "$PY" -m pytest -q "$@"
for n in 2 4; do
  echo "== MPI tests at $n ranks =="
  pytest_ok mpiexec -n "$n" --oversubscribe --bind-to none "$PY" -m pytest -q -m mpi tests
done
# The verbs transport over soft-RoCE in a VM (~6 min of software emulation): where the VM's parts
# cannot be installed (not root, no apt), it says so and the command goes on.
echo "== the verbs transport over soft-RoCE (tools/verbs_vm.sh) =="
if [ "${MKERNEL_TEST_VERBS_VM:-1}" = 0 ]; then
  echo "skipped: MKERNEL_TEST_VERBS_VM=0"
elif ! bash tools/verbs_vm.sh --check; then
  echo "skipped: tools/verbs_vm.sh cannot start its VM here (above: why)"
else
  bash tools/verbs_vm.sh
fi
