/* cip_publisher.h -- what the publisher side's modules share (leases.c, pub_wire.c,
 * pub_session.c, pub_poll.c, reader_rows.c, admission.c, acceptor.c, producer.c): declared
 * here, defined by the module named, of hidden visibility.  Included by cip_internal.h (at its end), never
 * on its own. */
#ifndef CIP_PUBLISHER_H
#define CIP_PUBLISHER_H

/* leases.c: the publisher's lease book (cupy_ipcpool._engine.LeaseBook) */
#define CIPI_ERR_LEASE_STATE ((cip_status)100) /* a lease the caller assumed is not there */
#define CIPI_ERR_SLOT_INDEX ((cip_status)101)  /* a slot outside the ring */
#define CIPI_ERR_CALLBACK ((cip_status)102)    /* the caller's callback failed */
#define CIPI_ERR_INTERRUPTED ((cip_status)103) /* the caller's cipi_waiting stopped a wait */
typedef int (*cipi_reached_fn)(void *ctx, uint64_t sub_id, uint32_t slot);
enum { CIPI_LEASE_BLOCK, CIPI_LEASE_LATEST, CIPI_LEASE_AHEAD };
struct cipi_pair {
    uint64_t seq;
    uint32_t slot;
};
struct cipi_pairs { /* seq -> slot, in insertion order */
    struct cipi_pair *v;
    uint32_t len, cap;
};
struct cipi_ids { /* subscriber ids, in insertion order */
    uint32_t *v;
    uint32_t len, cap;
};
struct cipi_lsub {
    uint32_t id;
    uint32_t row; /* its row of read flags in the sync page (pub_session.c); UINT32_MAX: none */
    int latest, ahead, suspended;
    int receiving, early_seen; /* cipi_leases_publishing's marks, for the frame it records */
    uint32_t credit;
    struct cipi_pairs leases;    /* oldest first */
    struct cipi_pairs due;       /* ended at the read flag, RELEASE not come yet */
    struct cipi_pairs early;     /* released before published ("ahead") */
    struct cipi_pairs flag_only; /* published off the schedule: end at the flag only */
    struct cipi_pairs spent;     /* ... whose RELEASE came already */
};
struct cipi_leasebook {
    uint32_t num_slots, max_credit, latest_reserve, max_due, latest_budget;
    uint32_t *latest_count; /* per slot: "latest" subscribers leasing it */
    uint32_t latest_slots;  /* slots with any */
    double *since;          /* per slot: when its frame was published (the caller's clock) */
    struct cipi_lsub **subs; /* in the order they were added */
    uint32_t nsubs, subs_cap;
    struct cipi_ids *holders; /* per slot: who leases its current frame ... */
    uint8_t *has_seq;
    uint64_t *seq;            /* ... which is this one */
    uint32_t *holds;          /* per slot: local holds */
    struct cipi_ids *readers; /* per slot: who released it since it was published */
    uint64_t releases_due, ended;
    int have_last;
    uint64_t last_seq;
    uint32_t last_slot;
    int oom;
};
CIP_INTERNAL uint32_t cipi_default_latest_reserve(uint32_t num_slots);
CIP_INTERNAL uint32_t cipi_default_max_due(uint32_t num_slots);
CIP_INTERNAL uint32_t cipi_default_max_credit(uint32_t num_slots);
CIP_INTERNAL uint32_t cipi_granted_credit(uint64_t asked, uint32_t max_credit);
CIP_INTERNAL cip_status cipi_leases_init(struct cipi_leasebook *b, uint32_t num_slots,
                                         long long max_credit, long long latest_reserve);
CIP_INTERNAL void cipi_leases_free(struct cipi_leasebook *b);
CIP_INTERNAL struct cipi_lsub *cipi_leases_sub(const struct cipi_leasebook *b, uint64_t sub_id);
CIP_INTERNAL cip_status cipi_leases_check_slot(const struct cipi_leasebook *b, long long slot);
CIP_INTERNAL cip_status cipi_leases_add(struct cipi_leasebook *b, uint64_t sub_id, int mode,
                                        long long credit, uint32_t *granted);
CIP_INTERNAL void cipi_leases_remove(struct cipi_leasebook *b, uint64_t sub_id, uint32_t *freed,
                                     uint32_t *nfreed);
CIP_INTERNAL void cipi_leases_suspend(struct cipi_leasebook *b, uint64_t sub_id);
CIP_INTERNAL int cipi_leases_is_free(const struct cipi_leasebook *b, uint32_t slot);
CIP_INTERNAL long cipi_leases_pick_free(const struct cipi_leasebook *b, uint64_t start);
CIP_INTERNAL cip_status cipi_leases_publishing(struct cipi_leasebook *b, uint32_t slot,
                                               uint64_t seq, double now, int on_schedule,
                                               uint32_t *receivers, uint32_t *n);
CIP_INTERNAL cip_status cipi_leases_release(struct cipi_leasebook *b, uint64_t sub_id,
                                            uint64_t seq, long long slot, int *out);
CIP_INTERNAL cip_status cipi_leases_settle(struct cipi_leasebook *b, uint64_t sub_id,
                                           uint32_t slot, int *out);
CIP_INTERNAL cip_status cipi_leases_cancel(struct cipi_leasebook *b, uint64_t sub_id, uint64_t seq,
                                           long long slot, int *out);
CIP_INTERNAL cip_status cipi_leases_hold(struct cipi_leasebook *b, long long slot);
CIP_INTERNAL cip_status cipi_leases_unhold(struct cipi_leasebook *b, long long slot, int *freed);
CIP_INTERNAL cip_status cipi_leases_settle_flagged(struct cipi_leasebook *b,
                                                   cipi_reached_fn reached, void *ctx,
                                                   long long slot, uint32_t *ended);
CIP_INTERNAL double cipi_leases_oldest(const struct cipi_leasebook *b, const struct cipi_lsub *sub,
                                       int *has);
CIP_INTERNAL int cipi_leases_any_leased(const struct cipi_leasebook *b);
CIP_INTERNAL void cipi_leases_overdue(const struct cipi_leasebook *b, double now, double timeout,
                                     uint32_t *ids, uint32_t *n);
CIP_INTERNAL int cipi_leases_next_expiry(const struct cipi_leasebook *b, double timeout,
                                         double *at);

/* pub_wire.c: the publisher's per-frame wire (under pub_session.c) */
/* Room for why a subscriber leaves ("said BYE", "protocol error: ...", an eviction's notice),
 * its end included: the wire's events, the session's departures and notices alike. */
#define CIPI_WHY_SIZE 224
struct cipi_pubevent { /* a subscriber to drop, and why */
    uint32_t sub_id;
    int err; /* the errno of a failed send or receive (EAGAIN: its socket is full), or 0 */
    char why[CIPI_WHY_SIZE];
};
struct cipi_pubwire {
    struct pollfd *set; /* the subscribers' sockets, in the order added ... */
    uint32_t *ids;      /* ... and whose each is */
    uint32_t n, cap;
    struct cipi_pubevent *events; /* the last send's or take's, cap of room */
    uint32_t nevents;
    uint32_t *receivers; /* cipi_pubwire_send's room for cipi_leases_publishing */
    uint32_t receivers_cap;
};
CIP_INTERNAL cip_status cipi_frame_payload_fits(size_t len);
CIP_INTERNAL void cipi_pubwire_free(struct cipi_pubwire *w);
CIP_INTERNAL int cipi_pubwire_fd(const struct cipi_pubwire *w, uint32_t sub_id);
CIP_INTERNAL cip_status cipi_pubwire_add(struct cipi_pubwire *w, uint32_t sub_id, int fd);
CIP_INTERNAL int cipi_pubwire_remove(struct cipi_pubwire *w, uint32_t sub_id);
CIP_INTERNAL cip_status cipi_pubwire_send(struct cipi_pubwire *w, struct cipi_leasebook *b,
                                          uint32_t slot, uint64_t seq, double now,
                                          int on_schedule, const void *payload, size_t len);
CIP_INTERNAL int cipi_pubwire_poll(struct cipi_pubwire *w, long long timeout_ns);
CIP_INTERNAL int cipi_pubwire_send_within(const struct cipi_pubwire *w, uint32_t sub_id,
                                          uint64_t seq, uint32_t slot, const void *payload,
                                          size_t len, long long timeout_ns);
CIP_INTERNAL cip_status cipi_pubwire_take(struct cipi_pubwire *w, struct cipi_leasebook *b,
                                          long limit, uint32_t *taken);

/* pub_session.c: the publisher's adopted subscribers (cupy_ipcpool._engine.PublisherSession) */
struct cipi_waiting { /* how a wait lets others run (the Python binding: the GIL) */
    void *(*release)(void);     /* before a wait; what it returns goes to reacquire */
    void (*reacquire)(void *);  /* after it */
    int (*interrupted)(void);   /* after a wait a signal ended: nonzero ends the call */
};
struct cipi_departure { /* a subscriber gone (socket closed, leases back), and why */
    uint32_t sub_id;
    char why[CIPI_WHY_SIZE];
};
struct cipi_notice { /* an evicted subscriber whose notice did not fit its socket yet */
    uint32_t sub_id;
    int fd;
    char why[CIPI_WHY_SIZE];
};
struct cipi_pubsession {
    struct cipi_pubwire wire;    /* the adopted subscribers' sockets (owned) */
    struct cipi_leasebook *book; /* not owned */
    double lease_timeout;        /* seconds a lease may last; 0: no limit */
    double send_timeout;         /* seconds a full "block" socket may stall a publish */
    double next_expiry;          /* when the oldest lease may be overdue; 0: none is held */
    uint64_t evictions;
    uint32_t since_drain;        /* frames published since the sockets were read */
    struct cipi_notice *notices; /* room for every subscriber (reserved by add) */
    uint32_t nnotices, notices_cap;
    struct cipi_departure *left; /* gone since the caller last looked (reserved by add) */
    uint32_t nleft, left_cap;
    uint64_t departures;         /* gone so far, all told */
    uint32_t *freed;             /* cipi_leases_remove's room (num_slots) */
    /* the read flags (cipi_pubsession_flags): the sync page's host mapping, where its rows
     * begin (in flags), how many rows; and the generation last published in each slot */
    const uint32_t *page;
    size_t reads_at;
    uint32_t rows;
    uint32_t *published;
    uint64_t flag_looks; /* how often a poll looked at the read flags (pub_poll.c) */
};
CIP_INTERNAL cip_status cipi_pubsession_init(struct cipi_pubsession *s, struct cipi_leasebook *b,
                                             double lease_timeout, double send_timeout);
/* Close every socket without a word (no BYE, no shutdown: copies in a forked child, whose
 * subscribers are the parent's); the session then has none. */
CIP_INTERNAL void cipi_pubsession_forget(struct cipi_pubsession *s);
CIP_INTERNAL void cipi_pubsession_free(struct cipi_pubsession *s);
CIP_INTERNAL cip_status cipi_pubsession_add(struct cipi_pubsession *s, uint32_t sub_id, int mode,
                                            long long credit, int fd);
CIP_INTERNAL int cipi_pubsession_drop(struct cipi_pubsession *s, uint32_t sub_id,
                                      const char *why, int notify);
CIP_INTERNAL void cipi_pubsession_retry_notices(struct cipi_pubsession *s);
CIP_INTERNAL cip_status cipi_pubsession_publish(struct cipi_pubsession *s, uint32_t slot,
                                                uint64_t seq, uint32_t generation,
                                                int on_schedule, const void *payload,
                                                size_t len, const struct cipi_waiting *waiting);
CIP_INTERNAL cip_status cipi_pubsession_flags(struct cipi_pubsession *s, const void *page,
                                              size_t nbytes, size_t reads_offset, uint32_t rows);
CIP_INTERNAL cip_status cipi_pubsession_set_row(struct cipi_pubsession *s, uint32_t sub_id,
                                                uint32_t row);
CIP_INTERNAL cip_status cipi_pubsession_settle(struct cipi_pubsession *s, long long slot,
                                               uint32_t *ended);
CIP_INTERNAL cip_status cipi_pubsession_take(struct cipi_pubsession *s, long long timeout_ns,
                                             long limit, const struct cipi_waiting *waiting);
CIP_INTERNAL cip_status cipi_pubsession_expire(struct cipi_pubsession *s);
CIP_INTERNAL int cipi_pubsession_close(struct cipi_pubsession *s, long long linger_ns,
                                       const struct cipi_waiting *waiting);

/* pub_poll.c: the publisher's wait for a lease to end.  While leases that end at read flags
 * are held, a wait looks at the flags after FIRST ns, each step GROWTH times the last, up to
 * every LAST ns; while an eviction notice waits for room, a wait lasts at most
 * CIPI_NOTICE_RETRY_NS before it is tried again. */
#define CIPI_SETTLE_RECHECK_FIRST_NS 20000
#define CIPI_SETTLE_RECHECK_LAST_NS 16000000
#define CIPI_SETTLE_RECHECK_GROWTH 1.25
#define CIPI_NOTICE_RETRY_NS 50000000
CIP_INTERNAL cip_status cipi_pubsession_poll(struct cipi_pubsession *s, long long timeout_ns,
                                             long long spin_ns, int settle,
                                             const struct cipi_waiting *waiting);

/* reader_rows.c: the publisher's rows of read flags, and the departed readers'. */
struct cipi_live_row {
    uint32_t sub_id, index;
    int pidfd;   /* its process's (the kernel's pid), -1: none */
    int adopted; /* it may read frames: streams may wait on its row */
};
struct cipi_departed { /* a row the publisher's streams may still wait on */
    uint32_t index;
    int pidfd;
};
struct cipi_rows {
    uint32_t max_rows, num_slots, next; /* next: where the round-robin looks first */
    uint32_t *page;                     /* the sync page's host mapping (not owned) */
    size_t reads_at;                    /* where the rows begin, in flags */
    struct cipi_live_row *live;         /* max_rows */
    uint32_t nlive;
    struct cipi_departed *departed; /* max_rows, oldest first */
    uint32_t ndeparted;
    uint32_t *values;    /* per row, the generations a departed row's flags must reach */
    uint64_t forced;     /* read flags written from the host so far */
    long long next_look; /* cipi_rows_due: CLOCK_MONOTONIC ns */
};
/* How often (ns) the departed rows are looked at, at most (cipi_rows_due). */
#define CIPI_ROWS_LOOK_EVERY_NS 10000000
CIP_INTERNAL int cipi_flag_force_to(uint32_t *flag, uint32_t value);
CIP_INTERNAL cip_status cipi_rows_init(struct cipi_rows *r, uint32_t max_rows, uint32_t num_slots,
                                       uint32_t *page, size_t nbytes, size_t reads_offset);
CIP_INTERNAL void cipi_rows_free(struct cipi_rows *r);
CIP_INTERNAL cip_status cipi_rows_assign(struct cipi_rows *r, uint32_t sub_id, int pid,
                                         uint32_t *index);
CIP_INTERNAL cip_status cipi_rows_adopt(struct cipi_rows *r, uint32_t sub_id);
CIP_INTERNAL long cipi_rows_index(const struct cipi_rows *r, uint32_t sub_id);
CIP_INTERNAL void cipi_rows_leave(struct cipi_rows *r, uint32_t sub_id, const uint32_t *published,
                                  int idle);
CIP_INTERNAL cip_status cipi_rows_drop(struct cipi_rows *r, uint32_t sub_id);
CIP_INTERNAL int cipi_rows_due(struct cipi_rows *r);
CIP_INTERNAL uint32_t cipi_rows_settle(struct cipi_rows *r, int idle);
CIP_INTERNAL void cipi_rows_close(struct cipi_rows *r, const uint32_t *published);
CIP_INTERNAL int cipi_rows_all_settled(struct cipi_rows *r);

struct cipi_admission; /* admission.c's: connections waiting, per group (pure state) */
CIP_INTERNAL cip_status cipi_admission_new(long long per_group, double timeout,
                                           struct cipi_admission **out);
CIP_INTERNAL void cipi_admission_free(struct cipi_admission *a);
CIP_INTERNAL cip_status cipi_admission_admit(struct cipi_admission *a, uint64_t key,
                                             uint64_t group, double now, uint64_t *out,
                                             size_t *nout);
CIP_INTERNAL cip_status cipi_admission_move(struct cipi_admission *a, uint64_t key,
                                            uint64_t group, uint64_t *out, size_t *nout);
CIP_INTERNAL int cipi_admission_group(const struct cipi_admission *a, uint64_t key,
                                      uint64_t *group);
CIP_INTERNAL int cipi_admission_next_to_go(const struct cipi_admission *a, uint64_t group,
                                           uint64_t *key);
CIP_INTERNAL int cipi_admission_remove(struct cipi_admission *a, uint64_t key);
CIP_INTERNAL size_t cipi_admission_expired(struct cipi_admission *a, double now, uint64_t *out);
CIP_INTERNAL int cipi_admission_next_deadline(const struct cipi_admission *a, double *at);
CIP_INTERNAL size_t cipi_admission_count(const struct cipi_admission *a, int all, uint64_t group);
CIP_INTERNAL int cipi_admission_contains(const struct cipi_admission *a, uint64_t key);

/* acceptor.c: the publisher's accept thread, admission and handshake. */
struct cipi_welcomed { /* a subscriber welcomed: pending adoption, or gone before it */
    uint32_t sub_id;
    int fd;                     /* its socket; -1 once gone */
    int pid, peer_pid;          /* pid: the kernel's, else its claim; peer_pid: the kernel's */
    uint32_t uid, mode, credit; /* credit: granted */
    uint8_t *hello;             /* its HELLO payload (malloc'd), hello_len bytes */
    uint32_t hello_len;
    long row; /* its row of read flags, -1: none */
};
struct cipi_acceptor_hooks { /* the rows of read flags (called on the accept thread) */
    void *ctx; /* assign: 0, *row is the subscriber's; 1: no row free; -1: rows gone */
    int (*assign)(void *ctx, uint32_t sub_id, int pid, uint32_t *row);
    void (*drop)(void *ctx, uint32_t sub_id); /* never adopted: its row back */
};
struct cipi_acceptor_config {
    int listener; /* listening, non-blocking: the acceptor's from init on */
    uint32_t num_slots, max_subscribers, max_credit, lease_timeout_ms, per_uid;
    long long handshake_ns;
    const uint32_t *uids; /* allowed */
    size_t nuids;
    const uint8_t *payload; /* the WELCOME payload (copied) */
    size_t payload_len;
    long row_at;         /* where the row goes in it (4 bytes LE), -1: no rows */
    const int *fds;      /* sent with every WELCOME (duplicated) */
    size_t nfds;
    const char *refuse[3]; /* by mode: the REFUSE reason, NULL: served */
    struct cipi_acceptor_hooks hooks;
};
/* acceptor.c's own state (the others go through the functions below) */
struct cipi_handshake { /* a connection accepted, its HELLO not yet read */
    int fd;
    uint64_t key; /* unique for the acceptor's lifetime: names it, not its fd */
    uint32_t uid;
    int pid;
};
struct cipi_acceptor {
    /* set at init */
    int listener, wake;
    uint32_t num_slots, max_subscribers, max_credit, lease_timeout_ms, per_uid;
    long long handshake_ns;
    uint32_t *uids;
    size_t nuids;
    uint8_t *payload;
    size_t payload_len;
    long row_at;
    int *fds;
    size_t nfds;
    char *refuse[3];
    struct cipi_acceptor_hooks hooks;
    pthread_t thread;
    pid_t owner; /* the process that started the thread (a forked child has no such thread) */
    int started, lock_made;
    int forked; /* stopped in a child forked while the thread ran: its locks are not touched */
    /* the thread's; hs and adm change under lock too (cipi_acceptor_handshakes reads them) */
    struct cipi_handshake *hs; /* the connections whose HELLO is awaited, by key */
    size_t nhs, hs_cap;
    struct cipi_admission *adm; /* their deadlines and the cap per uid (admission.c) */
    uint64_t *gone;             /* per_uid keys: those that go to make room */
    uint64_t *keys;             /* hs_cap keys: those whose deadline passed */
    uint64_t next_key;
    uint32_t next_id;
    long long backoff_until;
    char failure[160]; /* why the thread ended early; "" */
    /* under lock */
    pthread_mutex_t lock;
    struct cipi_welcomed *pending, *abandoned;
    size_t npending, pending_cap, nabandoned, abandoned_cap;
    uint32_t count; /* welcomed and not yet dropped: pending and adopted */
    int stopping;
    /* atomics */
    int news;          /* pending or abandoned are not empty */
    uint64_t next_seq; /* the next frame's seq (the producer's), told in each WELCOME */
    uint64_t welcomed; /* subscribers given an id */
};
CIP_INTERNAL cip_status cipi_acceptor_new(const struct cipi_acceptor_config *cfg,
                                          struct cipi_acceptor **out);
CIP_INTERNAL cip_status cipi_acceptor_start(struct cipi_acceptor *a);
CIP_INTERNAL void cipi_acceptor_take(struct cipi_acceptor *a, struct cipi_welcomed **pending,
                                     size_t *npending, struct cipi_welcomed **gone,
                                     size_t *ngone);
CIP_INTERNAL void cipi_acceptor_dropped(struct cipi_acceptor *a);
CIP_INTERNAL size_t cipi_acceptor_handshakes(struct cipi_acceptor *a, long long uid);
CIP_INTERNAL int cipi_acceptor_news(struct cipi_acceptor *a);
CIP_INTERNAL uint64_t cipi_acceptor_next_seq(struct cipi_acceptor *a);
CIP_INTERNAL void cipi_acceptor_set_next_seq(struct cipi_acceptor *a, uint64_t seq);
CIP_INTERNAL uint64_t cipi_acceptor_welcomed(struct cipi_acceptor *a);
CIP_INTERNAL const char *cipi_acceptor_failure(struct cipi_acceptor *a);
CIP_INTERNAL void cipi_acceptor_stop(struct cipi_acceptor *a);
/* In a child just forked (its at-fork handler): close this process's copy of the listening
 * socket, so that it never keeps the parent's path live. */
CIP_INTERNAL void cipi_acceptor_close_listener(struct cipi_acceptor *a);
CIP_INTERNAL void cipi_acceptor_free_list(struct cipi_welcomed *list, size_t n);
CIP_INTERNAL void cipi_acceptor_free(struct cipi_acceptor *a);

/* producer.c: the producer's calls over its accept thread and its session */
struct cipi_producer {
    struct cipi_pubsession *s; /* the adopted subscribers (not owned) */
    struct cipi_acceptor *acc; /* the accept thread (not owned) */
    uint32_t last_slot;        /* the slot last published: the pick of a free one starts after */
    uint64_t reported;         /* the lease book's `ended` as of the last poll's answer */
    uint64_t departed;         /* the session's departures told to the acceptor */
    struct cipi_welcomed *joined, *gone; /* adopted, and gone before adoption: not yet taken */
    size_t njoined, ngone;
    struct cipi_welcomed *known; /* the adopted until they leave (fd -1, HELLO kept) */
    size_t nknown, known_cap;
};
CIP_INTERNAL void cipi_producer_init(struct cipi_producer *p, struct cipi_pubsession *s,
                                     struct cipi_acceptor *acc);
CIP_INTERNAL void cipi_producer_free(struct cipi_producer *p);
CIP_INTERNAL cip_status cipi_producer_poll(struct cipi_producer *p, long long timeout_ns,
                                           long long spin_ns, int settle,
                                           const struct cipi_waiting *waiting,
                                           uint64_t *returned);
CIP_INTERNAL cip_status cipi_producer_acquire(struct cipi_producer *p, long long timeout_ns,
                                              const struct cipi_waiting *waiting, uint32_t *slot);
CIP_INTERNAL cip_status cipi_producer_publish(struct cipi_producer *p, uint32_t slot,
                                              uint32_t generation, int on_schedule,
                                              const void *payload, size_t len,
                                              const struct cipi_waiting *waiting,
                                              uint64_t *seq);
CIP_INTERNAL int cipi_producer_has_news(const struct cipi_producer *p);
CIP_INTERNAL void cipi_producer_take_news(struct cipi_producer *p, struct cipi_welcomed **joined,
                                          size_t *njoined, struct cipi_welcomed **gone,
                                          size_t *ngone);
CIP_INTERNAL void cipi_producer_stop(struct cipi_producer *p);
/* publisher.c: a publisher's options (cip_pub_options; the callbacks are not looked at),
 * the one check of them: CIP_OK, or CIP_ERR_INVALID_ARGUMENT saying which and why. */
CIP_INTERNAL cip_status cipi_pub_check_options(const cip_pub_options *o);
/* The record of an adopted subscriber still on the wire (or left, not yet told); NULL. */
CIP_INTERNAL const struct cipi_welcomed *cipi_producer_known(const struct cipi_producer *p,
                                                            uint32_t sub_id);
/* The record of the session's departure i (i < s->nleft), moved out to *out (the caller
 * frees its HELLO): 1; 0: not adopted with a record (one joined at close), only its sub_id
 * set.  The caller empties s->left when it has taken every one. */
CIP_INTERNAL int cipi_producer_leaver(struct cipi_producer *p, uint32_t i,
                                      struct cipi_welcomed *out);

#endif /* CIP_PUBLISHER_H */
