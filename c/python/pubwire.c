/*
 * cupy_ipcpool._engine.PublisherWire: the publisher's per-frame wire (c/src/pub_wire.c) over
 * a LeaseCore, for the Python publisher: the FRAME to every receiver the lease book names,
 * and the subscribers' messages, each RELEASE into the book.  What ends a subscriber comes
 * back as (sub_id, errno, why) for the caller, which drops it.
 *
 * Every method runs under the GIL; take() releases it only while it waits in ppoll, and
 * meanwhile the wire refuses every other call (the set being polled must not change).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_memop_args.h"
#include "cip_internal.h"
#include "engine.h"

typedef struct {
    PyObject_HEAD
    PyObject *core; /* the LeaseCore whose book this wire reads and writes */
    struct cipi_leasebook *book;
    struct cipi_pubwire wire;
    int polling; /* take() waits, the GIL released */
} PublisherWire;

static engine_state *
state(PublisherWire *self)
{
    return (engine_state *)PyType_GetModuleState(Py_TYPE(self));
}

static int
wire_init(PublisherWire *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"lease_core", NULL};
    PyObject *core;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:PublisherWire", names, &core))
        return -1;
    if (self->core != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PublisherWire is initialised once");
        return -1;
    }
    if ((self->book = cipy_leasebook_of(state(self), core)) == NULL)
        return -1;
    Py_INCREF(core);
    self->core = core;
    return 0;
}

static void
wire_dealloc(PublisherWire *self)
{
    cipi_pubwire_free(&self->wire);
    Py_XDECREF(self->core);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* 0 when the wire may be used now, else -1 with an exception. */
static int
usable(PublisherWire *self)
{
    if (self->core == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "PublisherWire is not initialised");
        return -1;
    }
    if (self->polling) {
        PyErr_SetString(PyExc_RuntimeError,
                        "PublisherWire is waiting (take, send_within) on another thread (one owner calls it)");
        return -1;
    }
    return 0;
}

/* The exception of status st, in the engine's words; NULL. */
static PyObject *
fail(PublisherWire *self, cip_status st)
{
    if (st == CIP_ERR_NO_MEMORY)
        return PyErr_NoMemory();
    const char *name = st == CIPI_ERR_LEASE_STATE  ? "LeaseStateError"
                       : st == CIPI_ERR_SLOT_INDEX ? "SlotIndexError"
                       : st == CIP_ERR_PROTOCOL    ? "ProtocolError"
                                                   : "UsageError";
    PyObject *cls = PyObject_GetAttrString(state(self)->errors, name);
    if (cls != NULL) {
        PyErr_SetString(cls, cip_last_error());
        Py_DECREF(cls);
    }
    return NULL;
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

/* The events of the last send or take: None when there are none, else a list. */
static PyObject *
events(PublisherWire *self)
{
    if (self->wire.nevents == 0)
        Py_RETURN_NONE;
    PyObject *out = PyList_New(self->wire.nevents);
    for (uint32_t i = 0; out != NULL && i < self->wire.nevents; i++) {
        const struct cipi_pubevent *ev = &self->wire.events[i];
        PyObject *item = Py_BuildValue("(kis)", (unsigned long)ev->sub_id, ev->err, ev->why);
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

static PyObject *
wire_add(PublisherWire *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t id;
    if (usable(self) < 0 || check_nargs(nargs, 2, "add(sub_id, fd)") < 0 ||
        as_sub_id(args[0], &id) < 0)
        return NULL;
    int fd = PyObject_AsFileDescriptor(args[1]);
    if (fd < 0)
        return NULL;
    cip_status st = cipi_pubwire_add(&self->wire, id, fd);
    if (st != CIP_OK)
        return fail(self, st);
    Py_RETURN_NONE;
}

static PyObject *
wire_remove(PublisherWire *self, PyObject *arg)
{
    uint32_t id;
    if (usable(self) < 0 || as_sub_id(arg, &id) < 0)
        return NULL;
    return PyBool_FromLong(cipi_pubwire_remove(&self->wire, id));
}

static PyObject *
wire_clear(PublisherWire *self, PyObject *Py_UNUSED(arg))
{
    if (usable(self) < 0)
        return NULL;
    self->wire.n = 0;
    Py_RETURN_NONE;
}

static PyObject *
wire_send(PublisherWire *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (usable(self) < 0 || check_nargs(nargs, 5, "send(slot, seq, now, on_schedule, payload)") < 0)
        return NULL;
    long long slot = PyLong_AsLongLong(args[0]);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    cip_status st = cipi_leases_check_slot(self->book, slot);
    if (st != CIP_OK)
        return fail(self, st);
    unsigned long long seq = PyLong_AsUnsignedLongLong(args[1]);
    if (seq == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    double now = PyFloat_AsDouble(args[2]);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    int on_schedule = PyObject_IsTrue(args[3]);
    if (on_schedule < 0)
        return NULL;
    if (!PyBytes_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "send: payload must be bytes");
        return NULL;
    }
    st = cipi_pubwire_send(&self->wire, self->book, (uint32_t)slot, seq, now, on_schedule,
                           PyBytes_AS_STRING(args[4]), (size_t)PyBytes_GET_SIZE(args[4]));
    if (st != CIP_OK)
        return fail(self, st);
    return events(self);
}

static PyObject *
wire_send_within(PublisherWire *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t id;
    if (usable(self) < 0 ||
        check_nargs(nargs, 5, "send_within(sub_id, seq, slot, payload, timeout)") < 0 ||
        as_sub_id(args[0], &id) < 0)
        return NULL;
    unsigned long long seq = PyLong_AsUnsignedLongLong(args[1]);
    if (seq == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    long long slot = PyLong_AsLongLong(args[2]);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    cip_status st = cipi_leases_check_slot(self->book, slot);
    if (st != CIP_OK)
        return fail(self, st);
    if (!PyBytes_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "send_within: payload must be bytes");
        return NULL;
    }
    Py_ssize_t len = PyBytes_GET_SIZE(args[3]);
    if ((st = cipi_frame_payload_fits((size_t)len)) != CIP_OK)
        return fail(self, st);
    double timeout = PyFloat_AsDouble(args[4]);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    if (!(timeout >= 0.0) || timeout > 1e9) {
        PyErr_Format(PyExc_ValueError, "send_within: timeout %R is not 0..1e9 seconds", args[4]);
        return NULL;
    }
    long long deadline = cipi_now_ns() + (long long)(timeout * 1e9);
    /* the payload stays alive and unchanged: bytes, referenced by the caller's frame */
    const char *data = PyBytes_AS_STRING(args[3]);
    int err;
    for (;;) {
        long long left = deadline - cipi_now_ns();
        self->polling = 1;
        Py_BEGIN_ALLOW_THREADS
        err = cipi_pubwire_send_within(&self->wire, id, seq, (uint32_t)slot, data, (size_t)len,
                                       left > 0 ? left : 0);
        Py_END_ALLOW_THREADS
        self->polling = 0;
        if (err != EINTR)
            break;
        if (PyErr_CheckSignals() < 0)
            return NULL;
    }
    return PyLong_FromLong(err);
}

static PyObject *
wire_take(PublisherWire *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (usable(self) < 0 || check_nargs(nargs, 2, "take(timeout_us, limit)") < 0)
        return NULL;
    long long timeout_us = PyLong_AsLongLong(args[0]);
    if (timeout_us == -1 && PyErr_Occurred())
        return NULL;
    long limit = PyLong_AsLong(args[1]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    if (timeout_us < -1) {
        PyErr_Format(PyExc_ValueError, "take: timeout_us %lld (-1 waits without limit)",
                     timeout_us);
        return NULL;
    }
    if (limit < 1) {
        PyErr_SetString(PyExc_ValueError, "take: limit must be at least 1");
        return NULL;
    }
    long long wait_ns = timeout_us < 0 || timeout_us > LLONG_MAX / 2000 ? -1 : timeout_us * 1000;
    long long deadline = wait_ns > 0 ? cipi_now_ns() + wait_ns : 0;
    int r;
    for (;;) {
        if (wait_ns == 0) {
            r = cipi_pubwire_poll(&self->wire, 0); /* no wait: the GIL stays */
        } else {
            self->polling = 1;
            Py_BEGIN_ALLOW_THREADS
            r = cipi_pubwire_poll(&self->wire, wait_ns);
            Py_END_ALLOW_THREADS
            self->polling = 0;
        }
        if (r != -EINTR)
            break;
        if (PyErr_CheckSignals() < 0)
            return NULL;
        if (wait_ns > 0 && (wait_ns = deadline - cipi_now_ns()) <= 0)
            wait_ns = 0;
    }
    if (r < 0) {
        errno = -r;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (r == 0) {
        self->wire.nevents = 0;
        Py_RETURN_NONE;
    }
    uint32_t taken;
    cip_status st = cipi_pubwire_take(&self->wire, self->book, limit, &taken);
    if (st != CIP_OK)
        return fail(self, st);
    return events(self);
}

static PyObject *
wire_len(PublisherWire *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLong(self->wire.n);
}

static PyMethodDef wire_methods[] = {
    {"add", (PyCFunction)(void (*)(void))wire_add, METH_FASTCALL,
     "add(sub_id, fd): read subscriber sub_id's messages from fd, and send it its frames "
     "(the fd stays the caller's)."},
    {"remove", (PyCFunction)wire_remove, METH_O,
     "remove(sub_id) -> bool: stop reading it (True when it was on the wire)."},
    {"clear", (PyCFunction)wire_clear, METH_NOARGS, "clear(): take every subscriber off."},
    {"send", (PyCFunction)(void (*)(void))wire_send, METH_FASTCALL,
     "send(slot, seq, now, on_schedule, payload) -> list | None: publish frame seq in slot "
     "(LeaseCore.publishing decides who receives it) and send its FRAME to each receiver "
     "without waiting; a full 'latest' socket skips the frame.  None when nothing else "
     "failed, else [(sub_id, errno, why)] to drop (errno EAGAIN: its socket is full)."},
    {"send_within", (PyCFunction)(void (*)(void))wire_send_within, METH_FASTCALL,
     "send_within(sub_id, seq, slot, payload, timeout) -> int: the FRAME to one subscriber "
     "whose socket was full, waiting (the GIL released) up to timeout seconds for room; 0 "
     "sent, ETIMEDOUT (its socket stayed full: evict it), EBADF (not on the wire), or the "
     "errno of a failed send."},
    {"take", (PyCFunction)(void (*)(void))wire_take, METH_FASTCALL,
     "take(timeout_us, limit) -> list | None: wait up to timeout_us (-1: without limit; the "
     "GIL released) for a readable socket, then take up to limit messages from each, each "
     "RELEASE into the lease book.  None when nothing ends a subscriber, else "
     "[(sub_id, errno, why)] to drop: a BYE, a hang-up, a message a subscriber may not send, "
     "a RELEASE the book refuses, a failed receive."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef wire_getset[] = {
    {"count", (getter)wire_len, NULL, "subscribers on the wire", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot wire_slots[] = {
    {Py_tp_doc, "PublisherWire(lease_core): the publisher's FRAMEs and its subscribers' "
                "messages (c/src/pub_wire.c), over the lease book of lease_core."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, wire_init},
    {Py_tp_dealloc, wire_dealloc},
    {Py_tp_methods, wire_methods},
    {Py_tp_getset, wire_getset},
    {0, NULL},
};

static PyType_Spec wire_spec = {
    "cupy_ipcpool._engine.PublisherWire",
    sizeof(PublisherWire),
    0,
    Py_TPFLAGS_DEFAULT,
    wire_slots,
};

int
cipy_pubwire_exec(PyObject *module)
{
    return cipy_add_type(module, &wire_spec, "PublisherWire");
}
