/* py_memory.c - DLPack capsules over tshare memory, and the storage table. */
#include "py_memory.h"

#include "dlpack_abi.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* One per capsule: the DLPack struct torch reads, and what it stands for. */
typedef struct py_mem {
  py_mem_kind kind;
  tshare_view *view;          /* PY_MEM_VIEW */
  tshare_set_pin *pin;        /* PY_MEM_VIEW released with its tensors kept: the memory stays mapped */
  atomic_int forwards;        /* PY_MEM_VIEW: sends of it on under way or out (py_memory_forward_begin) */
  tshare_host_buffer *buffer; /* PY_MEM_HOST_BUFFER */
  uintptr_t storage_key;      /* 0 until bound */
  int in_table;               /* found by storage_key (table_lock) */
  int adopted;                /* over torch's shared memory, lent to a set send */
  struct py_mem *next;        /* chain in the table */
  int versioned;
  union {
    DLManagedTensor classic;
    DLManagedTensorVersioned versioned;
  } dl;
  int64_t shape[TSHARE_MAX_NDIM];
  int64_t strides[TSHARE_MAX_NDIM];
} py_mem;

static int capsules_versioned;
static int bool_travels_as_uint8;

void py_memory_configure(int versioned, int bool_as_uint8) {
  capsules_versioned = versioned;
  bool_travels_as_uint8 = bool_as_uint8;
}

int py_memory_versioned(void) { return capsules_versioned; }

/* ---- the table: storage identity -> memory ------------------------------ */

#define TABLE_BUCKETS 4096
static py_mem *table[TABLE_BUCKETS];
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t bucket_of(uintptr_t key) { return (size_t)((key >> 4) * 0x9E3779B97F4A7C15ull >> 52) % TABLE_BUCKETS; }

static void table_insert(py_mem *m) {
  pthread_mutex_lock(&table_lock);
  if (!m->in_table) {
    size_t b = bucket_of(m->storage_key);
    m->next = table[b];
    table[b] = m;
    m->in_table = 1;
  }
  pthread_mutex_unlock(&table_lock);
}

static void table_remove(py_mem *m) {
  if (!m->storage_key) return;
  pthread_mutex_lock(&table_lock);
  for (py_mem **p = &table[bucket_of(m->storage_key)]; m->in_table && *p; p = &(*p)->next) {
    if (*p == m) {
      *p = m->next;
      m->in_table = 0;
      break;
    }
  }
  pthread_mutex_unlock(&table_lock);
}

/* The entry of storage_key and what it is (table_lock held). */
static py_mem *lookup_locked(uintptr_t storage_key, py_mem_kind *kind, void **memory) {
  for (py_mem *m = table[bucket_of(storage_key)]; m; m = m->next) {
    if (m->storage_key == storage_key) {
      *kind = m->kind == PY_MEM_VIEW && !m->view ? PY_MEM_PINNED : m->kind;
      *memory = *kind == PY_MEM_VIEW ? (void *)m->view : *kind == PY_MEM_HOST_BUFFER ? (void *)m->buffer : NULL;
      return m;
    }
  }
  *kind = PY_MEM_NONE;
  *memory = NULL;
  return NULL;
}

py_mem_kind py_memory_lookup(uintptr_t storage_key, void **memory) {
  py_mem_kind kind;
  pthread_mutex_lock(&table_lock);
  lookup_locked(storage_key, &kind, memory);
  pthread_mutex_unlock(&table_lock);
  return kind;
}

py_mem_kind py_memory_lookup_forward(uintptr_t storage_key, void **memory, void **token) {
  py_mem_kind kind;
  pthread_mutex_lock(&table_lock);
  py_mem *m = lookup_locked(storage_key, &kind, memory);
  /* Counted under the lock the lookup took: a release between the two
   * would find no forward and unpin the view this send is about to use. */
  if (kind == PY_MEM_VIEW) atomic_fetch_add(&m->forwards, 1);
  *token = kind == PY_MEM_VIEW ? m : NULL;
  pthread_mutex_unlock(&table_lock);
  return kind;
}

/* ---- host buffers by address ---------------------------------------------- */

/* Every live host buffer made here, sorted by address: a tensor set finds the
 * buffer under a tensor from its data pointer alone, without asking torch
 * for the tensor's storage (the costliest part of reading a tensor). Sound
 * because each buffer is its own mapping, unmapped only when it leaves this
 * table: an address inside one is that buffer's memory, whatever storage
 * torch wraps it in. */
static py_mem **by_address;
static size_t by_address_len, by_address_cap;

/* The index of the first buffer starting above addr (table_lock held). */
static size_t address_upper_bound(uintptr_t addr) {
  size_t lo = 0, hi = by_address_len;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if ((uintptr_t)tshare_host_buffer_data(by_address[mid]->buffer) <= addr) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

static int address_insert(py_mem *m) {
  int rc = 0;
  pthread_mutex_lock(&table_lock);
  if (by_address_len == by_address_cap) {
    size_t cap = by_address_cap ? by_address_cap * 2 : 64;
    py_mem **grown = realloc(by_address, cap * sizeof *grown);
    if (grown) by_address = grown, by_address_cap = cap;
    else rc = -1;
  }
  if (rc == 0) {
    size_t at = address_upper_bound((uintptr_t)tshare_host_buffer_data(m->buffer));
    memmove(by_address + at + 1, by_address + at, (by_address_len - at) * sizeof *by_address);
    by_address[at] = m;
    by_address_len++;
  }
  pthread_mutex_unlock(&table_lock);
  return rc;
}

static void address_remove(py_mem *m) {
  pthread_mutex_lock(&table_lock);
  size_t at = address_upper_bound((uintptr_t)tshare_host_buffer_data(m->buffer));
  if (at > 0 && by_address[at - 1] == m) {
    memmove(by_address + at - 1, by_address + at, (by_address_len - at) * sizeof *by_address);
    by_address_len--;
  }
  pthread_mutex_unlock(&table_lock);
}

static tshare_host_buffer *host_buffer_at(uintptr_t addr, int with_adopted) {
  tshare_host_buffer *found = NULL;
  pthread_mutex_lock(&table_lock);
  size_t at = address_upper_bound(addr);
  if (at > 0 && (with_adopted || !by_address[at - 1]->adopted)) {
    tshare_host_buffer *b = by_address[at - 1]->buffer;
    if (addr - (uintptr_t)tshare_host_buffer_data(b) < tshare_host_buffer_size(b)) found = b;
  }
  pthread_mutex_unlock(&table_lock);
  return found;
}

tshare_host_buffer *py_memory_host_buffer_at(uintptr_t addr) { return host_buffer_at(addr, 1); }

tshare_host_buffer *py_memory_made_host_buffer_at(uintptr_t addr) { return host_buffer_at(addr, 0); }

/* ---- giving the memory back ----------------------------------------------- */

/* The one place memory goes back, whichever way the capsule ended. */
static void mem_free(py_mem *m) {
  table_remove(m);
  if (m->kind == PY_MEM_VIEW) {
    tshare_view_release(m->view);
    tshare_set_pin_release(m->pin);
  } else {
    address_remove(m);
    tshare_host_buffer_destroy(m->buffer);
  }
  free(m);
}

static void classic_deleter(DLManagedTensor *self) { mem_free(self->manager_ctx); }
static void versioned_deleter(DLManagedTensorVersioned *self) { mem_free(self->manager_ctx); }

/* A capsule nobody consumed still owns its memory. */
static void capsule_destructor(PyObject *capsule) {
  const char *name = PyCapsule_GetName(capsule);
  if (!name || (strcmp(name, DLPACK_CAPSULE) != 0 && strcmp(name, DLPACK_CAPSULE_VERSIONED) != 0)) return;
  void *p = PyCapsule_GetPointer(capsule, name);
  if (!p) {
    PyErr_Clear();
    return;
  }
  if (strcmp(name, DLPACK_CAPSULE) == 0) classic_deleter(p);
  else versioned_deleter(p);
}

static DLTensor *dl_tensor_of(py_mem *m) { return m->versioned ? &m->dl.versioned.dl_tensor : &m->dl.classic.dl_tensor; }

static PyObject *capsule_of(py_mem *m, void *data, const tshare_tensor_desc *d, int device_type, int device_id) {
  m->versioned = capsules_versioned;
  DLTensor *t = dl_tensor_of(m);
  t->data = data; /* element [0,...,0]: byte_offset stays 0, which every torch reads the same */
  t->device.device_type = device_type;
  t->device.device_id = device_id;
  t->ndim = d->ndim;
  t->dtype.code = d->dtype.code;
  t->dtype.bits = d->dtype.bits;
  t->dtype.lanes = d->dtype.lanes;
  if (d->dtype.code == TSHARE_DTYPE_BOOL && bool_travels_as_uint8) t->dtype.code = TSHARE_DTYPE_UINT;
  for (int32_t i = 0; i < d->ndim; i++) {
    m->shape[i] = d->shape[i];
    m->strides[i] = d->strides[i];
  }
  t->shape = m->shape;
  t->strides = m->strides;
  t->byte_offset = 0;
  PyObject *capsule;
  if (m->versioned) {
    m->dl.versioned.version.major = 1;
    m->dl.versioned.version.minor = 0;
    m->dl.versioned.manager_ctx = m;
    m->dl.versioned.deleter = versioned_deleter;
    m->dl.versioned.flags = 0;
    capsule = PyCapsule_New(&m->dl.versioned, DLPACK_CAPSULE_VERSIONED, capsule_destructor);
  } else {
    m->dl.classic.manager_ctx = m;
    m->dl.classic.deleter = classic_deleter;
    capsule = PyCapsule_New(&m->dl.classic, DLPACK_CAPSULE, capsule_destructor);
  }
  if (!capsule) mem_free(m);
  return capsule;
}

/* A capsule over view's memory laid out as d (from the view's first element). */
static PyObject *view_capsule_as(tshare_view *view, const tshare_tensor_desc *d) {
  py_mem *m = calloc(1, sizeof *m);
  if (!m) {
    tshare_view_release(view);
    return PyErr_NoMemory();
  }
  m->kind = PY_MEM_VIEW;
  m->view = view;
  int device_id = tshare_view_device_type(view) == TSHARE_DEVICE_CUDA ? tshare_view_cuda_device(view) : 0;
  return capsule_of(m, tshare_view_data(view), d, tshare_view_device_type(view), device_id);
}

PyObject *py_memory_view_capsule(tshare_view *view) { return view_capsule_as(view, tshare_view_desc(view)); }

PyObject *py_memory_view_bytes_capsule(tshare_view *view, uint64_t nbytes) {
  int64_t n = (int64_t)nbytes;
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_UINT, 8, 1}, 1, &n, 0);
  return view_capsule_as(view, &d);
}

PyObject *py_memory_pending_capsule(void *data, const tshare_tensor_desc *d, int device_type, int device_id) {
  py_mem *m = calloc(1, sizeof *m);
  if (!m) return PyErr_NoMemory();
  m->kind = PY_MEM_VIEW; /* its view comes with py_memory_attach_view */
  return capsule_of(m, data, d, device_type, device_id);
}

/* The py_mem of a capsule torch consumed, or NULL with a Python error. */
static py_mem *consumed_mem(PyObject *capsule) {
  const char *name = PyCapsule_GetName(capsule);
  void *p = name ? PyCapsule_GetPointer(capsule, name) : NULL;
  if (!p) return NULL;
  if (strcmp(name, DLPACK_CAPSULE_USED) != 0 && strcmp(name, DLPACK_CAPSULE_VERSIONED_USED) != 0) {
    PyErr_SetString(PyExc_ValueError, "tshare: the capsule was not consumed by torch");
    return NULL;
  }
  return strcmp(name, DLPACK_CAPSULE_USED) == 0 ? ((DLManagedTensor *)p)->manager_ctx
                                                : ((DLManagedTensorVersioned *)p)->manager_ctx;
}

int py_memory_attach_view(PyObject *capsule, tshare_view *view) {
  py_mem *m = consumed_mem(capsule);
  if (!m) return -1;
  if (m->kind != PY_MEM_VIEW || m->view) {
    PyErr_SetString(PyExc_ValueError, "tshare: the capsule's memory is held already");
    return -1;
  }
  if (dl_tensor_of(m)->data != tshare_view_data(view)) { /* its tensors would point elsewhere than the view */
    PyErr_SetString(PyExc_ValueError, "tshare: the view is not where the capsule's tensor is");
    return -1;
  }
  pthread_mutex_lock(&table_lock);
  m->view = view;
  pthread_mutex_unlock(&table_lock);
  tshare_set_pin_release(m->pin); /* the view maps the same memory now */
  m->pin = NULL;
  if (m->storage_key) table_insert(m); /* found by its storage from now on (py_memory_bind waited for this) */
  return 0;
}

int py_memory_release_pinned(PyObject *const *capsules, Py_ssize_t n) {
  py_mem **mems = malloc((n ? (size_t)n : 1) * sizeof *mems);
  if (!mems) {
    PyErr_NoMemory();
    return -1;
  }
  /* Every capsule checked before any is released: all or nothing. The GIL,
   * held throughout, keeps sends (which look up memory with it) out. */
  Py_ssize_t held = 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    py_mem *m = consumed_mem(capsules[i]);
    if (!m) {
      free(mems);
      return -1;
    }
    if (m->kind != PY_MEM_VIEW || !m->view) continue; /* released already */
    if (atomic_load(&m->forwards) > 0) {
      free(mems);
      PyErr_SetString(PyExc_RuntimeError,
                      "tshare: release: a tensor of this set was sent on and that share is still out (or being "
                      "sent): its consumer reads this memory, which the producer could reuse once the set goes back; "
                      "wait for that share's release first");
      return -1;
    }
    mems[held++] = m;
  }
  for (Py_ssize_t i = 0; i < held; i++) {
    py_mem *m = mems[i];
    tshare_view *view = m->view;
    /* Still found by its storage, as pinned: a send of the tensor is refused
     * (its bytes are the producer's), not taken for memory of this process. */
    pthread_mutex_lock(&table_lock);
    m->view = NULL;
    pthread_mutex_unlock(&table_lock);
    int rc = tshare_set_view_release_pinned(view, &m->pin);
    if (rc != TSHARE_OK) { /* nothing released: those before it stay released (a retry goes on from here) */
      pthread_mutex_lock(&table_lock);
      m->view = view;
      pthread_mutex_unlock(&table_lock);
      free(mems);
      if (rc == TSHARE_E_NOMEM) PyErr_NoMemory();
      else PyErr_SetString(PyExc_TypeError, "tshare: release: the tensor's memory is not a tensor set member's");
      return -1;
    }
  }
  free(mems);
  return (int)held;
}

void py_memory_forward_more(void *token) {
  if (token) atomic_fetch_add(&((py_mem *)token)->forwards, 1);
}

void py_memory_forward_end(void *token) {
  if (token) atomic_fetch_sub(&((py_mem *)token)->forwards, 1);
}

PyObject *py_memory_host_capsule(size_t nbytes) {
  tshare_host_buffer *buffer = NULL;
  tshare_error err;
  int rc = tshare_host_buffer_create(nbytes ? nbytes : 1, "tshare-python", &buffer, &err);
  if (rc != TSHARE_OK) {
    PyErr_Format(PyExc_MemoryError, "tshare: empty_shared: %s", err.message);
    return NULL;
  }
  py_mem *m = calloc(1, sizeof *m);
  if (!m) {
    tshare_host_buffer_destroy(buffer);
    return PyErr_NoMemory();
  }
  m->kind = PY_MEM_HOST_BUFFER;
  m->buffer = buffer;
  if (address_insert(m) < 0) {
    tshare_host_buffer_destroy(buffer);
    free(m);
    return PyErr_NoMemory();
  }
  int64_t n = (int64_t)nbytes;
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_UINT, 8, 1}, 1, &n, 0);
  return capsule_of(m, tshare_host_buffer_data(buffer), &d, TSHARE_DEVICE_CPU, 0);
}

int py_memory_bind(PyObject *capsule, uintptr_t storage_key) {
  py_mem *m = consumed_mem(capsule);
  if (!m) return -1;
  if (m->storage_key) return 0;
  m->storage_key = storage_key;
  if (m->kind != PY_MEM_VIEW || m->view) table_insert(m); /* a pending capsule's goes in with its view */
  return 0;
}

/* ---- torch's own shared memory, lent to one set send ---------------------- */

#define ADOPTED_CAPSULE "tshare.adopted_file"

/* What a buffer over torch's shared memory holds: the storage object. */
static void drop_storage_object(void *storage) {
  PyGILState_STATE gil = PyGILState_Ensure();
  Py_DECREF((PyObject *)storage);
  PyGILState_Release(gil);
}

static void adopted_destructor(PyObject *capsule) {
  py_mem *m = PyCapsule_GetPointer(capsule, ADOPTED_CAPSULE);
  if (!m) {
    PyErr_Clear();
    return;
  }
  address_remove(m);
  tshare_host_buffer_destroy(m->buffer); /* the set's shares hold their own references */
  free(m);
}

PyObject *py_memory_adopt_file(int fd, size_t size, uintptr_t base, PyObject *storage) {
  tshare_host_buffer *buffer = NULL;
  tshare_error err;
  Py_INCREF(storage);
  int rc = tshare_host_buffer_wrap_fd(fd, size, (void *)base, drop_storage_object, storage, &buffer, &err);
  if (rc != TSHARE_OK) {
    Py_DECREF(storage);
    PyErr_Format(PyExc_OSError, "tshare: torch shared memory: %s", err.message);
    return NULL;
  }
  py_mem *m = calloc(1, sizeof *m);
  if (m) {
    m->kind = PY_MEM_HOST_BUFFER;
    m->buffer = buffer;
    m->adopted = 1;
  }
  if (!m || address_insert(m) < 0) {
    free(m);
    tshare_host_buffer_destroy(buffer);
    return PyErr_NoMemory();
  }
  PyObject *capsule = PyCapsule_New(m, ADOPTED_CAPSULE, adopted_destructor);
  if (!capsule) {
    address_remove(m);
    tshare_host_buffer_destroy(buffer);
    free(m);
  }
  return capsule;
}
