/* util.c -- clocks, deadlines, fds and growing rings (cip_internal.h says what the modules
 * share). */
#include "cip_internal.h"

/* CLOCK_MONOTONIC in nanoseconds (one clock for every process of the host). */
long long
cipi_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* `ns` nanoseconds (0 or more) as ppoll(2)'s timeout. */
struct timespec
cipi_timespec_of_ns(long long ns)
{
    return (struct timespec){(time_t)(ns / 1000000000LL), (long)(ns % 1000000000LL)};
}

/* A pidfd of `pid` (readable once it exits), or -1 where none can be had. */
int
cipi_pidfd_open(int pid)
{
    if (pid <= 0)
        return -1;
    int fd = (int)syscall(CIP_SYS_PIDFD_OPEN, pid, 0); /* close-on-exec */
    return fd < 0 ? -1 : fd;
}

/* Whether the process of `pidfd` has exited (its pidfd is readable); 0 for -1. */
int
cipi_pidfd_exited(int pidfd)
{
    if (pidfd < 0)
        return 0;
    struct pollfd p = {pidfd, POLLIN, 0};
    return poll(&p, 1, 0) > 0;
}

void
cipi_pidfd_close(int pidfd)
{
    if (pidfd >= 0)
        close(pidfd);
}

long long
cipi_now_ms(void)
{
    return cipi_now_ns() / 1000000;
}

/* Milliseconds left until `deadline` (-1: none) for poll(2). */
int
cipi_left_ms(long long deadline)
{
    if (deadline < 0)
        return -1;
    long long left = deadline - cipi_now_ms();
    if (left <= 0)
        return 0;
    return left > INT_MAX ? INT_MAX : (int)left;
}

long long
cipi_deadline_of(int timeout_ms)
{
    return timeout_ms < 0 ? -1 : cipi_now_ms() + timeout_ms;
}

/* `x` (finite) as Python's repr(float) writes it, into out (32 bytes are enough): the
 * fewest significant digits that read back as x; fixed notation for a decimal exponent in
 * -4..15 (with ".0" when whole: "5.0", "0.05", "30.0"), else "1e-05", "1.5e+16". */
void
cipi_fmt_seconds(char *out, size_t size, double x)
{
    int p = 1;
    for (; p < 17; p++) { /* %e with p significant digits */
        snprintf(out, size, "%.*e", p - 1, x);
        if (strtod(out, NULL) == x)
            break;
    }
    snprintf(out, size, "%.*e", p - 1, x);
    const char *e = strchr(out, 'e');
    int exp10 = e != NULL ? atoi(e + 1) : 0;
    if (x == 0.0 || (exp10 >= -4 && exp10 < 16)) {
        int decimals = p - 1 - exp10;
        snprintf(out, size, "%.*f", decimals > 0 ? decimals : 0, x);
        if (strchr(out, '.') == NULL && strlen(out) + 2 < size)
            strcat(out, ".0");
        return;
    }
    /* scientific: Python writes the mantissa without trailing zeros and the exponent
     * with at least two digits, as C's %e does */
}

void
cipi_sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

void
cipi_close_fds(int *fds, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (fds[i] >= 0)
            close(fds[i]);
        fds[i] = -1;
    }
}

/* The rings of this library (the book's record, the backlog of messages, the RELEASEs owed)
 * grow alike: the `len` entries of `size` bytes from `*head` of a ring of `*alloc`
 * entries at `old` are copied, in order, to the start of a new buffer of `new_alloc`
 * entries, `old` is freed, `*head` becomes 0 and `*alloc` new_alloc.  Returns the new
 * buffer, or NULL without memory (the ring kept as it was). */
void *
cipi_ring_regrow(void *old, size_t size, size_t *head, size_t len, size_t *alloc, size_t new_alloc)
{
    uint8_t *r = (uint8_t *)malloc(new_alloc * size);
    if (r == NULL)
        return NULL;
    if (len) {
        size_t first = *alloc - *head < len ? *alloc - *head : len; /* up to the ring's end */
        memcpy(r, (uint8_t *)old + *head * size, first * size);
        memcpy(r + first * size, old, (len - first) * size);
    }
    free(old);
    *head = 0;
    *alloc = new_alloc;
    return r;
}
