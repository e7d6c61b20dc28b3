/* What the files of cupy_ipcpool._engine's binding (c/python) share. */
#ifndef CIPY_ENGINE_H
#define CIPY_ENGINE_H

#include <Python.h>

/* The module's state: cupy_ipcpool's exceptions, which every call of the binding raises
 * (engine.c fills it at import; FrameBook finds it through its type, book.c). */
typedef struct {
    PyObject *protocol_error; /* cupy_ipcpool._errors.ProtocolError */
    PyObject *usage_error;    /* cupy_ipcpool._errors.UsageError */
    PyObject *transport_error; /* cupy_ipcpool._errors.TransportError */
    PyObject *errors;          /* cupy_ipcpool._errors, for the handshake's failures */
    PyObject *lease_core;      /* the LeaseCore type, which PublisherSession works on */
} engine_state;

/* engine.c: add the type of `spec`, bound to `module` (its state), as `name`; 0 or -1 */
int cipy_add_type(PyObject *module, PyType_Spec *spec, const char *name);

/* frameio.c: the channel's per-frame socket calls, and PROTOCOL, added to the module */
int cipy_frameio_exec(PyObject *module);

/* book.c: the FrameBook type (the engine's frame book for the Python subscriber) */
int cipy_book_exec(PyObject *module);

/* ledger.c: the FrameLedger type (the engine's frame ledger for the Python subscriber) */
int cipy_ledger_exec(PyObject *module);

/* handshake.c: handshake(), the subscriber's half of the handshake */
int cipy_handshake_exec(PyObject *module);

/* leasebook.c: the LeaseCore type (the publisher's lease book), lease_defaults,
 * granted_credit */
int cipy_leasebook_exec(PyObject *module);

/* leasebook.c: the lease book of the LeaseCore `obj`, or NULL with TypeError */
struct cipi_leasebook;
struct cipi_leasebook *cipy_leasebook_of(engine_state *es, PyObject *obj);
/* leasebook.c: a subscriber's mode by its name (CIPI_LEASE_*, or -1), and the UsageError
 * of one it does not know (NULL) */
int cipy_lease_mode(PyObject *name);
PyObject *cipy_lease_mode_error(engine_state *es, PyObject *name);

/* pubsession.c: the PublisherSession type (the publisher's adopted subscribers) */
int cipy_pubsession_exec(PyObject *module);

/* rows.c: the ReaderRows type (the publisher's rows of read flags) */
int cipy_rows_exec(PyObject *module);

/* rows.c: the accept thread's hooks into the ReaderRows `obj` (of `module`; the caller keeps
 * obj alive while they are used), or -1 with TypeError */
struct cipi_acceptor_hooks;
int cipy_rows_hooks(PyObject *module, PyObject *obj, struct cipi_acceptor_hooks *out);

/* admission.c: the AdmissionBook type (connections waiting, per group) */
int cipy_admission_exec(PyObject *module);

/* acceptor.c: the Acceptor type (the publisher's accept thread) */
int cipy_acceptor_exec(PyObject *module);

/* owed.c: the OwedReleases type (the RELEASEs the Python subscriber owes) */
int cipy_owed_exec(PyObject *module);

#endif /* CIPY_ENGINE_H */
