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

struct tshare_set_pin {
  tshare_channel *ch; /* a reference, as the view held */
  const ts_backend *backend;
  void *memory;
  void *data;
  tshare_view *child_view; /* in a forked child: the view itself (its release touches only the child's copy) */
};

int tshare_set_view_release_pinned(tshare_view *view, tshare_set_pin **out) {
  if (out) *out = NULL;
  const ts_backend *be = ts_set_view_memory_backend(view);
  if (!out || !be || !be->memory_ref_locked || !view->memory) return TSHARE_E_INVALID_ARG;
  tshare_set_pin *pin = malloc(sizeof *pin);
  if (!pin) return TSHARE_E_NOMEM;
  tshare_channel *ch = view->ch;
  pin->ch = ch;
  pin->backend = be;
  pin->memory = view->memory;
  pin->data = view->data;
  pin->child_view = NULL;
  if (ts_channel_foreign(ch)) { /* a forked child tells the producer nothing: the view is the pin */
    pin->child_view = view;
    *out = pin;
    return TSHARE_OK;
  }
  atomic_fetch_add(&ch->refs, 1);
  pthread_mutex_lock(&ch->lock);
  be->memory_ref_locked(ch, view->memory);
  pthread_mutex_unlock(&ch->lock);
  tshare_view_release(view);
  *out = pin;
  return TSHARE_OK;
}

void *tshare_set_pin_data(const tshare_set_pin *pin) { return pin ? pin->data : NULL; }

void tshare_set_pin_release(tshare_set_pin *pin) {
  if (!pin) return;
  tshare_channel *ch = pin->ch;
  if (pin->child_view) {
    tshare_view_release(pin->child_view);
    free(pin);
    return;
  }
  if (ts_channel_foreign(ch)) { /* pinned in the parent, let go of in a child it forked */
    if (pin->backend->memory_unref_in_child) pin->backend->memory_unref_in_child(ch, pin->memory);
  } else {
    /* GPU work queued on the tensors since the set's release still reads the mapping. */
    if (pin->backend->memory_wait_before_last_unref) pin->backend->memory_wait_before_last_unref(pin->memory);
    pthread_mutex_lock(&ch->lock);
    pin->backend->memory_unref_locked(ch, pin->memory);
    pthread_mutex_unlock(&ch->lock);
  }
  free(pin);
  ts_channel_unref(ch);
}
