/*
 * cupy_ipcpool._engine's host-frame functions (c/src/host_frame.c), for
 * cupy_ipcpool.remote._wire (array specs) and cupy_ipcpool.remote._host (a host frame's
 * payload): a spec is a (typestr, shape) tuple, both ways.  A bad spec or payload is ProtocolError; too many
 * arrays or too much metadata to send, UsageError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cip_internal.h"
#include "engine.h"

/* The exception of a failed call (its message, cip_last_error()); NULL. */
static PyObject *
failed(PyObject *module, cip_status st)
{
    return cipy_raise((engine_state *)PyModule_GetState(module), st, 0);
}

/* obj, a (typestr, shape) pair, into *out (their checks are cip_array_spec_check's); 0 or
 * -1. */
static int
spec_of(PyObject *module, PyObject *obj, cip_array_spec *out)
{
    memset(out, 0, sizeof *out);
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 2) {
        PyErr_Format(PyExc_TypeError, "an array spec is a (typestr, shape) tuple, not %.80s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *ts = PyTuple_GET_ITEM(obj, 0), *shape = PyTuple_GET_ITEM(obj, 1);
    Py_ssize_t n;
    const char *text = PyUnicode_Check(ts) ? PyUnicode_AsUTF8AndSize(ts, &n) : NULL;
    if (text == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "an array spec's typestr must be a str, not %.80s",
                         Py_TYPE(ts)->tp_name);
        return -1;
    }
    /* one byte more than fits: a typestr too long stays too long for the check */
    memcpy(out->typestr, text, (size_t)(n <= CIP_SPEC_MAX_TYPESTR ? n : CIP_SPEC_MAX_TYPESTR + 1));
    PyObject *dims = PySequence_Fast(shape, "an array spec's shape must be a sequence of ints");
    if (dims == NULL)
        return -1;
    Py_ssize_t ndim = PySequence_Fast_GET_SIZE(dims);
    out->ndim = ndim > UINT32_MAX ? UINT32_MAX : (uint32_t)ndim; /* the check counts them */
    for (Py_ssize_t d = 0; d < ndim && d < CIP_SPEC_MAX_NDIM; d++) {
        PyObject *item = PySequence_Fast_GET_ITEM(dims, d);
        unsigned long long v = PyLong_Check(item) ? PyLong_AsUnsignedLongLong(item) : 0;
        if (!PyLong_Check(item) || (v == (unsigned long long)-1 && PyErr_Occurred())) {
            PyErr_Clear();
            engine_state *es = (engine_state *)PyModule_GetState(module);
            PyErr_Format(es->protocol_error, "dimension %zd of the shape, %R, is out of range",
                         d, item);
            Py_DECREF(dims);
            return -1;
        }
        out->shape[d] = v;
    }
    Py_DECREF(dims);
    return 0;
}

/* The specs of sequence obj into a new array (*n of them); NULL on failure. */
static cip_array_spec *
specs_of(PyObject *module, PyObject *obj, size_t *n)
{
    PyObject *seq = PySequence_Fast(obj, "specs must be a sequence of array specs");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    cip_array_spec *specs = PyMem_Calloc(len ? (size_t)len : 1, sizeof *specs);
    if (specs == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < len; i++)
        if (spec_of(module, PySequence_Fast_GET_ITEM(seq, i), &specs[i]) < 0) {
            PyMem_Free(specs);
            Py_DECREF(seq);
            return NULL;
        }
    Py_DECREF(seq);
    *n = (size_t)len;
    return specs;
}

/* [(typestr, shape)] of n specs; NULL on failure. */
static PyObject *
spec_list(const cip_array_spec *specs, size_t n)
{
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out != NULL && i < n; i++) {
        PyObject *shape = PyTuple_New(specs[i].ndim);
        for (uint32_t d = 0; shape != NULL && d < specs[i].ndim; d++) {
            PyObject *v = PyLong_FromUnsignedLongLong(specs[i].shape[d]);
            if (v == NULL)
                Py_CLEAR(shape);
            else
                PyTuple_SET_ITEM(shape, d, v);
        }
        PyObject *item = shape == NULL ? NULL : Py_BuildValue("(sN)", specs[i].typestr, shape);
        if (item == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, (Py_ssize_t)i, item);
    }
    return out;
}

static PyObject *
offset_list(const uint64_t *offsets, size_t n)
{
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(offsets[i]);
        if (v == NULL)
            Py_CLEAR(out);
        else
            PyList_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    return out;
}

/* The most bytes n specs take in wire form. */
static size_t
specs_cap(size_t n)
{
    return n * (2 + CIP_SPEC_MAX_TYPESTR + 8 * CIP_SPEC_MAX_NDIM);
}

/* The wire form of n specs (host: as a host frame's payload, with meta_len bytes of
 * metadata); the specs are freed.  NULL on failure. */
static PyObject *
encoded(PyObject *module, cip_array_spec *specs, size_t n, const void *meta, size_t meta_len,
        int host)
{
    size_t cap = (host ? CIP_WIRE_HOST_HEAD_SIZE : 0) + specs_cap(n) + meta_len;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap);
    size_t len = 0;
    cip_status st = CIP_OK;
    if (out != NULL)
        st = host ? cip_host_frame_encode(specs, n, meta, meta_len, PyBytes_AS_STRING(out), cap,
                                          &len)
                  : cip_array_specs_encode(specs, n, PyBytes_AS_STRING(out), cap, &len);
    PyMem_Free(specs);
    if (out == NULL)
        return NULL;
    if (st != CIP_OK) {
        Py_DECREF(out);
        return failed(module, st);
    }
    _PyBytes_Resize(&out, (Py_ssize_t)len);
    return out;
}

static PyObject *
encode_array_specs(PyObject *module, PyObject *arg)
{
    size_t n;
    cip_array_spec *specs = specs_of(module, arg, &n);
    return specs == NULL ? NULL : encoded(module, specs, n, NULL, 0, 0);
}

static PyObject *
decode_array_specs(PyObject *module, PyObject *args)
{
    Py_buffer data;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "y*n:decode_array_specs", &data, &count))
        return NULL;
    if (count < 0 || (size_t)count > SIZE_MAX / 4096) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "decode_array_specs: count %zd", count);
        return NULL;
    }
    cip_array_spec *specs = PyMem_Calloc(count ? (size_t)count : 1, sizeof *specs);
    if (specs == NULL) {
        PyBuffer_Release(&data);
        return PyErr_NoMemory();
    }
    size_t used = 0;
    cip_status st = cip_array_specs_decode(data.buf, (size_t)data.len, (size_t)count, specs, &used);
    PyBuffer_Release(&data);
    PyObject *out = st != CIP_OK ? failed(module, st) : spec_list(specs, (size_t)count);
    PyMem_Free(specs);
    return out == NULL ? NULL : Py_BuildValue("(Nn)", out, (Py_ssize_t)used);
}

static PyObject *
array_layout(PyObject *module, PyObject *args)
{
    PyObject *obj;
    unsigned long long slot_nbytes;
    if (!PyArg_ParseTuple(args, "OK:array_layout", &obj, &slot_nbytes))
        return NULL;
    size_t n;
    cip_array_spec *specs = specs_of(module, obj, &n);
    if (specs == NULL)
        return NULL;
    uint64_t *offsets = PyMem_Calloc(n ? n : 1, sizeof *offsets);
    PyObject *out = NULL;
    if (offsets == NULL) {
        PyErr_NoMemory();
    } else {
        cip_status st = cip_array_layout(specs, n, slot_nbytes, offsets);
        out = st != CIP_OK ? failed(module, st) : offset_list(offsets, n);
    }
    PyMem_Free(offsets);
    PyMem_Free(specs);
    return out;
}

static PyObject *
encode_host_frame(PyObject *module, PyObject *args)
{
    PyObject *obj;
    Py_buffer meta;
    if (!PyArg_ParseTuple(args, "Oy*:encode_host_frame", &obj, &meta))
        return NULL;
    size_t n;
    cip_array_spec *specs = specs_of(module, obj, &n);
    PyObject *out = specs == NULL ? NULL : encoded(module, specs, n, meta.buf, (size_t)meta.len, 1);
    PyBuffer_Release(&meta);
    return out;
}

static PyObject *
decode_host_frame(PyObject *module, PyObject *args)
{
    Py_buffer payload;
    unsigned long long slot_nbytes;
    if (!PyArg_ParseTuple(args, "y*K:decode_host_frame", &payload, &slot_nbytes))
        return NULL;
    cip_array_spec *specs = PyMem_Calloc(CIP_MAX_ARRAYS, sizeof *specs);
    uint64_t offsets[CIP_MAX_ARRAYS];
    PyObject *out = NULL;
    if (specs == NULL) {
        PyErr_NoMemory();
    } else {
        size_t n = 0, meta_len = 0;
        const void *meta = NULL;
        cip_status st = cip_host_frame_decode(payload.buf, (size_t)payload.len, slot_nbytes,
                                              specs, offsets, CIP_MAX_ARRAYS, &n, &meta,
                                              &meta_len);
        PyObject *listed = NULL, *placed = NULL;
        if (st != CIP_OK)
            failed(module, st);
        else if ((listed = spec_list(specs, n)) != NULL &&
                 (placed = offset_list(offsets, n)) != NULL)
            out = Py_BuildValue("(OOy#)", listed, placed, (const char *)meta,
                                (Py_ssize_t)meta_len);
        Py_XDECREF(listed);
        Py_XDECREF(placed);
    }
    PyMem_Free(specs);
    PyBuffer_Release(&payload);
    return out;
}

static PyMethodDef host_frame_functions[] = {
    {"encode_array_specs", encode_array_specs, METH_O,
     "encode_array_specs(specs) -> bytes: the specs' wire form (cip_array_specs_encode); "
     "ProtocolError for a bad spec."},
    {"decode_array_specs", decode_array_specs, METH_VARARGS,
     "decode_array_specs(data, count) -> ([(typestr, shape)], used): count specs from the "
     "start of data, checked; ProtocolError if bad or truncated."},
    {"array_layout", array_layout, METH_VARARGS,
     "array_layout(specs, slot_nbytes) -> [offset]: where each array sits in a slot, each at "
     "a multiple of CIP_WIRE_SPEC_ALIGN; ProtocolError when they do not fit."},
    {"encode_host_frame", encode_host_frame, METH_VARARGS,
     "encode_host_frame(specs, metadata) -> bytes: a host frame's payload "
     "(cip_host_frame_encode); UsageError for too many arrays or too much metadata."},
    {"decode_host_frame", decode_host_frame, METH_VARARGS,
     "decode_host_frame(payload, slot_nbytes) -> ([(typestr, shape)], [offset], metadata): "
     "a host frame's payload read and checked against the slot size; ProtocolError if bad."},
    {NULL, NULL, 0, NULL},
};

int
cipy_host_frame_exec(PyObject *module)
{
    /* the limits and layout built for: cupy_ipcpool.remote._wire's loader checks them */
    if (PyModule_AddIntConstant(module, "SPEC_MAX_TYPESTR", CIP_WIRE_SPEC_MAX_TYPESTR) < 0 ||
        PyModule_AddIntConstant(module, "SPEC_MAX_NDIM", CIP_WIRE_SPEC_MAX_NDIM) < 0 ||
        PyModule_AddIntConstant(module, "SPEC_MAX_ITEMSIZE", CIP_WIRE_SPEC_MAX_ITEMSIZE) < 0 ||
        PyModule_AddIntConstant(module, "SPEC_ALIGN", CIP_WIRE_SPEC_ALIGN) < 0 ||
        PyModule_AddStringConstant(module, "SPEC_KINDS", CIP_WIRE_SPEC_KINDS) < 0 ||
        PyModule_AddIntConstant(module, "HOST_HEAD_SIZE", CIP_WIRE_HOST_HEAD_SIZE) < 0 ||
        PyModule_AddIntConstant(module, "HOST_MAX_ARRAYS", CIP_WIRE_HOST_MAX_ARRAYS) < 0 ||
        PyModule_AddIntConstant(module, "HOST_MAX_METADATA", CIP_WIRE_HOST_MAX_METADATA) < 0)
        return -1;
    return PyModule_AddFunctions(module, host_frame_functions);
}
