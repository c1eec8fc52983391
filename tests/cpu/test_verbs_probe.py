"""The verbs part builds, imports and reports the absence of RDMA clearly; 'auto' picks a transport
from what exists (verbs, else host memory on one host, else TCP); where a port is active (soft-RoCE
under tools/verbs_vm.sh), it is reported, chosen, and a wrong device or port is named."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mpi4py import MPI

from mkernel.comm.proxy import Proxy, probe_rdma, select_transport
from mkernel.core.errors import ArgumentError, NoRDMADeviceError

from tests.helpers.jobs import relaunch
from tests.helpers.rdma import NEEDS_RDMA

ROOT = Path(__file__).resolve().parents[2]


def _verbs_headers():
    r = subprocess.run(["cc", "-fsyntax-only", "-x", "c", "-"],
                       input=b"#include <infiniband/verbs.h>\n#include <infiniband/efadv.h>\n", capture_output=True)
    return r.returncode == 0


def _no_rdma_here():
    ports, _ = probe_rdma()
    return ports <= 0


def test_extension_has_verbs_exactly_when_headers_were_there():
    from mkernel import verbs
    assert verbs.HAVE_VERBS == _verbs_headers()


def test_extension_links_neither_libibverbs_nor_libcuda():
    from mkernel.verbs import _proxy
    needed = subprocess.run(["readelf", "-d", _proxy.__file__], capture_output=True, text=True).stdout
    assert "libibverbs" not in needed and "libcuda" not in needed and "libefa" not in needed


@pytest.mark.skipif(not _no_rdma_here(), reason="an RDMA device is present: the 'no RDMA' path cannot be seen here")
def test_no_rdma_is_reported_clearly():
    ports, report = probe_rdma()
    assert ports in (0, -1) and report.startswith("no RDMA"), report
    with pytest.raises(NoRDMADeviceError, match="verbs.*no RDMA"):
        Proxy(MPI.COMM_SELF, transport="verbs")


@pytest.mark.skipif(not _no_rdma_here(), reason="an RDMA device is present: 'auto' picks verbs")
def test_auto_picks_host_memory_on_one_host():
    assert select_transport("auto", MPI.COMM_SELF, [0]) == "host"


@pytest.mark.mpi
@pytest.mark.skipif(not _no_rdma_here(), reason="an RDMA device is present: 'auto' picks verbs")
def test_auto_picks_tcp_across_hosts(request, monkeypatch):
    if relaunch(request):
        return
    comm = MPI.COMM_WORLD
    monkeypatch.setattr(socket, "gethostname", lambda: f"host{comm.Get_rank()}")
    assert select_transport("auto", comm, list(range(comm.Get_size()))) == "tcp"
    monkeypatch.undo()
    assert select_transport("auto", comm, list(range(comm.Get_size()))) == "host"


@NEEDS_RDMA
def test_an_active_port_is_reported_and_auto_picks_verbs():
    ports, report = probe_rdma()
    assert ports >= 1 and "port 1 active" in report, report
    assert select_transport("auto", MPI.COMM_SELF, [0]) == "verbs"


def _has_v2_ipv4_gid(device, port):
    """Whether sysfs lists an IPv4-mapped GID of type RoCE v2 on the port (an IPv6-only port has none)."""
    ports = Path("/sys/class/infiniband") / device / "ports" / str(port)
    for gid in (ports / "gids").glob("*"):
        kind = ports / "gid_attrs" / "types" / gid.name
        try:
            if gid.read_text().startswith("0000:0000:0000:0000:0000:ffff:") and "v2" in kind.read_text():
                return True
        except OSError:  # unset entries cannot be read on some kernels
            continue
    return False


@NEEDS_RDMA
def test_roce_picks_a_v2_ipv4_gid_unless_told(monkeypatch):
    """A routed RoCE network carries RoCE v2 over IPv4 (tools/verbs_vm.sh's rxe device has fe80:: at
    index 0, ::ffff:10.77.0.1 at 1, both v2); MKERNEL_VERBS_GID_INDEX overrides."""
    with Proxy(MPI.COMM_SELF, transport="verbs") as proxy:
        endpoint = proxy.verbs_endpoint()
    if "(RoCE)" not in endpoint:
        pytest.skip(f"not a RoCE port: {endpoint}")
    device, rest = endpoint.split(" port ", 1)
    if not _has_v2_ipv4_gid(device, int(rest.split()[0])):
        pytest.skip(f"the port holds no RoCE v2 GID over IPv4: {endpoint}")
    assert "::ffff:" in endpoint and "(RoCE v2)" in endpoint, endpoint
    monkeypatch.setenv("MKERNEL_VERBS_GID_INDEX", "0")
    with Proxy(MPI.COMM_SELF, transport="verbs") as proxy:
        assert "GID index 0 " in proxy.verbs_endpoint()
    with Proxy(MPI.COMM_SELF, transport="tcp") as proxy, pytest.raises(ArgumentError, match="no RDMA device is open"):
        proxy.verbs_endpoint()


@NEEDS_RDMA
def test_an_unknown_device_or_port_is_named(monkeypatch):
    monkeypatch.setenv("MKERNEL_VERBS_DEVICE", "mk_no_such_device")
    with pytest.raises(NoRDMADeviceError, match="rank 0: verbs: no device named mk_no_such_device with port 1"):
        Proxy(MPI.COMM_SELF, transport="verbs")
    monkeypatch.setenv("MKERNEL_VERBS_DEVICE", "")
    monkeypatch.setenv("MKERNEL_VERBS_PORT", "9")
    with pytest.raises(NoRDMADeviceError, match="no device with port 9 active"):
        Proxy(MPI.COMM_SELF, transport="verbs")


@pytest.mark.slow
def test_builds_and_imports_without_verbs_headers(tmp_path):
    build = subprocess.run([sys.executable, str(ROOT / "mkernel/verbs/build_proxy.py"), str(tmp_path)],
                           capture_output=True, text=True, env=dict(os.environ, MKERNEL_BUILD_VERBS="0"), cwd=tmp_path,
                           timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    assert "without the verbs transport" in build.stderr
    so = build.stdout.strip().splitlines()[-1]
    check = textwrap.dedent(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("mkernel.verbs._proxy", {so!r})
        m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
        buf = m.ffi.new("char[]", 256)
        assert m.lib.mk_verbs_available() == 0
        n = m.lib.mk_verbs_probe(buf, 256)
        print(n, m.ffi.string(buf).decode())
    """)
    r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    n, report = r.stdout.split(" ", 1)
    assert int(n) <= 0 and ("no RDMA" in report or "no verbs transport" in report), report


def _libcuda_loads():
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.mark.skipif(_libcuda_loads(), reason="libcuda is present here: the no-driver path cannot be seen")
def test_cuda_regions_without_a_driver_say_so():
    from mkernel.core.errors import ArgumentError
    with pytest.raises(ArgumentError, match="libcuda.so.1 could not be loaded"):
        Proxy(MPI.COMM_SELF, transport="null", cuda_device=0)
    with Proxy(MPI.COMM_SELF, transport="null") as proxy:  # host regions need no driver
        with pytest.raises(ArgumentError, match="CUDA memory but no CUDA device"):
            proxy.register(0, 4096, 4096, "cuda")
