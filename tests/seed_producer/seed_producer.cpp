// A C++ producer written to the documented behaviour of the seed class IPCBufferManager,
// for the tests of cupy_ipcpool.import_seed_buffers (tests/test_seedpeer_gpu.py).
//
//   seed_producer <buffers> <buffer_step> [device]
//
// It creates an IPCBufferManager(buffers, buffer_step), fills every buffer with a known
// pattern (32-bit word k of buffer i: k * 2654435761 + (i + 1) * 40503), and prints, on
// stdout, one line per buffer and then its sizes:
//
//   BUFFER <i> <pid> <fd> <device pointer>     (getCurIpcMemHandle() and getCurBufferPtr())
//   ALLOC <allocation bytes> GRANULARITY <bytes>
//   READY
//
// Then it waits for one line on stdin. "VERIFY" makes it check that the consumer wrote the
// bitwise NOT of the pattern into every word of every buffer: it prints "OK" and exits 0,
// or prints "MISMATCH ..." and exits 1. Anything else (or end of input) exits 3 unchecked.
// Bad arguments exit 2, a CUDA failure 4. It gives up after LIFETIME_S seconds (SIGALRM),
// so a consumer that never answers cannot keep it alive.
//
// Build: tests/seed_producer/build.sh [OUTDIR]  (g++, cuda.h, -lcuda).

#include <cuda.h>

#include <sys/types.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr unsigned LIFETIME_S = 120;

void check(CUresult res, const char* call)
{
    if (res != CUDA_SUCCESS)
    {
        const char* name = nullptr;
        cuGetErrorName(res, &name);
        throw std::runtime_error(std::string(call) + ": " + (name ? name : "unknown CUDA error"));
    }
}

uint32_t pattern(size_t buffer, size_t word)
{
    return static_cast<uint32_t>(word) * 2654435761u + static_cast<uint32_t>(buffer + 1) * 40503u;
}

}  // namespace

// The seed's interface: IPCBufferManager(size, bufferStep), next(), getCurBufferPtr(),
// getCurIpcMemHandle() -> {pid, fd}. Sizes are the seed's: the minimum granularity of
// pinned device memory exportable as a POSIX fd, and an allocation of
// bufferStep - bufferStep % granularity + granularity bytes per buffer (a whole extra
// granule when bufferStep is already aligned). Unlike the seed this test double takes the
// device as an argument (the seed uses device 0), checks every call, and its destructor
// releases everything, so a failing test cannot leave device memory behind.
class IPCBufferManager
{
public:
    IPCBufferManager(size_t size, size_t bufferStep, int device = 0)
        : m_bufferSize(size), m_bufferStep(bufferStep)
    {
        CUmemAllocationProp prop = {};
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = device;
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        check(cuMemGetAllocationGranularity(&m_granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
              "cuMemGetAllocationGranularity");
        if (m_granularity == 0)
        {
            throw std::runtime_error("IPCBufferManager: the allocation granularity is zero");
        }
        m_allocSize = bufferStep - (bufferStep % m_granularity) + m_granularity;

        CUmemAccessDesc access = {};
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = device;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        try
        {
            for (size_t i = 0; i < m_bufferSize; i++)
            {
                Buffer b;
                check(cuMemCreate(&b.handle, m_allocSize, &prop, 0), "cuMemCreate");
                b.created = true;
                m_buffers.push_back(b);
                Buffer& last = m_buffers.back();
                check(cuMemExportToShareableHandle(&last.fd, last.handle,
                                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                      "cuMemExportToShareableHandle");
                check(cuMemAddressReserve(&last.ptr, m_allocSize, 0, 0, 0), "cuMemAddressReserve");
                check(cuMemMap(last.ptr, m_allocSize, 0, last.handle, 0), "cuMemMap");
                last.mapped = true;
                check(cuMemSetAccess(last.ptr, m_allocSize, &access, 1), "cuMemSetAccess");
                m_shareableHandles.push_back({ static_cast<int>(getpid()), last.fd });
            }
        }
        catch (...)
        {
            release();
            throw;
        }
    }

    IPCBufferManager(const IPCBufferManager&) = delete;
    IPCBufferManager& operator=(const IPCBufferManager&) = delete;

    ~IPCBufferManager()
    {
        release();
    }

    void next()
    {
        m_currentHandleIndex += 1;
        if (m_currentHandleIndex == m_bufferSize)
        {
            m_currentHandleIndex = 0;
        }
    }

    CUdeviceptr getCurBufferPtr()
    {
        return m_buffers[m_currentHandleIndex].ptr;
    }

    std::vector<int>& getCurIpcMemHandle()
    {
        return m_shareableHandles[m_currentHandleIndex];
    }

    // Not in the seed's interface: what the test compares the Python side's sizes with.
    size_t allocSize() const
    {
        return m_allocSize;
    }
    size_t granularity() const
    {
        return m_granularity;
    }

private:
    struct Buffer
    {
        CUmemGenericAllocationHandle handle = 0;
        CUdeviceptr ptr = 0;
        int fd = -1;
        bool created = false;
        bool mapped = false;
    };

    void release()
    {
        for (Buffer& b : m_buffers)
        {
            if (b.mapped)
            {
                cuMemUnmap(b.ptr, m_allocSize);
            }
            if (b.ptr)
            {
                cuMemAddressFree(b.ptr, m_allocSize);
            }
            if (b.created)
            {
                cuMemRelease(b.handle);
            }
            if (b.fd >= 0)
            {
                close(b.fd);
            }
        }
        m_buffers.clear();
        m_shareableHandles.clear();
    }

    size_t m_bufferSize;
    size_t m_bufferStep;
    size_t m_currentHandleIndex = 0;
    size_t m_granularity = 0;
    size_t m_allocSize = 0;
    std::vector<Buffer> m_buffers;
    std::vector<std::vector<int>> m_shareableHandles;
};

static int run(size_t buffers, size_t step, int device)
{
    CUdevice dev;
    CUcontext ctx;
    check(cuInit(0), "cuInit");
    check(cuDeviceGet(&dev, device), "cuDeviceGet");
    check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    int rc = 0;
    {
        IPCBufferManager manager(buffers, step, device);
        std::vector<uint32_t> host(step / 4);
        for (size_t i = 0; i < buffers; i++)
        {
            for (size_t k = 0; k < host.size(); k++)
            {
                host[k] = pattern(i, k);
            }
            check(cuMemcpyHtoD(manager.getCurBufferPtr(), host.data(), step), "cuMemcpyHtoD");
            std::vector<int>& h = manager.getCurIpcMemHandle();
            std::printf("BUFFER %zu %d %d 0x%llx\n", i, h[0], h[1],
                        static_cast<unsigned long long>(manager.getCurBufferPtr()));
            manager.next();  // after the last buffer it wraps around to the first
        }
        check(cuCtxSynchronize(), "cuCtxSynchronize");
        std::printf("ALLOC %zu GRANULARITY %zu\nREADY\n", manager.allocSize(), manager.granularity());
        std::fflush(stdout);

        char line[64] = {};
        if (!std::fgets(line, sizeof line, stdin) || std::strncmp(line, "VERIFY", 6) != 0)
        {
            rc = 3;
        }
        else
        {
            for (size_t i = 0; i < buffers && rc == 0; i++)
            {
                check(cuMemcpyDtoH(host.data(), manager.getCurBufferPtr(), step), "cuMemcpyDtoH");
                for (size_t k = 0; k < host.size(); k++)
                {
                    uint32_t want = ~pattern(i, k);
                    if (host[k] != want)
                    {
                        std::printf("MISMATCH buffer %zu word %zu got 0x%08" PRIx32 " want 0x%08" PRIx32 "\n",
                                    i, k, host[k], want);
                        rc = 1;
                        break;
                    }
                }
                manager.next();
            }
            if (rc == 0)
            {
                std::printf("OK\n");
            }
            std::fflush(stdout);
        }
    }
    cuDevicePrimaryCtxRelease(dev);
    return rc;
}

int main(int argc, char** argv)
{
    if (argc < 3 || argc > 4)
    {
        std::fprintf(stderr, "usage: %s <buffers> <buffer_step> [device]\n", argv[0]);
        return 2;
    }
    char* end = nullptr;
    unsigned long long buffers = std::strtoull(argv[1], &end, 10);
    bool bad = *end != '\0' || buffers == 0;
    unsigned long long step = std::strtoull(argv[2], &end, 10);
    bad = bad || *end != '\0' || step == 0 || step % 4 != 0;
    long device = argc > 3 ? std::strtol(argv[3], &end, 10) : 0;
    bad = bad || (argc > 3 && *end != '\0') || device < 0;
    if (bad)
    {
        std::fprintf(stderr, "bad arguments: buffers > 0, buffer_step a positive multiple of 4, device >= 0\n");
        return 2;
    }
    alarm(LIFETIME_S);
    try
    {
        return run(static_cast<size_t>(buffers), static_cast<size_t>(step), static_cast<int>(device));
    }
    catch (const std::exception& e)
    {
        std::fprintf(stderr, "seed_producer: %s\n", e.what());
        return 4;
    }
}
