/* Verbs transport (InfiniBand, RoCE, AWS EFA). libibverbs (and libefa) are loaded with dlopen, so
 * the extension imports where no RDMA stack is installed; the transport itself is compiled only
 * when the rdma-core headers were present at build time (MK_HAVE_VERBS). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proxy.h"

int mk_verbs_available(void) {
#ifdef MK_HAVE_VERBS
  return 1;
#else
  return 0;
#endif
}

#ifndef MK_HAVE_VERBS

/* Without the headers the probe can still say whether devices exist, which tells the user what to install. */
int mk_verbs_probe(char* report, int cap) {
  void* lib = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(report, (size_t)cap, "no RDMA: libibverbs.so.1 is not installed");
    return -1;
  }
  void** (*get_list)(int*) = (void** (*)(int*))dlsym(lib, "ibv_get_device_list");
  void (*free_list)(void**) = (void (*)(void**))dlsym(lib, "ibv_free_device_list");
  int n = 0;
  void** list = get_list ? get_list(&n) : NULL;
  if (list) free_list(list);
  snprintf(
      report, (size_t)cap,
      n > 0 ? "%d RDMA device(s) present, but this build has no verbs transport (rebuild with libibverbs-dev installed)"
            : "no RDMA device (%d found)",
      n);
  return 0;
}

static int unavailable(mk_proxy* p) {
  mk_fail(p, MKP_ERR_LOCAL, -1, 0, "the verbs transport is not compiled into this build");
  return -1;
}
int mk_verbs_open(mk_proxy* p, const char* device, int port, int gid_index) { return unavailable(p); }
int mk_verbs_describe(mk_proxy* p, char* out, int cap) { return unavailable(p); }
int mk_verbs_blob_bytes(void) { return 0; }
int mk_verbs_local_blob(mk_proxy* p, int peer, unsigned char* out, int cap) { return unavailable(p); }
int mk_verbs_connect(mk_proxy* p, int peer, const unsigned char* blob, int len) { return unavailable(p); }
int mk_verbs_region_key(mk_proxy* p, int id, unsigned long long* addr, unsigned long long* bytes, unsigned int* rkey) {
  return unavailable(p);
}
int mk_verbs_set_remote_region(mk_proxy* p, int peer, int id, unsigned long long addr, unsigned long long bytes,
                               unsigned int rkey) {
  return unavailable(p);
}
static int fail_cmd(mk_proxy* p, const struct MkCmd* c) { return unavailable(p); }
static int fail_poll(mk_proxy* p, int timeout_us) { return unavailable(p); }
const mk_transport_ops mk_verbs_ops = {
    .name = "verbs", .write = fail_cmd, .signal = fail_cmd, .flush = fail_cmd, .poll = fail_poll};

#else /* MK_HAVE_VERBS */
/* Reliable-connected QPs (InfiniBand, RoCE) and EFA's SRD through the extended QP API.
 *
 * A WRITE is RDMA writes of up to MK_VERBS_CHUNK bytes straight into the peer's registered region,
 * followed by a SEND of a 24-byte record that tells the peer's proxy which flag to apply. On RC the
 * record is delivered after the writes before it, so the flag is applied at once. SRD delivers out of
 * order: there every chunk is a write-with-immediate carrying (rank, write id), and the record says how
 * many chunks to await; whichever of the record and the last chunk completes last publishes the flag.
 * FLUSH sends a record holding how many commands preceded it; the peer answers once it has applied
 * that many. libibverbs is reached only through the function pointers below (dlopen): the header's
 * inline helpers used here go through the device context and reference no library symbol. */
#include <arpa/inet.h>
#include <infiniband/efadv.h>
#include <infiniband/verbs.h>
#include <unistd.h>

#ifndef EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE
#define EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE (1 << 3) /* rdma-core >= 45 */
#endif

#define MK_VERBS_CHUNK (16u << 20)
#define MK_VERBS_SQ 1024 /* send WRs in flight per QP */
#define MK_VERBS_RQ 1024 /* receive buffers posted on the SRD QP */
#define MK_VERBS_RQ_RC 256 /* receive buffers posted per RC QP */
#define MK_VERBS_QKEY 0x4d4b5131u
#define MK_VERBS_MAGIC 0x3142564du /* "MVB1" */
#define MK_VERBS_RETIRED 32 /* earlier registrations kept per proxy: growths (the workspace at least doubles each) */
#define MK_VERBS_IMM_RANK_BITS 12 /* SRD immediate: rank in the high 12 bits, write id in the low 20 */
#define MK_VERBS_IMM_ID_MASK ((1u << (32 - MK_VERBS_IMM_RANK_BITS)) - 1)
/* A send unacknowledged for 4.096 us << ACK_TIMEOUT (0.54 s) is retried RETRY times, then fails: a dead
 * peer surfaces in ~4 s. Not 7 retries: soft-RoCE takes 7 to mean forever. */
#define MK_VERBS_ACK_TIMEOUT 17
#define MK_VERBS_RETRY 6
#define MK_VERBS_BEAT_NS 100000000ULL /* an idle peer is probed this often: a dead one fails the probe */
/* wr_id: the peer in the high half; a send's low half holds MK_WR_SEND and what it carried */
#define MK_WR_SEND (1ull << 31)
enum { WR_DATA = 0, WR_BEAT = 1, WR_CONTROL = 2 }; /* CONTROL: flush acknowledgements, goodbye */

static struct {
  void *lib, *efa;
  struct ibv_device** (*get_device_list)(int*);
  void (*free_device_list)(struct ibv_device**);
  const char* (*get_device_name)(struct ibv_device*);
  struct ibv_context* (*open_device)(struct ibv_device*);
  int (*close_device)(struct ibv_context*);
  int (*query_device)(struct ibv_context*, struct ibv_device_attr*);
  int (*query_port)(struct ibv_context*, uint8_t, struct _compat_ibv_port_attr*);
  int (*query_gid)(struct ibv_context*, uint8_t, int, union ibv_gid*);
  struct ibv_pd* (*alloc_pd)(struct ibv_context*);
  int (*dealloc_pd)(struct ibv_pd*);
  struct ibv_cq* (*create_cq)(struct ibv_context*, int, void*, struct ibv_comp_channel*, int);
  int (*destroy_cq)(struct ibv_cq*);
  struct ibv_qp* (*create_qp)(struct ibv_pd*, struct ibv_qp_init_attr*);
  int (*modify_qp)(struct ibv_qp*, struct ibv_qp_attr*, int);
  int (*destroy_qp)(struct ibv_qp*);
  struct ibv_mr* (*reg_mr)(struct ibv_pd*, void*, size_t, int);
  struct ibv_mr* (*reg_dmabuf_mr)(struct ibv_pd*, uint64_t, size_t, uint64_t, int, int);
  int (*dereg_mr)(struct ibv_mr*);
  struct ibv_ah* (*create_ah)(struct ibv_pd*, struct ibv_ah_attr*);
  int (*destroy_ah)(struct ibv_ah*);
  struct ibv_qp_ex* (*qp_to_qp_ex)(struct ibv_qp*);
  const char* (*wc_status_str)(enum ibv_wc_status);
  struct ibv_qp* (*efa_create_qp_ex)(struct ibv_context*, struct ibv_qp_init_attr_ex*, struct efadv_qp_init_attr*,
                                     uint32_t);
  int (*efa_query_device)(struct ibv_context*, struct efadv_device_attr*, uint32_t);
} V;
static pthread_once_t v_once = PTHREAD_ONCE_INIT;
static char v_error[MKP_MESSAGE_BYTES];

static void v_load(void) {
  void* lib = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(v_error, sizeof v_error, "no RDMA: libibverbs.so.1 is not installed (%s)", dlerror());
    return;
  }
  struct {
    void** fn;
    const char* name;
  } syms[] = {
      {(void**)&V.get_device_list, "ibv_get_device_list"},
      {(void**)&V.free_device_list, "ibv_free_device_list"},
      {(void**)&V.get_device_name, "ibv_get_device_name"},
      {(void**)&V.open_device, "ibv_open_device"},
      {(void**)&V.close_device, "ibv_close_device"},
      {(void**)&V.query_device, "ibv_query_device"},
      {(void**)&V.query_port, "ibv_query_port"},
      {(void**)&V.query_gid, "ibv_query_gid"},
      {(void**)&V.alloc_pd, "ibv_alloc_pd"},
      {(void**)&V.dealloc_pd, "ibv_dealloc_pd"},
      {(void**)&V.create_cq, "ibv_create_cq"},
      {(void**)&V.destroy_cq, "ibv_destroy_cq"},
      {(void**)&V.create_qp, "ibv_create_qp"},
      {(void**)&V.modify_qp, "ibv_modify_qp"},
      {(void**)&V.destroy_qp, "ibv_destroy_qp"},
      {(void**)&V.reg_mr, "ibv_reg_mr"},
      {(void**)&V.dereg_mr, "ibv_dereg_mr"},
      {(void**)&V.create_ah, "ibv_create_ah"},
      {(void**)&V.destroy_ah, "ibv_destroy_ah"},
      {(void**)&V.wc_status_str, "ibv_wc_status_str"},
  };
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++)
    if (!(*syms[i].fn = dlsym(lib, syms[i].name))) {
      snprintf(v_error, sizeof v_error, "libibverbs.so.1 lacks %s", syms[i].name);
      return;
    }
  V.reg_dmabuf_mr = dlsym(lib, "ibv_reg_dmabuf_mr"); /* rdma-core >= 34; else GPU memory needs nvidia-peermem */
  V.qp_to_qp_ex = dlsym(lib, "ibv_qp_to_qp_ex");
  V.efa = dlopen("libefa.so.1", RTLD_NOW | RTLD_LOCAL);
  if (V.efa) {
    V.efa_create_qp_ex = dlsym(V.efa, "efadv_create_qp_ex");
    V.efa_query_device = dlsym(V.efa, "efadv_query_device");
  }
  V.lib = lib;
}

static int v_ready(char* why, int cap) {
  pthread_once(&v_once, v_load);
  if (V.lib) return 0;
  snprintf(why, (size_t)cap, "%s", v_error);
  return -1;
}

/* The header's ibv_query_port is an inline that calls the library's symbol: do the same by hand. */
static int port_attr(struct ibv_context* ctx, int port, struct ibv_port_attr* attr) {
  struct verbs_context* vctx = verbs_get_ctx_op(ctx, query_port);
  memset(attr, 0, sizeof *attr);
  if (vctx) return vctx->query_port(ctx, (uint8_t)port, attr, sizeof *attr);
  return V.query_port(ctx, (uint8_t)port, (struct _compat_ibv_port_attr*)attr);
}

static const char* link_name(const struct ibv_port_attr* a) {
  return a->link_layer == IBV_LINK_LAYER_ETHERNET     ? "RoCE"
         : a->link_layer == IBV_LINK_LAYER_INFINIBAND ? "InfiniBand"
                                                      : "unspecified";
}

int mk_verbs_probe(char* report, int cap) {
  if (v_ready(report, cap)) return -1;
  int n = 0, active = 0, len = 0;
  errno = 0;
  struct ibv_device** list = V.get_device_list(&n);
  if (!list || n == 0) { /* ENOSYS (no kernel support) and an empty list both mean: no RDMA here */
    snprintf(report, (size_t)cap, "no RDMA device (%s)", !list ? strerror(errno ? errno : ENOSYS) : "none found");
    if (list) V.free_device_list(list);
    return 0;
  }
  for (int d = 0; d < n; d++) {
    struct ibv_context* ctx = V.open_device(list[d]);
    struct ibv_device_attr da;
    if (!ctx) continue;
    if (!V.query_device(ctx, &da))
      for (int port = 1; port <= da.phys_port_cnt; port++) {
        struct ibv_port_attr pa;
        if (port_attr(ctx, port, &pa) || pa.state != IBV_PORT_ACTIVE) continue;
        active++;
        if (len < cap)
          len += snprintf(report + len, (size_t)(cap - len), "%s%s port %d active (%s)", active > 1 ? ", " : "",
                          V.get_device_name(list[d]), port, link_name(&pa));
      }
    V.close_device(ctx);
  }
  V.free_device_list(list);
  if (!active) snprintf(report, (size_t)cap, "no RDMA device with an active port (%d device(s) found)", n);
  return active;
}

/* ---- state ---- */

enum { REC_FLAG = 1, REC_FLUSH = 2, REC_FLUSH_ACK = 3, REC_BYE = 4, REC_BEAT = 5 }; /* BEAT: liveness, ignored */

typedef struct {
  uint8_t kind, flag_op;
  uint16_t rank; /* sender */
  uint32_t id; /* REC_FLAG on SRD: the write id its chunks carry; REC_FLUSH, REC_FLUSH_ACK: the flush id */
  uint32_t flag_id;
  uint32_t value; /* REC_FLUSH: commands that preceded it */
  uint32_t chunks; /* REC_FLAG: write-with-immediate completions to await first (0 on RC) */
  uint32_t bytes; /* REC_FLAG of a WRITE on RC: its payload (the receiver's count; SRD counts its chunks) */
} vrec;

typedef struct {
  uint64_t addr, bytes;
  uint32_t rkey, used;
} vremote_region;

typedef struct {
  uint32_t magic, rank, qpn, psn, qkey, efa;
  uint16_t lid;
  uint8_t mtu, link_layer;
  uint8_t gid[16];
  vremote_region regions[MK_MAX_REGIONS];
} vblob;

typedef struct {
  uint32_t id, flag_id, value;
  int flag_op;
  uint64_t since;
} vflush_wait;
typedef struct {
  uint32_t id, chunks_seen, chunks_needed, flag_id, value;
  int flag_op, have_record, used;
} vsrd_write;

typedef struct {
  struct ibv_qp* qp; /* RC: one per peer; SRD: the shared QP */
  struct ibv_ah* ah; /* SRD */
  uint32_t remote_qpn, connected, said_bye; /* said_bye: its proxy stopped cleanly; nothing more comes */
  vblob remote;
  uint32_t next_write_id, next_flush_id, commands_sent, commands_applied, in_flight;
  vflush_wait flushes[256];
  unsigned flush_head, flush_tail;
  struct {
    uint32_t id, needed;
  } acks_owed[256]; /* flushes of the peer we answer once caught up */
  unsigned owed_head, owed_tail;
  vsrd_write srd[1024]; /* SRD writes whose record or chunks are still missing, by id % 1024 */
} vpeer;

typedef struct {
  struct ibv_context* ctx;
  struct ibv_pd* pd;
  struct ibv_cq* cq;
  struct ibv_qp* srd_qp;
  struct ibv_qp_ex* srd_qpx;
  struct ibv_mr* recv_mr;
  vrec* recv_bufs; /* SRD: MK_VERBS_RQ shared; RC: MK_VERBS_RQ_RC per peer, peer-major */
  size_t nbufs;
  uint32_t srd_in_flight; /* the SRD QP's send queue is shared by all peers */
  int port, gid_index, efa;
  struct ibv_port_attr pa;
  union ibv_gid gid;
  char name[64], gid_type[16]; /* the device's name; the GID's type as sysfs gives it ("RoCE v2"), or "" */
  vpeer* peers;
  struct ibv_mr* retired[MK_VERBS_RETIRED]; /* grown regions' earlier registrations (posted work may use them) */
  int retired_count;
  uint64_t last_beat;
} vstate;

static int vfail(mk_proxy* p, int peer, int op, const char* what) {
  mk_fail(p, peer >= 0 ? MKP_ERR_PEER : MKP_ERR_LOCAL, peer, op, "verbs: %s: %s", what, strerror(errno ? errno : EIO));
  return -1;
}

/* wr_id of a receive: the peer (RC) in the high half, the buffer slot in the low half. */
static int post_recv(vstate* v, struct ibv_qp* qp, int peer, uint64_t slot) {
  struct ibv_sge sge = {(uint64_t)(uintptr_t)&v->recv_bufs[slot], sizeof(vrec), v->recv_mr->lkey};
  struct ibv_recv_wr wr = {.wr_id = slot | (uint64_t)peer << 32, .sg_list = &sge, .num_sge = 1}, *bad;
  return ibv_post_recv(qp, &wr, &bad);
}

static uint32_t sq_room(vstate* v, int peer) {
  return MK_VERBS_SQ - (v->efa ? v->srd_in_flight : v->peers[peer].in_flight);
}

/* The type of the port's GID `index` as sysfs names it ("RoCE v2", "IB/RoCE v1"); "" where unknown. */
static void gid_type(const vstate* v, int index, char* out, int cap) {
  char path[192];
  snprintf(path, sizeof path, "/sys/class/infiniband/%s/ports/%d/gid_attrs/types/%d", v->name, v->port, index);
  FILE* f = fopen(path, "r");
  if (!f || !fgets(out, cap, f)) out[0] = 0;
  if (f) fclose(f);
  out[strcspn(out, "\n")] = 0;
}

/* RoCE: the GID a routed network carries first (RoCE v2 over IPv4, ::ffff:a.b.c.d), then RoCE v2,
 * then IPv4, then any that is set; the lowest index among equals. InfiniBand: the first that is set. */
static int pick_gid(const vstate* v, struct ibv_context* ctx) {
  static const uint8_t v4_mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  const int roce = v->pa.link_layer == IBV_LINK_LAYER_ETHERNET;
  int best = 0, best_score = -1;
  for (int i = 0; i < v->pa.gid_tbl_len && i < 256; i++) {
    union ibv_gid g;
    if (V.query_gid(ctx, (uint8_t)v->port, i, &g) || !(g.global.subnet_prefix || g.global.interface_id)) continue;
    char type[16];
    gid_type(v, i, type, sizeof type);
    const int score = roce ? 2 * !strcmp(type, "RoCE v2") + !memcmp(g.raw, v4_mapped, sizeof v4_mapped) : 0;
    if (score > best_score) best = i, best_score = score;
    if (!roce) break;
  }
  return best;
}

int mk_verbs_describe(mk_proxy* p, char* out, int cap) {
  const vstate* v = p->tstate;
  if (!v) return -1;
  char addr[64];
  inet_ntop(AF_INET6, v->gid.raw, addr, sizeof addr);
  snprintf(out, (size_t)cap, "%s port %d (%s%s), GID index %d %s%s%s%s, MTU %d", v->name, v->port,
           v->efa ? "EFA, " : "", link_name(&v->pa), v->gid_index, addr, v->gid_type[0] ? " (" : "", v->gid_type,
           v->gid_type[0] ? ")" : "", 128 << v->pa.active_mtu);
  return 0;
}

int mk_verbs_open(mk_proxy* p, const char* device, int port, int gid_index) {
  char why[MKP_MESSAGE_BYTES];
  if (v_ready(why, sizeof why)) {
    mk_fail(p, MKP_ERR_LOCAL, -1, 0, "%s", why);
    return -1;
  }
  if (p->transport != MKP_TRANSPORT_VERBS || p->tstate) return -1;
  int n = 0;
  struct ibv_device** list = V.get_device_list(&n);
  struct ibv_context* ctx = NULL;
  char name[64] = "";
  for (int d = 0; list && d < n && !ctx; d++) {
    if (device && strcmp(device, V.get_device_name(list[d]))) continue;
    struct ibv_port_attr pa;
    snprintf(name, sizeof name, "%s", V.get_device_name(list[d]));
    ctx = V.open_device(list[d]);
    if (ctx && (port_attr(ctx, port, &pa) || pa.state != IBV_PORT_ACTIVE)) {
      V.close_device(ctx);
      ctx = NULL;
    }
  }
  if (list) V.free_device_list(list);
  if (!ctx) {
    mk_fail(p, MKP_ERR_LOCAL, -1, 0, "verbs: no device%s%s with port %d active", device ? " named " : "",
            device ? device : "", port);
    return -1;
  }
  vstate* v = calloc(1, sizeof *v);
  if (!v) {
    V.close_device(ctx);
    mk_fail(p, MKP_ERR_LOCAL, -1, 0, "verbs: out of memory");
    return -1;
  }
  p->tstate = v;
  v->ctx = ctx;
  v->port = port;
  port_attr(ctx, port, &v->pa);
  struct efadv_device_attr ea = {0};
  v->efa = V.efa_query_device && !V.efa_query_device(ctx, &ea, sizeof ea);
  v->nbufs = v->efa ? MK_VERBS_RQ : (size_t)p->nranks * MK_VERBS_RQ_RC;
  v->peers = calloc((size_t)p->nranks, sizeof *v->peers);
  v->recv_bufs = calloc(v->nbufs, sizeof(vrec));
  if (!v->peers || !v->recv_bufs) {
    mk_fail(p, MKP_ERR_LOCAL, -1, 0, "verbs: out of memory");
    return -1;
  }
  if (v->efa && (!(ea.device_caps & EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE) || !V.efa_create_qp_ex || !V.qp_to_qp_ex)) {
    mk_fail(p, MKP_ERR_LOCAL, -1, 0, "verbs: this EFA device (or rdma-core) has no RDMA write; use transport tcp");
    return -1;
  }
  snprintf(v->name, sizeof v->name, "%s", name);
  v->gid_index = gid_index >= 0 ? gid_index : pick_gid(v, ctx);
  V.query_gid(ctx, (uint8_t)port, v->gid_index, &v->gid);
  gid_type(v, v->gid_index, v->gid_type, sizeof v->gid_type);
  if (!(v->pd = V.alloc_pd(ctx))) return vfail(p, -1, 0, "ibv_alloc_pd");
  if (!(v->cq = V.create_cq(ctx, 2 * MK_VERBS_SQ * p->nranks + MK_VERBS_RQ, NULL, NULL, 0)))
    return vfail(p, -1, 0, "ibv_create_cq");
  if (!(v->recv_mr = V.reg_mr(v->pd, v->recv_bufs, v->nbufs * sizeof(vrec), IBV_ACCESS_LOCAL_WRITE)))
    return vfail(p, -1, 0, "ibv_reg_mr(receive buffers)");
  if (v->efa) {
    struct ibv_qp_init_attr_ex ax = {
        .send_cq = v->cq,
        .recv_cq = v->cq,
        .qp_type = IBV_QPT_DRIVER,
        .pd = v->pd,
        .cap = {.max_send_wr = MK_VERBS_SQ,
                .max_recv_wr = MK_VERBS_RQ,
                .max_send_sge = 1,
                .max_recv_sge = 1,
                .max_inline_data = sizeof(vrec)},
        .comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
        .send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_SEND};
    struct efadv_qp_init_attr ef = {.driver_qp_type = EFADV_QP_DRIVER_TYPE_SRD};
    if (!(v->srd_qp = V.efa_create_qp_ex(ctx, &ax, &ef, sizeof ef))) return vfail(p, -1, 0, "efadv_create_qp_ex(SRD)");
    v->srd_qpx = V.qp_to_qp_ex(v->srd_qp);
    struct ibv_qp_attr a = {
        .qp_state = IBV_QPS_INIT, .pkey_index = 0, .port_num = (uint8_t)port, .qkey = MK_VERBS_QKEY};
    if (V.modify_qp(v->srd_qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY))
      return vfail(p, -1, 0, "SRD QP to INIT");
    a = (struct ibv_qp_attr){.qp_state = IBV_QPS_RTR};
    if (V.modify_qp(v->srd_qp, &a, IBV_QP_STATE)) return vfail(p, -1, 0, "SRD QP to RTR");
    a = (struct ibv_qp_attr){.qp_state = IBV_QPS_RTS, .sq_psn = 0};
    if (V.modify_qp(v->srd_qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN)) return vfail(p, -1, 0, "SRD QP to RTS");
    for (uint64_t i = 0; i < MK_VERBS_RQ; i++)
      if (post_recv(v, v->srd_qp, 0, i)) return vfail(p, -1, 0, "ibv_post_recv");
  }
  return 0;
}

/* [base, base + bytes) registered for remote write: GPU memory through dma-buf, else directly
 * (nvidia-peermem). NULL (errno set) where neither works; why then says so. */
static struct ibv_mr* register_span(vstate* v, int kind, unsigned char* base, uint64_t bytes, char* why, int cap) {
  int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  struct ibv_mr* mr = NULL;
  if (kind == MKP_REGION_CUDA && V.reg_dmabuf_mr) {
    uint64_t offset;
    int fd = mk_cuda_dmabuf_fd(base, bytes, &offset);
    if (fd >= 0) {
      mr = V.reg_dmabuf_mr(v->pd, offset, bytes, (uint64_t)(uintptr_t)base, fd, access);
      close(fd);
    }
  }
  if (!mr) mr = V.reg_mr(v->pd, base, bytes, access);
  if (!mr)
    snprintf(
        why, (size_t)cap, "verbs: cannot register %s region (%llu bytes): %s%s",
        kind == MKP_REGION_CUDA ? "GPU" : "host", (unsigned long long)bytes, strerror(errno),
        kind == MKP_REGION_CUDA ? " (neither dma-buf nor nvidia-peermem works here; use transport tcp or host)" : "");
  return mr;
}

static int verbs_register(mk_proxy* p, mk_region* r) {
  vstate* v = p->tstate;
  char why[MKP_MESSAGE_BYTES];
  if (!v) {
    mk_fail(p, MKP_ERR_LOCAL, -1, 0, "verbs: open the device before registering regions");
    return -1;
  }
  if (!(r->transport_data = register_span(v, r->kind, r->base, r->bytes, why, sizeof why))) {
    mk_fail(p, MKP_ERR_LOCAL, -1, 0, "%s", why);
    return -1;
  }
  return 0;
}

/* The grown span's registration serves the commands from now on; the earlier one stays registered
 * until the proxy is destroyed (work posted with its key may still be in flight). */
static int verbs_grow(mk_proxy* p, mk_region* r, uint64_t bytes, char* why, int cap) {
  vstate* v = p->tstate;
  if (v->retired_count == MK_VERBS_RETIRED) {
    snprintf(why, (size_t)cap, "verbs: the region grew %d times already (MK_VERBS_RETIRED registrations kept)",
             MK_VERBS_RETIRED);
    return -1;
  }
  struct ibv_mr* mr = register_span(v, r->kind, r->base, bytes, why, cap);
  if (!mr) return -1;
  v->retired[v->retired_count++] = r->transport_data;
  __atomic_store_n(&r->transport_data, mr, __ATOMIC_RELEASE);
  return 0;
}

int mk_verbs_region_key(mk_proxy* p, int id, unsigned long long* addr, unsigned long long* bytes, unsigned int* rkey) {
  if (!p->tstate || id < 0 || id >= MK_MAX_REGIONS || !p->regions[id].used || !p->regions[id].transport_data) return -1;
  const struct ibv_mr* mr = __atomic_load_n(&p->regions[id].transport_data, __ATOMIC_ACQUIRE);
  *addr = (uint64_t)(uintptr_t)p->regions[id].base;
  *bytes = __atomic_load_n(&p->regions[id].bytes, __ATOMIC_ACQUIRE);
  *rkey = mr->rkey;
  return 0;
}

/* The proxy thread reads bytes (acquire), then the key: seeing the new size, it sees the new key;
 * the old key stays valid for the old span. */
int mk_verbs_set_remote_region(mk_proxy* p, int peer, int id, unsigned long long addr, unsigned long long bytes,
                               unsigned int rkey) {
  vstate* v = p->tstate;
  if (!v || peer < 0 || peer >= p->nranks || id < 0 || id >= MK_MAX_REGIONS) return -1;
  vremote_region* d = &v->peers[peer].remote.regions[id];
  if (!d->used || d->addr != addr || bytes < __atomic_load_n(&d->bytes, __ATOMIC_ACQUIRE)) {
    mk_fail(p, MKP_ERR_PEER, peer, 0, "verbs: rank %d's region %d did not grow in place (0x%llx, %llu bytes)", peer, id,
            addr, bytes);
    return -1;
  }
  __atomic_store_n(&d->rkey, rkey, __ATOMIC_RELAXED);
  __atomic_store_n(&d->bytes, (uint64_t)bytes, __ATOMIC_RELEASE);
  return 0;
}

static struct ibv_qp* rc_qp(mk_proxy* p, vstate* v, int peer) {
  vpeer* vp = &v->peers[peer];
  if (vp->qp) return vp->qp;
  struct ibv_qp_init_attr ia = {.send_cq = v->cq,
                                .recv_cq = v->cq,
                                .qp_type = IBV_QPT_RC,
                                .cap = {.max_send_wr = MK_VERBS_SQ,
                                        .max_recv_wr = MK_VERBS_RQ_RC,
                                        .max_send_sge = 1,
                                        .max_recv_sge = 1,
                                        .max_inline_data = sizeof(vrec)}};
  if (!(vp->qp = V.create_qp(v->pd, &ia))) {
    vfail(p, -1, 0, "ibv_create_qp(RC)");
    return NULL;
  }
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT,
                          .pkey_index = 0,
                          .port_num = (uint8_t)v->port,
                          .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE};
  if (V.modify_qp(vp->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
    vfail(p, -1, 0, "RC QP to INIT");
    return NULL;
  }
  return vp->qp;
}

int mk_verbs_blob_bytes(void) { return (int)sizeof(vblob); }

int mk_verbs_local_blob(mk_proxy* p, int peer, unsigned char* out, int cap) {
  vstate* v = p->tstate;
  if (!v || cap < (int)sizeof(vblob) || peer < 0 || peer >= p->nranks) return -1;
  struct ibv_qp* qp = v->efa ? v->srd_qp : rc_qp(p, v, peer);
  if (!qp) return -1;
  vblob b = {.magic = MK_VERBS_MAGIC,
             .rank = (uint32_t)p->rank,
             .qpn = qp->qp_num,
             .psn = 0,
             .qkey = MK_VERBS_QKEY,
             .efa = (uint32_t)v->efa,
             .lid = v->pa.lid,
             .mtu = (uint8_t)v->pa.active_mtu,
             .link_layer = v->pa.link_layer};
  memcpy(b.gid, v->gid.raw, 16);
  for (int i = 0; i < MK_MAX_REGIONS; i++) {
    mk_region* r = &p->regions[i];
    if (!r->used || !r->transport_data) continue;
    b.regions[i].addr = (uint64_t)(uintptr_t)r->base;
    b.regions[i].bytes = r->bytes;
    b.regions[i].rkey = ((struct ibv_mr*)r->transport_data)->rkey;
    b.regions[i].used = 1;
  }
  memcpy(out, &b, sizeof b);
  return (int)sizeof b;
}

int mk_verbs_connect(mk_proxy* p, int peer, const unsigned char* blob, int len) {
  vstate* v = p->tstate;
  if (!v || peer < 0 || peer >= p->nranks || len != (int)sizeof(vblob)) return -1;
  vpeer* vp = &v->peers[peer];
  memcpy(&vp->remote, blob, sizeof vp->remote);
  vblob* b = &vp->remote;
  if (b->magic != MK_VERBS_MAGIC || b->rank != (uint32_t)peer || b->efa != (uint32_t)v->efa) {
    mk_fail(p, MKP_ERR_PEER, peer, 0, "verbs: rank %d sent a connection blob of another kind (EFA on one side only?)",
            peer);
    return -1;
  }
  struct ibv_ah_attr ah = {.port_num = (uint8_t)v->port,
                           .is_global = v->pa.link_layer != IBV_LINK_LAYER_INFINIBAND || v->efa,
                           .dlid = b->lid,
                           .grh = {.sgid_index = (uint8_t)v->gid_index, .hop_limit = 64}};
  memcpy(ah.grh.dgid.raw, b->gid, 16);
  vp->remote_qpn = b->qpn;
  if (v->efa) {
    if (!(vp->ah = V.create_ah(v->pd, &ah))) return vfail(p, peer, 0, "ibv_create_ah");
    vp->qp = v->srd_qp;
  } else {
    struct ibv_qp* qp = rc_qp(p, v, peer);
    if (!qp) return -1;
    struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTR,
                            .path_mtu = b->mtu < v->pa.active_mtu ? b->mtu : v->pa.active_mtu,
                            .dest_qp_num = b->qpn,
                            .rq_psn = b->psn,
                            .max_dest_rd_atomic = 1,
                            .min_rnr_timer = 12,
                            .ah_attr = ah};
    if (V.modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
      return vfail(p, peer, 0, "RC QP to RTR");
    a = (struct ibv_qp_attr){.qp_state = IBV_QPS_RTS,
                             .timeout = MK_VERBS_ACK_TIMEOUT,
                             .retry_cnt = MK_VERBS_RETRY,
                             .rnr_retry = 7,
                             .sq_psn = 0,
                             .max_rd_atomic = 1};
    if (V.modify_qp(qp, &a,
                    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                        IBV_QP_MAX_QP_RD_ATOMIC))
      return vfail(p, peer, 0, "RC QP to RTS");
    for (uint64_t i = 0; i < MK_VERBS_RQ_RC; i++)
      if (post_recv(v, qp, peer, (uint64_t)peer * MK_VERBS_RQ_RC + i)) return vfail(p, peer, 0, "ibv_post_recv");
  }
  vp->connected = 1;
  return 0;
}

/* ---- sending ---- */

/* wr_id of a send: the peer in the high half, so completions are counted per peer, and its kind (WR_*). */
static int post(mk_proxy* p, vstate* v, int peer, int kind, int opcode, const void* local, uint32_t lkey,
                uint32_t bytes, uint64_t raddr, uint32_t rkey, uint32_t imm) {
  vpeer* vp = &v->peers[peer];
  uint64_t wr_id = (uint64_t)peer << 32 | MK_WR_SEND | (uint64_t)kind;
  int inl = opcode == IBV_WR_SEND;
  if (v->efa) {
    struct ibv_qp_ex* x = v->srd_qpx;
    ibv_wr_start(x);
    x->wr_id = wr_id;
    x->wr_flags = IBV_SEND_SIGNALED;
    if (inl)
      ibv_wr_send(x);
    else
      ibv_wr_rdma_write_imm(x, rkey, raddr, htonl(imm));
    ibv_wr_set_ud_addr(x, vp->ah, vp->remote_qpn, MK_VERBS_QKEY);
    if (inl)
      ibv_wr_set_inline_data(x, (void*)local, bytes);
    else
      ibv_wr_set_sge(x, lkey, (uint64_t)(uintptr_t)local, bytes);
    if (ibv_wr_complete(x)) return vfail(p, peer, MK_CMD_WRITE, "posting to the SRD QP");
  } else {
    struct ibv_sge sge = {(uint64_t)(uintptr_t)local, bytes, lkey};
    struct ibv_send_wr wr = {.wr_id = wr_id,
                             .sg_list = &sge,
                             .num_sge = bytes ? 1 : 0,
                             .opcode = (enum ibv_wr_opcode)opcode,
                             .send_flags = IBV_SEND_SIGNALED | (inl ? IBV_SEND_INLINE : 0),
                             .wr.rdma = {.remote_addr = raddr, .rkey = rkey}},
                       *bad;
    if (ibv_post_send(vp->qp, &wr, &bad)) return vfail(p, peer, MK_CMD_WRITE, "ibv_post_send");
  }
  vp->in_flight++;
  v->srd_in_flight++;
  return 0;
}

static int send_record(mk_proxy* p, vstate* v, int peer, vrec rec) {
  rec.rank = (uint16_t)p->rank;
  const int kind = rec.kind == REC_BEAT                               ? WR_BEAT
                   : rec.kind == REC_FLUSH_ACK || rec.kind == REC_BYE ? WR_CONTROL
                                                                      : WR_DATA;
  return post(p, v, peer, kind, IBV_WR_SEND, &rec, 0, sizeof rec, 0, 0, 0);
}

/* An idle peer's liveness: a BEAT record, which its NIC acknowledges while its queue pair exists (RC)
 * or its SRD QP does; once its process is gone the send fails (RC: retries; EFA: BAD_DEST_QPN). */
static int beat(mk_proxy* p, vstate* v, int peer) { return send_record(p, v, peer, (vrec){.kind = REC_BEAT}); }

/* A command for a rank this proxy has no queue pair to (one of its own node's), or whose proxy said
 * goodbye: an error, not a post. */
static int not_connected(mk_proxy* p, const struct MkCmd* c) {
  if (((vstate*)p->tstate)->peers[c->peer].said_bye)
    mk_fail(p, MKP_ERR_PEER, c->peer, c->type, "verbs: rank %d stopped its proxy; nothing can be sent to it", c->peer);
  else
    mk_fail(p, MKP_ERR_LOCAL, c->peer, c->type, "verbs: rank %d is not connected", c->peer);
  return -1;
}

static int verbs_write(mk_proxy* p, const struct MkCmd* c) {
  vstate* v = p->tstate;
  vpeer* vp = &v->peers[c->peer];
  if (!vp->connected || vp->said_bye) return not_connected(p, c);
  uint32_t chunks = (c->bytes + MK_VERBS_CHUNK - 1) / MK_VERBS_CHUNK;
  if (chunks + 1 > sq_room(v, c->peer)) return MK_AGAIN; /* at most 257 WRs: a u32 of bytes in 16 MiB chunks */
  uint64_t src_off = MK_CMD_OFFSET(c->src_off_hi, c->src_off_lo), dst_off = MK_CMD_OFFSET(c->dst_off_hi, c->dst_off_lo);
  const unsigned char* src = mk_region_span(p, c->src_region, src_off, c->bytes, NULL);
  vremote_region* dst = &vp->remote.regions[c->dst_region];
  const uint64_t dst_bytes = __atomic_load_n(&dst->bytes, __ATOMIC_ACQUIRE); /* then its key: see set_remote_region */
  if (!src || !p->regions[c->src_region].transport_data || !dst->used || dst_off > dst_bytes ||
      c->bytes > dst_bytes - dst_off) {
    mk_fail(p, MKP_ERR_LOCAL, c->peer, c->type,
            "WRITE of %u bytes from offset %llu of region %u to offset %llu of rank %d's region %u is outside them",
            c->bytes, (unsigned long long)src_off, c->src_region, (unsigned long long)dst_off, c->peer, c->dst_region);
    return -1;
  }
  uint32_t id = vp->next_write_id++ & MK_VERBS_IMM_ID_MASK;
  const uint32_t rkey = __atomic_load_n(&dst->rkey, __ATOMIC_RELAXED);
  const struct ibv_mr* mr = __atomic_load_n(&p->regions[c->src_region].transport_data, __ATOMIC_ACQUIRE);
  const uint32_t lkey = mr->lkey;
  for (uint32_t i = 0; i < chunks; i++) {
    uint32_t off = i * MK_VERBS_CHUNK, n = c->bytes - off < MK_VERBS_CHUNK ? c->bytes - off : MK_VERBS_CHUNK;
    if (post(p, v, c->peer, WR_DATA, v->efa ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE, src + off, lkey, n,
             dst->addr + dst_off + off, rkey, (uint32_t)p->rank << (32 - MK_VERBS_IMM_RANK_BITS) | id))
      return -1;
  }
  vp->commands_sent++;
  p->peers[c->peer].writes++;
  p->peers[c->peer].bytes_sent += c->bytes;
  return send_record(p, v, c->peer,
                     (vrec){.kind = REC_FLAG,
                            .flag_op = c->flag_op,
                            .id = id,
                            .flag_id = c->flag_id,
                            .value = c->flag_value,
                            .chunks = v->efa ? chunks : 0,
                            .bytes = v->efa ? 0 : c->bytes});
}

static int verbs_signal(mk_proxy* p, const struct MkCmd* c) {
  vstate* v = p->tstate;
  vpeer* vp = &v->peers[c->peer];
  if (!vp->connected || vp->said_bye) return not_connected(p, c);
  if (!sq_room(v, c->peer)) return MK_AGAIN;
  vp->commands_sent++;
  p->peers[c->peer].signals++;
  return send_record(p, v, c->peer,
                     (vrec){.kind = REC_FLAG,
                            .flag_op = c->flag_op,
                            .id = 0,
                            .flag_id = c->flag_id,
                            .value = c->flag_value,
                            .chunks = 0});
}

static int verbs_flush(mk_proxy* p, const struct MkCmd* c) {
  vstate* v = p->tstate;
  vpeer* vp = &v->peers[c->peer];
  if (!vp->connected || vp->said_bye) return not_connected(p, c);
  if (!sq_room(v, c->peer) || vp->flush_head - vp->flush_tail == 256) return MK_AGAIN;
  uint32_t id = ++vp->next_flush_id;
  vp->flushes[vp->flush_head++ % 256] = (vflush_wait){id, c->flag_id, c->flag_value, c->flag_op, mk_now_ns()};
  p->peers[c->peer].flushes++;
  return send_record(p, v, c->peer, (vrec){.kind = REC_FLUSH, .id = id, .value = vp->commands_sent});
}

/* ---- receiving ---- */

static int answer_flushes(mk_proxy* p, vstate* v, int peer) {
  vpeer* vp = &v->peers[peer];
  while (vp->owed_tail != vp->owed_head &&
         (int32_t)(vp->commands_applied - vp->acks_owed[vp->owed_tail % 256].needed) >= 0) {
    if (!sq_room(v, peer)) return 0; /* answered on a later pass */
    if (send_record(p, v, peer, (vrec){.kind = REC_FLUSH_ACK, .id = vp->acks_owed[vp->owed_tail % 256].id})) return -1;
    vp->owed_tail++;
  }
  return 0;
}

static int applied(mk_proxy* p, vstate* v, int peer, int flag_op, uint32_t flag_id, uint32_t value) {
  if (mk_apply_flag(p, flag_op, flag_id, value, peer)) return -1;
  v->peers[peer].commands_applied++;
  return answer_flushes(p, v, peer);
}

/* SRD: a write completes when its record and all its chunks are in, in whichever order they came. */
static int srd_progress(mk_proxy* p, vstate* v, int peer, uint32_t id, const vrec* rec) {
  vsrd_write* w = &v->peers[peer].srd[id % 1024];
  if (!w->used)
    *w = (vsrd_write){.id = id, .used = 1};
  else if (w->id != id) {
    mk_fail(p, MKP_ERR_PEER, peer, MK_CMD_WRITE, "verbs: rank %d has more than 1024 writes half-delivered", peer);
    return -1;
  }
  if (rec) {
    w->have_record = 1;
    w->chunks_needed = rec->chunks;
    w->flag_op = rec->flag_op;
    w->flag_id = rec->flag_id;
    w->value = rec->value;
  } else {
    w->chunks_seen++;
  }
  if (!w->have_record || w->chunks_seen < w->chunks_needed) return 0;
  vsrd_write done = *w;
  w->used = 0;
  return applied(p, v, peer, done.flag_op, done.flag_id, done.value);
}

static int on_record(mk_proxy* p, vstate* v, const vrec* r) {
  int peer = r->rank;
  if (peer >= p->nranks || !v->peers[peer].connected) {
    mk_fail(p, MKP_ERR_PEER, peer, 0, "verbs: a record names rank %d, which is not a connected peer", peer);
    return -1;
  }
  vpeer* vp = &v->peers[peer];
  switch (r->kind) {
    case REC_FLAG:
      p->peers[peer].bytes_received += r->bytes;
      return r->chunks ? srd_progress(p, v, peer, r->id, r) : applied(p, v, peer, r->flag_op, r->flag_id, r->value);
    case REC_FLUSH:
      if (vp->owed_head - vp->owed_tail == 256) {
        mk_fail(p, MKP_ERR_PEER, peer, MK_CMD_FLUSH, "verbs: rank %d sent too many FLUSHes", peer);
        return -1;
      }
      vp->acks_owed[vp->owed_head % 256].id = r->id;
      vp->acks_owed[vp->owed_head++ % 256].needed = r->value;
      return answer_flushes(p, v, peer);
    case REC_BEAT:
      return 0;
    case REC_BYE: /* the last record on its queue pair; flushes of ours it never answered are lost */
      if (vp->flush_tail != vp->flush_head) {
        mk_fail(p, MKP_ERR_PEER, peer, MK_CMD_FLUSH,
                "verbs: rank %d stopped its proxy with a FLUSH of ours outstanding", peer);
        return -1;
      }
      vp->said_bye = 1;
      return 0;
    case REC_FLUSH_ACK:
      while (vp->flush_tail != vp->flush_head && (int32_t)(r->id - vp->flushes[vp->flush_tail % 256].id) >= 0) {
        vflush_wait* f = &vp->flushes[vp->flush_tail++ % 256];
        if (mk_apply_flag(p, f->flag_op, f->flag_id, f->value, p->rank)) return -1;
      }
      return 0;
    default:
      mk_fail(p, MKP_ERR_PEER, peer, 0, "verbs: rank %d sent a record of unknown kind %u", peer, r->kind);
      return -1;
  }
}

static int verbs_poll(mk_proxy* p, int timeout_us) {
  vstate* v = p->tstate;
  struct ibv_wc wc[32];
  int n = ibv_poll_cq(v->cq, 32, wc);
  if (n < 0) return vfail(p, -1, 0, "ibv_poll_cq");
  for (int i = 0; i < n; i++) {
    int peer = (int)(wc[i].wr_id >> 32);
    const int send = (wc[i].wr_id & MK_WR_SEND) != 0, kind = (int)(wc[i].wr_id & 3);
    if (wc[i].status != IBV_WC_SUCCESS) { /* opcode is undefined here; wr_id still names the peer (SRD receives: 0) */
      if (!v->peers[peer].said_bye || (send && kind == WR_DATA)) {
        const char* what = !send ? "a receive from" : kind == WR_BEAT ? "the liveness probe of" : "a send to";
        mk_fail(p, MKP_ERR_PEER, peer, 0, "verbs: %s rank %d failed: %s (rank %d unreachable or gone?)", what, peer,
                V.wc_status_str(wc[i].status), peer);
        return -1;
      }
      if (!send) continue; /* its queue pair is gone: nothing lost; a send of ours is counted done below */
    }
    if (send) { /* one of ours completed */
      v->peers[peer].in_flight--;
      v->srd_in_flight--;
      continue;
    }
    uint64_t slot = wc[i].wr_id & 0xffffffffu;
    int rc;
    if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
      uint32_t imm = ntohl(wc[i].imm_data);
      int from = (int)(imm >> (32 - MK_VERBS_IMM_RANK_BITS));
      if (from >= p->nranks || !v->peers[from].connected) {
        mk_fail(p, MKP_ERR_PEER, from, MK_CMD_WRITE, "verbs: write from unknown rank %d", from);
        return -1;
      }
      p->peers[from].bytes_received += wc[i].byte_len;
      rc = srd_progress(p, v, from, imm & MK_VERBS_IMM_ID_MASK, NULL);
    } else {
      vrec r = v->recv_bufs[slot];
      rc = wc[i].byte_len == sizeof r ? on_record(p, v, &r)
                                      : (mk_fail(p, MKP_ERR_PEER, peer, 0, "verbs: short record"), -1);
    }
    if (rc) return -1;
    if (!v->efa && v->peers[peer].said_bye) continue; /* goodbye was its last record */
    if (post_recv(v, v->efa ? v->srd_qp : v->peers[peer].qp, peer, slot)) return vfail(p, -1, 0, "ibv_post_recv");
  }
  uint64_t now = mk_now_ns();
  const int beat_now = now - v->last_beat > MK_VERBS_BEAT_NS;
  if (beat_now) v->last_beat = now;
  for (int r = 0; r < p->nranks; r++) {
    vpeer* vp = &v->peers[r];
    if (vp->flush_tail != vp->flush_head && now - vp->flushes[vp->flush_tail % 256].since > p->timeout_ns) {
      mk_fail(p, MKP_ERR_TIMEOUT, r, MK_CMD_FLUSH, "verbs: rank %d did not acknowledge a FLUSH within %.1f s", r,
              p->timeout_ns / 1e9);
      return -1;
    }
    if (answer_flushes(p, v, r)) return -1;
    if (beat_now && vp->connected && !vp->said_bye && !vp->in_flight && sq_room(v, r) && beat(p, v, r)) return -1;
  }
  if (!n && timeout_us > 0) usleep((useconds_t)timeout_us);
  return n;
}

/* Goodbye (a clean stop): a BYE record to every peer, then the sends of ours still in flight land,
 * bounded by the timeout; the peers then take this rank's queue pairs going away as no failure. */
static void verbs_close(mk_proxy* p) {
  vstate* v = p->tstate;
  const uint64_t start = mk_now_ns();
  for (int r = 0; r < p->nranks; r++) {
    vpeer* vp = &v->peers[r];
    if (!vp->connected || vp->said_bye) continue;
    while (!sq_room(v, r) && mk_now_ns() - start < p->timeout_ns)
      if (verbs_poll(p, 100) < 0) return;
    if (send_record(p, v, r, (vrec){.kind = REC_BYE})) return;
  }
  for (;;) {
    int in_flight = 0;
    for (int r = 0; r < p->nranks; r++) in_flight |= v->peers[r].in_flight != 0;
    if (!in_flight || mk_now_ns() - start > p->timeout_ns || verbs_poll(p, 100) < 0) return;
  }
}

static void verbs_destroy(mk_proxy* p) {
  vstate* v = p->tstate;
  if (!v) return;
  for (int r = 0; r < p->nranks; r++) {
    if (v->peers[r].ah) V.destroy_ah(v->peers[r].ah);
    if (v->peers[r].qp && v->peers[r].qp != v->srd_qp) V.destroy_qp(v->peers[r].qp);
  }
  if (v->srd_qp) V.destroy_qp(v->srd_qp);
  for (int i = 0; i < MK_MAX_REGIONS; i++)
    if (p->regions[i].used && p->regions[i].transport_data) V.dereg_mr(p->regions[i].transport_data);
  for (int i = 0; i < v->retired_count; i++) V.dereg_mr(v->retired[i]);
  if (v->recv_mr) V.dereg_mr(v->recv_mr);
  if (v->cq) V.destroy_cq(v->cq);
  if (v->pd) V.dealloc_pd(v->pd);
  if (v->ctx) V.close_device(v->ctx);
  free(v->recv_bufs);
  free(v->peers);
  free(v);
  p->tstate = NULL;
}

const mk_transport_ops mk_verbs_ops = {.name = "verbs",
                                       .register_region = verbs_register,
                                       .grow_region = verbs_grow,
                                       .write = verbs_write,
                                       .signal = verbs_signal,
                                       .flush = verbs_flush,
                                       .poll = verbs_poll,
                                       .close = verbs_close,
                                       .destroy = verbs_destroy};
#endif
