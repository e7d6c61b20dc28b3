/*
 * cupy_ipcpool._engine's Unix-socket path functions (c/src/sockets.c, c/src/listen.c), for
 * cupy_ipcpool._transport._unix and the publisher: the path check, binding and listening,
 * the publisher's socket (a stale file replaced), the file removed at teardown only while
 * ours.  Paths are str (the
 * file system's encoding); failures are UsageError (a path no socket fits) and
 * TransportError(errno, why).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cip_internal.h"
#include "engine.h"

/* The exception of a failed call: UsageError for a bad path, else TransportError(err, why);
 * NULL. */
static PyObject *
failed(PyObject *module, cip_status st, int err)
{
    return cipy_raise((engine_state *)PyModule_GetState(module), st, err);
}

static PyObject *
check_socket_path(PyObject *module, PyObject *arg)
{
    PyObject *path;
    if (!PyUnicode_FSConverter(arg, &path))
        return NULL;
    cip_status st = cipi_check_socket_path(PyBytes_AS_STRING(path));
    Py_DECREF(path);
    if (st != CIP_OK)
        return failed(module, st, 0);
    Py_RETURN_NONE;
}

static PyObject *
bind_listen(PyObject *module, PyObject *args)
{
    int fd, backlog;
    unsigned int mode;
    PyObject *path;
    if (!PyArg_ParseTuple(args, "iO&Ii:bind_listen", &fd, PyUnicode_FSConverter, &path, &mode,
                          &backlog))
        return NULL;
    uint64_t dev = 0, ino = 0;
    int err = 0;
    cip_status st;
    Py_BEGIN_ALLOW_THREADS
    st = cipi_bind_listen(fd, PyBytes_AS_STRING(path), mode, backlog, &dev, &ino, &err);
    Py_END_ALLOW_THREADS
    Py_DECREF(path);
    if (st != CIP_OK)
        return failed(module, st, err);
    return Py_BuildValue("(KK)", (unsigned long long)dev, (unsigned long long)ino);
}

static PyObject *
publisher_listen(PyObject *module, PyObject *args)
{
    PyObject *path, *uids_obj;
    unsigned int max_subscribers;
    if (!PyArg_ParseTuple(args, "O&OI:publisher_listen", PyUnicode_FSConverter, &path, &uids_obj,
                          &max_subscribers))
        return NULL;
    PyObject *seq = PySequence_Fast(uids_obj, "publisher_listen: allowed_uids is a sequence");
    uint32_t *uids = NULL;
    Py_ssize_t n = seq == NULL ? 0 : PySequence_Fast_GET_SIZE(seq);
    if (seq != NULL && (uids = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *uids)) == NULL)
        PyErr_NoMemory();
    for (Py_ssize_t i = 0; uids != NULL && i < n; i++) {
        unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(seq, i));
        if ((v == (unsigned long)-1 && PyErr_Occurred()) || v > UINT32_MAX) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_OverflowError, "a uid fits in 32 bits");
            PyMem_Free(uids);
            uids = NULL;
        } else {
            uids[i] = (uint32_t)v;
        }
    }
    Py_XDECREF(seq);
    if (uids == NULL) {
        Py_DECREF(path);
        return NULL;
    }
    int fd = -1, err = 0;
    uint64_t dev = 0, ino = 0;
    cip_status st;
    Py_BEGIN_ALLOW_THREADS /* a live peer's full backlog is waited for, up to 1 s */
    st = cipi_publisher_listen(PyBytes_AS_STRING(path), uids, (size_t)n, max_subscribers, &fd,
                               &dev, &ino, &err);
    Py_END_ALLOW_THREADS
    PyMem_Free(uids);
    Py_DECREF(path);
    if (st != CIP_OK)
        return failed(module, st, err);
    return Py_BuildValue("(iKK)", fd, (unsigned long long)dev, (unsigned long long)ino);
}

static PyObject *
unlink_if_ours(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *path;
    unsigned long long dev, ino;
    if (!PyArg_ParseTuple(args, "O&KK:unlink_if_ours", PyUnicode_FSConverter, &path, &dev, &ino))
        return NULL;
    int err = cipi_unlink_if_ours(PyBytes_AS_STRING(path), dev, ino);
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
    }
    Py_DECREF(path);
    if (err != 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef unix_functions[] = {
    {"check_socket_path", check_socket_path, METH_O,
     "check_socket_path(path): UsageError unless a Unix socket fits at path (not empty, at "
     "most MAX_SOCKET_PATH bytes)."},
    {"bind_listen", bind_listen, METH_VARARGS,
     "bind_listen(fd, path, mode, backlog) -> (st_dev, st_ino): bind socket fd at path and "
     "listen, the file appearing only with mode and listening (bound in a fresh 0700 "
     "directory beside it, then linked, or renamed, into place)."},
    {"publisher_listen", publisher_listen, METH_VARARGS,
     "publisher_listen(path, allowed_uids, max_subscribers) -> (fd, st_dev, st_ino): a "
     "publisher's listening socket (non-blocking, close-on-exec), the caller's: a stale "
     "socket file replaced and a live one refused (TransportError), the file 0600 when only "
     "this process's euid is allowed (else 0666), the backlog well above max_subscribers."},
    {"unlink_if_ours", unlink_if_ours, METH_VARARGS,
     "unlink_if_ours(path, st_dev, st_ino): remove path if it is still that file; OSError "
     "other than a missing file is raised."},
    {NULL, NULL, 0, NULL},
};

int
cipy_unix_exec(PyObject *module)
{
    return PyModule_AddFunctions(module, unix_functions);
}
