/* pool.c -- pools: attach (import, reserve, map, access), slots, handles, close (no unmap
 * under queued GPU work) (cip_internal.h says what the modules share). */
#include "cip_internal.h"

/* ---- pools ----------------------------------------------------------------------------- */

static void
unmap_slots(cip_pool *pool, uint32_t mapped)
{
    for (uint32_t i = mapped; i-- > 0;) {
        cipi_drv.MemUnmap(pool->ptrs[i], pool->desc.alloc_nbytes);
        cipi_drv.MemAddressFree(pool->ptrs[i], pool->desc.alloc_nbytes);
        cipi_drv.MemRelease(pool->handles[i]);
    }
}

static void
free_pool(cip_pool *pool)
{
    free(pool->ptrs);
    free(pool->handles);
    free(pool->seen);
    free(pool);
}

void
cipi_pool_forget(cip_pool *pool)
{
    if (pool != NULL)
        free_pool(pool);
}

/* Import, reserve, map and set access for every slot; the fds are closed in every case. */
cip_status
cipi_attach_fds(const cip_descriptor *d, int *fds, size_t nfds, int device, cip_pool **out)
{
    cip_pool *pool = NULL;
    cip_status st = CIP_OK;
    int local = -1;
    if (nfds != d->num_slots) {
        st = cipi_fail(CIP_ERR_DESCRIPTOR, "got %zu fds for a pool of %u slots", nfds, d->num_slots);
        goto done;
    }
    if ((st = cipi_driver()) != CIP_OK)
        goto done;
    if ((st = cipi_resolve_device(d->device_uuid, device, &local)) != CIP_OK)
        goto done;
    pool = (cip_pool *)calloc(1, sizeof *pool);
    if (pool != NULL) {
        pool->ptrs = (uint64_t *)calloc(d->num_slots, sizeof(uint64_t));
        pool->handles = (uint64_t *)calloc(d->num_slots, sizeof(uint64_t));
        pool->seen = (uint64_t *)calloc(d->num_slots, sizeof(uint64_t));
    }
    if (pool == NULL || !pool->ptrs || !pool->handles || !pool->seen) {
        st = cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
        goto done;
    }
    pool->desc = *d;
    pool->desc.fds_le = NULL;
    pool->device = local;
    pool->num_slots = d->num_slots;
    if ((st = cipi_ctx_push(local)) != CIP_OK)
        goto done;
    cip_access_desc access = {{CIP_CU_MEM_LOCATION_TYPE_DEVICE, local},
                              CIP_CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    size_t size = (size_t)d->alloc_nbytes;
    uint32_t i;
    for (i = 0; i < d->num_slots; i++) {
        uint64_t h = 0;
        CUdeviceptr ptr = 0;
        CUresult rc = cipi_drv.MemImportFromShareableHandle(&h, (void *)(intptr_t)fds[i],
                                                       CIP_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        if (rc != CIP_CUDA_SUCCESS) {
            st = cipi_cuda_fail("cuMemImportFromShareableHandle", rc);
            break;
        }
        rc = cipi_drv.MemAddressReserve(&ptr, size, 0, 0, 0);
        if (rc != CIP_CUDA_SUCCESS) {
            cipi_drv.MemRelease(h);
            st = cipi_cuda_fail("cuMemAddressReserve", rc);
            break;
        }
        rc = cipi_drv.MemMap(ptr, size, 0, h, 0);
        if (rc != CIP_CUDA_SUCCESS) {
            cipi_drv.MemAddressFree(ptr, size);
            cipi_drv.MemRelease(h);
            st = cipi_cuda_fail("cuMemMap", rc);
            break;
        }
        rc = cipi_drv.MemSetAccess(ptr, size, &access, 1);
        if (rc != CIP_CUDA_SUCCESS) {
            cipi_drv.MemUnmap(ptr, size);
            cipi_drv.MemAddressFree(ptr, size);
            cipi_drv.MemRelease(h);
            st = cipi_cuda_fail("cuMemSetAccess", rc);
            break;
        }
        pool->ptrs[i] = ptr;
        pool->handles[i] = h;
    }
    if (st != CIP_OK)
        unmap_slots(pool, i);
    cipi_ctx_pop();
done:
    cipi_close_fds(fds, nfds);
    if (st != CIP_OK) {
        if (pool != NULL)
            free_pool(pool);
        return st;
    }
    *out = pool;
    return CIP_OK;
}

cip_status
cip_pool_attach_fds(const void *desc_bytes, size_t len, int *fds, size_t nfds, int device,
                    cip_pool **out)
{
    cip_descriptor d;
    cip_status st = out == NULL || (fds == NULL && nfds)
                        ? cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_pool_attach_fds: NULL argument")
                        : cip_parse_descriptor(desc_bytes, len, &d);
    if (st != CIP_OK) {
        if (fds != NULL)
            cipi_close_fds(fds, nfds);
        return st;
    }
    return cipi_attach_fds(&d, fds, nfds, device, out);
}

cip_status
cip_pool_attach(const void *desc_bytes, size_t len, int device, int transport, cip_pool **out)
{
    cip_descriptor d;
    if (out == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_pool_attach: NULL argument");
    cip_status st = cip_parse_descriptor(desc_bytes, len, &d);
    if (st != CIP_OK)
        return st;
    if ((st = cipi_driver()) != CIP_OK)
        return st;
    int *fds = (int *)malloc(d.num_slots * sizeof(int));
    if (fds == NULL)
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
    size_t n = 0;
    st = cip_fetch_fds(desc_bytes, len, transport, 10000, fds, d.num_slots, &n);
    if (st == CIP_OK)
        st = cipi_attach_fds(&d, fds, n, device, out);
    free(fds);
    return st;
}

uint32_t
cip_pool_num_slots(const cip_pool *pool)
{
    return pool ? pool->num_slots : 0;
}

uint64_t
cip_pool_slot_nbytes(const cip_pool *pool)
{
    return pool ? pool->desc.slot_nbytes : 0;
}

int
cip_pool_device(const cip_pool *pool)
{
    return pool ? pool->device : -1;
}

cip_status
cip_pool_slot_ptr(const cip_pool *pool, uint32_t slot, uint64_t *ptr)
{
    if (pool == NULL || ptr == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_pool_slot_ptr: NULL argument");
    if (slot >= pool->num_slots)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "slot %u out of range for %u slots", slot,
                    pool->num_slots);
    *ptr = pool->ptrs[slot];
    return CIP_OK;
}

cip_status
cip_array_from_handle(cip_pool *pool, const void *bytes, size_t len, cip_array *out)
{
    if (pool == NULL || bytes == NULL || out == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_array_from_handle: NULL argument");
    cip_array a;
    size_t used = 0;
    cip_status st = cipi_parse_handle((const uint8_t *)bytes, len, &a, &used);
    if (st != CIP_OK)
        return st;
    if (used != len)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "array handle has %zu trailing bytes after its end",
                    len - used);
    if (a.slot >= pool->num_slots)
        return cipi_fail(CIP_ERR_DESCRIPTOR, "handle names slot %u; the pool has %u slots", a.slot,
                    pool->num_slots);
    if (a.generation < pool->seen[a.slot])
        return cipi_fail(CIP_ERR_STALE,
                    "handle for slot %u is of generation %llu; generation %llu has been seen "
                    "since, so its memory was reused",
                    a.slot, (unsigned long long)a.generation,
                    (unsigned long long)pool->seen[a.slot]);
    if ((st = cipi_check_fits(&a, pool->desc.slot_nbytes)) != CIP_OK)
        return st;
    pool->seen[a.slot] = a.generation;
    a.data = pool->ptrs[a.slot] + a.offset;
    *out = a;
    return CIP_OK;
}

/* ---- closing a pool: no unmap under queued GPU work ------------------------------------ */

/* cuMemUnmap does not wait for kernels as cudaFree does: a kernel queued in this
 * process on a slot would fault (and poison the context) if the slot went first.  So
 * a close synchronises the pool's device context, then unmaps -- inline for up to
 * CIP_WIRE_UNMAP_WAIT_MS (generated: _vmm.DRAIN_TIMEOUT), after that in a thread of
 * its own, once the work is done (as the Python package's
 * _vmm.release_after_queued_work). */

/* cuCtxSynchronize on the pool's device (its primary context, pushed and popped),
 * then unmap and release every slot whatever it said, and free the pool.  On
 * failure `why` says what happened. */
static cip_status
sync_and_unmap(cip_pool *pool, char *why, size_t cap)
{
    cip_status st = cipi_ctx_push(pool->device);
    if (st == CIP_OK) {
        CUresult rc = cipi_drv.CtxSynchronize();
        if (rc != CIP_CUDA_SUCCESS) {
            char call[96];
            snprintf(call, sizeof call, "cuCtxSynchronize on device %d before unmapping the pool",
                     pool->device);
            st = cipi_cuda_fail(call, rc);
            snprintf(why, cap,
                     "%.600s: the context holds an error from earlier work (a failed kernel); the "
                     "slots were unmapped anyway",
                     cipi_tls_error);
        }
        unmap_slots(pool, pool->num_slots);
        cipi_ctx_pop();
    } else {
        snprintf(why, cap, "%.600s; the pool was unmapped without waiting for queued GPU work",
                 cipi_tls_error);
        unmap_slots(pool, pool->num_slots);
    }
    free_pool(pool);
    return st;
}

struct unmap_job {
    cip_pool *pool;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int done, abandoned; /* abandoned: the closing call gave up waiting; the thread frees */
    cip_status status;
    char why[sizeof cipi_tls_error];
};

static void
unmap_job_free(struct unmap_job *job)
{
    pthread_cond_destroy(&job->cond);
    pthread_mutex_destroy(&job->lock);
    free(job);
}

static void *
unmap_worker(void *arg)
{
    struct unmap_job *job = (struct unmap_job *)arg;
    job->status = sync_and_unmap(job->pool, job->why, sizeof job->why);
    pthread_mutex_lock(&job->lock);
    job->done = 1;
    int abandoned = job->abandoned;
    pthread_cond_signal(&job->cond);
    pthread_mutex_unlock(&job->lock);
    if (abandoned)
        unmap_job_free(job);
    return NULL;
}

/* Start the job's thread with every signal blocked (they stay the caller's threads'). */
static int
start_unmap_job(struct unmap_job *job, pthread_t *thread)
{
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr) != 0)
        return -1;
    int ok = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) == 0 &&
             pthread_cond_init(&job->cond, &attr) == 0;
    pthread_condattr_destroy(&attr);
    if (!ok)
        return -1;
    if (pthread_mutex_init(&job->lock, NULL) != 0) {
        pthread_cond_destroy(&job->cond);
        return -1;
    }
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(thread, NULL, unmap_worker, job);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        pthread_mutex_destroy(&job->lock);
        pthread_cond_destroy(&job->cond);
        return -1;
    }
    return 0;
}

cip_status
cip_pool_close(cip_pool *pool)
{
    if (pool == NULL)
        return CIP_OK;
    int device = pool->device;
    struct unmap_job *job = (struct unmap_job *)calloc(1, sizeof *job);
    pthread_t thread;
    if (job != NULL)
        job->pool = pool;
    if (job == NULL || start_unmap_job(job, &thread) != 0) {
        /* no thread to spare: wait inline, however long it takes */
        char why[sizeof cipi_tls_error];
        free(job);
        cip_status st = sync_and_unmap(pool, why, sizeof why);
        return st == CIP_OK ? CIP_OK : cipi_fail(st, "%s", why);
    }
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += (time_t)(CIP_WIRE_UNMAP_WAIT_MS / 1000u);
    until.tv_nsec += (long)(CIP_WIRE_UNMAP_WAIT_MS % 1000u) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&job->lock);
    while (!job->done) {
        if (pthread_cond_timedwait(&job->cond, &job->lock, &until) == ETIMEDOUT)
            break;
    }
    if (!job->done) {
        job->abandoned = 1;
        pthread_mutex_unlock(&job->lock);
        pthread_detach(thread);
        return cipi_fail(CIP_ERR_TIMEOUT,
                    "GPU work queued in this process on device %d has not finished within %g s; "
                    "the pool's slots stay mapped until it has, then a background thread unmaps "
                    "them",
                    device, CIP_WIRE_UNMAP_WAIT_MS / 1000.0);
    }
    pthread_mutex_unlock(&job->lock);
    pthread_join(thread, NULL);
    cip_status st = job->status;
    if (st != CIP_OK)
        cipi_fail(st, "%s", job->why);
    unmap_job_free(job);
    return st;
}
