/* libcuda, loaded with dlopen on first use, so that the extension builds and imports on machines
 * without CUDA. Only the handful of driver calls the proxy (and mkernel/runtime/tma.py) needs, declared by hand. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "proxy.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void* CUcontext;
typedef void* CUstream;
typedef void* CUevent;
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED 712
#define CU_EVENT_DISABLE_TIMING 2
#define CU_STREAM_NON_BLOCKING 1
#define CU_MEMHOSTREGISTER_PORTABLE 1
#define CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD 1

static struct {
  void* lib;
  CUresult (*init)(unsigned);
  CUresult (*primary_ctx_retain)(CUcontext*, int);
  CUresult (*primary_ctx_release)(int);
  CUresult (*ctx_set_current)(CUcontext);
  CUresult (*ctx_push_current)(CUcontext);
  CUresult (*ctx_pop_current)(CUcontext*);
  CUresult (*stream_create)(CUstream*, unsigned);
  CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*stream_synchronize)(CUstream);
  CUresult (*stream_destroy)(CUstream);
  CUresult (*host_register)(void*, size_t, unsigned);
  CUresult (*host_unregister)(void*);
  CUresult (*get_handle)(void*, CUdeviceptr, size_t, int, unsigned long long);
  CUresult (*error_string)(CUresult, const char**);
  CUresult (*event_create)(CUevent*, unsigned);
  CUresult (*event_record)(CUevent, CUstream);
  CUresult (*event_query)(CUevent);
  CUresult (*event_destroy)(CUevent);
  CUresult (*tensor_map_encode_tiled)(void* tensorMap, int dataType, unsigned rank, void* globalAddress,
                                      const unsigned long long* globalDim, const unsigned long long* globalStrides,
                                      const unsigned* boxDim, const unsigned* elementStrides, int interleave,
                                      int swizzle, int l2Promotion, int oobFill);
  CUresult (*launch_kernel_ex)(const void* config, void* fn, void** params, void** extra);
} cu;

/* CUlaunchAttribute and CUlaunchConfig (cuda.h), declared by hand like the calls above. */
typedef struct {
  int id;
  char pad[4];
  union {
    char bytes[64];
    void* align;
    int value;
  } value;
} mk_cu_launch_attr;
typedef struct {
  unsigned grid[3], block[3], smem;
  CUstream stream;
  mk_cu_launch_attr* attrs;
  unsigned num_attrs;
} mk_cu_launch_config;
_Static_assert(sizeof(mk_cu_launch_attr) == 72, "CUlaunchAttribute is 72 bytes");
_Static_assert(sizeof(mk_cu_launch_config) == 56, "CUlaunchConfig is 56 bytes");
#define CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION 6

static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static char cu_error[MKP_MESSAGE_BYTES];

static void cu_load(void) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(cu_error, sizeof cu_error,
             "libcuda.so.1 could not be loaded (%s): CUDA regions and TMA tensor maps need the NVIDIA driver",
             dlerror());
    return;
  }
  /* Optional symbols may be missing; only the calls that need them then fail. */
  struct {
    void** fn;
    const char* name;
    int optional;
  } syms[] = {
      {(void**)&cu.init, "cuInit", 0},
      {(void**)&cu.primary_ctx_retain, "cuDevicePrimaryCtxRetain", 0},
      {(void**)&cu.primary_ctx_release, "cuDevicePrimaryCtxRelease_v2", 0},
      {(void**)&cu.ctx_set_current, "cuCtxSetCurrent", 0},
      {(void**)&cu.ctx_push_current, "cuCtxPushCurrent_v2", 0},
      {(void**)&cu.ctx_pop_current, "cuCtxPopCurrent_v2", 0},
      {(void**)&cu.stream_create, "cuStreamCreate", 0},
      {(void**)&cu.memcpy_async, "cuMemcpyAsync", 0},
      {(void**)&cu.stream_synchronize, "cuStreamSynchronize", 0},
      {(void**)&cu.stream_destroy, "cuStreamDestroy_v2", 0},
      {(void**)&cu.host_register, "cuMemHostRegister_v2", 0},
      {(void**)&cu.host_unregister, "cuMemHostUnregister", 0},
      {(void**)&cu.get_handle, "cuMemGetHandleForAddressRange", 1}, /* dma-buf export (CUDA >= 11.7) */
      {(void**)&cu.error_string, "cuGetErrorString", 0},
      {(void**)&cu.event_create, "cuEventCreate", 0},
      {(void**)&cu.event_record, "cuEventRecord", 0},
      {(void**)&cu.event_query, "cuEventQuery", 0},
      {(void**)&cu.event_destroy, "cuEventDestroy_v2", 0},
      {(void**)&cu.tensor_map_encode_tiled, "cuTensorMapEncodeTiled", 1}, /* TMA (CUDA >= 12.0) */
      {(void**)&cu.launch_kernel_ex, "cuLaunchKernelEx", 1}, /* CUDA >= 12.0 */
  };
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
    *syms[i].fn = dlsym(lib, syms[i].name);
    if (!*syms[i].fn && !syms[i].optional) {
      snprintf(cu_error, sizeof cu_error, "libcuda.so.1 lacks %s", syms[i].name);
      return;
    }
  }
  CUresult r = cu.init(0);
  if (r) {
    snprintf(cu_error, sizeof cu_error, "cuInit failed with CUresult %d", r);
    return;
  }
  cu.lib = lib;
}

int mk_cuda_load(char* why, int cap) {
  pthread_once(&cu_once, cu_load);
  if (cu.lib) return 0;
  snprintf(why, (size_t)cap, "%s", cu_error);
  return -1;
}

static void describe(CUresult r, const char* call, char* why, int cap) {
  const char* text = "unknown error";
  if (cu.error_string) cu.error_string(r, &text);
  snprintf(why, (size_t)cap, "%s: %s (CUresult %d)", call, text, r);
}

/* The proxy thread works in the device's primary context (the one CuPy uses), on its own
 * non-blocking streams (one per direction, so that its D2H and H2D copies overlap), so that its
 * copies never wait for a persistent kernel on the default stream. */
int mk_cuda_thread_init(mk_proxy* p) {
  char why[MKP_MESSAGE_BYTES];
  CUcontext ctx;
  CUresult r;
  if (mk_cuda_load(why, sizeof why)) goto fail;
  if ((r = cu.primary_ctx_retain(&ctx, p->cuda_device))) {
    describe(r, "cuDevicePrimaryCtxRetain", why, sizeof why);
    goto fail;
  }
  if ((r = cu.ctx_set_current(ctx))) {
    describe(r, "cuCtxSetCurrent", why, sizeof why);
    goto fail;
  }
  for (int i = 0; i < 2; i++)
    if ((r = cu.stream_create((CUstream*)&p->cuda_streams[i], CU_STREAM_NON_BLOCKING))) {
      describe(r, "cuStreamCreate", why, sizeof why);
      goto fail;
    }
  return 0;
fail:
  mk_fail(p, MKP_ERR_LOCAL, -1, 0, "proxy thread could not use CUDA device %d: %s", p->cuda_device, why);
  return -1;
}

/* The thread's last act: copies still in flight (after a failure) land before the segments they
 * touch are unregistered and unmapped; the streams go. */
void mk_cuda_thread_fini(mk_proxy* p) {
  for (int i = 0; i < 2; i++)
    if (p->cuda_streams[i]) {
      cu.stream_synchronize(p->cuda_streams[i]);
      cu.stream_destroy(p->cuda_streams[i]);
      p->cuda_streams[i] = NULL;
    }
  while (p->cuda_event_count) cu.event_destroy(p->cuda_events[--p->cuda_event_count]);
}

/* Unified addressing: the driver tells host from device pointers itself. */
int mk_cuda_copy(mk_proxy* p, void* dst, const void* src, size_t bytes, char* why, int cap) {
  CUresult r = cu.memcpy_async((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, bytes, p->cuda_streams[0]);
  if (!r) r = cu.stream_synchronize(p->cuda_streams[0]);
  if (r) describe(r, "cuMemcpyAsync", why, cap);
  return r ? -1 : 0;
}

int mk_cuda_copy_start(mk_proxy* p, int lane, void* dst, const void* src, size_t bytes, void** event, char* why,
                       int cap) {
  CUevent ev = NULL;
  CUresult r = cu.memcpy_async((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, bytes, p->cuda_streams[lane]);
  if (r) {
    describe(r, "cuMemcpyAsync", why, cap);
    return -1;
  }
  if (p->cuda_event_count) ev = p->cuda_events[--p->cuda_event_count];
  if ((!ev && (r = cu.event_create(&ev, CU_EVENT_DISABLE_TIMING))) ||
      (r = cu.event_record(ev, p->cuda_streams[lane]))) {
    if (ev) cu.event_destroy(ev);
    describe(r, "cuEventRecord", why, cap);
    return -1;
  }
  *event = ev;
  return 0;
}

int mk_cuda_event_poll(mk_proxy* p, void* event, char* why, int cap) {
  CUresult r = cu.event_query(event);
  if (r == CUDA_ERROR_NOT_READY) return 0;
  if (!r && p->cuda_event_count < MK_EVENT_POOL)
    p->cuda_events[p->cuda_event_count++] = event;
  else
    cu.event_destroy(event);
  if (r) {
    describe(r, "cuEventQuery", why, cap);
    return -1;
  }
  return 1;
}

/* 0 pinned; 1 not pinned (copies then go through pageable memory, slower but right); -1 the range
 * is registered already: the driver would copy to the pages registered there before, not to the
 * ones mapped there now, so the caller must fail. */
int mk_cuda_host_register(void* ptr, size_t bytes) {
  if (!cu.lib) return 1;
  CUresult r = cu.host_register(ptr, bytes, CU_MEMHOSTREGISTER_PORTABLE);
  return r == 0 ? 0 : r == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED ? -1 : 1;
}

/* Must precede munmap of a pinned range: the driver keeps a registration (and its pages) past the
 * unmap, so a later mapping at the same address would be copied to the old pages. Works from any
 * thread (the device's primary context is pushed for the call). */
void mk_cuda_host_unregister(int device, void* ptr) {
  CUcontext ctx, popped;
  if (!cu.lib || cu.primary_ctx_retain(&ctx, device)) return;
  if (!cu.ctx_push_current(ctx)) {
    cu.host_unregister(ptr);
    cu.ctx_pop_current(&popped);
  }
  cu.primary_ctx_release(device);
}

/* A dma-buf file descriptor for GPU memory (for ibv_reg_dmabuf_mr); -1 where unsupported. The range
 * must be page aligned: *offset says where ptr lies inside it. */
int mk_cuda_dmabuf_fd(void* ptr, size_t bytes, uint64_t* offset) {
  if (!cu.lib || !cu.get_handle) return -1;
  uintptr_t page = 65536, start = (uintptr_t)ptr & ~(page - 1);
  size_t len = ((uintptr_t)ptr + bytes - start + page - 1) & ~(page - 1);
  int fd = -1;
  if (cu.get_handle(&fd, (CUdeviceptr)start, len, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)) return -1;
  *offset = (uintptr_t)ptr - start;
  return fd;
}

/* A tiled TMA tensor map (mkernel/runtime/tma.py): cuTensorMapEncodeTiled's CUresult (0 success, why says
 * which error otherwise), or -1 with why saying so when libcuda or the entry point is missing. A
 * host-only computation: no context, no stream. */
int mk_cuda_tensor_map_encode_tiled(void* tmap, int dtype, unsigned rank, void* ptr, const unsigned long long* dims,
                                    const unsigned long long* strides, const unsigned* box, const unsigned* estrides,
                                    int interleave, int swizzle, int l2, int oob, char* why, int cap) {
  if (mk_cuda_load(why, cap)) return -1;
  if (!cu.tensor_map_encode_tiled) {
    snprintf(why, (size_t)cap, "libcuda.so.1 lacks cuTensorMapEncodeTiled (TMA needs a CUDA 12 driver)");
    return -1;
  }
  CUresult r =
      cu.tensor_map_encode_tiled(tmap, dtype, rank, ptr, dims, strides, box, estrides, interleave, swizzle, l2, oob);
  if (r) describe(r, "cuTensorMapEncodeTiled", why, cap);
  return r;
}

/* A launch of fn that may begin before the stream's previous kernel has ended, once every CTA of that
 * kernel has started or executed griddepcontrol.launch_dependents (programmatic stream serialization):
 * fn must reach that kernel's results through its own waits. CUresult as above. */
int mk_cuda_launch_overlapped(void* fn, const unsigned* grid, const unsigned* block, unsigned smem, void* stream,
                              void** params, char* why, int cap) {
  if (mk_cuda_load(why, cap)) return -1;
  if (!cu.launch_kernel_ex) {
    snprintf(why, (size_t)cap, "libcuda.so.1 lacks cuLaunchKernelEx (overlapped launches need a CUDA 12 driver)");
    return -1;
  }
  mk_cu_launch_attr attr;
  memset(&attr, 0, sizeof attr);
  attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr.value.value = 1;
  mk_cu_launch_config cfg = {{grid[0], grid[1], grid[2]}, {block[0], block[1], block[2]}, smem, stream, &attr, 1};
  CUresult r = cu.launch_kernel_ex(&cfg, fn, params, NULL);
  if (r) describe(r, "cuLaunchKernelEx", why, cap);
  return r;
}
