/*
 * gpu_consumer: a C subscriber of a cupy_ipcpool Publisher, for the GPU tests and the
 * benchmark (tests/test_c_library_gpu.py, benchmarks/test_bench_c.py).
 *
 *   gpu_consumer check SOCKET MODE FULL_EVERY
 *       Frames are one uint32 array whose element i holds seed * 2654435761 + i
 *       (mod 2**32), the seed in the metadata (u64).  For every frame the consumer's
 *       own stream waits on the frame flag, then copies to pinned host memory, on that
 *       stream, three 4 KiB samples (the first, the last, and one at an offset that
 *       moves with the seed) and, every FULL_EVERY-th frame (1: every frame), the
 *       whole frame; it synchronises that stream, checks every copied byte against
 *       the pattern, and releases the frame on the stream.  No kernel is launched.
 *   gpu_consumer bench SOCKET
 *       The round trip's consumer: wait on the frame flag, release, nothing else; the
 *       metadata (i64) must count 1, 2, 3, ... (negative on the last frame).
 *   gpu_consumer attach DESC_HEX HANDLE_HEX TRANSPORT
 *       Attach a pool from its descriptor bytes (TRANSPORT: auto, pidfd or socket), turn
 *       the handle bytes into an array (a uint32 vector filled with the pattern of seed
 *       1), copy it to the host and check every element; then check that a handle of an
 *       older generation of the slot is refused.
 *   gpu_consumer death SOCKET
 *       Receive one frame, make the stream wait on it, print "waiting"; then receive
 *       again (the test kills the producer meanwhile) and synchronise the stream: it
 *       must return although the producer never wrote the flag.  Reports what
 *       cip_frame_complete says of the frame before and after its release, the
 *       incomplete list (cip_sub_incomplete_frames) and what cip_sub_close returned.
 *
 * Prints "ready" once subscribed, and one JSON line at the end.  Exit status 0 on
 * success.
 */
#define _GNU_SOURCE
#include "cupy_ipcpool.h"
#include "probe_util.h"

#include <dirent.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int (*stream_create_t)(void **, unsigned int);
typedef int (*stream_destroy_t)(void *);
typedef int (*copy_t)(void *, uint64_t, size_t, void *);
typedef int (*sync_t)(void *);
typedef int (*alloc_host_t)(void **, size_t);
typedef int (*free_host_t)(void *);

static stream_create_t stream_create;
static stream_destroy_t stream_destroy;
static copy_t copy_async;
static sync_t stream_sync;
static alloc_host_t alloc_host;
static free_host_t free_host;

#define SAMPLE 4096u

/* The targets of this process's fds, "fd=target" each, into fds (at most cap). */
static int
list_fds(char (*fds)[160], int cap)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0, self = dirfd(d);
    struct dirent *e;
    while ((e = readdir(d)) != NULL && n < cap) {
        if (e->d_name[0] == '.' || atoi(e->d_name) == self)
            continue;
        int fd = atoi(e->d_name);
        char path[64], target[128];
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        ssize_t k = readlink(path, target, sizeof target - 1);
        target[k > 0 ? k : 0] = '\0';
        snprintf(fds[n++], sizeof fds[0], "%d=%.127s", fd, target);
    }
    closedir(d);
    return n;
}

static const char *stage = "start";

/* A stream that waits forever fails the test with a report instead of hanging it. */
static void
on_alarm(int sig)
{
    (void)sig;
    char msg[256];
    int n = snprintf(msg, sizeof msg, "{\"error\": \"watchdog: stuck in %s for 30 s\"}\n", stage);
    (void)!write(1, msg, n > 0 ? (size_t)n : 0);
    _exit(3);
}

static int
die(const char *what, cip_status st)
{
    printf("{\"error\": \"%s: %s: %s\"}\n", what, cip_status_name(st), cip_last_error());
    return 1;
}

static int
load_symbols(void)
{
    *(void **)&stream_create = cip_cuda_symbol("cuStreamCreate");
    *(void **)&stream_destroy = cip_cuda_symbol("cuStreamDestroy");
    *(void **)&copy_async = cip_cuda_symbol("cuMemcpyDtoHAsync");
    *(void **)&stream_sync = cip_cuda_symbol("cuStreamSynchronize");
    *(void **)&alloc_host = cip_cuda_symbol("cuMemAllocHost");
    *(void **)&free_host = cip_cuda_symbol("cuMemFreeHost");
    return stream_create && stream_destroy && copy_async && stream_sync && alloc_host && free_host;
}

/* Elements [first, first + count) of the frame of `seed` that do not hold the pattern. */
static uint64_t
mismatches(const uint32_t *got, uint64_t first, uint64_t count, uint64_t seed)
{
    uint32_t base = (uint32_t)(seed * 2654435761ull);
    uint64_t bad = 0;
    for (uint64_t i = 0; i < count; i++)
        bad += got[i] != (uint32_t)(base + (uint32_t)(first + i));
    return bad;
}

static cip_sub *
open_sub(const char *path, int mode, cip_status *st)
{
    cip_sub_options o;
    cip_sub_options_init(&o);
    o.mode = mode;
    o.timeout_ms = 30000;
    cip_sub *sub = NULL;
    *st = cip_sub_open(path, &o, &sub);
    return sub;
}

/* The next frame of the stream into *f: 1, 0 at the end of the stream, or -1 (reported)
 * when the receive failed. */
static int
next_frame(cip_sub *sub, cip_frame *f)
{
    cip_status st = cip_sub_recv(sub, 60000, f);
    if (st == CIP_ERR_END_OF_STREAM)
        return 0;
    if (st != CIP_OK) {
        die("recv", st);
        return -1;
    }
    return 1;
}

/* The end of a receive loop that stopped with next_frame's `got`: 1 if on a failed
 * receive (reported already), else 0 once the stream is synchronised, the subscription
 * closed and the stream destroyed. */
static int
finish(cip_sub *sub, void *stream, int got)
{
    if (got < 0)
        return 1;
    stream_sync(stream);
    cip_sub_free(sub);
    stream_destroy(stream);
    return 0;
}

static int
check(const char *path, int mode, long full_every)
{
    cip_status st;
    cip_sub *sub = open_sub(path, mode, &st);
    if (sub == NULL)
        return die("open", st);
    cip_use_device(cip_sub_device(sub));
    void *stream = NULL;
    uint32_t *host = NULL;
    size_t host_bytes = 0;
    uint32_t *samples = NULL;
    if (stream_create(&stream, 0) != 0 || alloc_host((void **)&samples, 3 * SAMPLE) != 0) {
        printf("{\"error\": \"cannot make a stream or pinned memory\"}\n");
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    uint64_t frames = 0, full = 0, bad = 0, checked = 0, order = 0, last_seq = 0, gaps = 0;
    int have = 0, got;
    cip_frame f;
    while ((got = next_frame(sub, &f)) > 0) {
        if (have && f.seq != last_seq + 1)
            gaps++;
        if (have && f.seq <= last_seq)
            order++;
        have = 1;
        last_seq = f.seq;
        uint64_t seed = 0;
        if (f.metadata_len != 8 || f.num_arrays != 1 || f.arrays[0].dtype != CIP_UINT32 ||
            f.arrays[0].ndim != 1 || f.arrays[0].strides[0] != 4) {
            printf("{\"error\": \"frame %" PRIu64 " is not one uint32 vector\"}\n", f.seq);
            return 1;
        }
        memcpy(&seed, f.metadata, 8);
        const cip_array *a = &f.arrays[0];
        uint64_t n = a->shape[0];
        if ((st = cip_frame_wait(sub, &f, stream)) != CIP_OK)
            return die("wait", st);
        int whole = full_every > 0 && frames % (uint64_t)full_every == 0;
        uint64_t k = n * 4 < SAMPLE ? n : SAMPLE / 4; /* elements per sample */
        uint64_t offs[3] = {0, n - k, (seed * 7919u) % (n - k + 1)};
        if (whole && host_bytes < n * 4) {
            if (host)
                free_host(host);
            host_bytes = n * 4;
            if (alloc_host((void **)&host, host_bytes) != 0) {
                printf("{\"error\": \"cannot allocate %zu pinned bytes\"}\n", host_bytes);
                return 1;
            }
        }
        for (int s = 0; s < 3; s++)
            copy_async(samples + s * (SAMPLE / 4), a->data + 4 * offs[s], 4 * k, stream);
        if (whole)
            copy_async(host, a->data, 4 * n, stream);
        if (stream_sync(stream) != 0) {
            printf("{\"error\": \"the stream failed\"}\n");
            return 1;
        }
        for (int s = 0; s < 3; s++)
            bad += mismatches(samples + s * (SAMPLE / 4), offs[s], k, seed);
        checked += 3 * 4 * k;
        if (whole) {
            bad += mismatches(host, 0, n, seed);
            checked += 4 * n;
            full++;
        }
        if ((st = cip_sub_release(sub, &f, stream)) != CIP_OK)
            return die("release", st);
        frames++;
    }
    if (finish(sub, stream, got))
        return 1;
    free_host(samples);
    if (host)
        free_host(host);
    printf("{\"frames\": %" PRIu64 ", \"full_checks\": %" PRIu64 ", \"mismatches\": %" PRIu64
           ", \"bytes_checked\": %" PRIu64 ", \"out_of_order\": %" PRIu64 ", \"gaps\": %" PRIu64
           ", \"last_seq\": %" PRIu64 "}\n",
           frames, full, bad, checked, order, gaps, last_seq);
    return 0;
}

static int
bench(const char *path)
{
    cip_status st;
    cip_sub *sub = open_sub(path, CIP_MODE_BLOCK, &st);
    if (sub == NULL)
        return die("open", st);
    cip_use_device(cip_sub_device(sub));
    void *stream = NULL;
    stream_create(&stream, 0);
    printf("ready\n");
    fflush(stdout);
    int64_t last = 0;
    uint64_t frames = 0, bad = 0;
    int got;
    cip_frame f;
    while ((got = next_frame(sub, &f)) > 0) {
        int64_t value = 0;
        if (f.metadata_len >= 8)
            memcpy(&value, f.metadata, 8);
        if (llabs(value) != last + 1)
            bad++;
        last = llabs(value);
        if ((st = cip_frame_wait(sub, &f, stream)) != CIP_OK)
            return die("wait", st);
        if ((st = cip_sub_release(sub, &f, stream)) != CIP_OK)
            return die("release", st);
        frames++;
    }
    if (finish(sub, stream, got))
        return 1;
    printf("{\"frames\": %" PRIu64 ", \"bad_frames\": %" PRIu64 ", \"mismatches\": 0}\n", frames,
           bad);
    return 0;
}

static int
death(const char *path)
{
    /* the context first: its own fds are not the subscription's */
    cip_status st = cip_use_device(0);
    if (st != CIP_OK)
        return die("device 0", st);
    void *stream = NULL;
    stream_create(&stream, 0);
    static char before_fds[256][160], after_fds[256][160];
    int nbefore = list_fds(before_fds, 256);
    int before = count_fds();
    signal(SIGALRM, on_alarm);
    cip_sub *sub = open_sub(path, CIP_MODE_BLOCK, &st);
    if (sub == NULL)
        return die("open", st);
    if (cip_sub_device(sub) != 0) {
        printf("{\"error\": \"the pool is on device %d, this test uses 0\"}\n",
               cip_sub_device(sub));
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    cip_frame f;
    if ((st = cip_sub_recv(sub, 60000, &f)) != CIP_OK)
        return die("recv", st);
    if ((st = cip_frame_wait(sub, &f, stream)) != CIP_OK)
        return die("wait", st);
    printf("waiting\n");
    fflush(stdout);
    cip_frame g;
    struct timespec t0, t1, t2;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    stage = "cip_sub_recv after the kill";
    alarm(30);
    cip_status end = cip_sub_recv(sub, 60000, &g);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    /* what the library did at the end, before the stream is synchronised: it must have
     * set the flag already, or this synchronisation waits for ever */
    uint64_t forced_at_end = cip_sub_forced_flags(sub);
    printf("end %s (%s); forced %" PRIu64 "\n", cip_status_name(end), cip_last_error(),
           forced_at_end);
    stage = "cuStreamSynchronize (the stream waits on the frame flag)";
    alarm(30);
    int rc = stream_sync(stream);
    clock_gettime(CLOCK_MONOTONIC, &t2);
    printf("synchronised: %d\n", rc);
    stage = "cip_frame_complete, cip_sub_release, cip_sub_close";
    alarm(30);
    int complete = cip_frame_complete(sub, &f);
    uint64_t forced = cip_sub_forced_flags(sub);
    cip_status released = cip_sub_release(sub, &f, stream);
    int complete_released = cip_frame_complete(sub, &f); /* the same answer once released */
    uint64_t incomplete[8];
    size_t n_incomplete = 0;
    cip_status listed = cip_sub_incomplete_frames(sub, incomplete, 8, &n_incomplete);
    cip_status closed = cip_sub_close(sub);
    int complete_closed = cip_frame_complete(sub, &f); /* the same answer after close */
    cip_sub_free(sub);
    stream_destroy(stream);
    alarm(0);
    double recv_s = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
    double waited = (double)(t2.tv_sec - t1.tv_sec) + (t2.tv_nsec - t1.tv_nsec) / 1e9;
    int nafter = list_fds(after_fds, 256);
    printf("{\"end\": \"%s\", \"recv_s\": %.3f, \"sync_rc\": %d, \"sync_s\": %.3f, "
           "\"release\": \"%s\", \"complete\": %d, \"complete_released\": %d, "
           "\"complete_closed\": %d, "
           "\"forced_at_end\": %" PRIu64 ", \"forced\": %" PRIu64 ", \"seq\": %" PRIu64
           ", \"listed\": \"%s\", \"incomplete\": [",
           cip_status_name(end), recv_s, rc, waited, cip_status_name(released), complete,
           complete_released, complete_closed, forced_at_end, forced, f.seq, cip_status_name(listed));
    for (size_t i = 0; i < n_incomplete && i < 8; i++)
        printf("%s%" PRIu64, i ? ", " : "", incomplete[i]);
    printf("], \"close\": \"%s\", \"fds_before\": %d, \"fds_after\": %d, \"new_fds\": [",
           cip_status_name(closed), before, count_fds());
    int first = 1;
    for (int i = 0; i < nafter; i++) {
        int old = 0;
        for (int j = 0; j < nbefore && !old; j++)
            old = !strcmp(after_fds[i], before_fds[j]);
        if (!old) {
            printf("%s\"%s\"", first ? "" : ", ", after_fds[i]);
            first = 0;
        }
    }
    printf("]}\n");
    return 0;
}

static int
attach(const char *desc_hex, const char *handle_hex, const char *transport_name)
{
    static uint8_t desc[1 << 16], handle[1024];
    size_t dn = unhex(desc_hex, desc, sizeof desc), hn = unhex(handle_hex, handle, sizeof handle);
    int transport = !strcmp(transport_name, "pidfd")    ? CIP_TRANSPORT_PIDFD
                    : !strcmp(transport_name, "socket") ? CIP_TRANSPORT_SOCKET
                                                        : CIP_TRANSPORT_AUTO;
    cip_pool *pool = NULL;
    cip_status st = cip_pool_attach(desc, dn, -1, transport, &pool);
    if (st != CIP_OK)
        return die("attach", st);
    cip_array a;
    if ((st = cip_array_from_handle(pool, handle, hn, &a)) != CIP_OK)
        return die("array", st);
    if (a.dtype != CIP_UINT32 || a.ndim != 1 || a.strides[0] != 4)
        return die("array geometry", CIP_ERR_DESCRIPTOR);
    cip_use_device(cip_pool_device(pool));
    void *stream = NULL;
    uint32_t *host = NULL;
    stream_create(&stream, 0);
    alloc_host((void **)&host, a.nbytes ? a.nbytes : 4);
    copy_async(host, a.data, a.nbytes, stream);
    stream_sync(stream);
    uint64_t bad = mismatches(host, 0, a.shape[0], 1);
    const char *stale = "-";
    if (a.generation > 0) { /* the same handle, one generation older */
        uint64_t older = a.generation - 1;
        for (int i = 0; i < 8; i++)
            handle[4 + i] = (uint8_t)(older >> (8 * i));
        cip_array b;
        stale = cip_status_name(cip_array_from_handle(pool, handle, hn, &b));
    }
    printf("{\"num_slots\": %u, \"nbytes\": %" PRIu64 ", \"mismatches\": %" PRIu64
           ", \"older_generation\": \"%s\"}\n",
           cip_pool_num_slots(pool), a.nbytes, bad, stale);
    free_host(host);
    stream_destroy(stream);
    cip_pool_close(pool);
    return 0;
}

int
main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 3) {
        fprintf(stderr, "usage: %s check|bench|death SOCKET [MODE FULL_EVERY]\n", argv[0]);
        return 2;
    }
    if (!load_symbols()) {
        printf("{\"error\": \"no CUDA driver: %s\"}\n", cip_last_error());
        return 1;
    }
    if (!strcmp(argv[1], "check") && argc >= 5)
        return check(argv[2], !strcmp(argv[3], "latest") ? CIP_MODE_LATEST : CIP_MODE_BLOCK,
                     atol(argv[4]));
    if (!strcmp(argv[1], "bench"))
        return bench(argv[2]);
    if (!strcmp(argv[1], "attach") && argc >= 5)
        return attach(argv[2], argv[3], argv[4]);
    if (!strcmp(argv[1], "death"))
        return death(argv[2]);
    fprintf(stderr, "unknown mode %s\n", argv[1]);
    return 2;
}
