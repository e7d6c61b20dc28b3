/* host_publisher.c: publish frames from C, in host memory, to Python processes that read
 * them as NumPy arrays with cupy_ipcpool.remote.HostChannelSubscriber (no GPU):
 *
 *   host_publisher /tmp/host.sock 100 &
 *   python3 -c 'from cupy_ipcpool.remote import HostChannelSubscriber
 *   sub = HostChannelSubscriber("/tmp/host.sock")
 *   while True:
 *       with sub.recv(timeout=10) as f: print(f.seq, f.metadata, f.array.mean())'
 *
 * What a HostChannelSubscriber expects: the slots are memfds sent with the WELCOME, whose
 * payload is their size (u64, little endian); each frame's payload lists its arrays and
 * carries the metadata (cip_host_frame_encode writes it), and the arrays sit in the slot
 * where cip_array_layout says.  Frame n here is a 480 x 640 float32 image filled with n and
 * the frame's number as a uint64 array of one element, metadata "frame n".  It waits for a
 * first subscriber, publishes the frames, waits for their releases, closes.
 *
 * Build: cc host_publisher.c $(pkg-config --cflags --libs cupy_ipcpool_c) -o host_publisher
 * (or CMake's cip_host_publisher target). */
#define _GNU_SOURCE /* memfd_create */
#include <cupy_ipcpool.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

enum { SLOTS = 4, H = 480, W = 640 };
/* Slots big enough for the image, the number at the next multiple of 256 bytes, and room. */
static const uint64_t SLOT_NBYTES = (uint64_t)H * W * sizeof(float) + 4096;

static void
fail(const char *what, cip_status st)
{
    fprintf(stderr, "%s: %s: %s\n", what, cip_status_name(st), cip_last_error());
    exit(1);
}

int
main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s SOCKET_PATH FRAMES\n", argv[0]);
        return 2;
    }
    long frames = atol(argv[2]);
    /* the frame's arrays: where they sit in a slot is the library's rule */
    cip_array_spec specs[2] = {{"<f4", 2, {H, W}}, {"<u8", 1, {1}}};
    uint64_t offsets[2];
    cip_status st = cip_array_layout(specs, 2, SLOT_NBYTES, offsets);
    if (st != CIP_OK)
        fail("cip_array_layout", st);
    int fds[SLOTS];
    uint8_t *slots[SLOTS];
    for (int i = 0; i < SLOTS; i++) {
        fds[i] = memfd_create("host-slot", MFD_CLOEXEC);
        if (fds[i] < 0 || ftruncate(fds[i], (off_t)SLOT_NBYTES) != 0) {
            perror("memfd");
            return 1;
        }
        slots[i] = mmap(NULL, SLOT_NBYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fds[i], 0);
        if (slots[i] == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
    }
    cip_pub_options opts;
    cip_pub_options_init(&opts);
    opts.num_slots = SLOTS;
    cip_pub *pub;
    st = cip_pub_open_raw(argv[1], &opts, &SLOT_NBYTES, sizeof SLOT_NBYTES, fds, SLOTS, &pub);
    for (int i = 0; i < SLOTS; i++)
        close(fds[i]); /* the publisher sends its own copies */
    if (st != CIP_OK)
        fail("cip_pub_open_raw", st);
    printf("listening at %s\n", argv[1]);
    fflush(stdout);
    while (cip_pub_subscribers(pub) == 0)
        if ((st = cip_pub_poll(pub, 100, NULL)) != CIP_OK)
            fail("cip_pub_poll", st);
    uint64_t leased = 0, returned = 0;
    for (long n = 0; n < frames; n++) {
        uint32_t slot;
        if ((st = cip_pub_acquire(pub, 10000, &slot)) != CIP_OK)
            fail("cip_pub_acquire", st); /* no slot came back in 10 s */
        float *image = (float *)(slots[slot] + offsets[0]);
        for (size_t k = 0; k < (size_t)H * W; k++)
            image[k] = (float)n;
        uint64_t number = (uint64_t)n;
        memcpy(slots[slot] + offsets[1], &number, sizeof number);
        char metadata[32];
        uint8_t payload[1024];
        size_t len;
        snprintf(metadata, sizeof metadata, "frame %ld", n);
        if ((st = cip_host_frame_encode(specs, 2, metadata, strlen(metadata), payload,
                                        sizeof payload, &len)) != CIP_OK)
            fail("cip_host_frame_encode", st);
        if ((st = cip_pub_publish_raw(pub, slot, payload, len, NULL)) != CIP_OK)
            fail("cip_pub_publish_raw", st);
        leased += cip_pub_subscribers(pub);
    }
    while (returned < leased && cip_pub_subscribers(pub) > 0) { /* the last releases */
        uint64_t n = 0;
        if ((st = cip_pub_poll(pub, 5000, &n)) != CIP_OK || n == 0)
            break;
        returned += n;
    }
    st = cip_pub_close(pub, 1000); /* BYE: each subscriber's recv raises EndOfStream */
    printf("published %ld frames; %s\n", frames, cip_status_name(st));
    return st == CIP_OK ? 0 : 1;
}
