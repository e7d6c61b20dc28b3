/* consumer.c: print the first value of each frame a cupy_ipcpool Publisher sends.
 * Build (no CUDA toolkit): cc consumer.c $(pkg-config --cflags --libs cupy_ipcpool_c) -o consumer
 * with PKG_CONFIG_PATH=$HOME/.local/lib/pkgconfig after a $HOME/.local install; or CMake's
 * find_package(cupy_ipcpool_c). */
#include <cupy_ipcpool.h>
#include <stdio.h>
#include <stdlib.h>

typedef int (*stream_create_t)(void **stream, unsigned int flags);
typedef int (*copy_t)(void *dst, uint64_t src, size_t n, void *stream);
typedef int (*sync_t)(void *stream);

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s SOCKET [FRAMES]\n", argv[0]);
        return 2;
    }
    int frames = argc > 2 ? atoi(argv[2]) : 10;
    cip_sub_options opts;
    cip_sub_options_init(&opts);
    opts.mode = CIP_MODE_LATEST; /* never slow the producer down */
    cip_sub *sub;
    cip_status st = cip_sub_open(argv[1], &opts, &sub);
    if (st != CIP_OK) {
        fprintf(stderr, "%s: %s\n", cip_status_name(st), cip_last_error());
        return 1;
    }
    stream_create_t create;
    copy_t copy;
    sync_t sync;
    *(void **)&create = cip_cuda_symbol("cuStreamCreate");
    *(void **)&copy = cip_cuda_symbol("cuMemcpyDtoHAsync");
    *(void **)&sync = cip_cuda_symbol("cuStreamSynchronize");
    void *stream = NULL;
    cip_use_device(cip_sub_device(sub));
    create(&stream, 0);
    for (int i = 0; i < frames; i++) {
        cip_frame f;
        st = cip_sub_recv(sub, 10000, &f);
        if (st != CIP_OK) {
            fprintf(stderr, "%s: %s\n", cip_status_name(st), cip_last_error());
            break;
        }
        cip_frame_wait(sub, &f, stream); /* the stream waits for the producer's writes */
        unsigned char first[16] = {0};
        if (f.num_arrays && f.arrays[0].nbytes)
            copy(first, f.arrays[0].data, f.arrays[0].itemsize, stream);
        sync(stream);
        printf("frame %llu: %u arrays, first %s, first byte %u\n", (unsigned long long)f.seq,
               f.num_arrays, f.num_arrays ? cip_dtype_name(f.arrays[0].dtype) : "-", first[0]);
        cip_sub_release(sub, &f, stream); /* after the work that reads the frame */
    }
    cip_status closed = cip_sub_close(sub); /* waits for GPU work still queued on the slots */
    cip_sub_free(sub);
    if (closed != CIP_OK)
        fprintf(stderr, "%s: %s\n", cip_status_name(closed), cip_last_error());
    return st == CIP_OK || st == CIP_ERR_END_OF_STREAM ? 0 : 1;
}
