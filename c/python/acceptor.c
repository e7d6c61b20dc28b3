/*
 * cupy_ipcpool._engine.Acceptor: the publisher's listening side (c/src/acceptor.c) for the
 * Python publisher: the accept thread, admission, the HELLO, the WELCOME composed from data.
 *
 * The thread is C and never touches Python: it calls no user code and takes no GIL; the
 * rows of read flags it hands out are a ReaderRows, reached through its mutex
 * (cipy_rows_hooks).  Every method runs under the GIL and never waits but stop(), which
 * joins the thread with the GIL released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cip_internal.h"
#include "engine.h"

typedef struct {
    PyObject_HEAD
    struct cipi_acceptor *acc; /* NULL until initialised */
    PyObject *rows; /* the ReaderRows the hooks reach (kept alive), or NULL */
    int ready;
} Acceptor;

static const char *const MODE_NAMES[3] = {"block", "latest", "ahead"};

static engine_state *
state(Acceptor *self)
{
    return (engine_state *)PyType_GetModuleState(Py_TYPE(self));
}

static PyObject *
usage(Acceptor *self, const char *message)
{
    PyErr_SetString(state(self)->usage_error, message);
    return NULL;
}

/* `refuse` ({mode name: reason}) into cfg->refuse; 0 or -1 */
static int
refuse_arg(Acceptor *self, PyObject *refuse, struct cipi_acceptor_config *cfg)
{
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    if (!PyDict_Check(refuse)) {
        PyErr_SetString(PyExc_TypeError, "refuse must be a dict of mode name: reason");
        return -1;
    }
    while (PyDict_Next(refuse, &pos, &key, &value)) {
        int m = -1;
        for (int i = 0; i < 3 && PyUnicode_Check(key); i++)
            if (PyUnicode_CompareWithASCIIString(key, MODE_NAMES[i]) == 0)
                m = i;
        if (m < 0) {
            PyErr_Format(state(self)->usage_error, "refuse names no mode: %R", key);
            return -1;
        }
        if (!PyUnicode_Check(value)) {
            PyErr_SetString(PyExc_TypeError, "each refuse reason must be a str");
            return -1;
        }
        if ((cfg->refuse[m] = PyUnicode_AsUTF8(value)) == NULL)
            return -1;
    }
    return 0;
}

/* A sequence of ints into a malloc'd array of `size`-byte elements (int or uint32_t). */
static void *
ints_arg(PyObject *obj, const char *what, size_t *n, int as_u32)
{
    PyObject *seq = PySequence_Fast(obj, what);
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    void *out = PyMem_Malloc((len ? (size_t)len : 1) * sizeof(uint32_t));
    if (out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if ((v == -1 && PyErr_Occurred()) || v < 0 || v > (as_u32 ? UINT32_MAX : INT_MAX)) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "%s: %lld is out of range", what, v);
            Py_DECREF(seq);
            PyMem_Free(out);
            return NULL;
        }
        if (as_u32)
            ((uint32_t *)out)[i] = (uint32_t)v;
        else
            ((int *)out)[i] = (int)v;
    }
    Py_DECREF(seq);
    *n = (size_t)len;
    return out;
}

static int
acceptor_init(Acceptor *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"listener",        "num_slots",   "payload",
                            "fds",             "rows",        "row_at",
                            "refuse",          "allowed_uids", "max_subscribers",
                            "max_credit",      "lease_timeout_ms", "handshake_timeout",
                            "max_pending_per_uid", NULL};
    struct cipi_acceptor_config cfg;
    memset(&cfg, 0, sizeof cfg);
    Py_buffer payload;
    PyObject *fds, *rows, *refuse, *uids;
    double handshake_timeout;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Acceptor is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i$Iy*OOlOOIIIdI:Acceptor", names, &cfg.listener,
                                     &cfg.num_slots, &payload, &fds, &rows, &cfg.row_at, &refuse,
                                     &uids, &cfg.max_subscribers, &cfg.max_credit,
                                     &cfg.lease_timeout_ms, &handshake_timeout, &cfg.per_uid))
        return -1;
    int *fd_list = NULL;
    uint32_t *uid_list = NULL;
    int rc = -1;
    if (!(handshake_timeout > 0 && handshake_timeout < 1e9)) {
        usage(self, "handshake_timeout must be positive seconds");
        goto out;
    }
    cfg.handshake_ns = (long long)(handshake_timeout * 1e9);
    cfg.payload = payload.buf;
    cfg.payload_len = (size_t)payload.len;
    if ((fd_list = ints_arg(fds, "fds must be a sequence of fds", &cfg.nfds, 0)) == NULL ||
        (uid_list = ints_arg(uids, "allowed_uids must be a sequence of uids", &cfg.nuids, 1)) ==
            NULL ||
        refuse_arg(self, refuse, &cfg) < 0)
        goto out;
    cfg.fds = fd_list;
    cfg.uids = uid_list;
    if (rows != Py_None) {
        PyObject *module = PyType_GetModule(Py_TYPE(self));
        if (module == NULL || cipy_rows_hooks(module, rows, &cfg.hooks) < 0)
            goto out;
    } else {
        cfg.row_at = -1;
    }
    if (cipi_acceptor_new(&cfg, &self->acc) != CIP_OK) {
        usage(self, cip_last_error());
        goto out;
    }
    if (rows != Py_None) {
        Py_INCREF(rows);
        self->rows = rows;
    }
    self->ready = 1;
    rc = 0;
out:
    PyBuffer_Release(&payload);
    PyMem_Free(fd_list);
    PyMem_Free(uid_list);
    return rc;
}

static void
acceptor_dealloc(Acceptor *self)
{
    if (self->ready) {
        Py_BEGIN_ALLOW_THREADS
        cipi_acceptor_free(self->acc); /* joins the thread; closes what is left */
        Py_END_ALLOW_THREADS
    }
    Py_XDECREF(self->rows);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static int
ready(Acceptor *self)
{
    if (self->ready)
        return 0;
    usage(self, "the Acceptor is not initialised");
    return -1;
}

static PyObject *
acceptor_start(Acceptor *self, PyObject *Py_UNUSED(arg))
{
    if (ready(self) < 0)
        return NULL;
    if (cipi_acceptor_start(self->acc) != CIP_OK)
        return usage(self, cip_last_error());
    Py_RETURN_NONE;
}

/* [(sub_id, fd, pid, uid, mode, credit, hello, peer_pid, row)] of `n` welcomed (their fds
 * the caller's once this returns; on failure every fd is closed). */
PyObject *
cipy_welcomed_tuple(const struct cipi_welcomed *w)
{
    PyObject *row = w->row < 0 ? Py_NewRef(Py_None) : PyLong_FromLong(w->row);
    if (row == NULL)
        return NULL;
    return Py_BuildValue("(IiiIsIy#iN)", w->sub_id, w->fd, w->pid, w->uid, MODE_NAMES[w->mode],
                         w->credit, (const char *)w->hello, (Py_ssize_t)w->hello_len,
                         w->peer_pid, row);
}

PyObject *
cipy_welcomed_list(struct cipi_welcomed *w, size_t n)
{
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out != NULL && i < n; i++) {
        PyObject *t = cipy_welcomed_tuple(&w[i]);
        if (t == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, t);
    }
    if (out != NULL)
        for (size_t i = 0; i < n; i++)
            w[i].fd = -1; /* the caller's */
    cipi_acceptor_free_list(w, n);
    return out;
}

static PyObject *
acceptor_take(Acceptor *self, PyObject *Py_UNUSED(arg))
{
    if (ready(self) < 0)
        return NULL;
    struct cipi_welcomed *pending, *gone;
    size_t npending, ngone;
    cipi_acceptor_take(self->acc, &pending, &npending, &gone, &ngone);
    PyObject *gone_list = cipy_welcomed_list(gone, ngone);
    if (gone_list == NULL) {
        cipi_acceptor_free_list(pending, npending);
        return NULL;
    }
    PyObject *new_list = cipy_welcomed_list(pending, npending);
    if (new_list == NULL) {
        Py_DECREF(gone_list);
        return NULL;
    }
    return Py_BuildValue("(NN)", new_list, gone_list);
}

static PyObject *
acceptor_dropped(Acceptor *self, PyObject *Py_UNUSED(arg))
{
    if (ready(self) < 0)
        return NULL;
    cipi_acceptor_dropped(self->acc);
    Py_RETURN_NONE;
}

static PyObject *
acceptor_stop(Acceptor *self, PyObject *Py_UNUSED(arg))
{
    if (ready(self) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    cipi_acceptor_stop(self->acc);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
acceptor_handshakes(Acceptor *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (ready(self) < 0)
        return NULL;
    long long uid = -1;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "pending_handshakes(uid=None) takes at most 1 argument");
        return NULL;
    }
    if (nargs == 1 && args[0] != Py_None) {
        uid = PyLong_AsLongLong(args[0]);
        if (uid == -1 && PyErr_Occurred())
            return NULL;
        if (uid < 0 || uid > UINT32_MAX)
            return PyLong_FromLong(0);
    }
    return PyLong_FromSize_t(cipi_acceptor_handshakes(self->acc, uid));
}

static PyObject *
get_news(Acceptor *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->ready && cipi_acceptor_news(self->acc));
}

static PyObject *
get_next_seq(Acceptor *self, void *Py_UNUSED(closure))
{
    if (!self->ready)
        return PyLong_FromLong(0);
    return PyLong_FromUnsignedLongLong(cipi_acceptor_next_seq(self->acc));
}

static int
set_next_seq(Acceptor *self, PyObject *value, void *Py_UNUSED(closure))
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "next_seq cannot be deleted");
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(value);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (ready(self) < 0)
        return -1;
    cipi_acceptor_set_next_seq(self->acc, (uint64_t)v);
    return 0;
}

static PyObject *
get_welcomed(Acceptor *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(self->ready ? cipi_acceptor_welcomed(self->acc) : 0);
}

static PyObject *
get_failure(Acceptor *self, void *Py_UNUSED(closure))
{
    /* written by the thread before it ends; read here once it has (stop joins it) */
    const char *why = self->ready ? cipi_acceptor_failure(self->acc) : NULL;
    if (why == NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromString(why);
}

static PyMethodDef acceptor_methods[] = {
    {"start", (PyCFunction)acceptor_start, METH_NOARGS, "start(): start the accept thread."},
    {"take", (PyCFunction)acceptor_take, METH_NOARGS,
     "take() -> (welcomed, gone): the subscribers welcomed since the last take (their fds "
     "the caller's) and those that went before they were taken (fd -1, row given back), each "
     "(sub_id, fd, pid, uid, mode, credit, hello, peer_pid, row)."},
    {"dropped", (PyCFunction)acceptor_dropped, METH_NOARGS,
     "dropped(): a subscriber taken has gone (it no longer counts to max_subscribers)."},
    {"stop", (PyCFunction)acceptor_stop, METH_NOARGS,
     "stop(): welcome nobody more: join the thread (the handshakes in progress end without a "
     "WELCOME), close the listener; what is pending is left for a last take().  Idempotent."},
    {"pending_handshakes", (PyCFunction)(void (*)(void))acceptor_handshakes, METH_FASTCALL,
     "pending_handshakes(uid=None) -> int: handshakes in progress (of uid, or in all)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef acceptor_getset[] = {
    {"news", (getter)get_news, NULL, "whether take() has something", NULL},
    {"next_seq", (getter)get_next_seq, (setter)set_next_seq,
     "the next frame's seq, told in each WELCOME (the producer's to set)", NULL},
    {"welcomed", (getter)get_welcomed, NULL, "subscribers given an id so far", NULL},
    {"failure", (getter)get_failure, NULL,
     "why the thread ended before it was stopped (None: it did not)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot acceptor_slots[] = {
    {Py_tp_doc, "Acceptor(listener, *, num_slots, payload, fds, rows, row_at, refuse, "
                "allowed_uids, max_subscribers, max_credit, lease_timeout_ms, handshake_timeout, "
                "max_pending_per_uid): the publisher's accept thread (c/src/acceptor.c); it "
                "owns the listener from here on."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, acceptor_init},
    {Py_tp_dealloc, acceptor_dealloc},
    {Py_tp_methods, acceptor_methods},
    {Py_tp_getset, acceptor_getset},
    {0, NULL},
};

static PyType_Spec acceptor_spec = {
    "cupy_ipcpool._engine.Acceptor",
    sizeof(Acceptor),
    0,
    Py_TPFLAGS_DEFAULT,
    acceptor_slots,
};

struct cipi_acceptor *
cipy_acceptor_of(engine_state *es, PyObject *obj)
{
    if (!PyObject_TypeCheck(obj, (PyTypeObject *)es->acceptor)) {
        PyErr_Format(PyExc_TypeError, "an Acceptor is needed, not %.100s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    Acceptor *self = (Acceptor *)obj;
    return ready(self) < 0 ? NULL : self->acc;
}

int
cipy_acceptor_exec(PyObject *module)
{
    engine_state *es = (engine_state *)PyModule_GetState(module);
    if (cipy_add_type(module, &acceptor_spec, "Acceptor") < 0)
        return -1;
    es->acceptor = PyObject_GetAttrString(module, "Acceptor");
    return es->acceptor == NULL ? -1 : 0;
}
