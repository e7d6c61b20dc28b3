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
 * length), the check of a WELCOME and of the sync page's fd, the sync page's layout, flag states and the forcing of a dead producer's
 * frame flag, the frame book (book.c), and the channel's per-frame socket calls
 * (frameio.c).
 *
 * Errors are raised as cupy_ipcpool's own exceptions, with the engine's words
 * (cip_last_error): a rule's message is the same in Python and in C.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_memop_args.h"
#include "cip_internal.h"
#include "engine.h"

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
    if (check_nargs(nargs, 3 + whole, whole ? "check_frame" : "frame_head") < 0)
        return NULL;
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

PyDoc_STRVAR(
    encode_welcome_doc,
    "encode_welcome(sub_id, num_slots, next_seq, payload, credit, lease_timeout_ms, /) -> bytes\n"
    "\n"
    "The WELCOME datagram (the caller attaches the slot fds): the engine's writer, which the\n"
    "publisher sends.  Raises UsageError (cupy_ipcpool's) for a field out of range.");

static PyObject *
engine_encode_welcome(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 6, "encode_welcome") < 0)
        return NULL;
    unsigned long long sub_id = PyLong_AsUnsignedLongLong(args[0]);
    if (sub_id == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    unsigned long long next_seq = PyLong_AsUnsignedLongLong(args[2]);
    if (next_seq == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    long long v[3]; /* num_slots, credit, lease_timeout_ms: signed, so the engine words a
                     * negative one as out of range */
    const int at[3] = {1, 4, 5};
    for (int i = 0; i < 3; i++) {
        v[i] = PyLong_AsLongLong(args[at[i]]);
        if (v[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    if (sub_id > UINT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "sub_id %llu does not fit 32 bits", sub_id);
        return NULL;
    }
    Py_buffer payload;
    if (PyObject_GetBuffer(args[3], &payload, PyBUF_SIMPLE) < 0)
        return NULL;
    uint8_t head[CIP_WIRE_WELCOME_SIZE];
    PyObject *out = NULL;
    if (cipi_put_welcome(head, (uint32_t)sub_id, v[0], next_seq, v[1], v[2],
                         (size_t)payload.len) != CIP_OK) {
        PyErr_SetString(state_of(module)->usage_error, cip_last_error());
    } else if ((out = PyBytes_FromStringAndSize(NULL, sizeof head + payload.len)) != NULL) {
        memcpy(PyBytes_AS_STRING(out), head, sizeof head);
        memcpy(PyBytes_AS_STRING(out) + sizeof head, payload.buf, (size_t)payload.len);
    }
    PyBuffer_Release(&payload);
    return out;
}

PyDoc_STRVAR(
    encode_refuse_doc,
    "encode_refuse(reason, /) -> bytes\n"
    "\n"
    "The REFUSE datagram telling ``reason`` (UTF-8; a character it cannot encode becomes\n"
    "'?'), cut before the character that would pass MAX_REFUSE_REASON bytes: the engine's\n"
    "writer, which the publisher sends.");

static PyObject *
engine_encode_refuse(PyObject *Py_UNUSED(module), PyObject *reason)
{
    PyObject *raw = PyUnicode_AsEncodedString(reason, "utf-8", "replace");
    if (raw == NULL)
        return NULL;
    uint8_t msg[CIP_WIRE_REFUSE_SIZE + CIP_WIRE_MAX_REFUSE_REASON];
    size_t n = cipi_put_refuse(msg, PyBytes_AS_STRING(raw), (size_t)PyBytes_GET_SIZE(raw));
    Py_DECREF(raw);
    return PyBytes_FromStringAndSize((const char *)msg, (Py_ssize_t)n);
}

PyDoc_STRVAR(encode_bye_doc, "encode_bye() -> bytes\n\nThe BYE datagram: the engine's writer.");

static PyObject *
engine_encode_bye(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(arg))
{
    uint8_t bye[CIP_WIRE_HEADER_SIZE];
    cipi_put_bye(bye);
    return PyBytes_FromStringAndSize((const char *)bye, sizeof bye);
}

/* ---- the WELCOME --------------------------------------------------------------------- */

PyDoc_STRVAR(
    check_welcome_doc,
    "check_welcome(payload, num_slots, nfds, /) -> (row, max_subscribers, sync_nbytes,\n"
    "                                             desc_offset, desc_len)\n"
    "\n"
    "Check a WELCOME's payload for a session of ``num_slots`` slots that received ``nfds``\n"
    "fds: its head adds up (the slots, the descriptor's length, this subscriber's row among\n"
    "at most 65536, one fd per slot and the sync page's), the pool descriptor parses and\n"
    "has those slots, and the announced sync page is the layout's size.  Returns this\n"
    "subscriber's row, the rows, the page's size, and where the descriptor lies.\n"
    "\n"
    "Raises ProtocolError (cupy_ipcpool's) with the engine's message.");

static PyObject *
engine_check_welcome(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 3, "check_welcome") < 0)
        return NULL;
    unsigned long n = PyLong_AsUnsignedLong(args[1]);
    if (n == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t nfds = PyLong_AsSsize_t(args[2]);
    if (nfds == -1 && PyErr_Occurred())
        return NULL;
    if (n > UINT32_MAX || nfds < 0) {
        PyErr_Format(PyExc_OverflowError, "check_welcome: %lu slots, %zd fds", n, nfds);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    struct cipi_welcome w;
    cip_status st = cipi_check_welcome(view.buf, (size_t)view.len, (uint32_t)n, (size_t)nfds, &w);
    PyBuffer_Release(&view);
    if (st != CIP_OK) {
        PyErr_SetString(state_of(module)->protocol_error, cip_last_error());
        return NULL;
    }
    return Py_BuildValue("(IInnn)", w.row, w.max_subscribers, (Py_ssize_t)w.sync_nbytes,
                         (Py_ssize_t)w.desc_offset, (Py_ssize_t)w.desc_len);
}

PyDoc_STRVAR(
    check_sync_fd_doc,
    "check_sync_fd(fd, nbytes, /)\n"
    "\n"
    "Check that ``fd``, a publisher's sync page, is a memfd sealed against shrinking and\n"
    "growing (else the publisher could truncate it under this process) of ``nbytes`` bytes.\n"
    "Raises ProtocolError (cupy_ipcpool's) with the engine's message.");

static PyObject *
engine_check_sync_fd(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 2, "check_sync_fd") < 0)
        return NULL;
    long fd = PyLong_AsLong(args[0]);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[1]);
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    if (fd < 0 || fd > INT_MAX || nbytes < 0) {
        PyErr_Format(PyExc_ValueError, "check_sync_fd: fd %ld, %zd bytes", fd, nbytes);
        return NULL;
    }
    if (cipi_check_sync_fd((int)fd, (size_t)nbytes) != CIP_OK) {
        PyErr_SetString(state_of(module)->protocol_error, cip_last_error());
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- a failed call's exception -------------------------------------------------------- */

PyObject *
cipy_raise(engine_state *es, cip_status st, int err)
{
    const char *why = cip_last_error();
    if (st == CIP_ERR_NO_MEMORY)
        return PyErr_NoMemory();
    if (st == CIP_ERR_INVALID_ARGUMENT || st == CIP_ERR_PROTOCOL) {
        PyErr_SetString(st == CIP_ERR_PROTOCOL ? es->protocol_error : es->usage_error, why);
        return NULL;
    }
    const char *name = st == CIP_ERR_REFUSED   ? "PeerRefusedError"
                       : st == CIP_ERR_TIMEOUT ? "TransportTimeoutError"
                                               : "TransportError";
    PyObject *cls = PyObject_GetAttrString(es->errors, name);
    if (cls == NULL)
        return NULL;
    PyObject *exc = st == CIP_ERR_REFUSED
                        ? PyObject_CallFunction(cls, "si", why, err ? err : EACCES)
                        : PyObject_CallFunction(cls, "is",
                                                err ? err : st == CIP_ERR_TIMEOUT ? ETIMEDOUT
                                                                                  : EIO,
                                                why);
    if (exc != NULL) {
        PyErr_SetObject(cls, exc);
        Py_DECREF(exc);
    }
    Py_DECREF(cls);
    return NULL;
}

/* ---- the sync page ----------------------------------------------------------------- */

static PyObject *
engine_sync_create(PyObject *module, PyObject *arg)
{
    Py_ssize_t nbytes = PyLong_AsSsize_t(arg);
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    int fd = -1;
    cip_status st = cip_sync_create(nbytes < 0 ? 0 : (size_t)nbytes, &fd);
    if (st != CIP_OK)
        return cipy_raise(state_of(module), st, 0);
    return PyLong_FromLong(fd);
}

PyDoc_STRVAR(
    sync_layout_doc,
    "sync_layout(num_slots, max_subscribers, /) -> (reads_offset, nbytes)\n"
    "\n"
    "Where the read flags of a sync page of ``num_slots`` frame flags and\n"
    "``max_subscribers`` rows of read flags start, and the page's size (whole host\n"
    "pages).  Raises UsageError (cupy_ipcpool's) outside 1..MAX_SLOTS slots or\n"
    "1..65536 rows.");

static PyObject *
engine_sync_layout(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 2, "sync_layout") < 0)
        return NULL;
    uint32_t n[2];
    for (int i = 0; i < 2; i++) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(args[i], &overflow);
        if (v == -1 && PyErr_Occurred())
            return NULL;
        if (overflow || v < 0 || v > UINT32_MAX) { /* no count the engine takes */
            PyErr_Format(state_of(module)->usage_error,
                         "a sync page has no %S slots or subscriber rows (got %S and %S)",
                         args[i], args[0], args[1]);
            return NULL;
        }
        n[i] = (uint32_t)v; /* the engine refuses those out of its range, in its words */
    }
    size_t reads_offset, nbytes;
    if (cip_sync_layout(n[0], n[1], &reads_offset, &nbytes) != CIP_OK) {
        PyErr_SetString(state_of(module)->usage_error, cip_last_error());
        return NULL;
    }
    return Py_BuildValue("(nn)", (Py_ssize_t)reads_offset, (Py_ssize_t)nbytes);
}

PyDoc_STRVAR(
    flag_state_doc,
    "flag_state(word, generation, /) -> int\n"
    "\n"
    "What frame flag value ``word`` says about the frame of ``generation`` (both taken\n"
    "mod 2**32): 1, the producer's stream set it for this frame or a later one (or it\n"
    "was forced after the producer wrote the frame); 0, forced after the producer's death\n"
    "before it wrote this frame; -1, not set yet.");

static PyObject *
engine_flag_state(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 2, "flag_state") < 0)
        return NULL;
    unsigned long long word = PyLong_AsUnsignedLongLongMask(args[0]);
    if (word == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    unsigned long long generation = PyLong_AsUnsignedLongLongMask(args[1]);
    if (generation == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(cip_flag_state((uint32_t)word, (uint32_t)generation));
}

PyDoc_STRVAR(
    flag_force_doc,
    "flag_force(page, offset, awaited, /) -> bool\n"
    "\n"
    "Force the frame flag at byte ``offset`` of the writable buffer ``page`` (a mapped\n"
    "sync page) that a dead producer never set to ``awaited``: unless it has reached\n"
    "``awaited`` (cyclic), its value w becomes w + FORCED, by compare-and-swap (a write\n"
    "landing since the read is never overwritten; a word that changed is decided\n"
    "again).  True if this call stored it.");

static PyObject *
engine_flag_force(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 3, "flag_force") < 0)
        return NULL;
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    unsigned long long awaited = PyLong_AsUnsignedLongLongMask(args[2]);
    if (awaited == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (offset < 0 || offset % CIP_WIRE_SYNC_FLAG_BYTES ||
        offset > view.len - (Py_ssize_t)CIP_WIRE_SYNC_FLAG_BYTES) {
        PyErr_Format(state_of(module)->usage_error,
                     "flag_force: offset %zd is not a flag of a page of %zd bytes", offset,
                     view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    int stored = cip_flag_force((uint32_t *)((char *)view.buf + offset), (uint32_t)awaited);
    PyBuffer_Release(&view);
    return PyBool_FromLong(stored == 1);
}

/* ---- a hang-up (c/src/hangup.c) ---------------------------------------------------- */

PyDoc_STRVAR(hangup_verdict_doc,
"hangup_verdict(messages, /) -> tuple[str, int]\n\n"
"The verdict on ``messages`` (a list of bytes-like objects), the datagrams still queued\n"
"when the publisher hung up, oldest first: the first BYE or REFUSE decides.\n"
"``(\"bye\", i)``: the messages before the BYE at ``i`` are handed out;\n"
"``(\"evicted\", i)``: the eviction notice at ``i``, nothing is handed out;\n"
"``(\"bad\", i)``: the REFUSE at ``i`` does not decode (a protocol error), nothing is\n"
"handed out; ``(\"drop\", len(messages))``: neither, nothing is handed out.");

static PyObject *
engine_hangup_verdict(PyObject *Py_UNUSED(module), PyObject *messages)
{
    if (!PyList_Check(messages)) {
        PyErr_SetString(PyExc_TypeError, "hangup_verdict: messages must be a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(messages);
    struct msgbuf *ring = PyMem_Calloc(n ? (size_t)n : 1, sizeof *ring);
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof *views);
    Py_ssize_t got = 0;
    PyObject *answer = NULL;
    if (ring == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(messages, got), &views[got], PyBUF_SIMPLE) < 0)
            goto done;
        ring[got].data = (uint8_t *)views[got].buf;
        ring[got].len = (size_t)views[got].len;
    }
    size_t at;
    static const char *const words[] = {"drop", "bye", "evicted", "bad"};
    enum cipi_hangup verdict = cipi_hangup_verdict(ring, 0, (size_t)n, n ? (size_t)n : 1, &at);
    answer = Py_BuildValue("(sn)", words[verdict], (Py_ssize_t)at);
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(ring);
    return answer;
}

static int
keep_in_list(void *list, const uint8_t *p, size_t n)
{
    PyObject *data = PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)n);
    int r = data == NULL ? -1 : PyList_Append((PyObject *)list, data);
    Py_XDECREF(data);
    return r;
}

PyDoc_STRVAR(hangup_drain_doc,
"hangup_drain(fd, queued, /)\n\n"
"Append to the list ``queued`` every datagram still queued on the socket ``fd`` after\n"
"its peer hung up, without waiting (a reset is passed over once, as it comes before\n"
"what is still queued): the C subscriber's read of a hang-up.");

static PyObject *
engine_hangup_drain(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 2, "hangup_drain(fd, queued)") < 0)
        return NULL;
    int fd = PyObject_AsFileDescriptor(args[0]);
    if (fd < 0)
        return NULL;
    if (!PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "hangup_drain: queued must be a list");
        return NULL;
    }
    size_t cap = CIP_WIRE_MAX_FRAME_SIZE + 1;
    uint8_t *buf = PyMem_Malloc(cap);
    if (buf == NULL)
        return PyErr_NoMemory();
    cipi_hangup_drain(fd, buf, cap, keep_in_list, args[1]);
    PyMem_Free(buf);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

/* ---- the module --------------------------------------------------------------------- */

static PyMethodDef engine_methods[] = {
    {"decode", (PyCFunction)engine_decode, METH_O, decode_doc},
    {"encode_welcome", (PyCFunction)(void (*)(void))engine_encode_welcome, METH_FASTCALL,
     encode_welcome_doc},
    {"encode_refuse", (PyCFunction)engine_encode_refuse, METH_O, encode_refuse_doc},
    {"encode_bye", (PyCFunction)engine_encode_bye, METH_NOARGS, encode_bye_doc},
    {"check_welcome", (PyCFunction)(void (*)(void))engine_check_welcome, METH_FASTCALL,
     check_welcome_doc},
    {"sync_create", engine_sync_create, METH_O,
     "sync_create(nbytes) -> fd: a publisher's sync page, a zeroed memfd sealed against "
     "shrinking, growing and further seals (cip_sync_create), the caller's."},
    {"check_sync_fd", (PyCFunction)(void (*)(void))engine_check_sync_fd, METH_FASTCALL,
     check_sync_fd_doc},
    {"sync_layout", (PyCFunction)(void (*)(void))engine_sync_layout, METH_FASTCALL,
     sync_layout_doc},
    {"flag_state", (PyCFunction)(void (*)(void))engine_flag_state, METH_FASTCALL,
     flag_state_doc},
    {"flag_force", (PyCFunction)(void (*)(void))engine_flag_force, METH_FASTCALL,
     flag_force_doc},
    {"frame_head", (PyCFunction)(void (*)(void))engine_frame_head, METH_FASTCALL,
     frame_head_doc},
    {"check_frame", (PyCFunction)(void (*)(void))engine_check_frame, METH_FASTCALL,
     check_frame_doc},
    {"hangup_verdict", (PyCFunction)engine_hangup_verdict, METH_O, hangup_verdict_doc},
    {"hangup_drain", (PyCFunction)(void (*)(void))engine_hangup_drain, METH_FASTCALL,
     hangup_drain_doc},
    {NULL, NULL, 0, NULL},
};

int
cipy_add_type(PyObject *module, PyType_Spec *spec, const char *name)
{
    PyObject *type = PyType_FromModuleAndSpec(module, spec, NULL);
    if (type == NULL)
        return -1;
    if (PyModule_AddObject(module, name, type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

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
    st->usage_error = PyObject_GetAttrString(errors, "UsageError");
    st->transport_error = PyObject_GetAttrString(errors, "TransportError");
    st->errors = errors;
    if (st->protocol_error == NULL || st->usage_error == NULL || st->transport_error == NULL)
        return -1;
    /* the layouts and limits the engine was built for: cupy_ipcpool._compiled.load
     * refuses a build whose values differ from the Python definitions */
    if (add_int(module, "FRAME_HEAD_SIZE", CIP_WIRE_FRAME_HEAD_SIZE) < 0 ||
        add_int(module, "FRAME_VOID", CIP_WIRE_FRAME_VOID) < 0 ||
        add_int(module, "MAX_ARRAYS", CIP_WIRE_MAX_ARRAYS) < 0 ||
        add_int(module, "MAX_METADATA", CIP_WIRE_MAX_METADATA) < 0 ||
        add_int(module, "HANDLE_SIZE", CIP_WIRE_HANDLE_SIZE) < 0 ||
        add_int(module, "SYNC_FORCED", CIP_WIRE_SYNC_FORCED) < 0 ||
        add_int(module, "SYNC_SET_WINDOW", CIP_WIRE_SYNC_SET_WINDOW) < 0 ||
        add_int(module, "SYNC_READS_ALIGN", CIP_WIRE_SYNC_READS_ALIGN) < 0 ||
        add_int(module, "SYNC_RECORD_CAP", CIP_WIRE_SYNC_RECORD_CAP) < 0)
        return -1;
    /* PROTOCOL (the message layouts), the per-frame socket calls, FrameBook, FrameLedger,
     * OwedReleases, LeaseCore, PublisherSession, ReaderRows, AdmissionBook, Acceptor */
    if (cipy_frameio_exec(module) < 0 || cipy_book_exec(module) < 0 ||
        cipy_ledger_exec(module) < 0 || cipy_owed_exec(module) < 0 ||
        cipy_leasebook_exec(module) < 0 || cipy_pubsession_exec(module) < 0 ||
        cipy_rows_exec(module) < 0 || cipy_admission_exec(module) < 0 ||
        cipy_acceptor_exec(module) < 0 || cipy_producer_exec(module) < 0 ||
        cipy_unix_exec(module) < 0 || cipy_host_frame_exec(module) < 0 ||
        cipy_fetch_exec(module) < 0 || cipy_fdserver_exec(module) < 0)
        return -1;
    return cipy_handshake_exec(module);
}

static int
engine_traverse(PyObject *module, visitproc visit, void *arg)
{
    Py_VISIT(state_of(module)->protocol_error);
    Py_VISIT(state_of(module)->usage_error);
    Py_VISIT(state_of(module)->transport_error);
    Py_VISIT(state_of(module)->errors);
    Py_VISIT(state_of(module)->lease_core);
    Py_VISIT(state_of(module)->publisher_session);
    Py_VISIT(state_of(module)->acceptor);
    return 0;
}

static int
engine_clear(PyObject *module)
{
    Py_CLEAR(state_of(module)->protocol_error);
    Py_CLEAR(state_of(module)->usage_error);
    Py_CLEAR(state_of(module)->transport_error);
    Py_CLEAR(state_of(module)->errors);
    Py_CLEAR(state_of(module)->lease_core);
    Py_CLEAR(state_of(module)->publisher_session);
    Py_CLEAR(state_of(module)->acceptor);
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
