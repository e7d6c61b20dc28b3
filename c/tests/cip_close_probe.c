/*
 * cip_close_probe: a GPU subscription (cip_sub) whose producer died, closed, its answers
 * asked before and after cip_sub_close, for tests/test_c_library.py, without a GPU.
 *
 * The library's internal header is included and the program linked with its sources
 * (as cip_book_probe is), so that the handle is a real struct cip_sub, built as
 * cip_sub_open builds one -- the fields handshake() sets, then gpu_setup()'s: the
 * sync page (a sealed memfd of cip_sync_layout's size) mapped
 * and its fd closed, the event bookkeeping, the frame book -- less what needs the
 * driver: no pool is attached (a stand-in serves cip_sub_recv; see `close`), no event is
 * created and the page is not registered, so cip_sub_close's GPU branch runs on the
 * CPU.  The producer is a child process: it holds the other end of the subscription's
 * SOCK_SEQPACKET socket, sends FRAMEs on it and writes frame flags in its own mapping
 * of the page; the subscription holds its pidfd, as handshake() opens it.  Every call
 * on the handle is the library's: cip_sub_recv, cip_frame_complete,
 * cip_sub_incomplete_frames, the counts, cip_sub_get_info, cip_sub_error,
 * cip_sub_release, cip_sub_close and cip_sub_free.
 *
 * Commands (one per line; one answer line each):
 *   open NUM_SLOTS        the page, the producer, the handle -> ok PRODUCER_PID
 *   publish SEQ SLOT GEN V  the producer sends FRAME SEQ (void if V), cip_sub_recv
 *                         takes it -> ok SEQ SLOT GEN | err STATUS
 *   write SLOT VALUE      the producer's frame flag -> ok
 *   die                   the producer exits (its pidfd readable, reaped) -> ok
 *   recv                  cip_sub_recv -> ok SEQ | err STATUS
 *   release I             cip_sub_release of the I-th frame received -> ok | err STATUS
 *   answers               complete=C,... incomplete=S,...|- forced=N untracked=N
 *                         info=ID,SLOTS,NEXT_SEQ,CREDIT,MODE,PID fileno=FD error=TEXT
 *   fds                   -> ok COUNT (this process's open fds)
 *   held_fds              -> ok N (how many of the fds the handle had at its close are
 *                         open; before any close, of those it has now)
 *   mapped                -> ok 0|1 (the page's memfd is in /proc/self/maps)
 *   close                 cip_sub_close -> ok STATUS
 *   free                  cip_sub_free -> ok STATUS
 *   quit
 */
#include "../src/cip_internal.h"

#include <dirent.h>
#include <inttypes.h>
#include <sys/wait.h>

#define PAGE_NAME "cip-close-probe-page"
#define MAX_FRAMES 64

static cip_sub *sub;
static cip_pool *stand_in; /* what cip_sub_recv reads of a pool: no GPU memory */
static pid_t producer = -1;
static int to_producer = -1, from_producer = -1;
static int sub_fds[2] = {-1, -1}; /* the socket and the pidfd, as at the close */
static cip_frame frames[MAX_FRAMES];
static size_t nframes;

/* The producer: FRAMEs on the socket, flags in the page, each command acknowledged. */
static void
producer_main(int sock, int page_fd, size_t nbytes, int cmd, int ack)
{
    volatile uint32_t *page =
        (volatile uint32_t *)mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, page_fd, 0);
    close(page_fd);
    if ((void *)page == MAP_FAILED)
        _exit(3);
    unsigned long long a[4];
    char op;
    for (;;) {
        char line[128];
        ssize_t n = read(cmd, line, sizeof line - 1);
        if (n <= 0)
            _exit(0);
        line[n] = '\0';
        if (sscanf(line, "%c %llu %llu %llu %llu", &op, &a[0], &a[1], &a[2], &a[3]) < 1 ||
            op == 'x')
            _exit(0);
        if (op == 'w') {
            __atomic_store_n(&page[a[0]], (uint32_t)a[1], __ATOMIC_SEQ_CST);
        } else if (op == 'f') {
            uint8_t msg[CIP_WIRE_FRAME_SIZE + CIP_WIRE_FRAME_HEAD_SIZE];
            memset(msg, 0, sizeof msg);
            WR(msg, FRAME_MAGIC, CIP_WIRE_MAGIC);
            WR(msg, FRAME_VERSION, CIP_WIRE_VERSION);
            WR(msg, FRAME_TYPE, CIP_WIRE_FRAME);
            WR(msg, FRAME_SEQ, a[0]);
            WR(msg, FRAME_SLOT, a[1]);
            WR(msg, FRAME_LEN, CIP_WIRE_FRAME_HEAD_SIZE);
            uint8_t *head = msg + CIP_WIRE_FRAME_SIZE;
            WR(head, FRAME_HEAD_FLAG, a[1] | (a[3] ? CIP_WIRE_FRAME_VOID : 0u));
            WR(head, FRAME_HEAD_GENERATION, a[2]);
            if (send(sock, msg, sizeof msg, MSG_NOSIGNAL) != (ssize_t)sizeof msg)
                _exit(4);
        }
        if (write(ack, "k", 1) != 1)
            _exit(5);
    }
}

static int
tell_producer(const char *line)
{
    char k;
    if (write(to_producer, line, strlen(line)) != (ssize_t)strlen(line))
        return -1;
    return read(from_producer, &k, 1) == 1 ? 0 : -1;
}

static const char *
open_sub(uint32_t n)
{
    size_t reads = 0, nbytes = 0;
    if (cip_sync_layout(n, 1, &reads, &nbytes) != CIP_OK)
        return "layout";
    int page_fd = memfd_create(PAGE_NAME, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (page_fd < 0 || ftruncate(page_fd, (off_t)nbytes) != 0 ||
        fcntl(page_fd, F_ADD_SEALS, CIP_WIRE_SYNC_SEALS) != 0)
        return "memfd";
    int pair[2], cmd[2], ack[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) != 0 || pipe(cmd) != 0 ||
        pipe(ack) != 0)
        return "socketpair";
    fflush(stdout);
    producer = fork();
    if (producer < 0)
        return "fork";
    if (producer == 0) {
        close(pair[0]);
        close(cmd[1]);
        close(ack[0]);
        producer_main(pair[1], page_fd, nbytes, cmd[0], ack[1]);
    }
    close(pair[1]);
    close(cmd[0]);
    close(ack[1]);
    to_producer = cmd[1];
    from_producer = ack[0];

    /* handshake(): the connected socket, the producer's pidfd, the WELCOME's fields */
    sub = (cip_sub *)calloc(1, sizeof *sub);
    if (sub == NULL)
        return "calloc";
    sub->sock = pair[0];
    sub->owner = getpid(); /* (as cip_sub_open_raw sets it) */
    sub->pidfd = (int)syscall(CIP_SYS_PIDFD_OPEN, producer, 0);
    if (sub->pidfd < 0)
        return "pidfd_open";
    fcntl(sub->pidfd, F_SETFD, FD_CLOEXEC);
    sub->info.mode = CIP_MODE_BLOCK;
    sub->info.credit = CIP_WIRE_DEFAULT_BLOCK_CREDIT;
    sub->info.producer_pid = producer;
    sub->info.producer_uid = (uint32_t)geteuid();
    sub->info.sub_id = 7;
    sub->info.num_slots = n;
    sub->info.next_seq = 0;
    snprintf(sub->path, sizeof sub->path, "%s", "(socketpair)");
    sub->buf = (uint8_t *)malloc(CIP_WIRE_MAX_FRAME_SIZE + 1);
    sub->welcome = (uint8_t *)malloc(1);
    sub->fds = (int *)malloc(sizeof(int));
    sub->held = (struct held *)calloc(n, sizeof(struct held));
    sub->gpu = 1;
    /* gpu_setup(): the page mapped and its fd closed, the bookkeeping, no driver */
    void *m = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, page_fd, 0);
    close(page_fd);
    if (m == MAP_FAILED)
        return "mmap";
    sub->page = (volatile uint32_t *)m;
    sub->page_nbytes = nbytes;
    sub->reads_offset = reads;
    sub->row = 0;
    sub->max_subs = 1;
    sub->ev_wait = (CUevent *)calloc(n, sizeof(CUevent));
    sub->ev_write = (CUevent *)calloc(n, sizeof(CUevent));
    sub->wait_recorded = (uint8_t *)calloc(n, 1);
    sub->write_recorded = (uint8_t *)calloc(n, 1);
    if (!sub->buf || !sub->welcome || !sub->fds || !sub->held || !sub->ev_wait ||
        !sub->ev_write || !sub->wait_recorded || !sub->write_recorded ||
        cipi_book_init(&sub->book, n, CIP_WIRE_SYNC_RECORD_CAP) != 0 ||
        cipi_ledger_init(&sub->ledger, n, sub->info.next_seq) != CIP_OK)
        return "out of memory";
    cipi_owed_init(&sub->owed, n);
    /* cipi_attach_fds(): what cip_sub_recv reads of the pool, with no GPU memory behind it */
    stand_in = (cip_pool *)calloc(1, sizeof *stand_in);
    if (stand_in == NULL)
        return "out of memory";
    stand_in->device = -1;
    stand_in->num_slots = stand_in->desc.num_slots = n;
    stand_in->desc.slot_nbytes = 4096;
    stand_in->ptrs = (uint64_t *)calloc(n, sizeof(uint64_t));
    stand_in->seen = (uint64_t *)calloc(n, sizeof(uint64_t));
    if (!stand_in->ptrs || !stand_in->seen)
        return "out of memory";
    for (uint32_t s = 0; s < n; s++)
        stand_in->ptrs[s] = 0x100000000ull + (uint64_t)s * 4096;
    sub->pool = stand_in;
    sub_fds[0] = sub->sock;
    sub_fds[1] = sub->pidfd;
    return NULL;
}

/* cip_pool_close would unmap GPU memory through the driver: the stand-in, which has
 * none (and no fd), is given back here, before the handle is closed. */
static void
drop_stand_in(void)
{
    if (stand_in == NULL)
        return;
    if (sub != NULL && sub->pool == stand_in)
        sub->pool = NULL;
    free(stand_in->ptrs);
    free(stand_in->seen);
    free(stand_in);
    stand_in = NULL;
}

static void
print_answers(void)
{
    printf("ok complete=");
    for (size_t i = 0; i < nframes; i++)
        printf("%s%d", i ? "," : "", cip_frame_complete(sub, &frames[i]));
    size_t count = 0;
    uint64_t seqs[MAX_FRAMES];
    cip_status st = cip_sub_incomplete_frames(sub, seqs, MAX_FRAMES, &count);
    if (st != CIP_OK) {
        printf(" incomplete=%s", cip_status_name(st));
    } else {
        printf(" incomplete=");
        for (size_t i = 0; i < count; i++)
            printf("%s%" PRIu64, i ? "," : "", seqs[i]);
        if (count == 0)
            printf("-");
    }
    cip_sub_info info;
    memset(&info, 0, sizeof info);
    st = cip_sub_get_info(sub, &info);
    printf(" forced=%" PRIu64 " untracked=%" PRIu64 " info=%s,%u,%u,%" PRIu64 ",%u,%d,%d",
           cip_sub_forced_flags(sub), cip_sub_untracked_frames(sub), cip_status_name(st),
           (unsigned)info.sub_id, (unsigned)info.num_slots, (uint64_t)info.next_seq,
           (unsigned)info.credit, (int)info.mode, (int)info.producer_pid);
    printf(" error=%s\n", cip_sub_error(sub));
}

/* The open fds of this process (/proc/self/fd, less the directory's own fd). */
static int
count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    struct dirent *e;
    if (d == NULL)
        return -1;
    while ((e = readdir(d)) != NULL)
        n += e->d_name[0] != '.';
    closedir(d);
    return n - 1;
}

static int
open_of(const int *fds, size_t n)
{
    int k = 0;
    for (size_t i = 0; i < n; i++)
        k += fds[i] >= 0 && fcntl(fds[i], F_GETFD) != -1;
    return k;
}

static int
page_mapped(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    int found = 0;
    if (f == NULL)
        return -1;
    while (fgets(line, sizeof line, f) != NULL)
        found |= strstr(line, PAGE_NAME) != NULL;
    fclose(f);
    return found;
}

int
main(void)
{
    char line[512];
    setvbuf(stdout, NULL, _IOLBF, 0);
    while (fgets(line, sizeof line, stdin) != NULL) {
        char cmd[32] = "";
        unsigned long long a[4] = {0, 0, 0, 0};
        sscanf(line, "%31s %llu %llu %llu %llu", cmd, &a[0], &a[1], &a[2], &a[3]);
        if (!strcmp(cmd, "open")) {
            const char *why = sub == NULL ? open_sub((uint32_t)a[0]) : "opened already";
            if (why != NULL)
                printf("err %s: %s\n", why, strerror(errno));
            else
                printf("ok %d\n", (int)producer);
        } else if (!strcmp(cmd, "fds")) {
            printf("ok %d\n", count_fds());
        } else if (!strcmp(cmd, "mapped")) {
            printf("ok %d\n", page_mapped());
        } else if (!strcmp(cmd, "quit")) {
            break;
        } else if (sub == NULL) {
            printf("err no subscription\n");
        } else if (!strcmp(cmd, "publish")) {
            char msg[128];
            snprintf(msg, sizeof msg, "f %llu %llu %llu %llu\n", a[0], a[1], a[2], a[3]);
            if (producer < 0 || tell_producer(msg) != 0) {
                printf("err the producer did not send it\n");
                continue;
            }
            cip_frame f;
            cip_status st = cip_sub_recv(sub, 5000, &f);
            if (st != CIP_OK) {
                printf("err %s %s\n", cip_status_name(st), cip_last_error());
            } else {
                if (nframes < MAX_FRAMES)
                    frames[nframes++] = f;
                printf("ok %" PRIu64 " %u %u\n", f.seq, f.slot, f.generation);
            }
        } else if (!strcmp(cmd, "write")) {
            char msg[64];
            snprintf(msg, sizeof msg, "w %llu %llu\n", a[0], a[1]);
            printf(producer >= 0 && tell_producer(msg) == 0 ? "ok\n" : "err producer\n");
        } else if (!strcmp(cmd, "die")) {
            int status = 0;
            struct pollfd p = {sub_fds[1], POLLIN, 0};
            (void)!write(to_producer, "x\n", 2);
            int ready = poll(&p, 1, 10000) == 1;
            int reaped = waitpid(producer, &status, 0) == producer;
            close(to_producer);
            close(from_producer);
            to_producer = from_producer = -1;
            producer = -1;
            printf(ready && reaped && WIFEXITED(status) ? "ok\n" : "err the producer lives\n");
        } else if (!strcmp(cmd, "recv")) {
            cip_frame f;
            cip_status st = cip_sub_recv(sub, 2000, &f);
            if (st == CIP_OK)
                printf("ok %" PRIu64 "\n", f.seq);
            else
                printf("err %s\n", cip_status_name(st));
        } else if (!strcmp(cmd, "release")) {
            if (a[0] >= nframes) {
                printf("err no such frame\n");
                continue;
            }
            cip_status st = cip_sub_release(sub, &frames[a[0]], NULL);
            printf(st == CIP_OK ? "ok\n" : "err %s\n", cip_status_name(st));
        } else if (!strcmp(cmd, "answers")) {
            print_answers();
        } else if (!strcmp(cmd, "held_fds")) {
            if (!sub->closed) {
                sub_fds[0] = sub->sock;
                sub_fds[1] = sub->pidfd;
            }
            printf("ok %d\n", open_of(sub_fds, 2));
        } else if (!strcmp(cmd, "close")) {
            if (!sub->closed) {
                sub_fds[0] = sub->sock;
                sub_fds[1] = sub->pidfd;
            }
            drop_stand_in();
            printf("ok %s\n", cip_status_name(cip_sub_close(sub)));
        } else if (!strcmp(cmd, "free")) {
            drop_stand_in();
            cip_status st = cip_sub_free(sub);
            sub = NULL;
            printf("ok %s\n", cip_status_name(st));
        } else {
            printf("err unknown command '%s'\n", cmd);
        }
    }
    if (producer > 0) {
        kill(producer, SIGKILL);
        waitpid(producer, NULL, 0);
    }
    return 0;
}
