/* py_errors.h - tshare statuses as Python exceptions.
 *
 * tshare.Error (a RuntimeError) carries .code (the tshare_status value) and
 * .status (its name, "TSHARE_E_TIMEOUT"); tshare.TimeoutError and
 * tshare.PeerClosedError are the two a caller most often handles apart, and
 * are also the builtin TimeoutError and ConnectionError. */
#ifndef TSHARE_PY_ERRORS_H
#define TSHARE_PY_ERRORS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <tshare/tshare.h>

int py_errors_init(PyObject *module);

/* Set the exception for code with message; returns NULL. */
PyObject *py_raise(int code, const char *message);
PyObject *py_raise_fmt(int code, const char *fmt, ...);
/* "tshare: WHAT: <the channel's last error>". */
PyObject *py_raise_channel(tshare_channel *ch, int code, const char *what);
/* Whether the exception set is a tshare.Error (not, say, a signal
 * handler's KeyboardInterrupt). */
int py_error_is_tshare(void);
/* The exception object for code and message (not raised). */
PyObject *py_error_new(int code, const char *message);

#endif /* TSHARE_PY_ERRORS_H */
