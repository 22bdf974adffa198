/* py_set_recv.c - a received tensor set as the Python side builds it: one
 * capsule per memory of the set, and each member as its place in one of them.
 *
 * Making a torch tensor from a capsule and binding its storage costs several
 * times what a view of an existing tensor does, and a state_dict is hundreds
 * of tensors in a few memories. So the Python side makes one tensor per
 * memory (a byte tensor from the lowest member to the end of the highest),
 * one dtype view of it per (memory, dtype) -- a "kind" -- and each member as
 * kind.as_strided(shape, strides, element offset). Every member then shares
 * its memory's storage, bound to a view of the set: the set is released once
 * the last tensor on any of its memories is gone, and a member sent on alone
 * is the producer's memory, as before. A member that cannot be such a view
 * (its byte offset from the memory's lowest member is not a multiple of its
 * element size, an empty memory, a dtype of odd bits) or that is alone in
 * its memory gets a capsule of its own, as every member did before. */
#include "py_channel.h"
#include "py_errors.h"
#include "py_memory.h"

#include <stdlib.h>
#include <string.h>

/* ---- the set waiting for recv ------------------------------------------- */

int py_set_waiting(PyChannel *self) {
  py_next_set *n = &self->next;
  if (n->set || n->refusal != TSHARE_OK) return 1;
  int rc = tshare_set_recv(self->ch, 0, &n->set);
  /* The peer's end: the shares it sent before come first, then recv's own
   * look at the channel reports it. */
  if (rc == TSHARE_OK || rc == TSHARE_E_TIMEOUT || rc == TSHARE_END || rc == TSHARE_E_PEER_CLOSED)
    return n->set != NULL;
  n->refusal = rc; /* a set the peer got wrong (already released back) */
  snprintf(n->refusal_msg, sizeof n->refusal_msg, "%s", tshare_channel_last_error(self->ch));
  return 1;
}

uint64_t py_set_waiting_id(const PyChannel *self) { return self->next.set ? tshare_set_id(self->next.set) : 0; }

void py_set_drop_waiting(PyChannel *self) {
  tshare_set_release(self->next.set);
  self->next.set = NULL;
  self->next.refusal = TSHARE_OK;
}

/* ---- where each member lies ------------------------------------------------ */

/* Why a member cannot become a torch tensor, or NULL. */
static const char *member_refusal(const tshare_tensor_desc *d, char *why, size_t cap) {
  if (d->dtype.lanes != 1) {
    char name[32];
    snprintf(why, cap, "a dtype %s, which has no PyTorch equivalent", tshare_dtype_name(d->dtype, name, sizeof name));
    return why;
  }
  for (int32_t k = 0; k < d->ndim; k++) {
    if (d->strides[k] < 0) {
      snprintf(why, cap, "a negative stride (%lld in dimension %d), which PyTorch tensors cannot have",
               (long long)d->strides[k], (int)k);
      return why;
    }
  }
  return NULL;
}

/* A member and its memory, known by the address of the memory's first byte
 * and its device: two memories of one set are never mapped at one address. */
typedef struct member_place {
  uintptr_t base; /* 0: an empty memory, which has no address */
  int device;     /* -1: host memory */
  uint32_t index; /* in the set */
} member_place;

static int place_order(const void *a, const void *b) {
  const member_place *x = a, *y = b;
  if (x->base != y->base) return x->base < y->base ? -1 : 1;
  if (x->device != y->device) return x->device < y->device ? -1 : 1;
  return (x->index > y->index) - (x->index < y->index);
}

/* Bytes per element of a member that can be a view of its memory's tensor:
 * a dtype of whole bytes; 0 otherwise. */
static uint64_t view_itemsize(const tshare_tensor_desc *d) {
  return d->dtype.bits && d->dtype.bits % 8 == 0 ? d->dtype.bits / 8u : 0;
}

/* One past the member's last byte, from its memory's start (its offset when
 * it is empty). The set checked on arrival that it lies inside its memory
 * and that no stride is negative (member_refusal). */
static uint64_t member_end(const tshare_tensor_desc *d) {
  if (tshare_tensor_numel(d) == 0) return d->byte_offset;
  uint64_t last = 0;
  for (int32_t k = 0; k < d->ndim; k++) last += (uint64_t)(d->shape[k] - 1) * (uint64_t)d->strides[k];
  return d->byte_offset + (last + 1) * view_itemsize(d);
}

/* What the Python side builds a set from. */
typedef struct set_layout {
  tshare_set *s;
  PyObject *bases; /* [capsule]: one per memory, a byte tensor from its lowest member */
  PyObject *kinds; /* [(memory index, dtype code, bits, bytes usable as that dtype, a member's name)] */
  int32_t *kind_of;      /* per member: its kind, -1 for a member with a capsule of its own */
  int64_t *elem_offset;  /* per member: its first element's offset in elements of its kind's view */
  uint16_t *kind_dtype;  /* per kind: dtype code << 8 | bits */
  uint32_t *base_member; /* per memory: its lowest member, whose view the capsule holds */
  uint64_t *base_bytes;  /* per memory: the capsule's bytes */
} set_layout;

/* A memory's dtypes become kinds one by one; past this many, members of a
 * new dtype get capsules of their own (a producer cannot make the search
 * for a member's kind long). */
#define KINDS_PER_MEMORY 32

/* The kind of dtype in memory mem (whose kinds start at first), made on
 * first need; -1 when the memory has its share of kinds, -2 with a Python
 * error. */
static int32_t kind_for(set_layout *l, size_t first, Py_ssize_t mem, const tshare_tensor_desc *d, uint64_t nbytes,
                        const char *name) {
  uint16_t dtype = (uint16_t)(d->dtype.code << 8 | d->dtype.bits);
  size_t count = (size_t)PyList_GET_SIZE(l->kinds);
  for (size_t k = first; k < count; k++)
    if (l->kind_dtype[k] == dtype) return (int32_t)k;
  if (count - first >= KINDS_PER_MEMORY) return -1;
  uint64_t item = view_itemsize(d);
  PyObject *kind = Py_BuildValue("(niiKs)", mem, d->dtype.code, d->dtype.bits,
                                 (unsigned long long)(nbytes / item * item), name);
  if (!kind || PyList_Append(l->kinds, kind) < 0) {
    Py_XDECREF(kind);
    return -2;
  }
  Py_DECREF(kind);
  l->kind_dtype[count] = dtype;
  return (int32_t)count;
}

/* The members places[0..n) of one memory: its capsule, and each member's
 * kind and offset there (or -1: a capsule of its own). 0, or -1 with a
 * Python error. */
static int lay_out_memory(set_layout *l, const member_place *places, size_t n) {
  if (n == 1) return 0; /* its own capsule: cheaper than a memory's tensor and a view of it */
  uint64_t low = UINT64_MAX, high = 0;
  size_t lowest = 0;
  for (size_t j = 0; j < n; j++) {
    const tshare_tensor_desc *d = tshare_set_desc(l->s, places[j].index);
    if (!view_itemsize(d)) continue;
    if (d->byte_offset < low) low = d->byte_offset, lowest = places[j].index;
    uint64_t end = member_end(d);
    if (end > high) high = end;
  }
  if (low == UINT64_MAX) return 0; /* no member can be a view */
  tshare_view *view = NULL;
  int rc = tshare_set_view(l->s, lowest, &view);
  if (rc != TSHARE_OK)
    return py_raise_fmt(rc, "tshare: recv: set %llu: no view of its memory", (unsigned long long)tshare_set_id(l->s)),
           -1;
  PyObject *capsule = py_memory_view_bytes_capsule(view, high - low); /* owns the view from here */
  Py_ssize_t mem = PyList_GET_SIZE(l->bases);
  size_t first_kind = (size_t)PyList_GET_SIZE(l->kinds);
  if (!capsule || PyList_Append(l->bases, capsule) < 0) {
    Py_XDECREF(capsule);
    return -1;
  }
  Py_DECREF(capsule);
  l->base_member[mem] = (uint32_t)lowest;
  l->base_bytes[mem] = high - low;
  for (size_t j = 0; j < n; j++) {
    uint32_t i = places[j].index;
    const tshare_tensor_desc *d = tshare_set_desc(l->s, i);
    uint64_t item = view_itemsize(d), rel = d->byte_offset - low;
    if (!item || rel % item) continue;
    int32_t kind = kind_for(l, first_kind, mem, d, high - low, tshare_set_name(l->s, i));
    if (kind == -2) return -1;
    l->kind_of[i] = kind;
    l->elem_offset[i] = (int64_t)(rel / item);
  }
  return 0;
}

/* Group the members by memory and lay out each. 0, or -1 with a Python error. */
static int lay_out(set_layout *l, size_t n) {
  member_place *places = malloc((n ? n : 1) * sizeof *places);
  if (!places) return PyErr_NoMemory(), -1;
  for (size_t i = 0; i < n; i++) {
    const tshare_tensor_desc *d = tshare_set_desc(l->s, i);
    uintptr_t data = (uintptr_t)tshare_set_data(l->s, i);
    places[i] = (member_place){data ? data - (uintptr_t)d->byte_offset : 0, tshare_set_cuda_device(l->s, i),
                               (uint32_t)i};
    l->kind_of[i] = -1;
  }
  qsort(places, n, sizeof *places, place_order);
  int r = 0;
  for (size_t start = 0, end; r == 0 && start < n; start = end) {
    for (end = start + 1; end < n && places[end].base == places[start].base &&
                          places[end].device == places[start].device;
         end++) {
    }
    if (places[start].base) r = lay_out_memory(l, places + start, end - start);
  }
  free(places);
  return r;
}

/* ---- the result ------------------------------------------------------------- */

static PyObject *int_tuple(const int64_t *values, int32_t n) {
  PyObject *t = PyTuple_New(n);
  for (int32_t k = 0; t && k < n; k++) {
    PyObject *v = PyLong_FromLongLong(values[k]);
    if (!v) {
      Py_CLEAR(t);
      break;
    }
    PyTuple_SET_ITEM(t, k, v);
  }
  return t;
}

/* (name, kind, shape, strides, element offset) of a member that is a view. */
static PyObject *view_entry(const set_layout *l, size_t i) {
  const tshare_tensor_desc *d = tshare_set_desc(l->s, i);
  const char *name = tshare_set_name(l->s, i);
  return Py_BuildValue("(s#iNNL)", name, (Py_ssize_t)strlen(name), l->kind_of[i], int_tuple(d->shape, d->ndim),
                       int_tuple(d->strides, d->ndim), (long long)l->elem_offset[i]);
}

/* (index, name, capsule, dtype code, bits) of a member with a capsule of its own. */
static PyObject *own_entry(const set_layout *l, size_t i) {
  const tshare_tensor_desc *d = tshare_set_desc(l->s, i);
  tshare_view *view = NULL;
  int rc = tshare_set_view(l->s, i, &view);
  if (rc != TSHARE_OK)
    return py_raise_fmt(rc, "tshare: recv: set %llu: no view of tensor %zu", (unsigned long long)tshare_set_id(l->s),
                        i);
  PyObject *capsule = py_memory_view_capsule(view); /* owns the view from here */
  if (!capsule) return NULL;
  const char *name = tshare_set_name(l->s, i);
  return Py_BuildValue("(ns#Nii)", (Py_ssize_t)i, name, (Py_ssize_t)strlen(name), capsule, d->dtype.code,
                       d->dtype.bits);
}

/* The members in the sender's order: views in one list, those with a
 * capsule of their own in another. 0, or -1 with a Python error. */
static int member_entries(const set_layout *l, size_t n, PyObject *views, PyObject *own) {
  for (size_t i = 0; i < n; i++) {
    PyObject *entry = l->kind_of[i] >= 0 ? view_entry(l, i) : own_entry(l, i);
    if (!entry || PyList_Append(l->kind_of[i] >= 0 ? views : own, entry) < 0) {
      Py_XDECREF(entry);
      return -1;
    }
    Py_DECREF(entry);
  }
  return 0;
}

/* A member no torch tensor can be: refused, naming it. 0 when none is. */
static int refuse_members(tshare_set *s, size_t n) {
  char why[160];
  for (size_t i = 0; i < n; i++) {
    if (member_refusal(tshare_set_desc(s, i), why, sizeof why)) {
      py_raise_fmt(TSHARE_E_UNSUPPORTED, "tshare: recv: set %llu: tensor '%.200s' has %s",
                   (unsigned long long)tshare_set_id(s), tshare_set_name(s, i), why);
      return -1;
    }
  }
  return 0;
}

/* ("set", set_id, meta, bases, kinds, views, own, generation) for a set
 * (the lists set_layout and member_entries describe; generation: of the
 * recipe it was laid out by, 0 when none); the set handle goes once every
 * capsule holds it through its view. */
static PyObject *set_result(PyChannel *self, tshare_set *s) {
  size_t n = tshare_set_count(s), meta_len = 0;
  const void *meta = tshare_set_meta(s, &meta_len);
  set_layout l = {.s = s, .bases = PyList_New(0), .kinds = PyList_New(0)};
  l.kind_of = malloc((n ? n : 1) * sizeof *l.kind_of);
  l.elem_offset = malloc((n ? n : 1) * sizeof *l.elem_offset);
  l.kind_dtype = malloc((n ? n : 1) * sizeof *l.kind_dtype);
  l.base_member = malloc((n ? n : 1) * sizeof *l.base_member);
  l.base_bytes = malloc((n ? n : 1) * sizeof *l.base_bytes);
  PyObject *views = PyList_New(0), *own = PyList_New(0), *result = NULL;
  PyObject *meta_bytes = PyBytes_FromStringAndSize(meta, (Py_ssize_t)meta_len);
  if (!l.kind_of || !l.elem_offset || !l.kind_dtype || !l.base_member || !l.base_bytes) PyErr_NoMemory();
  else if (l.bases && l.kinds && views && own && meta_bytes && refuse_members(s, n) == 0 && lay_out(&l, n) == 0 &&
           member_entries(&l, n, views, own) == 0) {
    /* Its recipe, for the next set's tensors (py_set_ahead.h): a recipe that
     * cannot be kept costs that alone, never the set. */
    if (py_ahead_record(&self->ahead, s, l.base_member, l.base_bytes, (size_t)PyList_GET_SIZE(l.bases), l.kind_of,
                        l.kinds, views) < 0)
      PyErr_Clear();
    result = Py_BuildValue("(sKOOOOOK)", "set", (unsigned long long)tshare_set_id(s), meta_bytes, l.bases, l.kinds,
                           views, own, py_ahead_generation_of(&self->ahead, s));
  }
  /* On failure the capsules made so far go with their lists: the set goes back. */
  Py_XDECREF(l.bases);
  Py_XDECREF(l.kinds);
  Py_XDECREF(views);
  Py_XDECREF(own);
  Py_XDECREF(meta_bytes);
  free(l.kind_of);
  free(l.elem_offset);
  free(l.kind_dtype);
  free(l.base_member);
  free(l.base_bytes);
  tshare_set_release(s);
  return result;
}

PyObject *py_set_take(PyChannel *self) {
  py_next_set *n = &self->next;
  if (n->refusal != TSHARE_OK) {
    int rc = n->refusal;
    n->refusal = TSHARE_OK;
    return py_raise_fmt(rc, "tshare: recv (tensor set): %s", n->refusal_msg);
  }
  tshare_set *s = n->set;
  n->set = NULL;
  PyObject *kept = py_ahead_hand_over(&self->ahead, s);
  if (kept || PyErr_Occurred()) return kept;
  return set_result(self, s);
}
