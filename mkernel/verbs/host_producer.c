/* Producing commands from the CPU: the host twin of mkernel/cuda/primitives/queue.cuh, used by the tests and by
 * host code that enqueues without a kernel. Also the proxy-side check of the stress tests' commands.
 * Stress commands (here and in queue_test.cu) are NOPs carrying an id:
 *   flag_value = low 32 bits of id, src_off_lo = high 32 bits, bytes = id * 2654435761, dst_off_lo = ~flag_value */
#define _GNU_SOURCE
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "proxy.h"

/* Reserve a ticket, wait for its slot to be free, write the body, publish seq last (release). */
static int enqueue(struct MkQueueHeader* h, struct MkCmd* slots, const struct MkCmd* body, uint64_t timeout_ns) {
  uint64_t mask = h->capacity - 1;
  uint64_t t = __atomic_fetch_add(&h->reserve, 1, __ATOMIC_RELAXED), start = 0;
  while (t >= __atomic_load_n(&h->tail, __ATOMIC_ACQUIRE) + mask + 1) { /* back-pressure */
    if (__atomic_load_n(&h->error, __ATOMIC_ACQUIRE)) return -1;
    uint64_t now = mk_now_ns();
    if (!start) start = now;
    if (now - start > timeout_ns) return -1;
    sched_yield();
  }
  struct MkCmd* s = &slots[t & mask];
  memcpy((char*)s + 4, (const char*)body + 4, sizeof *s - 4);
  __atomic_store_n(&s->seq, (uint32_t)t + 1, __ATOMIC_RELEASE);
  return 0;
}

int mk_queue_push(unsigned long long header, unsigned long long slots, const void* command, double timeout_s) {
  return enqueue((struct MkQueueHeader*)(uintptr_t)header, (struct MkCmd*)(uintptr_t)slots, command,
                 (uint64_t)(timeout_s * 1e9));
}

int mk_null_verify(mk_proxy* p, unsigned long long expected) {
  if (p->running) return -1;
  free(p->verify_seen);
  p->verify_seen = calloc((size_t)(expected / 8 + 1), 1);
  p->verify_expected = expected;
  p->stats.verify_distinct = p->stats.verify_duplicates = p->stats.verify_corrupt = 0;
  return p->verify_seen ? 0 : -1;
}

void mk_verify_command(mk_proxy* p, const struct MkCmd* c) {
  if (!p->verify_seen) return;
  uint64_t id = (uint64_t)c->src_off_lo << 32 | c->flag_value;
  if (id >= p->verify_expected || c->bytes != (uint32_t)(id * 2654435761u) || c->dst_off_lo != ~c->flag_value) {
    p->stats.verify_corrupt++;
    return;
  }
  uint8_t bit = (uint8_t)(1u << (id & 7));
  if (p->verify_seen[id >> 3] & bit) {
    p->stats.verify_duplicates++;
  } else {
    p->verify_seen[id >> 3] |= bit;
    p->stats.verify_distinct++;
  }
}

typedef struct {
  struct MkQueueHeader* header;
  struct MkCmd* slots;
  uint64_t first, count, timeout_ns;
  int failed;
} producer;

static void* produce(void* arg) {
  producer* w = arg;
  for (uint64_t id = w->first; id < w->first + w->count && !w->failed; id++) {
    struct MkCmd c = {.type = MK_CMD_NOP,
                      .flag_value = (uint32_t)id,
                      .src_off_lo = (uint32_t)(id >> 32),
                      .bytes = (uint32_t)(id * 2654435761u),
                      .dst_off_lo = ~(uint32_t)id};
    w->failed = enqueue(w->header, w->slots, &c, w->timeout_ns) != 0;
  }
  return NULL;
}

int mk_test_produce(unsigned long long header, unsigned long long slots, int threads, unsigned long long per_thread,
                    double timeout_s) {
  if (threads < 1 || threads > 256) return -1;
  producer w[256];
  pthread_t tid[256];
  int started = 0, failed = 0;
  for (; started < threads; started++) {
    w[started] = (producer){(struct MkQueueHeader*)(uintptr_t)header,
                            (struct MkCmd*)(uintptr_t)slots,
                            (uint64_t)started * per_thread,
                            per_thread,
                            (uint64_t)(timeout_s * 1e9),
                            0};
    if (pthread_create(&tid[started], NULL, produce, &w[started])) {
      failed = 1;
      break;
    }
  }
  for (int i = 0; i < started; i++) {
    pthread_join(tid[i], NULL);
    failed |= w[i].failed;
  }
  return failed ? -1 : 0;
}
