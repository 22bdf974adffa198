/* The internal growable array (core/src/vec.h): growth keeps the elements,
 * insert and remove keep the order, sizes that would overflow a size_t are
 * refused before any allocation, and free leaves an empty, reusable vector. */
#include "harness.h"
#include "tshare/errors.h"
#include "vec.h"

#include <stdint.h>

TS_VEC_DEFINE(id_vec, uint64_t)

typedef struct pair {
  int a;
  double b;
} pair;
TS_VEC_DEFINE(pair_vec, pair)

static uint64_t value_at(size_t i) { return (uint64_t)i * UINT64_C(0x9e3779b97f4a7c15); }

TS_TEST(push_grows_by_doubling_and_keeps_every_element) {
  id_vec v = {0};
  CHECK(v.items == NULL && v.len == 0 && v.cap == 0);
  size_t last_cap = 0, grew = 0;
  for (size_t i = 0; i < 10000; i++) {
    CHECK_RC(id_vec_push(&v, value_at(i)), TSHARE_OK, "push");
    if (v.cap != last_cap) {
      CHECK(last_cap == 0 ? v.cap == TS_VEC_MIN_CAP : v.cap == last_cap * 2);
      last_cap = v.cap;
      grew++;
    }
  }
  CHECK_EQ(v.len, 10000);
  CHECK_EQ(grew, 11); /* 16 .. 16384 */
  for (size_t i = 0; i < v.len; i++)
    if (v.items[i] != value_at(i)) TS_FAIL("element %zu lost in growth", i);
  /* The untyped view is the same storage. */
  CHECK(v.raw.items == (void *)v.items && v.raw.len == v.len && v.raw.cap == v.cap);
  CHECK(*(uint64_t *)ts_vec_at(&v.raw, 5, sizeof(uint64_t)) == value_at(5));
  id_vec_free(&v);
}

TS_TEST(reserve_makes_room_at_once_and_never_shrinks) {
  pair_vec v = {0};
  CHECK_RC(pair_vec_reserve(&v, 100), TSHARE_OK, "reserve");
  CHECK(v.cap >= 100 && v.len == 0);
  pair *before = v.items;
  size_t cap = v.cap;
  for (int i = 0; i < 100; i++) CHECK_RC(pair_vec_push(&v, (pair){i, i / 2.0}), TSHARE_OK, "push");
  CHECK(v.items == before && v.cap == cap); /* no realloc while the room lasts */
  CHECK_RC(pair_vec_reserve(&v, 0), TSHARE_OK, "reserve 0");
  CHECK_RC(pair_vec_reserve(&v, cap - 100), TSHARE_OK, "reserve what is left");
  CHECK(v.cap == cap);
  CHECK(v.items[99].a == 99 && v.items[99].b == 49.5);
  pair_vec_free(&v);
}

TS_TEST(counts_whose_bytes_overflow_are_refused_and_change_nothing) {
  /* More elements than SIZE_MAX / elem_size: refused before realloc. */
  id_vec v = {0};
  CHECK_RC(id_vec_push(&v, 7), TSHARE_OK, "push");
  void *items = v.items;
  size_t cap = v.cap;
  CHECK_RC(id_vec_reserve(&v, SIZE_MAX / sizeof(uint64_t)), TSHARE_E_TOO_LARGE, "len + more over the limit");
  CHECK_RC(id_vec_reserve(&v, SIZE_MAX), TSHARE_E_TOO_LARGE, "SIZE_MAX elements");
  CHECK(v.items == items && v.cap == cap && v.len == 1 && v.items[0] == 7);
  id_vec_free(&v);

  /* A vector already at the limit (faked: nothing is allocated, and nothing
   * may be) refuses one more element. */
  ts_vec full = {NULL, SIZE_MAX / 8, SIZE_MAX / 8};
  uint64_t x = 1;
  CHECK_RC(ts_vec_push(&full, &x, 8), TSHARE_E_TOO_LARGE, "push past SIZE_MAX / 8");
  CHECK_RC(ts_vec_insert(&full, 0, &x, 8), TSHARE_E_TOO_LARGE, "insert past SIZE_MAX / 8");
  CHECK(full.items == NULL && full.len == SIZE_MAX / 8);

  /* Elements so large that two of them overflow. */
  ts_vec big = {0};
  CHECK_RC(ts_vec_reserve(&big, 2, SIZE_MAX / 2 + 1), TSHARE_E_TOO_LARGE, "2 x (SIZE_MAX/2 + 1)");
  CHECK_RC(ts_vec_reserve(&big, 1, 0), TSHARE_E_INVALID_ARG, "zero-sized elements");
  CHECK(big.items == NULL && big.cap == 0);
}

TS_TEST(insert_and_remove_keep_the_order) {
  id_vec v = {0};
  for (uint64_t i = 0; i < 10; i++) CHECK_RC(id_vec_push(&v, i * 10), TSHARE_OK, "push");
  CHECK_RC(id_vec_insert(&v, 3, 25), TSHARE_OK, "insert in the middle");
  CHECK_RC(id_vec_insert(&v, 0, 1), TSHARE_OK, "insert at the front");
  CHECK_RC(id_vec_insert(&v, v.len, 999), TSHARE_OK, "insert at the end");
  CHECK_RC(id_vec_insert(&v, v.len + 1, 5), TSHARE_E_INVALID_ARG, "insert past the end");
  const uint64_t want[] = {1, 0, 10, 20, 25, 30, 40, 50, 60, 70, 80, 90, 999};
  CHECK_EQ(v.len, sizeof want / sizeof *want);
  for (size_t i = 0; i < v.len; i++) CHECK_EQ(v.items[i], want[i]);

  id_vec_remove(&v, 0, 2); /* consumed from the front, like a queue */
  id_vec_remove(&v, 2, 1); /* the 25 */
  id_vec_remove(&v, 8, 100); /* past the end: cut at len */
  id_vec_remove(&v, 50, 1);  /* wholly past the end: nothing */
  const uint64_t left[] = {10, 20, 30, 40, 50, 60, 70, 80};
  CHECK_EQ(v.len, sizeof left / sizeof *left);
  for (size_t i = 0; i < v.len; i++) CHECK_EQ(v.items[i], left[i]);
  id_vec_free(&v);
}

TS_TEST(free_leaves_an_empty_reusable_vector) {
  id_vec v = {0};
  id_vec_free(&v); /* freeing an empty one is fine */
  for (int round = 0; round < 2; round++) {
    for (uint64_t i = 0; i < 40; i++) CHECK_RC(id_vec_push(&v, i), TSHARE_OK, "push");
    CHECK_EQ(v.items[39], 39);
    id_vec_free(&v);
    CHECK(v.items == NULL && v.len == 0 && v.cap == 0);
  }
}

TS_TEST_MAIN
