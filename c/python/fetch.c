/*
 * cupy_ipcpool._engine's fetch functions (c/src/fetch.c, c/src/pidfd.c), for
 * cupy_ipcpool._transport: an exporter's fds by pidfd_getfd or from its fd server, and a
 * process's start time.  Failures are TransportError(errno, why), PeerRefusedError when the
 * server refused or is not the exporter, TransportTimeoutError when it did not answer in
 * time, UsageError for arguments out of range.  The GIL is released while it waits.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cip_internal.h"
#include "engine.h"

/* The exception of a failed call; NULL. */
static PyObject *
failed(PyObject *module, cip_status st, int err)
{
    return cipy_raise((engine_state *)PyModule_GetState(module), st, err);
}

/* -1 for None, else the int (at least 0); 0 or -1 with an exception. */
static int
optional_arg(PyObject *obj, const char *name, long long *out)
{
    if (obj == Py_None) {
        *out = -1;
        return 0;
    }
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "%s must not be negative, not %lld", name, v);
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *
fetch_fds(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"pid",          "start_time",   "fds",    "count",
                            "socket_path",  "token",        "method", "exporter_uid",
                            "pid_namespace", "same_namespace", "timeout", NULL};
    int pid, method, same = 0;
    Py_ssize_t count;
    PyObject *start_obj, *fds_obj, *path_obj, *uid_obj, *ns_obj;
    Py_buffer token;
    double timeout;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$iOOnOy*iOOpd:fetch_fds", names, &pid,
                                     &start_obj, &fds_obj, &count, &path_obj, &token, &method,
                                     &uid_obj, &ns_obj, &same, &timeout))
        return NULL;
    PyObject *path = NULL, *seq = NULL, *out = NULL;
    uint32_t *targets = NULL;
    int *got = NULL;
    long long start_time, uid, ns;
    if (optional_arg(start_obj, "start_time", &start_time) < 0 ||
        optional_arg(uid_obj, "exporter_uid", &uid) < 0 ||
        optional_arg(ns_obj, "pid_namespace", &ns) < 0)
        goto done;
    if (path_obj != Py_None && !PyUnicode_FSConverter(path_obj, &path))
        goto done;
    if (fds_obj != Py_None) {
        if ((seq = PySequence_Fast(fds_obj, "fds must be a sequence of fd numbers")) == NULL)
            goto done;
        count = PySequence_Fast_GET_SIZE(seq);
    }
    if (seq == NULL && method != CIP_TRANSPORT_SOCKET) {
        PyErr_SetString(PyExc_ValueError, "fds (the exporter's fd numbers) are needed but for "
                                          "the socket transport");
        goto done;
    }
    size_t n = count < 0 ? 0 : (size_t)count;
    if (count >= 0 && n <= CIP_WIRE_FDSERVER_MAX_FDS_PER_REPLY) { /* (else refused below) */
        targets = PyMem_Calloc(n ? n : 1, sizeof *targets);
        got = PyMem_Calloc(n ? n : 1, sizeof *got);
        if (targets == NULL || got == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    for (size_t i = 0; seq != NULL && targets != NULL && i < n; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, (Py_ssize_t)i));
        if (v == -1 && PyErr_Occurred())
            goto done;
        if (v < 0 || v > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "fd number %ld is out of range", v);
            goto done;
        }
        targets[i] = (uint32_t)v;
    }
    if (!(timeout >= 0) || timeout > 1e6) {
        PyErr_Format(PyExc_ValueError, "timeout must be 0..1e6 seconds, not %g", timeout);
        goto done;
    }
    struct cipi_fetch f = {
        .pid = pid,
        .start_time = start_time,
        .fds = targets,
        .n = count,
        .socket_path = path != NULL ? PyBytes_AS_STRING(path) : NULL,
        .token = token.buf,
        .token_len = (size_t)token.len,
        .method = method,
        .exporter_uid = uid,
        .where = same ? CIPI_WHERE_SAME : cipi_where_of(ns < 0 ? 0 : (unsigned long long)ns),
        .timeout_ms = (int)(timeout * 1000.0 + 0.5),
    };
    int err = 0;
    cip_status st;
    Py_BEGIN_ALLOW_THREADS
    st = cipi_fetch(&f, got, &err); /* (too many: refused before got is looked at) */
    Py_END_ALLOW_THREADS
    if (st != CIP_OK) {
        failed(module, st, err);
        goto done;
    }
    out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyLong_FromLong(got[i]);
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    if (out == NULL)
        cipi_close_fds(got, n);
done:
    PyBuffer_Release(&token);
    Py_XDECREF(path);
    Py_XDECREF(seq);
    PyMem_Free(targets);
    PyMem_Free(got);
    return out;
}

static PyObject *
process_start_time(PyObject *module, PyObject *arg)
{
    long pid = PyLong_AsLong(arg);
    if (pid == -1 && PyErr_Occurred())
        return NULL;
    if (pid < 0 || pid > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "pid %ld is out of range", pid);
        return NULL;
    }
    long long start = -1;
    int err = 0;
    cip_status st = cipi_process_start_time((int)pid, &start, &err);
    if (st != CIP_OK)
        return failed(module, st, err);
    return PyLong_FromLongLong(start);
}

static PyMethodDef fetch_functions[] = {
    {"fetch_fds", (PyCFunction)(void (*)(void))fetch_fds, METH_VARARGS | METH_KEYWORDS,
     "fetch_fds(*, pid, start_time, fds, count, socket_path, token, method, exporter_uid, "
     "pid_namespace, same_namespace, timeout) -> [fd]: an exporter's fds (fds: its fd "
     "numbers, for pidfd; None: count of them, from the fd server only) by method "
     "(CIP_TRANSPORT_*), close-on-exec and the caller's (c/src/fetch.c: cipi_fetch)."},
    {"process_start_time", process_start_time, METH_O,
     "process_start_time(pid) -> int: field 22 of /proc/<pid>/stat (TransportError ESRCH "
     "when there is no such process)."},
    {NULL, NULL, 0, NULL},
};

int
cipy_fetch_exec(PyObject *module)
{
    if (PyModule_AddIntConstant(module, "TRANSPORT_AUTO", CIP_TRANSPORT_AUTO) < 0 ||
        PyModule_AddIntConstant(module, "TRANSPORT_PIDFD", CIP_TRANSPORT_PIDFD) < 0 ||
        PyModule_AddIntConstant(module, "TRANSPORT_SOCKET", CIP_TRANSPORT_SOCKET) < 0)
        return -1;
    return PyModule_AddFunctions(module, fetch_functions);
}
