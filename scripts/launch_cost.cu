// The consumer's launch cost in the channel's two-process pattern, with no Python in the way.
//
// The C++ twin of scripts/launch_cost.py (issue 11, part 1): a producer and a
// consumer process (fork + socketpair; the parent never touches CUDA), the
// producer's VMM slot and sync page exported as POSIX fds and sent with
// SCM_RIGHTS, the consumer's stream waiting on the frame flag with
// cuStreamWaitValue32 and writing the release flag with cuStreamWriteValue32.
// Each row adds one ingredient; the consumer times each per-frame step with
// CLOCK_MONOTONIC. The launch kind rotates frame by frame (driver
// cuLaunchKernel / runtime <<<>>>), and a second cuLaunchKernel follows it.
//
// Build and run (nvcc 13 on the GPU machine):
//   nvcc -O2 -o /tmp/launch_cost scripts/launch_cost.cu -lcuda
//   /tmp/launch_cost              # all rows, 2000 frames each (a few seconds per row)
//   /tmp/launch_cost --quick      # 7 rows, 400 frames
//   /tmp/launch_cost --frames N --only A5,V-
//   /tmp/launch_cost --only A5,V-satisfied,V-pending,V-lag,V-norelwait,V-rel   # the second run
//   /tmp/launch_cost --only A5,V-lag3,V-norelwait,H-   # the third run: flags in host memory
//
// Rows H-*: the release flag (H-both: the frame flag too) lives in a page of host memory
// shared by both processes (mmap MAP_SHARED | MAP_ANONYMOUS in the parent before the fork,
// registered in each child with cuMemHostRegister(DEVICEMAP | PORTABLE) once its context
// exists; the streams use the device pointer from cuMemHostGetDevicePointer). The producer
// can then read the consumer's release on the host with an acquire load and enqueue its
// cuStreamWaitValue32 only when the release has not been written yet.
// Prints a markdown table: config | step | p50 us | p99 us | n.

#include <cuda.h>
#include <cuda_runtime.h>

#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

static const int WARMUP = 200;
static const int SPIN_US = 200;
static const size_t SLOT = 2u << 20;
static const size_t FRAME_FLAG = 0, RELEASE_FLAG = 256;
static const size_t HOST_PAGE = 4096;  // the shared host page of the H rows (same flag offsets)
static const int HOST_SPIN_US = 100;   // H-release-spin: the producer's host spin before a GPU wait
static const char* g_row = "?";
// The H rows' shared host page: mapped by the parent before the fork (no CUDA there), so both
// children inherit the same physical page; each registers it after creating its context.
static unsigned char* g_host = nullptr;

#define CK(x)                                                                              \
  do {                                                                                     \
    CUresult r_ = (x);                                                                     \
    if (r_ != CUDA_SUCCESS) {                                                              \
      const char* n_ = nullptr;                                                            \
      cuGetErrorName(r_, &n_);                                                             \
      fprintf(stderr, "[%s] %s: %s (%d) at line %d\n", g_row, #x, n_ ? n_ : "?", (int)r_, \
              __LINE__);                                                                   \
      _exit(3);                                                                            \
    }                                                                                      \
  } while (0)
#define CKR(x)                                                                             \
  do {                                                                                     \
    cudaError_t r_ = (x);                                                                  \
    if (r_ != cudaSuccess) {                                                               \
      fprintf(stderr, "[%s] %s: %s at line %d\n", g_row, #x, cudaGetErrorName(r_), __LINE__); \
      _exit(3);                                                                            \
    }                                                                                      \
  } while (0)
#define CKS(x)                                                                             \
  do {                                                                                     \
    if ((x) < 0) {                                                                         \
      fprintf(stderr, "[%s] %s: %s at line %d\n", g_row, #x, strerror(errno), __LINE__);  \
      _exit(4);                                                                            \
    }                                                                                      \
  } while (0)

__global__ void touch(unsigned char* p) { p[0] += 1; }

__global__ void spin(unsigned char* p, long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
  p[0] += 1;
}

enum Producer { P_NONE, P_IDLE, P_PINGPONG };
enum PKernel { K_NONE, K_TRIVIAL, K_SPIN };
enum Wait { W_NONE, W_IMPORTED, W_LOCAL };
// How the producer issues its release wait:
//  R_ASYNC  enqueue it before the kernel, the host goes on (the channel's acquire);
//  R_SYNC   enqueue it, then cuStreamSynchronize: the release has been seen before the kernel
//           is launched, so the producer's stream is never blocked on the consumer's flag
//           while the consumer works (its frame wait may still be pending);
//  R_AHEAD  (with psync) after the frame flag is written and the stream synchronised, enqueue
//           the wait for the release of the frame about to be sent (>= i): the consumer's
//           frame wait is already met, the producer's stream blocked on the consumer's
//           release flag during the consumer's launches.
enum RelMode { R_ASYNC, R_SYNC, R_AHEAD };
// Flags in host memory (rows H-*), bits of Cfg::host:
//  HF_RELEASE  the release flag is in the shared host page (the consumer's stream writes it
//              through the registered page's device pointer);
//  HF_FRAME    the frame flag too (the producer's stream writes it, the consumer's waits on it);
//  HF_CHECK    the producer reads the release flag on the host (acquire load) and enqueues its
//              cuStreamWaitValue32 only when the flag is short of the value needed;
//  HF_SPIN     (with HF_CHECK) the producer spins on the host up to HOST_SPIN_US before it
//              falls back to the GPU wait.
enum HostFlags { HF_RELEASE = 1, HF_FRAME = 2, HF_CHECK = 4, HF_SPIN = 8 };

struct Cfg {
  const char* name;
  const char* what;
  Producer producer;
  PKernel pkernel;
  Wait wait;
  bool imported_data;  // launch on the imported slot (else on a local cuMemAlloc buffer)
  bool release;        // consumer writes the release flag, producer's stream waits on it
  bool nonblocking;    // consumer stream: created CU_STREAM_NON_BLOCKING (else legacy NULL)
  bool psync;          // producer synchronises before the ping: the wait is already met
  unsigned waitflags;  // CU_STREAM_WAIT_VALUE_*
  unsigned sched;      // consumer context CU_CTX_SCHED_*
  // The producer's release wait (only with `release`): before frame i's kernel its stream
  // waits until the release flag >= i - lag (A5: lag 1, the frame just released; a ring of
  // N slots reusing the least recently released slot: lag N); lag 0: never waits.
  int lag = 1;
  RelMode relmode = R_ASYNC;
  unsigned host = 0;  // HostFlags
};

#define A5 P_PINGPONG, K_TRIVIAL, W_IMPORTED, true, true
static const Cfg CONFIGS[] = {
    {"A0", "consumer alone, launches back to back (legacy stream)", P_NONE, K_NONE, W_NONE, false,
     false, false, false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO},
    {"A1", "+ idle producer process with a context and the VMM allocations", P_IDLE, K_NONE,
     W_NONE, false, false, false, false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO},
    {"A2-pingpong", "+ blocking socket ping-pong, no producer GPU work", P_PINGPONG, K_NONE,
     W_NONE, false, false, false, false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO},
    {"A2", "+ producer kernel per frame", P_PINGPONG, K_TRIVIAL, W_NONE, false, false, false,
     false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO},
    {"A3", "+ consumer stream waits (GEQ) on the imported frame flag", P_PINGPONG, K_TRIVIAL,
     W_IMPORTED, false, false, false, false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO},
    {"A4", "+ consumer launches on the imported slot", P_PINGPONG, K_TRIVIAL, W_IMPORTED, true,
     false, false, false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO},
    {"A5", "+ release write; producer stream waits on it (the channel's pattern)", A5, false,
     false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO},
    {"V-localflag", "A5, the wait on a local flag", P_PINGPONG, K_TRIVIAL, W_LOCAL, true, true,
     false, false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO},
    {"V-eq", "A5 with CU_STREAM_WAIT_VALUE_EQ", A5, false, false, CU_STREAM_WAIT_VALUE_EQ,
     CU_CTX_SCHED_AUTO},
    {"V-flush", "A5 with GEQ | FLUSH", A5, false, false,
     CU_STREAM_WAIT_VALUE_GEQ | CU_STREAM_WAIT_VALUE_FLUSH, CU_CTX_SCHED_AUTO},
    {"V-spin", "A5, consumer CU_CTX_SCHED_SPIN", A5, false, false, CU_STREAM_WAIT_VALUE_GEQ,
     CU_CTX_SCHED_SPIN},
    {"V-blocksync", "A5, consumer CU_CTX_SCHED_BLOCKING_SYNC", A5, false, false,
     CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_BLOCKING_SYNC},
    {"V-nonblocking", "A5 on a non-blocking stream", A5, true, false, CU_STREAM_WAIT_VALUE_GEQ,
     CU_CTX_SCHED_AUTO},
    {"V-satisfied", "A5, producer syncs before the ping: wait already met", A5, false, true,
     CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO},
    {"V-pending", "A5, producer kernel spins 200 us: wait pending at the launch", P_PINGPONG,
     K_SPIN, W_IMPORTED, true, true, false, false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO},
    {"V-pending-nb", "V-pending on a non-blocking stream", P_PINGPONG, K_SPIN, W_IMPORTED, true,
     true, true, false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO},
    {"V-nb-alone", "A0 on a non-blocking stream", P_NONE, K_NONE, W_NONE, false, false, true,
     false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO},
    // Second run: is it the cycle of pending cross-process stream waits? Does a ring's lag fix it?
    {"V-lag2", "A5, producer waits release >= i-2 (a ring of 2 slots)", A5, false, false,
     CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO, 2, R_ASYNC},
    {"V-lag3", "A5, producer waits release >= i-3 (a ring of 3 slots)", A5, false, false,
     CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO, 3, R_ASYNC},
    {"V-lag7", "A5, producer waits release >= i-7 (a ring of 7 slots)", A5, false, false,
     CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO, 7, R_ASYNC},
    {"V-norelwait", "A5, consumer writes the release flag, producer never waits (unsafe)", A5,
     false, false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO, 0, R_ASYNC},
    {"V-relsync", "A5, producer host syncs on its release wait (>= i-1) before its kernel", A5,
     false, false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO, 1, R_SYNC},
    {"V-relpending", "V-satisfied, then producer stream waits release >= i before the ping", A5,
     false, true, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO, 0, R_AHEAD},
    // Third run: flags in shared host memory; the producer checks the release on the host.
    {"H-release",
     "A5, release flag in shared host memory; producer checks it on the host, GPU wait only if "
     "unmet",
     A5, false, false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO, 1, R_ASYNC,
     HF_RELEASE | HF_CHECK},
    {"H-both", "H-release, and the frame flag in shared host memory too", A5, false, false,
     CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO, 1, R_ASYNC, HF_RELEASE | HF_FRAME | HF_CHECK},
    {"H-release-always",
     "A5, release flag in shared host memory; producer always enqueues the GPU wait on it", A5,
     false, false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO, 1, R_ASYNC, HF_RELEASE},
    {"H-release-spin",
     "H-release; when unmet the producer spins on the host (<= 100 us) before a GPU wait", A5,
     false, false, CU_STREAM_WAIT_VALUE_GEQ, CU_CTX_SCHED_AUTO, 1, R_ASYNC,
     HF_RELEASE | HF_CHECK | HF_SPIN},
};
static const char* QUICK[] = {"A0",          "A2",        "A5",    "V-nonblocking",
                              "V-satisfied", "V-pending", "V-lag3"};

static inline long long now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void print_stat(const char* row, const char* step, std::vector<long long>& v) {
  if (v.empty()) return;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  double p50 = v[std::min(n - 1, (size_t)(0.5 * n))] / 1e3;
  double p99 = v[std::min(n - 1, (size_t)(0.99 * n))] / 1e3;
  printf("| %s | %s | %.1f | %.1f | %zu |\n", row, step, p50, p99, n);
}

// ---------------------------------------------------------------------- sockets and fds

static void send_fds(int sock, const void* buf, size_t len, const int* fds, int nfds) {
  struct msghdr msg = {};
  struct iovec iov = {(void*)buf, len};
  char ctrl[CMSG_SPACE(sizeof(int) * 4)] = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctrl;
  msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
  struct cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
  memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  CKS(sendmsg(sock, &msg, 0));
}

static int recv_fds(int sock, void* buf, size_t len, int* fds, int maxfds) {
  struct msghdr msg = {};
  struct iovec iov = {buf, len};
  char ctrl[CMSG_SPACE(sizeof(int) * 4)] = {};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctrl;
  msg.msg_controllen = sizeof(ctrl);
  ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  CKS(n);
  int got = 0;
  for (struct cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
      for (int i = 0; i < k && got < maxfds; i++) memcpy(&fds[got++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
    }
  }
  return got;
}

static uint64_t recv_u64(int sock) {
  uint64_t v = 0;
  ssize_t n = recv(sock, &v, sizeof(v), 0);
  CKS(n);
  if (n == 0) {
    fprintf(stderr, "[%s] peer closed the socket\n", g_row);
    _exit(5);
  }
  return v;
}

static void send_u64(int sock, uint64_t v) { CKS(send(sock, &v, sizeof(v), 0)); }

// The H rows' ping carries this bit when the producer enqueued a GPU release wait for the frame.
static const uint64_t PING_GPU_WAIT = 1ull << 32;

// ---------------------------------------------------------------------- CUDA helpers

static CUdevice init_ctx(unsigned sched) {
  CUdevice dev;
  CUcontext ctx;
  CK(cuInit(0));
  CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxSetFlags(dev, sched));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CKR(cudaSetDevice(0));  // the runtime adopts the same primary context
  return dev;
}

static CUdeviceptr map_handle(CUmemGenericAllocationHandle h, size_t size) {
  CUdeviceptr ptr;
  CK(cuMemAddressReserve(&ptr, size, 0, 0, 0));
  CK(cuMemMap(ptr, size, 0, h, 0));
  CUmemAccessDesc acc = {};
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = 0;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemSetAccess(ptr, size, &acc, 1));
  return ptr;
}

static CUdeviceptr create_exported(size_t size, int* fd) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 0;
  CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  if (gran == 0 || size % gran) {
    fprintf(stderr, "[%s] size %zu is not a multiple of the granularity %zu\n", g_row, size, gran);
    _exit(3);
  }
  CUmemGenericAllocationHandle h;
  CK(cuMemCreate(&h, size, &prop, 0));
  CUdeviceptr ptr = map_handle(h, size);
  CK(cuMemExportToShareableHandle((void*)fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  CK(cuMemsetD32(ptr, 0, size / 4));
  return ptr;
}

// Register the shared host page in this process (its context is current) and return the
// device pointer the stream memory operations use.
static CUdeviceptr register_host_page(const char* who) {
  if (!g_host) {
    fprintf(stderr, "[%s] no shared host page\n", g_row);
    _exit(3);
  }
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  int same_va = -1, mapped = -1;
  CK(cuDeviceGetAttribute(&same_va, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
                          dev));
  CK(cuDeviceGetAttribute(&mapped, CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, dev));
  CK(cuMemHostRegister(g_host, HOST_PAGE,
                       CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE));
  CUdeviceptr d = 0;
  CK(cuMemHostGetDevicePointer(&d, g_host, 0));
  fprintf(stderr,
          "[%s] %s: host page %p registered, device pointer 0x%llx (%s the host address); "
          "CAN_MAP_HOST_MEMORY %d, CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM %d\n",
          g_row, who, (void*)g_host, (unsigned long long)d,
          d == (CUdeviceptr)(uintptr_t)g_host ? "same as" : "not", mapped, same_va);
  return d;
}

static CUdeviceptr import_fd(int fd, size_t size) {
  CUmemGenericAllocationHandle h;
  CK(cuMemImportFromShareableHandle(&h, (void*)(uintptr_t)fd,
                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  return map_handle(h, size);
}

// ---------------------------------------------------------------------- producer

static void producer(const Cfg& c, int sock, int frames) {
  init_ctx(CU_CTX_SCHED_AUTO);
  int fds[2];
  CUdeviceptr data = create_exported(SLOT, &fds[0]);
  CUdeviceptr page = create_exported(SLOT, &fds[1]);
  uint64_t sizes[2] = {SLOT, SLOT};
  send_fds(sock, sizes, sizeof(sizes), fds, 2);
  if (c.producer == P_IDLE) {
    char b[16];
    while (recv(sock, b, sizeof(b), 0) > 0 && memcmp(b, "done", 4) != 0) {
    }
    _exit(0);
  }
  int clock_khz = 1980000;
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  cuDeviceGetAttribute(&clock_khz, CU_DEVICE_ATTRIBUTE_CLOCK_RATE, dev);
  long long cycles = (long long)SPIN_US * clock_khz / 1000;
  CUstream s = 0;  // legacy default stream, as the channel's producer in the benchmarks
  // Where the flags are: the exported page (A5), or the shared host page (H rows).
  CUdeviceptr hdev = c.host ? register_host_page("producer") : 0;
  CUdeviceptr fptr = (c.host & HF_FRAME) ? hdev + FRAME_FLAG : page + FRAME_FLAG;
  CUdeviceptr relptr = (c.host & HF_RELEASE) ? hdev + RELEASE_FLAG : page + RELEASE_FLAG;
  uint32_t* hrel = (c.host & HF_RELEASE) ? (uint32_t*)(g_host + RELEASE_FLAG) : nullptr;
  bool hcheck = (c.host & HF_RELEASE) && (c.host & HF_CHECK);
  long long spin_ns = (c.host & HF_SPIN) ? (long long)HOST_SPIN_US * 1000 : 0;
  size_t gpu_waits = 0, host_spun = 0, timed = 0;
  touch<<<1, 1, 0, s>>>((unsigned char*)data);
  spin<<<1, 1, 0, s>>>((unsigned char*)data, 1);
  CKR(cudaGetLastError());
  CK(cuCtxSynchronize());
  std::vector<long long> rt, kern, relw;
  bool relwait = c.release && c.lag > 0 && c.relmode != R_AHEAD;
  recv_u64(sock);  // READY
  for (int i = 1; i <= frames + WARMUP; i++) {
    long long t0 = now_ns();
    if (c.pkernel == K_SPIN) CK(cuStreamSynchronize(s));
    long long tr = now_ns();
    bool gpu_wait = false;
    if (relwait && i > c.lag) {
      cuuint32_t need = (cuuint32_t)(i - c.lag);
      gpu_wait = true;
      if (hcheck) {
        // Acquire load of the flag the consumer's stream wrote after its kernels (with the
        // write's memory barrier): seeing `need` means the consumer's work on the frame is
        // done, so the GPU wait can be skipped. Cyclic >=, as the GPU's GEQ.
        uint32_t v = __atomic_load_n(hrel, __ATOMIC_ACQUIRE);
        if ((int32_t)(v - need) < 0 && spin_ns > 0) {
          if (i > WARMUP) host_spun++;
          long long until = now_ns() + spin_ns;
          do {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#elif defined(__aarch64__)
            __asm__ __volatile__("yield");
#endif
            v = __atomic_load_n(hrel, __ATOMIC_ACQUIRE);
          } while ((int32_t)(v - need) < 0 && now_ns() < until);
        }
        gpu_wait = (int32_t)(v - need) < 0;
      }
      if (gpu_wait) CK(cuStreamWaitValue32(s, relptr, need, CU_STREAM_WAIT_VALUE_GEQ));
      if (c.relmode == R_SYNC) CK(cuStreamSynchronize(s));
    }
    long long t1 = now_ns();
    if (c.pkernel == K_TRIVIAL) touch<<<1, 1, 0, s>>>((unsigned char*)data);
    if (c.pkernel == K_SPIN) spin<<<1, 1, 0, s>>>((unsigned char*)data, cycles);
    long long t2 = now_ns();
    if (c.wait == W_IMPORTED) CK(cuStreamWriteValue32(s, fptr, (cuuint32_t)i, 0));
    if (c.psync) CK(cuStreamSynchronize(s));
    // R_AHEAD: the stream now waits for the release of the frame the consumer is about to get
    if (c.release && c.relmode == R_AHEAD)
      CK(cuStreamWaitValue32(s, relptr, (cuuint32_t)i, CU_STREAM_WAIT_VALUE_GEQ));
    send_u64(sock, (uint64_t)i | (hcheck && gpu_wait ? PING_GPU_WAIT : 0));
    recv_u64(sock);
    long long t3 = now_ns();
    if (i > WARMUP) {
      rt.push_back(t3 - t0);
      kern.push_back(t2 - t1);
      if (relwait) relw.push_back(t1 - tr);
      if (relwait && i > c.lag) {
        timed++;
        gpu_waits += gpu_wait;
      }
    }
  }
  CKR(cudaGetLastError());
  send_u64(sock, 0);
  char b[16];
  CKS(recv(sock, b, sizeof(b), 0));  // DONE
  CK(cuCtxSynchronize());
  print_stat(c.name, "P round trip", rt);
  print_stat(c.name, "P kernel launch", kern);
  print_stat(c.name, "P release wait (host)", relw);
  if (c.host & HF_RELEASE) {
    // counts, not times: the n column holds the count
    printf("| %s | P release waits enqueued on the GPU: %zu of %zu frames (count in n) | – | – | %zu |\n",
           c.name, gpu_waits, timed, gpu_waits);
    if (spin_ns > 0)
      printf("| %s | P release unmet at first look, host spin: %zu of %zu frames (count in n) | – | – | %zu |\n",
             c.name, host_spun, timed, host_spun);
  }
  fflush(stdout);
  _exit(0);
}

// ---------------------------------------------------------------------- consumer

static void consumer(const Cfg& c, int sock, int frames) {
  init_ctx(c.sched);
  CUdeviceptr data = 0, page = 0;
  if (sock >= 0) {
    uint64_t sizes[2];
    int fds[4];
    int n = recv_fds(sock, sizes, sizeof(sizes), fds, 4);
    if (n != 2) {
      fprintf(stderr, "[%s] SETUP carried %d fds\n", g_row, n);
      _exit(5);
    }
    if (c.imported_data) data = import_fd(fds[0], sizes[0]);
    if (c.wait == W_IMPORTED || c.release) page = import_fd(fds[1], sizes[1]);
    close(fds[0]);
    close(fds[1]);
  }
  CUstream s = 0;
  if (c.nonblocking) CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  CUdeviceptr local, local_flag;
  CK(cuMemAlloc(&local, 256));
  CK(cuMemAlloc(&local_flag, 256));
  CK(cuMemsetD32(local_flag, 0, 64));  // stays 0: a wait for 0 is always met
  cudaFunction_t rfn;
  CKR(cudaGetFuncBySymbol(&rfn, (const void*)touch));
  CUfunction fn = (CUfunction)rfn;
  CUdeviceptr target = c.imported_data ? data : local;
  void* params[1] = {&target};
  // load the kernel before the loop (a first launch loads the module and may block)
  CK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, params, nullptr));
  touch<<<1, 1, 0, (cudaStream_t)s>>>((unsigned char*)target);
  CKR(cudaGetLastError());
  CK(cuCtxSynchronize());
  CUdeviceptr hdev = c.host ? register_host_page("consumer") : 0;
  CUdeviceptr flag = c.wait != W_IMPORTED ? local_flag
                     : (c.host & HF_FRAME) ? hdev + FRAME_FLAG
                                           : page + FRAME_FLAG;
  CUdeviceptr relptr = (c.host & HF_RELEASE) ? hdev + RELEASE_FLAG : page + RELEASE_FLAG;
  std::vector<long long> wake, wait, l_drv, l_rt, launch2, rel, reply, active;
  // H rows with the host check: both launches (launch + launch2) split by whether the producer
  // enqueued a GPU release wait before this frame's kernel (a bit of the ping)
  std::vector<long long> l_gw, l_nogw;
  bool split = (c.host & HF_RELEASE) && (c.host & HF_CHECK);
  bool pingpong = c.producer == P_PINGPONG;
  if (sock >= 0) send_u64(sock, 0xAAAA);  // READY
  int total = frames + WARMUP;
  for (int n = 1;; n++) {
    long long tw = now_ns();
    uint64_t i;
    bool pgw = false;
    if (pingpong) {
      i = recv_u64(sock);
      if (i == 0) break;
      pgw = (i & PING_GPU_WAIT) != 0;
      i &= 0xffffffffu;
    } else {
      i = (uint64_t)n;
      if (n > total) break;
      if (n % 256 == 0) {
        CK(cuStreamSynchronize(s));  // keep the queue short (untimed)
        tw = now_ns();
      }
    }
    long long t0 = now_ns();
    if (c.wait != W_NONE)
      CK(cuStreamWaitValue32(s, flag, c.wait == W_IMPORTED ? (cuuint32_t)i : 0, c.waitflags));
    long long t1 = now_ns();
    int kind = (int)(i % 2);
    if (kind == 0)
      CK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, params, nullptr));
    else
      touch<<<1, 1, 0, (cudaStream_t)s>>>((unsigned char*)target);
    long long t2 = now_ns();
    CK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, params, nullptr));
    long long t3 = now_ns();
    if (c.release) CK(cuStreamWriteValue32(s, relptr, (cuuint32_t)i, 0));
    long long t4 = now_ns();
    if (pingpong) send_u64(sock, i);
    long long t5 = now_ns();
    if (n > WARMUP) {
      wake.push_back(t0 - tw);
      if (c.wait != W_NONE) wait.push_back(t1 - t0);
      (kind == 0 ? l_drv : l_rt).push_back(t2 - t1);
      if (split) (pgw ? l_gw : l_nogw).push_back(t3 - t1);
      launch2.push_back(t3 - t2);
      if (c.release) rel.push_back(t4 - t3);
      if (pingpong) reply.push_back(t5 - t4);
      active.push_back(t5 - t0);
    }
  }
  CKR(cudaGetLastError());
  CK(cuCtxSynchronize());
  print_stat(c.name, "wake", wake);
  print_stat(c.name, "wait", wait);
  print_stat(c.name, "launch[cuLaunchKernel]", l_drv);
  print_stat(c.name, "launch[runtime <<<>>>]", l_rt);
  print_stat(c.name, "launch2[cuLaunchKernel]", launch2);
  print_stat(c.name, "launch+launch2, frames the producer enqueued a GPU release wait", l_gw);
  print_stat(c.name, "launch+launch2, frames the producer skipped it", l_nogw);
  print_stat(c.name, "release", rel);
  print_stat(c.name, "reply", reply);
  print_stat(c.name, "active (wait..reply)", active);
  fflush(stdout);
  if (sock >= 0) CKS(send(sock, "done", 4, 0));
  _exit(0);
}

// ---------------------------------------------------------------------- orchestration

static bool wait_child(pid_t pid, double deadline_s, const char* who, const char* row) {
  for (;;) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return true;
      printf("| %s | **failed** | %s exited with status %d (signal %d); see stderr | | |\n", row,
             who, WIFEXITED(status) ? WEXITSTATUS(status) : -1,
             WIFSIGNALED(status) ? WTERMSIG(status) : 0);
      return false;
    }
    if (now_ns() / 1e9 > deadline_s) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      printf("| %s | **failed** | %s killed after the row's timeout | | |\n", row, who);
      return false;
    }
    usleep(10000);
  }
}

int main(int argc, char** argv) {
  int frames = 2000;
  bool quick = false;
  std::string only;
  double timeout = 45.0;
  for (int a = 1; a < argc; a++) {
    if (!strcmp(argv[a], "--frames") && a + 1 < argc) frames = atoi(argv[++a]);
    else if (!strcmp(argv[a], "--quick")) quick = true;
    else if (!strcmp(argv[a], "--only") && a + 1 < argc) only = argv[++a];
    else if (!strcmp(argv[a], "--timeout") && a + 1 < argc) timeout = atof(argv[++a]);
    else {
      fprintf(stderr, "usage: %s [--frames N] [--quick] [--only PREFIX,...] [--timeout S]\n", argv[0]);
      return 2;
    }
  }
  if (quick && frames > 400) frames = 400;
  printf("| config | step | p50 us | p99 us | n |\n| --- | --- | ---: | ---: | ---: |\n");
  fflush(stdout);
  int failed = 0;
  for (const Cfg& c : CONFIGS) {
    if (quick) {
      bool in = false;
      for (const char* q : QUICK) in = in || !strcmp(q, c.name);
      if (!in) continue;
    }
    if (!only.empty()) {
      bool in = false;
      size_t pos = 0;
      while (pos <= only.size()) {
        size_t end = only.find(',', pos);
        if (end == std::string::npos) end = only.size();
        std::string p = only.substr(pos, end - pos);
        if (!p.empty() && strncmp(c.name, p.c_str(), p.size()) == 0) in = true;
        pos = end + 1;
      }
      if (!in) continue;
    }
    g_row = c.name;
    int sv[2] = {-1, -1};
    if (c.producer != P_NONE && socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) < 0) {
      perror("socketpair");
      return 1;
    }
    if (c.host) {
      // before the fork, so both children share the page; no CUDA in the parent
      void* m = mmap(nullptr, HOST_PAGE, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) {
        perror("mmap");
        return 1;
      }
      memset(m, 0, HOST_PAGE);
      g_host = (unsigned char*)m;
    }
    fflush(stdout);
    pid_t pp = -1;
    if (c.producer != P_NONE) {
      pp = fork();
      if (pp == 0) {
        close(sv[1]);
        producer(c, sv[0], frames);
      }
    }
    pid_t cp = fork();
    if (cp == 0) {
      if (sv[0] >= 0) close(sv[0]);
      consumer(c, sv[1], frames);
    }
    if (sv[0] >= 0) {
      close(sv[0]);
      close(sv[1]);
    }
    double deadline = now_ns() / 1e9 + timeout + frames * 0.002;
    bool ok = wait_child(cp, deadline, "consumer", c.name);
    if (pp > 0) {
      if (!ok) kill(pp, SIGKILL);
      ok = wait_child(pp, deadline, "producer", c.name) && ok;
    }
    failed += !ok;
    if (g_host) {
      munmap(g_host, HOST_PAGE);
      g_host = nullptr;
    }
    fflush(stdout);
  }
  printf("\nRows:\n");
  for (const Cfg& c : CONFIGS) printf("- %s: %s\n", c.name, c.what);
  return failed ? 1 : 0;
}
