/*
 * cupy_ipcpool._engine.ReaderRows: the publisher's rows of read flags in the sync page
 * (c/src/reader_rows.c): which subscriber writes which row, and the departed readers' rows,
 * kept while the publisher's streams may wait on them and forced once their process died.
 *
 * Every method runs under the GIL and never releases it, and holds the rows' mutex: the
 * publisher's accept thread (c/src/acceptor.c, without the GIL) assigns rows and gives back
 * those of subscribers never adopted through cipy_rows_hooks, under the same mutex; the
 * producer's thread adopts, leaves and settles.
 * The page is held (a buffer export) until release_page() or the object's end.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cip_internal.h"
#include "engine.h"

typedef struct {
    PyObject_HEAD
    struct cipi_rows rows;
    Py_buffer page; /* page.obj NULL: released (every call but the getters is refused) */
    pthread_mutex_t lock; /* over rows: the accept thread's hooks and every method */
    pid_t owner;          /* the process that made it: a forked child takes no lock (below) */
    uint32_t *published; /* num_slots: the generations a leave or close passes */
} ReaderRows;

/* The rows' mutex, but in a child forked while the accept thread of the parent may have
 * held it (copied locked): there no other thread of ours uses these rows. */
static void
rows_lock(ReaderRows *self)
{
    if (getpid() == self->owner)
        pthread_mutex_lock(&self->lock);
}

static void
rows_unlock(ReaderRows *self)
{
    if (getpid() == self->owner)
        pthread_mutex_unlock(&self->lock);
}

static engine_state *
state(ReaderRows *self)
{
    return (engine_state *)PyType_GetModuleState(Py_TYPE(self));
}

static int
rows_init(ReaderRows *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"page", "reads_offset", "max_rows", "num_slots", NULL};
    PyObject *page;
    Py_ssize_t offset;
    unsigned int max_rows, num_slots;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnII:ReaderRows", names, &page, &offset,
                                     &max_rows, &num_slots))
        return -1;
    if (self->page.obj != NULL || self->published != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ReaderRows is initialised once");
        return -1;
    }
    if (PyObject_GetBuffer(page, &self->page, PyBUF_WRITABLE) < 0)
        return -1;
    pthread_mutex_init(&self->lock, NULL);
    self->owner = getpid();
    cip_status st = offset < 0 || num_slots > CIP_WIRE_MAX_SLOTS
                        ? cipi_fail(CIP_ERR_INVALID_ARGUMENT, "ReaderRows: bad offset or slots")
                        : cipi_rows_init(&self->rows, max_rows, num_slots,
                                         (uint32_t *)self->page.buf, (size_t)self->page.len,
                                         (size_t)offset);
    if (st == CIP_OK && (self->published = PyMem_Calloc(num_slots, sizeof(uint32_t))) == NULL)
        st = CIP_ERR_NO_MEMORY;
    if (st != CIP_OK) {
        cipi_rows_free(&self->rows);
        PyBuffer_Release(&self->page);
        if (st == CIP_ERR_NO_MEMORY)
            PyErr_NoMemory();
        else
            PyErr_SetString(state(self)->usage_error, cip_last_error());
        return -1;
    }
    return 0;
}

static void
rows_dealloc(ReaderRows *self)
{
    cipi_rows_free(&self->rows); /* closes the pidfds */
    if (self->page.obj != NULL)
        PyBuffer_Release(&self->page);
    PyMem_Free(self->published);
    if (getpid() == self->owner)
        pthread_mutex_destroy(&self->lock);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static int
usable(ReaderRows *self)
{
    if (self->page.obj != NULL)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "the reader rows let go of their page");
    return -1;
}

static int
as_u32(PyObject *obj, uint32_t *out)
{
    unsigned long v = PyLong_AsUnsignedLong(obj);
    if (v == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (v > UINT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "%lu does not fit 32 bits", v);
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* The generations last published in each slot (a sequence of num_slots ints, each taken
 * modulo 2**32) into self->published. */
static int
published_arg(ReaderRows *self, PyObject *obj)
{
    PyObject *seq = PySequence_Fast(obj, "published must be a sequence of ints");
    if (seq == NULL)
        return -1;
    if (PySequence_Fast_GET_SIZE(seq) != (Py_ssize_t)self->rows.num_slots) {
        PyErr_Format(PyExc_ValueError, "published has %zd values, not one per slot (%u)",
                     PySequence_Fast_GET_SIZE(seq), self->rows.num_slots);
        Py_DECREF(seq);
        return -1;
    }
    for (uint32_t s = 0; s < self->rows.num_slots; s++) {
        unsigned long long v = PyLong_AsUnsignedLongLongMask(PySequence_Fast_GET_ITEM(seq, s));
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        self->published[s] = (uint32_t)v;
    }
    Py_DECREF(seq);
    return 0;
}

static PyObject *
rows_assign(ReaderRows *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t id;
    if (usable(self) < 0)
        return NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "assign(sub_id, pid) takes 2 arguments");
        return NULL;
    }
    long pid = PyLong_AsLong(args[1]);
    if (as_u32(args[0], &id) < 0 || (pid == -1 && PyErr_Occurred()))
        return NULL;
    if (pid > INT_MAX || pid < INT_MIN) {
        PyErr_Format(PyExc_OverflowError, "pid %ld is out of range", pid);
        return NULL;
    }
    uint32_t index;
    rows_lock(self);
    cip_status st = cipi_rows_assign(&self->rows, id, (int)pid, &index);
    rows_unlock(self);
    if (st == CIP_ERR_PROTOCOL)
        Py_RETURN_NONE; /* every row is live */
    if (st != CIP_OK) {
        PyErr_SetString(state(self)->usage_error, cip_last_error());
        return NULL;
    }
    return PyLong_FromUnsignedLong(index);
}

/* One subscriber's step (cipi_rows_adopt, cipi_rows_drop) under the rows' mutex. */
static PyObject *
by_id(ReaderRows *self, PyObject *arg, cip_status (*step)(struct cipi_rows *, uint32_t))
{
    uint32_t id;
    if (usable(self) < 0 || as_u32(arg, &id) < 0)
        return NULL;
    rows_lock(self);
    cip_status st = step(&self->rows, id);
    rows_unlock(self);
    if (st != CIP_OK) {
        PyErr_SetString(state(self)->usage_error, cip_last_error());
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
rows_adopt(ReaderRows *self, PyObject *arg)
{
    return by_id(self, arg, cipi_rows_adopt);
}

static PyObject *
rows_index(ReaderRows *self, PyObject *arg)
{
    uint32_t id;
    if (as_u32(arg, &id) < 0)
        return NULL;
    rows_lock(self);
    long index = cipi_rows_index(&self->rows, id);
    rows_unlock(self);
    if (index < 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(index);
}

static PyObject *
rows_drop(ReaderRows *self, PyObject *arg)
{
    return by_id(self, arg, cipi_rows_drop);
}

static PyObject *
rows_leave(ReaderRows *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t id;
    if (usable(self) < 0)
        return NULL;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "leave(sub_id, published, idle) takes 3 arguments");
        return NULL;
    }
    int idle = PyObject_IsTrue(args[2]);
    if (as_u32(args[0], &id) < 0 || idle < 0 || published_arg(self, args[1]) < 0)
        return NULL;
    rows_lock(self);
    cipi_rows_leave(&self->rows, id, self->published, idle);
    rows_unlock(self);
    Py_RETURN_NONE;
}

static PyObject *
rows_due(ReaderRows *self, PyObject *Py_UNUSED(arg))
{
    if (self->page.obj == NULL)
        Py_RETURN_FALSE;
    rows_lock(self);
    int due = cipi_rows_due(&self->rows);
    rows_unlock(self);
    return PyBool_FromLong(due);
}

static PyObject *
rows_settle(ReaderRows *self, PyObject *arg)
{
    int idle = PyObject_IsTrue(arg);
    if (usable(self) < 0 || idle < 0)
        return NULL;
    rows_lock(self);
    uint32_t settled = cipi_rows_settle(&self->rows, idle);
    rows_unlock(self);
    return PyLong_FromUnsignedLong(settled);
}

static PyObject *
rows_close(ReaderRows *self, PyObject *arg)
{
    if (usable(self) < 0 || published_arg(self, arg) < 0)
        return NULL;
    rows_lock(self);
    cipi_rows_close(&self->rows, self->published);
    rows_unlock(self);
    Py_RETURN_NONE;
}

static PyObject *
rows_all_settled(ReaderRows *self, PyObject *Py_UNUSED(arg))
{
    if (usable(self) < 0)
        return NULL;
    rows_lock(self);
    int all = cipi_rows_all_settled(&self->rows);
    rows_unlock(self);
    return PyBool_FromLong(all);
}

static PyObject *
rows_release_page(ReaderRows *self, PyObject *Py_UNUSED(arg))
{
    if (self->page.obj == NULL)
        Py_RETURN_NONE;
    rows_lock(self); /* the accept thread's hooks see it released */
    cipi_rows_free(&self->rows);     /* closes the pidfds; no row is kept */
    PyBuffer_Release(&self->page);
    rows_unlock(self);
    Py_RETURN_NONE;
}

static PyObject *
get_departed(ReaderRows *self, void *Py_UNUSED(closure))
{
    rows_lock(self);
    uint32_t n = self->rows.ndeparted;
    rows_unlock(self);
    return PyLong_FromUnsignedLong(n);
}

static PyObject *
get_live(ReaderRows *self, void *Py_UNUSED(closure))
{
    rows_lock(self);
    uint32_t n = self->rows.nlive;
    rows_unlock(self);
    return PyLong_FromUnsignedLong(n);
}

static PyObject *
get_forced(ReaderRows *self, void *Py_UNUSED(closure))
{
    rows_lock(self);
    uint64_t n = self->rows.forced;
    rows_unlock(self);
    return PyLong_FromUnsignedLongLong(n);
}

/* ---- the accept thread's hooks (no GIL: the mutex alone) ---- */

static int
hook_assign(void *ctx, uint32_t sub_id, int pid, uint32_t *row)
{
    ReaderRows *self = ctx;
    rows_lock(self);
    int got = -1; /* the page let go of: the publisher is closing */
    if (self->page.obj != NULL) {
        cip_status st = cipi_rows_assign(&self->rows, sub_id, pid, row);
        got = st == CIP_OK ? 0 : st == CIP_ERR_PROTOCOL ? 1 : -1;
    }
    rows_unlock(self);
    return got;
}

static void
hook_drop(void *ctx, uint32_t sub_id)
{
    ReaderRows *self = ctx;
    rows_lock(self);
    if (self->page.obj != NULL)
        (void)cipi_rows_drop(&self->rows, sub_id);
    rows_unlock(self);
}

int
cipy_rows_hooks(PyObject *module, PyObject *obj, struct cipi_acceptor_hooks *out)
{
    PyObject *type = PyObject_GetAttrString(module, "ReaderRows");
    if (type == NULL)
        return -1;
    int ok = PyObject_TypeCheck(obj, (PyTypeObject *)type);
    Py_DECREF(type);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "rows must be a ReaderRows, not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (usable((ReaderRows *)obj) < 0)
        return -1;
    out->ctx = obj;
    out->assign = hook_assign;
    out->drop = hook_drop;
    return 0;
}

static PyMethodDef rows_methods[] = {
    {"assign", (PyCFunction)(void (*)(void))rows_assign, METH_FASTCALL,
     "assign(sub_id, pid) -> int | None: give the subscriber a row (round-robin; else the "
     "oldest departed row, forced); None when every row is live.  pid: the kernel's, whose "
     "pidfd says when the subscriber died."},
    {"adopt", (PyCFunction)rows_adopt, METH_O,
     "adopt(sub_id): the subscriber may read frames (streams may wait on its row)."},
    {"index", (PyCFunction)rows_index, METH_O, "index(sub_id) -> int | None: its row."},
    {"drop", (PyCFunction)rows_drop, METH_O,
     "drop(sub_id): a subscriber welcomed and never adopted: its row is free at once."},
    {"leave", (PyCFunction)(void (*)(void))rows_leave, METH_FASTCALL,
     "leave(sub_id, published, idle): the subscriber left; its row waits among the departed "
     "until its flags reach published (per slot), its process dies (forced), or the "
     "publisher's streams are idle."},
    {"due", (PyCFunction)rows_due, METH_NOARGS,
     "due() -> bool: departed rows wait and the last look is 10 ms ago (starts the next)."},
    {"settle", (PyCFunction)rows_settle, METH_O,
     "settle(idle) -> int: force the dead departed rows, forget the settled ones (every one "
     "when idle); how many are left."},
    {"close", (PyCFunction)rows_close, METH_O,
     "close(published): the publisher closes: every adopted row is departed, at published."},
    {"all_settled", (PyCFunction)rows_all_settled, METH_NOARGS,
     "all_settled() -> bool: force the dead departed rows; whether every one's flags are in."},
    {"release_page", (PyCFunction)rows_release_page, METH_NOARGS,
     "release_page(): let go of the page and close every pidfd (the end of the rows)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef rows_getset[] = {
    {"departed", (getter)get_departed, NULL, "departed rows kept", NULL},
    {"live", (getter)get_live, NULL, "rows of subscribers connected", NULL},
    {"forced", (getter)get_forced, NULL, "read flags written from the host so far", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot rows_slots[] = {
    {Py_tp_doc, "ReaderRows(page, reads_offset, max_rows, num_slots): the publisher's rows of "
                "read flags in the sync page (c/src/reader_rows.c)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, rows_init},
    {Py_tp_dealloc, rows_dealloc},
    {Py_tp_methods, rows_methods},
    {Py_tp_getset, rows_getset},
    {0, NULL},
};

static PyType_Spec rows_spec = {
    "cupy_ipcpool._engine.ReaderRows",
    sizeof(ReaderRows),
    0,
    Py_TPFLAGS_DEFAULT,
    rows_slots,
};

int
cipy_rows_exec(PyObject *module)
{
    return cipy_add_type(module, &rows_spec, "ReaderRows");
}
