/* The null transport: commands are consumed and counted, nothing is sent. It measures the queue
 * and the proxy alone. */
#include <time.h>

#include "proxy.h"

static int null_write(mk_proxy* p, const struct MkCmd* c) {
  p->peers[c->peer].writes++;
  p->peers[c->peer].bytes_sent += c->bytes;
  return 0;
}

static int null_signal(mk_proxy* p, const struct MkCmd* c) {
  p->peers[c->peer].signals++;
  return 0;
}

static int null_flush(mk_proxy* p, const struct MkCmd* c) {
  p->peers[c->peer].flushes++;
  return mk_apply_flag(p, c->flag_op, c->flag_id, c->flag_value, p->rank); /* nothing is in flight */
}

static int null_poll(mk_proxy* p, int timeout_us) {
  (void)p;
  if (timeout_us > 0) nanosleep(&(struct timespec){0, timeout_us * 1000L}, NULL);
  return 0;
}

const mk_transport_ops mk_null_ops = {
    .name = "null", .write = null_write, .signal = null_signal, .flush = null_flush, .poll = null_poll};
