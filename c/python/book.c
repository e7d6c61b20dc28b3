/*
 * cupy_ipcpool._engine.FrameBook: the engine's frame book (c/src/book.c) for the Python
 * subscriber -- which frame flags its streams may wait on, the record of frames
 * received that the host has not seen complete, forcing those flags after the
 * producer's death, and the answers (which frames were never written).  The C
 * subscriber keeps the same struct frame_book: one implementation of these rules.
 *
 * The sync page is passed to each call as a writable buffer (the page's mmap) and read
 * only during the call; freeze() keeps the frame flags' last values for the answers
 * once the page is gone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_memop_args.h"
#include "cip_internal.h"
#include "engine.h"

typedef struct {
    PyObject_HEAD
    struct frame_book book;
    int ready;          /* book initialised */
    uint32_t *final;    /* the frame flags at freeze(), else NULL */
} FrameBook;

/* cupy_ipcpool's UsageError, from the state of the module that made this type */
static PyObject *
usage_error(FrameBook *self)
{
    return ((engine_state *)PyType_GetModuleState(Py_TYPE(self)))->usage_error;
}

/* The page's frame flags, from a writable buffer of at least num_slots flags. */
static int
page_flags(FrameBook *self, PyObject *page, Py_buffer *view, volatile uint32_t **flags)
{
    if (PyObject_GetBuffer(page, view, PyBUF_WRITABLE) < 0)
        return -1;
    if ((size_t)view->len < (size_t)self->book.num_slots * CIP_WIRE_SYNC_FLAG_BYTES) {
        PyErr_Format(usage_error(self), "a sync page of %zd bytes has no %u frame flags",
                     view->len, self->book.num_slots);
        PyBuffer_Release(view);
        return -1;
    }
    *flags = (volatile uint32_t *)view->buf;
    return 0;
}

static int
slot_arg(FrameBook *self, PyObject *obj, uint32_t *slot)
{
    unsigned long v = PyLong_AsUnsignedLong(obj);
    if (v == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (v >= self->book.num_slots) {
        PyErr_Format(usage_error(self), "slot %lu of a book of %u slots", v, self->book.num_slots);
        return -1;
    }
    *slot = (uint32_t)v;
    return 0;
}

static int
generation_arg(PyObject *obj, uint32_t *generation)
{
    unsigned long long v = PyLong_AsUnsignedLongLongMask(obj); /* taken mod 2**32 */
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *generation = (uint32_t)v;
    return 0;
}

static int
book_init(FrameBook *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"num_slots", "record_cap", NULL};
    long long num_slots, cap = CIP_WIRE_SYNC_RECORD_CAP;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L|$L:FrameBook", names, &num_slots, &cap))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "FrameBook is initialised once");
        return -1;
    }
    if (num_slots < 1 || num_slots > CIP_WIRE_MAX_SLOTS) {
        PyErr_Format(usage_error(self), "a frame book has 1..%u slots, not %lld",
                     CIP_WIRE_MAX_SLOTS, num_slots);
        return -1;
    }
    if (cap < 1) {
        PyErr_Format(usage_error(self), "record_cap must be at least 1 (got %lld)", cap);
        return -1;
    }
    if (cipi_book_init(&self->book, (uint32_t)num_slots, (size_t)cap) != 0) {
        cipi_book_free(&self->book);
        PyErr_NoMemory();
        return -1;
    }
    self->ready = 1;
    return 0;
}

static void
book_dealloc(FrameBook *self)
{
    if (self->ready)
        cipi_book_free(&self->book);
    PyMem_Free(self->final);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static int
check_ready(FrameBook *self)
{
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "FrameBook was not initialised");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(note_doc, "note(slot, generation, /)\n\n"
                       "A stream was made to wait for ``slot``'s frame flag to reach ``generation``.");

static PyObject *
book_note(FrameBook *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t slot, generation;
    if (check_ready(self) < 0)
        return NULL;
    if (check_nargs(nargs, 2, "note") < 0)
        return NULL;
    if (slot_arg(self, args[0], &slot) < 0 || generation_arg(args[1], &generation) < 0)
        return NULL;
    cipi_book_note(&self->book, slot, generation);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(received_doc,
             "received(page, seq, slot, generation, /) -> bool\n\n"
             "Frame ``seq`` was received: unless the host sees its flag set by the producer,\n"
             "note ``generation`` as awaited and record the frame (a full record drops its\n"
             "oldest frame, counted in ``untracked``); the record is pruned first either way.\n"
             "True if recorded.");

static PyObject *
book_received(FrameBook *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_ready(self) < 0)
        return NULL;
    if (check_nargs(nargs, 4, "received") < 0)
        return NULL;
    unsigned long long seq = PyLong_AsUnsignedLongLong(args[1]);
    if (seq == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    uint32_t slot, generation;
    if (slot_arg(self, args[2], &slot) < 0 || generation_arg(args[3], &generation) < 0)
        return NULL;
    Py_buffer view;
    volatile uint32_t *flags;
    if (page_flags(self, args[0], &view, &flags) < 0)
        return NULL;
    int recorded = cipi_book_received(&self->book, flags, seq, slot, generation);
    PyBuffer_Release(&view);
    return PyBool_FromLong(recorded);
}

PyDoc_STRVAR(prune_doc, "prune(page, /)\n\n"
                        "Drop from the front of the record the frames the producer's stream has\n"
                        "set (a forced flag is never taken for the producer's write).");

static PyObject *
book_prune(FrameBook *self, PyObject *page)
{
    if (check_ready(self) < 0)
        return NULL;
    Py_buffer view;
    volatile uint32_t *flags;
    if (page_flags(self, page, &view, &flags) < 0)
        return NULL;
    cipi_book_prune(&self->book, flags);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* pending (force = 0) and resolve (force = 1): the slots awaited and not set, or those
 * this call forced */
static PyObject *
slots_of(FrameBook *self, PyObject *page, int force)
{
    if (check_ready(self) < 0)
        return NULL;
    Py_buffer view;
    volatile uint32_t *flags;
    if (page_flags(self, page, &view, &flags) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    for (uint32_t s = 0; out != NULL && s < self->book.num_slots; s++) {
        int hit = force ? cipi_book_resolve_slot(&self->book, flags, s)
                        : cipi_book_waits_on(&self->book, flags, s);
        if (!hit)
            continue;
        PyObject *n = PyLong_FromUnsignedLong(s);
        if (n == NULL || PyList_Append(out, n) < 0)
            Py_CLEAR(out);
        Py_XDECREF(n);
    }
    PyBuffer_Release(&view);
    return out;
}

PyDoc_STRVAR(pending_doc, "pending(page, /) -> list[int]\n\n"
                          "The slots whose last awaited generation the host does not see set yet.");

static PyObject *
book_pending(FrameBook *self, PyObject *page)
{
    return slots_of(self, page, 0);
}

PyDoc_STRVAR(resolve_doc,
             "resolve(page, /) -> list[int]\n\n"
             "Force every frame flag still awaited (cip_flag_force); call only once the\n"
             "producer is dead.  Returns the slots this call forced.");

static PyObject *
book_resolve(FrameBook *self, PyObject *page)
{
    return slots_of(self, page, 1);
}

PyDoc_STRVAR(freeze_doc, "freeze(page, /)\n\n"
                         "Keep the frame flags' values: state() and answers() read them from now on.");

static PyObject *
book_freeze(FrameBook *self, PyObject *page)
{
    if (check_ready(self) < 0)
        return NULL;
    Py_buffer view;
    volatile uint32_t *flags;
    if (page_flags(self, page, &view, &flags) < 0)
        return NULL;
    uint32_t n = self->book.num_slots;
    uint32_t *final = self->final ? self->final : PyMem_Malloc(n * sizeof *final);
    if (final == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    for (uint32_t s = 0; s < n; s++)
        final[s] = __atomic_load_n(&flags[s], __ATOMIC_ACQUIRE);
    self->final = final;
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* The flags the answers read: the frozen ones, else the page's (a buffer to release) */
static int
answer_flags(FrameBook *self, PyObject *page, Py_buffer *view, volatile uint32_t **flags)
{
    view->obj = NULL;
    if (self->final != NULL) {
        *flags = self->final;
        return 0;
    }
    return page_flags(self, page, view, flags);
}

PyDoc_STRVAR(state_doc,
             "state(page, slot, generation, /) -> int\n\n"
             "cip_flag_state of ``slot``'s frame flag for ``generation``: frozen if freeze()\n"
             "ran, else read from ``page``: 1 written, 0 never written, -1 not known yet.");

static PyObject *
book_state(FrameBook *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_ready(self) < 0)
        return NULL;
    if (check_nargs(nargs, 3, "state") < 0)
        return NULL;
    uint32_t slot, generation;
    if (slot_arg(self, args[1], &slot) < 0 || generation_arg(args[2], &generation) < 0)
        return NULL;
    Py_buffer view;
    volatile uint32_t *flags;
    if (answer_flags(self, args[0], &view, &flags) < 0)
        return NULL;
    int state = cip_flag_state(__atomic_load_n(&flags[slot], __ATOMIC_ACQUIRE), generation);
    if (view.obj != NULL)
        PyBuffer_Release(&view);
    return PyLong_FromLong(state);
}

static PyObject *
seq_tuple(const uint64_t *seqs, size_t n)
{
    PyObject *t = PyTuple_New((Py_ssize_t)n);
    for (size_t i = 0; t != NULL && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(seqs[i]);
        if (v == NULL)
            Py_CLEAR(t);
        else
            PyTuple_SET_ITEM(t, (Py_ssize_t)i, v);
    }
    return t;
}

PyDoc_STRVAR(answers_doc,
             "answers(page, /) -> (incomplete, pending)\n\n"
             "Seqs of the recorded frames: never written (their flag forced after the\n"
             "producer's death), and not known yet (not set).  Every other frame received\n"
             "is complete; ``untracked`` frames are not known here.  Frozen if freeze() ran.");

static PyObject *
book_answers(FrameBook *self, PyObject *page)
{
    if (check_ready(self) < 0)
        return NULL;
    Py_buffer view;
    volatile uint32_t *flags;
    if (answer_flags(self, page, &view, &flags) < 0)
        return NULL;
    size_t n = self->book.rec_len ? self->book.rec_len : 1, pending = 0;
    uint64_t *seqs = PyMem_Malloc(2 * n * sizeof *seqs);
    PyObject *out = NULL;
    if (seqs == NULL) {
        PyErr_NoMemory();
    } else {
        size_t incomplete =
            cipi_book_answers(&self->book, flags, seqs, n, &pending, seqs + n, n);
        PyObject *a = seq_tuple(seqs, incomplete), *b = seq_tuple(seqs + n, pending);
        if (a != NULL && b != NULL)
            out = PyTuple_Pack(2, a, b);
        Py_XDECREF(a);
        Py_XDECREF(b);
        PyMem_Free(seqs);
    }
    if (view.obj != NULL)
        PyBuffer_Release(&view);
    return out;
}

static PyObject *
book_get_record(FrameBook *self, void *Py_UNUSED(closure))
{
    if (check_ready(self) < 0)
        return NULL;
    const struct frame_book *b = &self->book;
    PyObject *t = PyTuple_New((Py_ssize_t)b->rec_len);
    for (size_t i = 0; t != NULL && i < b->rec_len; i++) {
        const struct seen_frame *f = &b->rec[(b->rec_head + i) % b->rec_alloc];
        PyObject *e = Py_BuildValue("(KII)", (unsigned long long)f->seq, f->slot, f->generation);
        if (e == NULL)
            Py_CLEAR(t);
        else
            PyTuple_SET_ITEM(t, (Py_ssize_t)i, e);
    }
    return t;
}

static PyObject *
book_get_generations(FrameBook *self, void *Py_UNUSED(closure))
{
    if (check_ready(self) < 0)
        return NULL;
    PyObject *l = PyList_New(self->book.num_slots);
    for (uint32_t s = 0; l != NULL && s < self->book.num_slots; s++) {
        PyObject *v = self->book.awaited_set[s] ? PyLong_FromUnsignedLong(self->book.awaited[s])
                                                : PyLong_FromLong(-1);
        if (v == NULL)
            Py_CLEAR(l);
        else
            PyList_SET_ITEM(l, s, v);
    }
    return l;
}

static PyObject *
book_get_final(FrameBook *self, void *Py_UNUSED(closure))
{
    if (self->final == NULL)
        Py_RETURN_NONE;
    PyObject *l = PyList_New(self->book.num_slots);
    for (uint32_t s = 0; l != NULL && s < self->book.num_slots; s++) {
        PyObject *v = PyLong_FromUnsignedLong(self->final[s]);
        if (v == NULL)
            Py_CLEAR(l);
        else
            PyList_SET_ITEM(l, s, v);
    }
    return l;
}

static PyObject *
book_get_count(FrameBook *self, void *closure)
{
    if (check_ready(self) < 0)
        return NULL;
    const char *which = (const char *)closure;
    unsigned long long v = which[0] == 'f'   ? self->book.forced
                           : which[0] == 'u' ? self->book.untracked
                           : which[0] == 'c' ? (unsigned long long)self->book.rec_cap
                                             : (unsigned long long)self->book.rec_len;
    return PyLong_FromUnsignedLongLong(v);
}

static Py_ssize_t
book_len(FrameBook *self)
{
    return self->ready ? (Py_ssize_t)self->book.rec_len : 0;
}

static PyMethodDef book_methods[] = {
    {"note", (PyCFunction)(void (*)(void))book_note, METH_FASTCALL, note_doc},
    {"received", (PyCFunction)(void (*)(void))book_received, METH_FASTCALL, received_doc},
    {"prune", (PyCFunction)book_prune, METH_O, prune_doc},
    {"pending", (PyCFunction)book_pending, METH_O, pending_doc},
    {"resolve", (PyCFunction)book_resolve, METH_O, resolve_doc},
    {"freeze", (PyCFunction)book_freeze, METH_O, freeze_doc},
    {"state", (PyCFunction)(void (*)(void))book_state, METH_FASTCALL, state_doc},
    {"answers", (PyCFunction)book_answers, METH_O, answers_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef book_getset[] = {
    {"record", (getter)book_get_record, NULL,
     "(seq, slot, generation) of the frames recorded, oldest first", NULL},
    {"generations", (getter)book_get_generations, NULL,
     "per slot: the generation last awaited (low 32 bits), or -1", NULL},
    {"final", (getter)book_get_final, NULL, "the frozen frame flags, or None", NULL},
    {"forced", (getter)book_get_count, NULL, "frame flags resolve() forced", "f"},
    {"untracked", (getter)book_get_count, NULL, "frames dropped from a full record", "u"},
    {"record_cap", (getter)book_get_count, NULL, "most frames the record holds", "c"},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot book_slots[] = {
    {Py_tp_doc, "FrameBook(num_slots, *, record_cap=RECORD_CAP): the engine's frame book "
                "(c/src/book.c) for one subscriber: awaited frame flags, the record of frames "
                "not seen complete, forcing after the producer's death, the answers."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, book_init},
    {Py_tp_dealloc, book_dealloc},
    {Py_tp_methods, book_methods},
    {Py_tp_getset, book_getset},
    {Py_sq_length, book_len},
    {0, NULL},
};

static PyType_Spec book_spec = {
    "cupy_ipcpool._engine.FrameBook",
    sizeof(FrameBook),
    0,
    Py_TPFLAGS_DEFAULT,
    book_slots,
};

int
cipy_book_exec(PyObject *module)
{
    return cipy_add_type(module, &book_spec, "FrameBook");
}
