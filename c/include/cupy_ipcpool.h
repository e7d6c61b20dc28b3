/*
 * cupy_ipcpool.h -- a C library for consumers of cupy_ipcpool pools and channels.
 *
 * A process written in C or C++ attaches a pool exported by cupy_ipcpool
 * (PoolDescriptor.to_bytes()) and turns ArrayHandle bytes into device pointers,
 * or subscribes to a cupy_ipcpool Publisher and receives its frames: device
 * pointers into the producer's slots, with no copy, ordered on the GPU by the
 * channel's sync page (the caller's stream waits on the frame flag; a release
 * writes the read flag on the caller's stream).
 *
 * Two layers:
 *
 *   - the protocol layer (no GPU): cip_sub_open_raw() speaks the channel's
 *     protocol to any publisher (handshake, uid check, WELCOME with fds,
 *     frames, releases, block and latest modes, eviction and publisher death
 *     as status codes) and hands the WELCOME's payload, its fds and each
 *     frame's payload to the caller as bytes;
 *   - the GPU layer: cip_sub_open() subscribes to a cupy_ipcpool Publisher,
 *     checks and parses its WELCOME, maps the pool and the sync page, and
 *     hands out frames as arrays (cip_frame).  cip_pool_attach() maps a pool
 *     from its descriptor bytes alone.
 *
 * Nothing of CUDA is needed to build it: the driver (libcuda.so.1) is loaded
 * at run time, on the first call that needs it.  Streams are passed as
 * `void *` (a CUstream or cudaStream_t); device pointers are uint64_t
 * (CUdeviceptr).  Every function returns a cip_status; on failure,
 * cip_last_error() says what happened in words (per thread), and a
 * subscription also keeps the reason it ended (cip_sub_error()).
 *
 * Threads: a cip_sub or cip_pool is used by one thread at a time (the caller
 * serialises); different handles may be used from different threads.
 *
 * C99; usable from C++ (extern "C").  See docs/c.md.
 */
#ifndef CUPY_IPCPOOL_H
#define CUPY_IPCPOOL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CIP_VERSION_MAJOR 0
#define CIP_VERSION_MINOR 1

/* Limits of the wire format (the library checks them against cupy_ipcpool_wire.h). */
#define CIP_MAX_NDIM 16     /* dimensions of one array */
#define CIP_MAX_ARRAYS 64   /* arrays in one frame */
#define CIP_MAX_METADATA 16384 /* metadata bytes in one frame */
#define CIP_SPEC_MAX_TYPESTR 16 /* a host array spec's NumPy typestr */
#define CIP_SPEC_MAX_NDIM 32    /* a host array spec's dimensions */

/* ---- status codes ---------------------------------------------------------- */

typedef enum cip_status {
    CIP_OK = 0,
    CIP_ERR_INVALID_ARGUMENT = 1, /* a NULL pointer, an out-of-range value, a closed handle */
    CIP_ERR_TIMEOUT = 2,          /* nothing arrived within the timeout; try again */
    CIP_ERR_END_OF_STREAM = 3,    /* the publisher closed cleanly (BYE): no more frames */
    CIP_ERR_PUBLISHER_GONE = 4,   /* the publisher died or vanished without BYE */
    CIP_ERR_EVICTED = 5,          /* the publisher dropped this subscriber (lease timeout,
                                     full socket): held frames may be overwritten */
    CIP_ERR_REFUSED = 6,          /* the publisher refused us, or runs as a uid not allowed */
    CIP_ERR_PROTOCOL = 7,         /* a malformed or out-of-protocol message: connection closed */
    CIP_ERR_TRANSPORT = 8,        /* a socket or fd operation failed (errno in the message) */
    CIP_ERR_DESCRIPTOR = 9,       /* malformed descriptor or array handle bytes */
    CIP_ERR_STALE = 10,           /* an array handle of a generation older than one seen */
    CIP_ERR_NOT_HELD = 11,        /* release of a frame this subscriber does not hold */
    CIP_ERR_NO_DRIVER = 12,       /* libcuda.so.1 cannot be loaded, or no device */
    CIP_ERR_CUDA = 13,            /* a driver call failed (its name and error in the message) */
    CIP_ERR_DEVICE = 14,          /* the pool's GPU is not visible, or no peer access */
    CIP_ERR_NO_MEMORY = 15,
    CIP_ERR_RAW_SESSION = 16      /* a GPU call on a subscription opened with cip_sub_open_raw */
} cip_status;

/* The status code's name ("CIP_ERR_EVICTED"); never NULL. */
const char *cip_status_name(cip_status status);
/* A one-line description of the status code; never NULL. */
const char *cip_strerror(cip_status status);
/* What the last failing call of this thread said, with details; "" if none. */
const char *cip_last_error(void);

/* ---- dtypes (codes are part of the wire format) ----------------------------- */

typedef enum cip_dtype {
    CIP_BOOL = 0,
    CIP_INT8 = 1,
    CIP_INT16 = 2,
    CIP_INT32 = 3,
    CIP_INT64 = 4,
    CIP_UINT8 = 5,
    CIP_UINT16 = 6,
    CIP_UINT32 = 7,
    CIP_UINT64 = 8,
    CIP_FLOAT16 = 9,
    CIP_FLOAT32 = 10,
    CIP_FLOAT64 = 11,
    CIP_COMPLEX64 = 12,
    CIP_COMPLEX128 = 13
} cip_dtype;

/* "float32" etc., or NULL for an unknown code. */
const char *cip_dtype_name(int dtype);
/* Bytes per element, or 0 for an unknown code. */
size_t cip_dtype_itemsize(int dtype);

/* ---- arrays ------------------------------------------------------------------ */

/* One array inside one slot: what an ArrayHandle describes, checked against the slot. */
typedef struct cip_array {
    uint64_t data;        /* device address of element [0, ..., 0] in this process
                             (slot base + offset); with cip_parse_frame_payload:
                             slot_base + offset */
    uint64_t offset;      /* byte offset of element [0, ..., 0] from the slot's start */
    uint64_t generation;  /* the slot's generation when the array was published */
    uint64_t nbytes;      /* number of elements times itemsize */
    uint32_t slot;
    int32_t dtype;        /* a cip_dtype */
    uint32_t itemsize;
    uint32_t ndim;
    uint64_t shape[CIP_MAX_NDIM];
    int64_t strides[CIP_MAX_NDIM]; /* in bytes; may be zero or negative */
} cip_array;

/* ---- pool descriptors (no GPU) ------------------------------------------------- */

/* The fields of PoolDescriptor.to_bytes(), validated. */
typedef struct cip_descriptor {
    uint8_t pool_id[16];
    uint8_t device_uuid[16];
    uint32_t exporter_pid;
    uint32_t exporter_uid;
    uint64_t exporter_start_time;
    uint64_t exporter_pid_namespace; /* 0: unknown */
    uint32_t device_ordinal;         /* the exporter's ordinal: a hint only */
    uint32_t num_slots;
    uint64_t slot_nbytes;
    uint64_t alloc_nbytes;
    char socket_path[108];           /* the exporter's fd server, "" if none */
    const uint8_t *fds_le;           /* num_slots little-endian u32 fd numbers in the
                                        exporter, pointing into the parsed bytes */
} cip_descriptor;

/* Parse and validate descriptor bytes (every field, no trailing bytes).
 * `out->fds_le` points into `bytes`, which must outlive its use. */
cip_status cip_parse_descriptor(const void *bytes, size_t len, cip_descriptor *out);

/* How the slot fds of a pool are fetched from the exporter. */
typedef enum cip_transport {
    CIP_TRANSPORT_AUTO = 0,   /* pidfd_getfd; the fd server where the kernel refuses it
                                 (EPERM, ENOSYS) or the exporter's pid is not visible */
    CIP_TRANSPORT_PIDFD = 1,  /* pidfd_open + pidfd_getfd only */
    CIP_TRANSPORT_SOCKET = 2  /* the exporter's fd server (SCM_RIGHTS) only */
} cip_transport;

/* Fetch the slot fds the descriptor names into this process (close-on-exec,
 * owned by the caller), in slot order.  `cap` must be at least num_slots.  On
 * failure nothing is left open; the message says why and what to do:
 * CIP_ERR_REFUSED (the fd server refused, or is not the exporter's: nothing was
 * sent to it), CIP_ERR_TIMEOUT (the fd server did not answer within timeout_ms,
 * which bounds its exchange), CIP_ERR_TRANSPORT (the rest).  Python's fetch runs
 * the same code. */
cip_status cip_fetch_fds(const void *desc_bytes, size_t len, int transport, int timeout_ms,
                         int *fds, size_t cap, size_t *count);

/* ---- frame payloads (no GPU) ---------------------------------------------------- */

typedef struct cip_frame cip_frame;

/* Parse the payload of a FRAME sent by a cupy_ipcpool Publisher (flag index,
 * generation, packed array handles, metadata), for frame `seq` in `slot`,
 * against a slot of `slot_nbytes` bytes starting at `slot_base` (a device
 * address, a host mapping, or 0 for plain offsets).  Every handle must lie in
 * the frame's slot, inside it and aligned to its item size.  `arrays` receives
 * up to `cap` arrays (CIP_MAX_ARRAYS always suffice); `out->arrays` points
 * there and `out->metadata` into `payload`.  A void frame (its flag index is
 * slot | CIP_WIRE_FRAME_VOID: a Publisher(ahead=True) took the slot and did not
 * publish it) parses with no arrays; one that declares arrays is refused.  For raw
 * sessions whose slots are mapped by the caller; cip_sub_recv does this itself. */
cip_status cip_parse_frame_payload(const void *payload, size_t len, uint64_t seq, uint32_t slot,
                                   uint64_t slot_nbytes, uint64_t slot_base, cip_array *arrays,
                                   size_t cap, cip_frame *out);

/* ---- pools (GPU) ------------------------------------------------------------------ */

typedef struct cip_pool cip_pool;

/* Map a pool exported by another process: fetch its fds (as cip_fetch_fds),
 * import each slot (cuMemImportFromShareableHandle), reserve, map and grant
 * read-write access on `device` (-1: the exporter's GPU, found by UUID), close
 * the fds.  Nothing is left behind on failure.  Each call maps the slots anew. */
cip_status cip_pool_attach(const void *desc_bytes, size_t len, int device, int transport,
                           cip_pool **out);
/* cip_pool_attach with the slot fds in hand; the fds are taken (closed) in every case. */
cip_status cip_pool_attach_fds(const void *desc_bytes, size_t len, int *fds, size_t nfds,
                               int device, cip_pool **out);
/* Number of slots, usable bytes per slot, the local device. */
uint32_t cip_pool_num_slots(const cip_pool *pool);
uint64_t cip_pool_slot_nbytes(const cip_pool *pool);
int cip_pool_device(const cip_pool *pool);
/* Device address of a slot in this process. */
cip_status cip_pool_slot_ptr(const cip_pool *pool, uint32_t slot, uint64_t *ptr);
/* Decode exactly one packed ArrayHandle, check it fits its slot (bounds,
 * alignment) and is not older than a generation already seen for that slot. */
cip_status cip_array_from_handle(cip_pool *pool, const void *bytes, size_t len, cip_array *out);
/* Unmap and release everything, once no GPU work queued in this process can still
 * touch the slots: first cuCtxSynchronize on the pool's device (its primary
 * context, pushed and popped: the caller's current context is unchanged), because
 * cuMemUnmap does not wait for kernels as cudaFree does.  If that work has not
 * finished within CIP_WIRE_UNMAP_WAIT_MS (10 s, cupy_ipcpool_wire.h), a
 * background thread unmaps once it has, and CIP_ERR_TIMEOUT says so; if the
 * synchronisation fails (a context already broken by an earlier error), the slots
 * are unmapped anyway and CIP_ERR_CUDA names the error.  The handle is freed in every case; NULL is ignored (CIP_OK). */
cip_status cip_pool_close(cip_pool *pool);

/* ---- subscriptions ----------------------------------------------------------------- */

typedef enum cip_mode {
    CIP_MODE_BLOCK = 0,  /* every frame; the producer waits for this subscriber */
    CIP_MODE_LATEST = 1  /* the producer never waits; frames are skipped while credit are held */
} cip_mode;

typedef struct cip_sub_options {
    int mode;                       /* cip_mode; default CIP_MODE_BLOCK */
    uint32_t credit;                /* frames held at once; 0: 1 for latest, 64 for block */
    int timeout_ms;                 /* connect + handshake; default 10000 */
    int device;                     /* GPU layer: the local device, -1 (default): the
                                       producer's GPU, by UUID */
    const uint32_t *allowed_uids;   /* uids the publisher may run as; NULL: own euid */
    size_t n_allowed_uids;
} cip_sub_options;

/* Fill `opts` with the defaults. */
void cip_sub_options_init(cip_sub_options *opts);

typedef struct cip_sub cip_sub;

/* What the WELCOME said. */
typedef struct cip_sub_info {
    uint32_t sub_id;
    uint32_t num_slots;
    uint64_t next_seq;        /* no frame older than this is received */
    uint32_t credit;          /* the credit granted */
    uint32_t lease_timeout_ms;/* 0: none */
    int32_t producer_pid;     /* SO_PEERCRED; 0 where not visible (another pid namespace) */
    uint32_t producer_uid;
    int mode;
} cip_sub_info;

/* Protocol layer: connect, check the publisher's uid (SO_PEERCRED), send HELLO,
 * receive WELCOME and its fds.  `opts` may be NULL (defaults).  A `path` that is
 * empty or longer than CIP_WIRE_MAX_SOCKET_PATH (107) bytes is
 * CIP_ERR_INVALID_ARGUMENT, before any socket is made. */
cip_status cip_sub_open_raw(const char *path, const cip_sub_options *opts, cip_sub **out);

/* GPU layer: cip_sub_open_raw to a cupy_ipcpool Publisher, then check the
 * WELCOME payload (descriptor, row, sync page: a memfd sealed against
 * shrinking and growing, of exactly the layout's size) before anything is
 * mapped, map the pool and register the sync page for the device. */
cip_status cip_sub_open(const char *path, const cip_sub_options *opts, cip_sub **out);

cip_status cip_sub_get_info(const cip_sub *sub, cip_sub_info *info);

/* Raw sessions: the WELCOME payload (valid until cip_sub_close). */
cip_status cip_sub_welcome_payload(const cip_sub *sub, const uint8_t **payload, size_t *len);
/* Raw sessions: take the fds of the WELCOME (the caller owns and closes them).
 * Up to `cap` are stored; `*count` says how many there were; taken once. */
cip_status cip_sub_take_fds(cip_sub *sub, int *fds, size_t cap, size_t *count);

/* One frame as the protocol layer sees it.  `payload` is valid until the next
 * receive call on this subscription. */
typedef struct cip_raw_frame {
    uint64_t seq;
    uint32_t slot;
    uint32_t payload_len;
    const uint8_t *payload;
} cip_raw_frame;

/* Wait up to timeout_ms (-1: forever, 0: do not wait) for the next frame.
 * Returns CIP_OK with a frame the caller now holds a lease on, or
 * CIP_ERR_TIMEOUT, or how the stream ended: CIP_ERR_END_OF_STREAM (BYE;
 * frames queued before it were handed out first), CIP_ERR_PUBLISHER_GONE,
 * CIP_ERR_EVICTED (no frame queued behind an eviction notice is ever handed
 * out), CIP_ERR_PROTOCOL -- and the same on every later call. */
cip_status cip_sub_recv_raw(cip_sub *sub, int timeout_ms, cip_raw_frame *frame);
/* Return the lease on a frame: the frame is forgotten and RELEASE sent.  The call
 * never blocks: while the socket is full (a publisher that is not reading), the
 * RELEASE is kept and sent, in order, before any later one, by the next call that
 * talks to the publisher (receive, release, close); a publisher that lets more
 * than CIP_WIRE_MAX_CREDIT + num_slots of them pile up ends the subscription
 * (CIP_ERR_TRANSPORT).  After a clean end or the publisher's death this only
 * forgets the frame; after an eviction it forgets it and returns
 * CIP_ERR_EVICTED.  CIP_ERR_NOT_HELD if the frame is not held. */
cip_status cip_sub_release_raw(cip_sub *sub, uint64_t seq, uint32_t slot);

/* A received frame of a cupy_ipcpool Publisher.  `arrays` and `metadata` are
 * owned by the subscription and stay valid until the frame is released (or
 * the subscription closed). */
struct cip_frame {
    uint64_t seq;
    uint32_t slot;
    uint32_t generation;    /* the frame flag's value (low 32 bits of the slot's generation) */
    uint32_t num_arrays;
    uint32_t metadata_len;
    const cip_array *arrays;
    const uint8_t *metadata;
};

/* GPU layer: receive the next frame, as cip_sub_recv_raw, and check every
 * array handle against the slot.  The data may not be written yet: call
 * cip_frame_wait on the stream that reads it first. */
cip_status cip_sub_recv(cip_sub *sub, int timeout_ms, cip_frame *frame);
/* Make `stream` wait, on the GPU, until the producer's work that wrote the
 * frame is done (cuStreamWaitValue32 on the frame flag; nothing is enqueued
 * when the host already sees the flag set).  The host does not block. */
cip_status cip_frame_wait(cip_sub *sub, const cip_frame *frame, void *stream);
/* Return the lease: `stream` writes the frame's generation into this
 * subscriber's read flag after the work already queued on it
 * (cuStreamWriteValue32), then RELEASE is sent.  Enqueue the work that reads
 * the frame on `stream` (or order it before) first.  If the publisher has hung
 * up, nothing is written (after an eviction the row may be another
 * subscriber's): as cip_sub_release_raw, except that a hang-up seen here while
 * a stream of ours waits on an unset frame flag waits (at most
 * CIP_WIRE_DEATH_WAIT_MS, 5 s) for the producer's pidfd, as cip_sub_recv does, so
 * that the flags are forced first.
 * On CIP_ERR_CUDA the frame is still held. */
cip_status cip_sub_release(cip_sub *sub, const cip_frame *frame, void *stream);

/* Whether the producer finished writing a frame this subscription received, held or
 * already released (`frame` as cip_sub_recv filled it: its slot and generation
 * are what count): 1 (its stream set the frame flag for this frame or a later
 * one: the arrays held what it wrote before publishing), 0 (it died before its
 * stream got there, and this library, or another survivor, set the flag itself
 * so that no stream waits forever: the arrays held whatever its kernels had
 * written, and work queued on them ran on that), -1 (not known yet: the producer
 * is alive, or not seen dead, and has not set the flag; work ordered after
 * cip_frame_wait waits for it on the GPU).  -1 also for a frame never received.
 * Exact for every frame, by cip_flag_state on the slot's frame flag; 0 also for a
 * void frame (taken and not published by a Publisher(ahead=True): never written),
 * the last one received in its slot (an earlier void frame of the same slot
 * answers by its flag).  A void frame is not in cip_sub_incomplete_frames: the
 * producer's stream set its flag. */
int cip_frame_complete(cip_sub *sub, const cip_frame *frame);
/* How many frame flags this subscription set itself because the producer died. */
uint64_t cip_sub_forced_flags(const cip_sub *sub);
/* The end-of-stream report: the seqs, in the order received, of the frames this
 * subscription received (held or released) that the producer never finished
 * writing (cip_frame_complete 0).  Empty while the producer lives; complete once
 * it died and its unset flags were forced (by the time a receive reports
 * CIP_ERR_PUBLISHER_GONE; this call forces them too if the producer is seen
 * dead).  Up to `cap` seqs are stored; `*count` says how many there are.  The
 * library keeps a record of the received frames whose flag the host has not seen
 * set by the producer, pruned on every receive and bounded by
 * CIP_WIRE_SYNC_RECORD_CAP; frames dropped from a full record are not listed
 * (cip_sub_untracked_frames counts them).  CIP_ERR_RAW_SESSION on raw sessions. */
cip_status cip_sub_incomplete_frames(cip_sub *sub, uint64_t *seqs, size_t cap, size_t *count);
/* Frames received but left out of cip_sub_incomplete_frames (the record was full). */
uint64_t cip_sub_untracked_frames(const cip_sub *sub);

/* GPU sessions: the local device the pool is mapped on (-1 for raw sessions). */
int cip_sub_device(const cip_sub *sub);

/* The socket's fd: readable when a frame or the end is waiting (for an event loop). */
int cip_sub_fileno(const cip_sub *sub);
/* Why the subscription ended (or the last error on it); "" while it runs. */
const char *cip_sub_error(const cip_sub *sub);

/* Send the RELEASEs still owed (if the socket takes them), say BYE and close the
 * socket; wait (up to CIP_WIRE_CLOSE_WAIT_MS, 5 s) for the flag operations this
 * subscription enqueued to finish -- after the producer's death, first writing from the host every frame
 * flag a stream of ours still waits on, which the producer will never write --
 * then unregister and unmap the sync page, close the pool (as cip_pool_close: it
 * waits for this process's queued GPU work on the device first) and close every
 * fd.  If the operations do not finish, the page and the pool are left mapped
 * (leaked) rather than unmapped under the GPU, and CIP_ERR_TIMEOUT says so; a
 * failure of cip_pool_close is returned as it reported it.  Every resource is
 * given back in every case, but the handle stays: cip_frame_complete,
 * cip_sub_incomplete_frames, cip_sub_forced_flags, cip_sub_untracked_frames,
 * cip_sub_get_info and cip_sub_error answer as at the close (the frame flags are
 * kept, forced first if the producer is dead); other calls return
 * CIP_ERR_INVALID_ARGUMENT; a second close returns CIP_OK.  The device pointers of
 * held frames are invalid afterwards.  NULL is ignored (CIP_OK).  In a child forked from
 * the process that opened it (which may not use it otherwise: CIP_ERR_INVALID_ARGUMENT)
 * only the child's copies of its fds and mappings go: no BYE, nothing read, no driver
 * call, the parent's subscription left as it is.  (The child's copy of the socket is closed
 * at the fork already, so that it never hides the parent's death from the publisher.) */
cip_status cip_sub_close(cip_sub *sub);
/* Close (as cip_sub_close, whose status it returns, if not closed yet) and free the
 * handle.  NULL is ignored (CIP_OK). */
cip_status cip_sub_free(cip_sub *sub);

/* ---- publishers (raw: the caller's slots) ------------------------------------------ */

typedef struct cip_pub cip_pub;

/* A subscriber, as the publisher knows it (its HELLO's claims and SO_PEERCRED's). */
typedef struct cip_pub_subscriber {
    uint32_t sub_id;
    int32_t pid;     /* the kernel's, else its claim */
    uint32_t uid;
    int mode;        /* cip_mode */
    uint32_t credit; /* granted */
} cip_pub_subscriber;

typedef struct cip_pub_options {
    uint32_t num_slots;            /* the ring: 1..CIP_WIRE_MAX_SLOTS; no default */
    uint32_t max_subscribers;      /* further ones are refused; default 64 */
    uint32_t max_credit;           /* cap on a subscriber's credit, at most
                                      CIP_WIRE_MAX_CREDIT; 0 (default): num_slots - 2, at
                                      least 1 */
    double lease_timeout_s;        /* a subscriber holding a frame longer is evicted; below
                                      4294967; 0 (default): no limit */
    double send_timeout_s;         /* a full "block" socket may stall a publish (0..1e9; 0:
                                      dropped at once); default 5 */
    double handshake_timeout_s;    /* from accept to HELLO (above 0, up to 1e9); default 5 */
    uint32_t max_pending_per_uid;  /* handshakes of one uid at once; default 8 */
    const uint32_t *allowed_uids;  /* uids that may subscribe; NULL (default): own euid only,
                                      the socket file 0600 (else 0666: the uid check decides) */
    size_t n_allowed_uids;
    /* Called in the caller's thread, within cip_pub_acquire / _publish_raw / _poll /
     * _close, when a subscriber is adopted and when one leaves (why: BYE, hang-up,
     * eviction...; joined 0: it went before it was adopted).  The publisher's close is
     * not a subscriber's leaving.  NULL: not told. */
    void (*on_join)(void *ctx, const cip_pub_subscriber *sub);
    void (*on_leave)(void *ctx, const cip_pub_subscriber *sub, int joined, const char *why);
    void *ctx;
} cip_pub_options;

/* Fill `opts` with the defaults (num_slots 0: the caller sets it). */
void cip_pub_options_init(cip_pub_options *opts);

/* Protocol layer: listen at `path` (a stale socket file there is replaced, a live one is
 * CIP_ERR_TRANSPORT) and welcome subscribers on the library's accept thread with
 * `payload` (len bytes, at most CIP_WIRE_MAX_WELCOME_PAYLOAD) and a copy of each of
 * `fds` (nfds, at most 253): what a raw subscriber (cip_sub_open_raw, a Python
 * SubscriberCore) maps the slots from.  Subscribers in mode "block" and "latest" are
 * served; "ahead" is refused (it needs read flags).  The caller keeps its fds. */
cip_status cip_pub_open_raw(const char *path, const cip_pub_options *opts, const void *payload,
                            size_t len, const int *fds, size_t nfds, cip_pub **out);

/* The next slot to write: the first with no lease, round-robin after the one last
 * published, waiting up to timeout_ms (-1: without limit) for a subscriber to release
 * one; CIP_ERR_TIMEOUT when none came. */
cip_status cip_pub_acquire(cip_pub *pub, int timeout_ms, uint32_t *slot);

/* Publish the frame written in `slot` with `payload` (len bytes, at most
 * CIP_WIRE_MAX_FRAME_PAYLOAD): every "block" subscriber receives it (a full socket
 * stalls up to send_timeout_s, then that subscriber is evicted), a "latest" one while
 * it holds less than its credit.  *seq: its sequence number (NULL: not wanted). */
cip_status cip_pub_publish_raw(cip_pub *pub, uint32_t slot, const void *payload, size_t len,
                               uint64_t *seq);

/* Read the subscribers' messages, waiting up to timeout_ms (-1: without limit) for a
 * lease to end; *returned (NULL: not wanted): leases ended since the last poll. */
cip_status cip_pub_poll(cip_pub *pub, int timeout_ms, uint64_t *returned);

/* Subscribers adopted and not gone. */
uint32_t cip_pub_subscribers(const cip_pub *pub);

/* Stop accepting (the socket file removed while it is still ours), say BYE to every
 * subscriber, wait up to linger_ms for them to hang up, close everything and free the
 * handle.  CIP_ERR_TIMEOUT: some were still connected.  NULL is ignored (CIP_OK).  In a
 * child forked from the process that opened it (where the other cip_pub_* calls return
 * CIP_ERR_INVALID_ARGUMENT) only the child's copies close: no BYE, no unlink, no callback,
 * CIP_ERR_TIMEOUT (the subscribers are the parent's, still connected).  The child's copy of
 * the listening socket is closed at the fork already (it would keep the path live). */
cip_status cip_pub_close(cip_pub *pub, int linger_ms);

/* ---- frames in host memory (no GPU) ---------------------------------------------- */

/* One array of a frame in host memory: a NumPy typestr (byte order "<", ">" or "|", kind
 * one of "biufc", item size 1..64: "<f4", "|u1") and a
 * shape (C order, dense). */
typedef struct cip_array_spec {
    char typestr[CIP_SPEC_MAX_TYPESTR + 1];
    uint32_t ndim; /* at most CIP_SPEC_MAX_NDIM */
    uint64_t shape[CIP_SPEC_MAX_NDIM];
} cip_array_spec;

/* CIP_OK, or CIP_ERR_PROTOCOL saying what is wrong with `spec`. */
cip_status cip_array_spec_check(const cip_array_spec *spec);
/* The array's bytes (item size times the shape's product; UINT64_MAX if that overflows),
 * for a spec cip_array_spec_check accepts. */
uint64_t cip_array_spec_nbytes(const cip_array_spec *spec);
/* Where each of n arrays sits in a slot of slot_nbytes bytes: one after the other, each at
 * a multiple of 256 bytes (CIP_WIRE_SPEC_ALIGN).  CIP_ERR_PROTOCOL when they do not fit (or a
 * spec is bad). */
cip_status cip_array_layout(const cip_array_spec *specs, size_t n, uint64_t slot_nbytes,
                            uint64_t *offsets);
/* The specs' wire form (per array: u8 typestr length, the typestr, u8 ndim, ndim u64
 * dimensions), into out[0..cap), its length in *len: what the remote tier's FRAME and a host
 * frame's payload carry.  CIP_ERR_PROTOCOL for a bad spec, CIP_ERR_INVALID_ARGUMENT when
 * they do not fit in cap. */
cip_status cip_array_specs_encode(const cip_array_spec *specs, size_t n, void *out, size_t cap,
                                  size_t *len);
/* `count` specs from data[0..len), checked, into specs[0..count); *used: the bytes read. */
cip_status cip_array_specs_decode(const void *data, size_t len, size_t count,
                                  cip_array_spec *specs, size_t *used);
/* The FRAME payload of a host-memory channel (what cupy_ipcpool.remote.HostChannelSubscriber
 * reads, whose slots are memfds sent with the WELCOME, its payload their size as a u64):
 * u16 count, u32 metadata length, the specs' wire form, the metadata.  At most
 * 64 arrays and 16384 bytes of metadata
 * (CIP_ERR_INVALID_ARGUMENT: CIP_MAX_ARRAYS, CIP_MAX_METADATA); the arrays sit in the slot as cip_array_layout says. */
cip_status cip_host_frame_encode(const cip_array_spec *specs, size_t n, const void *metadata,
                                 size_t meta_len, void *out, size_t cap, size_t *len);
/* Read and check a host frame's payload against a slot of slot_nbytes bytes: up to cap
 * specs and their offsets in the slot (CIP_MAX_ARRAYS always suffice), their
 * count in *n, the metadata (pointing into payload).  CIP_ERR_PROTOCOL says what is wrong. */
cip_status cip_host_frame_decode(const void *payload, size_t len, uint64_t slot_nbytes,
                                 cip_array_spec *specs, uint64_t *offsets, size_t cap,
                                 size_t *n, const void **metadata, size_t *meta_len);

/* ---- the sync page (no GPU) ------------------------------------------------------ */

/* For raw sessions that map the sync page themselves (docs/c.md, "The sync page"):
 * the byte offset of the first read-flag row and the page's size for `num_slots`
 * slots and `max_subscribers` rows (the WELCOME payload's values): frame flag s at
 * 4 * s, subscriber row r's read flag for slot s at reads_offset + 4 * (r *
 * num_slots + s), the size rounded up to whole host pages. */
cip_status cip_sync_layout(uint32_t num_slots, uint32_t max_subscribers, size_t *reads_offset,
                           size_t *nbytes);
/* A publisher's sync page: a zeroed memfd of `nbytes` (cip_sync_layout's), sealed against
 * shrinking, growing and further seals, as subscribers require before they map it
 * (close-on-exec, the caller's: send it last among the WELCOME's fds). */
cip_status cip_sync_create(size_t nbytes, int *fd);
/* What frame flag value `word` says about the frame of `generation` (low 32 bits):
 * with d = word - generation (mod 2**32): -1 for d >= 2**31 (not set yet), 1 for
 * d < CIP_WIRE_SYNC_SET_WINDOW (the producer's stream set it), 0 for d below
 * CIP_WIRE_SYNC_FORCED (forced after the producer's death, this frame never
 * written), 1 above (forced, but this frame was written before the death). */
int cip_flag_state(uint32_t word, uint32_t generation);
/* Force, after the producer's death (its pidfd readable), the frame flag at `flag`
 * (in a shared mapping of the sync page) that a stream may wait on for `awaited`:
 * unless the flag has reached `awaited` (cyclic: (int32_t)(flag - awaited) >= 0),
 * its current value w -- the last generation the producer really wrote there --
 * becomes w + CIP_WIRE_SYNC_FORCED, atomically.  That satisfies every wait queued
 * on the flag and keeps cip_flag_state exact for every frame of the slot; a flag
 * another survivor forced already has reached `awaited` and is left alone.
 * Returns 1 if it stored, 0 if not, -1 for a NULL flag. */
int cip_flag_force(uint32_t *flag, uint32_t awaited);

/* ---- the driver ----------------------------------------------------------------- */

/* Make `device`'s primary context -- the one the CUDA runtime uses -- current on the
 * calling thread (what cudaSetDevice does), for callers of the driver API. */
cip_status cip_use_device(int device);

/* A CUDA driver entry point by name ("cuMemcpyDtoH"), resolved with
 * cuGetProcAddress for the CUDA 12 API (or the driver's, if older); NULL if the
 * driver or the symbol is missing.  For consumers that build without the toolkit. */
void *cip_cuda_symbol(const char *name);

#ifdef __cplusplus
}
#endif

#endif /* CUPY_IPCPOOL_H */
