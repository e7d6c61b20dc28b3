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

/* 0 when the producer may be used now, else -1 with an exception. */
static int
usable(Producer *self)
{
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Producer is not initialised");
        return -1;
    }
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
    long long wait_ns;
    if (usable(self) < 0 || check_nargs(nargs, 3, "poll(timeout_us, spin_ns, settle)") < 0 ||
        cipy_wait_arg(args[0], "poll", &wait_ns) < 0)
        return NULL;
    long long spin_ns = PyLong_AsLongLong(args[1]);
    if (spin_ns == -1 && PyErr_Occurred())
        return NULL;
    int settle = PyObject_IsTrue(args[2]);
    if (settle < 0)
        return NULL;
    uint64_t returned;
    *self->busy = 1;
    cip_status st = cipi_producer_poll(&self->prod, wait_ns, spin_ns < 0 ? 0 : spin_ns, settle,
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

/* (joined, gone, left), taken; NULL on failure (what was not made into a list is lost:
 * only out of memory fails, and their fds are closed). */
static PyObject *
news(Producer *self)
{
    struct cipi_welcomed *joined, *gone;
    size_t njoined, ngone;
    cipi_producer_take_news(&self->prod, &joined, &njoined, &gone, &ngone);
    PyObject *gone_list = cipy_welcomed_list(gone, ngone);
    PyObject *joined_list = cipy_welcomed_list(joined, njoined);
    PyObject *left = cipy_departures(self->prod.s);
    if (gone_list == NULL || joined_list == NULL || left == NULL) {
        Py_XDECREF(gone_list);
        Py_XDECREF(joined_list);
        Py_XDECREF(left);
        return NULL;
    }
    if (left == Py_None) {
        Py_DECREF(left);
        left = PyList_New(0);
        if (left == NULL) {
            Py_DECREF(gone_list);
            Py_DECREF(joined_list);
            return NULL;
        }
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
     "peer_pid, row)), and those that left, [(sub_id, why)]; None: nothing."},
    {"stop", (PyCFunction)producer_stop, METH_NOARGS,
     "stop() -> (joined, gone, left): stop the accept thread; the welcomed not yet adopted "
     "join the session for its BYE, without being told as joined; then news()."},
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

int
cipy_producer_exec(PyObject *module)
{
    return cipy_add_type(module, &producer_spec, "Producer");
}
