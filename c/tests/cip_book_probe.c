/*
 * cip_book_probe: the GPU subscription's bookkeeping of frame flags (struct frame_book:
 * what is awaited, the record of frames not seen complete, forcing after the
 * producer's death, the answers) driven over a real sync page without a GPU, for
 * tests/test_c_library.py, which runs the same scenarios through the Python
 * FrameWaits (the same c/src/book.c, in cupy_ipcpool._engine) and checks both against
 * the answers its table expects.  The library's internal header is included and the
 * program linked with the library's sources (c/src/book.c), so that its internal
 * functions -- the ones cip_sub_recv, cip_frame_wait, cip_frame_complete and
 * cip_sub_incomplete_frames call -- are driven as they are, not a copy of them.
 *
 * Commands (one per line; one answer line each):
 *   page PATH NUM_SLOTS CAP  map the page (a memfd, by /proc/PID/fd/N); a book of
 *                            NUM_SLOTS slots whose record holds CAP frames -> ok
 *   recv SEQ SLOT GEN        a frame received (as cip_sub_recv) -> ok RECORDED
 *   note SLOT GEN            a stream waits on the flag (as cip_frame_wait) -> ok
 *   pending                  -> ok 0|1 (a stream of ours may wait on an unset flag)
 *   resolve                  the producer is dead: force what is awaited
 *                            -> ok FORCED_NOW FORCED_TOTAL
 *   answers                  -> ok INCOMPLETE_SEQS(comma-separated, or -) PENDING UNTRACKED
 *   quit
 */
#include "../src/cip_internal.h"

#include <inttypes.h>

int
main(void)
{
    char line[512];
    volatile uint32_t *flags = NULL;
    size_t nbytes = 0;
    struct frame_book book;
    int have_book = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    while (fgets(line, sizeof line, stdin) != NULL) {
        char cmd[32] = "", a1[256] = "";
        unsigned long long b = 0, c = 0;
        sscanf(line, "%31s %255s %llu %llu", cmd, a1, &b, &c);
        if (!strcmp(cmd, "page")) {
            int fd = open(a1, O_RDWR | O_CLOEXEC);
            struct stat sb;
            if (fd < 0 || fstat(fd, &sb) != 0 || (uint64_t)sb.st_size < 4 * b) {
                printf("err cannot open %s\n", a1);
                if (fd >= 0)
                    close(fd);
                continue;
            }
            nbytes = (size_t)sb.st_size;
            void *m = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            close(fd);
            if (m == MAP_FAILED || cipi_book_init(&book, (uint32_t)b, (size_t)c) != 0) {
                printf("err cannot map %s\n", a1);
                continue;
            }
            flags = (volatile uint32_t *)m;
            have_book = 1;
            printf("ok\n");
        } else if (!have_book) {
            printf("err no page\n");
        } else if (!strcmp(cmd, "recv")) {
            uint32_t slot = (uint32_t)b;
            if (slot >= book.num_slots) {
                printf("err slot out of range\n");
                continue;
            }
            printf("ok %d\n", cipi_book_received(&book, flags, strtoull(a1, NULL, 10), slot,
                                                 (uint32_t)c));
        } else if (!strcmp(cmd, "note")) {
            uint32_t slot = (uint32_t)strtoul(a1, NULL, 10);
            if (slot >= book.num_slots) {
                printf("err slot out of range\n");
                continue;
            }
            cipi_book_note(&book, slot, (uint32_t)b);
            printf("ok\n");
        } else if (!strcmp(cmd, "pending")) {
            printf("ok %d\n", cipi_book_pending(&book, flags));
        } else if (!strcmp(cmd, "resolve")) {
            uint32_t now = cipi_book_resolve(&book, flags);
            printf("ok %u %" PRIu64 "\n", now, book.forced);
        } else if (!strcmp(cmd, "answers")) {
            size_t pending = 0;
            size_t n = cipi_book_answers(&book, flags, NULL, 0, &pending, NULL, 0);
            uint64_t *seqs = (uint64_t *)malloc((n ? n : 1) * sizeof *seqs);
            if (seqs == NULL) {
                printf("err out of memory\n");
                continue;
            }
            cipi_book_answers(&book, flags, seqs, n, &pending, NULL, 0);
            printf("ok ");
            for (size_t i = 0; i < n; i++)
                printf("%s%" PRIu64, i ? "," : "", seqs[i]);
            printf("%s %zu %" PRIu64 "\n", n ? "" : "-", pending, book.untracked);
            free(seqs);
        } else if (!strcmp(cmd, "quit")) {
            break;
        } else {
            printf("err unknown command '%s'\n", cmd);
        }
    }
    if (have_book)
        cipi_book_free(&book);
    if (flags != NULL)
        munmap((void *)flags, nbytes);
    return 0;
}
