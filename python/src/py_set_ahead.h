/* py_set_ahead.h - the next set's torch tensors, made while recv waits.
 *
 * A consumer of the update pattern (a trainer sending its state_dict again
 * and again, updated in place) receives a set of the same layout each time:
 * the same names, dtypes, shapes and strides at the same addresses in memory
 * it keeps mapped (tshare_set_layout). Making its hundreds of torch tensors
 * is most of a Python receive, and it needs nothing of the set but that
 * layout. So the channel keeps the recipe of the last set whose layout the
 * core keeps, and recv, while it would wait, makes the tensors of the next
 * set from it: capsules over the remembered addresses whose memory is not
 * held yet (py_memory_pending_capsule), made into tensors as any set's are.
 * When a set of that layout comes with every member where the recipe has
 * it, each memory's view of the set is attached to its capsule and those
 * tensors are recv's result; any other set is made as before, and the
 * tensors made for nothing are dropped at the next recv call, not on the
 * way to this one's result.
 *
 * Everything here runs with the GIL held, which orders the recv that takes a
 * set (inside the channel's guard) and the thread that makes tensors ahead;
 * but any Python allocation may run a finalizer that lets another thread
 * run, so no check is followed by an allocation before what it guards. */
#ifndef TSHARE_PY_SET_AHEAD_H
#define TSHARE_PY_SET_AHEAD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <tshare/tshare.h>

/* A capsule of the recipe: one per memory of the set (the memory's bytes
 * from its lowest member) or per member with a capsule of its own. */
typedef struct py_kept_capsule {
  uint32_t member;           /* the member whose view is the capsule's memory */
  void *data;                /* where that view starts */
  tshare_tensor_desc desc;   /* the capsule's tensor over it */
  int device_type, device_id;
} py_kept_capsule;

typedef struct py_set_ahead {
  uint64_t layout;      /* tshare_set_layout of the kept set; 0: no recipe */
  uint64_t generation;  /* changes with the recipe: tensors made from an older one are not put */
  size_t count;         /* members */
  void **data;          /* per member: its address, */
  int *device;          /* and its CUDA device (-1: host) */
  int cuda_device;      /* the first CUDA member's device, -1 when none */
  py_kept_capsule *caps;
  size_t n_caps, n_bases; /* caps[0..n_bases) are memories', the rest members' own */
  PyObject *kinds, *views; /* set_tensors' layout arguments, as the kept set had them */
  PyObject *own;           /* [(index, name, dtype code, bits)] of the members with a capsule of their own */
  PyObject *ahead;         /* (tensors, capsules, memories) made for the next set, or a received set's
                              given back to take it (_ahead_into), or NULL */
  int ahead_is_offer;      /* ahead is _ahead_into's (the caller's own tensors), not made here */
  PyObject *stale;         /* made for a set that did not come: dropped at the next recv */
  unsigned misses;          /* sets in a row that did not fit what was made: at 2 nothing is made
                              until a set of the recipe's layout comes (a producer alternating models) */
  unsigned long long made, handed_over;
} py_set_ahead;

/* Forget the recipe and what was made from it (a set of no kept layout came,
 * the channel closes). */
void py_ahead_forget(py_set_ahead *a);

/* Record the recipe of s, just laid out as recv gives it: its memories'
 * capsules from base_member[]/base_bytes[] (n_bases of them), own[] the
 * members with a capsule of their own (kind_of[i] < 0), kinds and views as
 * handed to Python. A set of no kept layout forgets the recipe. 0, or -1
 * with a Python error. */
int py_ahead_record(py_set_ahead *a, const tshare_set *s, const uint32_t *base_member, const uint64_t *base_bytes,
                    size_t n_bases, const int32_t *kind_of, PyObject *kinds, PyObject *views);

/* recv's result for s from the tensors made ahead: ("kept", set_id, meta,
 * tensors, cuda device, generation, capsules, memories), each memory now
 * holding its view of s. NULL
 * without an error where nothing was made ahead or s does not fit (its
 * layout or a member's address differs; what was made goes stale); NULL
 * with a Python error where s could not be attached (then it is released). */
PyObject *py_ahead_hand_over(py_set_ahead *a, tshare_set *s);

/* Channel methods (tshare._sets.make_ahead):
 *   _ahead_wanted() -> True when a recipe waits to be made; drops what went stale.
 *   _ahead_spec() -> (generation, bases, kinds, views, own), set_tensors'
 *     arguments with fresh capsules that hold no memory yet; None without a recipe.
 *   _ahead_put(generation, tensors, capsules, memories) -> whether they were
 *     kept (memories: the tensor of each capsule, which holds its memory).
 *   _ahead_into(generation, tensors, capsules, memories) -> whether a received
 *     set's tensors, released with their memory kept mapped
 *     (py_memory_release_pinned), now wait for the next set of the recipe of
 *     that generation in place of any made ahead (Received.release, recv's into).
 *   _ahead_counts -> (sets whose tensors were made ahead, sets handed over so). */
PyObject *py_channel_ahead_wanted(PyObject *self, PyObject *unused);
PyObject *py_channel_ahead_spec(PyObject *self, PyObject *unused);
PyObject *py_channel_ahead_put(PyObject *self, PyObject *args);
PyObject *py_channel_ahead_into(PyObject *self, PyObject *args);
/* _ahead_withdraw(tensors): what _ahead_into offered, taken back where no set
 * took it (recv timed out, was cancelled, got something else). */
PyObject *py_channel_ahead_withdraw(PyObject *self, PyObject *tensors);

/* The generation of the recipe s was laid out by (what its tensors can be
 * given back to with _ahead_into), 0 when none: call after py_ahead_record. */
unsigned long long py_ahead_generation_of(const py_set_ahead *a, const tshare_set *s);
PyObject *py_channel_ahead_counts(PyObject *self, void *unused);

#endif /* TSHARE_PY_SET_AHEAD_H */
