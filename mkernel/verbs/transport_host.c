/* Host-memory transport: ranks of one host that act as different nodes exchange through shared
 * host memory, like NCCL's shared-memory transport. One segment per direction, created by the
 * sender: a ring of chunk descriptors and chunk buffers. The sender copies a region into free
 * chunks and publishes them (release on head); the receiver checks each descriptor against its
 * regions, copies the chunk out, applies the write's flag after its last chunk, and frees chunks
 * (release on tail). FIFO, so every command is ordered after the ones before it. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "proxy.h"

#define MK_HOST_MAGIC 0x314d484du /* "MHM1" */
#define MK_HOST_SLOTS 16
#define MK_HOST_CHUNK (1u << 20)
#define MK_HOST_RUN \
  4 /* most chunks per copy (mk_host_set_run): fewer, bigger copies; both sides still copy
                       * at once (pipelined). bench/transport.py measures 2, 4 and 8 */
#define MK_HOST_DATA_OFFSET 4096
#define MK_HOST_OUTBOX 4096 /* commands accepted per peer and not yet pushed into the ring */
#define MK_HOST_BEAT_NS 1000000ULL /* liveness: each side stamps the segment every millisecond */
#define MK_HOST_PID_CHECK_NS 100000000ULL

enum { DESC_DATA = 1, DESC_SIGNAL = 2 };

typedef struct {
  uint8_t type, flag_op, dst_region, last; /* last: the final chunk of its write: apply the flag after it */
  uint32_t bytes, flag_id, flag_value;
  uint64_t dst_offset;
} host_desc;

typedef struct {
  uint64_t head;
  uint8_t pad0[56]; /* sender */
  uint64_t tail;
  uint8_t pad1[56]; /* receiver */
  struct {
    uint64_t beat_ns;
    int32_t pid;
    uint32_t closed;
    uint8_t pad[48];
  } side[2]; /* 0: sender, 1: receiver */
  uint32_t magic, slots, chunk, pad2;
  host_desc desc[MK_HOST_SLOTS];
} host_segment;

_Static_assert(sizeof(host_segment) <= MK_HOST_DATA_OFFSET, "descriptors fit before the data");

typedef struct {
  uint64_t target; /* complete once the peer's tail reaches this */
  uint32_t flag_id, flag_value;
  int flag_op;
  uint64_t since;
} flush_wait;

/* A copy into chunks (publish head = upto once it landed) or out of them (apply the flag, then free
 * tail = upto). Kept in order, so chunks are published and freed in ring order. */
typedef struct {
  uint64_t upto;
  void* event; /* NULL: done */
  host_desc flag; /* out of chunks: the flag to apply first, when flag.last */
} copy_wait;

typedef struct {
  copy_wait q[MK_HOST_SLOTS]; /* one per run of >= 1 chunk: never more than the ring holds */
  unsigned head, tail;
} copy_fifo;

typedef struct {
  host_segment *send, *recv;
  uint64_t send_head, recv_tail; /* chunks filled (or being filled) and taken (or being emptied): ahead of head/tail */
  copy_fifo filling, emptying;
  struct MkCmd outbox[MK_HOST_OUTBOX];
  unsigned out_head, out_tail;
  uint64_t out_done; /* bytes of the front WRITE already pushed */
  flush_wait flushes[MK_HOST_OUTBOX];
  unsigned flush_head, flush_tail;
  int peer_gone; /* the peer closed cleanly */
  int pinned; /* both segments registered with CUDA (unregistered before munmap) */
} host_peer;

typedef struct {
  host_peer* peers;
  uint64_t last_beat, last_pid_check;
  uint64_t run; /* chunks per copy, 1..MK_HOST_SLOTS */
} host_state;

static unsigned char* chunk_of(host_segment* s, uint64_t slot) {
  return (unsigned char*)s + MK_HOST_DATA_OFFSET + (slot % MK_HOST_SLOTS) * (uint64_t)MK_HOST_CHUNK;
}

unsigned long long mk_host_segment_bytes(void) { return MK_HOST_DATA_OFFSET + (uint64_t)MK_HOST_SLOTS * MK_HOST_CHUNK; }

static unsigned long long fail_errno(char* why, int cap, const char* what, const char* name) {
  snprintf(why, (size_t)cap, "%s %s: %s", what, name, strerror(errno));
  return 0;
}

/* Owner-only, exclusive creation; space is reserved now so a full /dev/shm fails here, not as SIGBUS later. */
unsigned long long mk_host_segment_create(const char* name, char* why, int why_cap) {
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return fail_errno(why, why_cap, "shm_open(create)", name);
  size_t bytes = mk_host_segment_bytes();
  int e = fchmod(fd, 0600) ? errno : posix_fallocate(fd, 0, (off_t)bytes);
  if (e) {
    errno = e;
    close(fd);
    shm_unlink(name);
    return fail_errno(why, why_cap, "reserving shared memory for", name);
  }
  void* m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) {
    shm_unlink(name);
    return fail_errno(why, why_cap, "mmap", name);
  }
  host_segment* s = m;
  s->slots = MK_HOST_SLOTS;
  s->chunk = MK_HOST_CHUNK;
  s->side[0].pid = getpid();
  s->side[0].beat_ns = mk_now_ns();
  __atomic_store_n(&s->magic, MK_HOST_MAGIC, __ATOMIC_RELEASE);
  return (unsigned long long)(uintptr_t)m;
}

/* Opens a peer's segment, refusing one that another user owns or others may read. */
unsigned long long mk_host_segment_open(const char* name, char* why, int why_cap) {
  int fd = shm_open(name, O_RDWR, 0);
  if (fd < 0) return fail_errno(why, why_cap, "shm_open", name);
  struct stat st;
  size_t bytes = mk_host_segment_bytes();
  if (fstat(fd, &st) || st.st_uid != geteuid() || (st.st_mode & 0077) || (size_t)st.st_size != bytes) {
    close(fd);
    snprintf(why, (size_t)why_cap, "shared memory %s is not an owner-only segment of %zu bytes of this user", name,
             bytes);
    return 0;
  }
  void* m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return fail_errno(why, why_cap, "mmap", name);
  host_segment* s = m;
  if (__atomic_load_n(&s->magic, __ATOMIC_ACQUIRE) != MK_HOST_MAGIC || s->slots != MK_HOST_SLOTS ||
      s->chunk != MK_HOST_CHUNK) {
    munmap(m, bytes);
    snprintf(why, (size_t)why_cap, "shared memory %s was not made by this version of mkernel", name);
    return 0;
  }
  s->side[1].pid = getpid();
  s->side[1].beat_ns = mk_now_ns();
  return (unsigned long long)(uintptr_t)m;
}

int mk_host_segment_unlink(const char* name) { return shm_unlink(name); }

/* A segment mapped by create or open that never reached a proxy (a set-up that failed part-way). */
int mk_host_segment_unmap(unsigned long long segment) {
  return segment ? munmap((void*)(uintptr_t)segment, mk_host_segment_bytes()) : 0;
}

static host_state* host(mk_proxy* p) {
  if (!p->tstate) {
    host_state* h = calloc(1, sizeof *h);
    if (!h) return NULL;
    h->peers = calloc((size_t)p->nranks, sizeof *h->peers);
    if (!h->peers) {
      free(h);
      return NULL;
    }
    h->run = MK_HOST_RUN;
    p->tstate = h;
  }
  return p->tstate;
}

int mk_host_add_peer(mk_proxy* p, int peer, unsigned long long send_segment, unsigned long long recv_segment) {
  host_state* h = host(p);
  if (!h || p->running || p->transport != MKP_TRANSPORT_HOST || peer < 0 || peer >= p->nranks || peer == p->rank ||
      !send_segment || !recv_segment)
    return -1;
  host_peer* hp = &h->peers[peer];
  hp->send = (host_segment*)(uintptr_t)send_segment;
  hp->recv = (host_segment*)(uintptr_t)recv_segment;
  hp->send_head = hp->send->head;
  hp->recv_tail = hp->recv->tail;
  return 0;
}

int mk_host_set_run(mk_proxy* p, int chunks) {
  host_state* h = host(p);
  if (!h || p->running || chunks < 1 || chunks > MK_HOST_SLOTS) return -1;
  h->run = (uint64_t)chunks;
  return 0;
}

static int outbox_push(mk_proxy* p, const struct MkCmd* c) {
  host_peer* hp = &((host_state*)p->tstate)->peers[c->peer];
  if (!hp->send) {
    mk_fail(p, MKP_ERR_LOCAL, c->peer, c->type, "no host-memory segment to rank %d", c->peer);
    return -1;
  }
  if (hp->out_head - hp->out_tail == MK_HOST_OUTBOX) return MK_AGAIN;
  hp->outbox[hp->out_head++ % MK_HOST_OUTBOX] = *c;
  if (c->type == MK_CMD_WRITE) p->peers[c->peer].writes++;
  if (c->type == MK_CMD_SIGNAL) p->peers[c->peer].signals++;
  if (c->type == MK_CMD_FLUSH) p->peers[c->peer].flushes++;
  return 0;
}

static void fifo_push(copy_fifo* f, uint64_t upto, void* event, const host_desc* flag) {
  f->q[f->head++ % MK_HOST_SLOTS] = (copy_wait){.upto = upto, .event = event, .flag = flag ? *flag : (host_desc){0}};
}

/* Publishes the chunks whose copies have landed, in order. */
static int publish_filled(mk_proxy* p, int peer, host_peer* hp) {
  int events = 0;
  while (hp->filling.tail != hp->filling.head) {
    copy_wait* w = &hp->filling.q[hp->filling.tail % MK_HOST_SLOTS];
    int done = mk_copy_done(p, w->event, peer);
    if (done <= 0) return done < 0 ? -1 : events;
    __atomic_store_n(&hp->send->head, w->upto, __ATOMIC_RELEASE);
    hp->filling.tail++;
    events++;
  }
  return events;
}

/* Applies the flags of chunks whose copies have landed, then frees them, in order. */
static int free_emptied(mk_proxy* p, int peer, host_peer* hp) {
  int events = 0;
  while (hp->emptying.tail != hp->emptying.head) {
    copy_wait* w = &hp->emptying.q[hp->emptying.tail % MK_HOST_SLOTS];
    int done = mk_copy_done(p, w->event, peer);
    if (done <= 0) return done < 0 ? -1 : events;
    if (w->flag.last && mk_apply_flag(p, w->flag.flag_op, w->flag.flag_id, w->flag.flag_value, peer)) return -1;
    __atomic_store_n(&hp->recv->tail, w->upto, __ATOMIC_RELEASE);
    hp->emptying.tail++;
    events++;
  }
  return events;
}

/* Pushes the front commands of the outbox into free chunks; one copy fills a run of chunks, and
 * several runs may be in flight (GPU memory) while earlier ones are published. */
static int push_outbox(mk_proxy* p, int peer, host_peer* hp) {
  const host_state* h = p->tstate;
  host_segment* s = hp->send;
  int events = 0;
  while (hp->out_tail != hp->out_head) {
    const struct MkCmd* c = &hp->outbox[hp->out_tail % MK_HOST_OUTBOX];
    uint64_t head = hp->send_head, tail = __atomic_load_n(&s->tail, __ATOMIC_ACQUIRE);
    if (c->type == MK_CMD_FLUSH) { /* done once the peer has freed every chunk filled so far */
      if (hp->flush_head - hp->flush_tail == MK_HOST_OUTBOX) break;
      hp->flushes[hp->flush_head++ % MK_HOST_OUTBOX] =
          (flush_wait){head, c->flag_id, c->flag_value, c->flag_op, mk_now_ns()};
      hp->out_tail++;
      events++;
      continue;
    }
    uint64_t free_slots = MK_HOST_SLOTS - (head - tail), run = MK_HOST_SLOTS - head % MK_HOST_SLOTS;
    if (!free_slots) break;
    void* event = NULL;
    uint64_t n = 1;
    if (c->type == MK_CMD_SIGNAL) {
      s->desc[head % MK_HOST_SLOTS] = (host_desc){
          .type = DESC_SIGNAL, .flag_op = c->flag_op, .last = 1, .flag_id = c->flag_id, .flag_value = c->flag_value};
    } else {
      uint64_t left = c->bytes - hp->out_done;
      n = (left + MK_HOST_CHUNK - 1) / MK_HOST_CHUNK;
      n = n ? n : 1; /* a zero-byte WRITE still carries its flag */
      /* A write's first chunk goes alone (the receiver starts copying out at once) and runs shrink
       * to half of what is left (its last copy out is short): pipeline fill and drain of one chunk. */
      uint64_t most = hp->out_done ? h->run : 1, half = (n + 1) / 2;
      most = most < half ? most : half;
      n = n < free_slots ? n : free_slots;
      n = n < run ? n : run;
      n = n < most ? n : most;
      uint64_t bytes = left < n * MK_HOST_CHUNK ? left : n * MK_HOST_CHUNK;
      int kind;
      const unsigned char* src =
          mk_region_span(p, c->src_region, MK_CMD_OFFSET(c->src_off_hi, c->src_off_lo) + hp->out_done, bytes, &kind);
      if (bytes && mk_copy_start(p, chunk_of(s, head), MKP_REGION_HOST, src, kind, bytes, peer, &event)) return -1;
      for (uint64_t i = 0; i < n; i++) {
        uint64_t off = i * MK_HOST_CHUNK, len = bytes - off < MK_HOST_CHUNK ? bytes - off : MK_HOST_CHUNK;
        s->desc[(head + i) % MK_HOST_SLOTS] =
            (host_desc){.type = DESC_DATA,
                        .flag_op = c->flag_op,
                        .dst_region = c->dst_region,
                        .last = hp->out_done + off + len == c->bytes,
                        .bytes = (uint32_t)len,
                        .flag_id = c->flag_id,
                        .flag_value = c->flag_value,
                        .dst_offset = MK_CMD_OFFSET(c->dst_off_hi, c->dst_off_lo) + hp->out_done + off};
      }
      hp->out_done += bytes;
      p->peers[peer].bytes_sent += bytes;
    }
    hp->send_head = head + n;
    fifo_push(&hp->filling, hp->send_head, event, NULL);
    events++;
    if (c->type == MK_CMD_SIGNAL || hp->out_done == c->bytes) {
      hp->out_done = 0;
      hp->out_tail++;
    }
  }
  int published = publish_filled(p, peer, hp);
  return published < 0 ? -1 : events + published;
}

static int bad_desc(mk_proxy* p, int peer, const char* what) {
  p->stats.frames_rejected++;
  mk_fail(p, MKP_ERR_PEER, peer, MK_CMD_WRITE,
          "rank %d's host-memory descriptor was rejected (%s); nothing of it was written", peer, what);
  return -1;
}

/* Takes published chunks: one copy for a run of chunks that continue each other; their flags are
 * applied and the chunks freed once the copy has landed (free_emptied). */
static int pull_inbox(mk_proxy* p, int peer, host_peer* hp) {
  const host_state* h = p->tstate;
  host_segment* s = hp->recv;
  uint64_t tail = hp->recv_tail, head = __atomic_load_n(&s->head, __ATOMIC_ACQUIRE);
  if (head - s->tail > MK_HOST_SLOTS || head - tail > MK_HOST_SLOTS) return bad_desc(p, peer, "head ran past the ring");
  int events = 0;
  while (tail != head) {
    host_desc d = s->desc[tail % MK_HOST_SLOTS];
    uint64_t n = 1;
    void* event = NULL;
    if (d.type == DESC_DATA) {
      if (d.bytes > MK_HOST_CHUNK) return bad_desc(p, peer, "chunk larger than a slot");
      uint64_t bytes = d.bytes;
      while (n < h->run && tail + n != head && (tail + n) % MK_HOST_SLOTS &&
             !s->desc[(tail + n - 1) % MK_HOST_SLOTS].last) {
        host_desc e = s->desc[(tail + n) % MK_HOST_SLOTS];
        if (e.type != DESC_DATA || e.dst_region != d.dst_region || e.dst_offset != d.dst_offset + bytes ||
            e.bytes > MK_HOST_CHUNK)
          break;
        bytes += e.bytes;
        n++;
      }
      int kind;
      unsigned char* dst = mk_payload_span(p, d.dst_region, d.dst_offset, bytes, &kind);
      if (!dst) return bad_desc(p, peer, "payload outside the registered data regions");
      if (bytes && mk_copy_start(p, dst, kind, chunk_of(s, tail), MKP_REGION_HOST, bytes, peer, &event)) return -1;
      p->peers[peer].bytes_received += bytes;
      d = s->desc[(tail + n - 1) % MK_HOST_SLOTS];
    } else if (d.type != DESC_SIGNAL) {
      return bad_desc(p, peer, "unknown descriptor type");
    }
    tail += n;
    hp->recv_tail = tail;
    fifo_push(&hp->emptying, tail, event, &d);
    events++;
  }
  int freed = free_emptied(p, peer, hp);
  return freed < 0 ? -1 : events + freed;
}

static int complete_flushes(mk_proxy* p, int peer, host_peer* hp) {
  int events = 0;
  while (hp->flush_tail != hp->flush_head) {
    flush_wait* f = &hp->flushes[hp->flush_tail % MK_HOST_OUTBOX];
    if (__atomic_load_n(&hp->send->tail, __ATOMIC_ACQUIRE) < f->target) {
      if (mk_now_ns() - f->since > p->timeout_ns) {
        mk_fail(p, MKP_ERR_TIMEOUT, peer, MK_CMD_FLUSH, "rank %d did not take its data within %.1f s", peer,
                p->timeout_ns / 1e9);
        return -1;
      }
      break;
    }
    if (mk_apply_flag(p, f->flag_op, f->flag_id, f->flag_value, p->rank)) return -1;
    hp->flush_tail++;
    events++;
  }
  return events;
}

/* Liveness: stamps our side of every segment; a peer whose process is gone, or whose stamp is older
 * than the timeout, has failed, unless it said goodbye with nothing of ours outstanding. */
static int check_peers(mk_proxy* p, host_state* h) {
  uint64_t now = mk_now_ns();
  if (now - h->last_beat < MK_HOST_BEAT_NS) return 0;
  h->last_beat = now;
  int check_pid = now - h->last_pid_check > MK_HOST_PID_CHECK_NS;
  if (check_pid) h->last_pid_check = now;
  for (int r = 0; r < p->nranks; r++) {
    host_peer* hp = &h->peers[r];
    if (!hp->send || hp->peer_gone) continue;
    __atomic_store_n(&hp->send->side[0].beat_ns, now, __ATOMIC_RELAXED);
    __atomic_store_n(&hp->recv->side[1].beat_ns, now, __ATOMIC_RELAXED);
    int outstanding = hp->out_tail != hp->out_head || hp->flush_tail != hp->flush_head ||
                      __atomic_load_n(&hp->send->tail, __ATOMIC_ACQUIRE) != hp->send_head;
    if (__atomic_load_n(&hp->recv->side[0].closed, __ATOMIC_ACQUIRE)) {
      if (outstanding) {
        mk_fail(p, MKP_ERR_PEER, r, 0, "rank %d stopped its proxy with data of ours outstanding", r);
        return -1;
      }
      hp->peer_gone = 1;
      continue;
    }
    int32_t pid = hp->recv->side[0].pid;
    if (check_pid && kill(pid, 0) && errno == ESRCH) {
      mk_fail(p, MKP_ERR_PEER, r, 0, "rank %d (pid %d) has exited without stopping its proxy", r, pid);
      return -1;
    }
    uint64_t beat = __atomic_load_n(&hp->recv->side[0].beat_ns, __ATOMIC_RELAXED);
    if (now > beat && now - beat > p->timeout_ns) {
      mk_fail(p, MKP_ERR_TIMEOUT, r, 0, "rank %d's proxy has not answered for %.1f s", r, (now - beat) / 1e9);
      return -1;
    }
  }
  return 0;
}

static int host_start(mk_proxy* p) {
  host_state* h = host(p);
  if (!h) {
    mk_fail(p, MKP_ERR_LOCAL, -1, 0, "out of memory starting the host transport");
    return -1;
  }
  for (int r = 0; r < p->nranks && p->cuda_device >= 0; r++) { /* pinned, so that GPU copies are DMA */
    host_peer* hp = &h->peers[r];
    if (!hp->send) continue;
    int a = mk_cuda_host_register(hp->send, mk_host_segment_bytes());
    int b = a ? 1 : mk_cuda_host_register(hp->recv, mk_host_segment_bytes());
    if (a == 0 && b) mk_cuda_host_unregister(p->cuda_device, hp->send);
    if (a < 0 || b < 0) {
      mk_fail(p, MKP_ERR_LOCAL, r, 0,
              "the host-memory segments of rank %d lie where CUDA still has memory registered "
              "(a segment unmapped without cuMemHostUnregister?): copies would reach the old pages",
              r);
      return -1;
    }
    hp->pinned = a == 0 && b == 0;
    if (!hp->pinned)
      mk_log(p, "could not pin the host-memory segments of rank %d; GPU copies go through pageable memory", r);
  }
  return 0;
}

static int host_poll(mk_proxy* p, int timeout_us) {
  host_state* h = p->tstate;
  int events = 0;
  for (int r = 0; r < p->nranks; r++) {
    host_peer* hp = &h->peers[r];
    if (!hp->send) continue;
    int a = push_outbox(p, r, hp), b = a < 0 ? -1 : pull_inbox(p, r, hp), c = b < 0 ? -1 : complete_flushes(p, r, hp);
    if (c < 0) return -1;
    events += a + b + c;
  }
  if (check_peers(p, h)) return -1;
  if (!events && timeout_us > 0) nanosleep(&(struct timespec){0, timeout_us * 1000L}, NULL);
  return events;
}

static int host_write(mk_proxy* p, const struct MkCmd* c) { return outbox_push(p, c); }

/* Goodbye: pushes what is accepted and lets copies land (bounded by the timeout), then marks our sides closed. */
static void host_close(mk_proxy* p) {
  host_state* h = p->tstate;
  uint64_t start = mk_now_ns();
  for (;;) {
    int queued = 0;
    for (int r = 0; r < p->nranks; r++) { /* accepted, being copied in, or being copied out */
      host_peer* hp = &h->peers[r];
      queued |= hp->send && ((!hp->peer_gone && hp->out_tail != hp->out_head) || hp->filling.tail != hp->filling.head ||
                             hp->emptying.tail != hp->emptying.head);
    }
    if (!queued || mk_now_ns() - start > p->timeout_ns || host_poll(p, 50) < 0) break;
  }
  for (int r = 0; r < p->nranks; r++)
    if (h->peers[r].send) {
      __atomic_store_n(&h->peers[r].send->side[0].closed, 1, __ATOMIC_RELEASE);
      __atomic_store_n(&h->peers[r].recv->side[1].closed, 1, __ATOMIC_RELEASE);
    }
}

static void host_destroy(mk_proxy* p) {
  host_state* h = p->tstate;
  if (!h) return;
  for (int r = 0; r < p->nranks; r++)
    if (h->peers[r].send) {
      if (h->peers[r].pinned) { /* before munmap: see mk_cuda_host_unregister */
        mk_cuda_host_unregister(p->cuda_device, h->peers[r].send);
        mk_cuda_host_unregister(p->cuda_device, h->peers[r].recv);
      }
      munmap(h->peers[r].send, mk_host_segment_bytes());
      munmap(h->peers[r].recv, mk_host_segment_bytes());
    }
  free(h->peers);
  free(h);
  p->tstate = NULL;
}

const mk_transport_ops mk_host_ops = {.name = "host",
                                      .write = host_write,
                                      .signal = host_write,
                                      .flush = host_write,
                                      .poll = host_poll,
                                      .start = host_start,
                                      .close = host_close,
                                      .destroy = host_destroy};
