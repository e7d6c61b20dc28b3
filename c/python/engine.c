/*
 * cupy_ipcpool._engine: the channel engine (c/src) under Python.
 *
 * The extension is built by setup.py from this file and every C file of c/src (a C
 * compiler only: the engine loads the CUDA driver at run time and needs no
 * CUDA header), with hidden visibility: the engine's cip_* functions are this
 * module's own, whatever else the process loads (libcupy_ipcpool.so through
 * ctypes, say).  Each rule of the protocol that moved into the engine has its
 * one implementation in c/src and a thin call here; Python keeps none of it
 * (docs/design.md, "One engine").  Today: the decoding and checks of every channel
 * message, the check of a FRAME payload (its head, its array handles, its metadata's
 * length), and the channel's per-frame socket calls (frameio.c).
 *
 * Errors are raised as cupy_ipcpool's own exceptions, with the engine's words
 * (cip_last_error): a rule's message is the same in Python and in C.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cip_internal.h"
#include "engine.h"

typedef struct {
    PyObject *protocol_error; /* cupy_ipcpool._errors.ProtocolError */
} engine_state;

static engine_state *
state_of(PyObject *module)
{
    return (engine_state *)PyModule_GetState(module);
}

/* ---- the FRAME payload -------------------------------------------------------------- */

/* frame_head (whole = 0) and check_frame (whole = 1): the arguments, then the engine's
 * check of the payload's head or of all of it */
static PyObject *
frame_call(PyObject *module, PyObject *const *args, Py_ssize_t nargs, int whole)
{
    const char *name = whole ? "check_frame" : "frame_head";
    if (nargs != 3 + whole) {
        PyErr_Format(PyExc_TypeError, "%s takes %d arguments (%zd given)", name, 3 + whole,
                     nargs);
        return NULL;
    }
    unsigned long long seq = PyLong_AsUnsignedLongLong(args[1]);
    if (seq == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    unsigned long slot = PyLong_AsUnsignedLong(args[2]);
    if (slot == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    if (slot > UINT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "slot %lu is out of range", slot);
        return NULL;
    }
    unsigned long long slot_nbytes = 0;
    if (whole) {
        slot_nbytes = PyLong_AsUnsignedLongLong(args[3]);
        if (slot_nbytes == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    struct cipi_frame_head head;
    cip_status st;
    if (whole) {
        cip_array arrays[CIP_WIRE_MAX_ARRAYS];
        cip_frame frame;
        st = cipi_parse_frame_payload(view.buf, (size_t)view.len, seq, (uint32_t)slot,
                                      slot_nbytes, 0, arrays, CIP_WIRE_MAX_ARRAYS, &frame,
                                      &head.is_void);
        head.generation = frame.generation;
        head.num_arrays = frame.num_arrays;
        head.metadata_len = frame.metadata_len;
    } else {
        st = cipi_frame_head(view.buf, (size_t)view.len, seq, (uint32_t)slot, &head);
    }
    PyBuffer_Release(&view);
    if (st != CIP_OK) {
        /* every refusal of a peer's bytes is a protocol error here (the engine's
         * CIP_ERR_INVALID_ARGUMENT cannot happen: the arrays have room for MAX_ARRAYS) */
        PyErr_SetString(state_of(module)->protocol_error, cip_last_error());
        return NULL;
    }
    return Py_BuildValue("(IIIO)", head.generation, head.num_arrays, head.metadata_len,
                         head.is_void ? Py_True : Py_False);
}

PyDoc_STRVAR(
    frame_head_doc,
    "frame_head(payload, seq, slot, /) -> (generation, count, metadata_len, void)\n"
    "\n"
    "Check the head of FRAME ``seq``'s payload, received for ``slot``: the flag index is\n"
    "``slot``, or ``slot | FRAME_VOID`` for a void frame (then no arrays); at most\n"
    "MAX_ARRAYS arrays and MAX_METADATA metadata bytes.  Returns the head's generation (the\n"
    "low 32 bits of the slot's), the number of arrays, the metadata's length and whether\n"
    "the frame is void.  The handles are not looked at (check_frame checks everything).\n"
    "\n"
    "Raises ProtocolError (cupy_ipcpool's) with the engine's message.");

static PyObject *
engine_frame_head(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return frame_call(module, args, nargs, 0);
}

PyDoc_STRVAR(
    check_frame_doc,
    "check_frame(payload, seq, slot, slot_nbytes, /) -> (generation, count, metadata_len, void)\n"
    "\n"
    "Check FRAME ``seq``'s payload, received for ``slot`` of a pool whose slots hold\n"
    "``slot_nbytes`` bytes: its head (the flag index is ``slot``, or ``slot | FRAME_VOID``\n"
    "for a void frame, which has no arrays; at most MAX_ARRAYS arrays and MAX_METADATA\n"
    "metadata bytes), each array handle (well formed, of the frame's slot and of its\n"
    "generation's low 32 bits, every byte inside the slot, offset and strides multiples of\n"
    "the item size) and the metadata's length.  Returns the head's generation (its low 32\n"
    "bits), the number of arrays, the metadata's length and whether the frame is void;\n"
    "the metadata is the payload's last ``metadata_len`` bytes.\n"
    "\n"
    "Raises ProtocolError (cupy_ipcpool's) with the engine's message, or TypeError /\n"
    "OverflowError for arguments of the wrong kind.");

static PyObject *
engine_check_frame(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return frame_call(module, args, nargs, 1);
}

/* ---- channel messages -------------------------------------------------------------- */

PyDoc_STRVAR(
    decode_doc,
    "decode(data, /) -> tuple\n"
    "\n"
    "Decode and check one channel message (a datagram, of any kind).  Returns its type\n"
    "and fields: (FRAME, seq, slot, payload), (RELEASE, seq, slot), (BYE,),\n"
    "(HELLO, mode, credit, pid, payload), (WELCOME, sub_id, num_slots, next_seq, payload,\n"
    "credit, lease_timeout_ms) or (REFUSE, reason); payloads are bytes, the reason str.\n"
    "\n"
    "Raises ProtocolError (cupy_ipcpool's) with the engine's message: wrong magic, version\n"
    "or type; truncated or trailing bytes; a length or field out of range; a REFUSE\n"
    "reason that is not UTF-8.");

static PyObject *
engine_decode(PyObject *module, PyObject *data)
{
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    struct cipi_msg m;
    PyObject *out = NULL;
    if (cipi_decode(view.buf, (size_t)view.len, &m) != CIP_OK) {
        PyErr_SetString(state_of(module)->protocol_error, cip_last_error());
    } else {
        const char *payload = (const char *)m.payload;
        Py_ssize_t len = (Py_ssize_t)m.len;
        switch (m.type) {
        case CIP_WIRE_FRAME:
            out = Py_BuildValue("(IKIy#)", m.type, (unsigned long long)m.seq, m.slot, payload, len);
            break;
        case CIP_WIRE_RELEASE:
            out = Py_BuildValue("(IKI)", m.type, (unsigned long long)m.seq, m.slot);
            break;
        case CIP_WIRE_BYE:
            out = Py_BuildValue("(I)", m.type);
            break;
        case CIP_WIRE_HELLO:
            out = Py_BuildValue("(IIIIy#)", m.type, m.mode, m.credit, m.pid, payload, len);
            break;
        case CIP_WIRE_WELCOME:
            out = Py_BuildValue("(IIIKy#II)", m.type, m.sub_id, m.num_slots,
                                (unsigned long long)m.seq, payload, len, m.credit,
                                m.lease_timeout_ms);
            break;
        default: /* CIP_WIRE_REFUSE: cipi_decode checked the reason is UTF-8 */
            out = Py_BuildValue("(Is#)", m.type, payload, len);
            break;
        }
    }
    PyBuffer_Release(&view);
    return out;
}

/* ---- the module --------------------------------------------------------------------- */

static PyMethodDef engine_methods[] = {
    {"decode", (PyCFunction)engine_decode, METH_O, decode_doc},
    {"frame_head", (PyCFunction)(void (*)(void))engine_frame_head, METH_FASTCALL,
     frame_head_doc},
    {"check_frame", (PyCFunction)(void (*)(void))engine_check_frame, METH_FASTCALL,
     check_frame_doc},
    {NULL, NULL, 0, NULL},
};

static int
add_int(PyObject *module, const char *name, unsigned long long value)
{
    PyObject *v = PyLong_FromUnsignedLongLong(value);
    if (v == NULL)
        return -1;
    if (PyModule_AddObject(module, name, v) < 0) {
        Py_DECREF(v);
        return -1;
    }
    return 0;
}

static int
engine_exec(PyObject *module)
{
    PyObject *errors = PyImport_ImportModule("cupy_ipcpool._errors");
    if (errors == NULL)
        return -1;
    engine_state *st = state_of(module);
    st->protocol_error = PyObject_GetAttrString(errors, "ProtocolError");
    Py_DECREF(errors);
    if (st->protocol_error == NULL)
        return -1;
    /* the layouts and limits the engine was built for: cupy_ipcpool._compiled.load
     * refuses a build whose values differ from the Python definitions */
    if (add_int(module, "MAGIC", CIP_WIRE_MAGIC) < 0 ||
        add_int(module, "WIRE_VERSION", CIP_WIRE_VERSION) < 0 ||
        add_int(module, "MAX_FRAME_PAYLOAD", CIP_WIRE_MAX_FRAME_PAYLOAD) < 0 ||
        add_int(module, "FRAME_HEAD_SIZE", CIP_WIRE_FRAME_HEAD_SIZE) < 0 ||
        add_int(module, "FRAME_VOID", CIP_WIRE_FRAME_VOID) < 0 ||
        add_int(module, "MAX_ARRAYS", CIP_WIRE_MAX_ARRAYS) < 0 ||
        add_int(module, "MAX_METADATA", CIP_WIRE_MAX_METADATA) < 0 ||
        add_int(module, "HANDLE_SIZE", CIP_WIRE_HANDLE_SIZE) < 0)
        return -1;
    return cipy_frameio_exec(module);
}

static int
engine_traverse(PyObject *module, visitproc visit, void *arg)
{
    Py_VISIT(state_of(module)->protocol_error);
    return 0;
}

static int
engine_clear(PyObject *module)
{
    Py_CLEAR(state_of(module)->protocol_error);
    return 0;
}

static void
engine_free(void *module)
{
    engine_clear((PyObject *)module);
}

static PyModuleDef_Slot engine_slots[] = {
    {Py_mod_exec, engine_exec},
    {0, NULL},
};

static struct PyModuleDef engine_module = {
    PyModuleDef_HEAD_INIT,
    "cupy_ipcpool._engine",
    "The channel engine (c/src) under Python: the protocol's rules that moved into C.",
    sizeof(engine_state),
    engine_methods,
    engine_slots,
    engine_traverse,
    engine_clear,
    engine_free,
};

PyMODINIT_FUNC
PyInit__engine(void)
{
    return PyModuleDef_Init(&engine_module);
}
