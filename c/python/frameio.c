/*
 * The channel's per-frame socket work, in cupy_ipcpool._engine (engine.c adds these
 * calls to the module).
 *
 * The subscriber's wait and receive of a FRAME with its header checked
 * (recv_frame), its release: hang-up check, read-flag write, RELEASE
 * (release_frame).  (The publisher's are its PublisherSession, pubsession.c.)  Each is
 * one call instead of several
 * Python layers (docs/install.md, "The compiled parts").  A message is
 * recognised by the engine's decoder (cipi_decode, c/src/message.c), the one
 * check of every message, and written from the generated layouts
 * (cupy_ipcpool_wire.h); the read-flag write is a function pointer (see
 * cupy_ipcpool/_memop_args.h): nothing here knows CUDA.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "cip_internal.h"
#include "_memop_args.h"
#include "engine.h"

#define CIP_MAX_POLLFDS 16             /* a hang-up set: the socket and watched fds */

static int
as_fd(PyObject *obj, const char *name)
{
    long fd = PyLong_AsLong(obj);
    if (fd == -1 && PyErr_Occurred())
        return -1;
    if (fd < 0 || fd > 0x7FFFFFFFL) {
        PyErr_Format(PyExc_ValueError, "%s: fd %ld out of range", name, fd);
        return -1;
    }
    return (int)fd;
}

/* A wait's timeout argument (``unit``: its name, e.g. "timeout_ms"): -1 (without limit)
 * or more.  0, or -1 with an exception. */
static inline int
as_timeout(PyObject *obj, const char *name, const char *unit, long *timeout)
{
    *timeout = PyLong_AsLong(obj);
    if (*timeout == -1 && PyErr_Occurred())
        return -1;
    if (*timeout < -1) {
        PyErr_Format(PyExc_ValueError, "%s: %s %ld (-1 waits without limit)", name, unit,
                     *timeout);
        return -1;
    }
    return 0;
}

/* A frame's seq (u64) and slot (u32) arguments.  0, or -1 with an exception. */
static inline int
as_seq_slot(PyObject *seq_obj, PyObject *slot_obj, const char *name, unsigned long long *seq,
            unsigned long *slot)
{
    *seq = PyLong_AsUnsignedLongLong(seq_obj);
    if (*seq == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *slot = PyLong_AsUnsignedLong(slot_obj);
    if (*slot == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (*slot > 0xFFFFFFFFul) {
        PyErr_Format(PyExc_OverflowError, "%s: slot does not fit in 32 bits", name);
        return -1;
    }
    return 0;
}

/* A pollfd set made by pollfds(): copied (poll writes revents), count returned. */
static int
load_pollfds(PyObject *obj, struct pollfd *out, nfds_t *count, const char *name)
{
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: the poll set must be bytes from pollfds()", name);
        return -1;
    }
    Py_ssize_t len = PyBytes_GET_SIZE(obj);
    if (len % (Py_ssize_t)sizeof(struct pollfd) != 0 ||
        len > (Py_ssize_t)(CIP_MAX_POLLFDS * sizeof(struct pollfd))) {
        PyErr_Format(PyExc_ValueError, "%s: the poll set is not from pollfds() (%zd bytes)", name,
                     len);
        return -1;
    }
    memcpy(out, PyBytes_AS_STRING(obj), (size_t)len);
    *count = (nfds_t)(len / (Py_ssize_t)sizeof(struct pollfd));
    for (nfds_t i = 0; i < *count; i++)
        out[i].revents = 0;
    return 0;
}

/* poll(0) of a set: 1 if any fd reported an event, 0 if none, -1 with an exception. */
static int
any_ready(struct pollfd *fds, nfds_t count)
{
    if (count == 0)
        return 0;
    for (;;) {
        int r = poll(fds, count, 0);
        if (r >= 0)
            return r > 0;
        if (errno != EINTR) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (PyErr_CheckSignals() < 0)
            return -1;
    }
}

PyDoc_STRVAR(pollfds_doc,
"pollfds(pairs) -> bytes\n"
"\n"
"Pack ``(fd, events)`` pairs (at most 16) as the ``struct pollfd`` array\n"
"that ``recv_frame`` and ``release_frame`` poll.");

static PyObject *
frameio_pollfds(PyObject *Py_UNUSED(module), PyObject *pairs)
{
    PyObject *seq = PySequence_Fast(pairs, "pollfds: pairs must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = NULL;
    if (n > CIP_MAX_POLLFDS) {
        PyErr_Format(PyExc_ValueError, "pollfds: %zd fds; at most %d", n, CIP_MAX_POLLFDS);
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(struct pollfd));
    if (out == NULL)
        goto done;
    struct pollfd *fds = (struct pollfd *)PyBytes_AS_STRING(out);
    memset(fds, 0, (size_t)n * sizeof *fds);
    for (Py_ssize_t i = 0; i < n; i++) {
        int fd;
        short events;
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyArg_ParseTuple(item, "ih;pollfds: each pair is (fd, events)", &fd, &events))
            goto fail;
        if (fd < 0) {
            PyErr_Format(PyExc_ValueError, "pollfds: fd %d is negative", fd);
            goto fail;
        }
        fds[i].fd = fd;
        fds[i].events = events;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_DECREF(seq);
    return out;
}

/* The deadline (CLOCK_MONOTONIC ns) of a timeout of ``timeout`` units of ``unit_ns``
 * nanoseconds; 0 without one.  A timeout too long to add to the clock (centuries)
 * becomes "without limit" (-1). */
static long long
deadline_after(long timeout, long long unit_ns, long *effective)
{
    if (timeout <= 0)
        return 0;
    long long now = cipi_now_ns();
    if ((long long)timeout > (LLONG_MAX - now) / unit_ns) {
        *effective = -1;
        return 0;
    }
    return now + (long long)timeout * unit_ns;
}

/* poll(2)'s timeout for ``left_ns`` nanoseconds: rounded up, at most INT_MAX ms (the
 * caller loops until its deadline). */
static int
poll_ms(long long left_ns)
{
    long long ms = (left_ns + 999999LL) / 1000000LL;
    return ms > INT_MAX ? INT_MAX : (int)ms;
}

PyDoc_STRVAR(recv_frame_doc,
"recv_frame(fd, buf, timeout_ms, poll_first, hup) -> tuple | None\n"
"\n"
"Receive one datagram from the ``SOCK_SEQPACKET`` socket ``fd`` into the\n"
"bytearray ``buf``, waiting up to ``timeout_ms`` milliseconds (-1: without\n"
"limit, 0: not at all).  ``poll_first``: wait before the first attempt (the\n"
"last call had to wait).  Returns None when nothing came in time, else\n"
"``(n, seq, slot, waited)``: ``n`` bytes received (0: the peer closed);\n"
"``seq`` and ``slot`` of a well-formed FRAME (magic, version, type, payload\n"
"length that adds up, payload at ``buf[20:n]``) when no fd of the hang-up\n"
"set ``hup`` (from ``pollfds``) is ready, else ``seq`` is -1 and the caller\n"
"decodes ``buf[:n]`` itself; ``waited``: whether it had to wait.  The\n"
"hang-up set is looked at by a ``poll(0)`` after the receive (unless the wait\n"
"already saw it fire): a FRAME is only reported as such if nothing had hung\n"
"up once it was received.  A failed receive raises the ``OSError`` of its\n"
"errno.  The GIL is released while it waits and receives.");

static PyObject *
frameio_recv_frame(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 5, "recv_frame(fd, buf, timeout_ms, poll_first, hup)") < 0)
        return NULL;
    int fd = as_fd(args[0], "recv_frame");
    if (fd < 0)
        return NULL;
    if (!PyByteArray_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "recv_frame: buf must be a bytearray");
        return NULL;
    }
    long timeout_ms;
    if (as_timeout(args[2], "recv_frame", "timeout_ms", &timeout_ms) < 0)
        return NULL;
    int poll_first = PyObject_IsTrue(args[3]);
    if (poll_first < 0)
        return NULL;
    if (timeout_ms == 0)
        poll_first = 0; /* no wait allowed: the receive is the only look */
    struct pollfd hup[CIP_MAX_POLLFDS];
    nfds_t nhup;
    if (load_pollfds(args[4], hup, &nhup, "recv_frame") < 0)
        return NULL;
    /* an exported buffer: the bytearray can be neither freed nor resized by another
     * thread while the GIL is released */
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    char *buf = (char *)view.buf;
    size_t size = (size_t)view.len;
    long long deadline = deadline_after(timeout_ms, 1000000LL, &timeout_ms);
    /* the hang-up set's events for the socket itself (POLLRDHUP), if it is in the set */
    short hup_events = 0;
    for (nfds_t i = 0; i < nhup; i++)
        if (hup[i].fd == fd)
            hup_events = hup[i].events;
    struct pollfd wait[CIP_MAX_POLLFDS + 1];
    int hup_fired = 0; /* the wait saw something in the hang-up set fire */
    int waited = 0;
    ssize_t n = -1;
    int err = 0;
    for (;;) {
        if (!poll_first) {
            Py_BEGIN_ALLOW_THREADS
            n = recv(fd, buf, size, MSG_DONTWAIT);
            err = errno;
            Py_END_ALLOW_THREADS
            if (n >= 0)
                break;
            if (err == EINTR) {
                if (PyErr_CheckSignals() < 0)
                    goto fail;
                continue;
            }
            if (err != EAGAIN && err != EWOULDBLOCK) {
                errno = err;
                PyErr_SetFromErrno(PyExc_OSError);
                goto fail;
            }
        }
        poll_first = 0;
        if (timeout_ms == 0)
            goto none;
        int wait_ms = -1;
        if (timeout_ms > 0) {
            long long left = deadline - cipi_now_ns();
            if (left <= 0)
                goto none;
            wait_ms = poll_ms(left);
        }
        /* The wait watches the hang-up set too, so that a hang-up (or a watched fd)
         * ends it.  Once something in the set has fired it is left out (it would
         * stay ready), and the caller decodes. */
        nfds_t nw = 0;
        if (!hup_fired) {
            memcpy(wait, hup, nhup * sizeof wait[0]);
            nw = nhup;
        }
        nfds_t self = nw;
        for (nfds_t i = 0; i < nw; i++)
            if (wait[i].fd == fd)
                self = i;
        if (self == nw) {
            wait[nw].fd = fd;
            wait[nw].events = 0;
            nw++;
        }
        wait[self].events |= POLLIN;
        for (nfds_t i = 0; i < nw; i++)
            wait[i].revents = 0;
        int r;
        waited = 1;
        Py_BEGIN_ALLOW_THREADS
        r = poll(wait, nw, wait_ms);
        err = errno;
        Py_END_ALLOW_THREADS
        if (r < 0) {
            if (err != EINTR) {
                errno = err;
                PyErr_SetFromErrno(PyExc_OSError);
                goto fail;
            }
            if (PyErr_CheckSignals() < 0)
                goto fail;
            continue;
        }
        if (r > 0 && !hup_fired) {
            for (nfds_t i = 0; i < nw; i++) {
                short ev = wait[i].revents;
                if (i == self) /* the socket: its hang-up events, not its data */
                    ev &= (short)((hup_events & ~POLLIN) | POLLHUP | POLLERR | POLLNVAL);
                if (ev)
                    hup_fired = 1;
            }
        }
    }
    long long seq = -1;
    unsigned int slot = 0;
    struct cipi_msg m;
    if ((size_t)n <= size && cipi_decode(buf, (size_t)n, &m) == CIP_OK &&
        m.type == CIP_WIRE_FRAME) {
        /* The check is made AFTER the receive, always: a wait that saw only
         * data says nothing about a hang-up that came while this process was
         * descheduled (or stopped) between the wait and the receive, and an
         * eviction in that gap revokes the frame just received. */
        int ready = hup_fired;
        if (!ready) {
            ready = any_ready(hup, nhup);
            if (ready < 0)
                goto fail;
        }
        if (!ready) {
            PyBuffer_Release(&view);
            return Py_BuildValue("(nKIO)", (Py_ssize_t)n, (unsigned long long)m.seq, m.slot,
                                 waited ? Py_True : Py_False);
        }
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(nLIO)", (Py_ssize_t)n, seq, slot, waited ? Py_True : Py_False);
none:
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&view);
    return NULL;
}

PyDoc_STRVAR(release_frame_doc,
"release_frame(fd, hup, fn, stream, addr, value, flags, seq, slot) -> int\n"
"\n"
"A subscriber's release of frame ``(seq, slot)``: unless an fd of the poll\n"
"set ``hup`` is ready (then -1 is returned and nothing done), enqueue the\n"
"stream memory operation ``fn(stream, addr, value, flags)`` (the read-flag\n"
"write, as ``memop``); if the driver fails, return its CUresult and send\n"
"nothing; else send the RELEASE datagram on ``fd`` without waiting and\n"
"return 0 (``fd`` -1: none is sent; the caller queues it).  A failed send (the operation was enqueued) raises the\n"
"``OSError`` of its errno (``BlockingIOError``: the socket is full).  The\n"
"GIL is released during the driver call.");

static PyObject *
frameio_release_frame(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 9,
                    "release_frame(fd, hup, fn, stream, addr, value, flags, seq, slot)") < 0)
        return NULL;
    long fd_arg = PyLong_AsLong(args[0]);
    if (fd_arg == -1 && PyErr_Occurred())
        return NULL;
    int fd = -1; /* -1: the write only, the caller queues the RELEASE */
    if (fd_arg != -1 && (fd = as_fd(args[0], "release_frame")) < 0)
        return NULL;
    struct pollfd hup[CIP_MAX_POLLFDS];
    nfds_t nhup;
    if (load_pollfds(args[1], hup, &nhup, "release_frame") < 0)
        return NULL;
    void *fn, *stream;
    unsigned long long addr;
    unsigned int value, flags;
    if (memop_args(args + 2, "release_frame", &fn, &stream, &addr, &value, &flags) < 0)
        return NULL;
    unsigned long long seq;
    unsigned long slot;
    if (as_seq_slot(args[7], args[8], "release_frame", &seq, &slot) < 0)
        return NULL;
    int ready = any_ready(hup, nhup);
    if (ready < 0)
        return NULL;
    if (ready)
        return PyLong_FromLong(-1);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ((memop_fn)fn)(stream, addr, value, flags);
    Py_END_ALLOW_THREADS
    if (rc != 0 || fd < 0)
        return PyLong_FromLong(rc);
    /* the RELEASE as the engine's owed.c sends every one: 0 (full) is EAGAIN */
    int sent = cipi_try_send_release(fd, seq, (uint32_t)slot);
    if (sent > 0)
        return PyLong_FromLong(0);
    if (sent == 0)
        errno = EAGAIN;
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* ------------------------------------------------------------------------ */
/* The publisher's per-frame socket work                                     */
/* ------------------------------------------------------------------------ */

static PyMethodDef cipy_frameio_methods[] = {
    {"pollfds", (PyCFunction)frameio_pollfds, METH_O, pollfds_doc},
    {"recv_frame", (PyCFunction)(void (*)(void))frameio_recv_frame, METH_FASTCALL,
     recv_frame_doc},
    {"release_frame", (PyCFunction)(void (*)(void))frameio_release_frame, METH_FASTCALL,
     release_frame_doc},
    {NULL, NULL, 0, NULL},
};

int
cipy_frameio_exec(PyObject *module)
{
    /* what the calls take the protocol to be (_sockets.py refuses a build that differs) */
    PyObject *protocol =
        Py_BuildValue("(IIIIiiI)", CIP_WIRE_MAGIC, CIP_WIRE_VERSION, CIP_WIRE_FRAME,
                      CIP_WIRE_RELEASE, CIP_WIRE_FRAME_SIZE, CIP_WIRE_RELEASE_SIZE,
                      CIP_WIRE_MAX_FRAME_PAYLOAD);
    if (protocol == NULL)
        return -1;
    if (PyModule_AddObject(module, "PROTOCOL", protocol) < 0) {
        Py_DECREF(protocol);
        return -1;
    }
    return PyModule_AddFunctions(module, cipy_frameio_methods);
}
