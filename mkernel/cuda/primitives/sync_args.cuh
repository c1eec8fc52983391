#pragma once
// Layouts shared with Python (mkernel/runtime/sync.py mirrors them with ctypes; a CPU test compares the
// two). Plain fixed-width fields only, so that a host C++ compiler can read this header too.

// The first error a kernel records. Lives in device memory (so that the first writer wins by a
// compare-and-swap on `code`), and is copied to a mapped host mirror the host reads without
// synchronising the stream.
struct MkStatus {
  unsigned int code;  // MK_ERR_* (0: no error)
  unsigned int op;  // MK_OP_* of the kernel that failed
  int rank;  // rank that recorded it
  int peer;  // rank it was waiting for (-1: none)
  unsigned int where;  // which wait (flag index, tile id)
  unsigned int expected;  // the value it waited for
  unsigned int seen;  // the last value it saw
  unsigned int pad;
  unsigned long long waited_ns;
};

// Passed inside every kernel's argument struct: where the epoch and the error word live.
struct MkSync {
  unsigned int* epoch;  // device: epoch of the last completed launch on this communicator
  unsigned int* exit_count;  // device: blocks of the running launch that have finished
  MkStatus* status;  // device: first error wins
  MkStatus* status_host;  // mapped pinned host memory: the host's view of *status
  unsigned long long timeout_ns;
  unsigned int op;
  int rank;
  // Trace mode (MKERNEL_TRACE): spans appended by blocks; NULL when tracing is off.
  unsigned long long* trace_events;  // MK_TRACE_WORDS words per span (trace.cuh)
  unsigned int* trace_count;
  unsigned int trace_capacity;  // spans
  unsigned int pad;
};
