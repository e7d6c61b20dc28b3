/*
 * cupy_ipcpool._engine.Producer: the producer's calls (c/src/producer.c) over a
 * PublisherSession and an Acceptor, for the Python publisher: poll, acquire and publish each
 * adopt the welcomed first, keep the next frame's seq and where the pick of a free slot
 * starts, and count the leases ended since the last poll.  Who joined, who went before
 * adoption and who left are kept until news() takes them, for the callbacks the caller runs.
 *
 * Every method runs under the GIL; a wait releases it and marks the session busy meanwhile
 * (the session refuses every call that could change it).  A signal ends a wait when its
 * Python handler raises: that exception comes out of the call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_memop_args.h"
#include "cip_internal.h"
#include "engine.h"

typedef struct {
    PyObject_HEAD
    PyObject *session;  /* the PublisherSession (kept alive) */
    PyObject *acceptor; /* the Acceptor (kept alive) */
    struct cipi_producer prod;
    int *busy; /* the session's: set while a call waits */
    int ready;
} Producer;

static engine_state *
state(Producer *self)
{
    return (engine_state *)PyType_GetModuleState(Py_TYPE(self));
}

static int
producer_init(Producer *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"session", "acceptor", NULL};
    PyObject *session, *acceptor;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:Producer", names, &session, &acceptor))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Producer is initialised once");
        return -1;
    }
    int *busy;
    struct cipi_pubsession *s = cipy_pubsession_of(state(self), session, &busy);
    if (s == NULL)
        return -1;
    struct cipi_acceptor *acc = cipy_acceptor_of(state(self), acceptor);
    if (acc == NULL)
        return -1;
    cipi_producer_init(&self->prod, s, acc);
    self->session = Py_NewRef(session);
    self->acceptor = Py_NewRef(acceptor);
    self->busy = busy;
    self->ready = 1;
    return 0;
}

static void
producer_dealloc(Producer *self)
{
    if (self->ready)
        cipi_producer_free(&self->prod); /* news not taken: their fds are closed */
    Py_XDECREF(self->session);
    Py_XDECREF(self->acceptor);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* 0 once initialised, else -1 with an exception: what the records need (they may be read
 * at any time). */
static int
initialised(Producer *self)
{
    if (self->ready)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "Producer is not initialised");
    return -1;
}

/* 0 when the producer may be used now, else -1 with an exception. */
static int
usable(Producer *self)
{
    if (initialised(self) < 0)
        return -1;
    if (*self->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "the PublisherSession is waiting on another thread (one owner calls it)");
        return -1;
    }
    return 0;
}

static PyObject *
producer_poll(Producer *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long wait_ns, spin_ns;
    int settle;
    if (usable(self) < 0 || cipy_poll_args(args, nargs, &wait_ns, &spin_ns, &settle) < 0)
        return NULL;
    uint64_t returned;
    *self->busy = 1;
    cip_status st = cipi_producer_poll(&self->prod, wait_ns, spin_ns, settle,
                                       &cipy_gil, &returned);
    *self->busy = 0;
    if (st != CIP_OK)
        return cipy_publisher_fail(state(self), st);
    return PyLong_FromUnsignedLongLong(returned);
}

static PyObject *
producer_acquire(Producer *self, PyObject *arg)
{
    long long wait_ns;
    if (usable(self) < 0 || cipy_wait_arg(arg, "acquire", &wait_ns) < 0)
        return NULL;
    uint32_t slot;
    *self->busy = 1;
    cip_status st = cipi_producer_acquire(&self->prod, wait_ns, &cipy_gil, &slot);
    *self->busy = 0;
    if (st == CIP_ERR_TIMEOUT)
        Py_RETURN_NONE;
    if (st != CIP_OK)
        return cipy_publisher_fail(state(self), st);
    return PyLong_FromUnsignedLong(slot);
}

static PyObject *
producer_publish(Producer *self, PyObject *const *args, Py_ssize_t nargs)
{
    struct cipy_frame f;
    if (usable(self) < 0 ||
        check_nargs(nargs, 4, "publish(slot, payload, on_schedule, generation)") < 0 ||
        cipy_frame_args(state(self), self->prod.s->book, args, &f) < 0)
        return NULL;
    /* the payload stays alive and unchanged while a wait releases the GIL: bytes, which
     * args holds */
    uint64_t seq;
    *self->busy = 1;
    cip_status st = cipi_producer_publish(&self->prod, f.slot, f.generation, f.on_schedule,
                                          f.payload, f.len, &cipy_gil, &seq);
    *self->busy = 0;
    if (st != CIP_OK)
        return cipy_publisher_fail(state(self), st);
    return PyLong_FromUnsignedLongLong(seq);
}

/* [(record, why)] of the session's departures, each record the producer's of it as it joined
 * (None: never told as joined), taken; NULL on failure (kept for the next answer). */
static PyObject *
leavers(Producer *self)
{
    struct cipi_pubsession *s = self->prod.s;
    PyObject *out = PyList_New(s->nleft);
    for (uint32_t i = 0; out != NULL && i < s->nleft; i++) {
        const struct cipi_welcomed *rec = cipi_producer_known(&self->prod, s->left[i].sub_id);
        PyObject *taken = rec != NULL ? cipy_welcomed_tuple(rec) : Py_NewRef(Py_None);
        PyObject *item = taken == NULL ? NULL : Py_BuildValue("(Ns)", taken, s->left[i].why);
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, item);
    }
    if (out == NULL)
        return NULL;
    for (uint32_t i = 0; i < s->nleft; i++) { /* told: their records go */
        struct cipi_welcomed rec;
        if (cipi_producer_leaver(&self->prod, i, &rec))
            free(rec.hello);
    }
    s->nleft = 0;
    return out;
}

/* (joined, gone, left), taken; NULL on failure (what was not made into a list is lost:
 * only out of memory fails, and their fds are closed; those that left are kept). */
static PyObject *
news(Producer *self)
{
    struct cipi_welcomed *joined, *gone;
    size_t njoined, ngone;
    cipi_producer_take_news(&self->prod, &joined, &njoined, &gone, &ngone);
    PyObject *gone_list = cipy_welcomed_list(gone, ngone);
    PyObject *joined_list = cipy_welcomed_list(joined, njoined);
    PyObject *left = gone_list && joined_list ? leavers(self) : NULL;
    if (left == NULL) {
        Py_XDECREF(gone_list);
        Py_XDECREF(joined_list);
        return NULL;
    }
    return Py_BuildValue("(NNN)", joined_list, gone_list, left);
}

static PyObject *
producer_news(Producer *self, PyObject *Py_UNUSED(arg))
{
    if (usable(self) < 0)
        return NULL;
    if (!cipi_producer_has_news(&self->prod))
        Py_RETURN_NONE;
    return news(self);
}

static PyObject *
producer_stop(Producer *self, PyObject *Py_UNUSED(arg))
{
    if (usable(self) < 0)
        return NULL;
    *self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    cipi_producer_stop(&self->prod);
    Py_END_ALLOW_THREADS
    *self->busy = 0;
    return news(self);
}

static PyObject *
producer_subscribers(Producer *self, PyObject *Py_UNUSED(arg))
{
    if (initialised(self) < 0)
        return NULL;
    const struct cipi_pubwire *w = &self->prod.s->wire;
    PyObject *out = PyList_New(0);
    for (uint32_t i = 0; out != NULL && i < w->n; i++) {
        const struct cipi_welcomed *rec = cipi_producer_known(&self->prod, w->ids[i]);
        if (rec == NULL) /* added at close, never told as joined */
            continue;
        PyObject *t = cipy_welcomed_tuple(rec);
        if (t == NULL || PyList_Append(out, t) < 0)
            Py_CLEAR(out);
        Py_XDECREF(t);
    }
    return out;
}

static PyObject *
producer_subscriber(Producer *self, PyObject *arg)
{
    if (initialised(self) < 0)
        return NULL;
    unsigned long sub_id = PyLong_AsUnsignedLong(arg);
    if (sub_id == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    const struct cipi_welcomed *rec =
        sub_id > UINT32_MAX ? NULL : cipi_producer_known(&self->prod, (uint32_t)sub_id);
    if (rec == NULL)
        Py_RETURN_NONE;
    return cipy_welcomed_tuple(rec);
}

static PyObject *
get_has_news(Producer *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->ready && cipi_producer_has_news(&self->prod));
}

static PyObject *
get_next_seq(Producer *self, void *Py_UNUSED(closure))
{
    if (!self->ready)
        return PyLong_FromLong(0);
    return PyLong_FromUnsignedLongLong(cipi_acceptor_next_seq(self->prod.acc));
}

static PyObject *
get_last_slot(Producer *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLong(self->ready ? self->prod.last_slot : 0);
}

static PyMethodDef producer_methods[] = {
    {"poll", (PyCFunction)(void (*)(void))producer_poll, METH_FASTCALL,
     "poll(timeout_us, spin_ns, settle) -> int: adopt the welcomed, then wait up to "
     "timeout_us (-1: without limit; no wait while leases ended unreported) for a lease to "
     "end (PublisherSession.poll); how many ended since the last poll's answer."},
    {"acquire", (PyCFunction)producer_acquire, METH_O,
     "acquire(timeout_us) -> int | None: the first free slot round-robin after the one last "
     "published, waiting up to timeout_us (-1: without limit) for one; None: none came."},
    {"publish", (PyCFunction)(void (*)(void))producer_publish, METH_FASTCALL,
     "publish(slot, payload, on_schedule, generation) -> int: adopt the welcomed, publish "
     "the next frame in slot (PublisherSession.publish), return its seq.  Interrupted after "
     "the frame went out, the seq is spent all the same."},
    {"news", (PyCFunction)producer_news, METH_NOARGS,
     "news() -> (joined, gone, left) | None: the subscribers adopted and those gone before "
     "adoption since the last news() (each (sub_id, fd, pid, uid, mode, credit, hello, "
     "peer_pid, row)), and those that left, [(record, why)], each record as it joined (None: "
     "never told as joined); None: nothing."},
    {"stop", (PyCFunction)producer_stop, METH_NOARGS,
     "stop() -> (joined, gone, left): stop the accept thread; the welcomed not yet adopted "
     "join the session for its BYE, without being told as joined; then news()."},
    {"subscribers", (PyCFunction)producer_subscribers, METH_NOARGS,
     "subscribers() -> list: the record of each subscriber on the wire told as joined, in the "
     "order added (as news() gives them, fd -1)."},
    {"subscriber", (PyCFunction)producer_subscriber, METH_O,
     "subscriber(sub_id) -> tuple | None: the record of an adopted subscriber not yet told as "
     "left."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef producer_getset[] = {
    {"has_news", (getter)get_has_news, NULL, "whether news() has something", NULL},
    {"next_seq", (getter)get_next_seq, NULL, "the seq the next publish gives", NULL},
    {"last_slot", (getter)get_last_slot, NULL, "the slot last published", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot producer_slots[] = {
    {Py_tp_doc, "Producer(session, acceptor): the producer's calls (c/src/producer.c) over "
                "a PublisherSession and its Acceptor."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, producer_init},
    {Py_tp_dealloc, producer_dealloc},
    {Py_tp_methods, producer_methods},
    {Py_tp_getset, producer_getset},
    {0, NULL},
};

static PyType_Spec producer_spec = {
    "cupy_ipcpool._engine.Producer",
    sizeof(Producer),
    0,
    Py_TPFLAGS_DEFAULT,
    producer_slots,
};

/* UsageError(message); -1. */
static int
usage(PyObject *module, const char *message)
{
    engine_state *es = (engine_state *)PyModule_GetState(module);
    PyErr_SetString(es->usage_error, message);
    return -1;
}

/* A count argument as uint32 (its range checked by the rule, not here); 0 or -1. */
static int
count_arg(PyObject *module, PyObject *obj, const char *name, uint32_t *out)
{
    PyObject *index = PyNumber_Index(obj); /* an int, or what says it is one (numpy's) */
    if (index == NULL) {
        engine_state *es = (engine_state *)PyModule_GetState(module);
        PyObject *cls = PyObject_GetAttrString(es->errors, "UsageTypeError");
        if (cls != NULL) {
            PyErr_Format(cls, "%s must be an int, not %.80s", name, Py_TYPE(obj)->tp_name);
            Py_DECREF(cls);
        }
        return -1;
    }
    long long v = PyLong_AsLongLong(index);
    Py_DECREF(index);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        v = -1; /* out of range either way */
    }
    if (v < 0 || v > (long long)UINT32_MAX) {
        char message[160];
        snprintf(message, sizeof message, "%s must be a count, not %lld", name, v);
        return usage(module, message);
    }
    *out = (uint32_t)v;
    return 0;
}

/* Seconds as a double (NaN and infinities refused by the rule); 0 or -1. */
static int
seconds_arg(PyObject *obj, double *out)
{
    double v = PyFloat_AsDouble(obj);
    if (v == -1.0 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

static PyObject *
check_publisher_options(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"num_slots",    "max_subscribers",   "max_credit",
                            "lease_timeout", "send_timeout",     "handshake_timeout",
                            "max_pending_per_uid", NULL};
    PyObject *num_slots, *max_subscribers, *max_credit, *lease_timeout, *send_timeout,
        *handshake_timeout, *per_uid;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$OOOOOOO:check_publisher_options", names,
                                     &num_slots, &max_subscribers, &max_credit, &lease_timeout,
                                     &send_timeout, &handshake_timeout, &per_uid))
        return NULL;
    cip_pub_options o;
    cip_pub_options_init(&o);
    if (count_arg(module, num_slots, "num_slots", &o.num_slots) < 0 ||
        count_arg(module, max_subscribers, "max_subscribers", &o.max_subscribers) < 0 ||
        count_arg(module, per_uid, "max_pending_per_uid", &o.max_pending_per_uid) < 0 ||
        seconds_arg(send_timeout, &o.send_timeout_s) < 0 ||
        seconds_arg(handshake_timeout, &o.handshake_timeout_s) < 0)
        return NULL;
    /* Python says "no limit" and "the default" with None, where C says 0 */
    if (max_credit != Py_None) {
        if (count_arg(module, max_credit, "max_credit", &o.max_credit) < 0)
            return NULL;
        if (o.max_credit == 0 && usage(module, "max_credit must be at least 1 (None: the "
                                               "default), not 0") < 0)
            return NULL;
    }
    if (lease_timeout != Py_None) {
        if (seconds_arg(lease_timeout, &o.lease_timeout_s) < 0)
            return NULL;
        if (!(o.lease_timeout_s > 0.0)) { /* (too long: the rule's) */
            PyErr_Format(((engine_state *)PyModule_GetState(module))->usage_error,
                         "lease_timeout must be positive seconds or None (no limit), not %R",
                         lease_timeout);
            return NULL;
        }
    }
    if (cipi_pub_check_options(&o) != CIP_OK) {
        usage(module, cip_last_error());
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef producer_functions[] = {
    {"check_publisher_options", (PyCFunction)(void (*)(void))check_publisher_options,
     METH_VARARGS | METH_KEYWORDS,
     "check_publisher_options(*, num_slots, max_subscribers, max_credit, lease_timeout, "
     "send_timeout, handshake_timeout, max_pending_per_uid): UsageError unless a publisher "
     "can be made with these (the C API's rule, cipi_pub_check_options; None: the default "
     "max_credit, no lease timeout)."},
    {NULL, NULL, 0, NULL},
};

int
cipy_producer_exec(PyObject *module)
{
    if (PyModule_AddFunctions(module, producer_functions) < 0)
        return -1;
    return cipy_add_type(module, &producer_spec, "Producer");
}
