/* tshare_module.c - the tshare._tshare extension: tshare's C library for the
 * Python package (tshare/__init__.py is the API; this is what it calls). */
#include "py_channel.h"
#include "py_errors.h"
#include "py_memory.h"
#include "py_set_fast.h"

static PyObject *configure(PyObject *module, PyObject *args) {
  (void)module;
  int versioned, bool_as_uint8;
  if (!PyArg_ParseTuple(args, "pp", &versioned, &bool_as_uint8)) return NULL;
  py_memory_configure(versioned, bool_as_uint8);
  Py_RETURN_NONE;
}

static PyObject *host_capsule(PyObject *module, PyObject *args) {
  (void)module;
  unsigned long long nbytes;
  if (!PyArg_ParseTuple(args, "K", &nbytes)) return NULL;
  return py_memory_host_capsule((size_t)nbytes);
}

/* _adopt_file(fd, size, base, storage) -> a capsule: the file of torch's
 * shared memory, found by address by a set's send while the capsule lives. */
static PyObject *adopt_file(PyObject *module, PyObject *args) {
  (void)module;
  int fd;
  unsigned long long size, base;
  PyObject *storage;
  if (!PyArg_ParseTuple(args, "iKKO", &fd, &size, &base, &storage)) return NULL;
  return py_memory_adopt_file(fd, (size_t)size, (uintptr_t)base, storage);
}

static PyObject *bind(PyObject *module, PyObject *args) {
  (void)module;
  PyObject *capsule;
  unsigned long long key;
  if (!PyArg_ParseTuple(args, "OK", &capsule, &key)) return NULL;
  if (py_memory_bind(capsule, (uintptr_t)key) < 0) return NULL;
  Py_RETURN_NONE;
}

/* "view", "host", "pinned" (released, Received.release) or None: how the
 * memory of a storage travels. */
static PyObject *memory_kind(PyObject *module, PyObject *args) {
  (void)module;
  unsigned long long key;
  if (!PyArg_ParseTuple(args, "K", &key)) return NULL;
  void *memory;
  switch (py_memory_lookup((uintptr_t)key, &memory)) {
  case PY_MEM_VIEW: return PyUnicode_FromString("view");
  case PY_MEM_HOST_BUFFER: return PyUnicode_FromString("host");
  case PY_MEM_PINNED: return PyUnicode_FromString("pinned");
  default: Py_RETURN_NONE;
  }
}

/* Whether addr is in a host buffer made here: a CPU tensor on it is sent as
 * that buffer, whatever storage torch wraps the memory in. */
static PyObject *host_memory_at(PyObject *module, PyObject *args) {
  (void)module;
  unsigned long long addr;
  if (!PyArg_ParseTuple(args, "K", &addr)) return NULL;
  return PyBool_FromLong(py_memory_made_host_buffer_at((uintptr_t)addr) != NULL);
}

/* _release_pinned(capsules) -> how many were released: a received set's
 * capsules (torch consumed them), their views released with the memory kept
 * mapped under the tensors (py_memory_release_pinned). The caller holds a
 * tensor of each capsule. */
static PyObject *release_pinned(PyObject *module, PyObject *args) {
  (void)module;
  PyObject *capsules;
  if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &capsules)) return NULL;
  Py_ssize_t count = PyList_GET_SIZE(capsules);
  int n = count ? py_memory_release_pinned(&PyList_GET_ITEM(capsules, 0), count) : 0;
  return n < 0 ? NULL : PyLong_FromLong(n);
}

static PyObject *make_error(PyObject *module, PyObject *args) {
  (void)module;
  int code;
  const char *message;
  if (!PyArg_ParseTuple(args, "is", &code, &message)) return NULL;
  return py_error_new(code, message);
}

static PyObject *version(PyObject *module, PyObject *unused) {
  (void)module;
  (void)unused;
  return PyUnicode_FromString(tshare_version());
}

static PyObject *cuda_device_count(PyObject *module, PyObject *unused) {
  (void)module;
  (void)unused;
  return PyLong_FromLong(tshare_cuda_device_count());
}

static PyMethodDef module_methods[] = {
  {"_configure", configure, METH_VARARGS, NULL},
  {"_host_capsule", host_capsule, METH_VARARGS, NULL},
  {"_bind", bind, METH_VARARGS, NULL},
  {"_adopt_file", adopt_file, METH_VARARGS, NULL},
  {"_memory_kind", memory_kind, METH_VARARGS, NULL},
  {"_host_memory_at", host_memory_at, METH_VARARGS, NULL},
  {"_error", make_error, METH_VARARGS, NULL},
  {"_set_items", py_set_items, METH_VARARGS, NULL},
  {"_set_members", py_set_members, METH_VARARGS, NULL},
  {"_bound", py_bound, METH_VARARGS, NULL},
  {"_bound_made", py_bound_made, METH_VARARGS, NULL},
  {"_bound_all", py_bound_all, METH_VARARGS, NULL},
  {"_bind_keys", py_bind_keys, METH_VARARGS, NULL},
  {"_release_pinned", release_pinned, METH_VARARGS, NULL},
  {"_open_socket", (PyCFunction)(void (*)(void))py_open_socket, METH_VARARGS | METH_KEYWORDS, NULL},
  {"_check_options", (PyCFunction)(void (*)(void))py_check_options, METH_VARARGS | METH_KEYWORDS, NULL},
  {"_connect", (PyCFunction)(void (*)(void))py_connect, METH_VARARGS | METH_KEYWORDS, NULL},
  {"_listen", py_listen, METH_VARARGS, NULL},
  {"socketpair", py_socketpair, METH_NOARGS, "Two connected socket fds for the two ends of a channel."},
  {"_role_from_env", py_role_from_env, METH_NOARGS, NULL},
  {"library_version", version, METH_NOARGS, "The version of the C library inside."},
  {"cuda_device_count", cuda_device_count, METH_NOARGS, "CUDA devices tshare can use (0 without CUDA)."},
  {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "tshare._tshare",
                                        "tshare's C library for the tshare package.", -1, module_methods};

static int add_statuses(PyObject *m) {
  /* Every status, without the TSHARE_ prefix: tshare.E_TIMEOUT, tshare.END. */
#define TSHARE_PY_ADD_STATUS(name, value, message)                                                                    \
  if (PyModule_AddIntConstant(m, #name + 7, value) < 0) return -1;
  TSHARE_STATUS_LIST(TSHARE_PY_ADD_STATUS)
#undef TSHARE_PY_ADD_STATUS
  return 0;
}

PyMODINIT_FUNC PyInit__tshare(void) {
  PyObject *m = PyModule_Create(&module_def);
  if (!m) return NULL;
  if (py_set_fast_init() < 0 || PyType_Ready(&PyChannel_Type) < 0 || PyType_Ready(&PyListener_Type) < 0 || PyType_Ready(&PyRole_Type) < 0 ||
      PyModule_AddObjectRef(m, "Channel", (PyObject *)&PyChannel_Type) < 0 ||
      PyModule_AddObjectRef(m, "Listener", (PyObject *)&PyListener_Type) < 0 ||
      PyModule_AddObjectRef(m, "Role", (PyObject *)&PyRole_Type) < 0 || py_errors_init(m) < 0 ||
      add_statuses(m) < 0 || PyModule_AddIntConstant(m, "TAG_MAX", TSHARE_TAG_MAX) < 0 ||
      PyModule_AddIntConstant(m, "MAX_NDIM", TSHARE_MAX_NDIM) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
