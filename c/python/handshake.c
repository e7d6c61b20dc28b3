/*
 * cupy_ipcpool._engine.handshake: the subscriber's half of the handshake (c/src/handshake.c,
 * the C subscriber's too) for the Python SubscriberCore -- connect, learn who is there,
 * send the HELLO, take the WELCOME and its fds -- with each failure raised as the
 * cupy_ipcpool exception it is.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_memop_args.h"
#include "cip_internal.h"
#include "engine.h"

/* The cupy_ipcpool exception `name` with `args` set; NULL. */
static PyObject *
raise_error(PyObject *module, const char *name, PyObject *args)
{
    engine_state *st = (engine_state *)PyModule_GetState(module);
    PyObject *cls = args ? PyObject_GetAttrString(st->errors, name) : NULL;
    PyObject *exc = cls ? PyObject_CallObject(cls, args) : NULL;
    if (exc != NULL)
        PyErr_SetObject(cls, exc);
    Py_XDECREF(exc);
    Py_XDECREF(cls);
    Py_XDECREF(args);
    return NULL;
}

static PyObject *
raise_status(PyObject *module, cip_status st, const struct cipi_joined *j)
{
    const char *why = cip_last_error();
    switch (st) {
    case CIP_ERR_TIMEOUT:
        return raise_error(module, "ChannelTimeoutError", Py_BuildValue("(s)", why));
    case CIP_ERR_TRANSPORT:
        return raise_error(module, "TransportError", Py_BuildValue("(is)", j->err, why));
    case CIP_ERR_REFUSED:
        return raise_error(module, "PeerRefusedError", Py_BuildValue("(s)", why));
    case CIP_ERR_PROTOCOL:
        return raise_error(module, j->foreign ? "ForeignPeerError" : "ProtocolError",
                           Py_BuildValue("(s)", why));
    case CIP_ERR_PUBLISHER_GONE:
        return raise_error(module, "EndOfStream", Py_BuildValue("(sO)", why, Py_False));
    case CIP_ERR_NO_MEMORY:
        return PyErr_NoMemory();
    default:
        return raise_error(module, "UsageError", Py_BuildValue("(s)", why));
    }
}

PyDoc_STRVAR(handshake_doc,
"handshake(path, mode, credit, payload, allowed_uids, timeout_ms, /) -> tuple\n\n"
"Connect to the publisher at ``path`` (a full listen backlog is retried), refuse one\n"
"whose uid is not in ``allowed_uids`` (it gets nothing, not even a BYE), send the HELLO\n"
"(``mode`` 0 block, 1 latest, 2 ahead; ``credit``; this process's pid; ``payload``,\n"
"at most 64 KiB) and take the WELCOME, all within ``timeout_ms`` (-1: no limit).\n"
"A field out of range raises ``UsageError`` before anything is connected.\n"
"Returns ``(sock_fd, pid, uid, sub_id, num_slots, next_seq, credit, lease_timeout_ms,\n"
"payload, fds)``; the caller owns the socket and the fds.  Raises\n"
"``ChannelTimeoutError``, ``TransportError``, ``PeerRefusedError``,\n"
"``ForeignPeerError``, ``ProtocolError`` or ``EndOfStream``; nothing is left open\n"
"then.  The GIL is released while it connects and waits.");

static PyObject *
engine_handshake(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 6, "handshake(path, mode, credit, payload, allowed_uids, timeout_ms)") <
        0)
        return NULL;
    PyObject *path = NULL, *answer = NULL;
    uint32_t *allowed = NULL;
    uint8_t *hello = NULL;
    Py_buffer payload = {0};
    unsigned long mode = PyLong_AsUnsignedLong(args[1]);
    if (mode == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    unsigned long long credit = PyLong_AsUnsignedLongLong(args[2]);
    if (credit == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (!PyUnicode_FSConverter(args[0], &path))
        return NULL;
    if (PyObject_GetBuffer(args[3], &payload, PyBUF_SIMPLE) < 0)
        goto done;
    size_t hello_len = CIP_WIRE_HELLO_SIZE + (size_t)payload.len;
    if ((hello = PyMem_Malloc(hello_len)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    cip_status put = cipi_put_hello(hello, mode > UINT_MAX ? UINT_MAX : (unsigned)mode, credit,
                                    (uint32_t)getpid(), (size_t)payload.len);
    if (put != CIP_OK) {
        engine_state *es = (engine_state *)PyModule_GetState(module);
        PyErr_SetString(es->usage_error, cip_last_error());
        goto done;
    }
    memcpy(hello + CIP_WIRE_HELLO_SIZE, payload.buf, (size_t)payload.len);
    PyObject *uids = PySequence_Fast(args[4], "handshake: allowed_uids must be a sequence");
    if (uids == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(uids);
    allowed = PyMem_Calloc(n ? (size_t)n : 1, sizeof *allowed);
    for (Py_ssize_t i = 0; allowed != NULL && i < n; i++) {
        unsigned long uid = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(uids, i));
        if (uid == (unsigned long)-1 && PyErr_Occurred())
            break;
        allowed[i] = (uint32_t)uid;
    }
    Py_DECREF(uids);
    if (allowed == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyErr_Occurred())
        goto done;
    long timeout_ms = PyLong_AsLong(args[5]);
    if (timeout_ms == -1 && PyErr_Occurred())
        goto done;
    if (timeout_ms < -1 || timeout_ms > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "handshake: timeout_ms %ld is out of range", timeout_ms);
        goto done;
    }
    struct cipi_joined j;
    cip_status st;
    Py_BEGIN_ALLOW_THREADS
    st = cipi_handshake(PyBytes_AS_STRING(path), hello, hello_len, allowed, (size_t)n,
                        (int)timeout_ms, &j);
    Py_END_ALLOW_THREADS
    if (st != CIP_OK) {
        raise_status(module, st, &j);
        goto done;
    }
    PyObject *fds = PyList_New((Py_ssize_t)j.nfds);
    for (size_t i = 0; fds != NULL && i < j.nfds; i++) {
        PyObject *fd = PyLong_FromLong(j.fds[i]);
        if (fd == NULL) {
            Py_CLEAR(fds);
            break;
        }
        PyList_SET_ITEM(fds, (Py_ssize_t)i, fd);
    }
    const struct cipi_msg *m = &j.welcome;
    if (fds != NULL)
        answer = Py_BuildValue("(iiIIIKIIy#N)", j.sock, (int)j.pid, j.uid, m->sub_id,
                               m->num_slots, (unsigned long long)m->seq, m->credit,
                               m->lease_timeout_ms, (const char *)m->payload,
                               (Py_ssize_t)m->len, fds);
    free(j.buf);
    if (answer == NULL) { /* nothing is handed over: close it all */
        cipi_close_fds(j.fds, j.nfds);
        close(j.sock);
    }
done:
    PyMem_Free(allowed);
    PyMem_Free(hello);
    if (payload.obj != NULL)
        PyBuffer_Release(&payload);
    Py_DECREF(path);
    return answer;
}

static PyMethodDef handshake_methods[] = {
    {"handshake", (PyCFunction)(void (*)(void))engine_handshake, METH_FASTCALL, handshake_doc},
    {NULL, NULL, 0, NULL},
};

int
cipy_handshake_exec(PyObject *module)
{
    return PyModule_AddFunctions(module, handshake_methods);
}
