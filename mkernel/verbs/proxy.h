/* Internals shared by the proxy thread and its transports. */
#pragma once
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "proxy_api.h"
#include "queue_layout.cuh"

_Static_assert(sizeof(struct MkCmd) == MK_CMD_BYTES, "MkCmd must stay 32 bytes");
_Static_assert(sizeof(struct MkQueueHeader) == 128, "MkQueueHeader: two 64-byte lines");

#define MK_MAX_REGIONS 256
#define MK_AGAIN 1 /* a transport's answer to write/signal/flush: full now, offer the command again later */
#define MK_EVENT_POOL 64 /* copy events kept for reuse (more than the copies a transport keeps in flight) */

typedef struct mk_region {
  int used, kind; /* MKP_REGION_* */
  unsigned char* base;
  uint64_t bytes;
  void* transport_data; /* verbs: the memory region (replaced, atomically, when the region grows) */
} mk_region;

/* The small interface every transport implements. write/signal/flush return 0, MK_AGAIN or -1
 * (after mk_fail); poll makes progress, blocking up to timeout_us when it has nothing to do, and
 * returns the number of events it handled or -1. */
typedef struct mk_transport_ops {
  const char* name;
  int (*register_region)(mk_proxy* p, mk_region* r);
  /* A registered region grown in place to bytes, while running: its new registration (why: the
   * reason it failed, for the caller's setup error). NULL: a transport that registers cannot grow. */
  int (*grow_region)(mk_proxy* p, mk_region* r, uint64_t bytes, char* why, int cap);
  int (*write)(mk_proxy* p, const struct MkCmd* c);
  int (*signal)(mk_proxy* p, const struct MkCmd* c);
  int (*flush)(mk_proxy* p, const struct MkCmd* c);
  int (*poll)(mk_proxy* p, int timeout_us);
  int (*start)(mk_proxy* p); /* on the proxy thread, before the first command; may be NULL */
  void (*close)(mk_proxy* p); /* on the proxy thread as it stops (goodbye to peers); may be NULL */
  void (*destroy)(mk_proxy* p);
} mk_transport_ops;

struct mk_proxy {
  int rank, nranks, transport;
  uint64_t timeout_ns;
  mk_region regions[MK_MAX_REGIONS];
  int flags_region;

  struct MkQueueHeader* header;
  struct MkCmd* slots;
  uint32_t mask;
  uint64_t head;

  pthread_t thread;
  int running, stop; /* stop: atomic */

  pthread_mutex_t lock; /* guards err, the log ring, setup_error */
  int err_code; /* atomic: nonzero once failed */
  mk_error_info err;
  char setup_error[MKP_MESSAGE_BYTES];
  char log_ring[16][MKP_MESSAGE_BYTES];
  unsigned log_head, log_tail;

  mk_proxy_stats stats; /* written by the proxy thread only */
  mk_peer_stats* peers;

  const mk_transport_ops* ops;
  void* tstate;

  int cuda_device; /* -1: no CUDA region allowed */
  void* cuda_streams[2]; /* 0: copies out of GPU memory (and synchronous ones), 1: copies into it */
  void* cuda_events[MK_EVENT_POOL]; /* landed copies' events, reused: creating one per copy costs a driver call */
  int cuda_event_count;

  uint8_t* verify_seen; /* null transport verify mode */
  uint64_t verify_expected;
};

/* Records the first error (later ones are logged), publishes it to the GPU through the queue header. */
void mk_fail(mk_proxy* p, int code, int peer, int op, const char* fmt, ...) __attribute__((format(printf, 5, 6)));
void mk_log(mk_proxy* p, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
int mk_failed(mk_proxy* p);
uint64_t mk_now_ns(void);

/* Checks that [offset, offset + bytes) lies inside registered region `id`; returns its address or NULL. */
unsigned char* mk_region_span(mk_proxy* p, int id, uint64_t offset, uint64_t bytes, int* kind);
/* A received payload's destination: mk_region_span of a data region, never the flag array (flags
 * change only through a frame's flag, in order after its write's bytes). */
unsigned char* mk_payload_span(mk_proxy* p, int id, uint64_t offset, uint64_t bytes, int* kind);
/* Copies between any two of host and CUDA memory; returns 0 or -1 after mk_fail. */
int mk_copy(mk_proxy* p, void* dst, int dst_kind, const void* src, int src_kind, size_t bytes, int peer);
/* The same, asynchronous where GPU memory is involved: *event is NULL when the copy is already done.
 * Returns 0 or -1 after mk_fail. */
int mk_copy_start(mk_proxy* p, void* dst, int dst_kind, const void* src, int src_kind, size_t bytes, int peer,
                  void** event);
/* 1 once the copy of `event` (NULL: done) has landed, 0 while in flight, -1 after mk_fail. */
int mk_copy_done(mk_proxy* p, void* event, int peer);
/* Applies a flag of this rank's flag array (bounds-checked); returns 0 or -1 after mk_fail. */
int mk_apply_flag(mk_proxy* p, int flag_op, uint32_t flag_id, uint32_t value, int peer);

/* libcuda, loaded at run time. */
int mk_cuda_load(char* why, int cap);
int mk_cuda_thread_init(mk_proxy* p);
void mk_cuda_thread_fini(mk_proxy* p);
int mk_cuda_copy(mk_proxy* p, void* dst, const void* src, size_t bytes, char* why, int cap);
int mk_cuda_copy_start(mk_proxy* p, int lane, void* dst, const void* src, size_t bytes, void** event, char* why,
                       int cap);
int mk_cuda_event_poll(mk_proxy* p, void* event, char* why,
                       int cap); /* 1 done (event released), 0 pending, -1 failed */
int mk_cuda_host_register(void* ptr, size_t bytes); /* 0 pinned, 1 not (pageable), -1 registered already */
void mk_cuda_host_unregister(int device, void* ptr);
int mk_cuda_dmabuf_fd(void* ptr, size_t bytes, uint64_t* offset);

/* NOP commands of the stress tests carry an id; verify mode checks each arrives once, intact. */
void mk_verify_command(mk_proxy* p, const struct MkCmd* c);

extern const mk_transport_ops mk_null_ops, mk_tcp_ops, mk_host_ops, mk_verbs_ops;
