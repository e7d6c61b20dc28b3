/*
 * cip_leases_probe -- the publisher's lease book (c/src/leases.c) driven line by line from
 * stdin, for tests/test_c_library.py: the same operations the Python publisher makes
 * through cupy_ipcpool._engine.LeaseCore, here in a plain C program, so that the
 * sanitizer lane (CUPY_IPCPOOL_C_SANITIZE) runs the book's code under AddressSanitizer
 * and UndefinedBehaviorSanitizer.  One answer line per command:
 *
 *   new N MAX_CREDIT LATEST_RESERVE   -> ok | err STATUS MESSAGE   (-1: the default)
 *   add ID MODE CREDIT                -> ok GRANTED | err ...      (MODE 0 block 1 latest 2 ahead)
 *   remove ID                         -> ok FREED...
 *   suspend ID                        -> ok
 *   hold SLOT / unhold SLOT           -> ok [FREED] | err ...
 *   pub SLOT SEQ NOW ON_SCHEDULE      -> ok RECEIVERS... | err ...
 *   release ID SEQ SLOT               -> ok 1|0|-1 | err ...
 *   settle ID SLOT                    -> ok 1|0|-1 | err ...
 *   cancel ID SEQ SLOT                -> ok 1|0 | err ...
 *   flagged SLOT ID:S...              -> ok ENDED   (SLOT -1: every slot; reached: the pairs)
 *   state                             -> ok DUE ENDED LATEST_SLOTS then per slot
 *                                        holders(sorted)/holds/readers(sorted)
 *
 * and the publisher's session over the book (c/src/pub_session.c, over c/src/pub_wire.c),
 * on fds the test passes in, which it owns:
 *
 *   snew LEASE_TIMEOUT SEND_TIMEOUT   -> ok | err ...               (seconds; 0: no limit)
 *   sadd ID MODE CREDIT FD            -> ok | err ...
 *   spub SLOT SEQ ON_SCHEDULE LEN     -> ok [ID/WHY;]... | err ...  (those that left)
 *   stake TIMEOUT_US LIMIT            -> ok [ID/WHY;]... | err ...
 *   sdrop ID NOTIFY WHY               -> ok [ID/WHY;]...
 *   sretry / sexpire                  -> ok [ID/WHY;]... | err ...
 *   sstate                            -> ok COUNT NOTICING EVICTIONS
 *   sclose LINGER_MS                  -> ok ALL_GONE
 *   fmt SECONDS                       -> ok TEXT   (how the session's messages write it)
 *   spage ROWS                        -> ok | err ...   (a zeroed page of ROWS rows of read
 *                                        flags, from byte 0, that the session reads)
 *   sflag ROW SLOT VALUE              -> ok             (a subscriber's read flag written)
 *   srow ID ROW                       -> ok | err ...
 *   ssettle SLOT                      -> ok ENDED | err ...   (SLOT -1: every slot)
 *   spoll TIMEOUT_US SPIN_NS SETTLE   -> ok [ID/WHY;]... | err ...  (c/src/pub_poll.c)
 *
 * and the publisher's rows of read flags (c/src/reader_rows.c), over a page of their own
 * (G...: one generation per slot):
 *
 *   rnew SLOTS ROWS                   -> ok | err ...   (a zeroed page)
 *   rassign ID PID                    -> ok INDEX | ok none | err ...
 *   radopt ID                         -> ok | err ...
 *   rleave ID IDLE G...               -> ok
 *   rsettle IDLE                      -> ok LEFT
 *   rclose G...                       -> ok
 *   rall                              -> ok 0|1
 *   rflag ROW SLOT VALUE              -> ok
 *   rstate                            -> ok LIVE DEPARTED FORCED then each row's flags
 *   quit
 */
#include "../src/cip_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void answer(cip_status st);

static struct cipi_rows rows;
static int rows_made;
static uint32_t *rows_page, rows_published[CIP_WIRE_MAX_SLOTS];

/* G...: one generation per slot of the rows, into rows_published; 0 if too few */
static int
parse_generations(const char *p)
{
    for (uint32_t s = 0; s < rows.num_slots; s++) {
        char *end;
        unsigned long long v = strtoull(p, &end, 10);
        if (end == p)
            return 0;
        rows_published[s] = (uint32_t)v;
        p = end;
    }
    return 1;
}

/* The rows' commands (r...); 0 when `cmd` is not one of them. */
static int
rows_command(const char *cmd, const char *rest)
{
    long long a = 0, b = 0, c = 0;
    int used = 0;
    cip_status st;
    if (!strcmp(cmd, "rnew") && sscanf(rest, "%lld %lld", &a, &b) == 2) {
        if (rows_made)
            cipi_rows_free(&rows);
        free(rows_page);
        size_t words = (size_t)(a > 0 ? a : 1) * (size_t)(b > 0 ? b : 1);
        rows_page = (uint32_t *)calloc(words, sizeof *rows_page);
        st = cipi_rows_init(&rows, (uint32_t)b, (uint32_t)a, rows_page, words * 4, 0);
        rows_made = st == CIP_OK;
        if (st == CIP_OK)
            printf("ok\n");
        answer(st);
    } else if (!rows_made) {
        static const char *const names[] = {"rassign", "radopt", "rleave", "rsettle",
                                            "rclose",  "rall",   "rflag",  "rstate"};
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
            if (!strcmp(cmd, names[i])) {
                printf("err -1 no rows\n");
                return 1;
            }
        return 0;
    } else if (!strcmp(cmd, "rassign") && sscanf(rest, "%lld %lld", &a, &b) == 2) {
        uint32_t index;
        st = cipi_rows_assign(&rows, (uint32_t)a, (int)b, &index);
        if (st == CIP_OK)
            printf("ok %u\n", index);
        else if (st == CIP_ERR_PROTOCOL)
            printf("ok none\n");
        else
            answer(st);
    } else if (!strcmp(cmd, "radopt") && sscanf(rest, "%lld", &a) == 1) {
        st = cipi_rows_adopt(&rows, (uint32_t)a);
        if (st == CIP_OK)
            printf("ok\n");
        answer(st);
    } else if (!strcmp(cmd, "rleave") && sscanf(rest, "%lld %lld %n", &a, &b, &used) == 2 &&
               parse_generations(rest + used)) {
        cipi_rows_leave(&rows, (uint32_t)a, rows_published, (int)b);
        printf("ok\n");
    } else if (!strcmp(cmd, "rsettle") && sscanf(rest, "%lld", &a) == 1) {
        printf("ok %u\n", cipi_rows_settle(&rows, (int)a));
    } else if (!strcmp(cmd, "rclose") && parse_generations(rest)) {
        cipi_rows_close(&rows, rows_published);
        printf("ok\n");
    } else if (!strcmp(cmd, "rall")) {
        printf("ok %d\n", cipi_rows_all_settled(&rows));
    } else if (!strcmp(cmd, "rflag") && sscanf(rest, "%lld %lld %lld", &a, &b, &c) == 3) {
        rows_page[(size_t)a * rows.num_slots + (size_t)b] = (uint32_t)c;
        printf("ok\n");
    } else if (!strcmp(cmd, "rstate")) {
        printf("ok %u %u %llu", rows.nlive, rows.ndeparted, (unsigned long long)rows.forced);
        for (uint32_t r = 0; r < rows.max_rows; r++)
            for (uint32_t s = 0; s < rows.num_slots; s++)
                printf(s ? ",%u" : " %u", rows_page[(size_t)r * rows.num_slots + s]);
        printf("\n");
    } else {
        return 0;
    }
    return 1;
}

static struct cipi_leasebook book;
static struct cipi_pubsession session;
static int made, session_made;
static uint32_t *page; /* spage's */

/* those that left since the last answer, then the end of the line */
static void
print_left(void)
{
    for (uint32_t i = 0; i < session.nleft; i++)
        printf(" %u/%s;", session.left[i].sub_id, session.left[i].why);
    session.nleft = 0;
    printf("\n");
}

struct reached {
    size_t n;
    unsigned long long id[256];
    unsigned slot[256];
};

static int
reached(void *ctx, uint64_t sub_id, uint32_t slot)
{
    const struct reached *r = (const struct reached *)ctx;
    for (size_t i = 0; i < r->n; i++)
        if (r->id[i] == sub_id && r->slot[i] == slot)
            return 1;
    return 0;
}

static int
cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static void
print_sorted(const struct cipi_ids *s)
{
    uint32_t v[256];
    uint32_t n = s->len < 256 ? s->len : 256;
    if (n) { /* an empty set has no array yet */
        memcpy(v, s->v, n * sizeof v[0]);
        qsort(v, n, sizeof v[0], cmp_u32);
    }
    printf("[");
    for (uint32_t i = 0; i < n; i++)
        printf(i ? ",%u" : "%u", v[i]);
    printf("]");
}

static int
is_session_command(const char *cmd)
{
    static const char *const names[] = {"sadd",   "spub",   "stake", "sdrop", "sretry",
                                        "sexpire", "sstate", "sclose", "spage", "sflag",
                                        "srow",   "ssettle", "spoll"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(cmd, names[i]))
            return 1;
    return 0;
}

static void
answer(cip_status st)
{
    if (st != CIP_OK)
        printf("err %d %s\n", (int)st, cip_last_error());
}

int
main(void)
{
    char line[8192];
    setvbuf(stdout, NULL, _IOLBF, 0);
    while (fgets(line, sizeof line, stdin) != NULL) {
        line[strcspn(line, "\n")] = 0;
        char cmd[32] = "";
        int used = 0;
        if (sscanf(line, "%31s%n", cmd, &used) != 1)
            continue;
        const char *rest = line + used;
        long long a = 0, b = 0, c = 0, d = 0, ms = 0;
        double now = 0.0, secs = 0.0;
        int out = 0;
        cip_status st;
        if (!strcmp(cmd, "quit")) {
            break;
        } else if (rows_command(cmd, rest)) {
            continue;
        } else if (!strcmp(cmd, "fmt") && sscanf(rest, "%lf", &now) == 1) {
            char text[32];
            cipi_fmt_seconds(text, sizeof text, now);
            printf("ok %s\n", text);
        } else if (!strcmp(cmd, "new") && sscanf(rest, "%lld %lld %lld", &a, &b, &c) == 3) {
            if (session_made) /* it reads and writes the book */
                cipi_pubsession_free(&session);
            session_made = 0;
            if (made)
                cipi_leases_free(&book);
            st = cipi_leases_init(&book, (uint32_t)a, b, c);
            made = st == CIP_OK;
            if (st == CIP_OK)
                printf("ok\n");
            answer(st);
        } else if (!made) {
            printf("err -1 no book\n");
        } else if (!strcmp(cmd, "add") && sscanf(rest, "%lld %lld %lld", &a, &b, &c) == 3) {
            uint32_t granted = 0;
            st = cipi_leases_add(&book, (uint64_t)a, (int)b, c, &granted);
            if (st == CIP_OK)
                printf("ok %u\n", granted);
            answer(st);
        } else if (!strcmp(cmd, "remove") && sscanf(rest, "%lld", &a) == 1) {
            uint32_t *freed = (uint32_t *)malloc(book.num_slots * sizeof *freed), n = 0;
            cipi_leases_remove(&book, (uint64_t)a, freed, &n);
            printf("ok");
            for (uint32_t i = 0; i < n; i++)
                printf(" %u", freed[i]);
            printf("\n");
            free(freed);
        } else if (!strcmp(cmd, "suspend") && sscanf(rest, "%lld", &a) == 1) {
            cipi_leases_suspend(&book, (uint64_t)a);
            printf("ok\n");
        } else if (!strcmp(cmd, "hold") && sscanf(rest, "%lld", &a) == 1) {
            st = cipi_leases_hold(&book, a);
            if (st == CIP_OK)
                printf("ok\n");
            answer(st);
        } else if (!strcmp(cmd, "unhold") && sscanf(rest, "%lld", &a) == 1) {
            st = cipi_leases_unhold(&book, a, &out);
            if (st == CIP_OK)
                printf("ok %d\n", out);
            answer(st);
        } else if (!strcmp(cmd, "pub") &&
                   sscanf(rest, "%lld %lld %lf %lld", &a, &b, &now, &d) == 4) {
            st = cipi_leases_check_slot(&book, a);
            uint32_t *receivers = (uint32_t *)malloc((book.nsubs + 1) * sizeof *receivers);
            uint32_t n = 0;
            if (st == CIP_OK)
                st = cipi_leases_publishing(&book, (uint32_t)a, (uint64_t)b, now, (int)d,
                                            receivers, &n);
            if (st == CIP_OK) {
                printf("ok");
                for (uint32_t i = 0; i < n; i++)
                    printf(" %u", receivers[i]);
                printf("\n");
            }
            answer(st);
            free(receivers);
        } else if (!strcmp(cmd, "release") && sscanf(rest, "%lld %lld %lld", &a, &b, &c) == 3) {
            st = cipi_leases_release(&book, (uint64_t)a, (uint64_t)b, c, &out);
            if (st == CIP_OK)
                printf("ok %d\n", out);
            answer(st);
        } else if (!strcmp(cmd, "settle") && sscanf(rest, "%lld %lld", &a, &b) == 2) {
            st = cipi_leases_settle(&book, (uint64_t)a, (uint32_t)b, &out);
            if (st == CIP_OK)
                printf("ok %d\n", out);
            answer(st);
        } else if (!strcmp(cmd, "cancel") && sscanf(rest, "%lld %lld %lld", &a, &b, &c) == 3) {
            st = cipi_leases_cancel(&book, (uint64_t)a, (uint64_t)b, c, &out);
            if (st == CIP_OK)
                printf("ok %d\n", out);
            answer(st);
        } else if (!strcmp(cmd, "flagged") && sscanf(rest, "%lld%n", &a, &used) == 1) {
            struct reached r = {0};
            const char *p = rest + used;
            int k = 0;
            while (r.n < 256 && sscanf(p, " %llu:%u%n", &r.id[r.n], &r.slot[r.n], &k) == 2) {
                r.n++;
                p += k;
            }
            uint32_t ended = 0;
            st = cipi_leases_settle_flagged(&book, reached, &r, a, &ended);
            if (st == CIP_OK)
                printf("ok %u\n", ended);
            answer(st);
        } else if (!strcmp(cmd, "snew") && sscanf(rest, "%lf %lf", &now, &secs) == 2) {
            if (session_made)
                cipi_pubsession_free(&session);
            st = cipi_pubsession_init(&session, &book, now, secs);
            session_made = st == CIP_OK;
            if (st == CIP_OK)
                printf("ok\n");
            answer(st);
        } else if (!session_made && is_session_command(cmd)) {
            printf("err -1 no session\n");
        } else if (!strcmp(cmd, "sadd") &&
                   sscanf(rest, "%lld %lld %lld %lld", &a, &b, &c, &d) == 4) {
            st = cipi_pubsession_add(&session, (uint32_t)a, (int)b, c, (int)d);
            if (st == CIP_OK)
                printf("ok\n");
            answer(st);
        } else if (!strcmp(cmd, "spub") &&
                   sscanf(rest, "%lld %lld %lld %lld", &a, &b, &d, &c) == 4) {
            uint8_t *payload = (uint8_t *)malloc(c > 0 ? (size_t)c : 1);
            for (long long i = 0; i < c; i++)
                payload[i] = (uint8_t)((b + i) & 0xFF);
            st = cipi_leases_check_slot(&book, a);
            if (st == CIP_OK)
                st = cipi_pubsession_publish(&session, (uint32_t)a, (uint64_t)b, (uint32_t)b,
                                             (int)d, payload, (size_t)c, NULL);
            if (st == CIP_OK) {
                printf("ok");
                print_left();
            }
            answer(st);
            free(payload);
        } else if (!strcmp(cmd, "stake") && sscanf(rest, "%lld %lld", &a, &b) == 2) {
            st = cipi_pubsession_take(&session, a < 0 ? -1 : a * 1000, (long)b, NULL);
            if (st == CIP_OK) {
                printf("ok");
                print_left();
            }
            answer(st);
        } else if (!strcmp(cmd, "spoll") && sscanf(rest, "%lld %lld %lld", &a, &b, &c) == 3) {
            st = cipi_pubsession_poll(&session, a < 0 ? -1 : a * 1000, b, (int)c, NULL);
            if (st == CIP_OK) {
                printf("ok");
                print_left();
            }
            answer(st);
        } else if (!strcmp(cmd, "sdrop") && sscanf(rest, "%lld %lld %n", &a, &b, &used) == 2) {
            cipi_pubsession_drop(&session, (uint32_t)a, rest + used, (int)b);
            printf("ok");
            print_left();
        } else if (!strcmp(cmd, "sretry")) {
            cipi_pubsession_retry_notices(&session);
            printf("ok");
            print_left();
        } else if (!strcmp(cmd, "sexpire")) {
            st = cipi_pubsession_expire(&session);
            if (st == CIP_OK) {
                printf("ok");
                print_left();
            }
            answer(st);
        } else if (!strcmp(cmd, "spage") && sscanf(rest, "%lld", &a) == 1) {
            size_t words = (size_t)(a > 0 ? a : 0) * book.num_slots;
            free(page);
            page = (uint32_t *)calloc(words ? words : 1, sizeof *page);
            st = cipi_pubsession_flags(&session, page, words * sizeof *page, 0, (uint32_t)a);
            if (st == CIP_OK)
                printf("ok\n");
            answer(st);
        } else if (!strcmp(cmd, "sflag") && sscanf(rest, "%lld %lld %lld", &a, &b, &c) == 3) {
            page[(size_t)a * book.num_slots + (size_t)b] = (uint32_t)c;
            printf("ok\n");
        } else if (!strcmp(cmd, "srow") && sscanf(rest, "%lld %lld", &a, &b) == 2) {
            st = cipi_pubsession_set_row(&session, (uint32_t)a, (uint32_t)b);
            if (st == CIP_OK)
                printf("ok\n");
            answer(st);
        } else if (!strcmp(cmd, "ssettle") && sscanf(rest, "%lld", &a) == 1) {
            uint32_t ended = 0;
            st = cipi_pubsession_settle(&session, a, &ended);
            if (st == CIP_OK)
                printf("ok %u\n", ended);
            answer(st);
        } else if (!strcmp(cmd, "sstate")) {
            printf("ok %u %u %llu\n", session.wire.n, session.nnotices,
                   (unsigned long long)session.evictions);
        } else if (!strcmp(cmd, "sclose") && sscanf(rest, "%lld", &ms) == 1) {
            printf("ok %d\n", cipi_pubsession_close(&session, ms * 1000000LL, NULL));
        } else if (!strcmp(cmd, "state")) {
            printf("ok %llu %llu %u", (unsigned long long)book.releases_due,
                   (unsigned long long)book.ended, book.latest_slots);
            for (uint32_t s = 0; s < book.num_slots; s++) {
                printf(" ");
                print_sorted(&book.holders[s]);
                printf("/%u/", book.holds[s]);
                print_sorted(&book.readers[s]);
            }
            printf("\n");
        } else {
            printf("err -1 unknown command: %s\n", line);
        }
    }
    if (session_made)
        cipi_pubsession_free(&session);
    free(page);
    if (rows_made)
        cipi_rows_free(&rows);
    free(rows_page);
    if (made)
        cipi_leases_free(&book);
    return 0;
}
