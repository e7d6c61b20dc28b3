/* sub_close.c -- closing a subscription: quiesce the flag operations, freeze the answers,
 * the close order, free (cip_internal.h says what the modules share). */
#include "cip_internal.h"

/* Wait for the flag operations we enqueued; resolve waits the dead producer left. */
static int
gpu_quiesce(cip_sub *sub)
{
    if (sub->untracked)
        return 0;
    long long deadline = cipi_now_ms() + (long long)CIP_WIRE_CLOSE_WAIT_MS;
    long delay = 50;
    for (;;) {
        int pending = 0;
        for (uint32_t s = 0; s < sub->info.num_slots; s++) {
            if (sub->wait_recorded[s]) {
                if (cipi_drv.EventQuery(sub->ev_wait[s]) == CIP_CUDA_ERROR_NOT_READY)
                    pending = 1;
                else
                    sub->wait_recorded[s] = 0;
            }
            if (sub->write_recorded[s]) {
                if (cipi_drv.EventQuery(sub->ev_write[s]) == CIP_CUDA_ERROR_NOT_READY)
                    pending = 1;
                else
                    sub->write_recorded[s] = 0;
            }
        }
        if (!pending)
            return 1;
        cipi_resolve_waits(sub); /* only acts once the producer is dead */
        if (cipi_now_ms() >= deadline)
            return 0;
        cipi_sleep_us(delay);
        delay = delay * 2 > 2000 ? 2000 : delay * 2;
    }
}

/* The answers after close: the frame flags as they are now (forced first if the
 * producer is dead), kept in the handle; 0, or -1 out of memory (then none). */
static int
freeze_answers(cip_sub *sub)
{
    if (!sub->gpu || sub->page == NULL)
        return 0;
    cipi_resolve_waits(sub);
    sub->final_flags = (uint32_t *)malloc((size_t)sub->info.num_slots * sizeof(uint32_t));
    if (sub->final_flags == NULL)
        return -1;
    for (uint32_t s = 0; s < sub->info.num_slots; s++)
        sub->final_flags[s] = flag_load(sub->page, s);
    return 0;
}

/* In a child just forked (forked.c): close its copy of the socket, which would hide this
 * process's death from the publisher (no hang-up: the frames held stay leased). */
static void
close_socket_in_child(void *end)
{
    cip_sub *sub = end;
    if (sub->sock >= 0)
        close(sub->sock); /* our copy: the parent's stays as it is */
    sub->sock = -1;
}

void
cipi_sub_watch_fork(cip_sub *sub)
{
    cipi_fork_watch(sub, close_socket_in_child);
}

cip_status
cipi_sub_usable(const cip_sub *sub)
{
    if (sub->closed)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "the subscription is closed");
    if (getpid() != sub->owner)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                         "this subscription was opened by process %d; a child created by fork "
                         "may not use it (subscribe in the child)",
                         (int)sub->owner);
    return CIP_OK;
}

cip_status
cip_sub_close(cip_sub *sub)
{
    if (sub == NULL || sub->closed)
        return CIP_OK;
    cipi_fork_unwatch(sub);
    char saved[sizeof cipi_tls_error], why[sizeof cipi_tls_error] = "";
    memcpy(saved, cipi_tls_error, sizeof saved);
    cip_status result = CIP_OK;
    int keep = 0;
    /* a child forked from the process that opened it: the connection, the mappings and the
     * GPU work are the parent's; only this process's copies of the fds close, no BYE, no
     * driver call (the Python subscriber's rule) */
    int child = getpid() != sub->owner;
    if (!child && sub->gpu && sub->page != NULL && cipi_drv.status == CIP_OK) {
        int device = sub->pool ? sub->pool->device : -1;
        int pushed = device >= 0 && cipi_ctx_push(device) == CIP_OK;
        keep = !gpu_quiesce(sub);
        if (keep) {
            result = CIP_ERR_TIMEOUT;
            snprintf(why, sizeof why,
                     "%s: the sync page and the pool stay mapped (leaked) rather than unmapped "
                     "under a stream that may still wait on a frame flag",
                     sub->untracked ? "a flag operation of this subscription could not be tracked"
                                    : "the flag operations this subscription enqueued did not "
                                      "finish within 5 s (a producer alive but stalled?)");
        } else if (sub->registered &&
                   cipi_drv.MemHostUnregister((void *)sub->page) != CIP_CUDA_SUCCESS) {
            keep = 1;
            result = CIP_ERR_CUDA;
            snprintf(why, sizeof why,
                     "cuMemHostUnregister of the sync page failed: the page and the pool stay "
                     "mapped (leaked)");
        }
        for (uint32_t s = 0; s < sub->info.num_slots; s++) {
            if (sub->ev_wait && sub->ev_wait[s])
                cipi_drv.EventDestroy(sub->ev_wait[s]);
            if (sub->ev_write && sub->ev_write[s])
                cipi_drv.EventDestroy(sub->ev_write[s]);
        }
        if (pushed)
            cipi_ctx_pop();
        (void)freeze_answers(sub);
        if (!keep)
            munmap((void *)sub->page, sub->page_nbytes);
    } else if (sub->page != NULL) {
        if (!child) /* (a child leaves the parent's page as it is: nothing forced) */
            (void)freeze_answers(sub);
        munmap((void *)sub->page, sub->page_nbytes);
    }
    sub->page = NULL;
    /* BYE only once our flag operations are done (or abandoned): the publisher may give
     * this row to a newcomer once we are gone, and a late read-flag write of ours would
     * land in its row (the Python subscriber's order) */
    if (sub->buf != NULL && !child)
        cipi_say_bye_and_close(sub);
    else if (sub->sock >= 0)
        close(sub->sock);
    sub->sock = -1;
    /* a stream that may still wait on the page may still read the slots: keep both;
     * else the pool's close waits for this process's queued work on them */
    if (child) {
        cipi_pool_forget(sub->pool);
    } else if (!keep) {
        cip_status st = cip_pool_close(sub->pool);
        if (st != CIP_OK) {
            result = st;
            memcpy(why, cipi_tls_error, sizeof why);
        }
    }
    sub->pool = NULL;
    if (sub->fds)
        cipi_close_fds(sub->fds, sub->nfds);
    if (sub->pidfd >= 0)
        close(sub->pidfd);
    sub->pidfd = -1;
    cipi_backlog_clear(sub);
    if (sub->held) {
        for (uint32_t s = 0; s < sub->info.num_slots; s++) {
            free(sub->held[s].arrays);
            free(sub->held[s].meta);
            sub->held[s].arrays = NULL;
            sub->held[s].meta = NULL;
        }
    }
    free(sub->backlog);
    cipi_owed_free(&sub->owed);
    free(sub->welcome);
    free(sub->fds);
    free(sub->buf);
    free(sub->ev_wait);
    free(sub->ev_write);
    free(sub->wait_recorded);
    free(sub->write_recorded);
    sub->backlog = NULL;
    sub->bl_len = 0;
    sub->welcome = NULL;
    sub->welcome_len = 0;
    sub->fds = NULL;
    sub->nfds = 0;
    sub->buf = NULL;
    sub->ev_wait = sub->ev_write = NULL;
    sub->wait_recorded = sub->write_recorded = NULL;
    sub->closed = 1; /* the handle, its answers (held, book, final_flags) and error stay */
    if (result != CIP_OK)
        return cipi_fail(result, "%s", why);
    memcpy(cipi_tls_error, saved, sizeof saved);
    return CIP_OK;
}

cip_status
cip_sub_free(cip_sub *sub)
{
    if (sub == NULL)
        return CIP_OK;
    cip_status st = cip_sub_close(sub);
    free(sub->held);
    cipi_ledger_free(&sub->ledger);
    cipi_book_free(&sub->book);
    free(sub->final_flags);
    free(sub);
    return st;
}
