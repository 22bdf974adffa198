/* py_tensor.c - Channel._send and Channel._recv: a tensor's memory out as a
 * share, a share in as a DLPack capsule. The Python layer (tshare/_torch.py)
 * reads the tensor's fields and builds the torch tensor; this side decides
 * how the memory travels and keeps it alive while the peer holds it. */
#include "py_channel.h"
#include "py_errors.h"
#include "py_memory.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* What a share of foreign or received memory keeps alive: its storage (the
 * Python object _torch.py passes as keep). Runs on the driving thread inside
 * a tshare call (GIL released there). */
static void drop_python_object(void *keep) {
  PyGILState_STATE gil = PyGILState_Ensure();
  Py_DECREF((PyObject *)keep);
  PyGILState_Release(gil);
}

/* What a received tensor sent on holds: its storage, and a count on its
 * memory that keeps Received.release() from letting the producer reuse it
 * while this send or a share it made is out. One per send call, counted:
 * the call's own hold and one per try, each try's dropped exactly once. */
typedef struct forward_hold {
  PyObject *storage;
  void *token; /* py_memory_forward_begin's */
  atomic_int refs;
} forward_hold;

static void forward_hold_drop(void *arg) {
  forward_hold *h = arg;
  py_memory_forward_end(h->token);
  if (atomic_fetch_sub(&h->refs, 1) != 1) return;
  drop_python_object(h->storage);
  free(h);
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

/* How a share's memory travels, and what a try to send it needs. */
typedef enum send_how { SEND_VIEW_PART, SEND_HOST, SEND_CUDA_BUFFER, SEND_CUDA_KEEP } send_how;

typedef struct send_call {
  PyChannel *self;
  send_how how;
  void *memory;   /* the received view, host buffer, CUDA buffer, or CUDA allocation's base */
  PyObject *keep; /* the storage, held by the share (a received view's part, CUDA memory); else NULL */
  forward_hold *forward; /* a received view's part: what each try's share holds instead of keep */
  tshare_tensor_desc d;
  void *stream;
  const char *tag;
  uint64_t id;
} send_call;

/* One try (a slice of a send waiting for room). A try that timed out sent
 * nothing and dropped what it was given to keep. */
static int send_slice(void *arg, int timeout_ms) {
  send_call *s = arg;
  tshare_channel *ch = s->self->ch;
  switch (s->how) {
  case SEND_VIEW_PART:
    return tshare_share_view_part(ch, s->memory, &s->d, s->stream, s->tag, forward_hold_drop, s->forward, NULL,
                                  timeout_ms, &s->id);
  case SEND_HOST:
    return tshare_share_host(ch, s->memory, &s->d, s->tag, NULL, timeout_ms, &s->id);
  case SEND_CUDA_BUFFER:
    return tshare_share_cuda_buffer(ch, s->memory, &s->d, s->stream, s->tag, NULL, timeout_ms, &s->id);
  case SEND_CUDA_KEEP:
    return tshare_share_cuda_keep(ch, s->memory, &s->d, s->stream, s->tag, drop_python_object, s->keep, NULL,
                                  timeout_ms, &s->id);
  }
  return TSHARE_E_INVALID_ARG;
}

/* Before each try: the try's share holds the storage, and with it the
 * memory. */
static void hold_keep(void *arg) {
  send_call *s = arg;
  if (s->forward) {
    atomic_fetch_add(&s->forward->refs, 1);
    py_memory_forward_more(s->forward->token);
  } else {
    Py_XINCREF(s->keep);
  }
}

static int send_in_slices(send_call *s, const char *what, int timeout_ms) {
  int rc;
  py_guard_slice slice = {send_slice, hold_keep, s};
  return py_channel_wait(s->self, what, timeout_ms, &slice, 0, &rc);
}

/* An empty CUDA storage has no allocation to export: a small owned buffer
 * carries the (empty) layout, as the LibTorch bridge does. */
static int send_empty_cuda(send_call *s, int device, int timeout_ms) {
  tshare_cuda_buffer *buffer = NULL;
  tshare_error err;
  int rc = tshare_cuda_buffer_create_kind(device, 256, TSHARE_CUDA_HANDLE_LEGACY, &buffer, &err);
  if (rc != TSHARE_OK) {
    py_raise_fmt(rc, "tshare: send (empty CUDA tensor): %s", err.message);
    return -1;
  }
  s->how = SEND_CUDA_BUFFER;
  s->memory = buffer;
  s->d.byte_offset = 0;
  int r = send_in_slices(s, "send (CUDA tensor)", timeout_ms);
  tshare_cuda_buffer_release(buffer); /* the share holds its own reference */
  return r;
}

/* A CPU tensor in torch's own shared memory: a host buffer over its file
 * (fd, size bytes, mapped here at file_base) that holds keep (the storage)
 * until the last share of it is released, so nothing is copied. */
static int send_torch_file(send_call *s, PyObject *keep, int fd, unsigned long long size, uintptr_t file_base,
                           uintptr_t data, int empty, int timeout_ms) {
  tshare_host_buffer *buffer = NULL;
  tshare_error err;
  Py_INCREF(keep);
  int rc = tshare_host_buffer_wrap_fd(fd, (size_t)size, (void *)file_base, drop_python_object, keep, &buffer, &err);
  if (rc != TSHARE_OK) {
    Py_DECREF(keep);
    py_raise_fmt(rc, "tshare: send (CPU tensor in torch shared memory): %s", err.message);
    return -1;
  }
  s->how = SEND_HOST;
  s->memory = buffer;
  s->d.byte_offset = empty ? 0 : data - file_base;
  int r = send_in_slices(s, "send (CPU tensor)", timeout_ms);
  tshare_host_buffer_destroy(buffer); /* the share holds its own reference, and through it the storage */
  return r;
}

/* _send(keep, storage_key, base, data, is_cuda, device, code, bits, shape,
 *       strides, stream, tag, timeout_ms[, file_fd, file_size, file_base])
 * -> share id, or None when a CPU tensor's memory is not shared memory (the
 * caller moves it and retries). file_fd >= 0: the tensor is in torch's
 * shared memory, the file of file_size bytes mapped at file_base. */
PyObject *py_channel_send(PyChannel *self, PyObject *args) {
  PyObject *keep, *shape, *strides;
  unsigned long long storage_key, base, data, stream;
  unsigned long long file_size = 0, file_base = 0;
  int is_cuda, device, code, bits, timeout_ms, file_fd = -1;
  const char *tag;
  Py_ssize_t tag_len;
  if (!PyArg_ParseTuple(args, "OKKKpiiiO!O!Ks#i|iKK", &keep, &storage_key, &base, &data, &is_cuda, &device, &code,
                        &bits, &PyTuple_Type, &shape, &PyTuple_Type, &strides, &stream, &tag, &tag_len, &timeout_ms,
                        &file_fd, &file_size, &file_base))
    return NULL;
  if (!py_channel_get(self)) return NULL;
  if (tag_len > TSHARE_TAG_MAX)
    return py_raise_fmt(TSHARE_E_TOO_LARGE, "tshare: send: tag of %zd bytes (at most %d)", tag_len, TSHARE_TAG_MAX);
  send_call s = {.self = self, .tag = tag, .stream = is_cuda ? (void *)(uintptr_t)stream : NULL};
  if (fill_desc(shape, strides, code, bits, &s.d) < 0) return NULL;
  int empty = tshare_tensor_numel(&s.d) == 0;
  int r;
  void *forward_token;
  py_mem_kind kind = py_memory_lookup_forward((uintptr_t)storage_key, &s.memory, &forward_token);
  if (kind == PY_MEM_PINNED)
    return py_raise_fmt(TSHARE_E_STATE, "tshare: send: the tensor is of a received set released with "
                                        "Received.release(): its memory is the producer's to change until the next "
                                        "version comes into it (recv into=); send it after that, or a copy");
  if (kind == PY_MEM_VIEW) {
    s.how = SEND_VIEW_PART;
    s.keep = keep;
    s.d.byte_offset = empty ? 0 : data - (uintptr_t)tshare_view_data(s.memory);
    s.forward = malloc(sizeof *s.forward);
    if (!s.forward) {
      py_memory_forward_end(forward_token);
      return PyErr_NoMemory();
    }
    Py_INCREF(keep);
    s.forward->storage = keep;
    s.forward->token = forward_token; /* counted by the lookup, from before the first try */
    atomic_init(&s.forward->refs, 1);
    r = send_in_slices(&s, "send (a received tensor, on)", timeout_ms);
    forward_hold_drop(s.forward); /* the call's hold; each share out keeps its own */
  } else if (kind == PY_MEM_HOST_BUFFER) {
    s.how = SEND_HOST; /* the share holds the memfd itself: the tensor may go before the consumer */
    s.d.byte_offset = empty ? 0 : data - (uintptr_t)tshare_host_buffer_data(s.memory);
    r = send_in_slices(&s, "send (CPU tensor)", timeout_ms);
  } else if (!is_cuda && file_fd >= 0) {
    r = send_torch_file(&s, keep, file_fd, file_size, (uintptr_t)file_base, (uintptr_t)data, empty, timeout_ms);
  } else if (!is_cuda) {
    Py_RETURN_NONE;
  } else if (base == 0) {
    r = send_empty_cuda(&s, device, timeout_ms);
  } else {
    s.how = SEND_CUDA_KEEP; /* the caching allocator's block stays ours while the peer holds it */
    s.keep = keep;
    s.memory = (void *)(uintptr_t)base;
    s.d.byte_offset = empty ? 0 : data - base;
    r = send_in_slices(&s, "send (CUDA tensor)", timeout_ms);
  }
  if (r < 0) return NULL;
  return PyLong_FromUnsignedLongLong(s.id);
}

/* _send_host_at(data, code, bits, shape, strides, tag, timeout_ms) -> share
 * id, or None when data is not in a host buffer made here. The buffer is
 * found from the address alone: each is its own mapping, so an address
 * inside one is that buffer's memory whatever storage torch wraps it in, and
 * the share holds the memfd itself, so the tensor may go before the consumer. */
PyObject *py_channel_send_host_at(PyChannel *self, PyObject *args) {
  PyObject *shape, *strides;
  unsigned long long data;
  int code, bits, timeout_ms;
  const char *tag;
  Py_ssize_t tag_len;
  if (!PyArg_ParseTuple(args, "KiiO!O!s#i", &data, &code, &bits, &PyTuple_Type, &shape, &PyTuple_Type, &strides, &tag,
                        &tag_len, &timeout_ms))
    return NULL;
  if (!py_channel_get(self)) return NULL;
  if (tag_len > TSHARE_TAG_MAX)
    return py_raise_fmt(TSHARE_E_TOO_LARGE, "tshare: send: tag of %zd bytes (at most %d)", tag_len, TSHARE_TAG_MAX);
  send_call s = {.self = self, .how = SEND_HOST, .tag = tag};
  if (fill_desc(shape, strides, code, bits, &s.d) < 0) return NULL;
  s.memory = py_memory_made_host_buffer_at((uintptr_t)data);
  if (!s.memory) Py_RETURN_NONE;
  s.d.byte_offset = tshare_tensor_numel(&s.d) == 0 ? 0 : data - (uintptr_t)tshare_host_buffer_data(s.memory);
  if (send_in_slices(&s, "send (CPU tensor)", timeout_ms) < 0) return NULL;
  return PyLong_FromUnsignedLongLong(s.id);
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

/* What recv finds next: a single share (peeked, not taken) and, apart from
 * it, a set or a set's refusal (py_set.c). */
typedef struct peek_call {
  PyChannel *self;
  tshare_share_info info;
  int share_waits, set_waits;
} peek_call;

/* Without waiting: OK when a share or a set waits, TSHARE_END once the peer
 * said bye and nothing does, TSHARE_E_TIMEOUT when nothing came yet. The
 * set look reads frames too: a share that lands between the two looks is
 * queued by the set look, which reports only sets. So the share queue is
 * looked at again (at once, without reading, when the share is there), or
 * _peek would say nothing waits while a share does, and a poll loop would
 * wait for a frame that already came. */
static int look(peek_call *p) {
  int rc = tshare_channel_peek_share(p->self->ch, 0, &p->info);
  p->share_waits = rc == TSHARE_OK;
  if (rc != TSHARE_OK && rc != TSHARE_E_TIMEOUT && rc != TSHARE_END) return rc;
  p->set_waits = py_set_waiting(p->self);
  if (!p->share_waits && !p->set_waits && rc == TSHARE_E_TIMEOUT) {
    rc = tshare_channel_peek_share(p->self->ch, 0, &p->info);
    p->share_waits = rc == TSHARE_OK;
    if (rc != TSHARE_OK && rc != TSHARE_E_TIMEOUT && rc != TSHARE_END) return rc;
  }
  return p->share_waits || p->set_waits ? TSHARE_OK : rc;
}

/* One slice of recv's wait for the next share or set. */
static int peek_slice(void *arg, int slice_ms) {
  peek_call *p = arg;
  int rc = look(p);
  if (rc != TSHARE_E_TIMEOUT || slice_ms == 0) return rc;
  rc = tshare_channel_poll(p->self->ch, slice_ms);
  if (rc != TSHARE_OK && rc != TSHARE_E_TIMEOUT && rc != TSHARE_END) return rc;
  return look(p);
}

/* A set goes first when it was sent first: its id is lower than the share's.
 * A refused set (no id) is reported once no share waits. */
static int set_is_next(const peek_call *p) {
  if (!p->set_waits) return 0;
  uint64_t set_id = py_set_waiting_id(p->self);
  return !p->share_waits || (set_id != 0 && set_id < p->info.share_id);
}

/* _peek() -> True when a share or a set waits for recv, False when none
 * does, None once the peer said bye: frames that came are processed, nothing
 * waits and nothing is handed out (an event loop decides with it which await
 * to wake). */
PyObject *py_channel_peek(PyChannel *self, PyObject *unused) {
  (void)unused;
  peek_call p = {.self = self};
  int rc;
  py_guard_slice slice = {peek_slice, NULL, &p};
  if (py_channel_wait(self, "recv", 0, &slice, 1, &rc) < 0) return NULL;
  if (rc == TSHARE_OK) Py_RETURN_TRUE;
  if (rc == TSHARE_E_TIMEOUT) Py_RETURN_FALSE;
  Py_RETURN_NONE;
}

/* The next share as a view, or the next set as recv's result: 0 with *view
 * or *set_result (both NULL once the peer said bye), -1 with a Python error.
 * What comes next is found and taken in one turn inside the channel, so
 * another thread's recv cannot take it in between. */
static int take_next(PyChannel *self, int timeout_ms, PyObject *stream_for, int device, tshare_view **view,
                     PyObject **set_result) {
  peek_call p = {.self = self};
  int rc, failed = 0;
  *view = NULL;
  *set_result = NULL;
  if (!py_channel_get(self)) return -1;
  py_guard_slice slice = {peek_slice, NULL, &p};
  if (py_guard_wait(&self->guard, "recv", timeout_ms, &slice, &rc) < 0) return -1;
  void *stream;
  if (rc == TSHARE_OK && set_is_next(&p)) {
    *set_result = py_set_take(self);
    failed = *set_result == NULL;
  } else if (rc == TSHARE_OK && receive_stream(stream_for, &p.info, device, &stream) < 0) {
    failed = 1;
  } else if (rc == TSHARE_OK) {
    tshare_channel *ch = self->ch;
    Py_BEGIN_ALLOW_THREADS rc = tshare_view_recv_stream(ch, stream, 0, view); /* already queued: no wait */
    Py_END_ALLOW_THREADS
  }
  if (!failed && rc != TSHARE_OK && rc != TSHARE_END) {
    py_raise_channel(self->ch, rc, "recv");
    failed = 1;
  }
  py_channel_leave(self);
  return failed ? -1 : 0;
}

/* _recv(timeout_ms, stream_for, device) -> None once the peer said bye; a
 * set as ("set", set_id, meta, [(name, capsule, dtype_code, dtype_bits)]);
 * else (capsule, tag, share_id, dtype_code, dtype_bits, device_type, device). */
PyObject *py_channel_recv(PyChannel *self, PyObject *args) {
  int timeout_ms, device;
  PyObject *stream_for, *set_result;
  if (!PyArg_ParseTuple(args, "iOi", &timeout_ms, &stream_for, &device)) return NULL;
  tshare_view *view;
  if (take_next(self, timeout_ms, stream_for, device, &view, &set_result) < 0) return NULL;
  if (set_result) return set_result;
  if (!view) Py_RETURN_NONE;
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
