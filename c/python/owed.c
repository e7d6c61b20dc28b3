/*
 * cupy_ipcpool._engine.OwedReleases: the RELEASEs a Python subscriber owes (c/src/owed.c,
 * the C subscriber's too): sent without waiting, kept in order while the publisher's
 * socket is full, and at most MAX_CREDIT + num_slots of them.
 *
 * Every method runs under the GIL and never releases it (each send is MSG_DONTWAIT), so
 * a release from another thread and a receive's flush see the queue one call at a time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_memop_args.h"
#include "cip_internal.h"
#include "engine.h"

typedef struct {
    PyObject_HEAD
    struct cipi_owed owed;
    int ready;
} OwedReleases;

static engine_state *
state(OwedReleases *self)
{
    return (engine_state *)PyType_GetModuleState(Py_TYPE(self));
}

static int
owed_init(OwedReleases *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"num_slots", NULL};
    long long num_slots;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L:OwedReleases", names, &num_slots))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "OwedReleases is initialised once");
        return -1;
    }
    if (num_slots < 1 || num_slots > CIP_WIRE_MAX_SLOTS) {
        PyErr_Format(state(self)->usage_error, "a ring has 1..%u slots, not %lld",
                     CIP_WIRE_MAX_SLOTS, num_slots);
        return -1;
    }
    cipi_owed_init(&self->owed, (uint32_t)num_slots);
    self->ready = 1;
    return 0;
}

static void
owed_dealloc(OwedReleases *self)
{
    cipi_owed_free(&self->owed);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* fd, seq and slot from args[0..2] (the fd only where want is 1). */
static int
parse(OwedReleases *self, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
      const char *signature, int *fd, uint64_t *seq, uint32_t *slot)
{
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "OwedReleases was not initialised");
        return -1;
    }
    if (check_nargs(nargs, want, signature) < 0)
        return -1;
    Py_ssize_t i = 0;
    if (fd != NULL) {
        long v = PyLong_AsLong(args[i++]);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (v < 0 || v > INT_MAX) {
            PyErr_Format(PyExc_ValueError, "%s: not an fd: %ld", signature, v);
            return -1;
        }
        *fd = (int)v;
    }
    if (seq != NULL) {
        unsigned long long s = PyLong_AsUnsignedLongLong(args[i++]);
        if (s == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        unsigned long sl = PyLong_AsUnsignedLong(args[i]);
        if (sl == (unsigned long)-1 && PyErr_Occurred())
            return -1;
        if (sl > UINT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "%s: slot %lu does not fit in 32 bits", signature,
                         sl);
            return -1;
        }
        *seq = s;
        *slot = (uint32_t)sl;
    }
    return 0;
}

/* The error of keeping a RELEASE (c/src/owed.c's words): TransportError past the limit. */
static PyObject *
keep_failed(OwedReleases *self, cip_status st)
{
    if (st == CIP_ERR_NO_MEMORY)
        return PyErr_NoMemory();
    PyObject *exc = PyObject_CallFunction(state(self)->transport_error, "is", ENOBUFS,
                                          cip_last_error());
    if (exc != NULL) {
        PyErr_SetObject(state(self)->transport_error, exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static PyObject *
send_failed(int err)
{
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

PyDoc_STRVAR(send_doc,
"send(fd, seq, slot, /) -> bool\n\n"
"The RELEASE of frame ``seq`` in ``slot`` on the socket ``fd``, behind every one owed,\n"
"without waiting: True if it went (with every one owed), False if it is owed now (the\n"
"socket is full).  ``TransportError`` (``ENOBUFS``) if ``MAX_CREDIT + num_slots`` are\n"
"owed already (nothing sent or kept); ``OSError`` if a send failed other than for\n"
"room (what was not sent is still owed).");

static PyObject *
owed_send(OwedReleases *self, PyObject *const *args, Py_ssize_t nargs)
{
    int fd, sent;
    uint64_t seq;
    uint32_t slot;
    if (parse(self, args, nargs, 3, "send(fd, seq, slot)", &fd, &seq, &slot) < 0)
        return NULL;
    cip_status st = cipi_owed_send(&self->owed, fd, seq, slot, &sent);
    if (st != CIP_OK)
        return keep_failed(self, st);
    if (sent < 0)
        return send_failed(errno);
    return PyBool_FromLong(sent);
}

PyDoc_STRVAR(owe_doc,
"owe(seq, slot, /)\n\n"
"Keep the RELEASE of frame ``seq`` in ``slot`` behind those owed (its send found the\n"
"socket full).  ``TransportError`` (``ENOBUFS``) past ``MAX_CREDIT + num_slots``.");

static PyObject *
owed_owe(OwedReleases *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t seq;
    uint32_t slot;
    if (parse(self, args, nargs, 2, "owe(seq, slot)", NULL, &seq, &slot) < 0)
        return NULL;
    cip_status st = cipi_owed_push(&self->owed, seq, slot);
    if (st != CIP_OK)
        return keep_failed(self, st);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(flush_doc,
"flush(fd, /) -> bool\n\n"
"Send what is owed, oldest first, as far as the socket ``fd`` takes it now: True when\n"
"none is owed any more, False when the socket is full (the rest kept, in order).\n"
"``OSError`` if a send failed other than for room (the rest kept).");

static PyObject *
owed_flush(OwedReleases *self, PyObject *const *args, Py_ssize_t nargs)
{
    int fd;
    if (parse(self, args, nargs, 1, "flush(fd)", &fd, NULL, NULL) < 0)
        return NULL;
    int r = cipi_owed_flush(&self->owed, fd);
    if (r < 0)
        return send_failed(errno);
    return PyBool_FromLong(r);
}

PyDoc_STRVAR(clear_doc, "clear()\n\nForget what is owed (the connection ended).");

static PyObject *
owed_clear(OwedReleases *self, PyObject *Py_UNUSED(ignored))
{
    cipi_owed_clear(&self->owed);
    Py_RETURN_NONE;
}

static PyObject *
owed_get_pending(OwedReleases *self, void *Py_UNUSED(closure))
{
    PyObject *out = PyList_New((Py_ssize_t)self->owed.len);
    for (size_t i = 0; out != NULL && i < self->owed.len; i++) {
        const struct owed_release *r = &self->owed.ring[(self->owed.head + i) % self->owed.alloc];
        PyObject *pair = Py_BuildValue("(KI)", (unsigned long long)r->seq, (unsigned)r->slot);
        if (pair == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, pair);
    }
    return out;
}

static PyObject *
owed_get_limit(OwedReleases *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(self->owed.limit);
}

static Py_ssize_t
owed_len(OwedReleases *self)
{
    return (Py_ssize_t)self->owed.len;
}

static PyMethodDef owed_methods[] = {
    {"send", (PyCFunction)(void (*)(void))owed_send, METH_FASTCALL, send_doc},
    {"owe", (PyCFunction)(void (*)(void))owed_owe, METH_FASTCALL, owe_doc},
    {"flush", (PyCFunction)(void (*)(void))owed_flush, METH_FASTCALL, flush_doc},
    {"clear", (PyCFunction)owed_clear, METH_NOARGS, clear_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef owed_getset[] = {
    {"pending", (getter)owed_get_pending, NULL, "the (seq, slot) owed, oldest first", NULL},
    {"limit", (getter)owed_get_limit, NULL, "the most that may be owed", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot owed_slots[] = {
    {Py_tp_doc, "OwedReleases(num_slots): the RELEASEs a subscriber owes (c/src/owed.c): "
                "sent without waiting, kept in order while the socket is full, bounded."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, owed_init},
    {Py_tp_dealloc, owed_dealloc},
    {Py_tp_methods, owed_methods},
    {Py_tp_getset, owed_getset},
    {Py_sq_length, owed_len},
    {0, NULL},
};

static PyType_Spec owed_spec = {
    "cupy_ipcpool._engine.OwedReleases",
    sizeof(OwedReleases),
    0,
    Py_TPFLAGS_DEFAULT,
    owed_slots,
};

int
cipy_owed_exec(PyObject *module)
{
    return cipy_add_type(module, &owed_spec, "OwedReleases");
}
