/* gpu_sub.c -- the GPU subscription: setup, receive, waits, answers, releases
 * (cip_internal.h says what the modules share). */
#include "cip_internal.h"

/* ---- the GPU subscription ------------------------------------------------------------ */

/* The frame flags the answers read: the page, or after cip_sub_close its last words. */
static volatile uint32_t *
answer_flags(const cip_sub *sub)
{
    return sub->page != NULL ? sub->page : sub->final_flags;
}

static int
flag_reached(const cip_sub *sub, uint32_t slot, uint32_t value)
{
    return (int32_t)(flag_load(sub->page, slot) - value) >= 0;
}

/* Check the WELCOME payload and the sync page's fd (no GPU involved), then map and
 * register the page and attach the pool. */
static cip_status
gpu_setup(cip_sub *sub, int device)
{
    uint32_t n = sub->info.num_slots;
    struct cipi_welcome w;
    if (cipi_check_welcome(sub->welcome, sub->welcome_len, n, sub->nfds, &w) != CIP_OK)
        return cipi_protocol_error(sub);
    int page_fd = sub->fds[n];
    if (cipi_check_sync_fd(page_fd, w.sync_nbytes) != CIP_OK)
        return cipi_protocol_error(sub);
    size_t nbytes = w.sync_nbytes, reads = w.reads_offset;
    uint64_t row = w.row, max_subs = w.max_subscribers;
    cip_descriptor d = w.desc;
    /* everything checked: now the GPU */
    cip_status status = cipi_driver();
    if (status != CIP_OK)
        return status;
    void *m = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, page_fd, 0);
    if (m == MAP_FAILED)
        return cipi_fail(CIP_ERR_TRANSPORT, "mapping the sync page failed: %s", strerror(errno));
    close(page_fd);
    sub->fds[n] = -1;
    sub->page = (volatile uint32_t *)m;
    sub->page_nbytes = nbytes;
    sub->reads_offset = reads;
    sub->row = (uint32_t)row;
    sub->max_subs = (uint32_t)max_subs;
    sub->ev_wait = (CUevent *)calloc(n, sizeof(CUevent));
    sub->ev_write = (CUevent *)calloc(n, sizeof(CUevent));
    sub->wait_recorded = (uint8_t *)calloc(n, 1);
    sub->write_recorded = (uint8_t *)calloc(n, 1);
    if (!sub->ev_wait || !sub->ev_write || !sub->wait_recorded || !sub->write_recorded ||
        cipi_book_init(&sub->book, n, CIP_WIRE_SYNC_RECORD_CAP) != 0)
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
    status = cipi_attach_fds(&d, sub->fds, n, device, &sub->pool); /* closes the slot fds */
    sub->nfds = 0;
    if (status != CIP_OK)
        return status;
    if ((status = cipi_ctx_push(sub->pool->device)) != CIP_OK)
        return status;
    CUresult rc = cipi_drv.MemHostRegister(m, nbytes,
                                      CIP_CU_MEMHOSTREGISTER_PORTABLE | CIP_CU_MEMHOSTREGISTER_DEVICEMAP);
    if (rc != CIP_CUDA_SUCCESS) {
        status = cipi_cuda_fail("cuMemHostRegister", rc);
    } else {
        sub->registered = 1;
        rc = cipi_drv.MemHostGetDevicePointer(&sub->page_dev, m, 0);
        if (rc != CIP_CUDA_SUCCESS)
            status = cipi_cuda_fail("cuMemHostGetDevicePointer", rc);
    }
    for (uint32_t i = 0; i < n && status == CIP_OK; i++) {
        rc = cipi_drv.EventCreate(&sub->ev_wait[i], CIP_CU_EVENT_DISABLE_TIMING);
        if (rc == CIP_CUDA_SUCCESS)
            rc = cipi_drv.EventCreate(&sub->ev_write[i], CIP_CU_EVENT_DISABLE_TIMING);
        if (rc != CIP_CUDA_SUCCESS)
            status = cipi_cuda_fail("cuEventCreate", rc);
    }
    cipi_ctx_pop();
    return status;
}

cip_status
cip_sub_open(const char *path, const cip_sub_options *opts, cip_sub **out)
{
    cip_sub *sub = NULL;
    cip_status st = cipi_sub_open_raw(path, opts, &sub);
    if (st != CIP_OK)
        return st;
    sub->gpu = 1;
    st = gpu_setup(sub, opts ? opts->device : -1);
    if (st != CIP_OK) {
        char why[sizeof cipi_tls_error];
        memcpy(why, cipi_tls_error, sizeof why);
        cip_sub_free(sub);
        return cipi_fail(st, "%s", why);
    }
    *out = sub;
    return CIP_OK;
}

cip_status
cip_sub_recv(cip_sub *sub, int timeout_ms, cip_frame *frame)
{
    if (sub == NULL || frame == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_recv: NULL argument");
    if (!sub->gpu)
        return cipi_fail(CIP_ERR_RAW_SESSION, "cip_sub_recv needs cip_sub_open; use cip_sub_recv_raw");
    uint64_t seq;
    uint32_t slot, len;
    const uint8_t *payload;
    cip_status st = cipi_next_frame(sub, timeout_ms, &seq, &slot, &payload, &len);
    if (st != CIP_OK)
        return st;
    struct held *h = &sub->held[slot];
    if (h->arrays == NULL)
        h->arrays = (cip_array *)malloc(CIP_MAX_ARRAYS * sizeof(cip_array));
    if (h->meta == NULL)
        h->meta = (uint8_t *)malloc(CIP_MAX_METADATA);
    if (h->arrays == NULL || h->meta == NULL)
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
    cip_pool *pool = sub->pool;
    cip_frame f;
    int void_frame = 0;
    st = cipi_parse_frame_payload(payload, len, seq, slot, pool->desc.slot_nbytes, pool->ptrs[slot],
                             h->arrays, CIP_MAX_ARRAYS, &f, &void_frame);
    if (st != CIP_OK)
        return cipi_protocol_error(sub);
    for (uint32_t i = 0; i < f.num_arrays; i++) {
        if (h->arrays[i].generation < pool->seen[slot]) {
            cipi_fail(CIP_ERR_PROTOCOL,
                 "frame %llu: handle for slot %u is of generation %llu; generation %llu has been "
                 "received since, so its memory was reused",
                 (unsigned long long)seq, slot, (unsigned long long)h->arrays[i].generation,
                 (unsigned long long)pool->seen[slot]);
            return cipi_protocol_error(sub);
        }
        pool->seen[slot] = h->arrays[i].generation;
    }
    if (cip_flag_state(flag_load(sub->page, slot), f.generation) != 1 && cipi_producer_dead(sub)) {
        cipi_backlog_clear(sub);
        cipi_resolve_waits(sub);
        return cipi_sub_end(sub, CIP_ERR_PUBLISHER_GONE,
                       "the publisher (pid %d) exited before frame %llu was complete; frames "
                       "still queued are dropped",
                       (int)sub->info.producer_pid, (unsigned long long)seq);
    }
    /* received: recorded unless the host sees it written already */
    cipi_book_received(&sub->book, sub->page, seq, slot, f.generation);
    memcpy(h->meta, f.metadata, f.metadata_len);
    f.metadata = h->meta;
    cipi_ledger_hold(&sub->ledger, seq, slot);
    h->generation = f.generation;
    if (void_frame) {
        h->void_seen = 1;
        h->void_generation = f.generation;
    }
    *frame = f;
    return CIP_OK;
}

static cip_status
check_held(cip_sub *sub, const cip_frame *frame)
{
    if (sub == NULL || frame == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "NULL argument");
    if (!sub->gpu)
        return cipi_fail(CIP_ERR_RAW_SESSION, "a raw session has no sync page");
    cip_status usable = cipi_sub_usable(sub);
    if (usable != CIP_OK)
        return usable;
    if (!cipi_ledger_holds(&sub->ledger, frame->seq, frame->slot))
        return cipi_fail(CIP_ERR_NOT_HELD, "frame %llu in slot %u is not held",
                    (unsigned long long)frame->seq, frame->slot);
    return CIP_OK;
}

cip_status
cip_frame_wait(cip_sub *sub, const cip_frame *frame, void *stream)
{
    cip_status st = check_held(sub, frame);
    if (st != CIP_OK)
        return st;
    uint32_t slot = frame->slot, value = sub->held[slot].generation;
    if (flag_reached(sub, slot, value))
        return CIP_OK; /* the producer's work is done and visible: nothing to wait for */
    if (sub->ended == CIP_ERR_PUBLISHER_GONE && cipi_producer_dead(sub))
        return cipi_fail(CIP_ERR_PUBLISHER_GONE,
                    "the publisher died before frame %llu was complete: its data may be partial",
                    (unsigned long long)frame->seq);
    CUdeviceptr addr = sub->page_dev + (CUdeviceptr)slot * CIP_WIRE_SYNC_FLAG_BYTES;
    CUresult rc = cipi_drv.StreamWaitValue32(stream, addr, value, CIP_CU_STREAM_WAIT_VALUE_GEQ);
    if (rc != CIP_CUDA_SUCCESS)
        return cipi_cuda_fail("cuStreamWaitValue32", rc);
    cipi_book_note(&sub->book, slot, value);
    if (cipi_drv.EventRecord(sub->ev_wait[slot], stream) == CIP_CUDA_SUCCESS)
        sub->wait_recorded[slot] = 1;
    else
        sub->untracked = 1;
    return CIP_OK;
}

int
cip_frame_complete(cip_sub *sub, const cip_frame *frame)
{
    if (sub == NULL || frame == NULL || !sub->gpu || answer_flags(sub) == NULL ||
        frame->slot >= sub->info.num_slots || !cipi_ledger_received(&sub->ledger, frame->seq))
        return -1;
    const struct held *h = &sub->held[frame->slot];
    if (h->void_seen && h->void_generation == frame->generation)
        return 0; /* a void frame: taken and not published, never written */
    int state = cip_flag_state(flag_load(answer_flags(sub), frame->slot), frame->generation);
    if (state < 0 && sub->page != NULL && cipi_producer_dead(sub)) {
        /* it will never be written by the producer: force what we await (a frame not
         * seen set when received was noted), then the flag answers */
        cipi_resolve_waits(sub);
        state = cip_flag_state(flag_load(sub->page, frame->slot), frame->generation);
    }
    return state;
}

uint64_t
cip_sub_forced_flags(const cip_sub *sub)
{
    return sub ? sub->book.forced : 0;
}

cip_status
cip_sub_incomplete_frames(cip_sub *sub, uint64_t *seqs, size_t cap, size_t *count)
{
    if (sub == NULL || count == NULL || (seqs == NULL && cap))
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_sub_incomplete_frames: NULL argument");
    if (!sub->gpu)
        return cipi_fail(CIP_ERR_RAW_SESSION, "a raw session keeps no record of frame flags");
    *count = 0;
    if (answer_flags(sub) == NULL)
        return CIP_OK;
    cipi_resolve_waits(sub); /* only once the producer is dead (and the page still mapped) */
    *count = cipi_book_answers(&sub->book, answer_flags(sub), seqs, cap, NULL, NULL, 0);
    return CIP_OK;
}

uint64_t
cip_sub_untracked_frames(const cip_sub *sub)
{
    return sub ? sub->book.untracked : 0;
}

cip_status
cip_sub_release(cip_sub *sub, const cip_frame *frame, void *stream)
{
    cip_status st = check_held(sub, frame);
    if (st != CIP_OK)
        return st;
    return cipi_release_slot(sub, frame->seq, frame->slot, stream, 1);
}
