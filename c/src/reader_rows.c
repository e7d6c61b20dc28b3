/* reader_rows.c -- the publisher's rows of read flags in the sync page: which subscriber
 * writes which row, and the rows of subscribers that left while the publisher's streams may
 * still wait on their flags ("departed readers").  No GPU, no threads, no lock: the owner
 * serialises the calls (the Python publisher: its lock and the GIL).
 *
 * Rows are handed out round-robin, so a departed subscriber's row is reused as late as
 * possible (its last flag writes may still be in flight).  A departed row is not reused while
 * the publisher's streams may wait on it -- until its flags are seen at the generations the
 * publisher may wait for, or its process has exited (then they are forced: its writes died
 * with its CUDA context), or the streams have run past every wait -- unless no other row is
 * free: then the oldest is forced and taken.  (cip_internal.h says what the modules share.) */
#include "cip_internal.h"

cip_status
cipi_rows_init(struct cipi_rows *r, uint32_t max_rows, uint32_t num_slots, uint32_t *page,
               size_t nbytes, size_t reads_offset)
{
    memset(r, 0, sizeof *r);
    if (max_rows == 0 || num_slots == 0 || page == NULL ||
        reads_offset % CIP_WIRE_SYNC_FLAG_BYTES || reads_offset > nbytes ||
        (nbytes - reads_offset) / CIP_WIRE_SYNC_FLAG_BYTES / num_slots < max_rows)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT,
                         "%u rows of %u read flags from byte %zu do not fit a page of %zu bytes",
                         max_rows, num_slots, reads_offset, nbytes);
    r->live = calloc(max_rows, sizeof *r->live);
    r->departed = calloc(max_rows, sizeof *r->departed);
    r->values = calloc((size_t)max_rows * num_slots, sizeof *r->values);
    if (r->live == NULL || r->departed == NULL || r->values == NULL) {
        free(r->live);
        free(r->departed);
        free(r->values);
        memset(r, 0, sizeof *r);
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory making the reader rows");
    }
    r->max_rows = max_rows;
    r->num_slots = num_slots;
    r->page = page;
    r->reads_at = reads_offset / CIP_WIRE_SYNC_FLAG_BYTES;
    return CIP_OK;
}

/* Close every pidfd still held; forget the page. */
void
cipi_rows_free(struct cipi_rows *r)
{
    for (uint32_t i = 0; i < r->nlive; i++)
        cipi_pidfd_close(r->live[i].pidfd);
    for (uint32_t i = 0; i < r->ndeparted; i++)
        cipi_pidfd_close(r->departed[i].pidfd);
    free(r->live);
    free(r->departed);
    free(r->values);
    memset(r, 0, sizeof *r);
}

static uint32_t *
flag(const struct cipi_rows *r, uint32_t index, uint32_t slot)
{
    return &r->page[r->reads_at + (size_t)index * r->num_slots + slot];
}

/* The values a departed row waits for (row `index`'s room in r->values). */
static uint32_t *
values_of(const struct cipi_rows *r, uint32_t index)
{
    return &r->values[(size_t)index * r->num_slots];
}

/* Whether every flag of departed row d is at (or past, cyclically) its value. */
static int
settled(const struct cipi_rows *r, const struct cipi_departed *d)
{
    const uint32_t *v = values_of(r, d->index);
    for (uint32_t s = 0; s < r->num_slots; s++)
        if ((int32_t)(__atomic_load_n(flag(r, d->index, s), __ATOMIC_ACQUIRE) - v[s]) < 0)
            return 0;
    return 1;
}

/* Write departed row d's flags from the host (each unless it reached its value); how many. */
static uint32_t
force(struct cipi_rows *r, const struct cipi_departed *d)
{
    const uint32_t *v = values_of(r, d->index);
    uint32_t n = 0;
    for (uint32_t s = 0; s < r->num_slots; s++)
        n += (uint32_t)cipi_flag_force_to(flag(r, d->index, s), v[s]);
    r->forced += n;
    return n;
}

static void
forget_departed(struct cipi_rows *r, uint32_t i)
{
    cipi_pidfd_close(r->departed[i].pidfd);
    memmove(&r->departed[i], &r->departed[i + 1], (r->ndeparted - i - 1) * sizeof *r->departed);
    r->ndeparted--;
}

static long
live_at(const struct cipi_rows *r, uint32_t sub_id)
{
    for (uint32_t i = 0; i < r->nlive; i++)
        if (r->live[i].sub_id == sub_id)
            return (long)i;
    return -1;
}

/* Give subscriber `sub_id` (of process `pid`, as the kernel names it) a row: the first
 * free one from the next round-robin, else the oldest departed row, forced.  *index is it.
 * CIP_ERR_PROTOCOL "no free subscriber row in the sync page" when every row is live. */
cip_status
cipi_rows_assign(struct cipi_rows *r, uint32_t sub_id, int pid, uint32_t *index)
{
    if (live_at(r, sub_id) >= 0)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "subscriber %u has a row already", sub_id);
    uint32_t pick = UINT32_MAX;
    for (uint32_t step = 0; step < r->max_rows && pick == UINT32_MAX; step++) {
        uint32_t i = (r->next + step) % r->max_rows, taken = 0;
        for (uint32_t k = 0; k < r->nlive && !taken; k++)
            taken = r->live[k].index == i;
        for (uint32_t k = 0; k < r->ndeparted && !taken; k++)
            taken = r->departed[k].index == i;
        if (!taken)
            pick = i;
    }
    if (pick == UINT32_MAX) {
        if (r->ndeparted == 0)
            return cipi_fail(CIP_ERR_PROTOCOL, "no free subscriber row in the sync page");
        force(r, &r->departed[0]);
        pick = r->departed[0].index;
        forget_departed(r, 0);
    }
    r->next = pick + 1;
    /* the kernel's pid only: a pid claimed in HELLO may name another process here (then
     * no pidfd, and a departed reader's flags are never written for it) */
    r->live[r->nlive++] = (struct cipi_live_row){sub_id, pick, cipi_pidfd_open(pid), 0};
    *index = pick;
    return CIP_OK;
}

/* Subscriber `sub_id` was adopted: it may read frames, so streams may wait on its row. */
cip_status
cipi_rows_adopt(struct cipi_rows *r, uint32_t sub_id)
{
    long i = live_at(r, sub_id);
    if (i < 0)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "subscriber %u has no row", sub_id);
    r->live[i].adopted = 1;
    return CIP_OK;
}

/* Subscriber sub_id's row, or -1. */
long
cipi_rows_index(const struct cipi_rows *r, uint32_t sub_id)
{
    long i = live_at(r, sub_id);
    return i < 0 ? -1 : (long)r->live[i].index;
}

/* Subscriber `sub_id` left.  Streams may wait on its read flags for the generations
 * `published` (the last published in each slot) only if it was adopted; if it is dead,
 * those writes died with its CUDA context: they are made here.  Once its flags are in, or
 * the streams are `idle` (run past every wait), nothing waits on it; until then (it lives,
 * its writes will come) its row waits among the departed.  Nothing for one without a row. */
void
cipi_rows_leave(struct cipi_rows *r, uint32_t sub_id, const uint32_t *published, int idle)
{
    long i = live_at(r, sub_id);
    if (i < 0)
        return;
    struct cipi_live_row row = r->live[i];
    r->live[i] = r->live[--r->nlive];
    if (!row.adopted) {
        cipi_pidfd_close(row.pidfd);
        return;
    }
    struct cipi_departed d = {row.index, row.pidfd};
    memcpy(values_of(r, row.index), published, r->num_slots * sizeof *published);
    if (cipi_pidfd_exited(d.pidfd)) {
        force(r, &d);
        cipi_pidfd_close(d.pidfd);
    } else if (idle || settled(r, &d)) {
        cipi_pidfd_close(d.pidfd);
    } else {
        r->departed[r->ndeparted++] = d;
    }
}

/* Subscriber `sub_id` was welcomed and never adopted (its WELCOME failed, or it hung up
 * first): it read no frame, so its row is free at once.  CIP_ERR_INVALID_ARGUMENT for one
 * that was adopted (that one leaves through cipi_rows_leave); nothing for one without a row. */
cip_status
cipi_rows_drop(struct cipi_rows *r, uint32_t sub_id)
{
    long i = live_at(r, sub_id);
    if (i < 0)
        return CIP_OK;
    if (r->live[i].adopted)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "subscriber %u was adopted: it leaves, "
                                                   "not drops", sub_id);
    cipi_pidfd_close(r->live[i].pidfd);
    r->live[i] = r->live[--r->nlive];
    return CIP_OK;
}

/* Whether the departed rows are due a look (some wait, and the last look is
 * CIPI_ROWS_LOOK_EVERY_NS ago): a look asks the caller whether its streams are idle, which
 * costs a query of each.  1 starts the next interval. */
int
cipi_rows_due(struct cipi_rows *r)
{
    if (r->ndeparted == 0)
        return 0;
    long long now = cipi_now_ns();
    if (now < r->next_look)
        return 0;
    r->next_look = now + CIPI_ROWS_LOOK_EVERY_NS;
    return 1;
}

/* Look at the departed rows: a dead one's flags are forced, and one whose flags are in, or
 * every one when the streams are `idle`, is done with.  How many are left. */
uint32_t
cipi_rows_settle(struct cipi_rows *r, int idle)
{
    for (uint32_t i = 0; i < r->ndeparted;) {
        struct cipi_departed *d = &r->departed[i];
        if (cipi_pidfd_exited(d->pidfd)) {
            force(r, d);
            forget_departed(r, i);
        } else if (idle || settled(r, d)) {
            forget_departed(r, i);
        } else {
            i++;
        }
    }
    return r->ndeparted;
}

/* The publisher closes: every adopted subscriber is departed now (its flags at
 * `published`), the others' pidfds are closed.  No row is live afterwards. */
void
cipi_rows_close(struct cipi_rows *r, const uint32_t *published)
{
    while (r->nlive) {
        struct cipi_live_row row = r->live[--r->nlive];
        if (!row.adopted || r->ndeparted == r->max_rows) {
            cipi_pidfd_close(row.pidfd);
            continue;
        }
        memcpy(values_of(r, row.index), published, r->num_slots * sizeof *published);
        r->departed[r->ndeparted++] = (struct cipi_departed){row.index, row.pidfd};
    }
}

/* One look at close: force the dead departed rows' flags; 1 when every departed row's
 * flags are in (nothing of ours can wait on the page any more). */
int
cipi_rows_all_settled(struct cipi_rows *r)
{
    int all = 1;
    for (uint32_t i = 0; i < r->ndeparted; i++) {
        if (cipi_pidfd_exited(r->departed[i].pidfd))
            force(r, &r->departed[i]);
        all = all && settled(r, &r->departed[i]);
    }
    return all;
}
