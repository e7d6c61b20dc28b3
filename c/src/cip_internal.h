/*
 * cip_internal.h -- what the modules of the C consumer library of cupy_ipcpool share
 * (see cupy_ipcpool.h); not installed, not part of the API.
 *
 * Every layout and limit comes from cupy_ipcpool_wire.h, generated from the
 * Python package (c/gen_wire.py); fields are read and written by their
 * generated offset and width.  The CUDA driver is loaded at run time
 * (dlopen("libcuda.so.1") + cuGetProcAddress): no CUDA header is needed, the
 * few types used are declared here.
 *
 * Modules (every .c file of c/src is the library; one concern each):
 *   errors.c     errors: the thread's last message, status names and texts
 *   util.c       clocks, deadlines, fds and growing rings
 *   driver.c     the CUDA driver, loaded at run time: dlopen of libcuda, the function
 *                table, contexts, devices
 *   wire.c       the wire: compile-time checks against the generated layouts, dtypes, pool
 *                descriptors, array handles, frame payloads
 *   message.c    one channel message decoded and checked, of every kind: the message rules,
 *                and the messages the engine sends, written
 *   welcome.c    what the WELCOME brought (payload, sync page fd), checked before mapping
 *   sockets.c    Unix sockets: the socket path check, connecting, receiving fds
 *   listen.c     a listening Unix socket at a path: bound and set listening before the file
 *                appears, a stale file replaced, removed at teardown only while ours
 *   pidfd.c      what names an exporter (pid, start time, PID namespace) and pidfd_getfd
 *   fetch.c      fetching an exporter's fds: the fd server's client, the choice of transport
 *   fdserver.c   the fd server: serving an exporter's fds over a Unix socket (its thread)
 *   forked.c     what a child forked while ends are open closes at the fork
 *   host_frame.c frames in host memory: array specs, their place in a slot, the payload
 *   pool.c       pools: attach (import, reserve, map, access), slots, handles, close (no
 *                unmap under queued GPU work)
 *   syncpage.c   the sync page: layout, flag states, forcing (no GPU)
 *   book.c       the frame book: awaited flags, the record of frames, forcing after a
 *                death, the answers (no GPU)
 *   ledger.c     the frame ledger: the order of frames, the frames held, releases and
 *                releases ahead of the message (no GPU)
 *   owed.c       the RELEASEs owed: sent without waiting, kept in order, bounded
 *   leases.c     the publisher's lease book: leases, RELEASEs explained, "latest" budget,
 *                leases ended at read flags, releases ahead, the eviction rule (no GPU)
 *   pub_wire.c   the publisher's per-frame wire: the FRAME to the receivers the lease book
 *                names, the subscribers' messages (RELEASEs into the book, the rest as
 *                events that drop a subscriber) (no GPU)
 *   pub_session.c the publisher's adopted subscribers: their sockets, departures, eviction
 *                (lease_timeout, a socket that stays full), the eviction notice, the BYE
 *                at close (no GPU)
 *   pub_poll.c   the publisher's wait for a lease to end: messages, read flags, the spin,
 *                lease_timeout, the notices that wait for room (no GPU)
 *   reader_rows.c the publisher's rows of read flags: who writes which, the departed
 *                readers' rows (kept while streams may wait, forced after a death) (no GPU)
 *   admission.c  connections waiting, per group, one deadline each, a cap per group (no GPU)
 *   acceptor.c   the publisher's accept thread: the uid check, HELLO, WELCOME (no GPU)
 *   producer.c   the producer's calls: adoption, the next seq, the pick of a free slot and
 *                the wait for one, the leases ended since the last poll (no GPU)
 *   publisher.c  the raw publisher of the API (cip_pub_*): the modules above at a path (no GPU)
 *   hangup.c     the verdict on what is still queued at a hang-up
 *   session.c    the channel's socket session: the end of a stream, the backlog, hang-ups,
 *                releases owed, judging messages, the next frame
 *   handshake.c  opening a subscription: options, the handshake, the raw open
 *   raw.c        what every session answers (info, welcome, fds, fileno, error) and the raw
 *                session's receive and release
 *   gpu_sub.c    the GPU subscription: setup, receive, waits, answers, releases
 *   sub_close.c  closing a subscription: quiesce the flag operations, freeze the answers,
 *                the close order, free
 *
 * A function or variable one module defines and another uses is declared at the end
 * of this file (the publisher side's in cip_publisher.h, which it includes), named cipi_*
 * and of hidden visibility: a shared library exports the API of cupy_ipcpool.h only, and
 * a program that compiles the sources in keeps its own names.  rd, wr and flag_load, a few lines each, are static inline here.
 */
#ifndef CIP_INTERNAL_H
#define CIP_INTERNAL_H

#ifndef _GNU_SOURCE /* Python.h defines it already when the engine is built under Python */
#define _GNU_SOURCE
#endif
#include "cupy_ipcpool.h"
#include "cupy_ipcpool_wire.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define CIP_INTERNAL __attribute__((visibility("hidden")))

/* errors.c: the calling thread's last error message (cip_last_error) */
CIP_INTERNAL extern __thread char cipi_tls_error[768];

#define CIP_ASSERT(cond, name) typedef char cip_assert_##name[(cond) ? 1 : -1]
#if defined(SYS_pidfd_getfd)
CIP_ASSERT(SYS_pidfd_getfd == CIP_WIRE_SYS_PIDFD_GETFD_X86_64, pidfd_getfd_nr);
#define CIP_SYS_PIDFD_GETFD SYS_pidfd_getfd
#else
#define CIP_SYS_PIDFD_GETFD CIP_WIRE_SYS_PIDFD_GETFD_X86_64
#endif
#if defined(SYS_pidfd_open)
#define CIP_SYS_PIDFD_OPEN SYS_pidfd_open
#else
#define CIP_SYS_PIDFD_OPEN 434
#endif

#define CIP_I32_MAX 0x7FFFFFFFull
#define CIP_I64_MAX 0x7FFFFFFFFFFFFFFFull
/* The waits after a death and at close are the Python package's, generated into
 * cupy_ipcpool_wire.h (channel/_settle.py, _vmm.py say why each is what it is):
 * CIP_WIRE_CLOSE_WAIT_MS, how long gpu_quiesce waits for our flag operations at
 * close; CIP_WIRE_DEATH_WAIT_MS, after a hang-up without BYE while a stream of ours
 * waits on a frame flag, how long to wait for the producer's pidfd (its sockets
 * close while it exits, before its pidfd says so: a CUDA process's exit takes
 * seconds while the driver tears down its context, and the stream must not be left
 * waiting on a flag nobody will write); CIP_WIRE_UNMAP_WAIT_MS, below. */

/* ---- little-endian fields by generated offset and width ------------------------------ */

static inline uint64_t
rd(const uint8_t *p, size_t width)
{
    uint64_t v = 0;
    for (size_t i = width; i-- > 0;)
        v = (v << 8) | p[i];
    return v;
}

static inline void
wr(uint8_t *p, size_t width, uint64_t v)
{
    for (size_t i = 0; i < width; i++) {
        p[i] = (uint8_t)(v & 0xFF);
        v >>= 8;
    }
}

#define RD(base, NAME) rd((const uint8_t *)(base) + CIP_WIRE_##NAME##_OFF, CIP_WIRE_##NAME##_WIDTH)
#define WR(base, NAME, v) wr((uint8_t *)(base) + CIP_WIRE_##NAME##_OFF, CIP_WIRE_##NAME##_WIDTH, (v))

/* ---- the driver (driver.c) ------------------------------------------------------------ */

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUevent;
typedef uint64_t CUdeviceptr;
typedef struct {
    unsigned char bytes[16];
} cip_cuuuid;
typedef struct {
    int type; /* CUmemLocationType: CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int id;
} cip_mem_location;
typedef struct {
    cip_mem_location location;
    int flags; /* CUmemAccess_flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} cip_access_desc;

#define CIP_CUDA_SUCCESS 0
#define CIP_CUDA_ERROR_NOT_READY 600
#define CIP_CU_MEM_LOCATION_TYPE_DEVICE 1
#define CIP_CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3
#define CIP_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1
#define CIP_CU_MEMHOSTREGISTER_PORTABLE 1
#define CIP_CU_MEMHOSTREGISTER_DEVICEMAP 2
#define CIP_CU_STREAM_WAIT_VALUE_GEQ 0
#define CIP_CU_STREAM_WRITE_VALUE_DEFAULT 0
#define CIP_CU_EVENT_DISABLE_TIMING 2
#define CIP_CUDA_API_VERSION 12000

typedef CUresult (*getproc_v1_t)(const char *, void **, int, unsigned long long);
typedef CUresult (*getproc_v2_t)(const char *, void **, int, unsigned long long, int *);

struct cipi_driver {
    pthread_once_t once;
    cip_status status;
    char error[512];
    void *lib;
    getproc_v1_t getproc_v1;
    getproc_v2_t getproc_v2;
    int version;
    CUresult (*GetErrorName)(CUresult, const char **);
    CUresult (*GetErrorString)(CUresult, const char **);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DeviceGetUuid)(cip_cuuuid *, CUdevice);
    CUresult (*DeviceCanAccessPeer)(int *, CUdevice, CUdevice);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*CtxPushCurrent)(CUcontext);
    CUresult (*CtxPopCurrent)(CUcontext *);
    CUresult (*CtxSynchronize)(void);
    CUresult (*MemImportFromShareableHandle)(uint64_t *, void *, int);
    CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*MemMap)(CUdeviceptr, size_t, size_t, uint64_t, unsigned long long);
    CUresult (*MemSetAccess)(CUdeviceptr, size_t, const cip_access_desc *, size_t);
    CUresult (*MemUnmap)(CUdeviceptr, size_t);
    CUresult (*MemAddressFree)(CUdeviceptr, size_t);
    CUresult (*MemRelease)(uint64_t);
    CUresult (*MemHostRegister)(void *, size_t, unsigned int);
    CUresult (*MemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned int);
    CUresult (*MemHostUnregister)(void *);
    CUresult (*StreamWaitValue32)(void *, CUdeviceptr, uint32_t, unsigned int);
    CUresult (*StreamWriteValue32)(void *, CUdeviceptr, uint32_t, unsigned int);
    CUresult (*EventCreate)(CUevent *, unsigned int);
    CUresult (*EventRecord)(CUevent, void *);
    CUresult (*EventQuery)(CUevent);
    CUresult (*EventDestroy)(CUevent);
};

/* ---- pools (pool.c) --------------------------------------------------------------------- */

struct cip_pool {
    cip_descriptor desc;
    int device;
    uint32_t num_slots;
    uint64_t *ptrs;
    uint64_t *handles;
    uint64_t *seen;
};

/* ---- the sync page and the frame book (syncpage.c, book.c) ------------------------------ */

static inline uint32_t
flag_load(volatile uint32_t *flags, uint32_t slot)
{
    return __atomic_load_n(&flags[slot], __ATOMIC_ACQUIRE);
}

/* A received frame, as the record keeps it. */
struct seen_frame {
    uint64_t seq;
    uint32_t slot, generation;
};

/* What a GPU subscription knows of the frame flags (the Python FrameWaits, rule for
 * rule): per slot the generation a stream of ours may wait for, and a bounded record,
 * oldest first, of the frames received whose flag the host did not see set by the
 * producer.  When the producer dies, cipi_book_resolve forces the flags it never wrote so
 * that every wait ends, and cipi_book_answers names the frames never written.  Pure state
 * over the page's frame flags (the page's first num_slots words). */
struct frame_book {
    uint32_t num_slots;
    uint8_t *awaited_set; /* per slot: a stream of ours may wait on the frame flag ... */
    uint32_t *awaited;    /* ... for this generation */
    struct seen_frame *rec; /* a ring of rec_alloc entries, rec_len used from rec_head */
    size_t rec_head, rec_len, rec_alloc, rec_cap;
    uint64_t untracked; /* frames dropped from a full record */
    uint64_t forced;    /* frame flags this subscription forced */
};

/* ---- the frame ledger (ledger.c) ------------------------------------------------------- */

struct cipi_hold {
    int held;
    uint64_t seq;
};

/* Rule 1 of a subscriber's stream, and the frames it released ahead of their message:
 * the C subscriber's and (cupy_ipcpool._engine.FrameLedger) the Python one's. */
struct cipi_ledger {
    uint32_t num_slots;
    uint64_t first_seq;      /* the WELCOME's next_seq: no frame comes before it */
    int have_seq;            /* a frame was received ... */
    uint64_t last_seq;       /* ... and this one last */
    struct cipi_hold *holds; /* by slot: the frame of ours held there (at most one) */
    uint64_t *ahead;         /* the seqs released ahead of their message ... */
    uint32_t ahead_len;      /* ... at most num_slots */
};

/* ---- the channel (session.c, handshake.c, raw.c, gpu_sub.c, sub_close.c) ---------------- */

/* What a GPU subscription keeps per slot (whether a frame is held there: the ledger). */
struct held {
    uint32_t generation;
    int void_seen;            /* a void frame was received in this slot ... */
    uint32_t void_generation; /* ... the last one at this generation (cip_frame_complete 0) */
    cip_array *arrays; /* CIP_MAX_ARRAYS, made at the slot's first frame (GPU sessions) */
    uint8_t *meta;     /* CIP_MAX_METADATA */
};

struct msgbuf {
    uint8_t *data;
    size_t len;
};

/* A RELEASE the socket did not take yet (the publisher is not reading). */
struct owed_release {
    uint64_t seq;
    uint32_t slot;
};

/* The RELEASEs owed (owed.c): a ring, oldest first, at most `limit`. */
struct cipi_owed {
    struct owed_release *ring;
    size_t head, len, alloc, limit;
};

struct cip_sub {
    int sock;
    int pidfd; /* the producer's, -1 where it cannot be opened */
    pid_t owner; /* the process that opened it: a child forked from it may not use it */
    int gpu;
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    cip_sub_info info;
    uint8_t *welcome;
    size_t welcome_len;
    int *fds;
    size_t nfds;
    uint8_t *buf; /* one datagram: MAX_FRAME_SIZE + 1 */
    struct msgbuf *backlog; /* what was still queued when the publisher hung up */
    size_t bl_head, bl_len, bl_cap;
    cip_status ended; /* CIP_OK while the stream runs */
    char error[sizeof cipi_tls_error];
    struct cipi_ledger ledger; /* rule 1: the order of frames, the frames held */
    struct held *held;         /* by slot: the held frame's generation, arrays, metadata */
    struct cipi_owed owed; /* RELEASEs to send, in order, before any other */
    /* GPU sessions */
    cip_pool *pool;
    uint32_t row, max_subs;
    volatile uint32_t *page;
    size_t page_nbytes, reads_offset;
    CUdeviceptr page_dev;
    int registered;
    int untracked; /* an operation was enqueued without its event: keep the page at close */
    CUevent *ev_wait, *ev_write;
    uint8_t *wait_recorded, *write_recorded;
    struct frame_book book; /* awaited flags and the record of frames not seen complete */
    int closed;             /* cip_sub_close ran: only the answers and the error remain */
    uint32_t *final_flags;  /* the frame flags at close, which the answers read then */
};

/* ---- shared between modules, by the module that defines it ------------------------------ */

/* forked.c: run in_child(end) in every child forked while `end` is watched (it closes the
 * child's copies of what would hide this process's death); unwatch before `end` goes. */
CIP_INTERNAL void cipi_fork_watch(void *end, void (*in_child)(void *end));
CIP_INTERNAL void cipi_fork_unwatch(void *end);
/* sub_close.c: CIP_OK while `sub` may be used here: open, in the process that opened it */
CIP_INTERNAL cip_status cipi_sub_usable(const cip_sub *sub);
/* sub_close.c: a child forked while `sub` is open closes its copy of the socket at the fork
 * (cip_sub_close forgets it) */
CIP_INTERNAL void cipi_sub_watch_fork(cip_sub *sub);
/* pool.c: free a pool's memory without a driver call (a forked child's copy) */
CIP_INTERNAL void cipi_pool_forget(cip_pool *pool);

/* errors.c */
CIP_INTERNAL cip_status cipi_fail(cip_status status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* util.c */
CIP_INTERNAL long long cipi_now_ns(void);
CIP_INTERNAL long long cipi_now_ms(void);
CIP_INTERNAL int cipi_pidfd_open(int pid);
CIP_INTERNAL int cipi_pidfd_exited(int pidfd);
CIP_INTERNAL void cipi_pidfd_close(int pidfd);
CIP_INTERNAL struct timespec cipi_timespec_of_ns(long long ns);
CIP_INTERNAL void cipi_fmt_seconds(char *out, size_t size, double x);
CIP_INTERNAL int cipi_left_ms(long long deadline);
CIP_INTERNAL long long cipi_deadline_of(int timeout_ms);
CIP_INTERNAL void cipi_sleep_us(long us);
CIP_INTERNAL void cipi_close_fds(int *fds, size_t n);
CIP_INTERNAL void *cipi_ring_regrow(void *old, size_t size, size_t *head, size_t len, size_t *alloc,
                                    size_t new_alloc);

/* pidfd.c, fetch.c: an exporter's fds, by pidfd_getfd or from its fd server */
enum cipi_where { CIPI_WHERE_SAME, CIPI_WHERE_OTHER, CIPI_WHERE_UNKNOWN }; /* its pid namespace */
struct cipi_fetch {
    int pid;                    /* the exporter's (0: unknown, the socket only) */
    long long start_time;       /* its start time (-1: not checked) */
    const uint32_t *fds;        /* its fd numbers, n of them (pidfd) */
    long long n;                /* how many fds (also what the fd server must send) */
    const char *socket_path;    /* its fd server (NULL: none) */
    const uint8_t *token;       /* the fd server's token, token_len bytes */
    size_t token_len;
    int method;                 /* CIP_TRANSPORT_* */
    long long exporter_uid;     /* the fd server must run as it (-1: unknown) */
    enum cipi_where where;      /* the exporter's pid namespace, as cipi_where_of says */
    int timeout_ms;             /* the fd server's exchange (negative: no limit) */
};
CIP_INTERNAL extern const char cipi_shared_socket_fix[];
CIP_INTERNAL const char *cipi_errname(int err); /* "EPERM"; NULL when not named here */
CIP_INTERNAL enum cipi_where cipi_where_of(unsigned long long pid_namespace);
CIP_INTERNAL cip_status cipi_process_start_time(int pid, long long *out, int *err);
CIP_INTERNAL cip_status cipi_pidfd_fail(int err, int pid, int fd, const char *call,
                                        enum cipi_where where);
CIP_INTERNAL cip_status cipi_getfd_all(int pid, const uint32_t *targets, size_t n,
                                       long long start_time, enum cipi_where where, int *out,
                                       int *err);
/* f->n fds into out (close-on-exec, the caller's; nothing left open on failure); the
 * status, *err the errno that says why (CIP_ERR_REFUSED: the server refused, or is not the
 * exporter; CIP_ERR_TIMEOUT: the fd server did not answer in time). */
CIP_INTERNAL cip_status cipi_fetch(const struct cipi_fetch *f, int *out, int *err);

/* fdserver.c: serve fds[0..nfds) (the caller's, kept open while it serves) to clients of
 * the listening socket `listener` (taken once made: closed by stop) that present `token` and run as
 * one of `uids`; its own thread from start to stop.  `live`: connections being served. */
struct cipi_fdserver;
CIP_INTERNAL cip_status cipi_fdserver_new(int listener, const int *fds, size_t nfds,
                                          const uint8_t *token, size_t token_len,
                                          const uint32_t *uids, size_t nuids,
                                          struct cipi_fdserver **out);
CIP_INTERNAL cip_status cipi_fdserver_start(struct cipi_fdserver *s);
CIP_INTERNAL int cipi_fdserver_live(const struct cipi_fdserver *s);
CIP_INTERNAL const char *cipi_fdserver_failure(const struct cipi_fdserver *s);
CIP_INTERNAL void cipi_fdserver_stop(struct cipi_fdserver *s);
CIP_INTERNAL void cipi_fdserver_free(struct cipi_fdserver *s);

/* driver.c */
CIP_INTERNAL extern struct cipi_driver cipi_drv;
CIP_INTERNAL cip_status cipi_driver(void);
CIP_INTERNAL cip_status cipi_cuda_fail(const char *call, CUresult rc);
CIP_INTERNAL cip_status cipi_ctx_push(int device);
CIP_INTERNAL void cipi_ctx_pop(void);
CIP_INTERNAL cip_status cipi_resolve_device(const uint8_t *uuid, int device, int *out);

/* wire.c */
CIP_INTERNAL int cipi_valid_utf8(const uint8_t *s, size_t n, int allow_nul);
struct cipi_frame_head {
    uint32_t generation;   /* the low 32 bits of the slot's generation */
    uint32_t num_arrays;
    uint32_t metadata_len;
    int is_void;           /* the flag index carries CIP_WIRE_FRAME_VOID */
};
CIP_INTERNAL cip_status cipi_frame_head(const void *payload, size_t len, uint64_t seq,
                                        uint32_t slot, struct cipi_frame_head *out);
CIP_INTERNAL cip_status cipi_parse_handle(const uint8_t *p, size_t avail, cip_array *a,
                                          size_t *used);
CIP_INTERNAL cip_status cipi_check_fits(const cip_array *a, uint64_t slot_nbytes);
CIP_INTERNAL cip_status cipi_parse_frame_payload(const void *payload, size_t len, uint64_t seq,
                                                 uint32_t slot, uint64_t slot_nbytes,
                                                 uint64_t slot_base, cip_array *arrays, size_t cap,
                                                 cip_frame *out, int *is_void);

/* message.c: one channel message, decoded and checked (every kind, either direction) */
struct cipi_msg {
    unsigned type;           /* CIP_WIRE_HELLO .. CIP_WIRE_BYE */
    uint64_t seq;            /* FRAME, RELEASE; WELCOME: next_seq */
    uint32_t slot;           /* FRAME, RELEASE */
    uint32_t mode, pid;      /* HELLO */
    uint32_t credit;         /* HELLO, WELCOME */
    uint32_t sub_id, num_slots, lease_timeout_ms; /* WELCOME */
    const uint8_t *payload;  /* HELLO, WELCOME, FRAME: the payload; REFUSE: the reason
                                (UTF-8, not NUL-terminated); points into the message */
    uint32_t len;            /* the payload's length */
};
CIP_INTERNAL cip_status cipi_decode(const void *data, size_t n, struct cipi_msg *out);
CIP_INTERNAL const char *cipi_type_name(unsigned type);
CIP_INTERNAL cip_status cipi_put_hello(uint8_t *p, unsigned mode, uint64_t credit, uint32_t pid,
                                       size_t len);
CIP_INTERNAL void cipi_put_frame_head(uint8_t *p, uint64_t seq, uint32_t slot, size_t len);
CIP_INTERNAL void cipi_put_release(uint8_t *p, uint64_t seq, uint32_t slot);
CIP_INTERNAL void cipi_put_bye(uint8_t *p);
CIP_INTERNAL size_t cipi_put_refuse(uint8_t *p, const char *reason, size_t len);
CIP_INTERNAL cip_status cipi_put_welcome(uint8_t *p, uint32_t sub_id, long long num_slots,
                                         uint64_t next_seq, long long credit,
                                         long long lease_timeout_ms, size_t len);
CIP_INTERNAL size_t cipi_utf8_cut(const char *s, size_t n, size_t max);

/* welcome.c: what the WELCOME brought, checked before anything is mapped (no GPU) */
struct cipi_welcome {
    cip_descriptor desc;     /* the pool's descriptor, parsed */
    size_t desc_offset, desc_len; /* where its bytes lie in the payload */
    uint32_t row, max_subscribers; /* this subscriber's row of read flags, and the rows */
    size_t reads_offset, sync_nbytes; /* the sync page's layout */
};
CIP_INTERNAL cip_status cipi_check_welcome(const uint8_t *p, size_t len, uint32_t n, size_t nfds,
                                           struct cipi_welcome *out);
CIP_INTERNAL cip_status cipi_check_sync_fd(int fd, size_t nbytes);

/* sockets.c */
CIP_INTERNAL cip_status cipi_check_socket_path(const char *path);
CIP_INTERNAL cip_status cipi_connect_unix(const char *path, int type, long long deadline, int *out,
                                          int *err);
CIP_INTERNAL ssize_t cipi_recv_with_fds(int s, void *buf, size_t n, void *control,
                                        size_t control_len, int *fds, size_t *nfds, size_t maxfds,
                                        int *excess, int *msg_flags);

/* listen.c */
CIP_INTERNAL cip_status cipi_bind_listen(int fd, const char *path, unsigned mode, int backlog,
                                         uint64_t *dev, uint64_t *ino, int *err);
CIP_INTERNAL int cipi_unlink_if_ours(const char *path, uint64_t dev, uint64_t ino);
/* Accept what is queued on the non-blocking `listener`, up to CIP_WIRE_ACCEPT_BATCH and cap,
 * into out (non-blocking, close-on-exec); how many.  Out of fds or memory (EMFILE, ENFILE,
 * ENOBUFS, ENOMEM): *backoff_until is set CIP_WIRE_ACCEPT_BACKOFF_MS ahead, for the
 * caller's poll to leave the listener alone (the connection stays queued).  The accept
 * threads' one accept step (acceptor.c, fdserver.c). */
CIP_INTERNAL int cipi_accept_batch(int listener, long long *backoff_until, int *out, int cap);
/* How long an accept thread's poll may sleep (ms; -1: no limit) at `now`: until the first
 * deadline (deadline_ns, -1: none) or the end of a back-off, whichever comes first. */
CIP_INTERNAL int cipi_accept_wait_ms(long long now, long long deadline_ns,
                                     long long backoff_until);
/* Whether `uid` is one of uids[0..n): the accept threads' one uid check. */
CIP_INTERNAL int cipi_uid_in(const uint32_t *uids, size_t n, uint32_t uid);
CIP_INTERNAL cip_status cipi_publisher_listen(const char *path, const uint32_t *uids, size_t nuids,
                                              uint32_t max_subscribers, int *fd, uint64_t *dev,
                                              uint64_t *ino, int *err);

/* pool.c */
CIP_INTERNAL cip_status cipi_attach_fds(const cip_descriptor *d, int *fds, size_t nfds, int device,
                                        cip_pool **out);

/* ledger.c */
CIP_INTERNAL cip_status cipi_ledger_init(struct cipi_ledger *l, uint32_t num_slots,
                                         uint64_t first_seq);
CIP_INTERNAL void cipi_ledger_free(struct cipi_ledger *l);
CIP_INTERNAL int cipi_ledger_received(const struct cipi_ledger *l, uint64_t seq);
CIP_INTERNAL cip_status cipi_ledger_receive(struct cipi_ledger *l, uint64_t seq, uint64_t slot);
CIP_INTERNAL int cipi_ledger_hold(struct cipi_ledger *l, uint64_t seq, uint32_t slot);
CIP_INTERNAL cip_status cipi_ledger_hold_again(struct cipi_ledger *l, uint64_t seq,
                                               uint64_t slot);
CIP_INTERNAL int cipi_ledger_holds(const struct cipi_ledger *l, uint64_t seq, uint64_t slot);
CIP_INTERNAL cip_status cipi_ledger_check_release(const struct cipi_ledger *l, uint64_t seq,
                                                  uint64_t slot);
CIP_INTERNAL void cipi_ledger_forget(struct cipi_ledger *l, uint32_t slot);
CIP_INTERNAL cip_status cipi_ledger_release_ahead(struct cipi_ledger *l, uint64_t seq,
                                                  uint64_t slot);

/* book.c */
CIP_INTERNAL int cipi_book_init(struct frame_book *b, uint32_t num_slots, size_t cap);
CIP_INTERNAL void cipi_book_free(struct frame_book *b);
CIP_INTERNAL void cipi_book_note(struct frame_book *b, uint32_t slot, uint32_t generation);
CIP_INTERNAL int cipi_book_received(struct frame_book *b, volatile uint32_t *flags, uint64_t seq,
                                    uint32_t slot, uint32_t generation);
CIP_INTERNAL void cipi_book_prune(struct frame_book *b, volatile uint32_t *flags);
CIP_INTERNAL int cipi_book_waits_on(const struct frame_book *b, volatile uint32_t *flags,
                                    uint32_t slot);
CIP_INTERNAL int cipi_book_pending(const struct frame_book *b, volatile uint32_t *flags);
CIP_INTERNAL int cipi_book_resolve_slot(struct frame_book *b, volatile uint32_t *flags,
                                        uint32_t slot);
CIP_INTERNAL uint32_t cipi_book_resolve(struct frame_book *b, volatile uint32_t *flags);
CIP_INTERNAL size_t cipi_book_answers(const struct frame_book *b, volatile uint32_t *flags,
                                      uint64_t *seqs, size_t cap, size_t *pending,
                                      uint64_t *pending_seqs, size_t pending_cap);

/* owed.c */
CIP_INTERNAL void cipi_owed_init(struct cipi_owed *o, uint32_t num_slots);
CIP_INTERNAL void cipi_owed_clear(struct cipi_owed *o);
CIP_INTERNAL void cipi_owed_free(struct cipi_owed *o);
CIP_INTERNAL int cipi_try_send_release(int sock, uint64_t seq, uint32_t slot);
CIP_INTERNAL cip_status cipi_owed_push(struct cipi_owed *o, uint64_t seq, uint32_t slot);
CIP_INTERNAL int cipi_owed_flush(struct cipi_owed *o, int sock);
CIP_INTERNAL cip_status cipi_owed_send(struct cipi_owed *o, int sock, uint64_t seq, uint32_t slot,
                                       int *sent);

/* hangup.c */
enum cipi_hangup { CIPI_HANGUP_DROP, CIPI_HANGUP_BYE, CIPI_HANGUP_EVICTED, CIPI_HANGUP_BAD_NOTICE };
CIP_INTERNAL enum cipi_hangup cipi_hangup_verdict(const struct msgbuf *ring, size_t head,
                                                  size_t len, size_t cap, size_t *at);
CIP_INTERNAL void cipi_hangup_drain(int sock, uint8_t *buf, size_t cap,
                                    int (*keep)(void *ctx, const uint8_t *p, size_t n), void *ctx);

/* session.c */
CIP_INTERNAL cip_status cipi_sub_end(cip_sub *sub, cip_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
CIP_INTERNAL void cipi_backlog_clear(cip_sub *sub);
CIP_INTERNAL void cipi_refuse_reason(const struct cipi_msg *m, char *out, size_t cap);
CIP_INTERNAL int cipi_producer_dead(cip_sub *sub);
CIP_INTERNAL void cipi_resolve_waits(cip_sub *sub);
CIP_INTERNAL void cipi_say_bye_and_close(cip_sub *sub);
CIP_INTERNAL cip_status cipi_protocol_error(cip_sub *sub);
CIP_INTERNAL cip_status cipi_judge_live(const uint8_t *p, size_t n, struct cipi_ledger *ledger,
                                        struct cipi_msg *m);
CIP_INTERNAL cip_status cipi_next_frame(cip_sub *sub, int timeout_ms, uint64_t *seq, uint32_t *slot,
                                        const uint8_t **payload, uint32_t *plen);
CIP_INTERNAL cip_status cipi_release_slot(cip_sub *sub, uint64_t seq, uint32_t slot, void *stream,
                                          int write);

/* handshake.c: the subscriber's half of the handshake (the C and the Python subscriber's) */
struct cipi_joined {
    int sock;                /* connected to the publisher (non-blocking, close-on-exec) */
    int32_t pid;             /* the publisher's, from SO_PEERCRED */
    uint32_t uid;
    int err;                 /* CIP_ERR_TRANSPORT: the errno */
    int foreign;             /* CIP_ERR_PROTOCOL: the peer answered in another protocol */
    uint8_t *buf;            /* the WELCOME datagram (the caller frees it) ... */
    size_t len;
    struct cipi_msg welcome; /* ... decoded (its payload points into buf) */
    int fds[CIP_WIRE_MAX_FDS];
    size_t nfds;             /* the WELCOME's fds (the caller owns them) */
};
CIP_INTERNAL cip_status cipi_handshake(const char *path, const uint8_t *hello, size_t hello_len,
                                       const uint32_t *allowed, size_t n_allowed, int timeout_ms,
                                       struct cipi_joined *out);

CIP_INTERNAL cip_status cipi_sub_open_raw(const char *path, const cip_sub_options *opts,
                                          cip_sub **out);

/* What the publisher side's modules share (leases.c .. acceptor.c) */
#include "cip_publisher.h"

#endif /* CIP_INTERNAL_H */
