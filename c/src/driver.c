/* driver.c -- the CUDA driver, loaded at run time: dlopen of libcuda, the function table,
 * contexts, devices (cip_internal.h says what the modules share). */
#include "cip_internal.h"

/* ---- the driver ---------------------------------------------------------------------- */

struct cipi_driver cipi_drv = {PTHREAD_ONCE_INIT};

static void *
proc(const char *name)
{
    void *pfn = NULL;
    CUresult rc;
    if (cipi_drv.getproc_v2 != NULL) {
        int found = 0;
        rc = cipi_drv.getproc_v2(name, &pfn, cipi_drv.version, 0, &found);
    } else if (cipi_drv.getproc_v1 != NULL) {
        rc = cipi_drv.getproc_v1(name, &pfn, cipi_drv.version, 0);
    } else {
        return dlsym(cipi_drv.lib, name);
    }
    return rc == CIP_CUDA_SUCCESS ? pfn : NULL;
}

static void
load_driver(void)
{
    cipi_drv.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (cipi_drv.lib == NULL) {
        const char *why = dlerror();
        cipi_drv.status = CIP_ERR_NO_DRIVER;
        snprintf(cipi_drv.error, sizeof cipi_drv.error,
                 "the CUDA driver (libcuda.so.1) cannot be loaded: %s; a GPU and its driver are "
                 "needed for this call",
                 why ? why : "not found");
        return;
    }
    /* POSIX's way to turn dlsym's answer into a function pointer */
    CUresult (*init)(unsigned int);
    CUresult (*version)(int *);
    *(void **)&init = dlsym(cipi_drv.lib, "cuInit");
    *(void **)&version = dlsym(cipi_drv.lib, "cuDriverGetVersion");
    *(void **)&cipi_drv.getproc_v2 = dlsym(cipi_drv.lib, "cuGetProcAddress_v2");
    if (cipi_drv.getproc_v2 == NULL)
        *(void **)&cipi_drv.getproc_v1 = dlsym(cipi_drv.lib, "cuGetProcAddress");
    int v = 0;
    if (init == NULL || version == NULL || version(&v) != CIP_CUDA_SUCCESS ||
        (cipi_drv.getproc_v1 == NULL && cipi_drv.getproc_v2 == NULL)) {
        cipi_drv.status = CIP_ERR_NO_DRIVER;
        snprintf(cipi_drv.error, sizeof cipi_drv.error,
                 "libcuda.so.1 lacks cuInit, cuDriverGetVersion or cuGetProcAddress: a CUDA 11.3 "
                 "or newer driver is needed");
        return;
    }
    cipi_drv.version = v < CIP_CUDA_API_VERSION ? v : CIP_CUDA_API_VERSION;
    CUresult rc = init(0);
    if (rc != CIP_CUDA_SUCCESS) {
        cipi_drv.status = CIP_ERR_NO_DRIVER;
        snprintf(cipi_drv.error, sizeof cipi_drv.error,
                 "cuInit failed with CUDA error %d (no usable GPU, or the driver is not loaded)",
                 rc);
        return;
    }
#define LOAD(field, name)                                                                  \
    do {                                                                                   \
        *(void **)&cipi_drv.field = proc(name);                                                 \
        if (cipi_drv.field == NULL) {                                                           \
            cipi_drv.status = CIP_ERR_NO_DRIVER;                                                \
            snprintf(cipi_drv.error, sizeof cipi_drv.error,                                          \
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
    cipi_drv.status = CIP_OK;
}

cip_status
cipi_driver(void)
{
    pthread_once(&cipi_drv.once, load_driver);
    if (cipi_drv.status != CIP_OK)
        return cipi_fail(cipi_drv.status, "%s", cipi_drv.error);
    return CIP_OK;
}

void *
cip_cuda_symbol(const char *name)
{
    if (name == NULL || cipi_driver() != CIP_OK)
        return NULL;
    return proc(name);
}

cip_status
cipi_cuda_fail(const char *call, CUresult rc)
{
    const char *name = NULL, *text = NULL;
    if (cipi_drv.GetErrorName == NULL || cipi_drv.GetErrorName(rc, &name) != CIP_CUDA_SUCCESS)
        name = NULL;
    if (cipi_drv.GetErrorString == NULL || cipi_drv.GetErrorString(rc, &text) != CIP_CUDA_SUCCESS)
        text = NULL;
    if (name != NULL)
        return cipi_fail(CIP_ERR_CUDA, "%s: %s (%s)", call, name, text ? text : "no description");
    return cipi_fail(CIP_ERR_CUDA, "%s: CUDA error %d", call, rc);
}

#define CIP_MAX_DEVICES 64
static CUcontext primary[CIP_MAX_DEVICES];
static pthread_mutex_t primary_lock = PTHREAD_MUTEX_INITIALIZER;

/* Make the device's primary context (the CUDA runtime's) current; pop with cipi_ctx_pop. */
cip_status
cipi_ctx_push(int device)
{
    if (device < 0 || device >= CIP_MAX_DEVICES)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "device %d out of range", device);
    pthread_mutex_lock(&primary_lock);
    CUresult rc = CIP_CUDA_SUCCESS;
    if (primary[device] == NULL) {
        CUdevice dev;
        rc = cipi_drv.DeviceGet(&dev, device);
        if (rc == CIP_CUDA_SUCCESS)
            rc = cipi_drv.DevicePrimaryCtxRetain(&primary[device], dev); /* kept for the process */
    }
    CUcontext ctx = primary[device];
    pthread_mutex_unlock(&primary_lock);
    if (rc != CIP_CUDA_SUCCESS)
        return cipi_cuda_fail("cuDevicePrimaryCtxRetain", rc);
    rc = cipi_drv.CtxPushCurrent(ctx);
    if (rc != CIP_CUDA_SUCCESS)
        return cipi_cuda_fail("cuCtxPushCurrent", rc);
    return CIP_OK;
}

cip_status
cip_use_device(int device)
{
    cip_status st = cipi_driver();
    if (st != CIP_OK)
        return st;
    if ((st = cipi_ctx_push(device)) != CIP_OK)
        return st;
    /* replace what was current with the primary context: pop ours, set it */
    CUcontext ctx;
    cipi_drv.CtxPopCurrent(&ctx);
    CUresult (*set)(CUcontext);
    *(void **)&set = proc("cuCtxSetCurrent");
    if (set == NULL)
        return cipi_fail(CIP_ERR_NO_DRIVER, "the driver has no cuCtxSetCurrent");
    CUresult rc = set(ctx);
    return rc == CIP_CUDA_SUCCESS ? CIP_OK : cipi_cuda_fail("cuCtxSetCurrent", rc);
}

void
cipi_ctx_pop(void)
{
    CUcontext ignored;
    cipi_drv.CtxPopCurrent(&ignored);
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
cip_status
cipi_resolve_device(const uint8_t *uuid, int device, int *out)
{
    int count = 0;
    CUresult rc = cipi_drv.DeviceGetCount(&count);
    if (rc != CIP_CUDA_SUCCESS)
        return cipi_cuda_fail("cuDeviceGetCount", rc);
    int home = -1;
    for (int i = 0; i < count && home < 0; i++) {
        CUdevice dev;
        cip_cuuuid id;
        if (cipi_drv.DeviceGet(&dev, i) == CIP_CUDA_SUCCESS &&
            cipi_drv.DeviceGetUuid(&id, dev) == CIP_CUDA_SUCCESS && memcmp(id.bytes, uuid, 16) == 0)
            home = i;
    }
    char hex[33];
    hex16(uuid, hex);
    if (device >= count || device < -1)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "device %d out of range (%d visible)", device,
                    count);
    if (home < 0)
        return cipi_fail(CIP_ERR_DEVICE,
                    "the exporter's GPU (uuid %s) is not visible in this process; check "
                    "CUDA_VISIBLE_DEVICES",
                    hex);
    if (device == -1 || device == home) {
        *out = home;
        return CIP_OK;
    }
    CUdevice a, b;
    int can = 0;
    if (cipi_drv.DeviceGet(&a, device) != CIP_CUDA_SUCCESS ||
        cipi_drv.DeviceGet(&b, home) != CIP_CUDA_SUCCESS ||
        cipi_drv.DeviceCanAccessPeer(&can, a, b) != CIP_CUDA_SUCCESS || !can)
        return cipi_fail(CIP_ERR_DEVICE, "device %d has no peer access to device %d, where the pool "
                                    "lives",
                    device, home);
    *out = device;
    return CIP_OK;
}
