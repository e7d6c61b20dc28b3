/*
 * cupy_ipcpool._hotpath: the per-frame bookkeeping of the pool, peer and
 * channel layers, compiled.
 *
 * docs/performance.md, section 8, found the round trip's distance to its floor
 * made of the library's own per-frame Python in both processes, spread over
 * a dozen small functions.  The calls here do the steady state of three of
 * them in one C call each, on the Python objects that own the state (nothing
 * is copied into C, so every other path keeps reading and writing the same
 * lists, dicts and sets):
 *
 *   take_slot    pool layer: the slot pick (SlotTable.take's first look) and
 *                the generation bump;
 *   order_slot   channel layer: the publisher's lease source ordering a new
 *                writer after the read flags of the subscribers that read the
 *                slot (SyncPage.order_all for one flag);
 *   take_frame   peer and channel layers: the subscriber's frame assembly,
 *                the FRAME payload's head and handles checked, the kept arrays
 *                handed out again to the new frame's lease (PeerPool.
 *                arrays_from_wire), the stream ordered after the frame flag.
 *
 * Each answers None when the case is not the steady state (a geometry not
 * cached yet, a kept array in use, no free slot, a lock held by another
 * thread, anything malformed): the caller then runs the Python path, which
 * decides and raises exactly as before.  A call that answers None has changed
 * nothing.  The calls hold the GIL throughout and call no Python code but the
 * locks' acquire/release, so what they read is consistent.
 *
 * Layouts known here, exported as HANDLE_LAYOUT and FRAME_LAYOUT; their one
 * source is the Python code, which refuses a build that differs at import
 * (cupy_ipcpool._compiled): an array handle's "<IQQBB" header (the generation
 * at byte 4, the offset at 12, ndim at 20) followed by 16 bytes per dimension
 * (cupy_ipcpool._handles), and the head of a FRAME message's payload "<IIHH"
 * (flag, generation, array count, metadata length) with the channel's limits
 * (cupy_ipcpool.channel._payload).  The FRAME message's own header, around
 * that payload, is channel/_frameio.c's (CIP_FRAME_MSG_HEAD).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "_le.h"
#include "_memop_args.h"

/* HANDLE_LAYOUT: cupy_ipcpool._handles._HANDLE_HEADER = "<IQQBB" and its field offsets */
#define CIP_HANDLE_HEAD 22
#define CIP_GENERATION_AT 4
#define CIP_OFFSET_AT 12
#define CIP_NDIM_AT 20
/* FRAME_LAYOUT: cupy_ipcpool.channel._payload.FRAME_HEAD = "<IIHH", MAX_ARRAYS, MAX_METADATA */
#define CIP_FRAME_PAYLOAD_HEAD 12
#define CIP_MAX_ARRAYS 64
#define CIP_MAX_METADATA 16384

static PyObject *S_array, *S_memptr, *S_mem, *S_n_array, *S_n_memptr, *S_n_mem;
static PyObject *ONE;
static PyObject *S_holder, *S_owner, *S_acquire, *S_release, *S_current, *S_holder_sets;
static PyObject *S_in_use;

/* ------------------------------------------------------------------------ */
/* Kept arrays (cupy_ipcpool._arrays.KeptArray)                              */
/* ------------------------------------------------------------------------ */

/* The reference count of kept.<name> as sys.getrefcount(kept.<name>) reads it:
 * the attribute's own references plus the one the reader holds. */
static Py_ssize_t
attr_refs(PyObject *kept, PyObject *name)
{
    PyObject *o = PyObject_GetAttr(kept, name);
    if (o == NULL)
        return -1;
    Py_ssize_t n = Py_REFCNT(o);
    Py_DECREF(o);
    return n;
}

static Py_ssize_t
attr_ssize(PyObject *obj, PyObject *name)
{
    PyObject *o = PyObject_GetAttr(obj, name);
    if (o == NULL)
        return -1;
    Py_ssize_t n = PyLong_AsSsize_t(o);
    Py_DECREF(o);
    return n;
}

/* The class KeptArray (set by set_kept_type): its instances are looked at here;
 * any other object's in_use() is called. */
static PyObject *KeptType;

static int kept_rule(PyObject *kept);

/* An object's in_use(): 1 in use, 0 not, -1 with an exception. */
static int
kept_in_use(PyObject *obj)
{
    if (KeptType != NULL && PyObject_TypeCheck(obj, (PyTypeObject *)KeptType))
        return kept_rule(obj);
    PyObject *r = PyObject_CallMethodNoArgs(obj, S_in_use);
    if (r == NULL)
        return -1;
    int busy = PyObject_IsTrue(r);
    Py_DECREF(r);
    return busy;
}

/* KeptArray.in_use, on its three reference counts. */
static int
kept_rule(PyObject *kept)
{
    PyObject *objs[3] = {S_array, S_memptr, S_mem};
    PyObject *base[3] = {S_n_array, S_n_memptr, S_n_mem};
    for (int i = 0; i < 3; i++) {
        Py_ssize_t now = attr_refs(kept, objs[i]);
        if (now < 0)
            return -1;
        Py_ssize_t then = attr_ssize(kept, base[i]);
        if (then == -1 && PyErr_Occurred())
            return -1;
        if (now != then)
            return 1;
    }
    return 0;
}

PyDoc_STRVAR(in_use_doc,
"in_use(kept) -> bool\n"
"\n"
"``kept.in_use()`` as the compiled calls evaluate it: for a ``KeptArray``\n"
"(see ``set_kept_type``), whether anything besides ``kept`` refers to its\n"
"array, MemoryPointer or memory; for any other object, its ``in_use()``.");

static PyObject *
hotpath_in_use(PyObject *Py_UNUSED(module), PyObject *kept)
{
    int r = kept_in_use(kept);
    if (r < 0)
        return NULL;
    return PyBool_FromLong(r);
}

PyDoc_STRVAR(set_kept_type_doc,
"set_kept_type(cls) -> None\n"
"\n"
"Name ``cupy_ipcpool._arrays.KeptArray``: the compiled calls evaluate its\n"
"``in_use`` rule on its instances themselves (its subclasses must not\n"
"override ``in_use``) and call ``in_use()`` of any other object.");

static PyObject *
hotpath_set_kept_type(PyObject *Py_UNUSED(module), PyObject *cls)
{
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "set_kept_type: a class is needed");
        return NULL;
    }
    Py_INCREF(cls);
    Py_XSETREF(KeptType, cls);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(attr_refcount_doc,
"attr_refcount(obj, name) -> int\n"
"\n"
"The reference count of ``getattr(obj, name)`` as the compiled calls read it;\n"
"the session layer checks at load that it equals ``sys.getrefcount`` of the\n"
"same attribute, the rule ``KeptArray`` takes its base counts by.");

static PyObject *
hotpath_attr_refcount(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "attr_refcount(obj, name) takes 2 arguments");
        return NULL;
    }
    Py_ssize_t n = attr_refs(args[0], args[1]);
    if (n < 0)
        return NULL;
    return PyLong_FromSsize_t(n);
}

/* ------------------------------------------------------------------------ */
/* Stream ordering on a host-visible flag (channel._syncpage.SyncPage.order) */
/* ------------------------------------------------------------------------ */

/* Whether the host sees the 32-bit flag at device address addr at value or past
 * it (cyclically); words/base: the page's host view and device address. */
static int
flag_reached(const Py_buffer *words, unsigned long long base, unsigned long long addr,
             unsigned int value)
{
    unsigned long long off = addr - base;
    if (addr < base || off + 4 > (unsigned long long)words->len || (off & 3))
        return -1;
    const volatile unsigned int *w =
        (const volatile unsigned int *)((const char *)words->buf + off);
    return ((unsigned int)(*w - value)) < 0x80000000u;
}

/* Parse (words, base, wait_fn, geq): the sync page's host view, its device
 * address, the cuStreamWaitValue32 pointer and its flags. */
typedef struct {
    Py_buffer words;
    unsigned long long base;
    memop_fn wait;
    unsigned int geq;
} page_t;

static int
load_page(PyObject *words, PyObject *base, PyObject *fn, PyObject *flags, page_t *page)
{
    if (PyObject_GetBuffer(words, &page->words, PyBUF_SIMPLE) < 0)
        return -1;
    page->base = PyLong_AsUnsignedLongLong(base);
    page->wait = (memop_fn)PyLong_AsVoidPtr(fn);
    unsigned long f = PyLong_AsUnsignedLong(flags);
    if (PyErr_Occurred() || page->wait == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "the wait function pointer is NULL");
        PyBuffer_Release(&page->words);
        return -1;
    }
    page->geq = (unsigned int)f;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* The subscriber's frame assembly                                           */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(take_frame_doc,
"take_frame(ctx, payload, slot, owner, stream) -> tuple | None\n"
"\n"
"The steady state of a GPU subscriber's ``recv`` after the receive.\n"
"``ctx`` is ``(geometry cache, kept views, seen generations, lent list,\n"
"words, base, frame flag addresses, wait fn, wait flags)`` (the peer pool's\n"
"caches and the sync page's, made once); ``payload`` the FRAME payload of\n"
"``slot``; ``owner`` the frame's lease.  When the head is consistent, every\n"
"handle's geometry is cached, no generation is older than one seen, every\n"
"kept array is free and appears once, and the metadata length adds up: the\n"
"kept arrays are handed to ``owner``, the seen generations advanced, and\n"
"``stream`` made to wait on the frame flag unless the host sees it set.\n"
"Returns ``(generation, arrays, metadata, waited, rc)`` (``rc``: the driver's\n"
"error of that wait, 0 on success).  Otherwise None, with nothing changed:\n"
"the caller decodes the frame in Python.");

typedef struct {
    PyObject *key;  /* new reference */
    PyObject *view; /* borrowed from the views dict (kept alive by it) */
    unsigned long long generation;
    Py_ssize_t slot;
} handle_t;

static PyObject *
hotpath_take_frame(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "take_frame(ctx, payload, slot, owner, stream) takes 5 arguments");
        return NULL;
    }
    PyObject *ctx = args[0];
    if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) != 9) {
        PyErr_SetString(PyExc_TypeError, "take_frame: ctx must be a 9-tuple");
        return NULL;
    }
    PyObject *cache = PyTuple_GET_ITEM(ctx, 0), *views = PyTuple_GET_ITEM(ctx, 1);
    PyObject *seen = PyTuple_GET_ITEM(ctx, 2), *lent = PyTuple_GET_ITEM(ctx, 3);
    PyObject *flags = PyTuple_GET_ITEM(ctx, 6);
    if (!PyDict_Check(cache) || !PyDict_Check(views) || !PyList_Check(seen) ||
        !PyList_Check(lent) || !PyList_Check(flags)) {
        PyErr_SetString(PyExc_TypeError, "take_frame: ctx holds the wrong types");
        return NULL;
    }
    Py_ssize_t slot = PyLong_AsSsize_t(args[2]);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    void *stream = PyLong_AsVoidPtr(args[4]);
    if (stream == NULL && PyErr_Occurred())
        return NULL;
    PyObject *owner = args[3];

    Py_buffer buf;
    if (PyObject_GetBuffer(args[1], &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *data = (const unsigned char *)buf.buf;
    Py_ssize_t n = buf.len;
    handle_t handles[CIP_MAX_ARRAYS];
    Py_ssize_t count = 0;
    PyObject *result = Py_None; /* None until every check passed */
    Py_INCREF(Py_None);

    if (n < CIP_FRAME_PAYLOAD_HEAD || slot < 0 || slot >= PyList_GET_SIZE(flags) ||
        slot >= PyList_GET_SIZE(seen) || (Py_ssize_t)le32(data) != slot)
        goto done;
    unsigned int generation = le32(data + 4);
    Py_ssize_t want = (Py_ssize_t)le16(data + 8);
    Py_ssize_t meta_len = (Py_ssize_t)le16(data + 10);
    if (want > CIP_MAX_ARRAYS || meta_len > CIP_MAX_METADATA)
        goto done;
    Py_ssize_t pos = CIP_FRAME_PAYLOAD_HEAD;

    /* First pass: look everything up, change nothing. */
    for (; count < want;) {
        if (n - pos < CIP_HANDLE_HEAD)
            goto done;
        Py_ssize_t end = pos + CIP_HANDLE_HEAD + 16 * (Py_ssize_t)data[pos + CIP_NDIM_AT];
        if (end > n)
            goto done;
        handle_t *h = &handles[count];
        /* the geometry key: the handle without its generation (ArrayHandle.peek) */
        h->key = PyBytes_FromStringAndSize(NULL, CIP_GENERATION_AT + (end - pos - CIP_OFFSET_AT));
        if (h->key == NULL)
            goto fail;
        count++;
        char *k = PyBytes_AS_STRING(h->key);
        memcpy(k, data + pos, CIP_GENERATION_AT);
        memcpy(k + CIP_GENERATION_AT, data + pos + CIP_OFFSET_AT, (size_t)(end - pos - CIP_OFFSET_AT));
        h->generation = le64(data + pos + CIP_GENERATION_AT);
        PyObject *geometry = PyDict_GetItemWithError(cache, h->key); /* borrowed */
        if (geometry == NULL) {
            if (PyErr_Occurred())
                goto fail;
            goto done; /* not validated yet: the Python path does it */
        }
        if (!PyTuple_Check(geometry) || PyTuple_GET_SIZE(geometry) < 1)
            goto done;
        h->slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(geometry, 0));
        if (h->slot == -1 && PyErr_Occurred())
            goto fail;
        if (h->slot < 0 || h->slot >= PyList_GET_SIZE(seen))
            goto done;
        PyObject *last = PyList_GET_ITEM(seen, h->slot);
        unsigned long long last_gen = PyLong_AsUnsignedLongLong(last);
        if (last_gen == (unsigned long long)-1 && PyErr_Occurred())
            goto fail;
        if (h->generation < last_gen)
            goto done; /* stale: the Python path raises */
        h->view = PyDict_GetItemWithError(views, h->key);
        if (h->view == NULL) {
            if (PyErr_Occurred())
                goto fail;
            goto done; /* no kept array yet */
        }
        for (Py_ssize_t j = 0; j < count - 1; j++)
            if (handles[j].view == h->view)
                goto done; /* the same geometry twice in one frame */
        int busy = kept_in_use(h->view);
        if (busy < 0)
            goto fail;
        if (busy)
            goto done; /* in use: the Python path makes a new one */
        pos = end;
    }
    if (n - pos != meta_len)
        goto done;

    /* The host's look at the frame flag, before anything changes: a ctx that does
     * not describe the page raises with nothing handed out.  (Looking before the
     * hand-out can only see an older value: at worst a wait more.) */
    page_t page;
    if (load_page(PyTuple_GET_ITEM(ctx, 4), PyTuple_GET_ITEM(ctx, 5), PyTuple_GET_ITEM(ctx, 7),
                  PyTuple_GET_ITEM(ctx, 8), &page) < 0)
        goto fail;
    unsigned long long addr = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(flags, slot));
    int reached = PyErr_Occurred() ? -1 : flag_reached(&page.words, page.base, addr, generation);
    if (reached < 0) {
        PyBuffer_Release(&page.words);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "take_frame: the frame flag is not in the page");
        goto fail;
    }
    PyObject *arrays = PyTuple_New(count);
    PyObject *metadata = PyBytes_FromStringAndSize((const char *)data + pos, n - pos);
    if (arrays == NULL || metadata == NULL) {
        PyBuffer_Release(&page.words);
        Py_XDECREF(arrays);
        Py_XDECREF(metadata);
        goto fail;
    }

    /* Second pass: hand the arrays out. */
    int bad = 0;
    for (Py_ssize_t i = 0; i < count && !bad; i++) {
        handle_t *h = &handles[i];
        PyObject *array = PyObject_GetAttr(h->view, S_array);
        bad = array == NULL;
        if (!bad)
            PyTuple_SET_ITEM(arrays, i, array);
    }
    for (Py_ssize_t i = 0; i < count && !bad; i++) {
        handle_t *h = &handles[i];
        PyObject *gen = PyLong_FromUnsignedLongLong(h->generation);
        bad = gen == NULL || PyList_SetItem(seen, h->slot, gen) < 0; /* steals gen */
        PyObject *holder = bad ? NULL : PyObject_GetAttr(h->view, S_holder);
        bad = bad || holder == NULL || PyObject_SetAttr(holder, S_owner, owner) < 0 ||
              PyList_Append(lent, h->view) < 0;
        Py_XDECREF(holder);
    }
    if (bad) {
        PyBuffer_Release(&page.words);
        Py_DECREF(arrays);
        Py_DECREF(metadata);
        goto fail;
    }

    /* The stream waits on the frame flag unless the host saw it set. */
    int rc = 0;
    if (reached == 0) {
        memop_fn wait = page.wait;
        unsigned int geq = page.geq;
        Py_BEGIN_ALLOW_THREADS
        rc = wait(stream, addr, generation, geq);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&page.words);
    Py_DECREF(result);
    result = Py_BuildValue("(INNOi)", generation, arrays, metadata,
                           reached == 0 ? Py_True : Py_False, rc);
    goto done;

fail:
    Py_CLEAR(result);
done:
    for (Py_ssize_t i = 0; i < count; i++)
        Py_DECREF(handles[i].key);
    PyBuffer_Release(&buf);
    return result;
}

/* ------------------------------------------------------------------------ */
/* The pool's slot pick (cupy_ipcpool._slots.SlotTable)                      */
/* ------------------------------------------------------------------------ */

/* lock.acquire(False): 1 taken, 0 held elsewhere, -1 error. */
static int
try_lock(PyObject *lock)
{
    PyObject *r = PyObject_CallMethodOneArg(lock, S_acquire, Py_False);
    if (r == NULL)
        return -1;
    int taken = PyObject_IsTrue(r);
    Py_DECREF(r);
    return taken;
}

/* lock.release(); an exception already set is kept (and a failure of release
 * then dropped).  0, or -1 with an exception set. */
static int
unlock(PyObject *lock)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallMethodNoArgs(lock, S_release);
    Py_XDECREF(r);
    if (type != NULL) {
        PyErr_Clear();
        PyErr_Restore(type, value, tb);
        return -1;
    }
    return r == NULL ? -1 : 0;
}

PyDoc_STRVAR(take_slot_doc,
"take_slot(ctx, sources, start) -> tuple | None\n"
"\n"
"``SlotTable.take``'s first look, for a writer of any slot: ``ctx`` is\n"
"``(table, lock, counts, writing, generation, views)`` (made once),\n"
"``sources`` the table's lease sources, ``start`` the first slot to look at\n"
"(round-robin).  With the table's lock free, the\n"
"first slot with no local reference, no writer, no kept view in use and no\n"
"lease of any lease source (each source's ``holder_sets``: item ``s`` a set\n"
"of the holders of slot ``s``) is marked written, its generation bumped, and\n"
"made the table's ``current``; returns ``(slot, generation)``.  None when no\n"
"slot is free, the lock is held elsewhere, or a source has no\n"
"``holder_sets``: nothing changed, the caller takes the Python path.");

static PyObject *
hotpath_take_slot(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "take_slot(ctx, sources, start) takes 3 arguments");
        return NULL;
    }
    PyObject *ctx = args[0], *sources = args[1];
    if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) != 6 || !PyTuple_Check(sources)) {
        PyErr_SetString(PyExc_TypeError, "take_slot: ctx must be a 6-tuple, sources a tuple");
        return NULL;
    }
    PyObject *table = PyTuple_GET_ITEM(ctx, 0), *lock = PyTuple_GET_ITEM(ctx, 1);
    PyObject *counts = PyTuple_GET_ITEM(ctx, 2), *writing = PyTuple_GET_ITEM(ctx, 3);
    PyObject *gens = PyTuple_GET_ITEM(ctx, 4), *views = PyTuple_GET_ITEM(ctx, 5);
    if (!PyList_Check(counts) || !PyList_Check(writing) || !PyList_Check(gens) ||
        !PyList_Check(views)) {
        PyErr_SetString(PyExc_TypeError, "take_slot: ctx holds the wrong types");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t nsrc = PyTuple_GET_SIZE(sources);
    PyObject *sets[8];
    if (nsrc > 8)
        Py_RETURN_NONE;
    Py_ssize_t got = 0;
    PyObject *result = NULL;
    for (; got < nsrc; got++) {
        sets[got] = PyObject_GetAttr(PyTuple_GET_ITEM(sources, got), S_holder_sets);
        if (sets[got] == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                goto out;
            PyErr_Clear();
            result = Py_NewRef(Py_None);
            goto out;
        }
        if (!PyList_Check(sets[got])) {
            got++;
            result = Py_NewRef(Py_None);
            goto out;
        }
    }
    int taken = try_lock(lock);
    if (taken <= 0) {
        if (taken == 0)
            result = Py_NewRef(Py_None);
        goto out;
    }
    Py_ssize_t n = PyList_GET_SIZE(counts);
    if (PyList_GET_SIZE(writing) != n || PyList_GET_SIZE(gens) != n ||
        PyList_GET_SIZE(views) != n || n == 0)
        goto unlock_none;
    for (Py_ssize_t i = 0; i < nsrc; i++)
        if (PyList_GET_SIZE(sets[i]) != n)
            goto unlock_none;
    if (start < 0)
        start = 0;
    for (Py_ssize_t step = 0; step < n; step++) {
        Py_ssize_t s = (start + step) % n;
        int busy = PyObject_IsTrue(PyList_GET_ITEM(counts, s));
        if (busy == 0)
            busy = PyObject_IsTrue(PyList_GET_ITEM(writing, s));
        if (busy < 0)
            goto unlock_fail;
        if (busy)
            continue;
        PyObject *view = PyList_GET_ITEM(views, s);
        if (view != Py_None) {
            busy = kept_in_use(view);
            if (busy < 0)
                goto unlock_fail;
            if (busy)
                continue;
        }
        for (Py_ssize_t i = 0; i < nsrc && !busy; i++) {
            PyObject *holders = PyList_GET_ITEM(sets[i], s);
            Py_ssize_t size = PyObject_Size(holders);
            if (size < 0)
                goto unlock_fail;
            busy = size > 0;
        }
        if (busy)
            continue;
        /* free: mark it written, bump its generation, make it current */
        PyObject *old = PyList_GET_ITEM(gens, s);
        PyObject *gen = PyNumber_Add(old, ONE);
        if (gen == NULL)
            goto unlock_fail;
        PyObject *slot = PyLong_FromSsize_t(s);
        if (slot == NULL || PyObject_SetAttr(table, S_current, slot) < 0) {
            Py_XDECREF(slot);
            Py_DECREF(gen);
            goto unlock_fail;
        }
        Py_INCREF(Py_True);
        PyList_SetItem(writing, s, Py_True);
        Py_INCREF(gen);
        PyList_SetItem(gens, s, gen);
        result = PyTuple_Pack(2, slot, gen);
        Py_DECREF(slot);
        Py_DECREF(gen);
        if (unlock(lock) < 0)
            Py_CLEAR(result);
        goto out;
    }
unlock_none:
    if (unlock(lock) == 0)
        result = Py_NewRef(Py_None);
    goto out;
unlock_fail:
    unlock(lock); /* keeps the exception */
out:
    for (Py_ssize_t i = 0; i < got; i++)
        Py_XDECREF(sets[i]);
    return result;
}

/* ------------------------------------------------------------------------ */
/* The publisher's ordering of a new writer (channel._publisher)             */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(order_slot_doc,
"order_slot(ctx, slot, stream) -> tuple | None\n"
"\n"
"``_PublisherLeases.order_write`` for the usual case: ``ctx`` is ``(lock,\n"
"readers, rows, published, words, base, wait fn, wait flags)`` (the session's\n"
"lock, the lease book's per-slot lists of subscribers that read a slot, the\n"
"publisher's rows of read-flag addresses by subscriber id, the generation\n"
"published per slot, the sync page's host view, device address and\n"
"``cuStreamWaitValue32``).  With the lock free, ``stream`` is made to wait on\n"
"the read flag of each reader of ``slot`` that the host does not see at the\n"
"slot's published generation yet; returns ``(waits, rc)`` (``rc``: the\n"
"driver's error, 0 on success).  None when the lock is held elsewhere or\n"
"more than one flag needs a wait (the Python path batches those): nothing\n"
"enqueued.");

static PyObject *
hotpath_order_slot(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "order_slot(ctx, slot, stream) takes 3 arguments");
        return NULL;
    }
    PyObject *ctx = args[0];
    if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) != 8) {
        PyErr_SetString(PyExc_TypeError, "order_slot: ctx must be an 8-tuple");
        return NULL;
    }
    PyObject *lock = PyTuple_GET_ITEM(ctx, 0), *readers = PyTuple_GET_ITEM(ctx, 1);
    PyObject *rows = PyTuple_GET_ITEM(ctx, 2), *published = PyTuple_GET_ITEM(ctx, 3);
    if (!PyList_Check(readers) || !PyDict_Check(rows) || !PyList_Check(published)) {
        PyErr_SetString(PyExc_TypeError, "order_slot: ctx holds the wrong types");
        return NULL;
    }
    Py_ssize_t slot = PyLong_AsSsize_t(args[1]);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    void *stream = PyLong_AsVoidPtr(args[2]);
    if (stream == NULL && PyErr_Occurred())
        return NULL;
    if (slot < 0 || slot >= PyList_GET_SIZE(readers) || slot >= PyList_GET_SIZE(published)) {
        PyErr_Format(PyExc_IndexError, "order_slot: slot %zd out of range", slot);
        return NULL;
    }
    page_t page;
    if (load_page(PyTuple_GET_ITEM(ctx, 4), PyTuple_GET_ITEM(ctx, 5), PyTuple_GET_ITEM(ctx, 6),
                  PyTuple_GET_ITEM(ctx, 7), &page) < 0)
        return NULL;
    PyObject *result = NULL;
    int taken = try_lock(lock);
    if (taken <= 0) {
        if (taken == 0)
            result = Py_NewRef(Py_None);
        PyBuffer_Release(&page.words);
        return result;
    }
    unsigned int value = (unsigned int)(PyLong_AsUnsignedLongLongMask(
                                            PyList_GET_ITEM(published, slot)) & 0xFFFFFFFFull);
    PyObject *who = PyList_GET_ITEM(readers, slot);
    unsigned long long pending = 0;
    int npending = 0;
    if (!PyErr_Occurred() && !PyList_Check(who))
        PyErr_SetString(PyExc_TypeError, "order_slot: the readers of a slot must be a list");
    if (PyErr_Occurred())
        goto unlock;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(who); i++) {
        PyObject *row = PyDict_GetItemWithError(rows, PyList_GET_ITEM(who, i)); /* borrowed */
        if (row == NULL) {
            if (PyErr_Occurred())
                goto unlock;
            continue; /* gone since: no flag to wait on */
        }
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 2 ||
            !PyList_Check(PyTuple_GET_ITEM(row, 1)) ||
            PyList_GET_SIZE(PyTuple_GET_ITEM(row, 1)) <= slot) {
            PyErr_SetString(PyExc_TypeError, "order_slot: a row is not (index, [flag, ...])");
            goto unlock;
        }
        unsigned long long addr =
            PyLong_AsUnsignedLongLong(PyList_GET_ITEM(PyTuple_GET_ITEM(row, 1), slot));
        if (PyErr_Occurred())
            goto unlock;
        int reached = flag_reached(&page.words, page.base, addr, value);
        if (reached < 0) {
            PyErr_SetString(PyExc_ValueError, "order_slot: a read flag is not in the page");
            goto unlock;
        }
        if (!reached) {
            pending = addr;
            npending++;
        }
    }
    if (npending > 1) {
        result = Py_NewRef(Py_None); /* the Python path waits on them in one batch */
        goto unlock;
    }
    int rc = 0;
    if (npending == 1) {
        memop_fn wait = page.wait;
        unsigned int geq = page.geq;
        Py_BEGIN_ALLOW_THREADS
        rc = wait(stream, pending, value, geq);
        Py_END_ALLOW_THREADS
    }
    result = Py_BuildValue("(ii)", npending, rc);
unlock:
    if (unlock(lock) < 0)
        Py_CLEAR(result);
    PyBuffer_Release(&page.words);
    return result;
}

/* ------------------------------------------------------------------------ */
/* The module                                                                */
/* ------------------------------------------------------------------------ */

static PyMethodDef hotpath_methods[] = {
    {"take_frame", (PyCFunction)(void (*)(void))hotpath_take_frame, METH_FASTCALL, take_frame_doc},
    {"take_slot", (PyCFunction)(void (*)(void))hotpath_take_slot, METH_FASTCALL, take_slot_doc},
    {"order_slot", (PyCFunction)(void (*)(void))hotpath_order_slot, METH_FASTCALL, order_slot_doc},
    {"in_use", hotpath_in_use, METH_O, in_use_doc},
    {"set_kept_type", hotpath_set_kept_type, METH_O, set_kept_type_doc},
    {"attr_refcount", (PyCFunction)(void (*)(void))hotpath_attr_refcount, METH_FASTCALL,
     attr_refcount_doc},
    {NULL, NULL, 0, NULL},
};

static int
intern(PyObject **slot, const char *name)
{
    *slot = PyUnicode_InternFromString(name);
    return *slot == NULL ? -1 : 0;
}

static int
hotpath_exec(PyObject *module)
{
    if (intern(&S_array, "array") < 0 || intern(&S_memptr, "_memptr") < 0 ||
        intern(&S_mem, "_mem") < 0 || intern(&S_n_array, "_n_array") < 0 ||
        intern(&S_n_memptr, "_n_memptr") < 0 || intern(&S_n_mem, "_n_mem") < 0 ||
        intern(&S_holder, "holder") < 0 || intern(&S_owner, "owner") < 0 ||
        intern(&S_acquire, "acquire") < 0 || intern(&S_release, "release") < 0 ||
        intern(&S_current, "current") < 0 || intern(&S_holder_sets, "holder_sets") < 0 ||
        intern(&S_in_use, "in_use") < 0)
        return -1;
    ONE = PyLong_FromLong(1);
    if (ONE == NULL)
        return -1;
    /* The layouts this build reads; the Python side compares them with its own. */
    PyObject *handle = Py_BuildValue("(iiii)", CIP_HANDLE_HEAD, CIP_GENERATION_AT,
                                     CIP_OFFSET_AT, CIP_NDIM_AT);
    if (handle == NULL)
        return -1;
    if (PyModule_AddObject(module, "HANDLE_LAYOUT", handle) < 0) {
        Py_DECREF(handle);
        return -1;
    }
    PyObject *frame =
        Py_BuildValue("(iii)", CIP_FRAME_PAYLOAD_HEAD, CIP_MAX_ARRAYS, CIP_MAX_METADATA);
    if (frame == NULL)
        return -1;
    if (PyModule_AddObject(module, "FRAME_LAYOUT", frame) < 0) {
        Py_DECREF(frame);
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot hotpath_slots[] = {
    {Py_mod_exec, hotpath_exec},
    {0, NULL},
};

static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT,
    "cupy_ipcpool._hotpath",
    "The per-frame bookkeeping of the pool, peer and channel layers, compiled "
    "(see docs/performance.md).",
    0,
    hotpath_methods,
    hotpath_slots,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    return PyModuleDef_Init(&hotpath_module);
}
