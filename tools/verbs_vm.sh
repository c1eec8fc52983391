#!/bin/bash
# The verbs transport's tests over soft-RoCE (the kernel's rdma_rxe) in a throwaway VM, since this
# machine's own kernel has no RDMA. The VM (virtme-ng, QEMU) sees this machine's files read-only.
#   bash tools/verbs_vm.sh [pytest args]   default: the tests whose ids name verbs
#   bash tools/verbs_vm.sh --sh 'command'  a shell command in the VM ($PY: this Python)
#   bash tools/verbs_vm.sh --check         installs the VM's parts if missing (root, apt); 1 if it cannot
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$(${PYTHON:-python3} -c 'import sys; print(sys.executable)')  # the guest has no pyenv shims

kernel() { ls /boot/vmlinuz-* 2>/dev/null | sort -V | tail -1; }
have_parts() {
  [ -n "$(kernel)" ] && command -v qemu-system-x86_64 >/dev/null && command -v rdma >/dev/null &&
    command -v busybox >/dev/null && "$PY" -c "import virtme_ng" 2>/dev/null
}
if ! have_parts; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "tools/verbs_vm.sh: needs qemu-system-x86, a Debian kernel, busybox-static, rdma-core and virtme-ng;" \
      "installing them takes root and apt-get" >&2
    exit 1
  fi
  echo "tools/verbs_vm.sh: installing the VM's parts" >&2
  pkgs=(qemu-system-x86 linux-image-amd64 busybox-static rdma-core ibverbs-providers iproute2)
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}"; }
  } >/dev/null 2>&1 && "$PY" -m pip install -q --disable-pip-version-check virtme-ng >/dev/null 2>&1 ||
    { echo "tools/verbs_vm.sh: installing the VM's parts failed" >&2; exit 1; }
fi
[ "${1:-}" = --check ] && exit 0
# The guest cannot write bytecode (a read-only view) and compiling our modules under software
# emulation took 20-50 s a process (bench/NOTES.md session 44): compile them here (__pycache__, ignored)
"$PY" -m compileall -q "$ROOT/mkernel" "$ROOT/tests" "$ROOT/tools" >/dev/null || true

# Software emulation runs the tests several times slower than this machine: their limits scale
# (tests/helpers/jobs.py; pytest-timeout's 300 s from pyproject.toml)
SLOWDOWN=${MKERNEL_TEST_SLOWDOWN:-3}
if [ "${1:-}" = --sh ]; then
  RUN=$2
else
  ARGS=("$@")
  [ ${#ARGS[@]} -gt 0 ] || ARGS=(tests/cpu/test_transport.py tests/cpu/test_proxy_grow.py tests/cpu/test_verbs_probe.py
    -k "verbs and not without_verbs_headers")
  RUN="\"\$PY\" -m pytest -p no:cacheprovider -o timeout=$((300 * SLOWDOWN)) -v -rs ${ARGS[*]@Q}"
fi
GUEST=$(mktemp /tmp/verbs_vm.XXXXXX.sh)
trap 'rm -f "$GUEST"' EXIT
# In the VM: one soft-RoCE device on a dummy interface (rxe loops packets for its own address back).
cat >"$GUEST" <<GUEST_EOF
set -e
modprobe rdma_rxe
ip link add mk0 type dummy && ip addr add 10.77.0.1/24 dev mk0 && ip link set mk0 up
rdma link add rxe0 type rxe netdev mk0
cd "$ROOT"
export MKERNEL_TEST_SLOWDOWN=$SLOWDOWN PYTHONPATH="$ROOT" PY="$PY" PATH="$(dirname "$PY"):\$PATH" PYTHONDONTWRITEBYTECODE=1
"\$PY" -c "from mkernel.comm.proxy import probe_rdma; print('probe:', probe_rdma())"
$RUN
GUEST_EOF
# KVM inside this machine's own VM stops at boot (nested virtualisation): software emulation instead
# through a pipe: QEMU reopens a file given as its stdout, truncating a caller's log. vng runs
# virtme-run by name: PATH gets the Python's own bin (pyenv's shims are not rehashed after pip)
PATH="$(dirname "$PY"):$PATH" "$PY" -c "import sys; from virtme_ng.run import main; sys.argv[0] = 'vng'; sys.exit(main())" \
  --disable-kvm -r "$(kernel)" --memory 4G --cpus 2 --exec "bash $GUEST" 2>&1 | cat
