/*
 * cupy_ipcpool.c -- the C consumer library of cupy_ipcpool (see cupy_ipcpool.h).
 *
 * Every layout and limit comes from cupy_ipcpool_wire.h, generated from the
 * Python package (c/gen_wire.py); fields are read and written by their
 * generated offset and width.  The CUDA driver is loaded at run time
 * (dlopen("libcuda.so.1") + cuGetProcAddress): no CUDA header is needed, the
 * few types used are declared here.
 *
 * Sections: errors; little-endian fields; the driver; descriptors and array
 * handles; fetching fds (pidfd_getfd, the fd server); pools; the channel's
 * protocol (handshake, frames, hang-ups, releases); the GPU subscription.
 */
#define _GNU_SOURCE
#include "cupy_ipcpool.h"
#include "cupy_ipcpool_wire.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* ---- compile-time checks: the public header and this file against the wire ---- */

#define CIP_ASSERT(cond, name) typedef char cip_assert_##name[(cond) ? 1 : -1]
#define CIP_LAST_FIELD(NAME, FIELD)                                                      \
    CIP_ASSERT(CIP_WIRE_##NAME##_##FIELD##_OFF + CIP_WIRE_##NAME##_##FIELD##_WIDTH ==     \
                   CIP_WIRE_##NAME##_SIZE,                                               \
               NAME##_ends_with_##FIELD)

CIP_ASSERT(CIP_MAX_NDIM == CIP_WIRE_MAX_NDIM, max_ndim);
CIP_ASSERT(CIP_MAX_ARRAYS == CIP_WIRE_MAX_ARRAYS, max_arrays);
CIP_ASSERT(CIP_MAX_METADATA == CIP_WIRE_MAX_METADATA, max_metadata);
CIP_ASSERT(CIP_COMPLEX128 + 1 == CIP_WIRE_DTYPE_COUNT, dtype_count);
CIP_ASSERT(CIP_MODE_BLOCK == CIP_WIRE_MODE_BLOCK && CIP_MODE_LATEST == CIP_WIRE_MODE_LATEST,
           modes);
CIP_ASSERT(CIP_WIRE_POOL_ID_NBYTES == 16 && CIP_WIRE_DEVICE_UUID_NBYTES == 16, id_sizes);
CIP_ASSERT(CIP_WIRE_DESC_POOL_ID_WIDTH == CIP_WIRE_POOL_ID_NBYTES, pool_id_field);
CIP_ASSERT(CIP_WIRE_DESC_DEVICE_UUID_WIDTH == CIP_WIRE_DEVICE_UUID_NBYTES, uuid_field);
CIP_ASSERT(CIP_WIRE_MAX_SOCKET_PATH < sizeof(((cip_descriptor *)0)->socket_path), path_field);
CIP_ASSERT(CIP_WIRE_MAX_SOCKET_PATH < sizeof(((struct sockaddr_un *)0)->sun_path), path_nul);
CIP_ASSERT(CIP_WIRE_DESC_MAGIC_WIDTH == 4 && sizeof(CIP_WIRE_DESC_MAGIC) == 5, desc_magic);
CIP_ASSERT(CIP_WIRE_MAX_CHANNEL_SLOTS + 1 <= CIP_WIRE_MAX_FDS, channel_fds);
CIP_ASSERT(CIP_WIRE_SYNC_FLAG_BYTES == 4, flag_words);
CIP_ASSERT(CIP_WIRE_POOL_ID_NBYTES <= CIP_WIRE_FDSERVER_MAX_TOKEN_LEN, token_fits);
CIP_ASSERT(CIP_WIRE_MAX_FRAME_SIZE == CIP_WIRE_FRAME_SIZE + CIP_WIRE_MAX_FRAME_PAYLOAD, frame_max);
CIP_LAST_FIELD(HEADER, TYPE);
CIP_LAST_FIELD(HELLO, LEN);
CIP_LAST_FIELD(WELCOME, LEN);
CIP_LAST_FIELD(REFUSE, LEN);
CIP_LAST_FIELD(FRAME, LEN);
CIP_LAST_FIELD(RELEASE, SLOT);
CIP_LAST_FIELD(WELCOME_HEAD, SYNC_NBYTES);
CIP_LAST_FIELD(FRAME_HEAD, METADATA_LEN);
CIP_LAST_FIELD(DESC, EXPORTER_PID_NAMESPACE);
CIP_LAST_FIELD(HANDLE, DTYPE);
/* every message starts with the header */
CIP_ASSERT(CIP_WIRE_FRAME_TYPE_OFF == CIP_WIRE_HEADER_TYPE_OFF &&
               CIP_WIRE_WELCOME_TYPE_OFF == CIP_WIRE_HEADER_TYPE_OFF,
           header_first);
#if defined(SYS_pidfd_getfd)
CIP_ASSERT(SYS_pidfd_getfd == CIP_WIRE_SYS_PIDFD_GETFD_X86_64, pidfd_getfd_nr);
#define CIP_SYS_PIDFD_GETFD SYS_pidfd_getfd
#else
#define CIP_SYS_PIDFD_GETFD CIP_WIRE_SYS_PIDFD_GETFD_X86_64
#endif
#if defined(SYS_pidfd_open)
#define CIP_SYS_PIDFD_OPEN SYS_pidfd_open
#else
#define CIP_SYS_PIDFD_OPEN 434
#endif

#define CIP_I32_MAX 0x7FFFFFFFull
#define CIP_I64_MAX 0x7FFFFFFFFFFFFFFFull
/* The waits after a death and at close are the Python package's, generated into
 * cupy_ipcpool_wire.h (channel/_settle.py, _vmm.py say why each is what it is):
 * CIP_WIRE_CLOSE_WAIT_MS, how long gpu_quiesce waits for our flag operations at
 * close; CIP_WIRE_DEATH_WAIT_MS, after a hang-up without BYE while a stream of ours
 * waits on a frame flag, how long to wait for the producer's pidfd (its sockets
 * close while it exits, before its pidfd says so: a CUDA process's exit takes
 * seconds while the driver tears down its context, and the stream must not be left
 * waiting on a flag nobody will write); CIP_WIRE_UNMAP_WAIT_MS, below. */

/* ---- errors ------------------------------------------------------------------------ */

static __thread char tls_error[768];

static cip_status fail(cip_status status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static cip_status
fail(cip_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_error, sizeof tls_error, fmt, ap);
    va_end(ap);
    return status;
}

const char *
cip_last_error(void)
{
    return tls_error;
}

const char *
cip_status_name(cip_status status)
{
    switch (status) {
    case CIP_OK: return "CIP_OK";
    case CIP_ERR_INVALID_ARGUMENT: return "CIP_ERR_INVALID_ARGUMENT";
    case CIP_ERR_TIMEOUT: return "CIP_ERR_TIMEOUT";
    case CIP_ERR_END_OF_STREAM: return "CIP_ERR_END_OF_STREAM";
    case CIP_ERR_PUBLISHER_GONE: return "CIP_ERR_PUBLISHER_GONE";
    case CIP_ERR_EVICTED: return "CIP_ERR_EVICTED";
    case CIP_ERR_REFUSED: return "CIP_ERR_REFUSED";
    case CIP_ERR_PROTOCOL: return "CIP_ERR_PROTOCOL";
    case CIP_ERR_TRANSPORT: return "CIP_ERR_TRANSPORT";
    case CIP_ERR_DESCRIPTOR: return "CIP_ERR_DESCRIPTOR";
    case CIP_ERR_STALE: return "CIP_ERR_STALE";
    case CIP_ERR_NOT_HELD: return "CIP_ERR_NOT_HELD";
    case CIP_ERR_NO_DRIVER: return "CIP_ERR_NO_DRIVER";
    case CIP_ERR_CUDA: return "CIP_ERR_CUDA";
    case CIP_ERR_DEVICE: return "CIP_ERR_DEVICE";
    case CIP_ERR_NO_MEMORY: return "CIP_ERR_NO_MEMORY";
    case CIP_ERR_RAW_SESSION: return "CIP_ERR_RAW_SESSION";
    }
    return "CIP_ERR_UNKNOWN";
}

const char *
cip_strerror(cip_status status)
{
    switch (status) {
    case CIP_OK: return "success";
    case CIP_ERR_INVALID_ARGUMENT: return "invalid argument";
    case CIP_ERR_TIMEOUT: return "timed out";
    case CIP_ERR_END_OF_STREAM: return "the publisher closed the stream";
    case CIP_ERR_PUBLISHER_GONE: return "the publisher is gone (it died or hung up without BYE)";
    case CIP_ERR_EVICTED: return "the publisher evicted this subscriber";
    case CIP_ERR_REFUSED: return "refused";
    case CIP_ERR_PROTOCOL: return "protocol error: malformed or unexpected message";
    case CIP_ERR_TRANSPORT: return "socket or file descriptor transport failed";
    case CIP_ERR_DESCRIPTOR: return "malformed pool descriptor or array handle";
    case CIP_ERR_STALE: return "array handle of a recycled slot";
    case CIP_ERR_NOT_HELD: return "frame not held";
    case CIP_ERR_NO_DRIVER: return "no CUDA driver or device";
    case CIP_ERR_CUDA: return "CUDA driver call failed";
    case CIP_ERR_DEVICE: return "unsupported device";
    case CIP_ERR_NO_MEMORY: return "out of memory";
    case CIP_ERR_RAW_SESSION: return "not available on a raw session";
    }
    return "unknown status";
}

/* ---- little-endian fields by generated offset and width ------------------------------ */

static uint64_t
rd(const uint8_t *p, size_t width)
{
    uint64_t v = 0;
    for (size_t i = width; i-- > 0;)
        v = (v << 8) | p[i];
    return v;
}

static void
wr(uint8_t *p, size_t width, uint64_t v)
{
    for (size_t i = 0; i < width; i++) {
        p[i] = (uint8_t)(v & 0xFF);
        v >>= 8;
    }
}

#define RD(base, NAME) rd((const uint8_t *)(base) + CIP_WIRE_##NAME##_OFF, CIP_WIRE_##NAME##_WIDTH)
#define WR(base, NAME, v) wr((uint8_t *)(base) + CIP_WIRE_##NAME##_OFF, CIP_WIRE_##NAME##_WIDTH, (v))

static const size_t dtype_itemsizes[] = CIP_WIRE_DTYPE_ITEMSIZES;
static const char *const dtype_names[] = CIP_WIRE_DTYPE_NAMES;
CIP_ASSERT(sizeof dtype_itemsizes / sizeof dtype_itemsizes[0] == CIP_WIRE_DTYPE_COUNT, dtypes);

const char *
cip_dtype_name(int dtype)
{
    return dtype >= 0 && dtype < (int)CIP_WIRE_DTYPE_COUNT ? dtype_names[dtype] : NULL;
}

size_t
cip_dtype_itemsize(int dtype)
{
    return dtype >= 0 && dtype < (int)CIP_WIRE_DTYPE_COUNT ? dtype_itemsizes[dtype] : 0;
}

static long long
now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Milliseconds left until `deadline` (-1: none) for poll(2). */
static int
left_ms(long long deadline)
{
    if (deadline < 0)
        return -1;
    long long left = deadline - now_ms();
    if (left <= 0)
        return 0;
    return left > INT_MAX ? INT_MAX : (int)left;
}

static long long
deadline_of(int timeout_ms)
{
    return timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
}

static void
sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

static void
close_fds(int *fds, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (fds[i] >= 0)
            close(fds[i]);
        fds[i] = -1;
    }
}

/* ---- the driver ---------------------------------------------------------------------- */

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUevent;
typedef uint64_t CUdeviceptr;
typedef struct {
    unsigned char bytes[16];
} cip_cuuuid;
typedef struct {
    int type; /* CUmemLocationType: CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int id;
} cip_mem_location;
typedef struct {
    cip_mem_location location;
    int flags; /* CUmemAccess_flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} cip_access_desc;

#define CIP_CUDA_SUCCESS 0
#define CIP_CUDA_ERROR_NOT_READY 600
#define CIP_CU_MEM_LOCATION_TYPE_DEVICE 1
#define CIP_CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3
#define CIP_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1
#define CIP_CU_MEMHOSTREGISTER_PORTABLE 1
#define CIP_CU_MEMHOSTREGISTER_DEVICEMAP 2
#define CIP_CU_STREAM_WAIT_VALUE_GEQ 0
#define CIP_CU_STREAM_WRITE_VALUE_DEFAULT 0
#define CIP_CU_EVENT_DISABLE_TIMING 2
#define CIP_CUDA_API_VERSION 12000

typedef CUresult (*getproc_v1_t)(const char *, void **, int, unsigned long long);
typedef CUresult (*getproc_v2_t)(const char *, void **, int, unsigned long long, int *);

static struct {
    pthread_once_t once;
    cip_status status;
    char error[512];
    void *lib;
    getproc_v1_t getproc_v1;
    getproc_v2_t getproc_v2;
    int version;
    CUresult (*GetErrorName)(CUresult, const char **);
    CUresult (*GetErrorString)(CUresult, const char **);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DeviceGetUuid)(cip_cuuuid *, CUdevice);
    CUresult (*DeviceCanAccessPeer)(int *, CUdevice, CUdevice);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*CtxPushCurrent)(CUcontext);
    CUresult (*CtxPopCurrent)(CUcontext *);
    CUresult (*CtxSynchronize)(void);
    CUresult (*MemImportFromShareableHandle)(uint64_t *, void *, int);
    CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*MemMap)(CUdeviceptr, size_t, size_t, uint64_t, unsigned long long);
    CUresult (*MemSetAccess)(CUdeviceptr, size_t, const cip_access_desc *, size_t);
    CUresult (*MemUnmap)(CUdeviceptr, size_t);
    CUresult (*MemAddressFree)(CUdeviceptr, size_t);
    CUresult (*MemRelease)(uint64_t);
    CUresult (*MemHostRegister)(void *, size_t, unsigned int);
    CUresult (*MemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned int);
    CUresult (*MemHostUnregister)(void *);
    CUresult (*StreamWaitValue32)(void *, CUdeviceptr, uint32_t, unsigned int);
    CUresult (*StreamWriteValue32)(void *, CUdeviceptr, uint32_t, unsigned int);
    CUresult (*EventCreate)(CUevent *, unsigned int);
    CUresult (*EventRecord)(CUevent, void *);
    CUresult (*EventQuery)(CUevent);
    CUresult (*EventDestroy)(CUevent);
} drv = {PTHREAD_ONCE_INIT};

static void *
proc(const char *name)
{
    void *pfn = NULL;
    CUresult rc;
    if (drv.getproc_v2 != NULL) {
        int found = 0;
        rc = drv.getproc_v2(name, &pfn, drv.version, 0, &found);
    } else if (drv.getproc_v1 != NULL) {
        rc = drv.getproc_v1(name, &pfn, drv.version, 0);
    } else {
        return dlsym(drv.lib, name);
    }
    return rc == CIP_CUDA_SUCCESS ? pfn : NULL;
}

static void
load_driver(void)
{
    drv.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (drv.lib == NULL) {
        const char *why = dlerror();
        drv.status = CIP_ERR_NO_DRIVER;
        snprintf(drv.error, sizeof drv.error,
                 "the CUDA driver (libcuda.so.1) cannot be loaded: %s; a GPU and its driver are "
                 "needed for this call",
                 why ? why : "not found");
        return;
    }
    /* POSIX's way to turn dlsym's answer into a function pointer */
    CUresult (*init)(unsigned int);
    CUresult (*version)(int *);
    *(void **)&init = dlsym(drv.lib, "cuInit");
    *(void **)&version = dlsym(drv.lib, "cuDriverGetVersion");
    *(void **)&drv.getproc_v2 = dlsym(drv.lib, "cuGetProcAddress_v2");
    if (drv.getproc_v2 == NULL)
        *(void **)&drv.getproc_v1 = dlsym(drv.lib, "cuGetProcAddress");
    int v = 0;
    if (init == NULL || version == NULL || version(&v) != CIP_CUDA_SUCCESS ||
        (drv.getproc_v1 == NULL && drv.getproc_v2 == NULL)) {
        drv.status = CIP_ERR_NO_DRIVER;
        snprintf(drv.error, sizeof drv.error,
                 "libcuda.so.1 lacks cuInit, cuDriverGetVersion or cuGetProcAddress: a CUDA 11.3 "
                 "or newer driver is needed");
        return;
    }
    drv.version = v < CIP_CUDA_API_VERSION ? v : CIP_CUDA_API_VERSION;
    CUresult rc = init(0);
    if (rc != CIP_CUDA_SUCCESS) {
        drv.status = CIP_ERR_NO_DRIVER;
        snprintf(drv.error, sizeof drv.error,
                 "cuInit failed with CUDA error %d (no usable GPU, or the driver is not loaded)",
                 rc);
        return;
    }
#define LOAD(field, name)                                                                  \
    do {                                                                                   \
        *(void **)&drv.field = proc(name);                                                 \
        if (drv.field == NULL) {                                                           \
            drv.status = CIP_ERR_NO_DRIVER;                                                \
            snprintf(drv.error, sizeof drv.error,                                          \
                     "the CUDA driver has no %s (driver version %d); a newer driver is "   \
                     "needed",                                                             \
                     name, v);                                                             \
            return;                                                                        \
        }                                                                                  \
    } while (0)
    LOAD(GetErrorName, "cuGetErrorName");
    LOAD(GetErrorString, "cuGetErrorString");
    LOAD(DeviceGetCount, "cuDeviceGetCount");
    LOAD(DeviceGet, "cuDeviceGet");
    LOAD(DeviceGetUuid, "cuDeviceGetUuid");
    LOAD(DeviceCanAccessPeer, "cuDeviceCanAccessPeer");
    LOAD(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    LOAD(CtxPushCurrent, "cuCtxPushCurrent");
    LOAD(CtxPopCurrent, "cuCtxPopCurrent");
    LOAD(CtxSynchronize, "cuCtxSynchronize");
    LOAD(MemImportFromShareableHandle, "cuMemImportFromShareableHandle");
    LOAD(MemAddressReserve, "cuMemAddressReserve");
    LOAD(MemMap, "cuMemMap");
    LOAD(MemSetAccess, "cuMemSetAccess");
    LOAD(MemUnmap, "cuMemUnmap");
    LOAD(MemAddressFree, "cuMemAddressFree");
    LOAD(MemRelease, "cuMemRelease");
    LOAD(MemHostRegister, "cuMemHostRegister");
    LOAD(MemHostGetDevicePointer, "cuMemHostGetDevicePointer");
    LOAD(MemHostUnregister, "cuMemHostUnregister");
    LOAD(StreamWaitValue32, "cuStreamWaitValue32");
    LOAD(StreamWriteValue32, "cuStreamWriteValue32");
    LOAD(EventCreate, "cuEventCreate");
    LOAD(EventRecord, "cuEventRecord");
    LOAD(EventQuery, "cuEventQuery");
    LOAD(EventDestroy, "cuEventDestroy");
#undef LOAD
    drv.status = CIP_OK;
}

static cip_status
driver(void)
{
    pthread_once(&drv.once, load_driver);
    if (drv.status != CIP_OK)
        return fail(drv.status, "%s", drv.error);
    return CIP_OK;
}

void *
cip_cuda_symbol(const char *name)
{
    if (name == NULL || driver() != CIP_OK)
        return NULL;
    return proc(name);
}

static cip_status
cuda_fail(const char *call, CUresult rc)
{
    const char *name = NULL, *text = NULL;
    if (drv.GetErrorName == NULL || drv.GetErrorName(rc, &name) != CIP_CUDA_SUCCESS)
        name = NULL;
    if (drv.GetErrorString == NULL || drv.GetErrorString(rc, &text) != CIP_CUDA_SUCCESS)
        text = NULL;
    if (name != NULL)
        return fail(CIP_ERR_CUDA, "%s: %s (%s)", call, name, text ? text : "no description");
    return fail(CIP_ERR_CUDA, "%s: CUDA error %d", call, rc);
}

#define CIP_MAX_DEVICES 64
static CUcontext primary[CIP_MAX_DEVICES];
static pthread_mutex_t primary_lock = PTHREAD_MUTEX_INITIALIZER;

/* Make the device's primary context (the CUDA runtime's) current; pop with ctx_pop. */
static cip_status
ctx_push(int device)
{
    if (device < 0 || device >= CIP_MAX_DEVICES)
        return fail(CIP_ERR_INVALID_ARGUMENT, "device %d out of range", device);
    pthread_mutex_lock(&primary_lock);
    CUresult rc = CIP_CUDA_SUCCESS;
    if (primary[device] == NULL) {
        CUdevice dev;
        rc = drv.DeviceGet(&dev, device);
        if (rc == CIP_CUDA_SUCCESS)
            rc = drv.DevicePrimaryCtxRetain(&primary[device], dev); /* kept for the process */
    }
    CUcontext ctx = primary[device];
    pthread_mutex_unlock(&primary_lock);
    if (rc != CIP_CUDA_SUCCESS)
        return cuda_fail("cuDevicePrimaryCtxRetain", rc);
    rc = drv.CtxPushCurrent(ctx);
    if (rc != CIP_CUDA_SUCCESS)
        return cuda_fail("cuCtxPushCurrent", rc);
    return CIP_OK;
}

cip_status
cip_use_device(int device)
{
    cip_status st = driver();
    if (st != CIP_OK)
        return st;
    if ((st = ctx_push(device)) != CIP_OK)
        return st;
    /* replace what was current with the primary context: pop ours, set it */
    CUcontext ctx;
    drv.CtxPopCurrent(&ctx);
    CUresult (*set)(CUcontext);
    *(void **)&set = proc("cuCtxSetCurrent");
    if (set == NULL)
        return fail(CIP_ERR_NO_DRIVER, "the driver has no cuCtxSetCurrent");
    CUresult rc = set(ctx);
    return rc == CIP_CUDA_SUCCESS ? CIP_OK : cuda_fail("cuCtxSetCurrent", rc);
}

static void
ctx_pop(void)
{
    CUcontext ignored;
    drv.CtxPopCurrent(&ignored);
}

static void
hex16(const uint8_t *b, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) {
        out[2 * i] = digits[b[i] >> 4];
        out[2 * i + 1] = digits[b[i] & 15];
    }
    out[32] = '\0';
}

/* The local device for memory on the GPU with `uuid`: `device` (-1: that GPU itself). */
static cip_status
resolve_device(const uint8_t *uuid, int device, int *out)
{
    int count = 0;
    CUresult rc = drv.DeviceGetCount(&count);
    if (rc != CIP_CUDA_SUCCESS)
        return cuda_fail("cuDeviceGetCount", rc);
    int home = -1;
    for (int i = 0; i < count && home < 0; i++) {
        CUdevice dev;
        cip_cuuuid id;
        if (drv.DeviceGet(&dev, i) == CIP_CUDA_SUCCESS &&
            drv.DeviceGetUuid(&id, dev) == CIP_CUDA_SUCCESS && memcmp(id.bytes, uuid, 16) == 0)
            home = i;
    }
    char hex[33];
    hex16(uuid, hex);
    if (device >= count || device < -1)
        return fail(CIP_ERR_INVALID_ARGUMENT, "device %d out of range (%d visible)", device,
                    count);
    if (home < 0)
        return fail(CIP_ERR_DEVICE,
                    "the exporter's GPU (uuid %s) is not visible in this process; check "
                    "CUDA_VISIBLE_DEVICES",
                    hex);
    if (device == -1 || device == home) {
        *out = home;
        return CIP_OK;
    }
    CUdevice a, b;
    int can = 0;
    if (drv.DeviceGet(&a, device) != CIP_CUDA_SUCCESS ||
        drv.DeviceGet(&b, home) != CIP_CUDA_SUCCESS ||
        drv.DeviceCanAccessPeer(&can, a, b) != CIP_CUDA_SUCCESS || !can)
        return fail(CIP_ERR_DEVICE, "device %d has no peer access to device %d, where the pool "
                                    "lives",
                    device, home);
    *out = device;
    return CIP_OK;
}

/* ---- descriptors and array handles ------------------------------------------------ */

static int
valid_utf8(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t extra;
        uint32_t cp;
        if (c == 0)
            return 0;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            extra = 1;
            cp = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            extra = 2;
            cp = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            extra = 3;
            cp = c & 0x07;
        } else {
            return 0;
        }
        if (i + extra >= n)
            return 0;
        for (size_t k = 1; k <= extra; k++) {
            if ((s[i + k] & 0xC0) != 0x80)
                return 0;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if ((extra == 1 && cp < 0x80) || (extra == 2 && cp < 0x800) ||
            (extra == 3 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
        i += extra + 1;
    }
    return 1;
}

cip_status
cip_parse_descriptor(const void *bytes, size_t n, cip_descriptor *out)
{
    const uint8_t *p = (const uint8_t *)bytes;
    if (p == NULL || out == NULL)
        return fail(CIP_ERR_INVALID_ARGUMENT, "cip_parse_descriptor: NULL argument");
    if (n < 4 || memcmp(p, CIP_WIRE_DESC_MAGIC, 4) != 0)
        return fail(CIP_ERR_DESCRIPTOR, "not a cupy_ipcpool pool descriptor (bad magic%s)",
                    n < 4 ? ", input truncated" : "");
    if (n < CIP_WIRE_DESC_VERSION_OFF + CIP_WIRE_DESC_VERSION_WIDTH)
        return fail(CIP_ERR_DESCRIPTOR, "pool descriptor truncated: %zu bytes", n);
    uint64_t version = RD(p, DESC_VERSION);
    if (version < CIP_WIRE_DESC_MIN_VERSION || version > CIP_WIRE_DESC_MAX_VERSION)
        return fail(CIP_ERR_DESCRIPTOR,
                    "unsupported pool descriptor format version %llu; this library supports "
                    "version %u: use a cupy_ipcpool of the same wire format in every process",
                    (unsigned long long)version, CIP_WIRE_DESC_VERSION);
    if (n < CIP_WIRE_DESC_SIZE)
        return fail(CIP_ERR_DESCRIPTOR,
                    "pool descriptor truncated: %zu bytes, the header alone is %d", n,
                    CIP_WIRE_DESC_SIZE);
    if (RD(p, DESC_KIND) != CIP_WIRE_DESC_KIND_POOL)
        return fail(CIP_ERR_DESCRIPTOR, "wrong message kind %llu for a pool descriptor",
                    (unsigned long long)RD(p, DESC_KIND));
    if (RD(p, DESC_RESERVED) != 0)
        return fail(CIP_ERR_DESCRIPTOR, "reserved header byte is %llu, must be 0",
                    (unsigned long long)RD(p, DESC_RESERVED));
    uint64_t num_slots = RD(p, DESC_NUM_SLOTS);
    if (num_slots < 1 || num_slots > CIP_WIRE_MAX_SLOTS)
        return fail(CIP_ERR_DESCRIPTOR, "num_slots=%llu is out of range [1, %u]",
                    (unsigned long long)num_slots, CIP_WIRE_MAX_SLOTS);
    size_t end_fds = CIP_WIRE_DESC_SIZE + 4 * (size_t)num_slots;
    if (n < end_fds + 2)
        return fail(CIP_ERR_DESCRIPTOR, "pool descriptor truncated: %zu bytes, %llu fds need %zu",
                    n, (unsigned long long)num_slots, end_fds + 2);
    size_t path_len = (size_t)rd(p + end_fds, 2);
    size_t pos = end_fds + 2;
    if (path_len > CIP_WIRE_MAX_SOCKET_PATH)
        return fail(CIP_ERR_DESCRIPTOR, "socket path length %zu exceeds the limit of %u bytes",
                    path_len, CIP_WIRE_MAX_SOCKET_PATH);
    if (n < pos + path_len)
        return fail(CIP_ERR_DESCRIPTOR,
                    "pool descriptor truncated: %zu bytes, the socket path needs %zu", n,
                    pos + path_len);
    if (n > pos + path_len)
        return fail(CIP_ERR_DESCRIPTOR, "pool descriptor has %zu trailing bytes after its end",
                    n - pos - path_len);
    if (path_len && !valid_utf8(p + pos, path_len))
        return fail(CIP_ERR_DESCRIPTOR, "socket path is not valid UTF-8 (or holds a NUL)");
    cip_descriptor d;
    memset(&d, 0, sizeof d);
    memcpy(d.pool_id, p + CIP_WIRE_DESC_POOL_ID_OFF, 16);
    memcpy(d.device_uuid, p + CIP_WIRE_DESC_DEVICE_UUID_OFF, 16);
    uint64_t pid = RD(p, DESC_EXPORTER_PID), uid = RD(p, DESC_EXPORTER_UID);
    uint64_t ordinal = RD(p, DESC_DEVICE_ORDINAL);
    d.exporter_start_time = RD(p, DESC_EXPORTER_START_TIME);
    d.exporter_pid_namespace = RD(p, DESC_EXPORTER_PID_NAMESPACE);
    d.slot_nbytes = RD(p, DESC_SLOT_NBYTES);
    d.alloc_nbytes = RD(p, DESC_ALLOC_NBYTES);
    if (pid < 1 || pid > CIP_I32_MAX)
        return fail(CIP_ERR_DESCRIPTOR, "exporter_pid=%llu is out of range",
                    (unsigned long long)pid);
    if (uid >= 0xFFFFFFFFull)
        return fail(CIP_ERR_DESCRIPTOR, "exporter_uid=%llu is out of range",
                    (unsigned long long)uid);
    if (ordinal > CIP_I32_MAX)
        return fail(CIP_ERR_DESCRIPTOR, "device_ordinal=%llu is out of range",
                    (unsigned long long)ordinal);
    if (d.slot_nbytes < 1 || d.slot_nbytes > CIP_WIRE_MAX_SLOT_NBYTES)
        return fail(CIP_ERR_DESCRIPTOR, "slot_nbytes=%llu is out of range [1, %llu]",
                    (unsigned long long)d.slot_nbytes, (unsigned long long)CIP_WIRE_MAX_SLOT_NBYTES);
    if (d.alloc_nbytes < 1 || d.alloc_nbytes > CIP_WIRE_MAX_SLOT_NBYTES)
        return fail(CIP_ERR_DESCRIPTOR, "alloc_nbytes=%llu is out of range",
                    (unsigned long long)d.alloc_nbytes);
    if (d.alloc_nbytes < d.slot_nbytes)
        return fail(CIP_ERR_DESCRIPTOR, "alloc_nbytes=%llu is smaller than slot_nbytes=%llu",
                    (unsigned long long)d.alloc_nbytes, (unsigned long long)d.slot_nbytes);
    for (uint64_t i = 0; i < num_slots; i++) {
        if (rd(p + CIP_WIRE_DESC_SIZE + 4 * i, 4) > CIP_I32_MAX)
            return fail(CIP_ERR_DESCRIPTOR, "fds[%llu] is out of range", (unsigned long long)i);
    }
    d.exporter_pid = (uint32_t)pid;
    d.exporter_uid = (uint32_t)uid;
    d.device_ordinal = (uint32_t)ordinal;
    d.num_slots = (uint32_t)num_slots;
    memcpy(d.socket_path, p + pos, path_len);
    d.socket_path[path_len] = '\0';
    d.fds_le = p + CIP_WIRE_DESC_SIZE;
    *out = d;
    return CIP_OK;
}

/* Decode one packed handle at p (avail bytes); *used = its size.  Ranges only. */
static cip_status
parse_handle(const uint8_t *p, size_t avail, cip_array *a, size_t *used)
{
    if (avail < CIP_WIRE_HANDLE_SIZE)
        return fail(CIP_ERR_DESCRIPTOR, "array handle truncated: %zu bytes", avail);
    uint64_t ndim = RD(p, HANDLE_NDIM), code = RD(p, HANDLE_DTYPE);
    if (ndim > CIP_WIRE_MAX_NDIM)
        return fail(CIP_ERR_DESCRIPTOR, "array handle ndim=%llu exceeds the limit %u",
                    (unsigned long long)ndim, CIP_WIRE_MAX_NDIM);
    if (code >= CIP_WIRE_DTYPE_COUNT)
        return fail(CIP_ERR_DESCRIPTOR, "unknown dtype code %llu in array handle",
                    (unsigned long long)code);
    size_t size = CIP_WIRE_HANDLE_SIZE + 16 * (size_t)ndim;
    if (avail < size)
        return fail(CIP_ERR_DESCRIPTOR,
                    "array handle truncated: %llu dimensions need %zu bytes, %zu remain",
                    (unsigned long long)ndim, 16 * (size_t)ndim, avail - CIP_WIRE_HANDLE_SIZE);
    memset(a, 0, sizeof *a);
    a->slot = (uint32_t)RD(p, HANDLE_SLOT);
    if (RD(p, HANDLE_SLOT) >= CIP_WIRE_MAX_SLOTS)
        return fail(CIP_ERR_DESCRIPTOR, "array handle slot %llu is out of range",
                    (unsigned long long)RD(p, HANDLE_SLOT));
    a->generation = RD(p, HANDLE_GENERATION);
    a->offset = RD(p, HANDLE_OFFSET);
    a->ndim = (uint32_t)ndim;
    a->dtype = (int32_t)code;
    a->itemsize = (uint32_t)dtype_itemsizes[code];
    const uint8_t *dims = p + CIP_WIRE_HANDLE_SIZE;
    uint64_t elements = 1, bytes = a->itemsize;
    for (uint64_t i = 0; i < ndim; i++) {
        uint64_t n = rd(dims + 8 * i, 8);
        if (n > CIP_I64_MAX)
            return fail(CIP_ERR_DESCRIPTOR, "shape[%llu]=%llu is out of range",
                        (unsigned long long)i, (unsigned long long)n);
        a->shape[i] = n;
        a->strides[i] = (int64_t)rd(dims + 8 * (ndim + i), 8);
        if (n > 1) {
            if (bytes > CIP_I64_MAX / n)
                return fail(CIP_ERR_DESCRIPTOR, "array of %llu dimensions is too large",
                            (unsigned long long)ndim);
            bytes *= n;
        }
        elements = n == 0 ? 0 : (elements == 0 ? 0 : elements * n);
    }
    a->nbytes = elements * a->itemsize;
    *used = size;
    return CIP_OK;
}

/* Python's ArrayHandle.check_fits: every byte inside [0, slot_nbytes), aligned. */
static cip_status
check_fits(const cip_array *a, uint64_t slot_nbytes)
{
    uint64_t itemsize = a->itemsize;
    if (a->offset % itemsize)
        return fail(CIP_ERR_DESCRIPTOR,
                    "offset %llu is not a multiple of the item size %llu of %s; offsets and "
                    "strides must be multiples of the item size",
                    (unsigned long long)a->offset, (unsigned long long)itemsize,
                    dtype_names[a->dtype]);
    /* the extent, in 128 bits; any term beyond 2**64 cannot fit a slot */
    __extension__ typedef __int128 i128;
    const i128 limit = (i128)1 << 64;
    i128 lo = (i128)a->offset, hi = (i128)a->offset;
    int empty = 0;
    for (uint32_t i = 0; i < a->ndim; i++) {
        if (a->shape[i] == 0) {
            empty = 1;
            break;
        }
    }
    if (!empty) {
        for (uint32_t i = 0; i < a->ndim; i++) {
            uint64_t n = a->shape[i];
            if (n <= 1)
                continue;
            int64_t s = a->strides[i];
            if ((uint64_t)(s < 0 ? -(i128)s : (i128)s) % itemsize)
                return fail(CIP_ERR_DESCRIPTOR,
                            "stride %lld of axis %u is not a multiple of the item size %llu of "
                            "%s; offsets and strides must be multiples of the item size",
                            (long long)s, i, (unsigned long long)itemsize, dtype_names[a->dtype]);
            i128 span = (i128)s * (i128)(n - 1);
            if (span < 0)
                lo += span;
            else
                hi += span;
            if (lo < -limit || hi > limit)
                break;
        }
        hi += itemsize;
    }
    if (lo < 0 || hi > (i128)slot_nbytes)
        return fail(CIP_ERR_DESCRIPTOR,
                    "array touches bytes [%lld, %lld) which do not fit in a slot of %llu bytes",
                    (long long)(lo < -limit ? -limit : lo), (long long)(hi > limit ? limit : hi),
                    (unsigned long long)slot_nbytes);
    return CIP_OK;
}

/* cip_parse_frame_payload, and whether the frame is void (its flag index carries
 * CIP_WIRE_FRAME_VOID: a frame of a Publisher(ahead=True) taken and not published,
 * with no arrays, never written). */
static cip_status
parse_frame_payload(const void *payload, size_t len, uint64_t seq, uint32_t slot,
                    uint64_t slot_nbytes, uint64_t slot_base, cip_array *arrays, size_t cap,
                    cip_frame *out, int *is_void)
{
    const uint8_t *p = (const uint8_t *)payload;
    if ((p == NULL && len) || out == NULL || (arrays == NULL && cap))
        return fail(CIP_ERR_INVALID_ARGUMENT, "cip_parse_frame_payload: NULL argument");
    unsigned long long s = (unsigned long long)seq;
    if (len < CIP_WIRE_FRAME_HEAD_SIZE)
        return fail(CIP_ERR_PROTOCOL, "frame %llu: payload too short (%zu bytes)", s, len);
    uint64_t flag = RD(p, FRAME_HEAD_FLAG), generation = RD(p, FRAME_HEAD_GENERATION);
    uint64_t count = RD(p, FRAME_HEAD_NUM_ARRAYS), meta_len = RD(p, FRAME_HEAD_METADATA_LEN);
    int void_frame = flag == ((uint64_t)slot | CIP_WIRE_FRAME_VOID);
    if (flag != slot && !void_frame)
        return fail(CIP_ERR_PROTOCOL, "frame %llu in slot %u names flag %llu", s, slot,
                    (unsigned long long)flag);
    if (count > CIP_WIRE_MAX_ARRAYS || meta_len > CIP_WIRE_MAX_METADATA)
        return fail(CIP_ERR_PROTOCOL, "frame %llu: %llu arrays, %llu metadata bytes", s,
                    (unsigned long long)count, (unsigned long long)meta_len);
    if (void_frame && count)
        return fail(CIP_ERR_PROTOCOL, "frame %llu: a void frame with %llu arrays", s,
                    (unsigned long long)count);
    if (count > cap)
        return fail(CIP_ERR_INVALID_ARGUMENT, "frame %llu has %llu arrays, room for %zu", s,
                    (unsigned long long)count, cap);
    size_t pos = CIP_WIRE_FRAME_HEAD_SIZE;
    for (uint64_t i = 0; i < count; i++) {
        size_t used = 0;
        cip_array *a = &arrays[i];
        cip_status st = parse_handle(p + pos, len - pos, a, &used);
        if (st == CIP_OK && a->slot != slot)
            st = fail(CIP_ERR_DESCRIPTOR, "array %llu lies in slot %u, not in the frame's", 
                      (unsigned long long)i, a->slot);
        if (st == CIP_OK && (a->generation & 0xFFFFFFFFull) != generation)
            st = fail(CIP_ERR_DESCRIPTOR, "array %llu is of generation %llu, the frame of %llu",
                      (unsigned long long)i, (unsigned long long)a->generation,
                      (unsigned long long)generation);
        if (st == CIP_OK)
            st = check_fits(a, slot_nbytes);
        if (st != CIP_OK) {
            char why[sizeof tls_error];
            memcpy(why, tls_error, sizeof why);
            return fail(CIP_ERR_PROTOCOL, "frame %llu: %s", s, why);
        }
        a->data = slot_base + a->offset;
        pos += used;
    }
    if (len - pos != meta_len)
        return fail(CIP_ERR_PROTOCOL, "frame %llu: metadata length does not match", s);
    out->seq = seq;
    out->slot = slot;
    out->generation = (uint32_t)generation;
    out->num_arrays = (uint32_t)count;
    out->metadata_len = (uint32_t)meta_len;
    out->arrays = arrays;
    out->metadata = p + pos;
    if (is_void)
        *is_void = void_frame;
    return CIP_OK;
}

cip_status
cip_parse_frame_payload(const void *payload, size_t len, uint64_t seq, uint32_t slot,
                        uint64_t slot_nbytes, uint64_t slot_base, cip_array *arrays, size_t cap,
                        cip_frame *out)
{
    return parse_frame_payload(payload, len, seq, slot, slot_nbytes, slot_base, arrays, cap, out,
                               NULL);
}

/* ---- fetching fds: pidfd_getfd, the fd server -------------------------------------- */

/* Field 22 (starttime) of /proc/<pid>/stat; -1 if the process is not there. */
static long long
process_start_time(int pid)
{
    char path[64], buf[1024];
    if (pid == getpid())
        snprintf(path, sizeof path, "/proc/self/stat");
    else
        snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    if (p == NULL)
        return -1;
    p++;
    /* p is before field 3; field 22 is the 20th after the ')' */
    for (int field = 3; field < 22; field++) {
        while (*p == ' ')
            p++;
        while (*p && *p != ' ')
            p++;
    }
    while (*p == ' ')
        p++;
    char *end;
    long long v = strtoll(p, &end, 10);
    return end == p ? -1 : v;
}

static int
process_gone(int pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 1;
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    if (p == NULL)
        return 1;
    while (*++p == ' ')
        ;
    return *p == 'Z' || *p == 'X' || *p == 'x';
}

static unsigned long long
own_pid_namespace(void)
{
    struct stat st;
    if (stat("/proc/self/ns/pid", &st) != 0)
        return 0;
    return (unsigned long long)st.st_ino;
}

enum where { WHERE_SAME, WHERE_OTHER, WHERE_UNKNOWN };

#define SHARED_SOCKET_FIX                                                                  \
    "publish with an fd server whose socket lies in a directory both processes see (a "    \
    "shared volume) and use the socket transport"

static cip_status
pidfd_error(int err, int pid, unsigned fd, const char *call, enum where where)
{
    if (err == EPERM)
        return fail(CIP_ERR_TRANSPORT,
                    "%s(pid=%d, fd=%u): the kernel's ptrace access check refused (Yama "
                    "kernel.yama.ptrace_scope >= 1 for non-descendant processes, a different "
                    "uid, or no CAP_SYS_PTRACE in a container); run both processes as the same "
                    "user with ptrace_scope 0, add CAP_SYS_PTRACE (docker run "
                    "--cap-add=SYS_PTRACE), or use the socket transport",
                    call, pid, fd);
    if (err == ENOSYS)
        return fail(CIP_ERR_TRANSPORT,
                    "%s(pid=%d, fd=%u): not supported by this kernel (pidfd_getfd needs Linux >= "
                    "5.6); use the socket transport",
                    call, pid, fd);
    if (err == ESRCH && where == WHERE_SAME)
        return fail(CIP_ERR_TRANSPORT, "%s(pid=%d, fd=%u): the exporter process has exited",
                    call, pid, fd);
    if (err == ESRCH)
        return fail(CIP_ERR_TRANSPORT,
                    "%s(pid=%d, fd=%u): no process %d here: the exporter has exited, or it runs "
                    "in another PID namespace (a container, or unshare --pid), where pidfd_getfd "
                    "cannot reach it: then " SHARED_SOCKET_FIX,
                    call, pid, fd, pid);
    if (err == EBADF)
        return fail(CIP_ERR_TRANSPORT,
                    "%s(pid=%d, fd=%u): fd %u is no longer open in the exporter (pool closed?)",
                    call, pid, fd, fd);
    return fail(CIP_ERR_TRANSPORT, "%s(pid=%d, fd=%u): %s", call, pid, fd, strerror(err));
}

/* pidfd_getfd of every fd; *err = the errno of the failure.  Nothing left open on failure. */
static cip_status
getfd_all(const cip_descriptor *d, int *out, enum where where, int *err)
{
    int pid = (int)d->exporter_pid;
    uint32_t n = d->num_slots;
    unsigned first = (unsigned)rd(d->fds_le, 4);
    *err = 0;
    int pidfd = (int)syscall(CIP_SYS_PIDFD_OPEN, pid, 0);
    if (pidfd < 0) {
        *err = errno;
        return pidfd_error(*err, pid, first, "pidfd_open", where);
    }
    fcntl(pidfd, F_SETFD, FD_CLOEXEC);
    if (process_start_time(pid) != (long long)d->exporter_start_time) {
        close(pidfd);
        *err = ESRCH;
        if (where == WHERE_SAME)
            return fail(CIP_ERR_TRANSPORT,
                        "exporter exited and its pid was reused: process %d has a different start "
                        "time than the exporter",
                        pid);
        return fail(CIP_ERR_TRANSPORT,
                    "process %d here is not the exporter (another start time): the exporter has "
                    "exited and its pid was reused, or it runs in another PID namespace (a "
                    "container, or unshare --pid), where pidfd_getfd cannot reach it: "
                    "then " SHARED_SOCKET_FIX,
                    pid);
    }
    for (uint32_t i = 0; i < n; i++)
        out[i] = -1;
    for (uint32_t i = 0; i < n; i++) {
        unsigned target = (unsigned)rd(d->fds_le + 4 * i, 4);
        int fd = (int)syscall(CIP_SYS_PIDFD_GETFD, pidfd, (int)target, 0);
        if (fd < 0) {
            *err = errno;
            if (*err == EBADF && process_gone(pid))
                *err = ESRCH;
            cip_status st = pidfd_error(*err, pid, target, "pidfd_getfd", where);
            close_fds(out, i);
            close(pidfd);
            return st;
        }
        out[i] = fd;
    }
    close(pidfd);
    return CIP_OK;
}

/* The one check of a socket path this library connects to: not empty, and short enough for
 * sun_path with its NUL (CIP_WIRE_MAX_SOCKET_PATH, 107 bytes, Python's limit too).  The
 * message gives the limit, the path's length and the fix. */
static cip_status
check_socket_path(const char *path)
{
    size_t len = strlen(path);
    if (len == 0)
        return fail(CIP_ERR_INVALID_ARGUMENT, "the socket path is empty");
    if (len > CIP_WIRE_MAX_SOCKET_PATH)
        return fail(CIP_ERR_INVALID_ARGUMENT,
                    "the socket path %.200s%s is %zu bytes long; a Unix socket path holds at most "
                    "%u bytes (sun_path): use a shorter path, e.g. in a directory under /tmp or "
                    "$XDG_RUNTIME_DIR",
                    path, len > 200 ? "..." : "", len, CIP_WIRE_MAX_SOCKET_PATH);
    return CIP_OK;
}

/* Connect a non-blocking Unix socket of `type`, retrying a full backlog until the deadline. */
static cip_status
connect_unix(const char *path, int type, long long deadline, int *out, int *err)
{
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    cip_status st = check_socket_path(path);
    if (st != CIP_OK) {
        *err = ENAMETOOLONG;
        return st;
    }
    memcpy(addr.sun_path, path, strlen(path));
    int s = socket(AF_UNIX, type | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0) {
        *err = errno;
        return fail(CIP_ERR_TRANSPORT, "socket: %s", strerror(errno));
    }
    long delay = 1000;
    for (;;) {
        if (connect(s, (struct sockaddr *)&addr, sizeof addr) == 0)
            break;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN) {
            *err = errno;
            close(s);
            return CIP_ERR_TRANSPORT;
        }
        if (deadline >= 0 && now_ms() >= deadline) {
            *err = ETIMEDOUT;
            close(s);
            return CIP_ERR_TIMEOUT;
        }
        sleep_us(delay);
        delay = delay * 2 > 50000 ? 50000 : delay * 2;
    }
    *out = s;
    return CIP_OK;
}

/* One recvmsg (MSG_CMSG_CLOEXEC | MSG_DONTWAIT) of up to `n` bytes into `buf`, its control
 * data into `control` (`control_len` bytes).  The fds of its SCM_RIGHTS go to fds[*nfds]
 * on, `maxfds` in all at most; those beyond are closed and `*excess` set.  Returns
 * recvmsg's result (when negative, errno says why and no fd came); `*msg_flags` gets the
 * message's flags (MSG_CTRUNC, MSG_TRUNC) when it is not. */
static ssize_t
recv_with_fds(int s, void *buf, size_t n, void *control, size_t control_len, int *fds,
              size_t *nfds, size_t maxfds, int *excess, int *msg_flags)
{
    struct iovec iov = {buf, n};
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = control_len;
    ssize_t k = recvmsg(s, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (k < 0)
        return k;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        int *in = (int *)CMSG_DATA(c);
        for (size_t i = 0; i < count; i++) {
            if (*nfds < maxfds) {
                fds[(*nfds)++] = in[i];
            } else {
                close(in[i]);
                *excess = 1;
            }
        }
    }
    *msg_flags = msg.msg_flags;
    return k;
}

/* Receive exactly n bytes of a stream socket, appending arriving fds to fds[*nfds]. */
static cip_status
recv_exact(int s, uint8_t *buf, size_t n, long long deadline, int *fds, size_t *nfds,
           size_t maxfds, const char *path)
{
    size_t got = 0;
    int reset = 0, excess = 0;
    union {
        char buf[CMSG_SPACE(CIP_WIRE_SCM_MAX_FD * sizeof(int))];
        struct cmsghdr align;
    } control;
    while (got < n) {
        struct pollfd pfd = {s, POLLIN, 0};
        int r = poll(&pfd, 1, left_ms(deadline));
        if (r < 0 && errno == EINTR)
            continue;
        if (r == 0)
            return fail(CIP_ERR_TRANSPORT, "fd server %s did not answer in time", path);
        int flags = 0;
        ssize_t k = recv_with_fds(s, buf + got, n - got, control.buf, sizeof control.buf, fds,
                                  nfds, maxfds, &excess, &flags);
        if (k < 0) {
            if (errno == EAGAIN || errno == EINTR)
                continue;
            if (errno == ECONNRESET && !reset) {
                reset = 1; /* what the server sent before may still be queued */
                continue;
            }
            return fail(CIP_ERR_TRANSPORT, "fd server %s: %s", path, strerror(errno));
        }
        if (excess)
            return fail(CIP_ERR_TRANSPORT, "fd server %s sent more fds than expected", path);
        if (flags & MSG_CTRUNC)
            return fail(CIP_ERR_TRANSPORT,
                        "fd server %s sent more fds than fit (control data truncated)", path);
        if (k == 0)
            return fail(CIP_ERR_TRANSPORT,
                        "fd server %s closed the connection mid-reply (exporter exiting?)", path);
        got += (size_t)k;
    }
    return CIP_OK;
}

static cip_status
fetch_socket(const cip_descriptor *d, enum where where, int timeout_ms, int *out)
{
    const char *path = d->socket_path;
    long long deadline = deadline_of(timeout_ms);
    uint32_t n = d->num_slots;
    int s = -1, err = 0;
    cip_status st = connect_unix(path, SOCK_STREAM, deadline, &s, &err);
    if (st == CIP_ERR_TIMEOUT)
        return fail(CIP_ERR_TRANSPORT, "connecting to fd server %s timed out", path);
    if (st != CIP_OK) {
        if (err == ECONNREFUSED || err == ENOENT)
            return fail(CIP_ERR_TRANSPORT,
                        "no fd server at %s: the exporter has exited or closed its fd server",
                        path);
        if (err == EACCES)
            return fail(CIP_ERR_TRANSPORT,
                        "cannot connect to fd server %s: the socket's file permissions refuse this "
                        "user (uid %u); the exporter must allow this uid (allowed_uids)",
                        path, (unsigned)geteuid());
        if (st == CIP_ERR_TRANSPORT)
            return fail(CIP_ERR_TRANSPORT, "cannot connect to fd server %s: %s", path,
                        strerror(err));
        return st;
    }
    /* who serves it: the exporter's uid, and the exporter's pid where it is visible here */
    struct ucred cred;
    socklen_t clen = sizeof cred;
    if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0) {
        close(s);
        return fail(CIP_ERR_TRANSPORT, "SO_PEERCRED on %s: %s", path, strerror(errno));
    }
    if (cred.uid != d->exporter_uid) {
        close(s);
        return fail(CIP_ERR_REFUSED,
                    "the fd server %s runs as uid %u, but the exporter runs as uid %u: someone "
                    "else owns the socket path; nothing was sent to it",
                    path, (unsigned)cred.uid, d->exporter_uid);
    }
    if (where != WHERE_OTHER &&
        process_start_time((int)d->exporter_pid) == (long long)d->exporter_start_time &&
        cred.pid != (pid_t)d->exporter_pid) {
        close(s);
        return fail(CIP_ERR_REFUSED,
                    "the fd server %s is process %d, not the exporter (process %u): someone else "
                    "owns the socket path; nothing was sent to it",
                    path, (int)cred.pid, d->exporter_pid);
    }
    uint8_t req[4 + 1 + 16];
    memcpy(req, CIP_WIRE_FDSERVER_MAGIC, 4);
    req[4] = 16;
    memcpy(req + 5, d->pool_id, 16);
    /* refused before the request arrived: the status byte still says why */
    (void)!send(s, req, sizeof req, MSG_NOSIGNAL);
    int *got = out;
    size_t nfds = 0;
    uint8_t head[5];
    st = recv_exact(s, head, 1, deadline, got, &nfds, n, path);
    if (st == CIP_OK && head[0] != CIP_WIRE_FDSERVER_STATUS_OK) {
        unsigned status = head[0];
        if (status == CIP_WIRE_FDSERVER_STATUS_UID_REFUSED)
            st = fail(CIP_ERR_REFUSED,
                      "the exporter's fd server %s refused this process's uid %u; the exporter "
                      "must allow it (allowed_uids=...)",
                      path, (unsigned)geteuid());
        else if (status == CIP_WIRE_FDSERVER_STATUS_BAD_TOKEN)
            st = fail(CIP_ERR_REFUSED,
                      "the exporter's fd server %s refused the token (descriptor stale or from a "
                      "different pool)",
                      path);
        else if (status == CIP_WIRE_FDSERVER_STATUS_BAD_REQUEST)
            st = fail(CIP_ERR_REFUSED, "fd server %s refused a malformed request", path);
        else if (status == CIP_WIRE_FDSERVER_STATUS_BUSY)
            st = fail(CIP_ERR_TRANSPORT,
                      "fd server %s is serving too many other connections of this uid and "
                      "dropped this one, the oldest; retry",
                      path);
        else if (status == CIP_WIRE_FDSERVER_STATUS_TOO_SLOW)
            st = fail(CIP_ERR_TRANSPORT, "fd server %s gave up on this connection", path);
        else
            st = fail(CIP_ERR_TRANSPORT, "fd server %s sent unknown status %u", path, status);
    }
    if (st == CIP_OK)
        st = recv_exact(s, head + 1, 4, deadline, got, &nfds, n, path);
    if (st == CIP_OK) {
        uint32_t announced = ((uint32_t)head[1] << 24) | ((uint32_t)head[2] << 16) |
                             ((uint32_t)head[3] << 8) | head[4];
        if (announced != n)
            st = fail(CIP_ERR_TRANSPORT,
                      "fd server %s serves %u fds, expected %u (descriptor from a different "
                      "pool?)",
                      path, announced, n);
    }
    if (st == CIP_OK) {
        size_t nmsg = (n + CIP_WIRE_FDSERVER_FDS_PER_MESSAGE - 1) / CIP_WIRE_FDSERVER_FDS_PER_MESSAGE;
        uint8_t *tags = (uint8_t *)malloc(nmsg ? nmsg : 1);
        if (tags == NULL)
            st = fail(CIP_ERR_NO_MEMORY, "out of memory");
        else
            st = recv_exact(s, tags, nmsg, deadline, got, &nfds, n, path);
        free(tags);
    }
    if (st == CIP_OK && nfds != n)
        st = fail(CIP_ERR_TRANSPORT, "fd server %s sent %zu fds, expected %u", path, nfds, n);
    close(s);
    if (st != CIP_OK)
        close_fds(got, nfds);
    return st;
}

cip_status
cip_fetch_fds(const void *desc_bytes, size_t len, int transport, int timeout_ms, int *fds,
              size_t cap, size_t *count)
{
    cip_descriptor d;
    cip_status st = cip_parse_descriptor(desc_bytes, len, &d);
    if (st != CIP_OK)
        return st;
    if (fds == NULL || count == NULL)
        return fail(CIP_ERR_INVALID_ARGUMENT, "cip_fetch_fds: NULL argument");
    if (cap < d.num_slots)
        return fail(CIP_ERR_INVALID_ARGUMENT, "room for %zu fds; the pool has %u slots", cap,
                    d.num_slots);
    if (transport < CIP_TRANSPORT_AUTO || transport > CIP_TRANSPORT_SOCKET)
        return fail(CIP_ERR_INVALID_ARGUMENT, "unknown transport %d", transport);
    *count = 0;
    unsigned long long mine = own_pid_namespace();
    enum where where = !d.exporter_pid_namespace || !mine           ? WHERE_UNKNOWN
                       : mine == d.exporter_pid_namespace ? WHERE_SAME
                                                          : WHERE_OTHER;
    int has_socket = d.socket_path[0] != '\0';
    if (transport == CIP_TRANSPORT_SOCKET) {
        if (!has_socket)
            return fail(CIP_ERR_TRANSPORT,
                        "socket transport requested but the exporter offers no fd server socket; "
                        "export with an fd server or use the pidfd transport");
        st = fetch_socket(&d, where, timeout_ms, fds);
    } else {
        char first[sizeof tls_error];
        int err = ESRCH;
        if (where == WHERE_OTHER) {
            st = fail(CIP_ERR_TRANSPORT,
                      "pidfd_getfd could not see the exporter: it runs in another PID namespace "
                      "than this process (a container, or unshare --pid), so its pid %u names no "
                      "process here; " SHARED_SOCKET_FIX,
                      d.exporter_pid);
        } else {
            st = getfd_all(&d, fds, where, &err);
            if (st == CIP_OK) {
                *count = d.num_slots;
                return CIP_OK;
            }
        }
        if (transport == CIP_TRANSPORT_PIDFD || !has_socket)
            return st;
        int invisible = err == ESRCH && where != WHERE_SAME;
        if (where != WHERE_OTHER && err != EPERM && err != ENOSYS && !invisible)
            return st;
        memcpy(first, tls_error, sizeof first);
        st = fetch_socket(&d, where, timeout_ms, fds);
        if (st != CIP_OK) {
            char second[sizeof tls_error];
            memcpy(second, tls_error, sizeof second);
            fail(st, "%s; the fallback to the socket transport failed too: %s", first, second);
        }
    }
    if (st == CIP_OK)
        *count = d.num_slots;
    return st;
}

/* ---- pools ----------------------------------------------------------------------------- */

struct cip_pool {
    cip_descriptor desc;
    int device;
    uint32_t num_slots;
    uint64_t *ptrs;
    uint64_t *handles;
    uint64_t *seen;
};

static void
unmap_slots(cip_pool *pool, uint32_t mapped)
{
    for (uint32_t i = mapped; i-- > 0;) {
        drv.MemUnmap(pool->ptrs[i], pool->desc.alloc_nbytes);
        drv.MemAddressFree(pool->ptrs[i], pool->desc.alloc_nbytes);
        drv.MemRelease(pool->handles[i]);
    }
}

static void
free_pool(cip_pool *pool)
{
    free(pool->ptrs);
    free(pool->handles);
    free(pool->seen);
    free(pool);
}

/* Import, reserve, map and set access for every slot; the fds are closed in every case. */
static cip_status
attach_fds(const cip_descriptor *d, int *fds, size_t nfds, int device, cip_pool **out)
{
    cip_pool *pool = NULL;
    cip_status st = CIP_OK;
    int local = -1;
    if (nfds != d->num_slots) {
        st = fail(CIP_ERR_DESCRIPTOR, "got %zu fds for a pool of %u slots", nfds, d->num_slots);
        goto done;
    }
    if ((st = driver()) != CIP_OK)
        goto done;
    if ((st = resolve_device(d->device_uuid, device, &local)) != CIP_OK)
        goto done;
    pool = (cip_pool *)calloc(1, sizeof *pool);
    if (pool != NULL) {
        pool->ptrs = (uint64_t *)calloc(d->num_slots, sizeof(uint64_t));
        pool->handles = (uint64_t *)calloc(d->num_slots, sizeof(uint64_t));
        pool->seen = (uint64_t *)calloc(d->num_slots, sizeof(uint64_t));
    }
    if (pool == NULL || !pool->ptrs || !pool->handles || !pool->seen) {
        st = fail(CIP_ERR_NO_MEMORY, "out of memory");
        goto done;
    }
    pool->desc = *d;
    pool->desc.fds_le = NULL;
    pool->device = local;
    pool->num_slots = d->num_slots;
    if ((st = ctx_push(local)) != CIP_OK)
        goto done;
    cip_access_desc access = {{CIP_CU_MEM_LOCATION_TYPE_DEVICE, local},
                              CIP_CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    size_t size = (size_t)d->alloc_nbytes;
    uint32_t i;
    for (i = 0; i < d->num_slots; i++) {
        uint64_t h = 0;
        CUdeviceptr ptr = 0;
        CUresult rc = drv.MemImportFromShareableHandle(&h, (void *)(intptr_t)fds[i],
                                                       CIP_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        if (rc != CIP_CUDA_SUCCESS) {
            st = cuda_fail("cuMemImportFromShareableHandle", rc);
            break;
        }
        rc = drv.MemAddressReserve(&ptr, size, 0, 0, 0);
        if (rc != CIP_CUDA_SUCCESS) {
            drv.MemRelease(h);
            st = cuda_fail("cuMemAddressReserve", rc);
            break;
        }
        rc = drv.MemMap(ptr, size, 0, h, 0);
        if (rc != CIP_CUDA_SUCCESS) {
            drv.MemAddressFree(ptr, size);
            drv.MemRelease(h);
            st = cuda_fail("cuMemMap", rc);
            break;
        }
        rc = drv.MemSetAccess(ptr, size, &access, 1);
        if (rc != CIP_CUDA_SUCCESS) {
            drv.MemUnmap(ptr, size);
            drv.MemAddressFree(ptr, size);
            drv.MemRelease(h);
            st = cuda_fail("cuMemSetAccess", rc);
            break;
        }
        pool->ptrs[i] = ptr;
        pool->handles[i] = h;
    }
    if (st != CIP_OK)
        unmap_slots(pool, i);
    ctx_pop();
done:
    close_fds(fds, nfds);
    if (st != CIP_OK) {
        if (pool != NULL)
            free_pool(pool);
        return st;
    }
    *out = pool;
    return CIP_OK;
}

cip_status
cip_pool_attach_fds(const void *desc_bytes, size_t len, int *fds, size_t nfds, int device,
                    cip_pool **out)
{
    cip_descriptor d;
    cip_status st = out == NULL || (fds == NULL && nfds)
                        ? fail(CIP_ERR_INVALID_ARGUMENT, "cip_pool_attach_fds: NULL argument")
                        : cip_parse_descriptor(desc_bytes, len, &d);
    if (st != CIP_OK) {
        if (fds != NULL)
            close_fds(fds, nfds);
        return st;
    }
    return attach_fds(&d, fds, nfds, device, out);
}

cip_status
cip_pool_attach(const void *desc_bytes, size_t len, int device, int transport, cip_pool **out)
{
    cip_descriptor d;
    if (out == NULL)
        return fail(CIP_ERR_INVALID_ARGUMENT, "cip_pool_attach: NULL argument");
    cip_status st = cip_parse_descriptor(desc_bytes, len, &d);
    if (st != CIP_OK)
        return st;
    if ((st = driver()) != CIP_OK)
        return st;
    int *fds = (int *)malloc(d.num_slots * sizeof(int));
    if (fds == NULL)
        return fail(CIP_ERR_NO_MEMORY, "out of memory");
    size_t n = 0;
    st = cip_fetch_fds(desc_bytes, len, transport, 10000, fds, d.num_slots, &n);
    if (st == CIP_OK)
        st = attach_fds(&d, fds, n, device, out);
    free(fds);
    return st;
}

uint32_t
cip_pool_num_slots(const cip_pool *pool)
{
    return pool ? pool->num_slots : 0;
}

uint64_t
cip_pool_slot_nbytes(const cip_pool *pool)
{
    return pool ? pool->desc.slot_nbytes : 0;
}

int
cip_pool_device(const cip_pool *pool)
{
    return pool ? pool->device : -1;
}

cip_status
cip_pool_slot_ptr(const cip_pool *pool, uint32_t slot, uint64_t *ptr)
{
    if (pool == NULL || ptr == NULL)
        return fail(CIP_ERR_INVALID_ARGUMENT, "cip_pool_slot_ptr: NULL argument");
    if (slot >= pool->num_slots)
        return fail(CIP_ERR_INVALID_ARGUMENT, "slot %u out of range for %u slots", slot,
                    pool->num_slots);
    *ptr = pool->ptrs[slot];
    return CIP_OK;
}

cip_status
cip_array_from_handle(cip_pool *pool, const void *bytes, size_t len, cip_array *out)
{
    if (pool == NULL || bytes == NULL || out == NULL)
        return fail(CIP_ERR_INVALID_ARGUMENT, "cip_array_from_handle: NULL argument");
    cip_array a;
    size_t used = 0;
    cip_status st = parse_handle((const uint8_t *)bytes, len, &a, &used);
    if (st != CIP_OK)
        return st;
    if (used != len)
        return fail(CIP_ERR_DESCRIPTOR, "array handle has %zu trailing bytes after its end",
                    len - used);
    if (a.slot >= pool->num_slots)
        return fail(CIP_ERR_DESCRIPTOR, "handle names slot %u; the pool has %u slots", a.slot,
                    pool->num_slots);
    if (a.generation < pool->seen[a.slot])
        return fail(CIP_ERR_STALE,
                    "handle for slot %u is of generation %llu; generation %llu has been seen "
                    "since, so its memory was reused",
                    a.slot, (unsigned long long)a.generation,
                    (unsigned long long)pool->seen[a.slot]);
    if ((st = check_fits(&a, pool->desc.slot_nbytes)) != CIP_OK)
        return st;
    pool->seen[a.slot] = a.generation;
    a.data = pool->ptrs[a.slot] + a.offset;
    *out = a;
    return CIP_OK;
}

/* ---- closing a pool: no unmap under queued GPU work ------------------------------------ */

/* cuMemUnmap does not wait for kernels as cudaFree does: a kernel queued in this
 * process on a slot would fault (and poison the context) if the slot went first.  So
 * a close synchronises the pool's device context, then unmaps -- inline for up to
 * CIP_WIRE_UNMAP_WAIT_MS (generated: _vmm.DRAIN_TIMEOUT), after that in a thread of
 * its own, once the work is done (as the Python package's
 * _vmm.release_after_queued_work). */

/* cuCtxSynchronize on the pool's device (its primary context, pushed and popped),
 * then unmap and release every slot whatever it said, and free the pool.  On
 * failure `why` says what happened. */
static cip_status
sync_and_unmap(cip_pool *pool, char *why, size_t cap)
{
    cip_status st = ctx_push(pool->device);
    if (st == CIP_OK) {
        CUresult rc = drv.CtxSynchronize();
        if (rc != CIP_CUDA_SUCCESS) {
            char call[96];
            snprintf(call, sizeof call, "cuCtxSynchronize on device %d before unmapping the pool",
                     pool->device);
            st = cuda_fail(call, rc);
            snprintf(why, cap,
                     "%.600s: the context holds an error from earlier work (a failed kernel); the "
                     "slots were unmapped anyway",
                     tls_error);
        }
        unmap_slots(pool, pool->num_slots);
        ctx_pop();
    } else {
        snprintf(why, cap, "%.600s; the pool was unmapped without waiting for queued GPU work",
                 tls_error);
        unmap_slots(pool, pool->num_slots);
    }
    free_pool(pool);
    return st;
}

struct unmap_job {
    cip_pool *pool;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int done, abandoned; /* abandoned: the closing call gave up waiting; the thread frees */
    cip_status status;
    char why[sizeof tls_error];
};

static void
unmap_job_free(struct unmap_job *job)
{
    pthread_cond_destroy(&job->cond);
    pthread_mutex_destroy(&job->lock);
    free(job);
}

static void *
unmap_worker(void *arg)
{
    struct unmap_job *job = (struct unmap_job *)arg;
    job->status = sync_and_unmap(job->pool, job->why, sizeof job->why);
    pthread_mutex_lock(&job->lock);
    job->done = 1;
    int abandoned = job->abandoned;
    pthread_cond_signal(&job->cond);
    pthread_mutex_unlock(&job->lock);
    if (abandoned)
        unmap_job_free(job);
    return NULL;
}

/* Start the job's thread with every signal blocked (they stay the caller's threads'). */
static int
start_unmap_job(struct unmap_job *job, pthread_t *thread)
{
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr) != 0)
        return -1;
    int ok = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) == 0 &&
             pthread_cond_init(&job->cond, &attr) == 0;
    pthread_condattr_destroy(&attr);
    if (!ok)
        return -1;
    if (pthread_mutex_init(&job->lock, NULL) != 0) {
        pthread_cond_destroy(&job->cond);
        return -1;
    }
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(thread, NULL, unmap_worker, job);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        pthread_mutex_destroy(&job->lock);
        pthread_cond_destroy(&job->cond);
        return -1;
    }
    return 0;
}

cip_status
cip_pool_close(cip_pool *pool)
{
    if (pool == NULL)
        return CIP_OK;
    int device = pool->device;
    struct unmap_job *job = (struct unmap_job *)calloc(1, sizeof *job);
    pthread_t thread;
    if (job != NULL)
        job->pool = pool;
    if (job == NULL || start_unmap_job(job, &thread) != 0) {
        /* no thread to spare: wait inline, however long it takes */
        char why[sizeof tls_error];
        free(job);
        cip_status st = sync_and_unmap(pool, why, sizeof why);
        return st == CIP_OK ? CIP_OK : fail(st, "%s", why);
    }
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += (time_t)(CIP_WIRE_UNMAP_WAIT_MS / 1000u);
    until.tv_nsec += (long)(CIP_WIRE_UNMAP_WAIT_MS % 1000u) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&job->lock);
    while (!job->done) {
        if (pthread_cond_timedwait(&job->cond, &job->lock, &until) == ETIMEDOUT)
            break;
    }
    if (!job->done) {
        job->abandoned = 1;
        pthread_mutex_unlock(&job->lock);
        pthread_detach(thread);
        return fail(CIP_ERR_TIMEOUT,
                    "GPU work queued in this process on device %d has not finished within %g s; "
                    "the pool's slots stay mapped until it has, then a background thread unmaps "
                    "them",
                    device, CIP_WIRE_UNMAP_WAIT_MS / 1000.0);
    }
    pthread_mutex_unlock(&job->lock);
    pthread_join(thread, NULL);
    cip_status st = job->status;
    if (st != CIP_OK)
        fail(st, "%s", job->why);
    unmap_job_free(job);
    return st;
}

/* ---- the sync page: layout, flag states, forcing, the record of frames (no GPU) ------- */

static size_t
round_up(size_t n, size_t to)
{
    return (n + to - 1) / to * to;
}

cip_status
cip_sync_layout(uint32_t num_slots, uint32_t max_subscribers, size_t *reads_offset,
                size_t *nbytes)
{
    if (reads_offset == NULL || nbytes == NULL)
        return fail(CIP_ERR_INVALID_ARGUMENT, "cip_sync_layout: NULL argument");
    if (num_slots < 1 || num_slots > CIP_WIRE_MAX_SLOTS || max_subscribers < 1 ||
        max_subscribers > 65536)
        return fail(CIP_ERR_INVALID_ARGUMENT,
                    "a sync page has 1..%u slots and 1..65536 subscriber rows, not %u and %u",
                    CIP_WIRE_MAX_SLOTS, num_slots, max_subscribers);
    long page = sysconf(_SC_PAGESIZE);
    size_t reads = round_up((size_t)num_slots * CIP_WIRE_SYNC_FLAG_BYTES, CIP_WIRE_SYNC_READS_ALIGN);
    *reads_offset = reads;
    *nbytes = round_up(reads + (size_t)num_slots * max_subscribers * CIP_WIRE_SYNC_FLAG_BYTES,
                       page > 0 ? (size_t)page : 4096);
    return CIP_OK;
}

int
cip_flag_state(uint32_t word, uint32_t generation)
{
    uint32_t distance = word - generation;
    if (distance >= 0x80000000u)
        return -1; /* not set yet: the producer's stream is behind */
    if (distance < CIP_WIRE_SYNC_SET_WINDOW)
        return 1; /* the producer's stream set it, for this frame or a later one */
    /* forced after the death to w + FORCED: written if w >= generation */
    return distance >= CIP_WIRE_SYNC_FORCED ? 1 : 0;
}

int
cip_flag_force(uint32_t *flag, uint32_t awaited)
{
    if (flag == NULL)
        return -1;
    uint32_t word = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
    for (;;) {
        if ((int32_t)(word - awaited) >= 0)
            return 0; /* reached: set by the producer, or forced by another survivor */
        if (__atomic_compare_exchange_n(flag, &word, word + CIP_WIRE_SYNC_FORCED, 0,
                                        __ATOMIC_SEQ_CST, __ATOMIC_ACQUIRE))
            return 1;
    }
}

static uint32_t
flag_load(volatile uint32_t *flags, uint32_t slot)
{
    return __atomic_load_n(&flags[slot], __ATOMIC_ACQUIRE);
}

/* A received frame, as the record keeps it. */
struct seen_frame {
    uint64_t seq;
    uint32_t slot, generation;
};

/* The rings of this file (the book's record, the backlog of messages, the RELEASEs owed)
 * grow alike: the `len` entries of `size` bytes from `*head` of a ring of `*alloc`
 * entries at `old` are copied, in order, to the start of a new buffer of `new_alloc`
 * entries, `old` is freed, `*head` becomes 0 and `*alloc` new_alloc.  Returns the new
 * buffer, or NULL without memory (the ring kept as it was). */
static void *
ring_regrow(void *old, size_t size, size_t *head, size_t len, size_t *alloc, size_t new_alloc)
{
    uint8_t *r = (uint8_t *)malloc(new_alloc * size);
    if (r == NULL)
        return NULL;
    if (len) {
        size_t first = *alloc - *head < len ? *alloc - *head : len; /* up to the ring's end */
        memcpy(r, (uint8_t *)old + *head * size, first * size);
        memcpy(r + first * size, old, (len - first) * size);
    }
    free(old);
    *head = 0;
    *alloc = new_alloc;
    return r;
}

/* What a GPU subscription knows of the frame flags (the Python FrameWaits, rule for
 * rule): per slot the generation a stream of ours may wait for, and a bounded record,
 * oldest first, of the frames received whose flag the host did not see set by the
 * producer.  When the producer dies, book_resolve forces the flags it never wrote so
 * that every wait ends, and book_answers names the frames never written.  Pure state
 * over the page's frame flags (the page's first num_slots words). */
struct frame_book {
    uint32_t num_slots;
    uint8_t *awaited_set; /* per slot: a stream of ours may wait on the frame flag ... */
    uint32_t *awaited;    /* ... for this generation */
    struct seen_frame *rec; /* a ring of rec_alloc entries, rec_len used from rec_head */
    size_t rec_head, rec_len, rec_alloc, rec_cap;
    uint64_t untracked; /* frames dropped from a full record */
    uint64_t forced;    /* frame flags this subscription forced */
};

static int
book_init(struct frame_book *b, uint32_t num_slots, size_t cap)
{
    memset(b, 0, sizeof *b);
    b->num_slots = num_slots;
    b->rec_cap = cap ? cap : 1;
    b->awaited_set = (uint8_t *)calloc(num_slots, 1);
    b->awaited = (uint32_t *)calloc(num_slots, sizeof(uint32_t));
    return b->awaited_set && b->awaited ? 0 : -1;
}

static void
book_free(struct frame_book *b)
{
    free(b->awaited_set);
    free(b->awaited);
    free(b->rec);
    memset(b, 0, sizeof *b);
}

/* Whether slot's flag holds the producer's own write of `generation` or later. */
static int
set_by_producer(volatile uint32_t *flags, uint32_t slot, uint32_t generation)
{
    return flag_load(flags, slot) - generation < CIP_WIRE_SYNC_SET_WINDOW;
}

/* Drop from the front of the record the frames the producer's stream has set.  A
 * forced flag is never taken for the producer's write: such frames stay. */
static void
book_prune(struct frame_book *b, volatile uint32_t *flags)
{
    while (b->rec_len) {
        const struct seen_frame *f = &b->rec[b->rec_head];
        if (!set_by_producer(flags, f->slot, f->generation))
            return;
        b->rec_head = (b->rec_head + 1) % b->rec_alloc;
        b->rec_len--;
    }
}

/* A stream of ours may wait for slot's frame flag to reach `generation`. */
static void
book_note(struct frame_book *b, uint32_t slot, uint32_t generation)
{
    b->awaited_set[slot] = 1;
    b->awaited[slot] = generation;
}

/* A frame was received: unless the host sees its flag set by the producer, note its
 * generation as awaited and record it (a full record drops its oldest frame, counted
 * in `untracked`); prune the record either way.  Returns 1 if recorded. */
static int
book_received(struct frame_book *b, volatile uint32_t *flags, uint64_t seq, uint32_t slot,
              uint32_t generation)
{
    book_prune(b, flags);
    if (set_by_producer(flags, slot, generation))
        return 0;
    book_note(b, slot, generation);
    if (b->rec_len >= b->rec_cap) {
        b->rec_head = (b->rec_head + 1) % b->rec_alloc;
        b->rec_len--;
        b->untracked++;
    }
    if (b->rec_len == b->rec_alloc) {
        size_t alloc = b->rec_alloc ? 2 * b->rec_alloc : 64;
        if (alloc > b->rec_cap)
            alloc = b->rec_cap;
        struct seen_frame *r = (struct seen_frame *)ring_regrow(
            b->rec, sizeof *r, &b->rec_head, b->rec_len, &b->rec_alloc, alloc);
        if (r == NULL) {
            b->untracked++; /* no memory: not recorded, and counted as such */
            return 0;
        }
        b->rec = r;
    }
    struct seen_frame *f = &b->rec[(b->rec_head + b->rec_len) % b->rec_alloc];
    f->seq = seq;
    f->slot = slot;
    f->generation = generation;
    b->rec_len++;
    return 1;
}

/* Whether a stream of ours waits (or may wait) on a frame flag that is not set. */
static int
book_pending(const struct frame_book *b, volatile uint32_t *flags)
{
    for (uint32_t s = 0; s < b->num_slots; s++)
        if (b->awaited_set[s] && (int32_t)(flag_load(flags, s) - b->awaited[s]) < 0)
            return 1;
    return 0;
}

/* The producer is dead: force every frame flag still awaited (cip_flag_force), so that
 * every wait a stream of ours has on it ends.  Returns how many were stored. */
static uint32_t
book_resolve(struct frame_book *b, volatile uint32_t *flags)
{
    uint32_t forced = 0;
    for (uint32_t s = 0; s < b->num_slots; s++)
        if (b->awaited_set[s] && cip_flag_force((uint32_t *)&flags[s], b->awaited[s]) == 1)
            forced++;
    b->forced += forced;
    return forced;
}

/* The recorded frames never written (cip_flag_state 0): up to `cap` seqs into `seqs`,
 * their number returned; `*pending`: those not known yet (-1). */
static size_t
book_answers(const struct frame_book *b, volatile uint32_t *flags, uint64_t *seqs, size_t cap,
             size_t *pending)
{
    size_t n = 0, unknown = 0;
    for (size_t i = 0; i < b->rec_len; i++) {
        const struct seen_frame *f = &b->rec[(b->rec_head + i) % b->rec_alloc];
        int state = cip_flag_state(flag_load(flags, f->slot), f->generation);
        if (state < 0) {
            unknown++;
        } else if (state == 0) {
            if (n < cap)
                seqs[n] = f->seq;
            n++;
        }
    }
    if (pending != NULL)
        *pending = unknown;
    return n;
}

/* ---- the channel: handshake, frames, hang-ups, releases ------------------------------- */

struct held {
    int held;
    uint64_t seq;
    uint32_t generation;
    int void_seen;            /* a void frame was received in this slot ... */
    uint32_t void_generation; /* ... the last one at this generation (cip_frame_complete 0) */
    cip_array *arrays; /* CIP_MAX_ARRAYS, made at the slot's first frame (GPU sessions) */
    uint8_t *meta;     /* CIP_MAX_METADATA */
};

struct msgbuf {
    uint8_t *data;
    size_t len;
};

/* A RELEASE the socket did not take yet (the publisher is not reading). */
struct owed_release {
    uint64_t seq;
    uint32_t slot;
};

struct cip_sub {
    int sock;
    int pidfd; /* the producer's, -1 where it cannot be opened */
    int gpu;
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    cip_sub_info info;
    uint8_t *welcome;
    size_t welcome_len;
    int *fds;
    size_t nfds;
    uint8_t *buf; /* one datagram: MAX_FRAME_SIZE + 1 */
    struct msgbuf *backlog; /* what was still queued when the publisher hung up */
    size_t bl_head, bl_len, bl_cap;
    cip_status ended; /* CIP_OK while the stream runs */
    char error[sizeof tls_error];
    int have_seq;
    uint64_t last_seq;
    struct held *held; /* by slot: a slot holds at most one frame of ours */
    struct owed_release *owed; /* a ring: RELEASEs to send, in order, before any other */
    size_t owed_head, owed_len, owed_alloc;
    /* GPU sessions */
    cip_pool *pool;
    uint32_t row, max_subs;
    volatile uint32_t *page;
    size_t page_nbytes, reads_offset;
    CUdeviceptr page_dev;
    int registered;
    int untracked; /* an operation was enqueued without its event: keep the page at close */
    CUevent *ev_wait, *ev_write;
    uint8_t *wait_recorded, *write_recorded;
    struct frame_book book; /* awaited flags and the record of frames not seen complete */
    int closed;             /* cip_sub_close ran: only the answers and the error remain */
    uint32_t *final_flags;  /* the frame flags at close, which the answers read then */
};

static cip_status
sub_end(cip_sub *sub, cip_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The stream ends with `status`: remembered, and reported by every later call. */
static cip_status
sub_end(cip_sub *sub, cip_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(sub->error, sizeof sub->error, fmt, ap);
    va_end(ap);
    sub->ended = status;
    return fail(status, "%s", sub->error);
}

static void
backlog_clear(cip_sub *sub)
{
    for (size_t i = 0; i < sub->bl_len; i++)
        free(sub->backlog[(sub->bl_head + i) % sub->bl_cap].data);
    sub->bl_head = sub->bl_len = 0;
}

static int
backlog_push(cip_sub *sub, const uint8_t *data, size_t len)
{
    if (sub->bl_len == sub->bl_cap) {
        size_t cap = sub->bl_cap ? 2 * sub->bl_cap : 16;
        struct msgbuf *b = (struct msgbuf *)ring_regrow(sub->backlog, sizeof *b, &sub->bl_head,
                                                        sub->bl_len, &sub->bl_cap, cap);
        if (b == NULL)
            return -1;
        sub->backlog = b;
    }
    uint8_t *copy = (uint8_t *)malloc(len ? len : 1);
    if (copy == NULL)
        return -1;
    memcpy(copy, data, len);
    struct msgbuf *slot = &sub->backlog[(sub->bl_head + sub->bl_len) % sub->bl_cap];
    slot->data = copy;
    slot->len = len;
    sub->bl_len++;
    return 0;
}

/* Type of a datagram with a valid header, else 0. */
static unsigned
msg_type(const uint8_t *p, size_t n)
{
    if (n < CIP_WIRE_HEADER_SIZE || RD(p, HEADER_MAGIC) != CIP_WIRE_MAGIC ||
        RD(p, HEADER_VERSION) != CIP_WIRE_VERSION)
        return 0;
    return (unsigned)RD(p, HEADER_TYPE);
}

/* A REFUSE's reason, printable, into out; -1 if malformed. */
static int
refuse_reason(const uint8_t *p, size_t n, char *out, size_t cap)
{
    if (n < CIP_WIRE_REFUSE_SIZE)
        return -1;
    uint64_t len = RD(p, REFUSE_LEN);
    if (len > CIP_WIRE_MAX_REFUSE_REASON || n != CIP_WIRE_REFUSE_SIZE + len)
        return -1;
    size_t k = 0;
    for (uint64_t i = 0; i < len && k + 1 < cap; i++) {
        uint8_t c = p[CIP_WIRE_REFUSE_SIZE + i];
        out[k++] = (c < 0x20 || c == 0x7F) ? '?' : (char)c;
    }
    out[k] = '\0';
    return 0;
}

static int
producer_dead(cip_sub *sub)
{
    if (sub->pidfd < 0)
        return 0;
    struct pollfd p = {sub->pidfd, POLLIN, 0};
    return poll(&p, 1, 0) > 0;
}

/* Whether the producer's pidfd becomes readable (it exited) within `ms`. */
static int
producer_dies_within(cip_sub *sub, int ms)
{
    if (sub->pidfd < 0)
        return 0;
    long long deadline = now_ms() + ms;
    for (;;) {
        struct pollfd p = {sub->pidfd, POLLIN, 0};
        int r = poll(&p, 1, left_ms(deadline));
        if (r > 0)
            return 1;
        if (r == 0 || errno != EINTR)
            return 0;
    }
}

/* The frame flags the answers read: the page, or after cip_sub_close its last words. */
static volatile uint32_t *
answer_flags(const cip_sub *sub)
{
    return sub->page != NULL ? sub->page : sub->final_flags;
}

static int
flag_reached(const cip_sub *sub, uint32_t slot, uint32_t value)
{
    return (int32_t)(flag_load(sub->page, slot) - value) >= 0;
}

/* Whether a stream of ours waits (or may wait) on a frame flag that is not set. */
static int
waits_pending(const cip_sub *sub)
{
    return sub->page != NULL && book_pending(&sub->book, sub->page);
}

/* The producer is dead: write, from the host, every frame flag a stream of ours waits
 * on and that it will never write, so that no stream waits forever: the flag's last
 * real value plus CIP_WIRE_SYNC_FORCED (cip_flag_force), as the Python subscriber
 * does, which satisfies every wait on it (GEQ, cyclic) and keeps cip_flag_state
 * exact, in every process that maps the page, for every frame of the slot. */
static void
resolve_waits(cip_sub *sub)
{
    if (sub->page == NULL || !producer_dead(sub))
        return;
    book_resolve(&sub->book, sub->page);
}

static cip_status protocol_error(cip_sub *sub);

/* The publisher hung up (or died): read everything still queued.  An eviction notice
 * among it means no queued frame may be used (a malformed one: the protocol error,
 * reported now); a BYE keeps the frames before it; a hang-up without either ends the
 * stream, queued frames dropped. */
static void
scan_after_hangup(cip_sub *sub)
{
    int reset = 0;
    if (sub->sock >= 0) {
        for (;;) {
            ssize_t n = recv(sub->sock, sub->buf, CIP_WIRE_MAX_FRAME_SIZE + 1, MSG_DONTWAIT);
            if (n < 0 && errno == EINTR)
                continue;
            if (n < 0 && errno == ECONNRESET && !reset) {
                reset = 1; /* reported once, before what is still queued */
                continue;
            }
            if (n <= 0)
                break;
            if (backlog_push(sub, sub->buf, (size_t)n) != 0)
                break;
        }
    }
    size_t bye = sub->bl_len;
    for (size_t i = 0; i < sub->bl_len; i++) {
        struct msgbuf *m = &sub->backlog[(sub->bl_head + i) % sub->bl_cap];
        unsigned type = msg_type(m->data, m->len);
        if (type == CIP_WIRE_REFUSE) {
            char reason[CIP_WIRE_MAX_REFUSE_REASON + 1];
            if (refuse_reason(m->data, m->len, reason, sizeof reason) != 0) {
                fail(CIP_ERR_PROTOCOL, "malformed REFUSE (%zu bytes)", m->len);
                protocol_error(sub); /* clears the backlog: no queued frame is handed out */
                return;
            }
            backlog_clear(sub);
            sub_end(sub, CIP_ERR_EVICTED, "the publisher evicted this subscriber: %s", reason);
            return;
        }
        if (type == CIP_WIRE_BYE && bye == sub->bl_len)
            bye = i;
    }
    if (bye == sub->bl_len) {
        backlog_clear(sub);
        /* its sockets close before its pidfd says it exited: while a stream of ours
         * waits on a flag, give its exit a moment to show, then set that flag */
        if (producer_dead(sub) ||
            (waits_pending(sub) && producer_dies_within(sub, (int)CIP_WIRE_DEATH_WAIT_MS))) {
            resolve_waits(sub);
            sub_end(sub, CIP_ERR_PUBLISHER_GONE,
                    "the publisher (pid %d) exited; frames still queued are dropped (their flags "
                    "may never be set)",
                    (int)sub->info.producer_pid);
        } else {
            sub_end(sub, CIP_ERR_PUBLISHER_GONE,
                    "the publisher hung up without BYE (it exited, or dropped this subscriber); "
                    "frames still queued are dropped");
        }
        return;
    }
    while (sub->bl_len > bye + 1) { /* nothing after a BYE counts */
        sub->bl_len--;
        free(sub->backlog[(sub->bl_head + sub->bl_len) % sub->bl_cap].data);
    }
}

/* One poll(0) of the socket's hang-up and the producer's pidfd. */
static int
hung_up(cip_sub *sub)
{
    struct pollfd p[2] = {{sub->sock, POLLRDHUP, 0}, {sub->pidfd, POLLIN, 0}};
    int n = sub->pidfd >= 0 ? 2 : 1;
    int r;
    do {
        r = poll(p, (nfds_t)n, 0);
    } while (r < 0 && errno == EINTR);
    return r > 0;
}

/* One RELEASE, without waiting: 1 sent, 0 no room in the socket, -1 failed (errno). */
static int
try_send_release(int sock, uint64_t seq, uint32_t slot)
{
    uint8_t msg[CIP_WIRE_RELEASE_SIZE];
    WR(msg, RELEASE_MAGIC, CIP_WIRE_MAGIC);
    WR(msg, RELEASE_VERSION, CIP_WIRE_VERSION);
    WR(msg, RELEASE_TYPE, CIP_WIRE_RELEASE);
    WR(msg, RELEASE_SEQ, seq);
    WR(msg, RELEASE_SLOT, slot);
    for (;;) {
        if (send(sock, msg, sizeof msg, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)sizeof msg)
            return 1;
        if (errno == EINTR)
            continue;
        return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
    }
}

static void
say_bye_and_close(cip_sub *sub)
{
    if (sub->sock < 0)
        return;
    /* the RELEASEs still owed go first, as far as the socket takes them (the hang-up
     * returns every lease anyway) */
    while (sub->owed_len && sub->ended == CIP_OK) {
        const struct owed_release *o = &sub->owed[sub->owed_head];
        if (try_send_release(sub->sock, o->seq, o->slot) <= 0)
            break;
        sub->owed_head = (sub->owed_head + 1) % sub->owed_alloc;
        sub->owed_len--;
    }
    sub->owed_len = 0;
    /* unread data would reset the peer instead of letting it read our BYE */
    while (recv(sub->sock, sub->buf, CIP_WIRE_MAX_FRAME_SIZE + 1, MSG_DONTWAIT) > 0)
        ;
    uint8_t bye[CIP_WIRE_HEADER_SIZE];
    WR(bye, HEADER_MAGIC, CIP_WIRE_MAGIC);
    WR(bye, HEADER_VERSION, CIP_WIRE_VERSION);
    WR(bye, HEADER_TYPE, CIP_WIRE_BYE);
    (void)!send(sub->sock, bye, sizeof bye, MSG_DONTWAIT | MSG_NOSIGNAL);
    close(sub->sock);
    sub->sock = -1;
}

static cip_status
protocol_error(cip_sub *sub)
{
    char why[sizeof tls_error];
    memcpy(why, tls_error, sizeof why);
    backlog_clear(sub);
    say_bye_and_close(sub);
    return sub_end(sub, CIP_ERR_PROTOCOL, "the connection was closed after a protocol error: %s",
                   why);
}

/* Sending a RELEASE failed other than for room: the publisher is gone; was this
 * subscriber dropped?  Owed RELEASEs are moot (the hang-up returned every lease). */
static cip_status
release_failed(cip_sub *sub)
{
    sub->owed_len = 0;
    scan_after_hangup(sub);
    if (sub->ended == CIP_ERR_EVICTED)
        return fail(CIP_ERR_EVICTED, "%s", sub->error);
    return CIP_OK;
}

/* Send the RELEASEs owed, oldest first, as far as the socket takes them now. */
static cip_status
flush_owed(cip_sub *sub)
{
    while (sub->owed_len) {
        if (sub->ended != CIP_OK || sub->sock < 0) {
            sub->owed_len = 0; /* nobody to send them to: the connection's end returned them */
            break;
        }
        const struct owed_release *o = &sub->owed[sub->owed_head];
        int r = try_send_release(sub->sock, o->seq, o->slot);
        if (r == 0)
            return CIP_OK; /* still full: kept, in order */
        if (r < 0)
            return release_failed(sub);
        sub->owed_head = (sub->owed_head + 1) % sub->owed_alloc;
        sub->owed_len--;
    }
    return CIP_OK;
}

/* Keep a RELEASE the socket did not take, behind the ones owed already. */
static cip_status
owe_release(cip_sub *sub, uint64_t seq, uint32_t slot)
{
    size_t limit = (size_t)CIP_WIRE_MAX_CREDIT + sub->info.num_slots;
    if (sub->owed_len >= limit) {
        cip_status st = sub_end(sub, CIP_ERR_TRANSPORT,
                                "the publisher has not read this subscriber's messages for %zu "
                                "RELEASEs, more than any credit allows (its socket stays full); "
                                "the subscription is closed",
                                sub->owed_len);
        say_bye_and_close(sub);
        return st;
    }
    if (sub->owed_len == sub->owed_alloc) {
        size_t alloc = sub->owed_alloc ? 2 * sub->owed_alloc : 16;
        struct owed_release *r = (struct owed_release *)ring_regrow(
            sub->owed, sizeof *r, &sub->owed_head, sub->owed_len, &sub->owed_alloc, alloc);
        if (r == NULL)
            return sub_end(sub, CIP_ERR_NO_MEMORY,
                           "out of memory keeping a RELEASE the publisher's socket did not take");
        sub->owed = r;
    }
    struct owed_release *o = &sub->owed[(sub->owed_head + sub->owed_len) % sub->owed_alloc];
    o->seq = seq;
    o->slot = slot;
    sub->owed_len++;
    return CIP_OK;
}

/* RELEASE of frame `seq` in `slot`, after every RELEASE still owed; never blocks. */
static cip_status
send_release(cip_sub *sub, uint64_t seq, uint32_t slot)
{
    if (sub->owed_len == 0) {
        int r = try_send_release(sub->sock, seq, slot);
        if (r > 0)
            return CIP_OK;
        if (r < 0)
            return release_failed(sub);
    }
    cip_status st = owe_release(sub, seq, slot);
    if (st != CIP_OK)
        return st;
    return flush_owed(sub);
}

/* Judge one message of a live stream: a FRAME we may use comes back as CIP_OK. */
static cip_status
judge(cip_sub *sub, const uint8_t *p, size_t n, uint64_t *seq, uint32_t *slot,
      const uint8_t **payload, uint32_t *plen)
{
    if (n < CIP_WIRE_HEADER_SIZE) {
        fail(CIP_ERR_PROTOCOL, "message of %zu bytes is shorter than the %d-byte header", n,
             CIP_WIRE_HEADER_SIZE);
        return protocol_error(sub);
    }
    if (RD(p, HEADER_MAGIC) != CIP_WIRE_MAGIC) {
        fail(CIP_ERR_PROTOCOL, "bad magic 0x%04llx (expected 0x%04x)",
             (unsigned long long)RD(p, HEADER_MAGIC), CIP_WIRE_MAGIC);
        return protocol_error(sub);
    }
    if (RD(p, HEADER_VERSION) != CIP_WIRE_VERSION) {
        fail(CIP_ERR_PROTOCOL, "unsupported protocol version %llu (this side speaks %u)",
             (unsigned long long)RD(p, HEADER_VERSION), CIP_WIRE_VERSION);
        return protocol_error(sub);
    }
    unsigned type = (unsigned)RD(p, HEADER_TYPE);
    if (type == CIP_WIRE_FRAME) {
        if (n < CIP_WIRE_FRAME_SIZE) {
            fail(CIP_ERR_PROTOCOL, "truncated FRAME (%zu bytes)", n);
            return protocol_error(sub);
        }
        uint64_t s = RD(p, FRAME_SEQ), sl = RD(p, FRAME_SLOT), len = RD(p, FRAME_LEN);
        if (len > CIP_WIRE_MAX_FRAME_PAYLOAD || n != CIP_WIRE_FRAME_SIZE + len) {
            fail(CIP_ERR_PROTOCOL, "FRAME length field says %llu bytes but the message carries %zu",
                 (unsigned long long)len, n - CIP_WIRE_FRAME_SIZE);
            return protocol_error(sub);
        }
        if (sl >= sub->info.num_slots) {
            fail(CIP_ERR_PROTOCOL, "frame %llu names slot %llu of %u", (unsigned long long)s,
                 (unsigned long long)sl, sub->info.num_slots);
            return protocol_error(sub);
        }
        if (s < sub->info.next_seq || (sub->have_seq && s <= sub->last_seq)) {
            fail(CIP_ERR_PROTOCOL, "frame %llu arrived after frame %llu (or before the first, %llu)",
                 (unsigned long long)s, (unsigned long long)sub->last_seq,
                 (unsigned long long)sub->info.next_seq);
            return protocol_error(sub);
        }
        if (sub->held[sl].held) {
            fail(CIP_ERR_PROTOCOL, "frame %llu is in slot %llu, where this subscriber still holds "
                                   "frame %llu",
                 (unsigned long long)s, (unsigned long long)sl,
                 (unsigned long long)sub->held[sl].seq);
            return protocol_error(sub);
        }
        sub->have_seq = 1;
        sub->last_seq = s;
        *seq = s;
        *slot = (uint32_t)sl;
        *payload = p + CIP_WIRE_FRAME_SIZE;
        *plen = (uint32_t)len;
        return CIP_OK;
    }
    if (type == CIP_WIRE_BYE) {
        if (n != CIP_WIRE_HEADER_SIZE) {
            fail(CIP_ERR_PROTOCOL, "BYE must be %d bytes, got %zu", CIP_WIRE_HEADER_SIZE, n);
            return protocol_error(sub);
        }
        backlog_clear(sub);
        return sub_end(sub, CIP_ERR_END_OF_STREAM, "the publisher said BYE");
    }
    if (type == CIP_WIRE_REFUSE) {
        char reason[CIP_WIRE_MAX_REFUSE_REASON + 1];
        if (refuse_reason(p, n, reason, sizeof reason) != 0) {
            fail(CIP_ERR_PROTOCOL, "malformed REFUSE (%zu bytes)", n);
            return protocol_error(sub);
        }
        backlog_clear(sub);
        return sub_end(sub, CIP_ERR_EVICTED, "the publisher evicted this subscriber: %s", reason);
    }
    fail(CIP_ERR_PROTOCOL, "unexpected message of type %u from the publisher", type);
    return protocol_error(sub);
}

/* The next frame we may use, or how the stream ended; nothing is marked held. */
static cip_status
next_frame(cip_sub *sub, int timeout_ms, uint64_t *seq, uint32_t *slot, const uint8_t **payload,
           uint32_t *plen)
{
    if (sub->closed)
        return fail(CIP_ERR_INVALID_ARGUMENT, "the subscription is closed");
    if (sub->ended != CIP_OK)
        return fail(sub->ended, "%s", sub->error);
    long long deadline = deadline_of(timeout_ms);
    for (;;) {
        if (sub->bl_len) {
            struct msgbuf m = sub->backlog[sub->bl_head];
            sub->bl_head = (sub->bl_head + 1) % sub->bl_cap;
            sub->bl_len--;
            memcpy(sub->buf, m.data, m.len);
            free(m.data);
            return judge(sub, sub->buf, m.len, seq, slot, payload, plen);
        }
        if (sub->owed_len) { /* RELEASEs the socket did not take before: first */
            cip_status st = flush_owed(sub);
            if (st != CIP_OK)
                return st;
            if (sub->ended != CIP_OK)
                return fail(sub->ended, "%s", sub->error);
        }
        short events = (short)(POLLIN | (sub->owed_len ? POLLOUT : 0));
        struct pollfd p[2] = {{sub->sock, events, 0}, {sub->pidfd, POLLIN, 0}};
        int r = poll(p, sub->pidfd >= 0 ? 2 : 1, left_ms(deadline));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return sub_end(sub, CIP_ERR_TRANSPORT, "poll: %s", strerror(errno));
        if (r == 0)
            return fail(CIP_ERR_TIMEOUT, "no frame within %d ms", timeout_ms);
        if (sub->pidfd >= 0 && p[1].revents) {
            scan_after_hangup(sub); /* ends the stream: evicted, or the producer's death */
            if (sub->ended != CIP_OK)
                return fail(sub->ended, "%s", sub->error);
            continue;
        }
        if ((p[0].revents & ~POLLOUT) == 0)
            continue; /* only room for the RELEASEs owed: sent at the top */
        ssize_t n = recv(sub->sock, sub->buf, CIP_WIRE_MAX_FRAME_SIZE + 1, MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            continue;
        if (n <= 0) { /* reset, closed, failed: the end, or what is still queued */
            int err = n < 0 ? errno : 0;
            scan_after_hangup(sub);
            if (sub->ended != CIP_OK)
                return fail(sub->ended, "%s", sub->error);
            if (!sub->bl_len)
                return sub_end(sub, CIP_ERR_PUBLISHER_GONE,
                               "the connection to the publisher failed: %s",
                               err ? strerror(err) : "closed");
            continue;
        }
        /* Taken from the socket: hand it out only if the publisher has not hung up
         * meanwhile; if it has, what is queued behind it decides (an eviction notice). */
        if (hung_up(sub)) {
            if (backlog_push(sub, sub->buf, (size_t)n) != 0)
                return fail(CIP_ERR_NO_MEMORY, "out of memory");
            scan_after_hangup(sub);
            if (sub->ended != CIP_OK)
                return fail(sub->ended, "%s", sub->error);
            continue;
        }
        return judge(sub, sub->buf, (size_t)n, seq, slot, payload, plen);
    }
}

void
cip_sub_options_init(cip_sub_options *opts)
{
    if (opts == NULL)
        return;
    memset(opts, 0, sizeof *opts);
    opts->mode = CIP_MODE_BLOCK;
    opts->timeout_ms = 10000;
    opts->device = -1;
}

static cip_status
handshake(cip_sub *sub, const cip_sub_options *o)
{
    long long deadline = deadline_of(o->timeout_ms);
    int err = 0;
    cip_status st = connect_unix(sub->path, SOCK_SEQPACKET, deadline, &sub->sock, &err);
    if (st == CIP_ERR_TIMEOUT)
        return fail(st, "cannot connect to the publisher at %s within %d ms: its listen backlog "
                        "stayed full",
                    sub->path, o->timeout_ms);
    if (st != CIP_OK) {
        if (st != CIP_ERR_TRANSPORT)
            return st;
        const char *hint = err == EACCES ? " (the socket is private to the publisher's uid: "
                                           "allow yours there)"
                           : (err == ENOENT || err == ECONNREFUSED) ? " (is the publisher running?)"
                                                                    : "";
        return fail(st, "cannot connect to the publisher at %s: %s%s", sub->path, strerror(err),
                    hint);
    }
    /* who is there, before anything is sent to it or read from it: a peer that is not
     * allowed gets nothing, not even a BYE (the socket is closed here) */
    struct ucred cred;
    socklen_t clen = sizeof cred;
    if (getsockopt(sub->sock, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0) {
        int e = errno;
        close(sub->sock);
        sub->sock = -1;
        return fail(CIP_ERR_TRANSPORT, "SO_PEERCRED on %s: %s; nothing was sent to it",
                    sub->path, strerror(e));
    }
    sub->info.producer_pid = cred.pid;
    sub->info.producer_uid = cred.uid;
    uint32_t own = (uint32_t)geteuid();
    const uint32_t *allowed = o->allowed_uids ? o->allowed_uids : &own;
    size_t n_allowed = o->allowed_uids ? o->n_allowed_uids : 1;
    int ok = 0;
    for (size_t i = 0; i < n_allowed; i++)
        ok |= allowed[i] == cred.uid;
    if (!ok) {
        close(sub->sock);
        sub->sock = -1;
        return fail(CIP_ERR_REFUSED,
                    "the publisher at %s runs as uid %u, which is not among the allowed uids; "
                    "nothing was sent to it",
                    sub->path, (unsigned)cred.uid);
    }
    if (cred.pid > 0) {
        /* readable once the producer exits */
        sub->pidfd = (int)syscall(CIP_SYS_PIDFD_OPEN, cred.pid, 0);
        if (sub->pidfd >= 0)
            fcntl(sub->pidfd, F_SETFD, FD_CLOEXEC);
    }
    uint8_t hello[CIP_WIRE_HELLO_SIZE];
    memset(hello, 0, sizeof hello);
    WR(hello, HELLO_MAGIC, CIP_WIRE_MAGIC);
    WR(hello, HELLO_VERSION, CIP_WIRE_VERSION);
    WR(hello, HELLO_TYPE, CIP_WIRE_HELLO);
    WR(hello, HELLO_MODE, (uint64_t)o->mode);
    WR(hello, HELLO_CREDIT, sub->info.credit);
    WR(hello, HELLO_PID, (uint64_t)getpid());
    WR(hello, HELLO_LEN, 0);
    /* a publisher that refuses at once may close before the HELLO: its REFUSE is queued */
    (void)!send(sub->sock, hello, sizeof hello, MSG_NOSIGNAL);

    size_t cap = CIP_WIRE_MAX_WELCOME_SIZE + 1;
    uint8_t *buf = (uint8_t *)malloc(cap);
    if (buf == NULL)
        return fail(CIP_ERR_NO_MEMORY, "out of memory");
    union {
        char buf[CMSG_SPACE(CIP_WIRE_MAX_FDS * sizeof(int))];
        struct cmsghdr align;
    } control;
    int fds[CIP_WIRE_MAX_FDS + 1];
    size_t nfds = 0;
    int reset = 0, excess = 0; /* excess: not looked at (more fds than fit: MSG_CTRUNC) */
    ssize_t n;
    int flags = 0;
    for (;;) {
        struct pollfd p = {sub->sock, POLLIN, 0};
        int r = poll(&p, 1, left_ms(deadline));
        if (r < 0 && errno == EINTR)
            continue;
        if (r == 0) {
            free(buf);
            return fail(CIP_ERR_TIMEOUT, "the publisher at %s did not answer within %d ms",
                        sub->path, o->timeout_ms);
        }
        n = recv_with_fds(sub->sock, buf, cap, control.buf, sizeof control.buf, fds, &nfds,
                          CIP_WIRE_MAX_FDS, &excess, &flags);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            continue;
        if (n < 0 && errno == ECONNRESET && !reset) {
            reset = 1; /* reported once; a REFUSE may still be queued behind it */
            continue;
        }
        if (n < 0) {
            int e = errno;
            free(buf);
            if (e == ECONNRESET)
                return fail(CIP_ERR_PUBLISHER_GONE,
                            "the publisher at %s reset the connection during the handshake (it "
                            "exited or was killed)",
                            sub->path);
            return fail(CIP_ERR_TRANSPORT, "the handshake with %s failed: %s", sub->path,
                        strerror(e));
        }
        break;
    }
    st = CIP_OK;
    unsigned type = 0;
    if (flags & MSG_CTRUNC)
        st = fail(CIP_ERR_PROTOCOL, "the WELCOME carried more fds than fit (MSG_CTRUNC)");
    else if ((flags & MSG_TRUNC) || (size_t)n >= cap)
        st = fail(CIP_ERR_PROTOCOL, "the WELCOME is larger than the protocol allows");
    else if (n == 0)
        st = fail(CIP_ERR_PUBLISHER_GONE, "the publisher at %s closed during the handshake",
                  sub->path);
    else if ((size_t)n < CIP_WIRE_HEADER_SIZE)
        st = fail(CIP_ERR_PROTOCOL, "message of %zd bytes is shorter than the header", n);
    else if (RD(buf, HEADER_MAGIC) != CIP_WIRE_MAGIC)
        st = fail(CIP_ERR_PROTOCOL,
                  "%s is not a cupy_ipcpool publisher: it answered in another protocol "
                  "(bad magic 0x%04llx, expected 0x%04x)",
                  sub->path, (unsigned long long)RD(buf, HEADER_MAGIC), CIP_WIRE_MAGIC);
    else if (RD(buf, HEADER_VERSION) != CIP_WIRE_VERSION)
        st = fail(CIP_ERR_PROTOCOL, "unsupported protocol version %llu (this side speaks %u)",
                  (unsigned long long)RD(buf, HEADER_VERSION), CIP_WIRE_VERSION);
    else
        type = (unsigned)RD(buf, HEADER_TYPE);
    if (st == CIP_OK && type == CIP_WIRE_REFUSE) {
        char reason[CIP_WIRE_MAX_REFUSE_REASON + 1];
        if (refuse_reason(buf, (size_t)n, reason, sizeof reason) != 0)
            st = fail(CIP_ERR_PROTOCOL, "malformed REFUSE (%zd bytes)", n);
        else
            st = fail(CIP_ERR_REFUSED, "the publisher at %s refused: %s", sub->path, reason);
    } else if (st == CIP_OK && type != CIP_WIRE_WELCOME) {
        st = fail(CIP_ERR_PROTOCOL, "expected WELCOME, got a message of type %u", type);
    } else if (st == CIP_OK) {
        uint64_t num_slots = 0, credit = 0, len = 0;
        if ((size_t)n < CIP_WIRE_WELCOME_SIZE) {
            st = fail(CIP_ERR_PROTOCOL, "truncated WELCOME (%zd bytes)", n);
        } else {
            num_slots = RD(buf, WELCOME_NUM_SLOTS);
            credit = RD(buf, WELCOME_CREDIT);
            len = RD(buf, WELCOME_LEN);
            if (num_slots < 1 || num_slots > CIP_WIRE_MAX_SLOTS)
                st = fail(CIP_ERR_PROTOCOL, "WELCOME num_slots %llu is outside 1..%u",
                          (unsigned long long)num_slots, CIP_WIRE_MAX_SLOTS);
            else if (credit < 1)
                st = fail(CIP_ERR_PROTOCOL, "WELCOME credit must be at least 1");
            else if (len > CIP_WIRE_MAX_WELCOME_PAYLOAD ||
                     (size_t)n != CIP_WIRE_WELCOME_SIZE + len)
                st = fail(CIP_ERR_PROTOCOL,
                          "WELCOME length field says %llu bytes but the message carries %zu",
                          (unsigned long long)len, (size_t)n - CIP_WIRE_WELCOME_SIZE);
        }
        if (st == CIP_OK) {
            sub->info.sub_id = (uint32_t)RD(buf, WELCOME_SUB_ID);
            sub->info.num_slots = (uint32_t)num_slots;
            sub->info.next_seq = RD(buf, WELCOME_NEXT_SEQ);
            sub->info.credit = (uint32_t)credit;
            sub->info.lease_timeout_ms = (uint32_t)RD(buf, WELCOME_LEASE_TIMEOUT_MS);
            sub->welcome = (uint8_t *)malloc(len ? len : 1);
            sub->fds = (int *)malloc((nfds ? nfds : 1) * sizeof(int));
            sub->held = (struct held *)calloc(num_slots, sizeof(struct held));
            if (!sub->welcome || !sub->fds || !sub->held) {
                st = fail(CIP_ERR_NO_MEMORY, "out of memory");
            } else {
                memcpy(sub->welcome, buf + CIP_WIRE_WELCOME_SIZE, len);
                sub->welcome_len = len;
                memcpy(sub->fds, fds, nfds * sizeof(int));
                sub->nfds = nfds;
                nfds = 0;
            }
        }
    }
    free(buf);
    close_fds(fds, nfds);
    return st;
}

static cip_status
sub_open_raw(const char *path, const cip_sub_options *opts, cip_sub **out)
{
    cip_sub_options o;
    if (path == NULL || out == NULL)
        return fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_open: NULL argument");
    *out = NULL;
    if (opts == NULL)
        cip_sub_options_init(&o);
    else
        o = *opts;
    if (o.mode != CIP_MODE_BLOCK && o.mode != CIP_MODE_LATEST)
        return fail(CIP_ERR_INVALID_ARGUMENT, "mode must be CIP_MODE_BLOCK or CIP_MODE_LATEST");
    if (o.credit > CIP_WIRE_MAX_CREDIT)
        return fail(CIP_ERR_INVALID_ARGUMENT, "credit must be in 1..%u, not %u",
                    CIP_WIRE_MAX_CREDIT, o.credit);
    if (o.allowed_uids == NULL && o.n_allowed_uids)
        return fail(CIP_ERR_INVALID_ARGUMENT, "allowed_uids is NULL");
    cip_status checked = check_socket_path(path); /* before it is copied into sub->path */
    if (checked != CIP_OK)
        return checked;
    cip_sub *sub = (cip_sub *)calloc(1, sizeof *sub);
    if (sub == NULL)
        return fail(CIP_ERR_NO_MEMORY, "out of memory");
    sub->sock = sub->pidfd = -1;
    sub->info.mode = o.mode;
    sub->info.credit = o.credit ? o.credit
                                : (o.mode == CIP_MODE_LATEST ? 1 : CIP_WIRE_DEFAULT_BLOCK_CREDIT);
    snprintf(sub->path, sizeof sub->path, "%s", path);
    sub->buf = (uint8_t *)malloc(CIP_WIRE_MAX_FRAME_SIZE + 1);
    cip_status st = sub->buf ? handshake(sub, &o) : fail(CIP_ERR_NO_MEMORY, "out of memory");
    if (st != CIP_OK) {
        cip_sub_free(sub);
        return st;
    }
    *out = sub;
    return CIP_OK;
}

cip_status
cip_sub_open_raw(const char *path, const cip_sub_options *opts, cip_sub **out)
{
    return sub_open_raw(path, opts, out);
}

cip_status
cip_sub_get_info(const cip_sub *sub, cip_sub_info *info)
{
    if (sub == NULL || info == NULL)
        return fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_get_info: NULL argument");
    *info = sub->info;
    return CIP_OK;
}

cip_status
cip_sub_welcome_payload(const cip_sub *sub, const uint8_t **payload, size_t *len)
{
    if (sub == NULL || payload == NULL || len == NULL)
        return fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_welcome_payload: NULL argument");
    *payload = sub->welcome;
    *len = sub->welcome_len;
    return CIP_OK;
}

cip_status
cip_sub_take_fds(cip_sub *sub, int *fds, size_t cap, size_t *count)
{
    if (sub == NULL || count == NULL || (fds == NULL && cap))
        return fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_take_fds: NULL argument");
    if (sub->gpu)
        return fail(CIP_ERR_INVALID_ARGUMENT, "the fds of a GPU subscription are its own");
    *count = sub->nfds;
    size_t k = sub->nfds < cap ? sub->nfds : cap;
    memcpy(fds, sub->fds, k * sizeof(int));
    close_fds(sub->fds + k, sub->nfds - k);
    sub->nfds = 0;
    return CIP_OK;
}

int
cip_sub_device(const cip_sub *sub)
{
    return sub && sub->pool ? sub->pool->device : -1;
}

int
cip_sub_fileno(const cip_sub *sub)
{
    return sub ? sub->sock : -1;
}

const char *
cip_sub_error(const cip_sub *sub)
{
    return sub ? sub->error : "";
}

cip_status
cip_sub_recv_raw(cip_sub *sub, int timeout_ms, cip_raw_frame *frame)
{
    if (sub == NULL || frame == NULL)
        return fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_recv_raw: NULL argument");
    if (sub->gpu)
        return fail(CIP_ERR_INVALID_ARGUMENT, "a GPU subscription receives with cip_sub_recv");
    uint64_t seq;
    uint32_t slot, len;
    const uint8_t *payload;
    cip_status st = next_frame(sub, timeout_ms, &seq, &slot, &payload, &len);
    if (st != CIP_OK)
        return st;
    sub->held[slot].held = 1;
    sub->held[slot].seq = seq;
    frame->seq = seq;
    frame->slot = slot;
    frame->payload = payload;
    frame->payload_len = len;
    return CIP_OK;
}

static void
forget(cip_sub *sub, uint32_t slot)
{
    sub->held[slot].held = 0;
}

/* A release: no flag write and no message once the publisher has hung up. */
static cip_status
release_slot(cip_sub *sub, uint32_t slot, void *stream, int write)
{
    struct held *h = &sub->held[slot];
    if (sub->ended != CIP_OK || sub->sock < 0) {
        forget(sub, slot);
        if (sub->ended == CIP_ERR_EVICTED)
            return fail(CIP_ERR_EVICTED, "%s", sub->error);
        return CIP_OK;
    }
    if (hung_up(sub)) {
        scan_after_hangup(sub);
        forget(sub, slot);
        if (sub->ended == CIP_ERR_EVICTED)
            return fail(CIP_ERR_EVICTED, "%s", sub->error);
        return CIP_OK;
    }
    if (write) {
        CUdeviceptr addr = sub->page_dev + sub->reads_offset +
                           ((size_t)sub->row * sub->info.num_slots + slot) * CIP_WIRE_SYNC_FLAG_BYTES;
        CUresult rc = drv.StreamWriteValue32(stream, addr, h->generation,
                                             CIP_CU_STREAM_WRITE_VALUE_DEFAULT);
        if (rc != CIP_CUDA_SUCCESS)
            return cuda_fail("cuStreamWriteValue32", rc); /* still held */
        if (drv.EventRecord(sub->ev_write[slot], stream) == CIP_CUDA_SUCCESS)
            sub->write_recorded[slot] = 1;
        else
            sub->untracked = 1;
    }
    uint64_t seq = h->seq;
    forget(sub, slot);
    return send_release(sub, seq, slot);
}

cip_status
cip_sub_release_raw(cip_sub *sub, uint64_t seq, uint32_t slot)
{
    if (sub == NULL)
        return fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_release_raw: NULL argument");
    if (sub->gpu)
        return fail(CIP_ERR_INVALID_ARGUMENT, "a GPU subscription releases with cip_sub_release");
    if (sub->closed)
        return fail(CIP_ERR_INVALID_ARGUMENT, "the subscription is closed");
    if (slot >= sub->info.num_slots || !sub->held[slot].held || sub->held[slot].seq != seq)
        return fail(CIP_ERR_NOT_HELD, "release of frame %llu in slot %u, which is not held",
                    (unsigned long long)seq, slot);
    return release_slot(sub, slot, NULL, 0);
}

/* ---- the GPU subscription ------------------------------------------------------------ */

/* Check the WELCOME payload and the sync page's fd (no GPU involved), then map and
 * register the page and attach the pool. */
static cip_status
gpu_setup(cip_sub *sub, int device)
{
    const uint8_t *p = sub->welcome;
    size_t len = sub->welcome_len;
    uint32_t n = sub->info.num_slots;
    if (len < CIP_WIRE_WELCOME_HEAD_SIZE) {
        fail(CIP_ERR_PROTOCOL, "WELCOME payload too short (%zu bytes)", len);
        return protocol_error(sub);
    }
    uint64_t desc_len = RD(p, WELCOME_HEAD_DESC_LEN), n_slots = RD(p, WELCOME_HEAD_NUM_SLOTS);
    uint64_t max_subs = RD(p, WELCOME_HEAD_MAX_SUBSCRIBERS), row = RD(p, WELCOME_HEAD_ROW);
    uint64_t sync_nbytes = RD(p, WELCOME_HEAD_SYNC_NBYTES);
    if (n_slots != n || len != CIP_WIRE_WELCOME_HEAD_SIZE + desc_len || !(row < max_subs) ||
        max_subs > 65536 || sub->nfds != (size_t)n + 1) {
        fail(CIP_ERR_PROTOCOL,
             "WELCOME does not add up: %llu slots (session says %u), %zu payload bytes for a "
             "%llu-byte descriptor, row %llu of %llu, %zu fds",
             (unsigned long long)n_slots, n, len, (unsigned long long)desc_len,
             (unsigned long long)row, (unsigned long long)max_subs, sub->nfds);
        return protocol_error(sub);
    }
    cip_descriptor d;
    if (cip_parse_descriptor(p + CIP_WIRE_WELCOME_HEAD_SIZE, (size_t)desc_len, &d) != CIP_OK) {
        char why[sizeof tls_error];
        memcpy(why, tls_error, sizeof why);
        fail(CIP_ERR_PROTOCOL, "bad pool descriptor in WELCOME: %s", why);
        return protocol_error(sub);
    }
    if (d.num_slots != n) {
        fail(CIP_ERR_PROTOCOL, "WELCOME announces %u slots, the descriptor %u", n, d.num_slots);
        return protocol_error(sub);
    }
    size_t reads = 0, nbytes = 0;
    if (cip_sync_layout(n, (uint32_t)max_subs, &reads, &nbytes) != CIP_OK) {
        char why[sizeof tls_error];
        memcpy(why, tls_error, sizeof why);
        fail(CIP_ERR_PROTOCOL, "WELCOME: %s", why);
        return protocol_error(sub);
    }
    if (sync_nbytes != nbytes) {
        fail(CIP_ERR_PROTOCOL,
             "the WELCOME announces a %llu-byte sync page; %u slots and %llu rows take %zu",
             (unsigned long long)sync_nbytes, n, (unsigned long long)max_subs, nbytes);
        return protocol_error(sub);
    }
    int page_fd = sub->fds[n];
    struct stat st;
    int seals = fcntl(page_fd, F_GET_SEALS);
    if (fstat(page_fd, &st) != 0 || seals < 0) {
        fail(CIP_ERR_PROTOCOL, "the sync page fd is no sealed memfd (%s)", strerror(errno));
        return protocol_error(sub);
    }
    if (!S_ISREG(st.st_mode) || (seals & CIP_WIRE_SYNC_SEALS) != CIP_WIRE_SYNC_SEALS) {
        fail(CIP_ERR_PROTOCOL,
             "the sync page fd is not sealed against shrinking and growing (seals 0x%x); "
             "refusing to map it",
             seals);
        return protocol_error(sub);
    }
    if ((uint64_t)st.st_size != nbytes) {
        fail(CIP_ERR_PROTOCOL, "the sync page is %lld bytes, the WELCOME says %zu",
             (long long)st.st_size, nbytes);
        return protocol_error(sub);
    }
    /* everything checked: now the GPU */
    cip_status status = driver();
    if (status != CIP_OK)
        return status;
    void *m = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, page_fd, 0);
    if (m == MAP_FAILED)
        return fail(CIP_ERR_TRANSPORT, "mapping the sync page failed: %s", strerror(errno));
    close(page_fd);
    sub->fds[n] = -1;
    sub->page = (volatile uint32_t *)m;
    sub->page_nbytes = nbytes;
    sub->reads_offset = reads;
    sub->row = (uint32_t)row;
    sub->max_subs = (uint32_t)max_subs;
    sub->ev_wait = (CUevent *)calloc(n, sizeof(CUevent));
    sub->ev_write = (CUevent *)calloc(n, sizeof(CUevent));
    sub->wait_recorded = (uint8_t *)calloc(n, 1);
    sub->write_recorded = (uint8_t *)calloc(n, 1);
    if (!sub->ev_wait || !sub->ev_write || !sub->wait_recorded || !sub->write_recorded ||
        book_init(&sub->book, n, CIP_WIRE_SYNC_RECORD_CAP) != 0)
        return fail(CIP_ERR_NO_MEMORY, "out of memory");
    status = attach_fds(&d, sub->fds, n, device, &sub->pool); /* closes the slot fds */
    sub->nfds = 0;
    if (status != CIP_OK)
        return status;
    if ((status = ctx_push(sub->pool->device)) != CIP_OK)
        return status;
    CUresult rc = drv.MemHostRegister(m, nbytes,
                                      CIP_CU_MEMHOSTREGISTER_PORTABLE | CIP_CU_MEMHOSTREGISTER_DEVICEMAP);
    if (rc != CIP_CUDA_SUCCESS) {
        status = cuda_fail("cuMemHostRegister", rc);
    } else {
        sub->registered = 1;
        rc = drv.MemHostGetDevicePointer(&sub->page_dev, m, 0);
        if (rc != CIP_CUDA_SUCCESS)
            status = cuda_fail("cuMemHostGetDevicePointer", rc);
    }
    for (uint32_t i = 0; i < n && status == CIP_OK; i++) {
        rc = drv.EventCreate(&sub->ev_wait[i], CIP_CU_EVENT_DISABLE_TIMING);
        if (rc == CIP_CUDA_SUCCESS)
            rc = drv.EventCreate(&sub->ev_write[i], CIP_CU_EVENT_DISABLE_TIMING);
        if (rc != CIP_CUDA_SUCCESS)
            status = cuda_fail("cuEventCreate", rc);
    }
    ctx_pop();
    return status;
}

cip_status
cip_sub_open(const char *path, const cip_sub_options *opts, cip_sub **out)
{
    cip_sub *sub = NULL;
    cip_status st = sub_open_raw(path, opts, &sub);
    if (st != CIP_OK)
        return st;
    sub->gpu = 1;
    st = gpu_setup(sub, opts ? opts->device : -1);
    if (st != CIP_OK) {
        char why[sizeof tls_error];
        memcpy(why, tls_error, sizeof why);
        cip_sub_free(sub);
        return fail(st, "%s", why);
    }
    *out = sub;
    return CIP_OK;
}

cip_status
cip_sub_recv(cip_sub *sub, int timeout_ms, cip_frame *frame)
{
    if (sub == NULL || frame == NULL)
        return fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_recv: NULL argument");
    if (!sub->gpu)
        return fail(CIP_ERR_RAW_SESSION, "cip_sub_recv needs cip_sub_open; use cip_sub_recv_raw");
    uint64_t seq;
    uint32_t slot, len;
    const uint8_t *payload;
    cip_status st = next_frame(sub, timeout_ms, &seq, &slot, &payload, &len);
    if (st != CIP_OK)
        return st;
    struct held *h = &sub->held[slot];
    if (h->arrays == NULL)
        h->arrays = (cip_array *)malloc(CIP_MAX_ARRAYS * sizeof(cip_array));
    if (h->meta == NULL)
        h->meta = (uint8_t *)malloc(CIP_MAX_METADATA);
    if (h->arrays == NULL || h->meta == NULL)
        return fail(CIP_ERR_NO_MEMORY, "out of memory");
    cip_pool *pool = sub->pool;
    cip_frame f;
    int void_frame = 0;
    st = parse_frame_payload(payload, len, seq, slot, pool->desc.slot_nbytes, pool->ptrs[slot],
                             h->arrays, CIP_MAX_ARRAYS, &f, &void_frame);
    if (st != CIP_OK)
        return protocol_error(sub);
    for (uint32_t i = 0; i < f.num_arrays; i++) {
        if (h->arrays[i].generation < pool->seen[slot]) {
            fail(CIP_ERR_PROTOCOL,
                 "frame %llu: handle for slot %u is of generation %llu; generation %llu has been "
                 "received since, so its memory was reused",
                 (unsigned long long)seq, slot, (unsigned long long)h->arrays[i].generation,
                 (unsigned long long)pool->seen[slot]);
            return protocol_error(sub);
        }
        pool->seen[slot] = h->arrays[i].generation;
    }
    if (cip_flag_state(flag_load(sub->page, slot), f.generation) != 1 && producer_dead(sub)) {
        backlog_clear(sub);
        resolve_waits(sub);
        return sub_end(sub, CIP_ERR_PUBLISHER_GONE,
                       "the publisher (pid %d) exited before frame %llu was complete; frames "
                       "still queued are dropped",
                       (int)sub->info.producer_pid, (unsigned long long)seq);
    }
    /* received: recorded unless the host sees it written already */
    book_received(&sub->book, sub->page, seq, slot, f.generation);
    memcpy(h->meta, f.metadata, f.metadata_len);
    f.metadata = h->meta;
    h->held = 1;
    h->seq = seq;
    h->generation = f.generation;
    if (void_frame) {
        h->void_seen = 1;
        h->void_generation = f.generation;
    }
    *frame = f;
    return CIP_OK;
}

static cip_status
check_held(cip_sub *sub, const cip_frame *frame)
{
    if (sub == NULL || frame == NULL)
        return fail(CIP_ERR_INVALID_ARGUMENT, "NULL argument");
    if (!sub->gpu)
        return fail(CIP_ERR_RAW_SESSION, "a raw session has no sync page");
    if (sub->closed)
        return fail(CIP_ERR_INVALID_ARGUMENT, "the subscription is closed");
    if (frame->slot >= sub->info.num_slots || !sub->held[frame->slot].held ||
        sub->held[frame->slot].seq != frame->seq)
        return fail(CIP_ERR_NOT_HELD, "frame %llu in slot %u is not held",
                    (unsigned long long)frame->seq, frame->slot);
    return CIP_OK;
}

cip_status
cip_frame_wait(cip_sub *sub, const cip_frame *frame, void *stream)
{
    cip_status st = check_held(sub, frame);
    if (st != CIP_OK)
        return st;
    uint32_t slot = frame->slot, value = sub->held[slot].generation;
    if (flag_reached(sub, slot, value))
        return CIP_OK; /* the producer's work is done and visible: nothing to wait for */
    if (sub->ended == CIP_ERR_PUBLISHER_GONE && producer_dead(sub))
        return fail(CIP_ERR_PUBLISHER_GONE,
                    "the publisher died before frame %llu was complete: its data may be partial",
                    (unsigned long long)frame->seq);
    CUdeviceptr addr = sub->page_dev + (CUdeviceptr)slot * CIP_WIRE_SYNC_FLAG_BYTES;
    CUresult rc = drv.StreamWaitValue32(stream, addr, value, CIP_CU_STREAM_WAIT_VALUE_GEQ);
    if (rc != CIP_CUDA_SUCCESS)
        return cuda_fail("cuStreamWaitValue32", rc);
    book_note(&sub->book, slot, value);
    if (drv.EventRecord(sub->ev_wait[slot], stream) == CIP_CUDA_SUCCESS)
        sub->wait_recorded[slot] = 1;
    else
        sub->untracked = 1;
    return CIP_OK;
}

int
cip_frame_complete(cip_sub *sub, const cip_frame *frame)
{
    if (sub == NULL || frame == NULL || !sub->gpu || answer_flags(sub) == NULL ||
        frame->slot >= sub->info.num_slots || !sub->have_seq || frame->seq < sub->info.next_seq ||
        frame->seq > sub->last_seq)
        return -1;
    const struct held *h = &sub->held[frame->slot];
    if (h->void_seen && h->void_generation == frame->generation)
        return 0; /* a void frame: taken and not published, never written */
    int state = cip_flag_state(flag_load(answer_flags(sub), frame->slot), frame->generation);
    if (state < 0 && sub->page != NULL && producer_dead(sub)) {
        /* it will never be written by the producer: force what we await (a frame not
         * seen set when received was noted), then the flag answers */
        resolve_waits(sub);
        state = cip_flag_state(flag_load(sub->page, frame->slot), frame->generation);
    }
    return state;
}

uint64_t
cip_sub_forced_flags(const cip_sub *sub)
{
    return sub ? sub->book.forced : 0;
}

cip_status
cip_sub_incomplete_frames(cip_sub *sub, uint64_t *seqs, size_t cap, size_t *count)
{
    if (sub == NULL || count == NULL || (seqs == NULL && cap))
        return fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_incomplete_frames: NULL argument");
    if (!sub->gpu)
        return fail(CIP_ERR_RAW_SESSION, "a raw session keeps no record of frame flags");
    *count = 0;
    if (answer_flags(sub) == NULL)
        return CIP_OK;
    resolve_waits(sub); /* only once the producer is dead (and the page still mapped) */
    *count = book_answers(&sub->book, answer_flags(sub), seqs, cap, NULL);
    return CIP_OK;
}

uint64_t
cip_sub_untracked_frames(const cip_sub *sub)
{
    return sub ? sub->book.untracked : 0;
}

cip_status
cip_sub_release(cip_sub *sub, const cip_frame *frame, void *stream)
{
    cip_status st = check_held(sub, frame);
    if (st != CIP_OK)
        return st;
    return release_slot(sub, frame->slot, stream, 1);
}

/* Wait for the flag operations we enqueued; resolve waits the dead producer left. */
static int
gpu_quiesce(cip_sub *sub)
{
    if (sub->untracked)
        return 0;
    long long deadline = now_ms() + (long long)CIP_WIRE_CLOSE_WAIT_MS;
    long delay = 50;
    for (;;) {
        int pending = 0;
        for (uint32_t s = 0; s < sub->info.num_slots; s++) {
            if (sub->wait_recorded[s]) {
                if (drv.EventQuery(sub->ev_wait[s]) == CIP_CUDA_ERROR_NOT_READY)
                    pending = 1;
                else
                    sub->wait_recorded[s] = 0;
            }
            if (sub->write_recorded[s]) {
                if (drv.EventQuery(sub->ev_write[s]) == CIP_CUDA_ERROR_NOT_READY)
                    pending = 1;
                else
                    sub->write_recorded[s] = 0;
            }
        }
        if (!pending)
            return 1;
        resolve_waits(sub); /* only acts once the producer is dead */
        if (now_ms() >= deadline)
            return 0;
        sleep_us(delay);
        delay = delay * 2 > 2000 ? 2000 : delay * 2;
    }
}

/* The answers after close: the frame flags as they are now (forced first if the
 * producer is dead), kept in the handle; 0, or -1 out of memory (then none). */
static int
freeze_answers(cip_sub *sub)
{
    if (!sub->gpu || sub->page == NULL)
        return 0;
    resolve_waits(sub);
    sub->final_flags = (uint32_t *)malloc((size_t)sub->info.num_slots * sizeof(uint32_t));
    if (sub->final_flags == NULL)
        return -1;
    for (uint32_t s = 0; s < sub->info.num_slots; s++)
        sub->final_flags[s] = flag_load(sub->page, s);
    return 0;
}

cip_status
cip_sub_close(cip_sub *sub)
{
    if (sub == NULL || sub->closed)
        return CIP_OK;
    char saved[sizeof tls_error], why[sizeof tls_error] = "";
    memcpy(saved, tls_error, sizeof saved);
    cip_status result = CIP_OK;
    int keep = 0;
    if (sub->gpu && sub->page != NULL && drv.status == CIP_OK) {
        int device = sub->pool ? sub->pool->device : -1;
        int pushed = device >= 0 && ctx_push(device) == CIP_OK;
        keep = !gpu_quiesce(sub);
        if (keep) {
            result = CIP_ERR_TIMEOUT;
            snprintf(why, sizeof why,
                     "%s: the sync page and the pool stay mapped (leaked) rather than unmapped "
                     "under a stream that may still wait on a frame flag",
                     sub->untracked ? "a flag operation of this subscription could not be tracked"
                                    : "the flag operations this subscription enqueued did not "
                                      "finish within 5 s (a producer alive but stalled?)");
        } else if (sub->registered &&
                   drv.MemHostUnregister((void *)sub->page) != CIP_CUDA_SUCCESS) {
            keep = 1;
            result = CIP_ERR_CUDA;
            snprintf(why, sizeof why,
                     "cuMemHostUnregister of the sync page failed: the page and the pool stay "
                     "mapped (leaked)");
        }
        for (uint32_t s = 0; s < sub->info.num_slots; s++) {
            if (sub->ev_wait && sub->ev_wait[s])
                drv.EventDestroy(sub->ev_wait[s]);
            if (sub->ev_write && sub->ev_write[s])
                drv.EventDestroy(sub->ev_write[s]);
        }
        if (pushed)
            ctx_pop();
        (void)freeze_answers(sub);
        if (!keep)
            munmap((void *)sub->page, sub->page_nbytes);
    } else if (sub->page != NULL) {
        (void)freeze_answers(sub);
        munmap((void *)sub->page, sub->page_nbytes);
    }
    sub->page = NULL;
    /* BYE only once our flag operations are done (or abandoned): the publisher may give
     * this row to a newcomer once we are gone, and a late read-flag write of ours would
     * land in its row (the Python subscriber's order) */
    if (sub->buf != NULL)
        say_bye_and_close(sub);
    else if (sub->sock >= 0)
        close(sub->sock);
    sub->sock = -1;
    /* a stream that may still wait on the page may still read the slots: keep both;
     * else the pool's close waits for this process's queued work on them */
    if (!keep) {
        cip_status st = cip_pool_close(sub->pool);
        if (st != CIP_OK) {
            result = st;
            memcpy(why, tls_error, sizeof why);
        }
    }
    sub->pool = NULL;
    if (sub->fds)
        close_fds(sub->fds, sub->nfds);
    if (sub->pidfd >= 0)
        close(sub->pidfd);
    sub->pidfd = -1;
    backlog_clear(sub);
    if (sub->held) {
        for (uint32_t s = 0; s < sub->info.num_slots; s++) {
            free(sub->held[s].arrays);
            free(sub->held[s].meta);
            sub->held[s].arrays = NULL;
            sub->held[s].meta = NULL;
        }
    }
    free(sub->backlog);
    free(sub->owed);
    free(sub->welcome);
    free(sub->fds);
    free(sub->buf);
    free(sub->ev_wait);
    free(sub->ev_write);
    free(sub->wait_recorded);
    free(sub->write_recorded);
    sub->backlog = NULL;
    sub->owed = NULL;
    sub->owed_len = sub->bl_len = 0;
    sub->welcome = NULL;
    sub->welcome_len = 0;
    sub->fds = NULL;
    sub->nfds = 0;
    sub->buf = NULL;
    sub->ev_wait = sub->ev_write = NULL;
    sub->wait_recorded = sub->write_recorded = NULL;
    sub->closed = 1; /* the handle, its answers (held, book, final_flags) and error stay */
    if (result != CIP_OK)
        return fail(result, "%s", why);
    memcpy(tls_error, saved, sizeof saved);
    return CIP_OK;
}

cip_status
cip_sub_free(cip_sub *sub)
{
    if (sub == NULL)
        return CIP_OK;
    cip_status st = cip_sub_close(sub);
    free(sub->held);
    book_free(&sub->book);
    free(sub->final_flags);
    free(sub);
    return st;
}
