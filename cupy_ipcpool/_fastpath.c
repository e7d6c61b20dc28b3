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
 * The module knows nothing of CUDA's headers (see _memop_args.h).
 *
 * The channel's per-frame socket work is cupy_ipcpool._engine's (c/python/frameio.c).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_memop_args.h"

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
    if (check_nargs(nargs, 5, "memop(fn, stream, addr, value, flags)") < 0)
        return NULL;
    void *fn, *stream;
    unsigned long long addr;
    unsigned int value, flags;
    if (memop_args(args, "memop", &fn, &stream, &addr, &value, &flags) < 0)
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ((memop_fn)fn)(stream, addr, value, flags);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/*
 * Several waits in one call: cuStreamBatchMemOp with CU_STREAM_MEM_OP_WAIT_VALUE_32
 * operations.  The publisher's stream waits on one read flag per subscriber that
 * read the slot; with fan-out that was one driver call per subscriber per frame.
 *
 * CUstreamBatchMemOpParams is a union of 48 bytes (its pad member is
 * cuuint64_t[6]); for a 32-bit wait its members are, in this order:
 *     CUstreamBatchMemOpType operation   (a 4-byte enum, then 4 bytes of padding)
 *     CUdeviceptr address
 *     union { cuuint32_t value; cuuint64_t value64; }
 *     unsigned int flags                 (then 4 bytes of padding)
 *     CUdeviceptr alias                  (driver internal; zero)
 * The 32-bit value is the union's first bytes: stored as a 64-bit integer with the
 * high half zero, it reads the same on a little-endian machine (every machine CUDA
 * supports on Linux).
 */
#define CIP_WAIT_VALUE_32 1u  /* CU_STREAM_MEM_OP_WAIT_VALUE_32 */
#define CIP_MAX_BATCH 255     /* "count must be less than 256" */

typedef struct {
    unsigned int operation;
    unsigned int pad0;
    unsigned long long address;
    unsigned long long value;
    unsigned int flags;
    unsigned int pad1;
    unsigned long long alias;
    unsigned long long pad2;
} cip_batch_op;

_Static_assert(sizeof(cip_batch_op) == 48, "CUstreamBatchMemOpParams is 48 bytes");

typedef int (*batch_fn)(void *stream, unsigned int count, cip_batch_op *ops, unsigned int flags);

PyDoc_STRVAR(wait_all_doc,
"wait_all(fn, stream, addrs, value, flags) -> int\n"
"\n"
"Enqueue on ``stream``, in one call of the driver's ``cuStreamBatchMemOp`` at\n"
"address ``fn``, a 32-bit wait for ``value`` (modulo 2**32) with ``flags`` at each\n"
"device address of the tuple or list ``addrs`` (1 to 255 of them), in order;\n"
"return the driver's CUresult (0 on success).  The GIL is released during the\n"
"call.  ``fn`` must be such a function pointer: it is called as given.");

static PyObject *
fastpath_wait_all(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs(nargs, 5, "wait_all(fn, stream, addrs, value, flags)") < 0)
        return NULL;
    void *fn, *stream;
    if (fn_and_stream(args, "wait_all", &fn, &stream) < 0)
        return NULL;
    PyObject *addrs = args[2];
    if (!PyTuple_Check(addrs) && !PyList_Check(addrs)) {
        PyErr_SetString(PyExc_TypeError, "wait_all: addrs must be a tuple or a list");
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(addrs);
    if (count < 1 || count > CIP_MAX_BATCH) {
        PyErr_Format(PyExc_ValueError, "wait_all: %zd addresses; 1 to %d may go in one call",
                     count, CIP_MAX_BATCH);
        return NULL;
    }
    unsigned int value, flags;
    if (value_and_flags(args[3], args[4], "wait_all", &value, &flags) < 0)
        return NULL;
    cip_batch_op ops[CIP_MAX_BATCH];
    PyObject **items = PySequence_Fast_ITEMS(addrs);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyLong_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "wait_all: address %zd is not an int", i);
            return NULL;
        }
        unsigned long long addr = PyLong_AsUnsignedLongLong(items[i]);
        if (addr == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
        cip_batch_op *op = &ops[i];
        memset(op, 0, sizeof *op);
        op->operation = CIP_WAIT_VALUE_32;
        op->address = addr;
        op->value = value;
        op->flags = flags;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ((batch_fn)fn)(stream, (unsigned int)count, ops, 0u);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyMethodDef fastpath_methods[] = {
    {"memop", (PyCFunction)(void (*)(void))fastpath_memop, METH_FASTCALL, memop_doc},
    {"wait_all", (PyCFunction)(void (*)(void))fastpath_wait_all, METH_FASTCALL, wait_all_doc},
    {NULL, NULL, 0, NULL},
};

/* The limit wait_all was built with; cupy_ipcpool._compiled checks it against the
 * batch size the channel's sync page splits its waits into (_syncpage._MAX_BATCH). */
static int
fastpath_exec(PyObject *module)
{
    return PyModule_AddIntConstant(module, "MAX_BATCH", CIP_MAX_BATCH);
}

static PyModuleDef_Slot fastpath_slots[] = {
    {Py_mod_exec, fastpath_exec},
    {0, NULL},
};

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT,
    "cupy_ipcpool._fastpath",
    "The per-frame driver calls of cupy_ipcpool, compiled (see docs/performance.md).",
    0,
    fastpath_methods,
    fastpath_slots,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    return PyModuleDef_Init(&fastpath_module);
}
