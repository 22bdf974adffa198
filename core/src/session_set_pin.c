/* A set member's memory kept mapped past the set's release (set.h,
 * tshare_set_view_release_pinned): a consumer that keeps one set's tensors
 * across versions gives each version back while its tensors still point
 * into the memory, and the next version of the same layout, at the same
 * addresses, is attached to them. Between the two, a pin holds what a view
 * holds of the memory (one reference on its mapping), nothing of the set:
 * the producer is free to write, and a memory it retires meanwhile stays
 * mapped here until the pin goes, so a read through a stale tensor never
 * faults. */
#include "tshare/set.h"

#include "backend.h"
#include "session.h"
#include "session_set.h"

#include <stdatomic.h>
#include <stdlib.h>

/* One memory's pin, or every memory of a set's (tshare_set_pin_memories):
 * one reference on each mapping, taken under one lock; backend NULL once
 * let go of. */
typedef struct pinned_memory {
  const ts_backend *backend;
  void *memory;
} pinned_memory;

struct tshare_set_pin {
  tshare_channel *ch; /* a reference, as the view held */
  void *data;
  tshare_view *child_view; /* in a forked child: the view itself (its release touches only the child's copy) */
  tshare_set *child_set;   /* in a forked child, a whole set's: the set itself, likewise */
  size_t n;
  pinned_memory mems[];
};

static tshare_set_pin *pin_new(tshare_channel *ch, void *data, size_t n) {
  tshare_set_pin *pin = malloc(sizeof *pin + (n ? n : 1) * sizeof pin->mems[0]);
  if (!pin) return NULL;
  pin->ch = ch;
  pin->data = data;
  pin->child_view = NULL;
  pin->child_set = NULL;
  pin->n = n;
  return pin;
}

/* The pin's references taken (the caller holds what keeps the mappings
 * until then: a view, or the set). */
static void pin_take(tshare_set_pin *pin) {
  atomic_fetch_add(&pin->ch->refs, 1);
  pthread_mutex_lock(&pin->ch->lock);
  for (size_t i = 0; i < pin->n; i++) pin->mems[i].backend->memory_ref_locked(pin->ch, pin->mems[i].memory);
  pthread_mutex_unlock(&pin->ch->lock);
}

int tshare_set_view_release_pinned(tshare_view *view, tshare_set_pin **out) {
  if (out) *out = NULL;
  const ts_backend *be = ts_set_view_memory_backend(view);
  if (!out || !be || !be->memory_ref_locked || !view->memory) return TSHARE_E_INVALID_ARG;
  tshare_set_pin *pin = pin_new(view->ch, view->data, 1);
  if (!pin) return TSHARE_E_NOMEM;
  pin->mems[0] = (pinned_memory){be, view->memory};
  if (ts_channel_foreign(view->ch)) { /* a forked child tells the producer nothing: the view is the pin */
    pin->child_view = view;
    *out = pin;
    return TSHARE_OK;
  }
  pin_take(pin);
  tshare_view_release(view);
  *out = pin;
  return TSHARE_OK;
}

int tshare_set_pin_memories(tshare_set *set, tshare_set_pin **out) {
  if (out) *out = NULL;
  if (!set || !out) return TSHARE_E_INVALID_ARG;
  tshare_channel *ch;
  uint32_t n = ts_set_memory_count(set, &ch);
  tshare_set_pin *pin = pin_new(ch, tshare_set_count(set) ? tshare_set_data(set, 0) : NULL, n);
  if (!pin) return TSHARE_E_NOMEM;
  for (uint32_t i = 0; i < n; i++) ts_set_memory_at(set, i, &pin->mems[i].backend, &pin->mems[i].memory);
  for (uint32_t i = 0; i < n; i++)
    if (!pin->mems[i].backend->memory_ref_locked) { /* memory no pin can hold (none of a same-host set's) */
      free(pin);
      return TSHARE_E_INVALID_ARG;
    }
  if (ts_channel_foreign(ch)) { /* a forked child tells the producer nothing: the set is the pin */
    ts_set_ref(set);
    pin->child_set = set;
  } else {
    pin_take(pin);
  }
  *out = pin;
  return TSHARE_OK;
}

void *tshare_set_pin_data(const tshare_set_pin *pin) { return pin ? pin->data : NULL; }

/* Device memories go as a set's do (set_release, with no release to send):
 * once the work queued on their default stream so far ran, since the
 * tensors kept past the set's release may have had work queued on them
 * after it, which the set's own release did not wait for. Each is taken
 * off the pin (backend NULL); the host ones stay for the caller. */
static void unpin_device_memories(tshare_channel *ch, tshare_set_pin *pin) {
  void **memories = NULL;
  for (;;) {
    const ts_backend *device = NULL;
    size_t n = 0;
    for (size_t i = 0; i < pin->n; i++) {
      const ts_backend *be = pin->mems[i].backend;
      if (!be || !be->set_release || (device && be != device)) continue;
      if (!memories && !(memories = malloc(pin->n * sizeof *memories))) break;
      device = be;
      memories[n++] = pin->mems[i].memory;
      pin->mems[i].backend = NULL;
    }
    if (!n) break;
    (void)device->set_release(ch, memories, n, 0);
  }
  if (memories) {
    free(memories);
    return;
  }
  /* Out of memory for the list: one by one, each after the work queued so far. */
  for (size_t i = 0; i < pin->n; i++) {
    const ts_backend *be = pin->mems[i].backend;
    if (!be || !be->set_release) continue;
    pin->mems[i].backend = NULL;
    (void)be->set_release(ch, &pin->mems[i].memory, 1, 0);
  }
}

void tshare_set_pin_release(tshare_set_pin *pin) {
  if (!pin) return;
  tshare_channel *ch = pin->ch;
  if (pin->child_view || pin->child_set) {
    tshare_view_release(pin->child_view);
    tshare_set_release(pin->child_set);
    free(pin);
    return;
  }
  if (ts_channel_foreign(ch)) { /* pinned in the parent, let go of in a child it forked */
    for (size_t i = 0; i < pin->n; i++)
      if (pin->mems[i].backend->memory_unref_in_child)
        pin->mems[i].backend->memory_unref_in_child(ch, pin->mems[i].memory);
  } else {
    unpin_device_memories(ch, pin);
    pthread_mutex_lock(&ch->lock);
    for (size_t i = 0; i < pin->n; i++)
      if (pin->mems[i].backend) pin->mems[i].backend->memory_unref_locked(ch, pin->mems[i].memory);
    pthread_mutex_unlock(&ch->lock);
  }
  free(pin);
  ts_channel_unref(ch);
}
