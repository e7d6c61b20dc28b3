/*
 * A raw publisher through the C++ layer (cupy_ipcpool::publisher), for
 * tests/test_cpp_layer_cpu.py: 4 memfd slots of 4096 bytes welcomed with the slot size
 * (tests/_memfd_backend.MemfdConsumer maps them); frame n fills its slot with n (u64).
 * Lines: "listening", "published N" each, "returned N" once all came back, then 4 more
 * frames the subscriber holds and "none free" (acquire timed out), then the publisher's end
 * of scope closes it (BYE) and "closed".
 *
 *   cip_cpp_pub_probe PATH FRAMES
 */
#include <cupy_ipcpool.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace cip = cupy_ipcpool;

int
main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    const long frames = std::atol(argv[2]);
    constexpr size_t slots = 4, size = 4096;
    std::vector<int> fds;
    std::vector<uint64_t *> maps;
    for (size_t i = 0; i < slots; i++) {
        int fd = memfd_create("cip-cpp-pub", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, size) != 0)
            return 3;
        void *m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED)
            return 3;
        fds.push_back(fd);
        maps.push_back(static_cast<uint64_t *>(m));
    }
    const uint64_t slot_size = size;
    try {
        cip::publisher_options o;
        o.num_slots = slots;
        auto pub = cip::publisher::open_raw(
            argv[1], o, std::string_view(reinterpret_cast<const char *>(&slot_size), 8), fds);
        for (int fd : fds)
            close(fd); /* the publisher has its own copies */
        std::printf("listening\n");
        while (pub.subscribers() < 1)
            pub.poll(10);
        uint64_t returned = 0;
        for (long n = 0; n < frames; n++) {
            auto slot = pub.acquire(10000);
            if (!slot)
                return 4;
            for (size_t k = 0; k < size / 8; k++)
                maps[*slot][k] = static_cast<uint64_t>(n);
            std::printf("published %llu\n",
                        static_cast<unsigned long long>(pub.publish(*slot, "frame")));
        }
        while (returned < static_cast<uint64_t>(frames))
            returned += pub.poll(5000);
        std::printf("returned %llu\n", static_cast<unsigned long long>(returned));
        for (size_t k = 0; k < slots; k++) { /* the subscriber holds these */
            auto slot = pub.acquire(1000);
            for (size_t w = 0; w < size / 8; w++)
                maps[*slot][w] = static_cast<uint64_t>(frames) + k;
            pub.publish(*slot, "held");
        }
        std::printf("%s\n", pub.acquire(100) ? "a slot free" : "none free");
    } catch (const cip::error &e) {
        std::printf("error %s\n", e.what());
        return 1;
    }
    std::printf("closed\n");
    return 0;
}
