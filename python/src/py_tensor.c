/* py_tensor.c - Channel._send and Channel._recv: a tensor's memory out as a
 * share, a share in as a DLPack capsule. The Python layer (tshare/_torch.py)
 * reads the tensor's fields and builds the torch tensor; this side decides
 * how the memory travels and keeps it alive while the peer holds it. */
#include "py_channel.h"
#include "py_errors.h"
#include "py_memory.h"

#include <string.h>

/* What a share of foreign or received memory keeps alive: the Python tensor.
 * Runs on the driving thread inside a tshare call (GIL released there). */
static void drop_python_object(void *keep) {
  PyGILState_STATE gil = PyGILState_Ensure();
  Py_DECREF((PyObject *)keep);
  PyGILState_Release(gil);
}

static int fill_desc(PyObject *shape, PyObject *strides, int code, int bits, tshare_tensor_desc *d) {
  memset(d, 0, sizeof *d);
  d->dtype.code = (uint8_t)code;
  d->dtype.bits = (uint8_t)bits;
  d->dtype.lanes = 1;
  Py_ssize_t n = PyTuple_GET_SIZE(shape);
  if (n > TSHARE_MAX_NDIM || PyTuple_GET_SIZE(strides) != n) {
    py_raise_fmt(TSHARE_E_TOO_LARGE, "tshare: cannot send a tensor of %zd dimensions (at most %d)", n,
                 TSHARE_MAX_NDIM);
    return -1;
  }
  d->ndim = (int32_t)n;
  for (Py_ssize_t i = 0; i < n; i++) {
    d->shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
    d->strides[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(strides, i));
  }
  return PyErr_Occurred() ? -1 : 0;
}

/* An empty CUDA storage has no allocation to export: a small owned buffer
 * carries the (empty) layout, as the LibTorch bridge does. */
static int send_empty_cuda(tshare_channel *ch, int device, tshare_tensor_desc *d, void *stream, const char *tag,
                           int timeout_ms, uint64_t *id) {
  tshare_cuda_buffer *buffer = NULL;
  tshare_error err;
  int rc = tshare_cuda_buffer_create_kind(device, 256, TSHARE_CUDA_HANDLE_LEGACY, &buffer, &err);
  if (rc != TSHARE_OK) {
    py_raise_fmt(rc, "tshare: send (empty CUDA tensor): %s", err.message);
    return rc;
  }
  d->byte_offset = 0;
  Py_BEGIN_ALLOW_THREADS rc = tshare_share_cuda_buffer(ch, buffer, d, stream, tag, NULL, timeout_ms, id);
  Py_END_ALLOW_THREADS
  tshare_cuda_buffer_release(buffer);
  if (rc != TSHARE_OK) py_raise_channel(ch, rc, "send (CUDA tensor)");
  return rc;
}

/* _send(keep, storage_key, base, data, is_cuda, device, code, bits, shape,
 *       strides, stream, tag, timeout_ms) -> share id, or None when a CPU
 * tensor's memory is not shared memory (the caller moves it and retries). */
PyObject *py_channel_send(PyChannel *self, PyObject *args) {
  PyObject *keep, *shape, *strides;
  unsigned long long storage_key, base, data, stream;
  int is_cuda, device, code, bits, timeout_ms, rc;
  const char *tag;
  Py_ssize_t tag_len;
  if (!PyArg_ParseTuple(args, "OKKKpiiiO!O!Ks#i", &keep, &storage_key, &base, &data, &is_cuda, &device, &code, &bits,
                        &PyTuple_Type, &shape, &PyTuple_Type, &strides, &stream, &tag, &tag_len, &timeout_ms))
    return NULL;
  tshare_channel *ch = py_channel_get(self);
  if (!ch) return NULL;
  if (tag_len > TSHARE_TAG_MAX)
    return py_raise_fmt(TSHARE_E_TOO_LARGE, "tshare: send: tag of %zd bytes (at most %d)", tag_len, TSHARE_TAG_MAX);
  tshare_tensor_desc d;
  if (fill_desc(shape, strides, code, bits, &d) < 0) return NULL;
  int empty = tshare_tensor_numel(&d) == 0;
  void *cuda_stream = is_cuda ? (void *)(uintptr_t)stream : NULL;
  uint64_t id = 0;
  void *memory;
  py_mem_kind kind = py_memory_lookup((uintptr_t)storage_key, &memory);
  if (kind == PY_MEM_VIEW) {
    tshare_view *view = memory;
    d.byte_offset = empty ? 0 : data - (uintptr_t)tshare_view_data(view);
    Py_INCREF(keep); /* the forward holds the tensor, the tensor holds the view */
    Py_BEGIN_ALLOW_THREADS rc = tshare_share_view_part(ch, view, &d, cuda_stream, tag, drop_python_object, keep, NULL,
                                                       timeout_ms, &id);
    Py_END_ALLOW_THREADS
    if (rc != TSHARE_OK) return py_raise_channel(ch, rc, "send (a received tensor, on)");
  } else if (kind == PY_MEM_HOST_BUFFER) {
    tshare_host_buffer *buffer = memory;
    d.byte_offset = empty ? 0 : data - (uintptr_t)tshare_host_buffer_data(buffer);
    /* The share holds the memfd itself: the tensor may go before the consumer. */
    Py_BEGIN_ALLOW_THREADS rc = tshare_share_host(ch, buffer, &d, tag, NULL, timeout_ms, &id);
    Py_END_ALLOW_THREADS
    if (rc != TSHARE_OK) return py_raise_channel(ch, rc, "send (CPU tensor)");
  } else if (!is_cuda) {
    Py_RETURN_NONE;
  } else if (base == 0) {
    if (send_empty_cuda(ch, device, &d, cuda_stream, tag, timeout_ms, &id) != TSHARE_OK) return NULL;
  } else {
    d.byte_offset = empty ? 0 : data - base;
    Py_INCREF(keep); /* the caching allocator's block stays ours while the peer holds it */
    Py_BEGIN_ALLOW_THREADS rc = tshare_share_cuda_keep(ch, (const void *)(uintptr_t)base, &d, cuda_stream, tag,
                                                       drop_python_object, keep, NULL, timeout_ms, &id);
    Py_END_ALLOW_THREADS
    if (rc != TSHARE_OK) return py_raise_channel(ch, rc, "send (CUDA tensor)");
  }
  return PyLong_FromUnsignedLongLong(id);
}

/* The stream a CUDA share is received on: stream_for(device) gives the
 * current stream of the device that will map it (device -1: let the caller
 * pick), so the caller's later work is ordered after the producer's. */
static int receive_stream(PyObject *stream_for, const tshare_share_info *info, int device, void **stream) {
  *stream = NULL;
  if (info->device_type != TSHARE_DEVICE_CUDA || stream_for == Py_None) return 0;
  int want = device >= 0 ? device : info->cuda_device;
  PyObject *r = PyObject_CallFunction(stream_for, "i", want);
  if (!r) return -1;
  unsigned long long s = PyLong_AsUnsignedLongLong(r);
  Py_DECREF(r);
  if (PyErr_Occurred()) return -1;
  *stream = (void *)(uintptr_t)s;
  return 0;
}

/* _recv(timeout_ms, stream_for, device) -> None once the peer said bye, else
 * (capsule, tag, share_id, dtype_code, dtype_bits, device_type, device). */
PyObject *py_channel_recv(PyChannel *self, PyObject *args) {
  int timeout_ms, device, rc;
  PyObject *stream_for;
  if (!PyArg_ParseTuple(args, "iOi", &timeout_ms, &stream_for, &device)) return NULL;
  tshare_channel *ch = py_channel_get(self);
  if (!ch) return NULL;
  tshare_share_info info;
  Py_BEGIN_ALLOW_THREADS rc = tshare_channel_peek_share(ch, timeout_ms, &info);
  Py_END_ALLOW_THREADS
  if (rc == TSHARE_END) Py_RETURN_NONE;
  if (rc != TSHARE_OK) return py_raise_channel(ch, rc, "recv");
  void *stream;
  if (receive_stream(stream_for, &info, device, &stream) < 0) return NULL;
  tshare_view *view = NULL;
  Py_BEGIN_ALLOW_THREADS rc = tshare_view_recv_stream(ch, stream, 0, &view); /* already queued: no wait */
  Py_END_ALLOW_THREADS
  if (rc != TSHARE_OK) return py_raise_channel(ch, rc, "recv");
  const tshare_tensor_desc *d = tshare_view_desc(view);
  uint64_t share_id = tshare_view_share_id(view);
  for (int32_t i = 0; i < d->ndim; i++) {
    if (d->strides[i] < 0) {
      long long stride = d->strides[i];
      tshare_view_release(view); /* given back to the producer */
      return py_raise_fmt(TSHARE_E_UNSUPPORTED,
                          "tshare: share %llu has a negative stride (%lld in dimension %d), which PyTorch tensors "
                          "cannot have",
                          (unsigned long long)share_id, stride, (int)i);
    }
  }
  PyObject *tag = PyUnicode_DecodeUTF8(tshare_view_tag(view), strlen(tshare_view_tag(view)), "replace");
  int code = d->dtype.code, bits = d->dtype.bits, lanes = d->dtype.lanes;
  int device_type = tshare_view_device_type(view);
  int cuda_device = tshare_view_cuda_device(view);
  if (!tag) {
    tshare_view_release(view);
    return NULL;
  }
  if (lanes != 1) {
    char name[32];
    tshare_dtype dt = d->dtype;
    tshare_view_release(view);
    Py_DECREF(tag);
    return py_raise_fmt(TSHARE_E_UNSUPPORTED, "tshare: a shared dtype %s has no PyTorch equivalent",
                        tshare_dtype_name(dt, name, sizeof name));
  }
  PyObject *capsule = py_memory_view_capsule(view); /* owns the view from here */
  if (!capsule) {
    Py_DECREF(tag);
    return NULL;
  }
  return Py_BuildValue("(NNKiiii)", capsule, tag, (unsigned long long)share_id, code, bits, device_type, cuda_device);
}
