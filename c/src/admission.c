/* admission.c -- connections waiting for something (a handshake, a request), per group, each
 * with one deadline: pure state, no I/O, no clock (the caller passes `now`, in seconds).
 *
 * A group is whatever must not crowd out the others: the peer's uid for local sockets (the
 * publisher's accept thread, acceptor.c, and the fd server), a source address and handshake
 * stage for the remote server.  At most `per_group` keys of one group wait at once: one more
 * makes the one longest in that group go, so an idle or hostile client of one group never
 * keeps out a client of another, and keeps out a fresh one of its own only while it is
 * slower than the idle ones.  A key keeps its deadline from admission when it moves to
 * another group; it is then the newest of that group.  The keys are kept in admission order
 * (so their deadlines increase along it: one timeout, and moves keep the deadline). */
#include "cip_internal.h"

struct cipi_admitted {
    uint64_t key, group;
    double deadline;
    uint64_t since; /* when it came into its group: the longest in a group goes first */
    int parked;     /* moving: in no group */
};
struct cipi_admission {
    uint32_t per_group;
    double timeout;
    struct cipi_admitted *e; /* in admission order: deadlines increase along it */
    size_t n, cap;
    uint64_t next_since;
};

/* A new book of `per_group` keys at most per group, each given `timeout` s, into *out. */
cip_status
cipi_admission_new(long long per_group, double timeout, struct cipi_admission **out)
{
    if (per_group < 1 || per_group > UINT32_MAX)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "per_uid must be at least 1, not %lld",
                         per_group);
    if (!(timeout > 0))
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "timeout must be positive, not %g", timeout);
    struct cipi_admission *a = calloc(1, sizeof *a);
    if (a == NULL)
        return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
    a->per_group = (uint32_t)per_group;
    a->timeout = timeout;
    *out = a;
    return CIP_OK;
}

void
cipi_admission_free(struct cipi_admission *a)
{
    if (a == NULL)
        return;
    free(a->e);
    free(a);
}

static long
at(const struct cipi_admission *a, uint64_t key)
{
    for (size_t i = 0; i < a->n; i++)
        if (a->e[i].key == key)
            return (long)i;
    return -1;
}

int
cipi_admission_contains(const struct cipi_admission *a, uint64_t key)
{
    return at(a, key) >= 0;
}

static void
forget(struct cipi_admission *a, size_t i)
{
    memmove(&a->e[i], &a->e[i + 1], (a->n - i - 1) * sizeof *a->e);
    a->n--;
}

size_t
cipi_admission_count(const struct cipi_admission *a, int all, uint64_t group)
{
    if (all)
        return a->n;
    size_t n = 0;
    for (size_t i = 0; i < a->n; i++)
        n += a->e[i].group == group && !a->e[i].parked;
    return n;
}

/* The key of `group` that has been in it longest, or -1 (index into a->e). */
static long
longest_in(const struct cipi_admission *a, uint64_t group)
{
    long best = -1;
    for (size_t i = 0; i < a->n; i++)
        if (a->e[i].group == group && !a->e[i].parked &&
            (best < 0 || a->e[i].since < a->e[best].since))
            best = (long)i;
    return best;
}

int
cipi_admission_next_to_go(const struct cipi_admission *a, uint64_t group, uint64_t *key)
{
    if (cipi_admission_count(a, 0, group) < a->per_group)
        return 0;
    *key = a->e[longest_in(a, group)].key;
    return 1;
}

/* Make room in `group` for one more: the keys that go, longest in it first, into out (at
 * most per_group of them). */
static size_t
make_room(struct cipi_admission *a, uint64_t group, uint64_t *out)
{
    size_t n = 0;
    while (cipi_admission_count(a, 0, group) >= a->per_group) {
        long i = longest_in(a, group);
        out[n++] = a->e[i].key;
        forget(a, (size_t)i);
    }
    return n;
}

cip_status
cipi_admission_admit(struct cipi_admission *a, uint64_t key, uint64_t group, double now,
                     uint64_t *out, size_t *nout)
{
    *nout = 0;
    if (at(a, key) >= 0)
        return cipi_fail(CIP_ERR_INVALID_ARGUMENT, "%llu is already admitted",
                         (unsigned long long)key);
    if (a->n == a->cap) {
        size_t grown = a->cap ? 2 * a->cap : 16;
        void *p = realloc(a->e, grown * sizeof *a->e);
        if (p == NULL)
            return cipi_fail(CIP_ERR_NO_MEMORY, "out of memory");
        a->e = p;
        a->cap = grown;
    }
    *nout = make_room(a, group, out);
    a->e[a->n++] = (struct cipi_admitted){key, group, now + a->timeout, a->next_since++, 0};
    return CIP_OK;
}

cip_status
cipi_admission_move(struct cipi_admission *a, uint64_t key, uint64_t group, uint64_t *out,
                    size_t *nout)
{
    *nout = 0;
    long i = at(a, key);
    if (i < 0)
        return cipi_fail(CIP_ERR_NOT_HELD, "%llu is not admitted", (unsigned long long)key);
    a->e[i].parked = 1; /* in no group while room is made (not counted against itself) */
    *nout = make_room(a, group, out);
    i = at(a, key); /* (make_room may have moved it down) */
    a->e[i] = (struct cipi_admitted){key, group, a->e[i].deadline, a->next_since++, 0};
    return CIP_OK;
}

int
cipi_admission_group(const struct cipi_admission *a, uint64_t key, uint64_t *group)
{
    long i = at(a, key);
    if (i < 0)
        return 0;
    *group = a->e[i].group;
    return 1;
}

int
cipi_admission_remove(struct cipi_admission *a, uint64_t key)
{
    long i = at(a, key);
    if (i < 0)
        return 0;
    forget(a, (size_t)i);
    return 1;
}

/* Remove the keys whose deadline has passed at `now` (oldest first) into out (at most
 * cipi_admission_count(a, 1, 0) of them); how many. */
size_t
cipi_admission_expired(struct cipi_admission *a, double now, uint64_t *out)
{
    size_t n = 0;
    while (n < a->n && a->e[n].deadline <= now) {
        out[n] = a->e[n].key;
        n++;
    }
    if (n > 0) {
        memmove(a->e, a->e + n, (a->n - n) * sizeof *a->e);
        a->n -= n;
    }
    return n;
}

int
cipi_admission_next_deadline(const struct cipi_admission *a, double *deadline)
{
    if (a->n == 0)
        return 0;
    *deadline = a->e[0].deadline;
    return 1;
}
