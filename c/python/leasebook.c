/*
 * cupy_ipcpool._engine.LeaseCore: the publisher's lease book (c/src/leases.c) for the
 * Python publisher; channel/_leases.py's LeaseBook is its documented face.  Every method
 * runs under the GIL (the owner serialises calls, as the book requires) and never
 * releases it; settle_flagged calls back into Python for each read flag it looks at.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_memop_args.h"
#include "cip_internal.h"
#include "engine.h"

typedef struct {
    PyObject_HEAD
    struct cipi_leasebook book;
    int ready;
} LeaseCore;

/* The exception of status st (the book's words), as cupy_ipcpool raises it; NULL. */
static PyObject *
fail(LeaseCore *self, cip_status st)
{
    if (st == CIP_ERR_NO_MEMORY)
        return PyErr_NoMemory();
    if (st == CIPI_ERR_CALLBACK)
        return NULL; /* the callback's exception is set */
    const char *name = st == CIP_ERR_PROTOCOL       ? "ProtocolError"
                       : st == CIPI_ERR_LEASE_STATE ? "LeaseStateError"
                       : st == CIPI_ERR_SLOT_INDEX  ? "SlotIndexError"
                                                    : "UsageError";
    engine_state *es = (engine_state *)PyType_GetModuleState(Py_TYPE(self));
    PyObject *cls = PyObject_GetAttrString(es->errors, name);
    if (cls != NULL) {
        PyErr_SetString(cls, cip_last_error());
        Py_DECREF(cls);
    }
    return NULL;
}

static int
core_init(LeaseCore *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"num_slots", "max_credit", "latest_reserve", NULL};
    long long num_slots, max_credit = -1, latest_reserve = -1;
    PyObject *mc = Py_None, *lr = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L|$OO:LeaseCore", names, &num_slots, &mc, &lr))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "LeaseCore is initialised once");
        return -1;
    }
    if ((mc != Py_None && (max_credit = PyLong_AsLongLong(mc)) == -1 && PyErr_Occurred()) ||
        (lr != Py_None && (latest_reserve = PyLong_AsLongLong(lr)) == -1 && PyErr_Occurred()))
        return -1;
    /* the book takes -1 for a default: a negative value given is refused in its words */
    cip_status st = CIP_ERR_INVALID_ARGUMENT;
    if (num_slots < 1 || num_slots > UINT32_MAX)
        cipi_fail(st, "num_slots must be at least 1, not %lld", num_slots);
    else if (mc != Py_None && max_credit < 1)
        cipi_fail(st, "max_credit must be at least 1, not %lld", max_credit);
    else if (lr != Py_None && latest_reserve < 0)
        cipi_fail(st, "latest_reserve must be in 0..%lld, not %lld", num_slots - 1,
                  latest_reserve);
    else
        st = cipi_leases_init(&self->book, (uint32_t)num_slots, max_credit, latest_reserve);
    if (st != CIP_OK) {
        fail(self, st);
        return -1;
    }
    self->ready = 1;
    return 0;
}

static void
core_dealloc(LeaseCore *self)
{
    if (self->ready)
        cipi_leases_free(&self->book);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* ints from args[0..n): 0, or -1 with an exception. */
static int
ints(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t n, const char *signature,
     long long *out)
{
    if (check_nargs(nargs, n, signature) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* slot as an index of the ring, else SlotIndexError */
static int
slot_index(LeaseCore *self, long long slot)
{
    cip_status st = cipi_leases_check_slot(&self->book, slot);
    if (st != CIP_OK) {
        fail(self, st);
        return -1;
    }
    return 0;
}

static PyObject *
tri(int out) /* True / False / None */
{
    if (out < 0)
        Py_RETURN_NONE;
    return PyBool_FromLong(out);
}

static PyObject *
u32_list(const uint32_t *v, uint32_t n)
{
    PyObject *out = PyList_New(n);
    for (uint32_t i = 0; out != NULL && i < n; i++) {
        PyObject *x = PyLong_FromUnsignedLong(v[i]);
        if (x == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, x);
    }
    return out;
}

static PyObject *
core_add_subscriber(LeaseCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 3, "add_subscriber(sub_id, mode, credit)") < 0)
        return NULL;
    long long id = PyLong_AsLongLong(args[0]), credit;
    if (id == -1 && PyErr_Occurred())
        return NULL;
    int mode = cipy_lease_mode(args[1]);
    if (mode < 0 && cipi_leases_sub(&self->book, (uint64_t)id) == NULL) /* a known id: below */
        return cipy_lease_mode_error((engine_state *)PyType_GetModuleState(Py_TYPE(self)),
                                     args[1]);
    credit = PyLong_AsLongLong(args[2]);
    if (credit == -1 && PyErr_Occurred())
        return NULL;
    uint32_t granted;
    cip_status st = cipi_leases_add(&self->book, (uint64_t)id, mode, credit, &granted);
    if (st != CIP_OK)
        return fail(self, st);
    return PyLong_FromUnsignedLong(granted);
}

static PyObject *
core_remove_subscriber(LeaseCore *self, PyObject *arg)
{
    long long id = PyLong_AsLongLong(arg);
    if (id == -1 && PyErr_Occurred())
        return NULL;
    uint32_t *freed = (uint32_t *)PyMem_Malloc(self->book.num_slots * sizeof *freed), n = 0;
    if (freed == NULL)
        return PyErr_NoMemory();
    if (id >= 0)
        cipi_leases_remove(&self->book, (uint64_t)id, freed, &n);
    PyObject *out = u32_list(freed, n);
    PyMem_Free(freed);
    return out;
}

static PyObject *
core_suspend(LeaseCore *self, PyObject *arg)
{
    long long id = PyLong_AsLongLong(arg);
    if (id == -1 && PyErr_Occurred())
        return NULL;
    if (id >= 0)
        cipi_leases_suspend(&self->book, (uint64_t)id);
    Py_RETURN_NONE;
}

static PyObject *
core_subscribers(LeaseCore *self, PyObject *Py_UNUSED(ignored))
{
    uint32_t *ids = (uint32_t *)PyMem_Malloc((self->book.nsubs + 1) * sizeof *ids);
    if (ids == NULL)
        return PyErr_NoMemory();
    for (uint32_t i = 0; i < self->book.nsubs; i++)
        ids[i] = self->book.subs[i]->id;
    PyObject *out = u32_list(ids, self->book.nsubs);
    PyMem_Free(ids);
    return out;
}

static PyObject *
core_hold(LeaseCore *self, PyObject *arg)
{
    long long slot = PyLong_AsLongLong(arg);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    cip_status st = cipi_leases_hold(&self->book, slot);
    if (st != CIP_OK)
        return fail(self, st);
    Py_RETURN_NONE;
}

static PyObject *
core_unhold(LeaseCore *self, PyObject *arg)
{
    long long slot = PyLong_AsLongLong(arg);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    int freed;
    cip_status st = cipi_leases_unhold(&self->book, slot, &freed);
    if (st != CIP_OK)
        return fail(self, st);
    return PyBool_FromLong(freed);
}

static PyObject *
core_publishing(LeaseCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 4, "publishing(slot, seq, now, on_schedule)") < 0)
        return NULL;
    long long slot = PyLong_AsLongLong(args[0]);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    if (slot_index(self, slot) < 0)
        return NULL;
    unsigned long long seq = PyLong_AsUnsignedLongLong(args[1]);
    if (seq == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    double now = PyFloat_AsDouble(args[2]);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    int on_schedule = PyObject_IsTrue(args[3]);
    if (on_schedule < 0)
        return NULL;
    uint32_t stack[64], *receivers = stack;
    if (self->book.nsubs > 64 &&
        (receivers = (uint32_t *)PyMem_Malloc(self->book.nsubs * sizeof *receivers)) == NULL)
        return PyErr_NoMemory();
    uint32_t n;
    cip_status st = cipi_leases_publishing(&self->book, (uint32_t)slot, seq, now, on_schedule,
                                           receivers, &n);
    PyObject *out = st == CIP_OK ? u32_list(receivers, n) : fail(self, st);
    if (receivers != stack)
        PyMem_Free(receivers);
    return out;
}

static PyObject *
core_release(LeaseCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long v[3];
    if (ints(args, nargs, 3, "release(sub_id, seq, slot)", v) < 0)
        return NULL;
    int out;
    cip_status st = v[0] < 0 || v[1] < 0
                        ? cipi_fail(CIP_ERR_PROTOCOL, "release from unknown subscriber %lld", v[0])
                        : cipi_leases_release(&self->book, (uint64_t)v[0], (uint64_t)v[1], v[2],
                                              &out);
    if (st != CIP_OK)
        return fail(self, st);
    return tri(out);
}

static PyObject *
core_settle(LeaseCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long v[2];
    if (ints(args, nargs, 2, "settle(sub_id, slot)", v) < 0)
        return NULL;
    int out;
    cip_status st =
        v[0] < 0 || v[1] < 0 || v[1] >= self->book.num_slots
            ? cipi_fail(CIPI_ERR_LEASE_STATE, "subscriber %lld holds no lease on slot %lld", v[0],
                        v[1])
            : cipi_leases_settle(&self->book, (uint64_t)v[0], (uint32_t)v[1], &out);
    if (st != CIP_OK)
        return fail(self, st);
    return tri(out);
}

/* the Python callable reached(sub_id, slot), for cipi_leases_settle_flagged */
static int
call_reached(void *ctx, uint64_t sub_id, uint32_t slot)
{
    PyObject *r = PyObject_CallFunction((PyObject *)ctx, "KI", (unsigned long long)sub_id,
                                        (unsigned)slot);
    if (r == NULL)
        return -1;
    int yes = PyObject_IsTrue(r);
    Py_DECREF(r);
    return yes;
}

static PyObject *
core_settle_flagged(LeaseCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 2, "settle_flagged(reached, slot)") < 0)
        return NULL;
    long long slot = -1;
    if (args[1] != Py_None) {
        slot = PyLong_AsLongLong(args[1]);
        if (slot == -1 && PyErr_Occurred())
            return NULL;
        if (slot_index(self, slot) < 0)
            return NULL;
    }
    uint32_t ended;
    cip_status st = cipi_leases_settle_flagged(&self->book, call_reached, args[0], slot, &ended);
    if (st != CIP_OK)
        return fail(self, st);
    return PyLong_FromUnsignedLong(ended);
}

static PyObject *
core_cancel(LeaseCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    long long v[3];
    if (ints(args, nargs, 3, "cancel(sub_id, seq, slot)", v) < 0)
        return NULL;
    int out;
    cip_status st = v[0] < 0 || v[1] < 0
                        ? cipi_fail(CIP_ERR_PROTOCOL,
                                    "subscriber %lld holds no lease on frame %lld in slot %lld",
                                    v[0], v[1], v[2])
                        : cipi_leases_cancel(&self->book, (uint64_t)v[0], (uint64_t)v[1], v[2],
                                             &out);
    if (st != CIP_OK)
        return fail(self, st);
    return PyBool_FromLong(out);
}

/* ---- queries ---------------------------------------------------------------------------- */

static int
slot_of(LeaseCore *self, PyObject *arg, uint32_t *slot)
{
    long long s = PyLong_AsLongLong(arg);
    if (s == -1 && PyErr_Occurred())
        return -1;
    if (slot_index(self, s) < 0)
        return -1;
    *slot = (uint32_t)s;
    return 0;
}

static struct cipi_lsub *
sub_of(LeaseCore *self, PyObject *arg, int *err)
{
    long long id = PyLong_AsLongLong(arg);
    *err = id == -1 && PyErr_Occurred();
    return *err || id < 0 ? NULL : cipi_leases_sub(&self->book, (uint64_t)id);
}

static PyObject *
core_is_free(LeaseCore *self, PyObject *arg)
{
    uint32_t slot;
    if (slot_of(self, arg, &slot) < 0)
        return NULL;
    return PyBool_FromLong(cipi_leases_is_free(&self->book, slot));
}

static PyObject *
core_pick_free(LeaseCore *self, PyObject *arg)
{
    unsigned long long start = PyLong_AsUnsignedLongLong(arg);
    if (start == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    long slot = cipi_leases_pick_free(&self->book, start);
    if (slot < 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(slot);
}

static PyObject *
core_lease_count(LeaseCore *self, PyObject *arg)
{
    uint32_t slot;
    if (slot_of(self, arg, &slot) < 0)
        return NULL;
    return PyLong_FromUnsignedLong(self->book.holders[slot].len);
}

static PyObject *
core_holds(LeaseCore *self, PyObject *arg)
{
    uint32_t slot;
    if (slot_of(self, arg, &slot) < 0)
        return NULL;
    return PyLong_FromUnsignedLong(self->book.holds[slot]);
}

static PyObject *
core_any_leased(LeaseCore *self, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(cipi_leases_any_leased(&self->book));
}

static PyObject *
core_free_slots(LeaseCore *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *out = PyList_New(0);
    for (uint32_t s = 0; out != NULL && s < self->book.num_slots; s++) {
        if (!cipi_leases_is_free(&self->book, s))
            continue;
        PyObject *x = PyLong_FromUnsignedLong(s);
        if (x == NULL || PyList_Append(out, x) < 0)
            Py_CLEAR(out);
        Py_XDECREF(x);
    }
    return out;
}

static int
cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static PyObject *
core_leases(LeaseCore *self, PyObject *arg)
{
    uint32_t slot;
    if (slot_of(self, arg, &slot) < 0)
        return NULL;
    const struct cipi_ids *h = &self->book.holders[slot];
    if (!self->book.has_seq[slot])
        return PyList_New(0);
    uint32_t *ids = (uint32_t *)PyMem_Malloc((h->len + 1) * sizeof *ids);
    if (ids == NULL)
        return PyErr_NoMemory();
    if (h->len) { /* an empty set has no array yet */
        memcpy(ids, h->v, h->len * sizeof *ids);
        qsort(ids, h->len, sizeof *ids, cmp_u32);
    }
    PyObject *out = PyList_New(h->len);
    for (uint32_t i = 0; out != NULL && i < h->len; i++) {
        PyObject *pair = Py_BuildValue("(IK)", ids[i], (unsigned long long)self->book.seq[slot]);
        if (pair == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, pair);
    }
    PyMem_Free(ids);
    return out;
}

static PyObject *
core_outstanding(LeaseCore *self, PyObject *arg)
{
    int err;
    struct cipi_lsub *sub = sub_of(self, arg, &err);
    if (err)
        return NULL;
    return PyLong_FromUnsignedLong(sub ? sub->leases.len : 0);
}

static PyObject *
core_held_by(LeaseCore *self, PyObject *arg)
{
    int err;
    struct cipi_lsub *sub = sub_of(self, arg, &err);
    if (err)
        return NULL;
    PyObject *out = PyDict_New();
    for (uint32_t i = 0; out != NULL && sub != NULL && i < sub->leases.len; i++) {
        PyObject *k = PyLong_FromUnsignedLongLong(sub->leases.v[i].seq);
        PyObject *v = PyLong_FromUnsignedLong(sub->leases.v[i].slot);
        if (k == NULL || v == NULL || PyDict_SetItem(out, k, v) < 0)
            Py_CLEAR(out);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    return out;
}

static PyObject *
core_credit(LeaseCore *self, PyObject *arg)
{
    int err;
    struct cipi_lsub *sub = sub_of(self, arg, &err);
    if (err)
        return NULL;
    return PyLong_FromUnsignedLong(sub ? sub->credit : 0);
}

static PyObject *
core_oldest_lease(LeaseCore *self, PyObject *arg)
{
    int err, has;
    struct cipi_lsub *sub = sub_of(self, arg, &err);
    if (err)
        return NULL;
    double t = cipi_leases_oldest(&self->book, sub, &has);
    if (!has)
        Py_RETURN_NONE;
    return PyFloat_FromDouble(t);
}

static PyObject *
core_overdue(LeaseCore *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 2, "overdue(now, timeout)") < 0)
        return NULL;
    double now = PyFloat_AsDouble(args[0]), timeout = PyFloat_AsDouble(args[1]);
    if (PyErr_Occurred())
        return NULL;
    uint32_t n = 0;
    uint32_t *ids = (uint32_t *)PyMem_Malloc((self->book.nsubs + 1) * sizeof *ids);
    if (ids == NULL)
        return PyErr_NoMemory();
    cipi_leases_overdue(&self->book, now, timeout, ids, &n);
    if (n)
        qsort(ids, n, sizeof *ids, cmp_u32);
    PyObject *out = u32_list(ids, n);
    PyMem_Free(ids);
    return out;
}

static PyObject *
core_next_expiry(LeaseCore *self, PyObject *arg)
{
    double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    double at;
    if (!cipi_leases_next_expiry(&self->book, timeout, &at))
        Py_RETURN_NONE;
    return PyFloat_FromDouble(at);
}

static PyObject *
core_readers_to_wait(LeaseCore *self, PyObject *arg)
{
    uint32_t slot;
    if (slot_of(self, arg, &slot) < 0)
        return NULL;
    const struct cipi_ids *r = &self->book.readers[slot];
    return u32_list(r->v, r->len);
}

static PyObject *
core_get(LeaseCore *self, void *closure)
{
    const struct cipi_leasebook *b = &self->book;
    switch (*(const char *)closure) {
    case 'n': return PyLong_FromUnsignedLong(b->num_slots);
    case 'c': return PyLong_FromUnsignedLong(b->max_credit);
    case 'r': return PyLong_FromUnsignedLong(b->latest_reserve);
    case 'm': return PyLong_FromUnsignedLong(b->max_due);
    case 'd': return PyLong_FromUnsignedLongLong(b->releases_due);
    case 'e': return PyLong_FromUnsignedLongLong(b->ended);
    case 'l': return PyLong_FromUnsignedLong(b->latest_slots);
    default:
        if (!b->have_last)
            Py_RETURN_NONE;
        return Py_BuildValue("(KI)", (unsigned long long)b->last_seq, b->last_slot);
    }
}

#define FAST(name) (PyCFunction)(void (*)(void))core_##name, METH_FASTCALL
static PyMethodDef core_methods[] = {
    {"add_subscriber", FAST(add_subscriber), NULL},
    {"remove_subscriber", (PyCFunction)core_remove_subscriber, METH_O, NULL},
    {"suspend", (PyCFunction)core_suspend, METH_O, NULL},
    {"subscribers", (PyCFunction)core_subscribers, METH_NOARGS, NULL},
    {"hold", (PyCFunction)core_hold, METH_O, NULL},
    {"unhold", (PyCFunction)core_unhold, METH_O, NULL},
    {"holds", (PyCFunction)core_holds, METH_O, NULL},
    {"publishing", FAST(publishing), NULL},
    {"release", FAST(release), NULL},
    {"settle", FAST(settle), NULL},
    {"settle_flagged", FAST(settle_flagged), NULL},
    {"cancel", FAST(cancel), NULL},
    {"is_free", (PyCFunction)core_is_free, METH_O, NULL},
    {"pick_free", (PyCFunction)core_pick_free, METH_O, NULL},
    {"lease_count", (PyCFunction)core_lease_count, METH_O, NULL},
    {"any_leased", (PyCFunction)core_any_leased, METH_NOARGS, NULL},
    {"free_slots", (PyCFunction)core_free_slots, METH_NOARGS, NULL},
    {"leases", (PyCFunction)core_leases, METH_O, NULL},
    {"outstanding", (PyCFunction)core_outstanding, METH_O, NULL},
    {"held_by", (PyCFunction)core_held_by, METH_O, NULL},
    {"credit", (PyCFunction)core_credit, METH_O, NULL},
    {"oldest_lease", (PyCFunction)core_oldest_lease, METH_O, NULL},
    {"overdue", FAST(overdue), NULL},
    {"next_expiry", (PyCFunction)core_next_expiry, METH_O, NULL},
    {"readers_to_wait", (PyCFunction)core_readers_to_wait, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef core_getset[] = {
    {"num_slots", (getter)core_get, NULL, NULL, "n"},
    {"max_credit", (getter)core_get, NULL, NULL, "c"},
    {"latest_reserve", (getter)core_get, NULL, NULL, "r"},
    {"max_due", (getter)core_get, NULL, NULL, "m"},
    {"releases_due", (getter)core_get, NULL, NULL, "d"},
    {"ended", (getter)core_get, NULL, NULL, "e"},
    {"latest_slots", (getter)core_get, NULL, NULL, "l"},
    {"last_published", (getter)core_get, NULL, NULL, "p"},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot core_slots[] = {
    {Py_tp_doc, "LeaseCore(num_slots, *, max_credit=None, latest_reserve=None): the "
                "publisher's lease book (c/src/leases.c); channel/_leases.py's LeaseBook "
                "documents it."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, core_init},
    {Py_tp_dealloc, core_dealloc},
    {Py_tp_methods, core_methods},
    {Py_tp_getset, core_getset},
    {0, NULL},
};

static PyType_Spec core_spec = {
    "cupy_ipcpool._engine.LeaseCore",
    sizeof(LeaseCore),
    0,
    Py_TPFLAGS_DEFAULT,
    core_slots,
};

static PyObject *
engine_lease_defaults(PyObject *Py_UNUSED(module), PyObject *arg)
{
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    uint32_t s = n < 0 ? 0 : n > UINT32_MAX ? UINT32_MAX : (uint32_t)n;
    return Py_BuildValue("(III)", cipi_default_latest_reserve(s), cipi_default_max_due(s),
                         cipi_default_max_credit(s));
}

static PyObject *
engine_granted_credit(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    long long v[2];
    if (ints(args, nargs, 2, "granted_credit(asked, max_credit)", v) < 0)
        return NULL;
    if (v[0] < 0)
        v[0] = 0;
    return PyLong_FromUnsignedLong(
        cipi_granted_credit((uint64_t)v[0], v[1] < 0 ? 0 : v[1] > UINT32_MAX ? UINT32_MAX
                                                                              : (uint32_t)v[1]));
}

static PyMethodDef lease_functions[] = {
    {"lease_defaults", (PyCFunction)engine_lease_defaults, METH_O,
     "lease_defaults(num_slots) -> (latest_reserve, max_due, max_credit)"},
    {"granted_credit", (PyCFunction)(void (*)(void))engine_granted_credit, METH_FASTCALL,
     "granted_credit(asked, max_credit) -> int: min(asked, max_credit), at least 1"},
    {NULL, NULL, 0, NULL},
};

int
cipy_leasebook_exec(PyObject *module)
{
    if (PyModule_AddFunctions(module, lease_functions) < 0 ||
        cipy_add_type(module, &core_spec, "LeaseCore") < 0)
        return -1;
    engine_state *es = (engine_state *)PyModule_GetState(module);
    es->lease_core = PyObject_GetAttrString(module, "LeaseCore");
    return es->lease_core == NULL ? -1 : 0;
}

/* A subscriber's mode by its name: CIPI_LEASE_*, or -1 (no exception) for another. */
int
cipy_lease_mode(PyObject *name)
{
    if (!PyUnicode_Check(name))
        return -1;
    return PyUnicode_CompareWithASCIIString(name, "block") == 0    ? CIPI_LEASE_BLOCK
           : PyUnicode_CompareWithASCIIString(name, "latest") == 0 ? CIPI_LEASE_LATEST
           : PyUnicode_CompareWithASCIIString(name, "ahead") == 0  ? CIPI_LEASE_AHEAD
                                                                   : -1;
}

/* The UsageError of a mode cipy_lease_mode does not know; NULL. */
PyObject *
cipy_lease_mode_error(engine_state *es, PyObject *name)
{
    PyObject *cls = PyObject_GetAttrString(es->errors, "UsageError");
    if (cls != NULL) {
        PyErr_Format(cls, "mode must be 'block', 'latest' or 'ahead', not %R", name);
        Py_DECREF(cls);
    }
    return NULL;
}

struct cipi_leasebook *
cipy_leasebook_of(engine_state *es, PyObject *obj)
{
    if (!PyObject_TypeCheck(obj, (PyTypeObject *)es->lease_core)) {
        PyErr_Format(PyExc_TypeError, "a LeaseCore is needed, not %.100s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    LeaseCore *core = (LeaseCore *)obj;
    if (!core->ready) {
        PyErr_SetString(PyExc_RuntimeError, "the LeaseCore is not initialised");
        return NULL;
    }
    return &core->book;
}
