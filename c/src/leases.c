/* leases.c -- the publisher's lease book: who holds which slot, and when a slot may be
 * reused; every RELEASE explained by a lease; the "latest" subscribers' budget; leases
 * ended at read flags and the RELEASEs then due; an "ahead" subscriber's releases before
 * publication; the eviction rule (no GPU, no I/O, no clock of its own) (cip_internal.h
 * says what the modules share).  cupy_ipcpool._engine.LeaseBook is its Python face;
 * channel/_leases.py documents each rule. */
#include "cip_internal.h"

/* ---- small ordered maps seq -> slot (insertion order, as Python's dicts) ---------------- */

static long
pairs_find(const struct cipi_pairs *p, uint64_t seq)
{
    for (uint32_t i = 0; i < p->len; i++)
        if (p->v[i].seq == seq)
            return (long)i;
    return -1;
}

/* seq's slot, or -1 */
static long long
pairs_get(const struct cipi_pairs *p, uint64_t seq)
{
    long i = pairs_find(p, seq);
    return i < 0 ? -1 : (long long)p->v[i].slot;
}

static int
pairs_put(struct cipi_pairs *p, uint64_t seq, uint32_t slot)
{
    long i = pairs_find(p, seq);
    if (i >= 0) {
        p->v[i].slot = slot;
        return 0;
    }
    if (p->len == p->cap) {
        uint32_t cap = p->cap ? 2 * p->cap : 8;
        struct cipi_pair *v = (struct cipi_pair *)realloc(p->v, cap * sizeof *v);
        if (v == NULL)
            return -1;
        p->v = v;
        p->cap = cap;
    }
    p->v[p->len].seq = seq;
    p->v[p->len].slot = slot;
    p->len++;
    return 0;
}

/* Remove seq; its slot, or -1 if it was not there. */
static long long
pairs_pop(struct cipi_pairs *p, uint64_t seq)
{
    long i = pairs_find(p, seq);
    if (i < 0)
        return -1;
    long long slot = p->v[i].slot;
    memmove(&p->v[i], &p->v[i + 1], (p->len - (uint32_t)i - 1) * sizeof p->v[0]);
    p->len--;
    return slot;
}

/* ---- small sets of subscriber ids, in insertion order ----------------------------------- */

static long
ids_find(const struct cipi_ids *s, uint32_t id)
{
    for (uint32_t i = 0; i < s->len; i++)
        if (s->v[i] == id)
            return (long)i;
    return -1;
}

static int
ids_add(struct cipi_ids *s, uint32_t id)
{
    if (ids_find(s, id) >= 0)
        return 0;
    if (s->len == s->cap) {
        uint32_t cap = s->cap ? 2 * s->cap : 4;
        uint32_t *v = (uint32_t *)realloc(s->v, cap * sizeof *v);
        if (v == NULL)
            return -1;
        s->v = v;
        s->cap = cap;
    }
    s->v[s->len++] = id;
    return 0;
}

static void
ids_remove(struct cipi_ids *s, uint32_t id)
{
    long i = ids_find(s, id);
    if (i < 0)
        return;
    memmove(&s->v[i], &s->v[i + 1], (s->len - (uint32_t)i - 1) * sizeof s->v[0]);
    s->len--;
}

/* ---- the book ---------------------------------------------------------------------------- */

uint32_t
cipi_default_latest_reserve(uint32_t num_slots)
{
    return num_slots < 1 ? 0 : (num_slots - 1 < 2 ? num_slots - 1 : 2);
}

uint32_t
cipi_default_max_due(uint32_t num_slots)
{
    return 4 * num_slots;
}

uint32_t
cipi_default_max_credit(uint32_t num_slots)
{
    uint32_t c = num_slots - cipi_default_latest_reserve(num_slots);
    return c < 1 ? 1 : c;
}

uint32_t
cipi_granted_credit(uint64_t asked, uint32_t max_credit)
{
    uint64_t c = asked < max_credit ? asked : max_credit;
    return c < 1 ? 1 : (uint32_t)c;
}

static cip_status
nomem(void)
{
    return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory in the lease book");
}

cip_status
cipi_leases_init(struct cipi_leasebook *b, uint32_t num_slots, long long max_credit,
                 long long latest_reserve)
{
    memset(b, 0, sizeof *b);
    if (num_slots < 1)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "num_slots must be at least 1, not %u",
                         num_slots);
    if (max_credit < 0)
        max_credit = cipi_default_max_credit(num_slots);
    else if (max_credit < 1)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "max_credit must be at least 1, not %lld",
                         max_credit);
    if (latest_reserve < 0)
        latest_reserve = cipi_default_latest_reserve(num_slots);
    else if (latest_reserve >= num_slots)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "latest_reserve must be in 0..%u, not %lld",
                         num_slots - 1, latest_reserve);
    b->num_slots = num_slots;
    b->max_credit = max_credit > UINT32_MAX ? UINT32_MAX : (uint32_t)max_credit;
    b->latest_reserve = (uint32_t)latest_reserve;
    b->max_due = cipi_default_max_due(num_slots);
    b->latest_budget = num_slots - b->latest_reserve;
    b->latest_count = (uint32_t *)calloc(num_slots, sizeof *b->latest_count);
    b->since = (double *)calloc(num_slots, sizeof *b->since);
    b->holders = (struct cipi_ids *)calloc(num_slots, sizeof *b->holders);
    b->readers = (struct cipi_ids *)calloc(num_slots, sizeof *b->readers);
    b->has_seq = (uint8_t *)calloc(num_slots, 1);
    b->seq = (uint64_t *)calloc(num_slots, sizeof *b->seq);
    b->holds = (uint32_t *)calloc(num_slots, sizeof *b->holds);
    if (!b->latest_count || !b->since || !b->holders || !b->readers || !b->has_seq || !b->seq ||
        !b->holds) {
        cipi_leases_free(b);
        return nomem();
    }
    return CIP_OK;
}

static void
sub_free(struct cipi_lsub *s)
{
    free(s->leases.v);
    free(s->due.v);
    free(s->early.v);
    free(s->flag_only.v);
    free(s->spent.v);
    free(s);
}

void
cipi_leases_free(struct cipi_leasebook *b)
{
    for (uint32_t i = 0; i < b->nsubs; i++)
        sub_free(b->subs[i]);
    free(b->subs);
    for (uint32_t s = 0; b->holders && s < b->num_slots; s++)
        free(b->holders[s].v);
    for (uint32_t s = 0; b->readers && s < b->num_slots; s++)
        free(b->readers[s].v);
    free(b->holders);
    free(b->readers);
    free(b->latest_count);
    free(b->since);
    free(b->has_seq);
    free(b->seq);
    free(b->holds);
    memset(b, 0, sizeof *b);
}

struct cipi_lsub *
cipi_leases_sub(const struct cipi_leasebook *b, uint64_t sub_id)
{
    for (uint32_t i = 0; i < b->nsubs; i++)
        if (b->subs[i]->id == sub_id)
            return b->subs[i];
    return NULL;
}

cip_status
cipi_leases_check_slot(const struct cipi_leasebook *b, long long slot)
{
    if (slot < 0 || slot >= b->num_slots)
        return cipi_fail(CIPI_ERR_SLOT_INDEX, "slot %lld is outside 0..%u", slot,
                         b->num_slots - 1);
    return CIP_OK;
}

/* mode: CIPI_LEASE_BLOCK, _LATEST or _AHEAD; *granted: the credit granted. */
cip_status
cipi_leases_add(struct cipi_leasebook *b, uint64_t sub_id, int mode, long long credit,
                uint32_t *granted)
{
    if (sub_id > UINT32_MAX)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "sub_id %llu is outside 0..2**32-1",
                         (unsigned long long)sub_id);
    if (cipi_leases_sub(b, sub_id) != NULL)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "subscriber %llu is already registered",
                         (unsigned long long)sub_id);
    if (mode != CIPI_LEASE_BLOCK && mode != CIPI_LEASE_LATEST && mode != CIPI_LEASE_AHEAD)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "mode %d is not block, latest or ahead", mode);
    if (credit < 1)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "credit must be at least 1, not %lld", credit);
    struct cipi_lsub *s = (struct cipi_lsub *)calloc(1, sizeof *s);
    if (s == NULL)
        return nomem();
    if (b->nsubs == b->subs_cap) {
        uint32_t cap = b->subs_cap ? 2 * b->subs_cap : 8;
        struct cipi_lsub **v = (struct cipi_lsub **)realloc(b->subs, cap * sizeof *v);
        if (v == NULL) {
            free(s);
            return nomem();
        }
        b->subs = v;
        b->subs_cap = cap;
    }
    s->id = (uint32_t)sub_id;
    s->row = UINT32_MAX;
    s->latest = mode == CIPI_LEASE_LATEST;
    s->ahead = mode == CIPI_LEASE_AHEAD;
    s->credit = cipi_granted_credit((uint64_t)credit, b->max_credit);
    b->subs[b->nsubs++] = s;
    *granted = s->credit;
    return CIP_OK;
}

static void
latest_drop(struct cipi_leasebook *b, uint32_t slot)
{
    if (--b->latest_count[slot] == 0)
        b->latest_slots--;
}

static int
cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Forget subscriber sub_id and return its leases at once; the slots that became free,
 * in index order, into freed (num_slots of room), their count into *nfreed. */
void
cipi_leases_remove(struct cipi_leasebook *b, uint64_t sub_id, uint32_t *freed, uint32_t *nfreed)
{
    *nfreed = 0;
    for (uint32_t s = 0; s < b->num_slots; s++)
        ids_remove(&b->readers[s], (uint32_t)sub_id);
    uint32_t at = b->nsubs;
    for (uint32_t i = 0; i < b->nsubs; i++)
        if (b->subs[i]->id == sub_id)
            at = i;
    if (at == b->nsubs)
        return;
    struct cipi_lsub *sub = b->subs[at];
    memmove(&b->subs[at], &b->subs[at + 1], (b->nsubs - at - 1) * sizeof b->subs[0]);
    b->nsubs--;
    b->releases_due -= sub->due.len;
    b->ended += sub->leases.len;
    /* its slots, each once, in index order */
    uint32_t *slots = freed; /* reused as scratch: at most num_slots distinct slots */
    uint32_t n = 0;
    for (uint32_t i = 0; i < sub->leases.len; i++) {
        uint32_t slot = sub->leases.v[i].slot;
        int seen = 0;
        for (uint32_t k = 0; k < n; k++)
            seen |= slots[k] == slot;
        if (!seen)
            slots[n++] = slot;
    }
    if (n)
        qsort(slots, n, sizeof *slots, cmp_u32);
    for (uint32_t k = 0; k < n; k++) {
        uint32_t slot = slots[k];
        if (sub->latest)
            latest_drop(b, slot);
        ids_remove(&b->holders[slot], (uint32_t)sub_id);
        if (b->holders[slot].len == 0) {
            b->has_seq[slot] = 0;
            if (b->holds[slot] == 0)
                freed[(*nfreed)++] = slot; /* *nfreed <= k: no entry still to read is lost */
        }
    }
    sub_free(sub);
}

void
cipi_leases_suspend(struct cipi_leasebook *b, uint64_t sub_id)
{
    struct cipi_lsub *sub = cipi_leases_sub(b, sub_id);
    if (sub != NULL)
        sub->suspended = 1;
}

int
cipi_leases_is_free(const struct cipi_leasebook *b, uint32_t slot)
{
    return b->holders[slot].len == 0 && b->holds[slot] == 0;
}

/* The first free slot from `start` on, round-robin; -1: none.  The rule of
 * cupy_ipcpool._slots.first_free_slot, which the pool follows (a test holds both to one
 * model). */
long
cipi_leases_pick_free(const struct cipi_leasebook *b, uint64_t start)
{
    for (uint32_t i = 0; i < b->num_slots; i++) {
        uint32_t slot = (uint32_t)((start + i) % b->num_slots);
        if (cipi_leases_is_free(b, slot))
            return (long)slot;
    }
    return -1;
}

/* What a call that ran out of memory keeping a reader says, once. */
static cip_status
reported(struct cipi_leasebook *b)
{
    if (!b->oom)
        return CIP_OK;
    b->oom = 0;
    return nomem();
}

/* 1: the slot became free. */
static int
end_lease(struct cipi_leasebook *b, struct cipi_lsub *sub, uint64_t seq, uint32_t slot)
{
    pairs_pop(&sub->leases, seq);
    b->ended++;
    if (sub->latest)
        latest_drop(b, slot);
    ids_remove(&b->holders[slot], (uint32_t)sub->id);
    if (ids_add(&b->readers[slot], (uint32_t)sub->id) != 0)
        b->oom = 1;
    if (b->holders[slot].len)
        return 0;
    b->has_seq[slot] = 0;
    return b->holds[slot] == 0;
}

/* Decide who receives frame seq in slot and record their leases: their ids, in the
 * order the subscribers were added, into receivers (nsubs of room), *n of them. */
cip_status
cipi_leases_publishing(struct cipi_leasebook *b, uint32_t slot, uint64_t seq, double now,
                       int on_schedule, uint32_t *receivers, uint32_t *n)
{
    *n = 0;
    if (b->holders[slot].len) {
        struct cipi_ids *h = &b->holders[slot];
        char who[256];
        uint32_t *sorted = (uint32_t *)malloc(h->len * sizeof *sorted);
        if (sorted == NULL)
            return nomem();
        memcpy(sorted, h->v, h->len * sizeof *sorted);
        qsort(sorted, h->len, sizeof *sorted, cmp_u32);
        size_t k = (size_t)snprintf(who, sizeof who, "[");
        for (uint32_t i = 0; i < h->len && k < sizeof who; i++)
            k += (size_t)snprintf(who + k, sizeof who - k, "%s%u", i ? ", " : "", sorted[i]);
        if (k < sizeof who)
            snprintf(who + k, sizeof who - k, "]");
        free(sorted);
        return cipi_fail(CIPI_ERR_LEASE_STATE, "slot %u published while subscribers %s still "
                                                "hold frame %llu",
                         slot, who, (unsigned long long)b->seq[slot]);
    }
    int latest_room = b->latest_slots < b->latest_budget;
    uint32_t n_latest = 0;
    for (uint32_t i = 0; i < b->nsubs; i++) {
        struct cipi_lsub *sub = b->subs[i];
        sub->receiving = !sub->suspended &&
                         (!sub->latest || (latest_room && sub->leases.len < sub->credit));
        if (sub->receiving) {
            receivers[(*n)++] = sub->id;
            n_latest += (uint32_t)sub->latest;
        }
    }
    /* the "ahead" subscribers that released this frame before it came: marked here
     * (early_seen), their leases ended below */
    for (uint32_t i = 0; i < b->nsubs; i++) {
        struct cipi_lsub *sub = b->subs[i];
        if (!sub->receiving)
            continue;
        if (pairs_put(&sub->leases, seq, slot) != 0 || ids_add(&b->holders[slot], sub->id) != 0)
            return nomem();
        sub->early_seen = sub->early.len && pairs_pop(&sub->early, seq) == (long long)slot;
        if (!sub->early_seen && sub->ahead && !on_schedule &&
            pairs_put(&sub->flag_only, seq, slot) != 0)
            return nomem();
    }
    if (*n) {
        b->has_seq[slot] = 1;
        b->seq[slot] = seq;
        b->since[slot] = now;
        if (n_latest) {
            b->latest_count[slot] = n_latest;
            b->latest_slots++;
        }
    }
    b->readers[slot].len = 0;
    b->have_last = 1;
    b->last_seq = seq;
    b->last_slot = slot;
    for (uint32_t i = 0; i < b->nsubs; i++) {
        struct cipi_lsub *sub = b->subs[i];
        if (!sub->receiving || !sub->early_seen)
            continue;
        sub->early_seen = 0;
        if (on_schedule) {
            end_lease(b, sub, seq, slot); /* the producer's stream orders after its read flag */
        } else if (pairs_put(&sub->spent, seq, slot) != 0) {
            return nomem();
        }
    }
    return reported(b);
}

/* An "ahead" subscriber's RELEASE of frame seq, not published yet: 1 noted, 0 not a
 * frame to come (the caller refuses the message), or CIP_ERR_PROTOCOL's -1. */
static int
early(struct cipi_leasebook *b, struct cipi_lsub *sub, uint64_t seq, uint32_t slot)
{
    if (!b->have_last || !(seq > b->last_seq && seq - b->last_seq <= b->num_slots))
        return 0;
    uint32_t expected = (uint32_t)((b->last_slot + (seq - b->last_seq)) % b->num_slots);
    if (slot != expected) {
        cipi_fail(CIP_ERR_PROTOCOL,
                  "subscriber %llu released frame %llu (not published yet) as slot %u; the "
                  "publisher's schedule puts it in slot %u",
                  (unsigned long long)sub->id, (unsigned long long)seq, slot, expected);
        return -1;
    }
    if (pairs_find(&sub->early, seq) >= 0) {
        cipi_fail(CIP_ERR_PROTOCOL, "subscriber %llu released frame %llu twice",
                  (unsigned long long)sub->id, (unsigned long long)seq);
        return -1;
    }
    for (uint32_t i = 0; i < sub->early.len;) { /* published without it: nothing to end */
        if (sub->early.v[i].seq <= b->last_seq)
            pairs_pop(&sub->early, sub->early.v[i].seq);
        else
            i++;
    }
    if (pairs_put(&sub->early, seq, slot) != 0) {
        nomem();
        return -1;
    }
    return 1;
}

/* Subscriber sub_id's RELEASE of frame seq in slot: *out 1 the slot became free, 0 not,
 * -1 no news (ended at its read flag already, or not published yet); CIP_ERR_PROTOCOL
 * when nothing explains it. */
cip_status
cipi_leases_release(struct cipi_leasebook *b, uint64_t sub_id, uint64_t seq, long long slot,
                    int *out)
{
    *out = -1;
    struct cipi_lsub *sub = cipi_leases_sub(b, sub_id);
    if (sub == NULL)
        return cipi_fail(CIP_ERR_PROTOCOL, "release from unknown subscriber %llu",
                         (unsigned long long)sub_id);
    if (slot < 0 || slot >= b->num_slots)
        return cipi_fail(CIP_ERR_PROTOCOL,
                         "subscriber %llu released frame %llu as slot %lld, outside 0..%u",
                         (unsigned long long)sub_id, (unsigned long long)seq, slot,
                         b->num_slots - 1);
    long long held = pairs_get(&sub->leases, seq);
    if (held >= 0 && (sub->spent.len || sub->flag_only.len)) {
        if (pairs_find(&sub->spent, seq) >= 0)
            return cipi_fail(CIP_ERR_PROTOCOL, "subscriber %llu released frame %llu twice",
                             (unsigned long long)sub_id, (unsigned long long)seq);
        if (pairs_get(&sub->flag_only, seq) == slot) { /* published off the schedule */
            pairs_pop(&sub->flag_only, seq);
            if (pairs_put(&sub->spent, seq, (uint32_t)slot) != 0)
                return nomem();
            return CIP_OK; /* the lease ends at its read flag */
        }
    }
    if (held < 0) {
        held = pairs_get(&sub->due, seq);
        if (held < 0) {
            if (sub->ahead) {
                int r = early(b, sub, seq, (uint32_t)slot);
                if (r < 0)
                    return CIP_ERR_PROTOCOL;
                if (r > 0)
                    return CIP_OK;
            }
            return cipi_fail(CIP_ERR_PROTOCOL,
                             "subscriber %llu released frame %llu, which it does not hold (never "
                             "sent to it, or released already)",
                             (unsigned long long)sub_id, (unsigned long long)seq);
        }
        if (held != slot)
            return cipi_fail(CIP_ERR_PROTOCOL,
                             "subscriber %llu released frame %llu as slot %lld, but it was in "
                             "slot %lld",
                             (unsigned long long)sub_id, (unsigned long long)seq, slot, held);
        pairs_pop(&sub->due, seq); /* ended at its read flag: this message is no news */
        b->releases_due--;
        return CIP_OK;
    }
    if (held != slot)
        return cipi_fail(CIP_ERR_PROTOCOL,
                         "subscriber %llu released frame %llu as slot %lld, but it is in slot %lld",
                         (unsigned long long)sub_id, (unsigned long long)seq, slot, held);
    *out = end_lease(b, sub, seq, (uint32_t)slot);
    return reported(b);
}

/* End sub_id's lease on slot's frame at its read flag: *out 1 the slot became free, 0 not,
 * -1 kept (max_due RELEASEs due already); CIPI_ERR_LEASE_STATE if it holds none. */
cip_status
cipi_leases_settle(struct cipi_leasebook *b, uint64_t sub_id, uint32_t slot, int *out)
{
    *out = -1;
    struct cipi_lsub *sub = cipi_leases_sub(b, sub_id);
    uint64_t seq = b->seq[slot];
    if (sub == NULL || !b->has_seq[slot] || pairs_get(&sub->leases, seq) != (long long)slot)
        return cipi_fail(CIPI_ERR_LEASE_STATE, "subscriber %llu holds no lease on slot %u",
                         (unsigned long long)sub_id, slot);
    if (sub->spent.len && pairs_pop(&sub->spent, seq) >= 0) {
        *out = end_lease(b, sub, seq, slot); /* its RELEASE came already */
        return reported(b);
    }
    if (sub->flag_only.len)
        pairs_pop(&sub->flag_only, seq); /* ended at its flag: its RELEASE is due as usual */
    if (sub->due.len >= b->max_due)
        return CIP_OK;
    if (pairs_put(&sub->due, seq, slot) != 0)
        return nomem();
    b->releases_due++;
    *out = end_lease(b, sub, seq, slot);
    return reported(b);
}

/* Undo a lease that was never delivered: *out 1 the slot became free. */
cip_status
cipi_leases_cancel(struct cipi_leasebook *b, uint64_t sub_id, uint64_t seq, long long slot,
                   int *out)
{
    *out = 0;
    struct cipi_lsub *sub = cipi_leases_sub(b, sub_id);
    if (sub == NULL || slot < 0 || pairs_get(&sub->leases, seq) != slot)
        return cipi_fail(CIP_ERR_PROTOCOL, "subscriber %llu holds no lease on frame %llu in slot "
                                           "%lld",
                         (unsigned long long)sub_id, (unsigned long long)seq, slot);
    pairs_pop(&sub->leases, seq);
    if (sub->spent.len || sub->flag_only.len) {
        pairs_pop(&sub->spent, seq);
        pairs_pop(&sub->flag_only, seq);
    }
    if (sub->latest)
        latest_drop(b, (uint32_t)slot);
    ids_remove(&b->holders[slot], (uint32_t)sub_id);
    if (b->holders[slot].len)
        return CIP_OK;
    b->has_seq[slot] = 0;
    *out = b->holds[slot] == 0;
    return CIP_OK;
}

/* When sub's oldest lease began; 0 and *has 0 when it holds none. */
double
cipi_leases_oldest(const struct cipi_leasebook *b, const struct cipi_lsub *sub, int *has)
{
    *has = sub != NULL && sub->leases.len;
    return *has ? b->since[sub->leases.v[0].slot] : 0.0;
}

/* 1 when any slot's frame is leased. */
int
cipi_leases_any_leased(const struct cipi_leasebook *b)
{
    for (uint32_t s = 0; s < b->num_slots; s++)
        if (b->holders[s].len)
            return 1;
    return 0;
}

/* The subscribers (not suspended) whose oldest lease began before now - timeout, in the
 * order they were added, into ids (room for b->nsubs); *n how many. */
void
cipi_leases_overdue(const struct cipi_leasebook *b, double now, double timeout, uint32_t *ids,
                    uint32_t *n)
{
    *n = 0;
    for (uint32_t i = 0; i < b->nsubs; i++) {
        const struct cipi_lsub *sub = b->subs[i];
        int has;
        double t = cipi_leases_oldest(b, sub, &has);
        if (has && !sub->suspended && t < now - timeout)
            ids[(*n)++] = sub->id;
    }
}

/* When the first lease (of a subscriber not suspended) becomes overdue: its start plus
 * timeout, in *at; 0 when none is held. */
int
cipi_leases_next_expiry(const struct cipi_leasebook *b, double timeout, double *at)
{
    int any = 0;
    double first = 0.0;
    for (uint32_t i = 0; i < b->nsubs; i++) {
        const struct cipi_lsub *sub = b->subs[i];
        int has;
        double t = cipi_leases_oldest(b, sub, &has);
        if (has && !sub->suspended && (!any || t < first)) {
            first = t;
            any = 1;
        }
    }
    *at = first + timeout;
    return any;
}

/* One more local reference (a live producer array) to slot. */
cip_status
cipi_leases_hold(struct cipi_leasebook *b, long long slot)
{
    cip_status st = cipi_leases_check_slot(b, slot);
    if (st == CIP_OK)
        b->holds[slot]++;
    return st;
}

/* One local reference to slot fewer: *freed 1 when the slot became free. */
cip_status
cipi_leases_unhold(struct cipi_leasebook *b, long long slot, int *freed)
{
    cip_status st = cipi_leases_check_slot(b, slot);
    if (st != CIP_OK)
        return st;
    if (b->holds[slot] == 0)
        return cipi_fail(CIPI_ERR_LEASE_STATE, "unhold of slot %lld, which has no local hold",
                         slot);
    b->holds[slot]--;
    *freed = cipi_leases_is_free(b, (uint32_t)slot);
    return CIP_OK;
}

/* Settle every lease of slot's holders (every leased slot's when slot is -1) whose read
 * flag `reached` says is at its frame's generation, except those of holders with max_due
 * RELEASEs due; *ended: how many ended.  reached answers 1, 0, or -1 (then this stops and
 * returns CIPI_ERR_CALLBACK: the caller has its error). */
cip_status
cipi_leases_settle_flagged(struct cipi_leasebook *b, cipi_reached_fn reached, void *ctx,
                           long long slot, uint32_t *ended)
{
    *ended = 0;
    uint32_t first = slot < 0 ? 0 : (uint32_t)slot, last = slot < 0 ? b->num_slots : first + 1;
    for (uint32_t s = first; s < last; s++) {
        struct cipi_ids *h = &b->holders[s];
        if (h->len == 0)
            continue;
        uint32_t n = h->len, k = 0;
        uint32_t *ids = (uint32_t *)malloc(n * sizeof *ids);
        if (ids == NULL)
            return nomem();
        memcpy(ids, h->v, n * sizeof *ids);
        qsort(ids, n, sizeof *ids, cmp_u32); /* the order Python's set of small ids gives */
        for (uint32_t i = 0; i < n; i++) {
            struct cipi_lsub *sub = cipi_leases_sub(b, ids[i]);
            if (sub == NULL || sub->due.len >= b->max_due) /* gone: reached() may call back */
                continue;
            int r = reached(ctx, ids[i], s);
            if (r < 0) {
                free(ids);
                return CIPI_ERR_CALLBACK;
            }
            if (r)
                ids[k++] = ids[i];
        }
        for (uint32_t i = 0; i < k; i++) {
            int out;
            cip_status st = cipi_leases_settle(b, ids[i], s, &out);
            if (st != CIP_OK) {
                free(ids);
                return st;
            }
            *ended += out >= 0;
        }
        free(ids);
    }
    return CIP_OK;
}
