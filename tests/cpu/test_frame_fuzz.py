"""Fuzzing the TCP transport's frame check, the gate between the network and registered memory.

1. The C check against an independent Python model of the rules, on arbitrary headers.
2. A live proxy fed hostile byte streams over a socket: it rejects and reports, and never writes a
   byte outside its regions (guard bytes around them stay zero) nor anything of a rejected frame."""

import socket
import struct
import time

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mkernel.verbs import ffi, lib

FRAME = struct.Struct("<IBBBBIIIIIIQ")  # mk_frame (frame.h)
MAGIC, PAYLOAD_MAX = 0x31464B4D, 512 << 10
DATA, SIGNAL, FLUSH, FLUSH_ACK, BYE = 1, 2, 3, 4, 5
REGIONS = {0: 4096, 3: 100}  # id: bytes
FLAGS_REGION, NFLAGS = 7, 16
GUARD = 4096


def _valid_model(magic, type_, flag_op, region, pad, nbytes, write_bytes, id_, flag_id, flag_value, pad2, offset):
    if magic != MAGIC or pad or pad2 or flag_op > 2:
        return False
    flagged = flag_op != 0
    if flagged and flag_id >= NFLAGS:
        return False
    if type_ == DATA:
        size = REGIONS.get(region)
        return (nbytes <= PAYLOAD_MAX and nbytes <= write_bytes and size is not None and offset <= size
                and nbytes <= size - offset)
    if type_ == SIGNAL:
        return nbytes == 0 and flagged
    if type_ in (FLUSH, FLUSH_ACK, BYE):
        return nbytes == 0 and not flagged
    return False


class _Memory:
    """Regions laid out inside one buffer with guard bytes between and around them."""

    def __init__(self):
        sizes = list(REGIONS.values()) + [4 * NFLAGS]
        self.buf = np.zeros(GUARD + sum(s + GUARD for s in sizes), dtype=np.uint8)
        self.spans, at = {}, GUARD
        for rid, size in list(REGIONS.items()) + [(FLAGS_REGION, 4 * NFLAGS)]:
            self.spans[rid] = (at, size)
            at += size + GUARD

    def proxy(self, transport=1):
        p = lib.mk_proxy_create(0, 2, transport, 5.0)
        for rid, (at, size) in self.spans.items():
            assert lib.mk_proxy_register(p, rid, self.buf.ctypes.data + at, size, 0) == 0
        assert lib.mk_proxy_set_flags(p, FLAGS_REGION) == 0
        return p

    def guards_clean(self):
        inside = np.zeros(self.buf.size, dtype=bool)
        for at, size in self.spans.values():
            inside[at:at + size] = True
        return not self.buf[~inside].any()

    def flags(self):
        at, size = self.spans[FLAGS_REGION]
        return self.buf[at:at + size].view(np.uint32)


_MEM = _Memory()
_PROXY = _MEM.proxy()

u32 = st.integers(0, 2**32 - 1)
edge32 = st.one_of(st.integers(0, 8),
                   st.sampled_from([PAYLOAD_MAX - 1, PAYLOAD_MAX, PAYLOAD_MAX + 1, 2**31, 2**32 - 1]), u32)
edge64 = st.one_of(st.integers(0, 5000), st.sampled_from([2**48 - 1, 2**63, 2**64 - 1, 2**64 - 4096]),
                   st.integers(0, 2**64 - 1))
fields = st.tuples(st.sampled_from([MAGIC, MAGIC ^ 1, 0]), st.integers(0, 7), st.integers(0, 3), st.integers(0, 255),
                   st.sampled_from([0, 0, 0, 1]), edge32, edge32, u32, st.integers(0, NFLAGS + 2), u32,
                   st.sampled_from([0, 0, 0, 1]), edge64)


@settings(max_examples=3000, deadline=None)
@given(fields)
def test_check_agrees_with_model(f):
    why = ffi.new("char[]", 96)
    accepted = lib.mk_tcp_check_frame(_PROXY, 1, FRAME.pack(*f), FRAME.size, why, 96) == 0
    assert accepted == _valid_model(*f), (f, ffi.string(why))


def test_a_payload_into_the_flag_array_is_rejected():
    """Flags change only through a frame's flag (after its write's bytes), never by a payload (the
    case hypothesis found: the check took the flag array for a data region)."""
    why = ffi.new("char[]", 96)
    check = lambda f: lib.mk_tcp_check_frame(_PROXY, 1, FRAME.pack(*f), FRAME.size, why, 96)  # noqa: E731
    assert check((MAGIC, DATA, 0, FLAGS_REGION, 0, 0, 0, 0, 0, 0, 0, 0)) != 0
    assert check((MAGIC, DATA, 0, FLAGS_REGION, 0, 4, 4, 0, 0, 0, 0, 8)) != 0
    assert check((MAGIC, DATA, 0, 0, 0, 8, 8, 0, 0, 0, 0, 0)) == 0  # a data region still takes it


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=64))
def test_arbitrary_bytes_never_crash(data):
    why = ffi.new("char[]", 96)
    r = lib.mk_tcp_check_frame(_PROXY, 1, data, len(data), why, 96)
    if len(data) != FRAME.size:
        assert r != 0 and b"short or long" in ffi.string(why)


def _data_frame(region, offset, nbytes, flag_id, value, write_id):
    return FRAME.pack(MAGIC, DATA, 1, region, 0, nbytes, nbytes, write_id, flag_id, value, 0, offset)


# Well-formed DATA headers that reach just past a region's end: the frames a bounds bug would obey.
out_of_bounds = st.tuples(st.sampled_from(sorted(REGIONS)), st.integers(0, 2 * GUARD),
                          st.integers(1, 2 * GUARD)).filter(
    lambda w: w[1] + w[2] > REGIONS[w[0]]).map(lambda w: (MAGIC, DATA, 0, w[0], 0, w[2], w[2], 0, 0, 0, 0, w[1]))
hostile_frames = st.one_of(out_of_bounds, fields.filter(lambda f: not _valid_model(*f)))

valid_write = st.tuples(st.sampled_from(sorted(REGIONS)), st.integers(0, 100), st.integers(0, 64)).filter(
    lambda w: w[1] + w[2] <= REGIONS[w[0]])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(valid_write, max_size=6), st.one_of(st.none(), hostile_frames))
def test_live_proxy_rejects_hostile_streams(writes, hostile):
    _MEM.buf[:] = 0
    p = _MEM.proxy()
    mine, theirs = socket.socketpair()
    try:
        assert lib.mk_tcp_add_connection(p, 1, theirs.detach()) == 0
        assert lib.mk_proxy_start(p) == 0
        stream = b""
        for i, (region, offset, nbytes) in enumerate(writes):  # payload bytes 0x11: valid data
            stream += _data_frame(region, offset, nbytes, i, 1000 + i, i) + b"\x11" * nbytes
        if hostile is not None:  # then a rejected header, with 0xEE bytes where a payload would follow
            stream += FRAME.pack(*hostile) + b"\xee" * min(hostile[5], 4096)
        else:
            stream += FRAME.pack(MAGIC, BYE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        mine.sendall(stream)
        mine.shutdown(socket.SHUT_WR)
        info = ffi.new("mk_error_info*")
        deadline = time.monotonic() + 5
        flags = _MEM.flags()
        while not lib.mk_proxy_error(p, info) and not all(flags[i] == 1000 + i for i in range(len(writes))):
            assert time.monotonic() < deadline, "proxy neither applied the writes nor reported"
            time.sleep(0.001)
        lib.mk_proxy_stop(p)
        stats = ffi.new("mk_proxy_stats*")
        lib.mk_proxy_get_stats(p, stats, ffi.NULL)
        assert _MEM.guards_clean(), "a frame wrote outside the registered regions"
        assert not (_MEM.buf == 0xEE).any(), "bytes of a rejected frame were written"
        if hostile is not None:
            assert lib.mk_proxy_error(p, info) == 2 and b"rejected" in ffi.string(info.message)
            assert stats.frames_rejected == 1
        else:
            assert lib.mk_proxy_error(p, info) == 0, ffi.string(info.message)
            assert all(flags[i] == 1000 + i for i in range(len(writes)))
            for region, offset, nbytes in writes:
                at, _ = _MEM.spans[region]
                assert (_MEM.buf[at + offset:at + offset + nbytes] == 0x11).all()
    finally:
        mine.close()
        lib.mk_proxy_destroy(p)


def test_peer_closing_after_a_flush_it_did_not_wait_for_is_not_an_error():
    """A peer that sends FLUSH, then BYE, and closes (a proxy may stop without waiting for its last
    FLUSH's acknowledgement) leaves an ACK queued for a closed connection: it is dropped, and the
    proxy keeps serving its other peers instead of failing on the closed socket (a 3-node bug)."""
    p = _MEM.proxy()
    mine, theirs = socket.socketpair()
    try:
        assert lib.mk_tcp_add_connection(p, 1, theirs.detach()) == 0
        mine.sendall(FRAME.pack(MAGIC, FLUSH, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0) +
                     FRAME.pack(MAGIC, BYE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
        mine.shutdown(socket.SHUT_WR)
        assert lib.mk_proxy_start(p) == 0
        time.sleep(0.3)  # long enough for the frames, the close and several stall checks
        info = ffi.new("mk_error_info*")
        code = lib.mk_proxy_error(p, info)
        assert code == 0, ffi.string(info.message).decode()
    finally:
        lib.mk_proxy_destroy(p)
        mine.close()
