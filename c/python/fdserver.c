/*
 * cupy_ipcpool._engine.FdServer: the fd server's thread (c/src/fdserver.c), for
 * cupy_ipcpool._transport.FdServer, which makes and binds the socket and removes its files.
 * FdServer(listener, fds, token, allowed_uids) takes the listening socket's fd (closed by
 * stop) and serves the fds (not taken: the caller keeps them open); start() and stop()
 * (which joins the thread, the GIL released, and closes every connection).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cip_internal.h"
#include "engine.h"

typedef struct {
    PyObject_HEAD
    struct cipi_fdserver *server;
    int *fds; /* the served fd numbers (the server reads them) */
} FdServer;

static engine_state *
state(FdServer *self)
{
    return (engine_state *)PyType_GetModuleState(Py_TYPE(self));
}

static int
fdserver_init(FdServer *self, PyObject *args, PyObject *kwds)
{
    static char *names[] = {"listener", "fds", "token", "allowed_uids", NULL};
    int listener;
    PyObject *fds_obj, *uids_obj;
    Py_buffer token;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOy*O:FdServer", names, &listener, &fds_obj,
                                     &token, &uids_obj))
        return -1;
    int rc = -1;
    uint32_t *uids = NULL;
    PyObject *fds = NULL, *us = NULL;
    if (self->server != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "FdServer is initialised once");
        goto done;
    }
    fds = PySequence_Fast(fds_obj, "fds must be a sequence of fds");
    us = fds == NULL ? NULL : PySequence_Fast(uids_obj, "allowed_uids must be a sequence");
    if (us == NULL)
        goto done;
    Py_ssize_t nfds = PySequence_Fast_GET_SIZE(fds), nuids = PySequence_Fast_GET_SIZE(us);
    self->fds = PyMem_Calloc(nfds ? (size_t)nfds : 1, sizeof *self->fds);
    uids = PyMem_Calloc(nuids ? (size_t)nuids : 1, sizeof *uids);
    if (self->fds == NULL || uids == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nfds; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fds, i));
        if (v == -1 && PyErr_Occurred())
            goto done;
        self->fds[i] = v < INT_MIN ? INT_MIN : v > INT_MAX ? INT_MAX : (int)v; /* (checked) */
    }
    for (Py_ssize_t i = 0; i < nuids; i++) {
        unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(us, i));
        if (v == (unsigned long)-1 && PyErr_Occurred())
            goto done;
        uids[i] = (uint32_t)v;
    }
    cip_status st = cipi_fdserver_new(listener, self->fds, (size_t)nfds, token.buf,
                                      (size_t)token.len, uids, (size_t)nuids, &self->server);
    if (st != CIP_OK) {
        cipy_raise(state(self), st, 0);
        goto done;
    }
    rc = 0;
done:
    PyBuffer_Release(&token);
    Py_XDECREF(fds);
    Py_XDECREF(us);
    PyMem_Free(uids);
    return rc;
}

static void
fdserver_dealloc(FdServer *self)
{
    if (self->server != NULL) {
        Py_BEGIN_ALLOW_THREADS
        cipi_fdserver_free(self->server); /* stops it first */
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(self->fds);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static int
ready(FdServer *self)
{
    if (self->server != NULL)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "FdServer is not initialised");
    return -1;
}

static PyObject *
fdserver_start(FdServer *self, PyObject *Py_UNUSED(arg))
{
    if (ready(self) < 0)
        return NULL;
    cip_status st = cipi_fdserver_start(self->server);
    if (st != CIP_OK)
        return cipy_raise(state(self), st, 0);
    Py_RETURN_NONE;
}

static PyObject *
fdserver_stop(FdServer *self, PyObject *Py_UNUSED(arg))
{
    if (ready(self) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    cipi_fdserver_stop(self->server);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
get_connections(FdServer *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->server == NULL ? 0 : cipi_fdserver_live(self->server));
}

static PyObject *
get_failure(FdServer *self, void *Py_UNUSED(closure))
{
    const char *why = self->server == NULL ? NULL : cipi_fdserver_failure(self->server);
    if (why == NULL)
        Py_RETURN_NONE;
    return PyUnicode_FromString(why);
}

static PyMethodDef fdserver_methods[] = {
    {"start", (PyCFunction)fdserver_start, METH_NOARGS, "start(): start serving (its thread)."},
    {"stop", (PyCFunction)fdserver_stop, METH_NOARGS,
     "stop(): join the thread (every connection closed without a word), close the listener; "
     "idempotent.  In a forked child: only this process's copies are closed."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef fdserver_getset[] = {
    {"connections", (getter)get_connections, NULL, "connections being served now", NULL},
    {"failure", (getter)get_failure, NULL, "why the thread ended by itself, or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot fdserver_slots[] = {
    {Py_tp_doc, "FdServer(listener, fds, token, allowed_uids): the fd server's thread "
                "(c/src/fdserver.c)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, fdserver_init},
    {Py_tp_dealloc, fdserver_dealloc},
    {Py_tp_methods, fdserver_methods},
    {Py_tp_getset, fdserver_getset},
    {0, NULL},
};

static PyType_Spec fdserver_spec = {
    "cupy_ipcpool._engine.FdServer",
    sizeof(FdServer),
    0,
    Py_TPFLAGS_DEFAULT,
    fdserver_slots,
};

int
cipy_fdserver_exec(PyObject *module)
{
    return cipy_add_type(module, &fdserver_spec, "FdServer");
}
