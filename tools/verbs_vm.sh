#!/bin/bash
# Runs the verbs transport's tests over soft-RoCE (the kernel's rdma_rxe) in a throwaway VM, since
# this machine's own kernel has no RDMA: `bash tools/verbs_vm.sh [pytest args]` (default: every test
# whose id names verbs), or `bash tools/verbs_vm.sh --sh 'command'` (a shell command there). The VM (virtme-ng, QEMU) sees this machine's files read-only, /tmp its own.
# Needs root once to install qemu-system-x86, a Debian kernel, busybox-static and rdma-core.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KERNEL=$(ls /boot/vmlinuz-* 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$KERNEL" ] || ! command -v qemu-system-x86_64 >/dev/null || ! command -v vng >/dev/null ||
  ! command -v rdma >/dev/null; then
  echo "tools/verbs_vm.sh: installing the VM's parts" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-system-x86 linux-image-amd64 \
    busybox-static rdma-core ibverbs-providers iproute2 >/dev/null
  python3 -m pip install -q virtme-ng
  KERNEL=$(ls /boot/vmlinuz-* | sort -V | tail -1)
fi
if [ "${1:-}" = --sh ]; then
  RUN=$2
else
  ARGS=("$@")
  [ ${#ARGS[@]} -gt 0 ] || ARGS=(tests/cpu/test_transport.py tests/cpu/test_proxy_grow.py tests/cpu/test_verbs_probe.py -k "verbs and not without_verbs_headers")
  RUN="\"\$PY\" -m pytest -p no:cacheprovider -v -rs ${ARGS[*]@Q}"
fi
PY=$(python3 -c 'import sys; print(sys.executable)')  # the guest has no pyenv shims
GUEST=$(mktemp /tmp/verbs_vm.XXXXXX.sh)
trap 'rm -f "$GUEST"' EXIT
# Inside: one soft-RoCE device on a dummy interface (rxe loops a packet for its own address back).
cat >"$GUEST" <<GUEST_EOF
set -e
modprobe rdma_rxe
ip link add mk0 type dummy && ip addr add 10.77.0.1/24 dev mk0 && ip link set mk0 up
rdma link add rxe0 type rxe netdev mk0
cd "$ROOT"
export PYTHONPATH="$ROOT" PY="$PY" PATH="$(dirname "$PY"):\$PATH" PYTHONDONTWRITEBYTECODE=1
"\$PY" -c "from mkernel.comm.proxy import probe_rdma; print('probe:', probe_rdma())"
$RUN
GUEST_EOF
# KVM inside this machine's VM stops at boot (nested virtualisation): software emulation instead
exec vng --disable-kvm -r "$KERNEL" --memory 4G --cpus 2 --exec "bash $GUEST"
