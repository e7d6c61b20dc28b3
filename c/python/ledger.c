/*
 * cupy_ipcpool._engine.FrameLedger: the engine's frame ledger (c/src/ledger.c) for the
 * Python subscriber -- rule 1 of the stream (the order of frames, one frame held per
 * slot), the releases of frames held, and releases ahead of a frame's message.  The C
 * subscriber keeps the same struct cipi_ledger: one implementation of these rules.
 *
 * Every method runs under the GIL and never releases it, so a release from another
 * thread (or the garbage collector) and a receive see the ledger one call at a time.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_memop_args.h"
#include "cip_internal.h"
#include "engine.h"

typedef struct {
    PyObject_HEAD
    struct cipi_ledger ledger;
    int ready; /* ledger initialised */
} FrameLedger;

static engine_state *
state(FrameLedger *self)
{
    return (engine_state *)PyType_GetModuleState(Py_TYPE(self));
}

static int
ledger_init(FrameLedger *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"num_slots", "next_seq", NULL};
    long long num_slots;
    unsigned long long next_seq;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LK:FrameLedger", names, &num_slots, &next_seq))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "FrameLedger is initialised once");
        return -1;
    }
    if (num_slots < 1 || num_slots > CIP_WIRE_MAX_SLOTS) {
        PyErr_Format(state(self)->usage_error, "a frame ledger has 1..%u slots, not %lld",
                     CIP_WIRE_MAX_SLOTS, num_slots);
        return -1;
    }
    if (cipi_ledger_init(&self->ledger, (uint32_t)num_slots, next_seq) != CIP_OK) {
        PyErr_NoMemory();
        return -1;
    }
    self->ready = 1;
    return 0;
}

static void
ledger_dealloc(FrameLedger *self)
{
    if (self->ready)
        cipi_ledger_free(&self->ledger);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* (seq, slot) from two Python ints: 0, 1 when either is outside 0..2**64-1 (no error
 * set: no frame has it), -1 with an exception (not an int, or the ledger not ready). */
static int
seq_slot(FrameLedger *self, PyObject *const *args, Py_ssize_t nargs, const char *signature,
         uint64_t *seq, uint64_t *slot)
{
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "FrameLedger was not initialised");
        return -1;
    }
    if (check_nargs(nargs, 2, signature) < 0)
        return -1;
    unsigned long long v[2];
    for (int i = 0; i < 2; i++) {
        if (!PyLong_Check(args[i])) {
            PyErr_Format(PyExc_TypeError, "%s: seq and slot must be ints", signature);
            return -1;
        }
        v[i] = PyLong_AsUnsignedLongLong(args[i]);
        if (v[i] == (unsigned long long)-1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError))
                return -1;
            PyErr_Clear();
            return 1;
        }
    }
    *seq = v[0];
    *slot = v[1];
    return 0;
}

static PyObject *
protocol_error(FrameLedger *self)
{
    PyErr_SetString(state(self)->protocol_error, cip_last_error());
    return NULL;
}

PyDoc_STRVAR(take_doc,
"take(seq, slot, /) -> bool\n\n"
"FRAME ``seq`` in ``slot`` was received: raise ``ProtocolError`` (saying why) if it\n"
"breaks rule 1 -- a slot outside the ring, a seq below the WELCOME's ``next_seq``\n"
"or not after every seq received, a slot where a frame of ours is still held --\n"
"else note it received and return True if it is held now, False if it was\n"
"released ahead of its message (then it is not held).");

static PyObject *
ledger_take(FrameLedger *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t seq, slot;
    int r = seq_slot(self, args, nargs, "take(seq, slot)", &seq, &slot);
    if (r < 0)
        return NULL;
    if (r > 0) {
        PyErr_Format(state(self)->protocol_error, "a frame's seq or slot is out of range");
        return NULL;
    }
    if (cipi_ledger_receive(&self->ledger, seq, slot) != CIP_OK)
        return protocol_error(self);
    return PyBool_FromLong(cipi_ledger_hold(&self->ledger, seq, (uint32_t)slot));
}

PyDoc_STRVAR(judge_doc,
"judge(data, /) -> tuple\n\n"
"What one message of a live stream means (the C subscriber's judge): a FRAME that\n"
"rule 1 takes, ``(\"frame\", seq, slot, held, payload)`` (noted as by ``take``); a BYE,\n"
"``(\"bye\",)``; an eviction notice, ``(\"evicted\", reason)``.  Anything else --\n"
"undecodable, a FRAME breaking rule 1, another type -- raises ``ProtocolError``.");

static PyObject *
ledger_judge(FrameLedger *self, PyObject *data)
{
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "FrameLedger was not initialised");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    struct cipi_msg m;
    cip_status st = cipi_judge_live((const uint8_t *)view.buf, (size_t)view.len, &self->ledger, &m);
    PyObject *out = NULL;
    if (st == CIP_OK) {
        int held = cipi_ledger_hold(&self->ledger, m.seq, m.slot);
        out = Py_BuildValue("(sKIOy#)", "frame", (unsigned long long)m.seq, m.slot,
                            held ? Py_True : Py_False, (const char *)m.payload,
                            (Py_ssize_t)m.len);
    } else if (st == CIP_ERR_END_OF_STREAM) {
        out = Py_BuildValue("(s)", "bye");
    } else if (st == CIP_ERR_EVICTED) { /* the decoder checked the reason is UTF-8 */
        out = Py_BuildValue("(ss#)", "evicted", (const char *)m.payload, (Py_ssize_t)m.len);
    } else {
        protocol_error(self);
    }
    PyBuffer_Release(&view);
    return out;
}

PyDoc_STRVAR(release_doc,
"release(seq, slot, /)\n\n"
"Frame ``seq`` in ``slot`` is released: forgotten, so that the slot's next frame\n"
"may come.  ``ProtocolError`` if it is not held (never received, released\n"
"already, another slot); then nothing changes.");

static PyObject *
ledger_release(FrameLedger *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t seq = 0, slot = 0;
    int r = seq_slot(self, args, nargs, "release(seq, slot)", &seq, &slot);
    if (r < 0)
        return NULL;
    if (r > 0) /* no frame has it: the ledger's words, for these numbers */
        return PyErr_Format(state(self)->protocol_error,
                            "release of frame %R in slot %R, which is not held", args[0], args[1]);
    if (cipi_ledger_check_release(&self->ledger, seq, slot) != CIP_OK)
        return protocol_error(self);
    cipi_ledger_forget(&self->ledger, (uint32_t)slot);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(hold_again_doc,
"hold_again(seq, slot, /)\n\n"
"Undo ``release(seq, slot)``, whose read-flag write the driver refused: the frame is\n"
"held again.  ``ProtocolError`` if the slot holds another frame meanwhile.");

static PyObject *
ledger_hold_again(FrameLedger *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t seq = 0, slot = 0;
    int r = seq_slot(self, args, nargs, "hold_again(seq, slot)", &seq, &slot);
    if (r < 0)
        return NULL;
    if (r > 0)
        return PyErr_Format(state(self)->protocol_error,
                            "frame %R cannot be held again in slot %R", args[0], args[1]);
    if (cipi_ledger_hold_again(&self->ledger, seq, slot) != CIP_OK)
        return protocol_error(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(release_ahead_doc,
"release_ahead(seq, slot, /)\n\n"
"Frame ``seq`` in ``slot`` is released before its FRAME message came (frames handed\n"
"out ahead): when that message comes, ``take`` answers False.  ``ProtocolError`` if\n"
"``seq`` was received by message already, or released ahead already, if ``slot`` is\n"
"not one of the ring's, or if ``num_slots`` frames are released ahead already (no\n"
"schedule explains more); then nothing changes.");

static PyObject *
ledger_release_ahead(FrameLedger *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t seq = 0, slot = 0;
    int r = seq_slot(self, args, nargs, "release_ahead(seq, slot)", &seq, &slot);
    if (r < 0)
        return NULL;
    if (r > 0) {
        PyErr_Format(state(self)->protocol_error,
                     "a frame's seq or slot out of range cannot be released ahead");
        return NULL;
    }
    if (cipi_ledger_release_ahead(&self->ledger, seq, slot) != CIP_OK)
        return protocol_error(self);
    Py_RETURN_NONE;
}

static PyObject *
ledger_get_held(FrameLedger *self, void *Py_UNUSED(closure))
{
    PyObject *held = PyDict_New();
    if (held == NULL || !self->ready)
        return held;
    for (uint32_t s = 0; s < self->ledger.num_slots; s++) {
        if (!self->ledger.holds[s].held)
            continue;
        PyObject *k = PyLong_FromUnsignedLongLong(self->ledger.holds[s].seq);
        PyObject *v = PyLong_FromUnsignedLong(s);
        if (k == NULL || v == NULL || PyDict_SetItem(held, k, v) < 0) {
            Py_XDECREF(k);
            Py_XDECREF(v);
            Py_DECREF(held);
            return NULL;
        }
        Py_DECREF(k);
        Py_DECREF(v);
    }
    return held;
}

static PyObject *
ledger_get_ahead(FrameLedger *self, void *Py_UNUSED(closure))
{
    PyObject *ahead = PyFrozenSet_New(NULL);
    if (ahead == NULL || !self->ready)
        return ahead;
    for (uint32_t i = 0; i < self->ledger.ahead_len; i++) {
        PyObject *k = PyLong_FromUnsignedLongLong(self->ledger.ahead[i]);
        if (k == NULL || PySet_Add(ahead, k) < 0) {
            Py_XDECREF(k);
            Py_DECREF(ahead);
            return NULL;
        }
        Py_DECREF(k);
    }
    return ahead;
}

static PyObject *
ledger_get_last_seq(FrameLedger *self, void *Py_UNUSED(closure))
{
    if (!self->ready || !self->ledger.have_seq)
        return PyLong_FromLong(-1);
    return PyLong_FromUnsignedLongLong(self->ledger.last_seq);
}

static PyMethodDef ledger_methods[] = {
    {"take", (PyCFunction)(void (*)(void))ledger_take, METH_FASTCALL, take_doc},
    {"judge", (PyCFunction)ledger_judge, METH_O, judge_doc},
    {"release", (PyCFunction)(void (*)(void))ledger_release, METH_FASTCALL, release_doc},
    {"hold_again", (PyCFunction)(void (*)(void))ledger_hold_again, METH_FASTCALL, hold_again_doc},
    {"release_ahead", (PyCFunction)(void (*)(void))ledger_release_ahead, METH_FASTCALL,
     release_ahead_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef ledger_getset[] = {
    {"held", (getter)ledger_get_held, NULL, "the frames held, as {seq: slot}", NULL},
    {"ahead", (getter)ledger_get_ahead, NULL,
     "the seqs released ahead whose message has not come", NULL},
    {"last_seq", (getter)ledger_get_last_seq, NULL, "the last seq received, or -1", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot ledger_slots[] = {
    {Py_tp_doc, "FrameLedger(num_slots, next_seq): the engine's frame ledger (c/src/ledger.c) "
                "for one subscriber: rule 1 of its stream, the frames it holds, and those it "
                "released ahead of their message."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, ledger_init},
    {Py_tp_dealloc, ledger_dealloc},
    {Py_tp_methods, ledger_methods},
    {Py_tp_getset, ledger_getset},
    {0, NULL},
};

static PyType_Spec ledger_spec = {
    "cupy_ipcpool._engine.FrameLedger",
    sizeof(FrameLedger),
    0,
    Py_TPFLAGS_DEFAULT,
    ledger_slots,
};

int
cipy_ledger_exec(PyObject *module)
{
    return cipy_add_type(module, &ledger_spec, "FrameLedger");
}
