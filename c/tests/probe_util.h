/*
 * What the C test programs (cip_probe.c, gpu_consumer.c) both need: hex arguments
 * back to bytes, and the count of this process's open fds.  Each program includes
 * this header once; it is no part of the library.
 */
#ifndef CIP_PROBE_UTIL_H
#define CIP_PROBE_UTIL_H

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* The bytes of the hex string `s` into `out` (at most `cap`); their number returned. */
static __attribute__((unused)) size_t
unhex(const char *s, uint8_t *out, size_t cap)
{
    size_t n = strlen(s) / 2;
    if (n > cap)
        n = cap;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        sscanf(s + 2 * i, "%2x", &v);
        out[i] = (uint8_t)v;
    }
    return n;
}

/* The open fds of this process (/proc/self/fd, less the directory's own fd). */
static __attribute__((unused)) int
count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return n - 1; /* the directory's own fd */
}

#endif /* CIP_PROBE_UTIL_H */
