/*
 * The argument conversion shared by cupy_ipcpool's compiled modules
 * (cupy_ipcpool._fastpath and cupy_ipcpool._engine): a stream memory
 * operation's function pointer, stream, value and flags, from Python ints.
 *
 * A memory operation is
 *     CUresult fn(CUstream, CUdeviceptr, cuuint32_t, unsigned int)
 * which on every platform CUDA supports is
 *     int fn(void *, unsigned long long, unsigned int, unsigned int).
 */
#ifndef CUPY_IPCPOOL_MEMOP_ARGS_H
#define CUPY_IPCPOOL_MEMOP_ARGS_H

#include <Python.h>

typedef int (*memop_fn)(void *stream, unsigned long long addr, unsigned int value,
                        unsigned int flags);

/* The arguments every trampoline shares: fn, stream, and (elsewhere in the list)
 * value and flags.  Each returns 0, or -1 with a Python exception set. */
static inline int
fn_and_stream(PyObject *const *args, const char *name, void **fn, void **stream)
{
    *fn = PyLong_AsVoidPtr(args[0]);
    if (*fn == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "%s: the function pointer is NULL", name);
        return -1;
    }
    *stream = PyLong_AsVoidPtr(args[1]); /* 0 is the legacy default stream */
    if (*stream == NULL && PyErr_Occurred())
        return -1;
    return 0;
}

static inline int
value_and_flags(PyObject *value_obj, PyObject *flags_obj, const char *name,
                unsigned int *value, unsigned int *flags)
{
    if (!PyLong_Check(value_obj)) {
        PyErr_Format(PyExc_TypeError, "%s: value must be an int", name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLongMask(value_obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    unsigned long f = PyLong_AsUnsignedLong(flags_obj);
    if (f == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (f > 0xFFFFFFFFul) {
        PyErr_Format(PyExc_OverflowError, "%s: flags do not fit in 32 bits", name);
        return -1;
    }
    *value = (unsigned int)(v & 0xFFFFFFFFull);
    *flags = (unsigned int)f;
    return 0;
}

/* A METH_FASTCALL function's argument count: `signature` ("memop(fn, stream, ...)")
 * takes `want`.  0, or -1 with a TypeError. */
static inline int
check_nargs(Py_ssize_t nargs, Py_ssize_t want, const char *signature)
{
    if (nargs == want)
        return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", signature, want, nargs);
    return -1;
}

/* A memory operation's five arguments, args[0..4]: fn, stream, addr, value, flags. */
static inline int
memop_args(PyObject *const *args, const char *name, void **fn, void **stream,
           unsigned long long *addr, unsigned int *value, unsigned int *flags)
{
    if (fn_and_stream(args, name, fn, stream) < 0)
        return -1;
    *addr = PyLong_AsUnsignedLongLong(args[2]);
    if (*addr == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    return value_and_flags(args[3], args[4], name, value, flags);
}

#endif /* CUPY_IPCPOOL_MEMOP_ARGS_H */
