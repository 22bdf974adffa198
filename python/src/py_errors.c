/* py_errors.c - the exception classes and how a status becomes one. */
#include "py_errors.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static PyObject *error_class, *timeout_class, *peer_closed_class;

int py_errors_init(PyObject *module) {
  error_class = PyErr_NewExceptionWithDoc("tshare.Error",
                                          "A tshare call failed: .code is the tshare_status value, .status its name.",
                                          PyExc_RuntimeError, NULL);
  if (!error_class) return -1;
  PyObject *bases = PyTuple_Pack(2, error_class, PyExc_TimeoutError);
  timeout_class = bases ? PyErr_NewExceptionWithDoc("tshare.TimeoutError", "Nothing happened within the timeout.",
                                                    bases, NULL)
                        : NULL;
  Py_XDECREF(bases);
  bases = PyTuple_Pack(2, error_class, PyExc_ConnectionError);
  peer_closed_class = bases ? PyErr_NewExceptionWithDoc("tshare.PeerClosedError",
                                                        "The peer went away without ending the stream.", bases, NULL)
                            : NULL;
  Py_XDECREF(bases);
  if (!timeout_class || !peer_closed_class) return -1;
  if (PyModule_AddObjectRef(module, "Error", error_class) < 0 ||
      PyModule_AddObjectRef(module, "TimeoutError", timeout_class) < 0 ||
      PyModule_AddObjectRef(module, "PeerClosedError", peer_closed_class) < 0)
    return -1;
  return 0;
}

static PyObject *class_of(int code) {
  if (code == TSHARE_E_TIMEOUT) return timeout_class;
  if (code == TSHARE_E_PEER_CLOSED) return peer_closed_class;
  return error_class;
}

int py_error_is_tshare(void) { return PyErr_ExceptionMatches(error_class); }

PyObject *py_error_new(int code, const char *message) {
  /* Messages quote what peers said of themselves (a name cut at its wire
   * bound may end mid-character): never a decoding error instead. */
  PyObject *text = PyUnicode_DecodeUTF8(message, (Py_ssize_t)strlen(message), "replace");
  PyObject *exc = text ? PyObject_CallFunctionObjArgs(class_of(code), text, NULL) : NULL;
  Py_XDECREF(text);
  if (!exc) return NULL;
  PyObject *c = PyLong_FromLong(code);
  PyObject *s = PyUnicode_FromString(tshare_status_name(code));
  int bad = !c || !s || PyObject_SetAttrString(exc, "code", c) < 0 || PyObject_SetAttrString(exc, "status", s) < 0;
  Py_XDECREF(c);
  Py_XDECREF(s);
  if (bad) {
    Py_DECREF(exc);
    return NULL;
  }
  return exc;
}

PyObject *py_raise(int code, const char *message) {
  PyObject *exc = py_error_new(code, message);
  if (exc) {
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
  }
  return NULL;
}

PyObject *py_raise_fmt(int code, const char *fmt, ...) {
  char message[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(message, sizeof message, fmt, ap);
  va_end(ap);
  return py_raise(code, message);
}

PyObject *py_raise_channel(tshare_channel *ch, int code, const char *what) {
  return py_raise_fmt(code, "tshare: %s: %s", what, tshare_channel_last_error(ch));
}
