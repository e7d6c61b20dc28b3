/*
 * cupy_ipcpool._engine.AdmissionBook: connections waiting, per group, each with one deadline
 * (c/src/admission.c), for the serving threads written in Python (the fd server, the remote
 * server), which wrap it as cupy_ipcpool._transport.Admission.  The publisher's accept
 * thread uses the same book in C (c/src/acceptor.c).  Keys and groups are unsigned 64-bit
 * ints, times are seconds (the caller's clock).  Every method runs under the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cip_internal.h"
#include "engine.h"

typedef struct {
    PyObject_HEAD
    struct cipi_admission *book; /* NULL until initialised */
    uint64_t *out;               /* room for the keys a call returns */
    size_t out_cap;
} AdmissionBook;

static engine_state *
state(AdmissionBook *self)
{
    return (engine_state *)PyType_GetModuleState(Py_TYPE(self));
}

static int
book_init(AdmissionBook *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"per_uid", "timeout", NULL};
    long long per_uid;
    double timeout;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Ld:AdmissionBook", names, &per_uid, &timeout))
        return -1;
    if (self->book != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "AdmissionBook is initialised once");
        return -1;
    }
    if (cipi_admission_new(per_uid, timeout, &self->book) != CIP_OK) {
        PyErr_SetString(state(self)->usage_error, cip_last_error());
        return -1;
    }
    return 0;
}

static void
book_dealloc(AdmissionBook *self)
{
    cipi_admission_free(self->book);
    PyMem_Free(self->out);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* The book is initialised, and `out` has room for every key it holds (what a call can
 * return); 0 or -1 with the exception set. */
static int
usable(AdmissionBook *self)
{
    if (self->book == NULL) {
        PyErr_SetString(state(self)->usage_error, "the AdmissionBook is not initialised");
        return -1;
    }
    size_t room = cipi_admission_count(self->book, 1, 0) + 1;
    if (room > self->out_cap) {
        uint64_t *p = PyMem_Realloc(self->out, 2 * room * sizeof *p);
        if (p == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->out = p;
        self->out_cap = 2 * room;
    }
    return 0;
}

static int
as_u64(PyObject *obj, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)v;
    return 0;
}

static PyObject *
keys_list(const uint64_t *keys, size_t n)
{
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out != NULL && i < n; i++) {
        PyObject *k = PyLong_FromUnsignedLongLong(keys[i]);
        if (k == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, k);
    }
    return out;
}

/* An error of the book: KeyError for a key not admitted, UsageError for the rest. */
static PyObject *
fail(AdmissionBook *self, cip_status st, PyObject *key)
{
    if (st == CIP_ERR_NO_MEMORY)
        return PyErr_NoMemory();
    if (st == CIP_ERR_NOT_HELD)
        PyErr_SetObject(PyExc_KeyError, key);
    else
        PyErr_SetString(state(self)->usage_error, cip_last_error());
    return NULL;
}

static PyObject *
book_admit(AdmissionBook *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t key, group;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "admit(key, group, now) takes 3 arguments");
        return NULL;
    }
    double now = PyFloat_AsDouble(args[2]);
    if ((now == -1.0 && PyErr_Occurred()) || as_u64(args[0], &key) < 0 ||
        as_u64(args[1], &group) < 0 || usable(self) < 0)
        return NULL;
    size_t n;
    cip_status st = cipi_admission_admit(self->book, key, group, now, self->out, &n);
    if (st != CIP_OK)
        return fail(self, st, args[0]);
    return keys_list(self->out, n);
}

static PyObject *
book_move(AdmissionBook *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t key, group;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "move(key, group) takes 2 arguments");
        return NULL;
    }
    if (as_u64(args[0], &key) < 0 || as_u64(args[1], &group) < 0 || usable(self) < 0)
        return NULL;
    size_t n;
    cip_status st = cipi_admission_move(self->book, key, group, self->out, &n);
    if (st != CIP_OK)
        return fail(self, st, args[0]);
    return keys_list(self->out, n);
}

static PyObject *
book_group(AdmissionBook *self, PyObject *arg)
{
    uint64_t key, group;
    if (as_u64(arg, &key) < 0 || usable(self) < 0)
        return NULL;
    if (!cipi_admission_group(self->book, key, &group))
        return fail(self, CIP_ERR_NOT_HELD, arg);
    return PyLong_FromUnsignedLongLong(group);
}

static PyObject *
book_next_to_go(AdmissionBook *self, PyObject *arg)
{
    uint64_t group, key;
    if (as_u64(arg, &group) < 0 || usable(self) < 0)
        return NULL;
    if (!cipi_admission_next_to_go(self->book, group, &key))
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(key);
}

static PyObject *
book_remove(AdmissionBook *self, PyObject *arg)
{
    uint64_t key;
    if (as_u64(arg, &key) < 0 || usable(self) < 0)
        return NULL;
    return PyBool_FromLong(cipi_admission_remove(self->book, key));
}

static PyObject *
book_expired(AdmissionBook *self, PyObject *arg)
{
    double now = PyFloat_AsDouble(arg);
    if ((now == -1.0 && PyErr_Occurred()) || usable(self) < 0)
        return NULL;
    return keys_list(self->out, cipi_admission_expired(self->book, now, self->out));
}

static PyObject *
book_next_deadline(AdmissionBook *self, PyObject *Py_UNUSED(arg))
{
    double at;
    if (usable(self) < 0)
        return NULL;
    if (!cipi_admission_next_deadline(self->book, &at))
        Py_RETURN_NONE;
    return PyFloat_FromDouble(at);
}

static PyObject *
book_count(AdmissionBook *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t group = 0;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "count(group=None) takes at most 1 argument");
        return NULL;
    }
    int all = nargs == 0 || args[0] == Py_None;
    if ((!all && as_u64(args[0], &group) < 0) || usable(self) < 0)
        return NULL;
    return PyLong_FromSize_t(cipi_admission_count(self->book, all, group));
}

static int
book_contains(AdmissionBook *self, PyObject *arg)
{
    uint64_t key;
    if (!PyLong_Check(arg) || as_u64(arg, &key) < 0) {
        PyErr_Clear();
        return 0;
    }
    return self->book != NULL && cipi_admission_contains(self->book, key);
}

static Py_ssize_t
book_len(AdmissionBook *self)
{
    return self->book == NULL ? 0 : (Py_ssize_t)cipi_admission_count(self->book, 1, 0);
}

static PyMethodDef book_methods[] = {
    {"admit", (PyCFunction)(void (*)(void))book_admit, METH_FASTCALL,
     "admit(key, group, now) -> list[int]: admit key in group (deadline now + timeout); the "
     "keys that go to make room, the longest in the group first.  UsageError if admitted."},
    {"move", (PyCFunction)(void (*)(void))book_move, METH_FASTCALL,
     "move(key, group) -> list[int]: key goes to group (the newest there, its deadline kept); "
     "the keys that go to make room.  KeyError if not admitted."},
    {"group", (PyCFunction)book_group, METH_O, "group(key) -> int (KeyError if not admitted)."},
    {"next_to_go", (PyCFunction)book_next_to_go, METH_O,
     "next_to_go(group) -> int | None: the key one more admission to group would push out."},
    {"remove", (PyCFunction)book_remove, METH_O, "remove(key) -> bool: whether it was admitted."},
    {"expired", (PyCFunction)book_expired, METH_O,
     "expired(now) -> list[int]: remove and return the keys past their deadline, oldest first."},
    {"next_deadline", (PyCFunction)book_next_deadline, METH_NOARGS,
     "next_deadline() -> float | None: the earliest deadline."},
    {"count", (PyCFunction)(void (*)(void))book_count, METH_FASTCALL,
     "count(group=None) -> int: keys waiting (of group, or in all)."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot book_slots[] = {
    {Py_tp_doc, "AdmissionBook(per_uid, timeout): connections waiting per group, each with one "
                "deadline (c/src/admission.c)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, book_init},
    {Py_tp_dealloc, book_dealloc},
    {Py_tp_methods, book_methods},
    {Py_sq_contains, book_contains},
    {Py_sq_length, book_len},
    {0, NULL},
};

static PyType_Spec book_spec = {
    "cupy_ipcpool._engine.AdmissionBook",
    sizeof(AdmissionBook),
    0,
    Py_TPFLAGS_DEFAULT,
    book_slots,
};

int
cipy_admission_exec(PyObject *module)
{
    return cipy_add_type(module, &book_spec, "AdmissionBook");
}
