/*
 * A raw C publisher through the public API (cip_pub_*), for tests/test_c_producer_cpu.py:
 * 4 memfd slots of 4096 bytes; the WELCOME payload is the slot size (u64 little endian),
 * its fds the memfds (what tests/_memfd_backend.MemfdConsumer maps).  Frame seq fills its
 * slot with seq (u64) repeated.  Lines on stdout: "listening", "joined ID MODE CREDIT",
 * "published SEQ SLOT", "published all", "left ID JOINED MODE CREDIT WHY", "closed STATUS"
 * (the subscriber as on_join told it: the publisher keeps what it knows); it closes
 * once a line (or the end) comes on stdin.  With CIP_PROBE_FORK set, once it has published
 * all it forks a child that polls and closes its copy of the publisher: "child POLL CLOSE
 * EXIT" (the child's cip_pub_poll and cip_pub_close statuses, its exit code).  With
 * CIP_PROBE_LINGER_CHILD set, once listening it forks a child that lives on (until killed)
 * and says "child PID" itself (once its at-fork handlers ran).
 *
 *   cip_pub_probe PATH FRAMES SUBSCRIBERS LINGER_MS
 */
#define _GNU_SOURCE /* memfd_create */
#include <cupy_ipcpool.h>

#include "probe_util.h"

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define SLOTS 4
#define SLOT_SIZE 4096

static void
on_join(void *ctx, const cip_pub_subscriber *sub)
{
    (void)ctx;
    printf("joined %u %s %u\n", sub->sub_id, sub->mode == CIP_MODE_LATEST ? "latest" : "block",
           sub->credit);
}

static void
on_leave(void *ctx, const cip_pub_subscriber *sub, int joined, const char *why)
{
    (void)ctx;
    printf("left %u %d %s %u %s\n", sub->sub_id, joined,
           sub->mode == CIP_MODE_LATEST ? "latest" : "block", sub->credit, why);
}

/* CIP_PROBE_FORK's child: poll (refused: not its own), then close its copy. */
static void
child_closes(void *ctx, char *out, size_t cap)
{
    cip_pub *pub = ctx;
    cip_status ps = cip_pub_poll(pub, 0, NULL);
    cip_status cs = cip_pub_close(pub, 0);
    snprintf(out, cap, "%s %s", cip_status_name(ps), cip_status_name(cs));
}

int
main(int argc, char **argv)
{
    if (argc != 5)
        return 2;
    setvbuf(stdout, NULL, _IOLBF, 0);
    long frames = atol(argv[2]), want = atol(argv[3]);
    int fds[SLOTS];
    uint64_t *maps[SLOTS];
    for (int i = 0; i < SLOTS; i++) {
        fds[i] = memfd_create("cip-pub-probe", MFD_CLOEXEC);
        if (fds[i] < 0 || ftruncate(fds[i], SLOT_SIZE) != 0)
            return 3;
        maps[i] = mmap(NULL, SLOT_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fds[i], 0);
        if (maps[i] == MAP_FAILED)
            return 3;
    }
    uint64_t size = SLOT_SIZE; /* little endian hosts only, as the library */
    cip_pub_options opts;
    cip_pub_options_init(&opts);
    opts.num_slots = SLOTS;
    opts.on_join = on_join;
    opts.on_leave = on_leave;
    cip_pub *pub;
    cip_status st = cip_pub_open_raw(argv[1], &opts, &size, sizeof size, fds, SLOTS, &pub);
    for (int i = 0; i < SLOTS; i++)
        close(fds[i]); /* the publisher keeps its own copies */
    if (st != CIP_OK) {
        printf("error %s %s\n", cip_status_name(st), cip_last_error());
        return 1;
    }
    printf("listening\n");
    if (getenv("CIP_PROBE_LINGER_CHILD") != NULL) {
        fflush(stdout);
        if (fork() == 0) { /* fork returns here after the at-fork handlers */
            printf("child %d\n", (int)getpid());
            fflush(stdout);
            for (;;)
                pause();
        }
    }
    while (cip_pub_subscribers(pub) < (uint32_t)want)
        cip_pub_poll(pub, 10, NULL);
    for (long n = 0; n < frames; n++) {
        uint32_t slot;
        if ((st = cip_pub_acquire(pub, 10000, &slot)) != CIP_OK)
            break;
        for (size_t k = 0; k < SLOT_SIZE / 8; k++)
            maps[slot][k] = (uint64_t)n;
        char payload[32];
        int len = snprintf(payload, sizeof payload, "frame %ld", n);
        uint64_t seq;
        if ((st = cip_pub_publish_raw(pub, slot, payload, (size_t)len, &seq)) != CIP_OK)
            break;
        printf("published %llu %u\n", (unsigned long long)seq, slot);
    }
    if (st != CIP_OK)
        printf("error %s %s\n", cip_status_name(st), cip_last_error());
    if (getenv("CIP_PROBE_FORK") != NULL) {
        char got[256];
        int code = fork_and_report(child_closes, pub, got, sizeof got);
        printf("child %s %d\n", got, code);
    }
    /* until told to close (a line on stdin), the subscribers' releases are read */
    printf("published all\n");
    struct pollfd in = {.fd = 0, .events = POLLIN, .revents = 0};
    while (poll(&in, 1, 0) == 0)
        cip_pub_poll(pub, 10, NULL);
    printf("closed %s\n", cip_status_name(cip_pub_close(pub, atoi(argv[4]))));
    return st == CIP_OK ? 0 : 1;
}
