/*
 * cip_cpp_probe -- the C++ layer (cupy_ipcpool.hpp) at work on a protocol-layer
 * subscription, for tests/test_cpp_layer_cpu.py: errors as exceptions, a receive that
 * times out, a release by hand (twice: the second does nothing), a release at the end of
 * a scope, a frame moved, and the subscription's end at its own end of scope.  One line
 * per step on stdout; it waits for "go" and "end" on stdin.
 */
#include "cupy_ipcpool.hpp"

#include <cstdio>
#include <iostream>
#include <string>

namespace cip = cupy_ipcpool;

static void
wait_for(const char *word)
{
    std::string line;
    while (std::getline(std::cin, line) && line != word) {
    }
}

static void
print(const char *what, const cip::raw_frame &f)
{
    std::printf("%s %llu %u %.*s\n", what, (unsigned long long)f.seq(), f.slot(),
                (int)f.payload().size(), f.payload().data());
}

int
main(int argc, char **argv)
{
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    if (argc != 2)
        return 2;
    const std::string path = argv[1];
    try {
        cip::subscription::open_raw(path + ".nobody");
        std::printf("opened a socket nobody serves\n");
    } catch (const cip::error &e) {
        std::printf("refused %s | %s\n", cip_status_name(e.status()), e.what());
    }
    try {
        cip::options o;
        o.credit = 4;
        cip::subscription sub = cip::subscription::open_raw(path, o);
        std::printf("joined %u slots, credit %u\n", sub.info().num_slots, sub.info().credit);
        std::printf("nothing yet %d\n", (int)!sub.recv_raw(0).has_value());
        wait_for("go");
        {
            auto a = sub.recv_raw(10000);
            print("by hand", *a);
            a->release();
            a->release(); /* nothing: released already */
            std::printf("held %d\n", (int)a->held());
        }
        {
            auto b = sub.recv_raw(10000);
            print("by scope", *b);
        } /* released here */
        auto c = sub.recv_raw(10000);
        cip::raw_frame kept = std::move(*c);
        print("kept", kept);
        std::printf("moved-from held %d, kept held %d\n", (int)c->held(), (int)kept.held());
        wait_for("end");
    } catch (const cip::error &e) {
        std::printf("error %s | %s\n", cip_status_name(e.status()), e.what());
        return 1;
    }
    std::printf("closed\n");
    return 0;
}
