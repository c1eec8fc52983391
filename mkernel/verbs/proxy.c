/* The proxy: a native thread that drains the GPU's command queue into a transport. No Python and
 * no GIL per command; Python only configures it, starts and stops it, and polls its error word. */
#define _GNU_SOURCE
#include "proxy.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Commands taken per pass before the transport gets to progress, and before tail is published. */
#define MK_BATCH 256
/* Idle back-off: spin SPIN_NS, then sleep SHORT_US; after MID_NS MID_US, after LONG_NS LONG_US. A kernel may
 * start long after the last traffic (its host ran ahead): its first command waits up to one sleep a side. */
#define MK_IDLE_SPIN_NS 200000ULL
#define MK_IDLE_MID_NS 20000000ULL
#define MK_IDLE_LONG_NS 1000000000ULL
#define MK_IDLE_SHORT_US 50
#define MK_IDLE_MID_US 200
#define MK_IDLE_LONG_US 1000

uint64_t mk_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void push_log(mk_proxy* p, const char* text) {
  if (p->log_head - p->log_tail == 16) p->log_tail++; /* full: drop the oldest */
  snprintf(p->log_ring[p->log_head % 16], MKP_MESSAGE_BYTES, "%s", text);
  p->log_head++;
}

void mk_log(mk_proxy* p, const char* fmt, ...) {
  char text[MKP_MESSAGE_BYTES];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&p->lock);
  push_log(p, text);
  pthread_mutex_unlock(&p->lock);
}

void mk_fail(mk_proxy* p, int code, int peer, int op, const char* fmt, ...) {
  char text[MKP_MESSAGE_BYTES];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&p->lock);
  if (!p->err_code) {
    p->err.code = code;
    p->err.peer = peer;
    p->err.op = op;
    snprintf(p->err.message, sizeof p->err.message, "%s", text);
    __atomic_store_n(&p->err_code, code, __ATOMIC_RELEASE);
    if (p->header) __atomic_store_n(&p->header->error, (unsigned)code, __ATOMIC_RELEASE);
  } else {
    push_log(p, text);
  }
  pthread_mutex_unlock(&p->lock);
}

int mk_failed(mk_proxy* p) { return __atomic_load_n(&p->err_code, __ATOMIC_ACQUIRE); }

mk_proxy* mk_proxy_create(int rank, int nranks, int transport, double timeout_s) {
  if (nranks <= 0 || rank < 0 || rank >= nranks || nranks > 65536 || timeout_s <= 0) return NULL;
  const mk_transport_ops* ops;
  switch (transport) {
    case MKP_TRANSPORT_NULL:
      ops = &mk_null_ops;
      break;
    case MKP_TRANSPORT_TCP:
      ops = &mk_tcp_ops;
      break;
    case MKP_TRANSPORT_HOST:
      ops = &mk_host_ops;
      break;
    case MKP_TRANSPORT_VERBS:
      ops = &mk_verbs_ops;
      break;
    default:
      return NULL;
  }
  mk_proxy* p = calloc(1, sizeof *p);
  if (!p) return NULL;
  p->peers = calloc((size_t)nranks, sizeof *p->peers);
  if (!p->peers) {
    free(p);
    return NULL;
  }
  p->rank = rank;
  p->nranks = nranks;
  p->transport = transport;
  p->timeout_ns = (uint64_t)(timeout_s * 1e9);
  p->flags_region = -1;
  p->cuda_device = -1;
  p->ops = ops;
  pthread_mutex_init(&p->lock, NULL);
  return p;
}

void mk_proxy_destroy(mk_proxy* p) {
  if (!p) return;
  mk_proxy_stop(p);
  if (p->ops->destroy) p->ops->destroy(p);
  free(p->verify_seen);
  free(p->peers);
  pthread_mutex_destroy(&p->lock);
  free(p);
}

static int setup_error(mk_proxy* p, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static int setup_error(mk_proxy* p, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  pthread_mutex_lock(&p->lock);
  vsnprintf(p->setup_error, sizeof p->setup_error, fmt, ap);
  pthread_mutex_unlock(&p->lock);
  va_end(ap);
  return -1;
}

const char* mk_proxy_last_setup_error(mk_proxy* p) { return p->setup_error; }

int mk_proxy_set_cuda_device(mk_proxy* p, int ordinal) {
  char why[MKP_MESSAGE_BYTES];
  if (p->running) return setup_error(p, "set the CUDA device before start()");
  if (mk_cuda_load(why, sizeof why)) return setup_error(p, "%s", why);
  p->cuda_device = ordinal;
  return 0;
}

int mk_proxy_register(mk_proxy* p, int id, unsigned long long base, unsigned long long bytes, int kind) {
  if (p->running) return setup_error(p, "regions are registered before start()");
  if (id < 0 || id >= MK_MAX_REGIONS) return setup_error(p, "region id %d is outside 0..%d", id, MK_MAX_REGIONS - 1);
  if (p->regions[id].used) return setup_error(p, "region id %d is registered already", id);
  if (!base || !bytes || bytes > MK_OFFSET_MAX || base + bytes < base)
    return setup_error(p, "region %d: base 0x%llx, %llu bytes is not a valid span", id, base, bytes);
  if (kind != MKP_REGION_HOST && kind != MKP_REGION_CUDA) return setup_error(p, "region %d: unknown kind %d", id, kind);
  if (kind == MKP_REGION_CUDA && p->cuda_device < 0)
    return setup_error(p, "region %d is CUDA memory but no CUDA device was set", id);
  mk_region* r = &p->regions[id];
  *r = (mk_region){.used = 1, .kind = kind, .base = (unsigned char*)(uintptr_t)base, .bytes = bytes};
  if (p->ops->register_region && p->ops->register_region(p, r)) {
    r->used = 0;
    return -1;
  }
  return 0;
}

/* In place (same base), also while running: the workspace grew (VMM maps more at its end). A
 * transport that registered the region with a NIC registers the grown span first (verbs). */
int mk_proxy_grow_region(mk_proxy* p, int id, unsigned long long bytes) {
  if (id < 0 || id >= MK_MAX_REGIONS || !p->regions[id].used) return setup_error(p, "region %d is not registered", id);
  mk_region* r = &p->regions[id];
  const uint64_t size = __atomic_load_n(&r->bytes, __ATOMIC_ACQUIRE);
  if (bytes < size || bytes > MK_OFFSET_MAX || (uintptr_t)r->base + bytes < (uintptr_t)r->base)
    return setup_error(p, "region %d cannot grow from %llu to %llu bytes", id, (unsigned long long)size, bytes);
  if (p->ops->register_region) {
    char why[MKP_MESSAGE_BYTES] = "this transport cannot register a grown region";
    if (!p->ops->grow_region || p->ops->grow_region(p, r, bytes, why, sizeof why))
      return setup_error(p, "region %d cannot grow to %llu bytes: %s", id, bytes, why);
  }
  __atomic_store_n(&r->bytes, (uint64_t)bytes, __ATOMIC_RELEASE);
  return 0;
}

int mk_proxy_set_flags(mk_proxy* p, int region_id) {
  if (region_id < 0 || region_id >= MK_MAX_REGIONS || !p->regions[region_id].used)
    return setup_error(p, "flag region %d is not registered", region_id);
  if (p->regions[region_id].kind != MKP_REGION_HOST || ((uintptr_t)p->regions[region_id].base & 3))
    return setup_error(p, "the flag array must be 4-byte aligned host memory (mapped pinned memory for the GPU)");
  p->flags_region = region_id;
  return 0;
}

int mk_proxy_attach_queue(mk_proxy* p, unsigned long long header, unsigned long long slots) {
  if (p->running) return setup_error(p, "attach the queue before start()");
  struct MkQueueHeader* h = (struct MkQueueHeader*)(uintptr_t)header;
  if (!h || !slots || (header & 63) || (slots & 31)) return setup_error(p, "queue memory must be 64-byte aligned");
  uint32_t cap = h->capacity;
  if (cap < 2 || cap > (1u << 30) || (cap & (cap - 1)))
    return setup_error(p, "queue capacity %u is not a power of two in 2..2^30", cap);
  p->header = h;
  p->slots = (struct MkCmd*)(uintptr_t)slots;
  p->mask = cap - 1;
  p->head = __atomic_load_n(&h->tail, __ATOMIC_ACQUIRE);
  return 0;
}

unsigned char* mk_region_span(mk_proxy* p, int id, uint64_t offset, uint64_t bytes, int* kind) {
  if (id < 0 || id >= MK_MAX_REGIONS) return NULL;
  mk_region* r = &p->regions[id];
  const uint64_t size = __atomic_load_n(&r->bytes, __ATOMIC_ACQUIRE); /* mk_proxy_grow_region may raise it */
  if (!r->used || offset > size || bytes > size - offset) return NULL;
  if (kind) *kind = r->kind;
  return r->base + offset;
}

unsigned char* mk_payload_span(mk_proxy* p, int id, uint64_t offset, uint64_t bytes, int* kind) {
  return id == p->flags_region ? NULL : mk_region_span(p, id, offset, bytes, kind);
}

int mk_copy(mk_proxy* p, void* dst, int dst_kind, const void* src, int src_kind, size_t bytes, int peer) {
  if (dst_kind == MKP_REGION_HOST && src_kind == MKP_REGION_HOST) {
    memcpy(dst, src, bytes);
    return 0;
  }
  char why[MKP_MESSAGE_BYTES];
  if (mk_cuda_copy(p, dst, src, bytes, why, sizeof why)) {
    mk_fail(p, MKP_ERR_LOCAL, peer, MK_CMD_WRITE, "copy of %zu bytes failed: %s", bytes, why);
    return -1;
  }
  return 0;
}

int mk_copy_start(mk_proxy* p, void* dst, int dst_kind, const void* src, int src_kind, size_t bytes, int peer,
                  void** event) {
  *event = NULL;
  if (dst_kind == MKP_REGION_HOST && src_kind == MKP_REGION_HOST) {
    memcpy(dst, src, bytes);
    return 0;
  }
  char why[MKP_MESSAGE_BYTES];
  if (mk_cuda_copy_start(p, dst_kind == MKP_REGION_CUDA, dst, src, bytes, event, why, sizeof why)) {
    mk_fail(p, MKP_ERR_LOCAL, peer, MK_CMD_WRITE, "copy of %zu bytes failed: %s", bytes, why);
    return -1;
  }
  return 0;
}

int mk_copy_done(mk_proxy* p, void* event, int peer) {
  if (!event) return 1;
  char why[MKP_MESSAGE_BYTES];
  int r = mk_cuda_event_poll(p, event, why, sizeof why);
  if (r < 0) mk_fail(p, MKP_ERR_LOCAL, peer, MK_CMD_WRITE, "copy failed: %s", why);
  return r;
}

int mk_apply_flag(mk_proxy* p, int flag_op, uint32_t flag_id, uint32_t value, int peer) {
  if (flag_op == MK_FLAG_NONE) return 0;
  uint32_t* flag = (uint32_t*)mk_region_span(p, p->flags_region, (uint64_t)flag_id * 4, 4, NULL);
  if (!flag || (flag_op != MK_FLAG_SET && flag_op != MK_FLAG_ADD)) {
    /* from a peer: it sent something no check of ours accepted; from ourselves: a bad FLUSH command */
    if (peer != p->rank) p->stats.frames_rejected++;
    mk_fail(p, peer != p->rank ? MKP_ERR_PEER : MKP_ERR_LOCAL, peer, MK_CMD_SIGNAL,
            "flag %u (op %d) from rank %d is outside this rank's flag array; rejected", flag_id, flag_op, peer);
    return -1;
  }
  if (flag_op == MK_FLAG_SET)
    __atomic_store_n(flag, value, __ATOMIC_RELEASE);
  else
    __atomic_fetch_add(flag, value, __ATOMIC_RELEASE);
  return 0;
}

/* Local checks on a command the GPU wrote: a bad one is this rank's bug, reported as such. */
static int check_command(mk_proxy* p, const struct MkCmd* c) {
  if (c->type == MK_CMD_NOP) return 0;
  if (c->peer >= p->nranks || c->peer == p->rank) {
    mk_fail(p, MKP_ERR_LOCAL, c->peer, c->type, "command %u names rank %u (this is rank %d of %d)", c->type, c->peer,
            p->rank, p->nranks);
    return -1;
  }
  if (c->type == MK_CMD_WRITE &&
      !mk_region_span(p, c->src_region, MK_CMD_OFFSET(c->src_off_hi, c->src_off_lo), c->bytes, NULL)) {
    mk_fail(p, MKP_ERR_LOCAL, c->peer, c->type,
            "WRITE reads %u bytes at offset %llu of local region %u, outside what is registered", c->bytes,
            MK_CMD_OFFSET(c->src_off_hi, c->src_off_lo), c->src_region);
    return -1;
  }
  if (c->type < MK_CMD_WRITE || c->type > MK_CMD_NOP) {
    mk_fail(p, MKP_ERR_LOCAL, c->peer, c->type, "unknown command type %u at queue position %llu", c->type,
            (unsigned long long)p->head);
    return -1;
  }
  return 0;
}

static int dispatch(mk_proxy* p, const struct MkCmd* c) {
  if (check_command(p, c)) return -1;
  switch (c->type) {
    case MK_CMD_WRITE:
      return p->ops->write(p, c);
    case MK_CMD_SIGNAL:
      return p->ops->signal(p, c);
    case MK_CMD_FLUSH:
      return p->ops->flush(p, c);
    default:
      mk_verify_command(p, c);
      return 0; /* NOP */
  }
}

/* Takes up to MK_BATCH published commands; returns how many, or -1. */
static int drain(mk_proxy* p) {
  if (!p->slots) return 0;
  int n = 0;
  while (n < MK_BATCH) {
    struct MkCmd* slot = &p->slots[p->head & p->mask];
    if (__atomic_load_n(&slot->seq, __ATOMIC_ACQUIRE) != (uint32_t)p->head + 1) break;
    struct MkCmd c = *slot;
    int r = dispatch(p, &c);
    if (r == MK_AGAIN) break;
    if (r < 0) return -1;
    p->head++;
    n++;
  }
  if (n) {
    p->stats.commands += (unsigned)n;
    __atomic_store_n(&p->header->tail, p->head, __ATOMIC_RELEASE);
  }
  return n;
}

static void* proxy_main(void* arg) {
  mk_proxy* p = arg;
  if (p->cuda_device >= 0 && mk_cuda_thread_init(p)) return NULL;
  if (p->ops->start && p->ops->start(p)) {
    if (p->cuda_device >= 0) mk_cuda_thread_fini(p);
    return NULL;
  }
  uint64_t idle_since = 0;
  int timeout_us = 0;
  while (!__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE) && !mk_failed(p)) {
    int taken = drain(p);
    int events = taken < 0 ? -1 : p->ops->poll(p, timeout_us);
    if (taken < 0 || events < 0) break;
    if (taken || events) {
      idle_since = 0;
      timeout_us = 0;
      continue;
    }
    uint64_t now = mk_now_ns();
    if (!idle_since) idle_since = now;
    uint64_t idle = now - idle_since;
    timeout_us = idle < MK_IDLE_SPIN_NS   ? 0
                 : idle < MK_IDLE_MID_NS  ? MK_IDLE_SHORT_US
                 : idle < MK_IDLE_LONG_NS ? MK_IDLE_MID_US
                                          : MK_IDLE_LONG_US;
  }
  /* Goodbye only on a clean stop: after a failure the connections stay as they are until destroy, so
   * that peers find the root cause themselves instead of seeing this rank hang up on them. */
  if (p->ops->close && !mk_failed(p)) p->ops->close(p);
  if (p->cuda_device >= 0) mk_cuda_thread_fini(p);
  return NULL;
}

int mk_proxy_start(mk_proxy* p) {
  if (p->running) return setup_error(p, "the proxy is running already");
  __atomic_store_n(&p->stop, 0, __ATOMIC_RELEASE);
  int e = pthread_create(&p->thread, NULL, proxy_main, p);
  if (e) return setup_error(p, "pthread_create: %s", strerror(e));
  p->running = 1;
  return 0;
}

int mk_proxy_stop(mk_proxy* p) {
  if (!p->running) return 0;
  __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
  pthread_join(p->thread, NULL);
  p->running = 0;
  return 0;
}

int mk_proxy_error(mk_proxy* p, mk_error_info* out) {
  pthread_mutex_lock(&p->lock);
  int code = p->err_code;
  if (code) *out = p->err;
  pthread_mutex_unlock(&p->lock);
  return code;
}

static unsigned long long load64(const unsigned long long* v) { return __atomic_load_n(v, __ATOMIC_RELAXED); }

void mk_proxy_get_stats(mk_proxy* p, mk_proxy_stats* out, mk_peer_stats* per_peer) {
  const unsigned long long* s = (const unsigned long long*)&p->stats;
  unsigned long long* d = (unsigned long long*)out;
  for (size_t i = 0; i < sizeof *out / 8; i++) d[i] = load64(s + i);
  for (int r = 0; per_peer && r < p->nranks; r++) {
    s = (const unsigned long long*)&p->peers[r];
    d = (unsigned long long*)&per_peer[r];
    for (size_t i = 0; i < sizeof *per_peer / 8; i++) d[i] = load64(s + i);
  }
}

int mk_proxy_next_log(mk_proxy* p, char* buf, int cap) {
  pthread_mutex_lock(&p->lock);
  int has = p->log_head != p->log_tail;
  if (has) snprintf(buf, (size_t)cap, "%s", p->log_ring[p->log_tail++ % 16]);
  pthread_mutex_unlock(&p->lock);
  return has;
}
