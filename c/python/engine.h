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
    PyObject *publisher_session; /* the PublisherSession type, which Producer works on ... */
    PyObject *acceptor;          /* ... with an Acceptor */
} engine_state;

/* engine.c: add the type of `spec`, bound to `module` (its state), as `name`; 0 or -1 */
int cipy_add_type(PyObject *module, PyType_Spec *spec, const char *name);
/* engine.c: the exception of a failed call, its message cip_last_error(); NULL.  UsageError
 * (CIP_ERR_INVALID_ARGUMENT), ProtocolError, MemoryError, PeerRefusedError(why, err),
 * TransportTimeoutError(err, why), else TransportError(err, why) (err 0: a default). */
PyObject *cipy_raise(engine_state *es, cip_status st, int err);

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
/* pubsession.c: the session of PublisherSession `obj`, usable now, and where a call that
 * waits marks it busy; or NULL with an exception */
struct cipi_pubsession;
struct cipi_pubsession *cipy_pubsession_of(engine_state *es, PyObject *obj, int **busy);
/* pubsession.c: those that left the session since the last answer, taken: None, or
 * [(sub_id, why)]; NULL on failure (kept for the next answer) */
PyObject *cipy_departures(struct cipi_pubsession *s);
/* pubsession.c: the exception of a publisher-side status, in the engine's words; NULL */
PyObject *cipy_publisher_fail(engine_state *es, int status);
/* pubsession.c: a wait's timeout_us (-1: without limit) as ns into *wait_ns (-1 too); -1 with
 * ValueError, naming `call`, for one below -1 */
int cipy_wait_arg(PyObject *obj, const char *call, long long *wait_ns);
/* pubsession.c: poll's arguments (timeout_us, spin_ns, settle), checked, for
 * PublisherSession.poll and Producer.poll; 0, or -1 with an exception */
int cipy_poll_args(PyObject *const *args, Py_ssize_t nargs, long long *wait_ns, long long *spin_ns,
                   int *settle);
/* pubsession.c: a frame's (slot, payload, on_schedule, generation) from args[0..4), the slot
 * checked against book; 0, or -1 with an exception.  The payload is the bytes' own. */
struct cipy_frame {
    uint32_t slot, generation;
    int on_schedule;
    const char *payload;
    size_t len;
};
struct cipi_leasebook;
int cipy_frame_args(engine_state *es, struct cipi_leasebook *book, PyObject *const *args,
                    struct cipy_frame *out);
/* pubsession.c: how a publisher-side wait lets other threads run (the GIL released) */
struct cipi_waiting;
extern const struct cipi_waiting cipy_gil;

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
/* acceptor.c: the accept thread of Acceptor `obj`, or NULL with an exception */
struct cipi_acceptor;
struct cipi_acceptor *cipy_acceptor_of(engine_state *es, PyObject *obj);
/* acceptor.c: [(sub_id, fd, pid, uid, mode, credit, hello, peer_pid, row)] of n welcomed,
 * their fds the caller's; the list is freed (on failure too, every fd closed) */
struct cipi_welcomed;
PyObject *cipy_welcomed_list(struct cipi_welcomed *w, size_t n);
/* acceptor.c: one welcomed's (sub_id, fd, pid, uid, mode, credit, hello, peer_pid, row) */
PyObject *cipy_welcomed_tuple(const struct cipi_welcomed *w);

/* unix.c: the Unix-socket path functions (check_socket_path, bind_listen,
 * publisher_listen, unlink_if_ours), added to the module */
int cipy_unix_exec(PyObject *module);

/* producer.c: the Producer type (the producer's calls over a session and an Acceptor) */
int cipy_producer_exec(PyObject *module);
/* host_frame.c: the host-frame functions (encode_array_specs ... decode_host_frame) */
int cipy_host_frame_exec(PyObject *module);
/* fetch.c: fetch_fds, process_start_time, TRANSPORT_* */
int cipy_fetch_exec(PyObject *module);
/* fdserver.c: FdServer, the fd server's thread */
int cipy_fdserver_exec(PyObject *module);

/* owed.c: the OwedReleases type (the RELEASEs the Python subscriber owes) */
int cipy_owed_exec(PyObject *module);

#endif /* CIPY_ENGINE_H */
