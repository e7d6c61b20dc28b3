/*
 * cupy_ipcpool._fastpath: the per-frame driver calls without the binding's
 * argument conversion.
 *
 * Each frame makes four stream memory operations (docs/performance.md): the
 * producer's cuStreamWaitValue32 on the readers' flags and cuStreamWriteValue32
 * of the frame flag, the subscriber's wait on the frame flag and write of its
 * read flag.  Through cuda.bindings each costs 1.4-2.3 us of host time on the
 * H200 machine, most of it in wrapping and unwrapping arguments; ctypes was
 * slower still.  Here the call goes straight through the driver's function
 * pointer (from cuGetProcAddress, resolved once by cupy_ipcpool._driver).
 *
 * The module knows nothing of CUDA's headers: a memory operation is
 *     CUresult fn(CUstream, CUdeviceptr, cuuint32_t, unsigned int)
 * which on every platform CUDA supports is
 *     int fn(void *, unsigned long long, unsigned int, unsigned int).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef int (*memop_fn)(void *stream, unsigned long long addr, unsigned int value,
                        unsigned int flags);

PyDoc_STRVAR(memop_doc,
"memop(fn, stream, addr, value, flags) -> int\n"
"\n"
"Call the driver's stream memory operation at address ``fn`` (a\n"
"``cuStreamWriteValue32`` or ``cuStreamWaitValue32`` pointer) with the raw\n"
"stream handle, the device address, ``value`` (taken modulo 2**32) and\n"
"``flags``; return the driver's CUresult (0 on success).  The GIL is released\n"
"during the call (the driver may block while the stream's queue is full).\n"
"``fn`` must be such a function pointer: it is called as given.");

static PyObject *
fastpath_memop(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError,
                     "memop(fn, stream, addr, value, flags) takes 5 arguments (%zd given)",
                     nargs);
        return NULL;
    }
    void *fn = PyLong_AsVoidPtr(args[0]);
    if (fn == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "memop: the function pointer is NULL");
        return NULL;
    }
    void *stream = PyLong_AsVoidPtr(args[1]); /* 0 is the legacy default stream */
    if (stream == NULL && PyErr_Occurred())
        return NULL;
    unsigned long long addr = PyLong_AsUnsignedLongLong(args[2]);
    if (addr == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (!PyLong_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "memop: value must be an int");
        return NULL;
    }
    unsigned long long value = PyLong_AsUnsignedLongLongMask(args[3]);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    unsigned long flags = PyLong_AsUnsignedLong(args[4]);
    if (flags == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    if (flags > 0xFFFFFFFFul) {
        PyErr_SetString(PyExc_OverflowError, "memop: flags do not fit in 32 bits");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ((memop_fn)fn)(stream, addr, (unsigned int)(value & 0xFFFFFFFFull), (unsigned int)flags);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyMethodDef fastpath_methods[] = {
    {"memop", (PyCFunction)(void (*)(void))fastpath_memop, METH_FASTCALL, memop_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT,
    "cupy_ipcpool._fastpath",
    "The per-frame driver calls of cupy_ipcpool, compiled (see docs/performance.md).",
    0,
    fastpath_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    return PyModuleDef_Init(&fastpath_module);
}
