/*
 * cupy_ipcpool._engine.PublisherSession: the publisher's adopted subscribers
 * (c/src/pub_session.c) over a LeaseCore, for the Python publisher: their sockets (owned
 * from add() on), the frames out and the messages in, who leaves and why, eviction, the
 * eviction notice, the BYE at close.  Every call that may end subscribers returns those
 * that left as [(sub_id, why)] (None when none did): their sockets are closed and their
 * leases are back in the book by then; the caller forgets them.
 *
 * Every method runs under the GIL; a wait (take, publish's wait for room, close's linger)
 * releases it, and meanwhile the session refuses every call that could change it (the set
 * being polled must not change); ids(), fd() and the counts answer at any time.  A signal ends a wait when its Python handler raises: that exception comes out
 * of the call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_memop_args.h"
#include "cip_internal.h"
#include "engine.h"

typedef struct {
    PyObject_HEAD
    PyObject *core; /* the LeaseCore whose book the session reads and writes */
    struct cipi_pubsession session;
    Py_buffer page; /* the sync page the read flags are read from (flags()), page.obj NULL: none */
    int ready;
    int busy; /* a call waits with the GIL released */
} PublisherSession;

static void *
gil_release(void)
{
    return PyEval_SaveThread();
}

static void
gil_reacquire(void *token)
{
    PyEval_RestoreThread((PyThreadState *)token);
}

static int
signal_raised(void)
{
    return PyErr_CheckSignals() < 0;
}

const struct cipi_waiting cipy_gil = {gil_release, gil_reacquire, signal_raised};

static engine_state *
state(PublisherSession *self)
{
    return (engine_state *)PyType_GetModuleState(Py_TYPE(self));
}

/* The exception of status st, in the engine's words; NULL. */
PyObject *
cipy_publisher_fail(engine_state *es, int st)
{
    if (st == CIPI_ERR_INTERRUPTED)
        return NULL; /* the signal handler's exception is set */
    if (st == CIP_ERR_NO_MEMORY)
        return PyErr_NoMemory();
    if (st == CIP_ERR_TRANSPORT) {
        PyErr_SetString(PyExc_OSError, cip_last_error());
        return NULL;
    }
    const char *name = st == CIPI_ERR_LEASE_STATE  ? "LeaseStateError"
                       : st == CIPI_ERR_SLOT_INDEX ? "SlotIndexError"
                       : st == CIP_ERR_PROTOCOL    ? "ProtocolError"
                                                   : "UsageError";
    PyObject *cls = PyObject_GetAttrString(es->errors, name);
    if (cls != NULL) {
        PyErr_SetString(cls, cip_last_error());
        Py_DECREF(cls);
    }
    return NULL;
}

static PyObject *
fail(PublisherSession *self, cip_status st)
{
    return cipy_publisher_fail(state(self), st);
}

/* A timeout in seconds, 0..1e9: 0, or -1 with UsageError (the publisher's own check). */
static int
seconds_arg(PublisherSession *self, PyObject *obj, const char *what, double *out)
{
    double v = PyFloat_AsDouble(obj);
    if (v == -1.0 && PyErr_Occurred())
        return -1;
    if (!(v >= 0.0) || v > 1e9) {
        PyObject *cls = PyObject_GetAttrString(state(self)->errors, "UsageError");
        if (cls != NULL) {
            PyErr_Format(cls, "%s must be 0..1e9 seconds, not %R", what, obj);
            Py_DECREF(cls);
        }
        return -1;
    }
    *out = v;
    return 0;
}

static int
session_init(PublisherSession *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"lease_core", "lease_timeout", "send_timeout", NULL};
    PyObject *core, *lease_obj, *send_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO:PublisherSession", names, &core,
                                     &lease_obj, &send_obj))
        return -1;
    if (self->core != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PublisherSession is initialised once");
        return -1;
    }
    double lease_timeout = 0.0, send_timeout;
    if ((lease_obj != Py_None &&
         seconds_arg(self, lease_obj, "lease_timeout", &lease_timeout) < 0) ||
        seconds_arg(self, send_obj, "send_timeout", &send_timeout) < 0)
        return -1;
    struct cipi_leasebook *book = cipy_leasebook_of(state(self), core);
    if (book == NULL)
        return -1;
    cip_status st = cipi_pubsession_init(&self->session, book, lease_timeout, send_timeout);
    if (st != CIP_OK) {
        fail(self, st);
        return -1;
    }
    Py_INCREF(core);
    self->core = core;
    self->ready = 1;
    return 0;
}

static void
session_dealloc(PublisherSession *self)
{
    if (self->ready)
        cipi_pubsession_free(&self->session); /* closes what close() did not */
    if (self->page.obj != NULL)
        PyBuffer_Release(&self->page);
    Py_XDECREF(self->core);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* 0 when the session may be looked at, else -1 with an exception: at any time, also while
 * a call waits on another thread (nothing changes the wire then: usable() refuses). */
static int
readable(PublisherSession *self)
{
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "PublisherSession is not initialised");
        return -1;
    }
    return 0;
}

/* 0 when the session may be used now, else -1 with an exception. */
static int
usable(PublisherSession *self)
{
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "PublisherSession is not initialised");
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "PublisherSession is waiting on another thread (one owner calls it)");
        return -1;
    }
    return 0;
}

struct cipi_pubsession *
cipy_pubsession_of(engine_state *es, PyObject *obj, int **busy)
{
    if (!PyObject_TypeCheck(obj, (PyTypeObject *)es->publisher_session)) {
        PyErr_Format(PyExc_TypeError, "a PublisherSession is needed, not %.100s",
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PublisherSession *self = (PublisherSession *)obj;
    if (usable(self) < 0)
        return NULL;
    *busy = &self->busy;
    return &self->session;
}

/* a subscriber id (u32): 0, or -1 with an exception */
static int
as_sub_id(PyObject *obj, uint32_t *out)
{
    unsigned long v = PyLong_AsUnsignedLong(obj);
    if (v == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (v > UINT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a subscriber id fits in 32 bits");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* Those that left since the last answer: None, or [(sub_id, why)]; taken from the session. */
PyObject *
cipy_departures(struct cipi_pubsession *s)
{
    if (s->nleft == 0)
        Py_RETURN_NONE;
    PyObject *out = PyList_New(s->nleft);
    for (uint32_t i = 0; out != NULL && i < s->nleft; i++) {
        PyObject *item = Py_BuildValue("(ks)", (unsigned long)s->left[i].sub_id, s->left[i].why);
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, item);
    }
    if (out != NULL)
        s->nleft = 0; /* kept for the next answer when the list could not be made */
    return out;
}

/* The answer of a call that may have ended subscribers: its error, or those that left. */
static PyObject *
answer(PublisherSession *self, cip_status st)
{
    if (st != CIP_OK) {
        /* those that left before the error are not lost: the next answer has them */
        return fail(self, st);
    }
    return cipy_departures(&self->session);
}

static PyObject *
session_add(PublisherSession *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t id;
    if (usable(self) < 0 || check_nargs(nargs, 4, "add(sub_id, mode, credit, fd)") < 0 ||
        as_sub_id(args[0], &id) < 0)
        return NULL;
    int mode = cipy_lease_mode(args[1]);
    if (mode < 0)
        return cipy_lease_mode_error(state(self), args[1]);
    long long credit = PyLong_AsLongLong(args[2]);
    if (credit == -1 && PyErr_Occurred())
        return NULL;
    int fd = PyObject_AsFileDescriptor(args[3]);
    if (fd < 0)
        return NULL;
    cip_status st = cipi_pubsession_add(&self->session, id, mode, credit, fd);
    if (st != CIP_OK)
        return fail(self, st);
    Py_RETURN_NONE;
}

int
cipy_frame_args(engine_state *es, struct cipi_leasebook *book, PyObject *const *args,
                struct cipy_frame *out)
{
    long long slot = PyLong_AsLongLong(args[0]);
    if (slot == -1 && PyErr_Occurred())
        return -1;
    cip_status st = cipi_leases_check_slot(book, slot);
    if (st != CIP_OK) {
        cipy_publisher_fail(es, st);
        return -1;
    }
    if (!PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "publish: payload must be bytes");
        return -1;
    }
    int on_schedule = PyObject_IsTrue(args[2]);
    if (on_schedule < 0)
        return -1;
    unsigned long long generation = PyLong_AsUnsignedLongLongMask(args[3]);
    if (generation == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    out->slot = (uint32_t)slot;
    out->payload = PyBytes_AS_STRING(args[1]);
    out->len = (size_t)PyBytes_GET_SIZE(args[1]);
    out->on_schedule = on_schedule;
    out->generation = (uint32_t)generation;
    return 0;
}

static PyObject *
session_publish(PublisherSession *self, PyObject *const *args, Py_ssize_t nargs)
{
    struct cipy_frame f;
    if (usable(self) < 0 ||
        check_nargs(nargs, 5, "publish(slot, seq, on_schedule, payload, generation)") < 0)
        return NULL;
    PyObject *frame[4] = {args[0], args[3], args[2], args[4]};
    if (cipy_frame_args(state(self), self->session.book, frame, &f) < 0)
        return NULL;
    unsigned long long seq = PyLong_AsUnsignedLongLong(args[1]);
    if (seq == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    /* the payload stays alive and unchanged while a wait releases the GIL: bytes, which
     * args holds */
    self->busy = 1;
    cip_status st = cipi_pubsession_publish(&self->session, f.slot, seq, f.generation,
                                            f.on_schedule, f.payload, f.len, &cipy_gil);
    self->busy = 0;
    return answer(self, st);
}

/* A wait's timeout_us (-1: without limit) as nanoseconds into *wait_ns (-1 too); -1 with
 * ValueError, naming `call`, for one below -1. */
int
cipy_wait_arg(PyObject *obj, const char *call, long long *wait_ns)
{
    long long timeout_us = PyLong_AsLongLong(obj);
    if (timeout_us == -1 && PyErr_Occurred())
        return -1;
    if (timeout_us < -1) {
        PyErr_Format(PyExc_ValueError, "%s: timeout_us %lld (-1 waits without limit)", call,
                     timeout_us);
        return -1;
    }
    *wait_ns = timeout_us < 0 || timeout_us > LLONG_MAX / 2000 ? -1 : timeout_us * 1000;
    return 0;
}

static PyObject *
session_take(PublisherSession *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long wait_ns;
    if (usable(self) < 0 || check_nargs(nargs, 2, "take(timeout_us, limit)") < 0 ||
        cipy_wait_arg(args[0], "take", &wait_ns) < 0)
        return NULL;
    long limit = PyLong_AsLong(args[1]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    if (limit < 1) {
        PyErr_SetString(PyExc_ValueError, "take: limit must be at least 1");
        return NULL;
    }
    self->busy = 1;
    cip_status st = cipi_pubsession_take(&self->session, wait_ns, limit, &cipy_gil);
    self->busy = 0;
    return answer(self, st);
}

int
cipy_poll_args(PyObject *const *args, Py_ssize_t nargs, long long *wait_ns, long long *spin_ns,
               int *settle)
{
    if (check_nargs(nargs, 3, "poll(timeout_us, spin_ns, settle)") < 0 ||
        cipy_wait_arg(args[0], "poll", wait_ns) < 0)
        return -1;
    *spin_ns = PyLong_AsLongLong(args[1]);
    if (*spin_ns == -1 && PyErr_Occurred())
        return -1;
    if (*spin_ns < 0) {
        PyErr_Format(PyExc_ValueError, "poll: spin_ns %lld (0 or more)", *spin_ns);
        return -1;
    }
    *settle = PyObject_IsTrue(args[2]);
    return *settle < 0 ? -1 : 0;
}

static PyObject *
session_poll(PublisherSession *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long wait_ns, spin_ns;
    int settle;
    if (usable(self) < 0 || cipy_poll_args(args, nargs, &wait_ns, &spin_ns, &settle) < 0)
        return NULL;
    self->busy = 1;
    cip_status st = cipi_pubsession_poll(&self->session, wait_ns, spin_ns, settle, &cipy_gil);
    self->busy = 0;
    return answer(self, st);
}

static PyObject *
session_drop(PublisherSession *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t id;
    if (usable(self) < 0 || check_nargs(nargs, 3, "drop(sub_id, why, notify)") < 0 ||
        as_sub_id(args[0], &id) < 0)
        return NULL;
    const char *why = PyUnicode_AsUTF8(args[1]);
    if (why == NULL)
        return NULL;
    int notify = PyObject_IsTrue(args[2]);
    if (notify < 0)
        return NULL;
    cipi_pubsession_drop(&self->session, id, why, notify);
    return cipy_departures(&self->session);
}

static PyObject *
session_retry_notices(PublisherSession *self, PyObject *Py_UNUSED(arg))
{
    if (usable(self) < 0)
        return NULL;
    cipi_pubsession_retry_notices(&self->session);
    return cipy_departures(&self->session);
}

static PyObject *
session_expire(PublisherSession *self, PyObject *Py_UNUSED(arg))
{
    if (usable(self) < 0)
        return NULL;
    return answer(self, cipi_pubsession_expire(&self->session));
}

static PyObject *
session_close(PublisherSession *self, PyObject *arg)
{
    double linger;
    if (usable(self) < 0 || seconds_arg(self, arg, "linger", &linger) < 0)
        return NULL;
    self->busy = 1;
    int all_gone = cipi_pubsession_close(&self->session, (long long)(linger * 1e9), &cipy_gil);
    self->busy = 0;
    self->session.page = NULL; /* the page may be unmapped from here on */
    if (self->page.obj != NULL)
        PyBuffer_Release(&self->page);
    if (PyErr_Occurred())
        return NULL; /* a signal's handler raised during the linger */
    return PyBool_FromLong(all_gone);
}

static PyObject *
session_forget(PublisherSession *self, PyObject *Py_UNUSED(arg))
{
    if (self->busy) { /* (a forked child has no waiting thread: only a misuse gets here) */
        PyErr_SetString(PyExc_RuntimeError, "the PublisherSession is waiting on another thread");
        return NULL;
    }
    cipi_pubsession_forget(&self->session);
    Py_RETURN_NONE;
}

static PyObject *
session_flags(PublisherSession *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (usable(self) < 0 || check_nargs(nargs, 3, "flags(page, reads_offset, rows)") < 0)
        return NULL;
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    unsigned long rows = PyLong_AsUnsignedLong(args[2]);
    if (rows == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    cip_status st = offset < 0 || rows > UINT32_MAX
                        ? cipi_fail(CIP_ERR_INVALID_ARGUMENT, "flags: bad offset or rows")
                        : cipi_pubsession_flags(&self->session, view.buf, (size_t)view.len,
                                                (size_t)offset, (uint32_t)rows);
    if (st != CIP_OK) {
        PyBuffer_Release(&view);
        return fail(self, st);
    }
    if (self->page.obj != NULL)
        PyBuffer_Release(&self->page);
    self->page = view; /* held: the page stays mapped while the session reads it */
    Py_RETURN_NONE;
}

static PyObject *
session_set_row(PublisherSession *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t id, row;
    if (usable(self) < 0 || check_nargs(nargs, 2, "set_row(sub_id, row)") < 0 ||
        as_sub_id(args[0], &id) < 0 || as_sub_id(args[1], &row) < 0)
        return NULL;
    cip_status st = cipi_pubsession_set_row(&self->session, id, row);
    if (st != CIP_OK)
        return fail(self, st);
    Py_RETURN_NONE;
}

/* Allowed while a call waits on another thread: it reads the page and changes the lease
 * book only, which that wait does not touch (it polls the wire, the GIL released). */
static PyObject *
session_settle(PublisherSession *self, PyObject *arg)
{
    if (readable(self) < 0)
        return NULL;
    long long slot = PyLong_AsLongLong(arg);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    if (slot < -1 || slot >= (long long)self->session.book->num_slots) {
        PyErr_Format(PyExc_ValueError, "settle: slot %lld is not -1 or a slot of the ring",
                     slot);
        return NULL;
    }
    uint32_t ended;
    cip_status st = cipi_pubsession_settle(&self->session, slot, &ended);
    if (st != CIP_OK)
        return fail(self, st);
    return PyLong_FromUnsignedLong(ended);
}

static PyObject *
session_ids(PublisherSession *self, PyObject *Py_UNUSED(arg))
{
    if (readable(self) < 0)
        return NULL;
    const struct cipi_pubwire *w = &self->session.wire;
    PyObject *out = PyList_New(w->n);
    for (uint32_t i = 0; out != NULL && i < w->n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(w->ids[i]);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *
session_fd(PublisherSession *self, PyObject *arg)
{
    uint32_t id;
    if (readable(self) < 0 || as_sub_id(arg, &id) < 0)
        return NULL;
    int fd = cipi_pubwire_fd(&self->session.wire, id);
    for (uint32_t i = 0; fd < 0 && i < self->session.nnotices; i++)
        if (self->session.notices[i].sub_id == id)
            fd = self->session.notices[i].fd;
    return PyLong_FromLong(fd);
}

static PyObject *
get_count(PublisherSession *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLong(self->session.wire.n);
}

static PyObject *
get_noticing(PublisherSession *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLong(self->session.nnotices);
}

static PyObject *
get_evictions(PublisherSession *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(self->session.evictions);
}

static PyObject *
get_flag_looks(PublisherSession *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(self->session.flag_looks);
}

static PyObject *
get_next_expiry(PublisherSession *self, void *Py_UNUSED(closure))
{
    if (self->session.next_expiry == 0.0)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(self->session.next_expiry);
}

static PyMethodDef session_methods[] = {
    {"add", (PyCFunction)(void (*)(void))session_add, METH_FASTCALL,
     "add(sub_id, mode, credit, fd): adopt a subscriber (into the lease book and onto the "
     "wire); the session owns fd from here on, whatever the answer (closed on failure)."},
    {"publish", (PyCFunction)(void (*)(void))session_publish, METH_FASTCALL,
     "publish(slot, seq, on_schedule, payload, generation) -> list | None: publish frame seq "
     "(of generation, what its readers' flags say once read) in slot and "
     "send it to every subscriber the lease book names.  A full 'latest' socket skips it; a "
     "full 'block'/'ahead' one is waited for up to send_timeout (the GIL released), then "
     "evicted; another failed send drops its subscriber.  Those that left: [(sub_id, why)]."},
    {"poll", (PyCFunction)(void (*)(void))session_poll, METH_FASTCALL,
     "poll(timeout_us, spin_ns, settle) -> list | None: wait up to timeout_us (-1: without "
     "limit, 0: not at all; the GIL released while it sleeps) for a lease to end, however: a "
     "RELEASE, a read flag (settle: looked at between growing steps), a departure, an "
     "eviction past lease_timeout.  The waiting notices are tried again first; with spin_ns "
     "a wait first looks without sleeping for up to spin_ns (the GIL held)."},
    {"take", (PyCFunction)(void (*)(void))session_take, METH_FASTCALL,
     "take(timeout_us, limit) -> list | None: wait up to timeout_us (-1: without limit; the "
     "GIL released) for a message, then take up to limit from each readable socket: each "
     "RELEASE into the lease book; a BYE, a hang-up, a message a subscriber may not send, a "
     "RELEASE the book refuses or a failed receive drops its subscriber."},
    {"drop", (PyCFunction)(void (*)(void))session_drop, METH_FASTCALL,
     "drop(sub_id, why, notify) -> list | None: drop a subscriber; with notify, evict it "
     "(told why behind the frames queued for it; kept, suspended, while that does not fit)."},
    {"retry_notices", (PyCFunction)session_retry_notices, METH_NOARGS,
     "retry_notices() -> list | None: try again to queue the notices that did not fit."},
    {"expire", (PyCFunction)session_expire, METH_NOARGS,
     "expire() -> list | None: once a lease may be overdue, evict every subscriber that holds "
     "a frame longer than lease_timeout."},
    {"forget", (PyCFunction)session_forget, METH_NOARGS,
     "forget(): close every socket without a word (no BYE, no shutdown): this process's "
     "copies, in a child forked from the publisher's process."},
    {"close", (PyCFunction)session_close, METH_O,
     "close(linger) -> bool: BYE to every subscriber, wait up to linger seconds (the GIL "
     "released) for all to hang up, close every socket; True when all had."},
    {"flags", (PyCFunction)(void (*)(void))session_flags, METH_FASTCALL,
     "flags(page, reads_offset, rows): read the subscribers' read flags from page (the sync "
     "page's host mapping, held until close): rows rows of num_slots flags from byte "
     "reads_offset on."},
    {"set_row", (PyCFunction)(void (*)(void))session_set_row, METH_FASTCALL,
     "set_row(sub_id, row): subscriber sub_id writes its read flags in row."},
    {"settle", (PyCFunction)session_settle, METH_O,
     "settle(slot) -> int: end every lease of slot (-1: of every slot) whose read flag holds "
     "the generation published there (LeaseCore.settle_flagged's rule); how many ended."},
    {"fd", (PyCFunction)session_fd, METH_O,
     "fd(sub_id) -> int: the socket of subscriber sub_id (its notice waiting or not), -1 when "
     "the session has none; the session's to close."},
    {"ids", (PyCFunction)session_ids, METH_NOARGS,
     "ids() -> list: the subscribers on the wire, in the order added."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef session_getset[] = {
    {"count", (getter)get_count, NULL, "subscribers on the wire", NULL},
    {"noticing", (getter)get_noticing, NULL, "evicted subscribers whose notice waits", NULL},
    {"evictions", (getter)get_evictions, NULL, "subscribers evicted so far", NULL},
    {"flag_looks", (getter)get_flag_looks, NULL, "how often poll() looked at the read flags",
     NULL},
    {"next_expiry", (getter)get_next_expiry, NULL,
     "when the oldest lease may be overdue (time.monotonic()), or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot session_slots[] = {
    {Py_tp_doc, "PublisherSession(lease_core, lease_timeout, send_timeout): the publisher's "
                "adopted subscribers (c/src/pub_session.c), over the lease book of "
                "lease_core."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, session_init},
    {Py_tp_dealloc, session_dealloc},
    {Py_tp_methods, session_methods},
    {Py_tp_getset, session_getset},
    {0, NULL},
};

static PyType_Spec session_spec = {
    "cupy_ipcpool._engine.PublisherSession",
    sizeof(PublisherSession),
    0,
    Py_TPFLAGS_DEFAULT,
    session_slots,
};

int
cipy_pubsession_exec(PyObject *module)
{
    /* SETTLE_RECHECK: a settling poll's first and longest step between two looks at the
     * read flags (s), and each step's growth over the last (c/src/pub_poll.c) */
    PyObject *recheck = Py_BuildValue("(ddd)", CIPI_SETTLE_RECHECK_FIRST_NS / 1e9,
                                      CIPI_SETTLE_RECHECK_LAST_NS / 1e9,
                                      CIPI_SETTLE_RECHECK_GROWTH);
    if (recheck == NULL || PyModule_AddObject(module, "SETTLE_RECHECK", recheck) < 0) {
        Py_XDECREF(recheck);
        return -1;
    }
    engine_state *es = (engine_state *)PyModule_GetState(module);
    if (cipy_add_type(module, &session_spec, "PublisherSession") < 0)
        return -1;
    es->publisher_session = PyObject_GetAttrString(module, "PublisherSession");
    return es->publisher_session == NULL ? -1 : 0;
}
