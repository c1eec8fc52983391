"""The command queue and the proxy thread with CPU producers (null transport): one layout for C, the
device and Python; wrap-around, back-pressure, many producers, millions of commands, none lost or
duplicated or torn; an idle proxy sleeps; stop is prompt; a bad command is reported, not obeyed."""

import struct
import subprocess
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from mkernel.comm.proxy import (
    _CMD,
    NOP,
    WRITE,
    CommandQueue,
    Proxy,
    QueueArgs,
    QueueHeader,
    QueueStressArgs,
    TileExchangeArgs,
)
from mkernel.core.errors import MKernelError, TimeoutError

from tests.helpers.c_layout import assert_same_layout

CUDA_PRIMITIVES = Path(__file__).resolve().parents[2] / "mkernel" / "cuda" / "primitives"  # queue_layout.cuh

CMD_FIELDS = ["seq", "type", "flag_op", "peer", "bytes", "flag_value", "flag_id", "src_region", "dst_region",
              "src_off_hi", "dst_off_hi", "src_off_lo", "dst_off_lo"]


def _c_layout(tmp_path):
    """sizeof and offsetof of the command and header, as gcc compiles queue_layout.cuh as C (the proxy's view)."""
    lines = [f'P("MkCmd.{f}", offsetof(struct MkCmd, {f}));' for f in CMD_FIELDS]
    lines += [f'P("MkQueueHeader.{f}", offsetof(struct MkQueueHeader, {f}));'
              for f in ("tail", "error", "capacity", "reserve")]
    lines += ['P("sizeof MkCmd", sizeof(struct MkCmd));', 'P("sizeof MkQueueHeader", sizeof(struct MkQueueHeader));']
    src = tmp_path / "layout.c"
    src.write_text('#include <stdio.h>\n#include <stddef.h>\n#include "queue_layout.cuh"\n'
                   '#define P(n, v) printf("%s %zu\\n", n, (size_t)(v))\nint main(void) {\n'
                   + "\n".join(lines) + "\nreturn 0; }\n")
    subprocess.run(["gcc", "-x", "c", "-I", str(CUDA_PRIMITIVES), str(src), "-o", str(tmp_path / "layout")], check=True)
    out = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True).stdout
    return {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in out.splitlines()}


def test_layout_is_one_definition(tmp_path):
    c = _c_layout(tmp_path)
    assert c["sizeof MkCmd"] == 32 == _CMD.size
    offset = 0
    for f, code in zip(CMD_FIELDS, _CMD.format[1:]):  # the Python packer follows the C fields in order
        assert c[f"MkCmd.{f}"] == offset, f
        offset += struct.calcsize("<" + code)
    assert c["sizeof MkQueueHeader"] == 128 and c["MkQueueHeader.reserve"] == 64  # proxy and producer lines apart
    for f in ("tail", "error", "capacity", "reserve"):  # C sees what C++ (and ctypes, below) see
        assert c[f"MkQueueHeader.{f}"] == getattr(QueueHeader, f).offset, f


@pytest.mark.parametrize("header, cls, struct", [
    ("queue_layout.cuh", QueueHeader, "MkQueueHeader"), ("queue_layout.cuh", QueueArgs, "MkQueue"),
    ("queue_test_args.cuh", QueueStressArgs, None), ("queue_test_args.cuh", TileExchangeArgs, None)])
def test_ctypes_mirrors_match_the_headers(tmp_path, header, cls, struct):
    assert_same_layout(header, cls, tmp_path, struct)


def _null_proxy(queue, expected):
    proxy = Proxy(MPI.COMM_SELF, transport="null")
    proxy.attach_queue(queue)
    proxy.verify_commands(expected)
    return proxy


def _wait_tail(queue, proxy, n, timeout=60):
    deadline = time.monotonic() + timeout
    while queue.header.tail < n:
        proxy.check()
        assert time.monotonic() < deadline, f"tail stuck at {queue.header.tail} of {n}"
        time.sleep(0.001)


@pytest.mark.parametrize("capacity, threads, per_thread", [(64, 4, 500_000), (2, 3, 20_000), (1 << 12, 8, 50_000)],
                         ids=["2M-cmds-4-producers-cap64", "cap2-3-producers", "8-producers-cap4096"])
def test_many_producers_none_lost_or_duplicated(capacity, threads, per_thread):
    total = threads * per_thread
    queue = CommandQueue(capacity)
    with _null_proxy(queue, total) as proxy:
        proxy.start()
        queue.produce_test_commands(threads, per_thread, timeout_s=60)
        _wait_tail(queue, proxy, total)
        stats = proxy.stats()
    assert stats["verify"] == {"distinct": total, "duplicates": 0, "corrupt": 0}
    assert stats["commands"] == total == queue.header.tail == queue.header.reserve
    assert total > 20 * capacity  # wrapped around many times


def _push_verify_nop(queue, i, timeout_s=5):
    queue.push(NOP, 0, (i * 2654435761) & 0xFFFFFFFF, src=(0, i >> 32), dst=(0, ~i & 0xFFFFFFFF),
               flag=(0, i & 0xFFFFFFFF, 0), timeout_s=timeout_s)


def test_back_pressure_never_overwrites_unread_commands():
    queue = CommandQueue(8)
    with _null_proxy(queue, 8) as proxy:
        for i in range(8):  # the proxy is not running: the ring fills
            _push_verify_nop(queue, i)
        t = time.monotonic()
        with pytest.raises(TimeoutError, match="stayed full"):
            _push_verify_nop(queue, 8, timeout_s=0.2)
        assert 0.2 <= time.monotonic() - t < 2
        proxy.start()
        _wait_tail(queue, proxy, 8)
        time.sleep(0.05)
        stats = proxy.stats()
    # all eight intact; the timed-out ninth reservation was never published, so nothing past it is taken
    assert stats["verify"] == {"distinct": 8, "duplicates": 0, "corrupt": 0}
    assert queue.header.tail == 8 and queue.header.reserve == 9


def test_idle_proxy_backs_off_and_stops_promptly():
    queue = CommandQueue(64)
    with _null_proxy(queue, 1) as proxy:
        proxy.start()
        time.sleep(0.1)  # past the spinning phase
        cpu = time.process_time()
        time.sleep(1.0)
        used = time.process_time() - cpu
        assert used < 0.15, f"idle proxy used {used:.2f} s of CPU in 1 s"
        _push_verify_nop(queue, 0)  # still wakes up for work
        _wait_tail(queue, proxy, 1, timeout=1)
        t = time.monotonic()
        proxy.stop()
        assert time.monotonic() - t < 0.5
        assert proxy.stats()["verify"]["distinct"] == 1


def test_bad_command_is_reported_not_obeyed():
    queue = CommandQueue(8)
    with _null_proxy(queue, 0) as proxy:
        proxy.start()
        queue.push(WRITE, 5, 16)  # rank 5 of a 1-rank job, from an unregistered region
        deadline = time.monotonic() + 5
        while not queue.header.error:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        with pytest.raises(MKernelError, match="names rank 5"):
            proxy.check()
    assert queue.header.error == 4  # what a GPU producer waiting for space sees (MKP_ERR_LOCAL)
