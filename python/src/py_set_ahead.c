/* py_set_ahead.c - the next set's torch tensors, made while recv waits (see
 * py_set_ahead.h). */
#include "py_set_ahead.h"

#include "py_channel.h"
#include "py_errors.h"
#include "py_memory.h"

#include <stdlib.h>
#include <string.h>

/* Recipe generations count up across every channel of the process (GIL
 * held): tensors of one channel's set are never taken for another's. */
static uint64_t last_generation;

/* What was made ahead will not be handed over: it goes at the next recv
 * call (dropping hundreds of tensors is not for the way to a result). A
 * caller's own tensors offered by recv(into=) go at once: that recv holds
 * them, so this drops a reference and nothing else, and a slot kept for the
 * next recv would pin their memory after the caller let go of them. */
static void go_stale(py_set_ahead *a) {
  if (!a->ahead) return;
  if (a->ahead_is_offer) {
    a->ahead_is_offer = 0;
    Py_CLEAR(a->ahead);
    return;
  }
  /* what went stale before stays for the next recv to drop */
  PyObject *older = a->stale;
  a->stale = a->ahead;
  a->ahead = NULL;
  Py_XDECREF(older);
}

static void drop_recipe(py_set_ahead *a) {
  PyObject *kinds = a->kinds, *views = a->views, *own = a->own;
  free(a->data);
  free(a->device);
  free(a->caps);
  a->data = NULL, a->device = NULL, a->caps = NULL;
  a->kinds = a->views = a->own = NULL;
  a->layout = 0, a->count = 0, a->n_caps = a->n_bases = 0, a->cuda_device = -1;
  a->generation = ++last_generation;
  Py_XDECREF(kinds);
  Py_XDECREF(views);
  Py_XDECREF(own);
}

void py_ahead_forget(py_set_ahead *a) {
  go_stale(a);
  PyObject *stale = a->stale;
  a->stale = NULL;
  drop_recipe(a);
  Py_XDECREF(stale);
}

/* The capsule a member's memory becomes: where it starts and its device. */
static void kept_capsule(const tshare_set *s, uint32_t member, const tshare_tensor_desc *desc, py_kept_capsule *c) {
  int cuda = tshare_set_cuda_device(s, member);
  c->member = member;
  c->data = tshare_set_data(s, member);
  c->desc = *desc;
  c->device_type = cuda >= 0 ? TSHARE_DEVICE_CUDA : TSHARE_DEVICE_CPU;
  c->device_id = cuda >= 0 ? cuda : 0;
}

static int fits(const py_set_ahead *a, const tshare_set *s);

static int record(py_set_ahead *a, const tshare_set *s, const uint32_t *base_member, const uint64_t *base_bytes,
                  size_t n_bases, const int32_t *kind_of, PyObject *kinds, PyObject *views) {
  size_t n = tshare_set_count(s), n_own = 0;
  for (size_t i = 0; i < n; i++) n_own += kind_of[i] < 0;
  a->data = malloc((n ? n : 1) * sizeof *a->data);
  a->device = malloc((n ? n : 1) * sizeof *a->device);
  a->caps = malloc((n_bases + n_own ? n_bases + n_own : 1) * sizeof *a->caps);
  a->own = PyList_New(0);
  if (!a->data || !a->device || !a->caps) PyErr_NoMemory();
  if (!a->data || !a->device || !a->caps || !a->own) return -1;
  a->count = n;
  a->cuda_device = -1;
  for (size_t i = 0; i < n; i++) {
    a->data[i] = tshare_set_data(s, i);
    a->device[i] = tshare_set_cuda_device(s, i);
    if (a->cuda_device < 0) a->cuda_device = a->device[i];
  }
  for (size_t j = 0; j < n_bases; j++) {
    int64_t bytes = (int64_t)base_bytes[j];
    tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_UINT, 8, 1}, 1, &bytes, 0);
    kept_capsule(s, base_member[j], &d, &a->caps[j]);
  }
  size_t c = n_bases;
  for (size_t i = 0; i < n; i++) {
    if (kind_of[i] >= 0) continue;
    const tshare_tensor_desc *d = tshare_set_desc(s, i);
    const char *name = tshare_set_name(s, i);
    kept_capsule(s, (uint32_t)i, d, &a->caps[c++]);
    PyObject *entry =
      Py_BuildValue("(ns#ii)", (Py_ssize_t)i, name, (Py_ssize_t)strlen(name), d->dtype.code, d->dtype.bits);
    if (!entry || PyList_Append(a->own, entry) < 0) {
      Py_XDECREF(entry);
      return -1;
    }
    Py_DECREF(entry);
  }
  a->n_caps = c, a->n_bases = n_bases;
  Py_INCREF(kinds);
  Py_INCREF(views);
  a->kinds = kinds, a->views = views;
  a->layout = tshare_set_layout(s);
  return 0;
}

int py_ahead_record(py_set_ahead *a, const tshare_set *s, const uint32_t *base_member, const uint64_t *base_bytes,
                    size_t n_bases, const int32_t *kind_of, PyObject *kinds, PyObject *views) {
  if (fits(a, s)) { /* the recipe it came from (nothing was made ahead): kept as it is */
    a->misses = 0;   /* and worth making again */
    return 0;
  }
  go_stale(a);
  drop_recipe(a);
  if (!tshare_set_layout(s)) return 0;
  if (record(a, s, base_member, base_bytes, n_bases, kind_of, kinds, views) == 0) return 0;
  drop_recipe(a);
  return -1;
}

/* Every member of s where the recipe has it: then the tensors made from the
 * recipe are s's, only their memory is not held yet. The layout number says
 * the rest (names, dtypes, shapes, strides, places in memory: set.h). */
static int fits(const py_set_ahead *a, const tshare_set *s) {
  if (!a->layout || tshare_set_layout(s) != a->layout || tshare_set_count(s) != a->count) return 0;
  for (size_t i = 0; i < a->count; i++)
    if (tshare_set_data(s, i) != a->data[i] || tshare_set_cuda_device(s, i) != a->device[i]) return 0;
  return 1;
}

static void release_views(tshare_view **views, size_t from, size_t to) {
  for (size_t j = from; j < to; j++) tshare_view_release(views[j]);
}

PyObject *py_ahead_hand_over(py_set_ahead *a, tshare_set *s) {
  if (!a->ahead) return NULL;
  if (!fits(a, s)) {
    go_stale(a);
    a->misses++;
    return NULL;
  }
  size_t n = a->n_caps;
  tshare_view **views = calloc(n ? n : 1, sizeof *views);
  if (!views) {
    tshare_set_release(s);
    return PyErr_NoMemory();
  }
  /* Every view first: a memory that is not where the recipe has it (which
   * fits() rules out) leaves the set to be made as any other. */
  size_t made = 0;
  int rc = TSHARE_OK;
  for (; made < n; made++) {
    rc = tshare_set_view(s, a->caps[made].member, &views[made]);
    if (rc != TSHARE_OK || tshare_view_data(views[made]) != a->caps[made].data) break;
  }
  if (made < n) {
    release_views(views, 0, made + (rc == TSHARE_OK));
    free(views);
    go_stale(a);
    if (rc == TSHARE_OK) return NULL;
    PyObject *none = py_raise_fmt(rc, "tshare: recv: set %llu: no view of its memory",
                                  (unsigned long long)tshare_set_id(s));
    tshare_set_release(s);
    return none;
  }
  PyObject *tensors = PyTuple_GET_ITEM(a->ahead, 0), *capsules = PyTuple_GET_ITEM(a->ahead, 1);
  for (size_t j = 0; j < n; j++) {
    if (py_memory_attach_view(PyList_GET_ITEM(capsules, (Py_ssize_t)j), views[j]) < 0) {
      release_views(views, j, n); /* those attached go with the tensors */
      free(views);
      go_stale(a);
      tshare_set_release(s);
      return NULL;
    }
  }
  free(views);
  size_t meta_len = 0;
  const void *meta = tshare_set_meta(s, &meta_len);
  PyObject *result = Py_BuildValue("(sKy#OiKOO)", "kept", (unsigned long long)tshare_set_id(s), meta ? meta : "",
                                   (Py_ssize_t)meta_len, tensors, a->cuda_device, (unsigned long long)a->generation,
                                   capsules, PyTuple_GET_ITEM(a->ahead, 2));
  tshare_set_release(s); /* each memory's view holds it now */
  PyObject *ahead = a->ahead;
  a->ahead = NULL;
  a->ahead_is_offer = 0;
  Py_DECREF(ahead); /* result holds the tensors, or (no memory for it) they go, and the set with them */
  if (result) a->handed_over++, a->misses = 0;
  return result;
}

/* ---- what recv calls, from tshare._sets.make_ahead ------------------------- */

PyObject *py_channel_ahead_wanted(PyObject *obj, PyObject *unused) {
  (void)unused;
  py_set_ahead *a = &((PyChannel *)obj)->ahead;
  Py_CLEAR(a->stale);
  return PyBool_FromLong(((PyChannel *)obj)->ch && a->layout && !a->ahead && a->misses < 2);
}

PyObject *py_channel_ahead_spec(PyObject *obj, PyObject *unused) {
  (void)unused;
  py_set_ahead *a = &((PyChannel *)obj)->ahead;
  if (!((PyChannel *)obj)->ch || !a->layout || a->ahead) Py_RETURN_NONE;
  /* A copy of the recipe before the first Python allocation: one may run a
   * finalizer that lets another thread's recv replace the recipe. What is
   * made from the copy carries its generation, which _ahead_put checks. */
  const unsigned long long generation = a->generation;
  const size_t n_caps = a->n_caps, n_bases = a->n_bases;
  py_kept_capsule *caps = malloc((n_caps ? n_caps : 1) * sizeof *caps);
  if (!caps) return PyErr_NoMemory();
  memcpy(caps, a->caps, n_caps * sizeof *caps);
  PyObject *kinds = a->kinds, *views = a->views, *own_template = a->own;
  Py_INCREF(kinds);
  Py_INCREF(views);
  Py_INCREF(own_template);
  PyObject *bases = PyList_New((Py_ssize_t)n_bases), *own = PyList_New((Py_ssize_t)(n_caps - n_bases));
  PyObject *result = NULL;
  if (!bases || !own) goto out;
  for (size_t j = 0; j < n_caps; j++) {
    const py_kept_capsule *c = &caps[j];
    PyObject *capsule = py_memory_pending_capsule(c->data, &c->desc, c->device_type, c->device_id);
    if (!capsule) goto out;
    if (j < n_bases) {
      PyList_SET_ITEM(bases, (Py_ssize_t)j, capsule);
      continue;
    }
    PyObject *t = PyList_GET_ITEM(own_template, (Py_ssize_t)(j - n_bases)); /* (index, name, code, bits) */
    PyObject *entry = Py_BuildValue("(OONOO)", PyTuple_GET_ITEM(t, 0), PyTuple_GET_ITEM(t, 1), capsule,
                                    PyTuple_GET_ITEM(t, 2), PyTuple_GET_ITEM(t, 3));
    if (!entry) goto out;
    PyList_SET_ITEM(own, (Py_ssize_t)(j - n_bases), entry);
  }
  result = Py_BuildValue("(KOOOO)", generation, bases, kinds, views, own);
out:
  free(caps);
  Py_XDECREF(bases);
  Py_XDECREF(own);
  Py_DECREF(kinds);
  Py_DECREF(views);
  Py_DECREF(own_template);
  return result;
}

/* _ahead_put and _ahead_into: (generation, tensors, capsules, memories),
 * tensors made from the recipe of that generation; into replaces what was
 * made ahead, put does not. */
static PyObject *ahead_store(PyObject *obj, PyObject *args, int into) {
  unsigned long long generation;
  PyObject *tensors, *capsules, *memories;
  if (!PyArg_ParseTuple(args, "KO!O!O!", &generation, &PyDict_Type, &tensors, &PyList_Type, &capsules, &PyList_Type,
                        &memories))
    return NULL;
  py_set_ahead *a = &((PyChannel *)obj)->ahead;
  /* Allocated before the checks: an allocation may run a finalizer that lets
   * another thread's recv replace the recipe, and nothing may come between
   * the checks and the store. */
  PyObject *made = PyTuple_Pack(3, tensors, capsules, memories);
  if (!made) return NULL;
  if (!((PyChannel *)obj)->ch || !a->layout || (a->ahead && !into) || generation != a->generation ||
      (size_t)PyList_GET_SIZE(capsules) != a->n_caps || PyList_GET_SIZE(memories) != PyList_GET_SIZE(capsules)) {
    Py_DECREF(made); /* another recv changed the recipe or made its tensors meanwhile */
    Py_RETURN_FALSE;
  }
  if (into) go_stale(a); /* tensors made ahead meanwhile are dropped at the next recv, not here */
  a->ahead = made;
  a->ahead_is_offer = into;
  a->made += !into;
  Py_RETURN_TRUE;
}

PyObject *py_channel_ahead_put(PyObject *obj, PyObject *args) { return ahead_store(obj, args, 0); }

PyObject *py_channel_ahead_into(PyObject *obj, PyObject *args) { return ahead_store(obj, args, 1); }

PyObject *py_channel_ahead_withdraw(PyObject *obj, PyObject *tensors) {
  py_set_ahead *a = &((PyChannel *)obj)->ahead;
  if (a->ahead && PyTuple_GET_ITEM(a->ahead, 0) == tensors) go_stale(a); /* the offer's reference, dropped now */
  Py_RETURN_NONE;
}

unsigned long long py_ahead_generation_of(const py_set_ahead *a, const tshare_set *s) {
  return a->layout && a->layout == tshare_set_layout(s) ? a->generation : 0;
}

PyObject *py_channel_ahead_counts(PyObject *obj, void *unused) {
  (void)unused;
  const py_set_ahead *a = &((PyChannel *)obj)->ahead;
  return Py_BuildValue("(KK)", a->made, a->handed_over);
}
