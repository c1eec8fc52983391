/* TCP transport: several connections per peer, frames of a header then a payload. Connections
 * arrive here already authenticated (mkernel/comm/proxy.py runs the secret handshake); from then on
 * every incoming frame is checked against the registered regions before a byte is written. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "frame.h"
#include "proxy.h"

#define MK_TCP_MAX_CONNS 16 /* per peer */
#define MK_TCP_QUEUED_MAX (64u << 20) /* bytes queued per peer before the proxy stops taking commands */
#define MK_TCP_PENDING_MAX 65536 /* multi-frame writes a peer may have half-delivered */

typedef struct {
  mk_frame hdr;
  const unsigned char* src; /* payload in a registered region */
  int src_kind;
} out_frame;

typedef struct {
  int fd, peer, said_bye;
  /* send side: a FIFO of frames; [start, end) of a growable ring */
  out_frame* q;
  size_t q_cap, q_start, q_len;
  size_t sent; /* bytes of the head frame (header + payload) already sent */
  size_t barrier; /* shuffle mode: frames before this index may not be overtaken */
  unsigned char* stage; /* the head frame's payload, when it lives in CUDA memory */
  int staged;
  uint64_t stalled_since;
  /* receive side */
  mk_frame in;
  size_t in_got; /* of header + payload */
  unsigned char* in_dst; /* where the payload goes (a bounce buffer for CUDA memory) */
  int in_dst_kind;
  unsigned char* bounce;
  uint32_t flushes_seen;
} conn;

typedef struct {
  uint32_t id, flag_id, flag_value, write_bytes;
  uint64_t got;
  int used, flag_op;
} pending_write;

typedef struct {
  uint32_t id, flag_id, flag_value;
  int flag_op;
  uint64_t since;
} flush_wait;

typedef struct {
  int nconns, next_conn;
  conn* conns[MK_TCP_MAX_CONNS];
  uint32_t next_write_id, next_flush_id, acked_flush;
  uint64_t queued_bytes;
  /* flushes sent and not yet acknowledged, FIFO: local flag to apply on ack */
  flush_wait flushes[1024];
  unsigned flush_head, flush_tail;
  pending_write* pending; /* open addressing on id */
  size_t pending_cap, pending_len;
  int bye_conns;
} peer_state;

typedef struct {
  peer_state* peers;
  struct pollfd* pfds;
  conn** pconn;
  size_t npfds;
  unsigned shuffle_seed;
  int shuffle;
} tcp_state;

static tcp_state* tcp(mk_proxy* p) {
  if (!p->tstate) {
    tcp_state* t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->peers = calloc((size_t)p->nranks, sizeof *t->peers);
    if (!t->peers) {
      free(t);
      return NULL;
    }
    p->tstate = t;
  }
  return p->tstate;
}

int mk_tcp_frame_bytes(void) { return (int)sizeof(mk_frame); }

int mk_tcp_set_shuffle(mk_proxy* p, unsigned int seed) {
  tcp_state* t = tcp(p);
  if (!t || p->running) return -1;
  t->shuffle = 1;
  t->shuffle_seed = seed;
  return 0;
}

int mk_tcp_add_connection(mk_proxy* p, int peer, int fd) {
  tcp_state* t = tcp(p);
  if (!t || p->running || p->transport != MKP_TRANSPORT_TCP || peer < 0 || peer >= p->nranks || peer == p->rank)
    return -1;
  peer_state* ps = &t->peers[peer];
  if (ps->nconns == MK_TCP_MAX_CONNS) return -1;
  conn* c = calloc(1, sizeof *c);
  if (!c) return -1;
  c->fd = fd;
  c->peer = peer;
  c->bounce = malloc(MK_FRAME_PAYLOAD_MAX);
  c->stage = malloc(MK_FRAME_PAYLOAD_MAX);
  if (!c->bounce || !c->stage) {
    free(c->bounce);
    free(c->stage);
    free(c);
    return -1;
  }
  int one = 1, buf = 4 << 20;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  ps->conns[ps->nconns++] = c;
  return 0;
}

/* ---- the frame check: the only gate between the network and registered memory ---- */

static int reject(char* why, int cap, const char* text) {
  if (why) snprintf(why, (size_t)cap, "%s", text);
  return -1;
}

static int check_frame(mk_proxy* p, const mk_frame* f, char* why, int cap) {
  if (f->magic != MK_FRAME_MAGIC) return reject(why, cap, "bad magic");
  if (f->pad || f->pad2) return reject(why, cap, "nonzero padding");
  int flagged = f->flag_op != MK_FLAG_NONE;
  if (f->flag_op > MK_FLAG_ADD) return reject(why, cap, "unknown flag op");
  if (flagged && !mk_region_span(p, p->flags_region, (uint64_t)f->flag_id * 4, 4, NULL))
    return reject(why, cap, "flag id outside the flag array");
  switch (f->type) {
    case MK_FRAME_DATA:
      if (f->bytes > MK_FRAME_PAYLOAD_MAX || f->bytes > f->write_bytes)
        return reject(why, cap, "payload larger than a frame or its write");
      if (!mk_payload_span(p, f->dst_region, f->dst_offset, f->bytes, NULL))
        return reject(why, cap, "payload outside the registered data regions");
      return 0;
    case MK_FRAME_SIGNAL:
      if (f->bytes || !flagged) return reject(why, cap, "SIGNAL with a payload or without a flag");
      return 0;
    case MK_FRAME_FLUSH:
    case MK_FRAME_FLUSH_ACK:
    case MK_FRAME_BYE:
      if (f->bytes || flagged) return reject(why, cap, "control frame with a payload or a flag");
      return 0;
    default:
      return reject(why, cap, "unknown frame type");
  }
}

int mk_tcp_check_frame(mk_proxy* p, int peer, const unsigned char* frame, int len, char* why, int why_cap) {
  (void)peer;
  if (len != (int)sizeof(mk_frame)) return reject(why, why_cap, "short or long header");
  mk_frame f;
  memcpy(&f, frame, sizeof f);
  return check_frame(p, &f, why, why_cap);
}

/* ---- multi-frame writes: the flag waits for the last byte, whatever order frames came in ---- */

static pending_write* pending_slot(peer_state* ps, uint32_t id) {
  size_t mask = ps->pending_cap - 1, i = (id * 2654435761u) & mask;
  while (ps->pending[i].used && ps->pending[i].id != id) i = (i + 1) & mask;
  return &ps->pending[i];
}

static int pending_grow(peer_state* ps) {
  size_t old_cap = ps->pending_cap, cap = old_cap ? old_cap * 2 : 256;
  pending_write* old = ps->pending;
  ps->pending = calloc(cap, sizeof *old);
  if (!ps->pending) {
    ps->pending = old;
    return -1;
  }
  ps->pending_cap = cap;
  for (size_t i = 0; i < old_cap; i++)
    if (old[i].used) *pending_slot(ps, old[i].id) = old[i];
  free(old);
  return 0;
}

static void pending_remove(peer_state* ps, pending_write* w) { /* backward-shift deletion */
  size_t mask = ps->pending_cap - 1, i = (size_t)(w - ps->pending), j = i;
  ps->pending[i].used = 0;
  for (;;) {
    j = (j + 1) & mask;
    if (!ps->pending[j].used) break;
    size_t home = (ps->pending[j].id * 2654435761u) & mask;
    if (((j - home) & mask) >= ((j - i) & mask)) { /* j may move back to i */
      ps->pending[i] = ps->pending[j];
      ps->pending[j].used = 0;
      i = j;
    }
  }
  ps->pending_len--;
}

/* A DATA frame has landed in full; returns -1 on failure. */
static int data_arrived(mk_proxy* p, peer_state* ps, const mk_frame* f, int peer) {
  if (f->bytes == f->write_bytes) return mk_apply_flag(p, f->flag_op, f->flag_id, f->flag_value, peer);
  if (ps->pending_len * 2 >= ps->pending_cap && (ps->pending_len >= MK_TCP_PENDING_MAX || pending_grow(ps))) {
    mk_fail(p, MKP_ERR_PEER, peer, MK_CMD_WRITE, "rank %d has too many half-delivered writes", peer);
    return -1;
  }
  pending_write* w = pending_slot(ps, f->id);
  if (!w->used) {
    *w = (pending_write){.id = f->id, .write_bytes = f->write_bytes, .used = 1};
    ps->pending_len++;
  }
  w->got += f->bytes;
  if (w->got < w->write_bytes) return 0;
  pending_write done = *w;
  pending_remove(ps, w);
  if (done.got > done.write_bytes) {
    mk_fail(p, MKP_ERR_PEER, peer, MK_CMD_WRITE, "rank %d sent more bytes than write %u holds", peer, done.id);
    return -1;
  }
  return mk_apply_flag(p, f->flag_op, f->flag_id, f->flag_value, peer);
}

/* ---- send side ---- */

static out_frame* queue_insert(conn* c, size_t at) {
  if (c->q_len == c->q_cap) {
    size_t cap = c->q_cap ? c->q_cap * 2 : 64;
    out_frame* q = malloc(cap * sizeof *q);
    if (!q) return NULL;
    for (size_t i = 0; i < c->q_len; i++) q[i] = c->q[(c->q_start + i) % c->q_cap];
    free(c->q);
    c->q = q;
    c->q_cap = cap;
    c->q_start = 0;
  }
  for (size_t i = c->q_len; i > at; i--) c->q[(c->q_start + i) % c->q_cap] = c->q[(c->q_start + i - 1) % c->q_cap];
  c->q_len++;
  return &c->q[(c->q_start + at) % c->q_cap];
}

static int enqueue(mk_proxy* p, tcp_state* t, conn* c, const out_frame* f) {
  size_t at = c->q_len;
  if (t->shuffle &&
      f->hdr.type == MK_FRAME_DATA) { /* test only: anywhere after the last barrier and the frame in flight */
    size_t lo = c->barrier > (c->sent ? 1u : 0u) ? c->barrier : (c->sent ? 1u : 0u);
    at = lo + (size_t)rand_r(&t->shuffle_seed) % (c->q_len - lo + 1);
  }
  out_frame* slot = queue_insert(c, at);
  if (!slot) {
    mk_fail(p, MKP_ERR_LOCAL, c->peer, f->hdr.type, "out of memory queueing a frame");
    return -1;
  }
  *slot = *f;
  if (f->hdr.type != MK_FRAME_DATA) c->barrier = c->q_len;
  t->peers[c->peer].queued_bytes += sizeof f->hdr + f->hdr.bytes;
  return 0;
}

static conn* pick_conn(tcp_state* t, peer_state* ps) {
  int i = t->shuffle ? rand_r(&t->shuffle_seed) % ps->nconns : ps->next_conn++ % ps->nconns;
  return ps->conns[i];
}

static int no_conns(mk_proxy* p, int peer, int op) {
  mk_fail(p, MKP_ERR_LOCAL, peer, op, "no TCP connection to rank %d", peer);
  return -1;
}

static int tcp_write(mk_proxy* p, const struct MkCmd* c) {
  tcp_state* t = p->tstate;
  peer_state* ps = &t->peers[c->peer];
  if (!ps->nconns) return no_conns(p, c->peer, c->type);
  if (ps->queued_bytes > MK_TCP_QUEUED_MAX) return MK_AGAIN;
  int kind;
  const unsigned char* src =
      mk_region_span(p, c->src_region, MK_CMD_OFFSET(c->src_off_hi, c->src_off_lo), c->bytes, &kind);
  uint64_t dst = MK_CMD_OFFSET(c->dst_off_hi, c->dst_off_lo);
  uint32_t id = ps->next_write_id++;
  uint32_t off = 0;
  do {
    uint32_t n = c->bytes - off < MK_FRAME_PAYLOAD_MAX ? c->bytes - off : MK_FRAME_PAYLOAD_MAX;
    out_frame f = {.hdr = {.magic = MK_FRAME_MAGIC,
                           .type = MK_FRAME_DATA,
                           .flag_op = c->flag_op,
                           .dst_region = c->dst_region,
                           .bytes = n,
                           .write_bytes = c->bytes,
                           .id = id,
                           .flag_id = c->flag_id,
                           .flag_value = c->flag_value,
                           .dst_offset = dst + off},
                   .src = src + off,
                   .src_kind = kind};
    if (enqueue(p, t, pick_conn(t, ps), &f)) return -1;
    off += n;
  } while (off < c->bytes);
  p->peers[c->peer].writes++;
  return 0;
}

static int tcp_signal(mk_proxy* p, const struct MkCmd* c) {
  tcp_state* t = p->tstate;
  peer_state* ps = &t->peers[c->peer];
  if (!ps->nconns) return no_conns(p, c->peer, c->type);
  out_frame f = {.hdr = {.magic = MK_FRAME_MAGIC,
                         .type = MK_FRAME_SIGNAL,
                         .flag_op = c->flag_op,
                         .flag_id = c->flag_id,
                         .flag_value = c->flag_value}};
  if (enqueue(p, t, pick_conn(t, ps), &f)) return -1;
  p->peers[c->peer].signals++;
  return 0;
}

/* A FLUSH marker goes down every connection; the peer acknowledges once it saw all of them. */
static int tcp_flush(mk_proxy* p, const struct MkCmd* c) {
  tcp_state* t = p->tstate;
  peer_state* ps = &t->peers[c->peer];
  if (!ps->nconns) return no_conns(p, c->peer, c->type);
  if (ps->flush_head - ps->flush_tail == 1024) return MK_AGAIN;
  uint32_t id = ++ps->next_flush_id;
  for (int i = 0; i < ps->nconns; i++) {
    out_frame f = {.hdr = {.magic = MK_FRAME_MAGIC, .type = MK_FRAME_FLUSH, .id = id}};
    if (enqueue(p, t, ps->conns[i], &f)) return -1;
  }
  ps->flushes[ps->flush_head++ % 1024] = (flush_wait){id, c->flag_id, c->flag_value, c->flag_op, mk_now_ns()};
  p->peers[c->peer].flushes++;
  return 0;
}

/* Sends what the socket takes; returns 1 if it made progress, 0 if not, -1 on failure. */
static int send_some(mk_proxy* p, tcp_state* t, conn* c) {
  int progress = 0;
  while (c->q_len) {
    out_frame* f = &c->q[c->q_start];
    size_t total = sizeof f->hdr + f->hdr.bytes;
    const unsigned char* payload = f->src;
    if (f->hdr.bytes && f->src_kind == MKP_REGION_CUDA) { /* staged once, when the frame reaches the head */
      if (!c->staged && mk_copy(p, c->stage, MKP_REGION_HOST, f->src, MKP_REGION_CUDA, f->hdr.bytes, c->peer))
        return -1;
      c->staged = 1;
      payload = c->stage;
    }
    struct iovec iov[2];
    int n = 0;
    if (c->sent < sizeof f->hdr) iov[n++] = (struct iovec){(unsigned char*)&f->hdr + c->sent, sizeof f->hdr - c->sent};
    size_t pay_sent = c->sent > sizeof f->hdr ? c->sent - sizeof f->hdr : 0;
    if (f->hdr.bytes) iov[n++] = (struct iovec){(void*)(payload + pay_sent), f->hdr.bytes - pay_sent};
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)n};
    ssize_t r = sendmsg(c->fd, &msg, MSG_NOSIGNAL); /* a dead peer is an error to report, not a SIGPIPE */
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      mk_fail(p, MKP_ERR_PEER, c->peer, f->hdr.type, "sending to rank %d failed: %s", c->peer, strerror(errno));
      return -1;
    }
    progress = 1;
    c->sent += (size_t)r;
    if (c->sent < total) break;
    if (f->hdr.type == MK_FRAME_DATA) p->peers[c->peer].bytes_sent += f->hdr.bytes;
    t->peers[c->peer].queued_bytes -= total;
    c->sent = 0;
    c->staged = 0;
    c->q_start = (c->q_start + 1) % c->q_cap;
    c->q_len--;
    if (c->barrier) c->barrier--;
  }
  if (progress || !c->q_len)
    c->stalled_since = 0;
  else if (!c->stalled_since)
    c->stalled_since = mk_now_ns();
  else if (mk_now_ns() - c->stalled_since > p->timeout_ns) {
    mk_fail(p, MKP_ERR_TIMEOUT, c->peer, c->q[c->q_start].hdr.type, "rank %d has not taken data for %.1f s", c->peer,
            p->timeout_ns / 1e9);
    return -1;
  }
  return progress;
}

/* ---- receive side ---- */

static int frame_complete(mk_proxy* p, tcp_state* t, conn* c) {
  peer_state* ps = &t->peers[c->peer];
  mk_frame* f = &c->in;
  switch (f->type) {
    case MK_FRAME_DATA:
      if (c->in_dst_kind == MKP_REGION_CUDA &&
          mk_copy(p, mk_payload_span(p, f->dst_region, f->dst_offset, f->bytes, NULL), MKP_REGION_CUDA, c->bounce,
                  MKP_REGION_HOST, f->bytes, c->peer))
        return -1;
      p->peers[c->peer].bytes_received += f->bytes;
      return data_arrived(p, ps, f, c->peer);
    case MK_FRAME_SIGNAL:
      return mk_apply_flag(p, f->flag_op, f->flag_id, f->flag_value, c->peer);
    case MK_FRAME_FLUSH: {
      c->flushes_seen = f->id;
      uint32_t all = c->flushes_seen;
      for (int i = 0; i < ps->nconns; i++)
        if ((int32_t)(ps->conns[i]->flushes_seen - all) < 0) all = ps->conns[i]->flushes_seen;
      if (all != f->id) return 0; /* other connections still carry frames from before this flush */
      out_frame ack = {.hdr = {.magic = MK_FRAME_MAGIC, .type = MK_FRAME_FLUSH_ACK, .id = all}};
      return enqueue(p, t, ps->conns[0], &ack);
    }
    case MK_FRAME_FLUSH_ACK:
      while (ps->flush_tail != ps->flush_head && (int32_t)(f->id - ps->flushes[ps->flush_tail % 1024].id) >= 0) {
        flush_wait* fl = &ps->flushes[ps->flush_tail++ % 1024];
        if (mk_apply_flag(p, fl->flag_op, fl->flag_id, fl->flag_value, p->rank)) return -1;
      }
      return 0;
    default: /* BYE */
      c->said_bye = 1;
      return 0;
  }
}

/* A peer that said goodbye and closed reads nothing more: what is still queued for it may only be
 * acknowledgements of FLUSHes it did not wait for (dropped); anything else was lost, and says so. */
static int closed_cleanly(mk_proxy* p, tcp_state* t, conn* c) {
  for (size_t i = 0; i < c->q_len; i++) {
    const out_frame* f = &c->q[(c->q_start + i) % c->q_cap];
    if (f->hdr.type != MK_FRAME_FLUSH_ACK && f->hdr.type != MK_FRAME_BYE) {
      mk_fail(p, MKP_ERR_PEER, c->peer, f->hdr.type, "rank %d closed its connection with data of ours outstanding",
              c->peer);
      return -1;
    }
    t->peers[c->peer].queued_bytes -= sizeof f->hdr + f->hdr.bytes;
  }
  c->q_len = c->q_start = c->sent = c->barrier = 0;
  c->staged = 0;
  c->fd = -c->fd - 1; /* stop polling it */
  return 0;
}

static int recv_some(mk_proxy* p, tcp_state* t, conn* c) {
  int progress = 0;
  for (int rounds = 0; rounds < 64; rounds++) {
    unsigned char* dst;
    size_t want;
    if (c->in_got < sizeof c->in) {
      dst = (unsigned char*)&c->in + c->in_got;
      want = sizeof c->in - c->in_got;
    } else {
      dst = c->in_dst + (c->in_got - sizeof c->in);
      want = sizeof c->in + c->in.bytes - c->in_got;
    }
    ssize_t r = recv(c->fd, dst, want, 0);
    if (r == 0) {
      if (c->said_bye && t->peers[c->peer].flush_tail == t->peers[c->peer].flush_head)
        return closed_cleanly(p, t, c) ? -1 : progress;
      mk_fail(p, MKP_ERR_PEER, c->peer, 0, "rank %d closed its connection %s(did the process die?)", c->peer,
              c->said_bye ? "with flushes outstanding " : "without saying goodbye ");
      return -1;
    }
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return progress;
      mk_fail(p, MKP_ERR_PEER, c->peer, 0, "receiving from rank %d failed: %s", c->peer, strerror(errno));
      return -1;
    }
    progress = 1;
    c->in_got += (size_t)r;
    if (c->in_got == sizeof c->in) {
      char why[96];
      if (check_frame(p, &c->in, why, sizeof why)) {
        p->stats.frames_rejected++;
        mk_fail(p, MKP_ERR_PEER, c->peer, 0, "rank %d sent a frame that was rejected (%s); nothing of it was written",
                c->peer, why);
        return -1;
      }
      if (c->in.type == MK_FRAME_DATA) {
        c->in_dst = mk_payload_span(p, c->in.dst_region, c->in.dst_offset, c->in.bytes, &c->in_dst_kind);
        if (c->in_dst_kind == MKP_REGION_CUDA) c->in_dst = c->bounce;
      }
    }
    if (c->in_got >= sizeof c->in && c->in_got == sizeof c->in + c->in.bytes) {
      c->in_got = 0;
      if (frame_complete(p, t, c)) return -1;
    }
  }
  return progress;
}

/* ---- progress ---- */

static int rebuild_pollfds(mk_proxy* p, tcp_state* t) {
  free(t->pfds);
  free(t->pconn);
  size_t n = 0;
  for (int r = 0; r < p->nranks; r++) n += (size_t)t->peers[r].nconns;
  t->pfds = calloc(n ? n : 1, sizeof *t->pfds);
  t->pconn = calloc(n ? n : 1, sizeof *t->pconn);
  if (!t->pfds || !t->pconn) return -1;
  n = 0;
  for (int r = 0; r < p->nranks; r++)
    for (int i = 0; i < t->peers[r].nconns; i++) t->pconn[n++] = t->peers[r].conns[i];
  t->npfds = n;
  return 0;
}

static int tcp_start(mk_proxy* p) {
  tcp_state* t = tcp(p);
  if (!t || rebuild_pollfds(p, t)) {
    mk_fail(p, MKP_ERR_LOCAL, -1, 0, "out of memory starting the TCP transport");
    return -1;
  }
  return 0;
}

static int check_flush_deadlines(mk_proxy* p, tcp_state* t) {
  uint64_t now = mk_now_ns();
  for (int r = 0; r < p->nranks; r++) {
    peer_state* ps = &t->peers[r];
    if (ps->flush_tail != ps->flush_head && now - ps->flushes[ps->flush_tail % 1024].since > p->timeout_ns) {
      mk_fail(p, MKP_ERR_TIMEOUT, r, MK_CMD_FLUSH, "rank %d did not acknowledge a FLUSH within %.1f s", r,
              p->timeout_ns / 1e9);
      return -1;
    }
  }
  return 0;
}

static int tcp_poll(mk_proxy* p, int timeout_us) {
  tcp_state* t = p->tstate;
  int sending = 0;
  for (size_t i = 0; i < t->npfds; i++) {
    conn* c = t->pconn[i];
    t->pfds[i] = (struct pollfd){.fd = c->fd, .events = (short)(POLLIN | (c->q_len ? POLLOUT : 0))};
    sending |= c->q_len != 0;
  }
  struct timespec ts = {0, (sending ? 0 : timeout_us) * 1000L};
  int ready = ppoll(t->pfds, t->npfds, &ts, NULL);
  if (ready < 0 && errno != EINTR) {
    mk_fail(p, MKP_ERR_LOCAL, -1, 0, "ppoll: %s", strerror(errno));
    return -1;
  }
  int events = 0;
  for (size_t i = 0; ready > 0 && i < t->npfds; i++) {
    conn* c = t->pconn[i];
    short re = t->pfds[i].revents;
    int r = 0;
    if (re & (POLLIN | POLLERR | POLLHUP)) r = recv_some(p, t, c);
    if (r >= 0 && c->fd >= 0 && c->q_len && (re & POLLOUT)) r = r | send_some(p, t, c);
    if (r < 0) return -1;
    events += r;
  }
  for (size_t i = 0; i < t->npfds; i++) /* a stalled connection that poll never reports must still time out */
    if (t->pconn[i]->fd >= 0 && t->pconn[i]->q_len && !(t->pfds[i].revents & POLLOUT) &&
        send_some(p, t, t->pconn[i]) < 0)
      return -1;
  if (check_flush_deadlines(p, t)) return -1;
  return events;
}

/* Goodbye: drains what is queued (bounded by the timeout), then sends BYE on every connection. */
static void tcp_close(mk_proxy* p) {
  tcp_state* t = p->tstate;
  for (size_t i = 0; i < t->npfds; i++) {
    out_frame bye = {.hdr = {.magic = MK_FRAME_MAGIC, .type = MK_FRAME_BYE}};
    if (t->pconn[i]->fd >= 0) enqueue(p, t, t->pconn[i], &bye);
  }
  uint64_t start = mk_now_ns();
  for (;;) {
    int queued = 0;
    for (size_t i = 0; i < t->npfds; i++) queued |= t->pconn[i]->fd >= 0 && t->pconn[i]->q_len;
    if (!queued || mk_now_ns() - start > p->timeout_ns || tcp_poll(p, 100) < 0) break;
  }
  for (size_t i = 0; i < t->npfds; i++) {
    conn* c = t->pconn[i];
    if (c->fd >= 0) shutdown(c->fd, SHUT_WR);
  }
}

static void tcp_destroy(mk_proxy* p) {
  tcp_state* t = p->tstate;
  if (!t) return;
  for (int r = 0; r < p->nranks; r++) {
    peer_state* ps = &t->peers[r];
    for (int i = 0; i < ps->nconns; i++) {
      conn* c = ps->conns[i];
      close(c->fd >= 0 ? c->fd : -c->fd - 1);
      free(c->q);
      free(c->bounce);
      free(c->stage);
      free(c);
    }
    free(ps->pending);
  }
  free(t->peers);
  free(t->pfds);
  free(t->pconn);
  free(t);
  p->tstate = NULL;
}

const mk_transport_ops mk_tcp_ops = {.name = "tcp",
                                     .write = tcp_write,
                                     .signal = tcp_signal,
                                     .flush = tcp_flush,
                                     .poll = tcp_poll,
                                     .start = tcp_start,
                                     .close = tcp_close,
                                     .destroy = tcp_destroy};
