/*
 * What the C test programs (cip_probe.c, gpu_consumer.c, cip_pub_probe.c) share: hex
 * arguments back to bytes, the count of this process's open fds, a forked child's report.
 * Each program includes this header once; it is no part of the library.
 */
#ifndef CIP_PROBE_UTIL_H
#define CIP_PROBE_UTIL_H

#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

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

/* Fork a child that runs child(ctx, out, cap), writes what it put in `out` back through a
 * pipe and exits 0; the parent waits for it.  What the child wrote goes to got (cap bytes,
 * "? ?" if nothing came), its exit code is returned (-1: no exit, -2: no pipe or fork). */
static __attribute__((unused)) int
fork_and_report(void (*child)(void *ctx, char *out, size_t cap), void *ctx, char *got,
                size_t cap)
{
    int pipefd[2];
    if (pipe(pipefd) != 0)
        return -2;
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        close(pipefd[0]);
        close(pipefd[1]);
        return -2;
    }
    if (pid == 0) {
        char out[256] = "";
        child(ctx, out, sizeof out);
        (void)!write(pipefd[1], out, strlen(out));
        _exit(0);
    }
    close(pipefd[1]);
    ssize_t n = read(pipefd[0], got, cap - 1);
    close(pipefd[0]);
    snprintf(got + (n > 0 ? n : 0), cap - (size_t)(n > 0 ? n : 0), "%s", n > 0 ? "" : "? ?");
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

#endif /* CIP_PROBE_UTIL_H */
