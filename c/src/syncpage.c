/* syncpage.c -- the sync page: layout, flag states, forcing (no GPU) (cip_internal.h says
 * what the modules share). */
#include "cip_internal.h"

/* ---- the sync page: layout, flag states, forcing (no GPU) ----------------------------- */

static size_t
round_up(size_t n, size_t to)
{
    return (n + to - 1) / to * to;
}

cip_status
cip_sync_layout(uint32_t num_slots, uint32_t max_subscribers, size_t *reads_offset,
                size_t *nbytes)
{
    if (reads_offset == NULL || nbytes == NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_sync_layout: NULL argument");
    if (num_slots < 1 || num_slots > CIP_WIRE_MAX_SLOTS || max_subscribers < 1 ||
        max_subscribers > 65536)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                    "a sync page has 1..%u slots and 1..65536 subscriber rows, not %u and %u",
                    CIP_WIRE_MAX_SLOTS, num_slots, max_subscribers);
    long page = sysconf(_SC_PAGESIZE);
    size_t reads = round_up((size_t)num_slots * CIP_WIRE_SYNC_FLAG_BYTES, CIP_WIRE_SYNC_READS_ALIGN);
    *reads_offset = reads;
    *nbytes = round_up(reads + (size_t)num_slots * max_subscribers * CIP_WIRE_SYNC_FLAG_BYTES,
                       page > 0 ? (size_t)page : 4096);
    return CIP_OK;
}

cip_status
cip_sync_create(size_t nbytes, int *fd)
{
    if (fd == NULL || nbytes == 0 || nbytes > ((size_t)1 << 40))
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "cip_sync_create: %zu bytes%s", nbytes,
                         fd == NULL ? ", NULL fd" : "");
    *fd = -1;
    int f = memfd_create("cupy_ipcpool-sync", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (f < 0)
        return cipi_fail(CIP_ERR_TRANSPORT, "memfd_create for the sync page: %s",
                         strerror(errno));
    if (ftruncate(f, (off_t)nbytes) != 0 ||
        fcntl(f, F_ADD_SEALS, CIP_WIRE_SYNC_SEALS | F_SEAL_SEAL) != 0) {
        int e = errno;
        close(f);
        return cipi_fail(e == ENOMEM || e == ENOSPC ? CIP_ERR_NO_MEMORY : CIP_ERR_TRANSPORT,
                         "making the sync page (%zu bytes): %s", nbytes, strerror(e));
    }
    *fd = f;
    return CIP_OK;
}

int
cip_flag_state(uint32_t word, uint32_t generation)
{
    uint32_t distance = word - generation;
    if (distance >= 0x80000000u)
        return -1; /* not set yet: the producer's stream is behind */
    if (distance < CIP_WIRE_SYNC_SET_WINDOW)
        return 1; /* the producer's stream set it, for this frame or a later one */
    /* forced after the death to w + FORCED: written if w >= generation */
    return distance >= CIP_WIRE_SYNC_FORCED ? 1 : 0;
}

/* A read flag a departed subscriber never wrote: store `value` unless the flag reached it
 * (cyclic; it never moves backwards).  A compare-and-swap: a write that lands since the read
 * is never overwritten.  1 if stored. */
int
cipi_flag_force_to(uint32_t *flag, uint32_t value)
{
    uint32_t word = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
    while ((int32_t)(word - value) < 0)
        if (__atomic_compare_exchange_n(flag, &word, value, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_ACQUIRE))
            return 1;
    return 0;
}

int
cip_flag_force(uint32_t *flag, uint32_t awaited)
{
    if (flag == NULL)
        return -1;
    uint32_t word = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
    for (;;) {
        if ((int32_t)(word - awaited) >= 0)
            return 0; /* reached: set by the producer, or forced by another survivor */
        if (__atomic_compare_exchange_n(flag, &word, word + CIP_WIRE_SYNC_FORCED, 0,
                                        __ATOMIC_SEQ_CST, __ATOMIC_ACQUIRE))
            return 1;
    }
}
