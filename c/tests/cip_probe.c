/*
 * cip_probe: drives the C library from a line protocol on stdin, for
 * tests/test_c_library.py (no GPU needed for anything but "open"'s success).
 *
 * Commands (one per line; answers one line each: "ok ...", "frame ...", "err NAME message"):
 *   open_raw PATH MODE CREDIT TIMEOUT_MS [UIDS|-]  subscribe (protocol layer); UIDS: 1,2,3
 *   open PATH MODE CREDIT TIMEOUT_MS               subscribe (GPU layer)
 *   map                      take the WELCOME's fds and mmap them (memfd slots; the
 *                            payload is the slot size, u64)
 *   recv TIMEOUT_MS          -> frame SEQ SLOT PAYLOAD_LEN PAYLOAD_HEX MATCH
 *                            MATCH: 1 if the mapped slot holds the frame's pattern
 *                            (its seq as u64, repeated), 0 if not, - if not mapped
 *   check SEQ SLOT           -> ok MATCH (the pattern again, before a release)
 *   release SEQ SLOT         -> ok
 *   recvrel N TIMEOUT_MS     receive and release N frames -> ok N (or the first error)
 *   parse                    the last frame's payload as a Publisher's FRAME payload,
 *                            against the mapped slot -> ok N META_HEX then per array
 *                            OFFSET:DTYPE:NDIM:SHAPE:STRIDES:NBYTES:FNV (FNV-1a 64 of the
 *                            elements' bytes in C order, read from the mapping)
 *   fds                      -> ok COUNT (open fds of this process)
 *   desc HEX                 -> ok NUM_SLOTS SLOT_NBYTES ALLOC_NBYTES PID UID PATH|-
 *   fetch HEX TRANSPORT      -> ok N HEAD0 HEAD1 ... (first 8 bytes of each fd, hex)
 *   layout NUM_SLOTS ROWS    -> ok READS_OFFSET NBYTES (cip_sync_layout)
 *   state WORD GENERATION    -> ok STATE (cip_flag_state: 1, 0 or -1)
 *   page PATH                map a sync page (a memfd, by /proc/PID/fd/N) shared -> ok NBYTES
 *   word SLOT                -> ok WORD (frame flag SLOT of the mapped page)
 *   force SLOT AWAITED       cip_flag_force on it -> ok STORED WORD
 *   close                    close the subscription -> ok, or the error cip_sub_close reported
 *   forkchild                fork a child that lives on (until killed) -> ok PID, once the
 *                            child's at-fork handlers ran
 *   forkclose                fork a child that closes and frees its copy of the subscription
 *                            and then tries to receive -> ok CLOSE_STATUS RECV_STATUS EXIT
 *                            (the child's: cip_sub_free's, cip_sub_recv_raw's on a second
 *                            copy it kept open, its exit code); the parent's stays open
 *   quit
 */
#define _GNU_SOURCE
#include "cupy_ipcpool.h"
#include "probe_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static cip_sub *sub;
static uint8_t **maps;
static size_t nmaps, slot_size;
static uint8_t last_payload[70000];
static size_t last_len;
static uint64_t last_seq;
static uint32_t last_slot;
static uint32_t *page;
static size_t page_nbytes;

static void
err(cip_status st)
{
    printf("err %s %s\n", cip_status_name(st), cip_last_error());
}

static void
hex(const uint8_t *p, size_t n)
{
    if (n == 0)
        fputs("-", stdout);
    for (size_t i = 0; i < n; i++)
        printf("%02x", p[i]);
}

static const char *
match(uint64_t seq, uint32_t slot)
{
    if (slot >= nmaps)
        return "-";
    const uint8_t *m = maps[slot];
    for (size_t off = 0; off + 8 <= slot_size; off += 8) {
        uint64_t v;
        memcpy(&v, m + off, 8);
        if (v != seq)
            return "0";
    }
    return "1";
}

static void
unmap_all(void)
{
    for (size_t i = 0; i < nmaps; i++)
        munmap(maps[i], slot_size);
    free(maps);
    maps = NULL;
    nmaps = 0;
}

/* FNV-1a over the elements of `a` in C order, read from `base`. */
static uint64_t
fnv_array(const uint8_t *base, const cip_array *a)
{
    uint64_t h = 1469598103934665603ull;
    uint64_t count = 1;
    for (uint32_t d = 0; d < a->ndim; d++)
        count *= a->shape[d];
    uint64_t idx[CIP_MAX_NDIM] = {0};
    for (uint64_t e = 0; e < count; e++) {
        int64_t off = (int64_t)a->offset;
        for (uint32_t d = 0; d < a->ndim; d++)
            off += (int64_t)idx[d] * a->strides[d];
        for (uint32_t b = 0; b < a->itemsize; b++) {
            h ^= base[off + b];
            h *= 1099511628211ull;
        }
        for (uint32_t d = a->ndim; d-- > 0;) {
            if (++idx[d] < a->shape[d])
                break;
            idx[d] = 0;
        }
    }
    return h;
}

/* forkclose's child: receive (refused: not its own), then free its copy. */
static void
child_closes(void *ctx, char *out, size_t cap)
{
    cip_sub *sub = ctx;
    cip_raw_frame f;
    cip_status rs = cip_sub_recv_raw(sub, 0, &f);
    cip_status cs = cip_sub_free(sub);
    snprintf(out, cap, "%s %s", cip_status_name(cs), cip_status_name(rs));
}

int
main(void)
{
    char line[1 << 17];
    setvbuf(stdout, NULL, _IOLBF, 0);
    while (fgets(line, sizeof line, stdin) != NULL) {
        line[strcspn(line, "\n")] = '\0';
        char cmd[32] = "", a1[1 << 16] = "", a2[64] = "", a3[64] = "", a4[64] = "", a5[256] = "";
        sscanf(line, "%31s %65535s %63s %63s %63s %255s", cmd, a1, a2, a3, a4, a5);
        cip_status st;
        if (!strcmp(cmd, "open_raw") || !strcmp(cmd, "open")) {
            cip_sub_options o;
            cip_sub_options_init(&o);
            o.mode = !strcmp(a2, "latest") ? CIP_MODE_LATEST : CIP_MODE_BLOCK;
            o.credit = (uint32_t)strtoul(a3, NULL, 10);
            o.timeout_ms = atoi(a4);
            uint32_t uids[16];
            size_t nu = 0;
            if (a5[0] && strcmp(a5, "-")) {
                for (char *t = strtok(a5, ","); t && nu < 16; t = strtok(NULL, ","))
                    uids[nu++] = (uint32_t)strtoul(t, NULL, 10);
                o.allowed_uids = uids;
                o.n_allowed_uids = nu;
            }
            st = !strcmp(cmd, "open") ? cip_sub_open(a1, &o, &sub) : cip_sub_open_raw(a1, &o, &sub);
            if (st != CIP_OK) {
                err(st);
                continue;
            }
            cip_sub_info info;
            cip_sub_get_info(sub, &info);
            const uint8_t *payload = NULL;
            size_t len = 0;
            cip_sub_welcome_payload(sub, &payload, &len);
            printf("ok %u %u %" PRIu64 " %u %u ", info.sub_id, info.num_slots, info.next_seq,
                   info.credit, info.lease_timeout_ms);
            hex(payload, len);
            printf(" %d\n", info.producer_pid);
        } else if (!strcmp(cmd, "map")) {
            const uint8_t *payload;
            size_t len;
            cip_sub_welcome_payload(sub, &payload, &len);
            memcpy(&slot_size, payload, 8);
            int fds[256];
            size_t n = 0;
            st = cip_sub_take_fds(sub, fds, 256, &n);
            if (st != CIP_OK) {
                err(st);
                continue;
            }
            maps = calloc(n, sizeof *maps);
            for (size_t i = 0; i < n; i++) {
                maps[i] = mmap(NULL, slot_size, PROT_READ, MAP_SHARED, fds[i], 0);
                close(fds[i]);
            }
            nmaps = n;
            printf("ok %zu\n", n);
        } else if (!strcmp(cmd, "recv")) {
            cip_raw_frame f;
            st = cip_sub_recv_raw(sub, atoi(a1), &f);
            if (st != CIP_OK) {
                err(st);
                continue;
            }
            last_len = f.payload_len;
            memcpy(last_payload, f.payload, f.payload_len);
            last_seq = f.seq;
            last_slot = f.slot;
            printf("frame %" PRIu64 " %u %u ", f.seq, f.slot, f.payload_len);
            hex(f.payload, f.payload_len);
            printf(" %s\n", match(f.seq, f.slot));
        } else if (!strcmp(cmd, "check")) {
            printf("ok %s\n", match(strtoull(a1, NULL, 10), (uint32_t)strtoul(a2, NULL, 10)));
        } else if (!strcmp(cmd, "release")) {
            st = cip_sub_release_raw(sub, strtoull(a1, NULL, 10), (uint32_t)strtoul(a2, NULL, 10));
            if (st != CIP_OK)
                err(st);
            else
                printf("ok\n");
        } else if (!strcmp(cmd, "recvrel")) {
            long n = atol(a1), done = 0;
            st = CIP_OK;
            for (; done < n; done++) {
                cip_raw_frame f;
                if ((st = cip_sub_recv_raw(sub, atoi(a2), &f)) != CIP_OK)
                    break;
                if ((st = cip_sub_release_raw(sub, f.seq, f.slot)) != CIP_OK)
                    break;
            }
            if (st != CIP_OK)
                printf("err %s after %ld frames: %s\n", cip_status_name(st), done,
                       cip_last_error());
            else
                printf("ok %ld\n", done);
        } else if (!strcmp(cmd, "layout")) {
            size_t reads = 0, nbytes = 0;
            st = cip_sync_layout((uint32_t)strtoul(a1, NULL, 10), (uint32_t)strtoul(a2, NULL, 10),
                                 &reads, &nbytes);
            if (st != CIP_OK)
                err(st);
            else
                printf("ok %zu %zu\n", reads, nbytes);
        } else if (!strcmp(cmd, "state")) {
            printf("ok %d\n", cip_flag_state((uint32_t)strtoul(a1, NULL, 10),
                                              (uint32_t)strtoul(a2, NULL, 10)));
        } else if (!strcmp(cmd, "page")) {
            int fd = open(a1, O_RDWR | O_CLOEXEC);
            struct stat sb;
            if (fd < 0 || fstat(fd, &sb) != 0) {
                printf("err CIP_ERR_TRANSPORT cannot open %s\n", a1);
                if (fd >= 0)
                    close(fd);
                continue;
            }
            if (page != NULL)
                munmap(page, page_nbytes);
            page_nbytes = (size_t)sb.st_size;
            page = mmap(NULL, page_nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            close(fd);
            if (page == MAP_FAILED) {
                page = NULL;
                printf("err CIP_ERR_TRANSPORT cannot map %s\n", a1);
                continue;
            }
            printf("ok %zu\n", page_nbytes);
        } else if (!strcmp(cmd, "word") || !strcmp(cmd, "force")) {
            size_t slot = strtoul(a1, NULL, 10);
            if (page == NULL || slot >= page_nbytes / 4) {
                printf("err CIP_ERR_INVALID_ARGUMENT no page, or slot out of range\n");
                continue;
            }
            int stored = 0;
            if (!strcmp(cmd, "force"))
                stored = cip_flag_force(&page[slot], (uint32_t)strtoul(a2, NULL, 10));
            uint32_t word = __atomic_load_n(&page[slot], __ATOMIC_ACQUIRE);
            if (!strcmp(cmd, "force"))
                printf("ok %d %u\n", stored, word);
            else
                printf("ok %u\n", word);
        } else if (!strcmp(cmd, "parse")) {
            cip_array arrays[CIP_MAX_ARRAYS];
            cip_frame f;
            uint64_t base = last_slot < nmaps ? (uint64_t)(uintptr_t)maps[last_slot] : 0;
            st = cip_parse_frame_payload(last_payload, last_len, last_seq, last_slot, slot_size,
                                         base, arrays, CIP_MAX_ARRAYS, &f);
            if (st != CIP_OK) {
                err(st);
                continue;
            }
            printf("ok %u ", f.num_arrays);
            hex(f.metadata, f.metadata_len);
            for (uint32_t i = 0; i < f.num_arrays; i++) {
                const cip_array *a = &arrays[i];
                if (a->data != base + a->offset) {
                    printf(" bad-data-pointer");
                    continue;
                }
                printf(" %" PRIu64 ":%s:%u:", a->offset, cip_dtype_name(a->dtype), a->ndim);
                for (uint32_t d = 0; d < a->ndim; d++)
                    printf("%s%" PRIu64, d ? "," : "", a->shape[d]);
                printf(":");
                for (uint32_t d = 0; d < a->ndim; d++)
                    printf("%s%" PRId64, d ? "," : "", a->strides[d]);
                printf(":%" PRIu64 ":%016" PRIx64, a->nbytes,
                       base ? fnv_array((const uint8_t *)(uintptr_t)base, a) : 0);
            }
            printf("\n");
        } else if (!strcmp(cmd, "fds")) {
            printf("ok %d\n", count_fds());
        } else if (!strcmp(cmd, "desc")) {
            static uint8_t buf[1 << 15];
            size_t n = unhex(a1, buf, sizeof buf);
            cip_descriptor d;
            st = cip_parse_descriptor(buf, n, &d);
            if (st != CIP_OK) {
                err(st);
                continue;
            }
            printf("ok %u %" PRIu64 " %" PRIu64 " %u %u %s\n", d.num_slots, d.slot_nbytes,
                   d.alloc_nbytes, d.exporter_pid, d.exporter_uid,
                   d.socket_path[0] ? d.socket_path : "-");
        } else if (!strcmp(cmd, "fetch")) {
            static uint8_t buf[1 << 15];
            size_t n = unhex(a1, buf, sizeof buf);
            int transport = !strcmp(a2, "pidfd") ? CIP_TRANSPORT_PIDFD
                            : !strcmp(a2, "socket") ? CIP_TRANSPORT_SOCKET
                                                    : CIP_TRANSPORT_AUTO;
            int fds[256];
            size_t count = 0;
            st = cip_fetch_fds(buf, n, transport, 5000, fds, 256, &count);
            if (st != CIP_OK) {
                err(st);
                continue;
            }
            printf("ok %zu", count);
            for (size_t i = 0; i < count; i++) {
                uint8_t head[8] = {0};
                ssize_t got = pread(fds[i], head, 8, 0);
                printf(" ");
                hex(head, got > 0 ? (size_t)got : 0);
                close(fds[i]);
            }
            printf("\n");
        } else if (!strcmp(cmd, "close")) {
            st = cip_sub_free(sub);
            sub = NULL;
            unmap_all();
            if (st != CIP_OK)
                err(st);
            else
                printf("ok\n");
        } else if (!strcmp(cmd, "forkchild")) {
            int ready[2];
            if (pipe(ready) != 0) {
                printf("err CIP_ERR_TRANSPORT pipe\n");
                continue;
            }
            fflush(stdout);
            pid_t pid = fork();
            if (pid == 0) { /* fork returns here after the at-fork handlers */
                char one = 1;
                (void)!write(ready[1], &one, 1);
                for (;;)
                    pause();
            }
            close(ready[1]);
            char one = 0;
            (void)!read(ready[0], &one, 1);
            close(ready[0]);
            printf("ok %d\n", (int)pid);
        } else if (!strcmp(cmd, "forkclose")) {
            char got[256];
            int code = fork_and_report(child_closes, sub, got, sizeof got);
            printf("ok %s %d\n", got, code);
        } else if (!strcmp(cmd, "quit")) {
            break;
        } else {
            printf("err CIP_ERR_INVALID_ARGUMENT unknown command '%s'\n", cmd);
        }
    }
    cip_sub_free(sub);
    unmap_all();
    if (page != NULL)
        munmap(page, page_nbytes);
    return 0;
}
