/* A growable array: one pointer, a length and a capacity, grown by doubling
 * with every size computed overflow-checked. Header-only, so that any file
 * of core (and a unit test) can use it without a source list entry.
 *
 * Two levels:
 *  - ts_vec and the ts_vec_* functions work on untyped elements of a size the
 *    caller passes each time;
 *  - TS_VEC_DEFINE(name, T) declares a typed vector `name` whose `items` is a
 *    T * and thin functions name_push(v, x), name_reserve(v, more),
 *    name_insert(v, at, x), name_remove(v, at, count), name_free(v) that
 *    pass sizeof(T) for you. Its `raw` member is the same storage as a
 *    ts_vec (a union), so the untyped functions still apply.
 *
 *   TS_VEC_DEFINE(ts_id_vec, uint64_t)
 *   ts_id_vec ids = {0};
 *   if (ts_id_vec_push(&ids, 42) != TSHARE_OK) ...   // out of memory
 *   for (size_t i = 0; i < ids.len; i++) use(ids.items[i]);
 *   ts_id_vec_free(&ids);
 *
 * Statuses are the public ones: TSHARE_OK, TSHARE_E_NOMEM when realloc
 * fails, TSHARE_E_TOO_LARGE when the element count times the element size
 * would not fit in a size_t. On failure the vector is unchanged. A
 * zero-initialised vector is empty and valid; free leaves it empty and
 * reusable. Not thread-safe: the owner's lock covers it. */
#ifndef TSHARE_VEC_H
#define TSHARE_VEC_H

#include "tshare/errors.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct ts_vec {
  void *items;
  size_t len; /* elements in use */
  size_t cap; /* elements allocated */
} ts_vec;

/* The smallest capacity a vector grows to: fewer reallocs for short lists. */
#define TS_VEC_MIN_CAP 16

#if defined(__GNUC__) || defined(__clang__)
#define TS_VEC_MAYBE_UNUSED __attribute__((unused))
#else
#define TS_VEC_MAYBE_UNUSED
#endif

/* Room for `more` elements past len: afterwards cap - len >= more. */
static inline TS_VEC_MAYBE_UNUSED int ts_vec_reserve(ts_vec *v, size_t more, size_t elem_size) {
  if (elem_size == 0) return TSHARE_E_INVALID_ARG;
  if (v->cap - v->len >= more) return TSHARE_OK;
  size_t most = SIZE_MAX / elem_size; /* the most elements whose bytes fit a size_t */
  if (more > most - v->len) return TSHARE_E_TOO_LARGE;
  size_t need = v->len + more;
  size_t cap = v->cap < TS_VEC_MIN_CAP ? TS_VEC_MIN_CAP : v->cap;
  while (cap < need) cap = cap > most / 2 ? most : cap * 2; /* doubling, clamped at the limit */
  if (cap > most) cap = most;
  void *items = realloc(v->items, cap * elem_size);
  if (!items) return TSHARE_E_NOMEM;
  v->items = items;
  v->cap = cap;
  return TSHARE_OK;
}

/* The element at index i (no bounds check: callers index below len). */
static inline TS_VEC_MAYBE_UNUSED void *ts_vec_at(const ts_vec *v, size_t i, size_t elem_size) {
  return (char *)v->items + i * elem_size;
}

/* A copy of *elem appended. */
static inline TS_VEC_MAYBE_UNUSED int ts_vec_push(ts_vec *v, const void *elem, size_t elem_size) {
  int rc = ts_vec_reserve(v, 1, elem_size);
  if (rc != TSHARE_OK) return rc;
  memcpy(ts_vec_at(v, v->len, elem_size), elem, elem_size);
  v->len++;
  return TSHARE_OK;
}

/* A copy of *elem put at index `at` (<= len), the elements from there on
 * moved up by one. at > len is refused. */
static inline TS_VEC_MAYBE_UNUSED int ts_vec_insert(ts_vec *v, size_t at, const void *elem, size_t elem_size) {
  if (at > v->len) return TSHARE_E_INVALID_ARG;
  int rc = ts_vec_reserve(v, 1, elem_size);
  if (rc != TSHARE_OK) return rc;
  memmove(ts_vec_at(v, at + 1, elem_size), ts_vec_at(v, at, elem_size), (v->len - at) * elem_size);
  memcpy(ts_vec_at(v, at, elem_size), elem, elem_size);
  v->len++;
  return TSHARE_OK;
}

/* `count` elements from index `at` taken out, the rest moved down (order
 * kept). A range past len is cut at len. Never allocates, never fails:
 * remove(v, 0, n) drops the first n, the way a queue is consumed. */
static inline TS_VEC_MAYBE_UNUSED void ts_vec_remove(ts_vec *v, size_t at, size_t count, size_t elem_size) {
  if (at >= v->len) return;
  if (count > v->len - at) count = v->len - at;
  size_t tail = v->len - at - count;
  if (tail) memmove(ts_vec_at(v, at, elem_size), ts_vec_at(v, at + count, elem_size), tail * elem_size);
  v->len -= count;
}

/* The storage given back; the vector is empty and usable again. */
static inline TS_VEC_MAYBE_UNUSED void ts_vec_free(ts_vec *v) {
  free(v->items);
  *v = (ts_vec){0};
}

/* A typed vector of T named `name`, and its functions name_*. The union puts
 * a T * over the ts_vec's void * (same representation, checked below), so
 * v.items[i] is typed and &v.raw goes to the untyped functions. */
#define TS_VEC_DEFINE(name, T)                                                                                         \
  typedef union name {                                                                                                 \
    ts_vec raw;                                                                                                        \
    struct {                                                                                                           \
      T *items;                                                                                                        \
      size_t len, cap;                                                                                                 \
    };                                                                                                                 \
  } name;                                                                                                              \
  _Static_assert(sizeof(T *) == sizeof(void *), #name ": a T * must be stored like a void *");                         \
  static inline TS_VEC_MAYBE_UNUSED int name##_reserve(name *v, size_t more) {                                         \
    return ts_vec_reserve(&v->raw, more, sizeof(T));                                                                   \
  }                                                                                                                    \
  static inline TS_VEC_MAYBE_UNUSED int name##_push(name *v, T x) { return ts_vec_push(&v->raw, &x, sizeof(T)); }      \
  static inline TS_VEC_MAYBE_UNUSED int name##_insert(name *v, size_t at, T x) {                                       \
    return ts_vec_insert(&v->raw, at, &x, sizeof(T));                                                                  \
  }                                                                                                                    \
  static inline TS_VEC_MAYBE_UNUSED void name##_remove(name *v, size_t at, size_t count) {                             \
    ts_vec_remove(&v->raw, at, count, sizeof(T));                                                                      \
  }                                                                                                                    \
  static inline TS_VEC_MAYBE_UNUSED void name##_free(name *v) { ts_vec_free(&v->raw); }

#endif
