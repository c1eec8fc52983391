/* The proxy extension's public C API. cffi's cdef parses this very file (build_proxy.py), so it
 * holds declarations only: no #include, no #define, no expressions in array sizes. */

typedef struct mk_proxy mk_proxy;

enum { MKP_TRANSPORT_NULL = 0, MKP_TRANSPORT_TCP = 1, MKP_TRANSPORT_HOST = 2, MKP_TRANSPORT_VERBS = 3 };
enum { MKP_REGION_HOST = 0, MKP_REGION_CUDA = 1 };
/* Error codes match MK_ERR_* of signals.cuh where they overlap; LOCAL is a bad command or a failed copy. */
enum { MKP_ERR_NONE = 0, MKP_ERR_TIMEOUT = 1, MKP_ERR_PEER = 2, MKP_ERR_LOCAL = 4 };
enum { MKP_MESSAGE_BYTES = 256 };

typedef struct {
  int code; /* MKP_ERR_* */
  int peer; /* rank the failure concerns, -1: none */
  int op; /* MK_CMD_* being processed, 0: none */
  char message[256];
} mk_error_info;

typedef struct {
  unsigned long long bytes_sent, bytes_received, writes, signals, flushes;
} mk_peer_stats;

typedef struct {
  unsigned long long commands; /* consumed from the queue */
  unsigned long long frames_rejected; /* incoming frames that failed the region checks */
  unsigned long long verify_distinct, verify_duplicates, verify_corrupt; /* null transport, verify mode */
} mk_proxy_stats;

mk_proxy* mk_proxy_create(int rank, int nranks, int transport, double timeout_s);
void mk_proxy_destroy(mk_proxy* p);
/* Regions of kind CUDA are copied through this device's primary context (libcuda, loaded at run time). */
int mk_proxy_set_cuda_device(mk_proxy* p, int ordinal);
int mk_proxy_register(mk_proxy* p, int id, unsigned long long base, unsigned long long bytes, int kind);
int mk_proxy_set_flags(mk_proxy* p, int region_id);
/* A registered region grown in place (its base unchanged), also while running. Verbs registers the grown span
 * with the NIC; its peers then need its new key (mk_verbs_region_key, mk_verbs_set_remote_region). */
int mk_proxy_grow_region(mk_proxy* p, int id, unsigned long long bytes);
int mk_proxy_attach_queue(mk_proxy* p, unsigned long long header, unsigned long long slots);
int mk_proxy_start(mk_proxy* p);
int mk_proxy_stop(mk_proxy* p);
int mk_proxy_error(mk_proxy* p, mk_error_info* out);
void mk_proxy_get_stats(mk_proxy* p, mk_proxy_stats* out, mk_peer_stats* per_peer);
int mk_proxy_next_log(mk_proxy* p, char* buf, int cap);
const char* mk_proxy_last_setup_error(mk_proxy* p);

/* Null transport: verify mode checks the stress test's commands (ids 0..expected-1, once each). */
int mk_null_verify(mk_proxy* p, unsigned long long expected);

/* CPU producers: push one 32-byte command (seq is filled in); 0, or -1 after a timeout or a proxy error. */
int mk_queue_push(unsigned long long header, unsigned long long slots, const void* command, double timeout_s);
/* The queue tests' producers: `threads` pthreads enqueue `per_thread` verify commands each. */
int mk_test_produce(unsigned long long header, unsigned long long slots, int threads, unsigned long long per_thread,
                    double timeout_s);

/* TCP: connections are authenticated by Python, then handed over. Shuffle is test-only. */
int mk_tcp_add_connection(mk_proxy* p, int peer, int fd);
int mk_tcp_set_shuffle(mk_proxy* p, unsigned int seed);
int mk_tcp_frame_bytes(void);
int mk_tcp_check_frame(mk_proxy* p, int peer, const unsigned char* frame, int len, char* why, int why_cap);

/* Host memory: one segment per direction, created by the sender, opened by the receiver. */
unsigned long long mk_host_segment_bytes(void);
unsigned long long mk_host_segment_create(const char* name, char* why, int why_cap);
unsigned long long mk_host_segment_open(const char* name, char* why, int why_cap);
int mk_host_segment_unlink(const char* name);
int mk_host_segment_unmap(unsigned long long segment); /* one that no proxy took (mk_host_add_peer) */
int mk_host_add_peer(mk_proxy* p, int peer, unsigned long long send_segment, unsigned long long recv_segment);
int mk_host_set_run(mk_proxy* p, int chunks); /* chunks per copy, 1..16, before start */

/* Verbs: probe, and the connection blobs that the Python side exchanges over MPI. */
int mk_verbs_available(void); /* 1 when compiled in (the rdma-core headers were present at build time) */
int mk_verbs_probe(char* report, int cap); /* active ports, 0 none, -1 no libibverbs; report says what was seen */
int mk_verbs_open(mk_proxy* p, const char* device, int port, int gid_index);
/* The opened device, port, link, GID (index, address, type) and MTU, for the log; -1 before open. */
int mk_verbs_describe(mk_proxy* p, char* out, int cap);
int mk_verbs_blob_bytes(void);
int mk_verbs_local_blob(mk_proxy* p, int peer, unsigned char* out, int cap);
int mk_verbs_connect(mk_proxy* p, int peer, const unsigned char* blob, int len);
/* A region's registration as peers address it (its base, bytes and remote key); -1 where it has none. */
int mk_verbs_region_key(mk_proxy* p, int id, unsigned long long* addr, unsigned long long* bytes, unsigned int* rkey);
/* Rank peer's region id grew in place: its span and key from then on (also while running). */
int mk_verbs_set_remote_region(mk_proxy* p, int peer, int id, unsigned long long addr, unsigned long long bytes,
                               unsigned int rkey);

/* TMA (mkernel/runtime/tma.py): cuTensorMapEncodeTiled through the libcuda this extension loads. tmap is the
 * 128-byte CUtensorMap; dims, box and estrides hold rank entries, strides rank-1 (bytes). Returns the
 * CUresult (0 success), or -1 when libcuda or the entry point is missing; why says which. */
int mk_cuda_tensor_map_encode_tiled(void* tmap, int dtype, unsigned rank, void* ptr, const unsigned long long* dims,
                                    const unsigned long long* strides, const unsigned* box, const unsigned* estrides,
                                    int interleave, int swizzle, int l2, int oob, char* why, int cap);
/* A kernel launch allowed to begin before the stream's previous kernel ends (programmatic stream
 * serialization; mkernel/runtime/launch.py). Returns the CUresult, or -1 as above. */
int mk_cuda_launch_overlapped(void* fn, const unsigned* grid, const unsigned* block, unsigned smem, void* stream,
                              void** params, char* why, int cap);
