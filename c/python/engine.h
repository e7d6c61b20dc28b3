/* What the files of cupy_ipcpool._engine's binding (c/python) share. */
#ifndef CIPY_ENGINE_H
#define CIPY_ENGINE_H

#include <Python.h>

/* frameio.c: the channel's per-frame socket calls, and PROTOCOL, added to the module */
int cipy_frameio_exec(PyObject *module);

/* book.c: the FrameBook type (the engine's frame book for the Python subscriber) */
int cipy_book_exec(PyObject *module);

#endif /* CIPY_ENGINE_H */
