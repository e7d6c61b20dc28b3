/* forked.c -- what a child forked while channel ends are open closes at the fork: each end
 * registered (cipi_fork_watch) has its callback run in the child, which closes the child's
 * copies of the fds that would otherwise hide the parent's death (a subscriber's socket, a
 * publisher's listener).  The list is under `watched_lock`, which the fork's prepare handler
 * holds across the fork, so the child sees a whole list; a callback only closes ints its end
 * set at open. */
#include "cip_internal.h"

struct watched_end {
    void *end;
    void (*in_child)(void *end);
};

static pthread_mutex_t watched_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t watched_once = PTHREAD_ONCE_INIT;
static struct watched_end *watched;
static size_t nwatched, watched_cap;

static void
before_fork(void)
{
    pthread_mutex_lock(&watched_lock);
}

static void
after_fork_in_parent(void)
{
    pthread_mutex_unlock(&watched_lock);
}

static void
after_fork_in_child(void)
{
    for (size_t i = 0; i < nwatched; i++)
        watched[i].in_child(watched[i].end);
    pthread_mutex_unlock(&watched_lock);
}

static void
install_fork_handlers(void)
{
    (void)pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
}

void
cipi_fork_watch(void *end, void (*in_child)(void *end))
{
    pthread_once(&watched_once, install_fork_handlers);
    pthread_mutex_lock(&watched_lock);
    if (nwatched == watched_cap) {
        size_t cap = watched_cap ? 2 * watched_cap : 8;
        struct watched_end *grown = realloc(watched, cap * sizeof *grown);
        if (grown != NULL) {
            watched = grown;
            watched_cap = cap;
        }
    }
    if (nwatched < watched_cap) /* (out of memory: a child's copies stay until it exits) */
        watched[nwatched++] = (struct watched_end){end, in_child};
    pthread_mutex_unlock(&watched_lock);
}

void
cipi_fork_unwatch(void *end)
{
    pthread_mutex_lock(&watched_lock);
    for (size_t i = 0; i < nwatched; i++)
        if (watched[i].end == end) {
            watched[i] = watched[--nwatched];
            break;
        }
    pthread_mutex_unlock(&watched_lock);
}
