/* The internal hash map behind exports, host mappings and the CUDA import
 * cache: lookups, deletes (tombstones), growth, in-place replacement, and
 * iteration, against a plain array as the reference. */
#include "harness.h"
#include "u64map.h"

#include <stdint.h>

enum { N = 5000 };

static uint64_t key_at(int i) { return (uint64_t)i * UINT64_C(0x9e3779b97f4a7c15) | UINT64_C(1); } /* spread, never 0 */

TS_TEST(put_get_remove_against_a_reference) {
  ts_u64map m = {0};
  static int present[N];
  for (int i = 0; i < N; i++) {
    CHECK(ts_u64map_put(&m, key_at(i), &present[i]) == 0);
    present[i] = 1;
  }
  CHECK_EQ(m.count, N);
  /* Remove every third key, then put every sixth back: tombstones get reused. */
  for (int i = 0; i < N; i += 3) {
    CHECK(ts_u64map_remove(&m, key_at(i)) == &present[i]);
    present[i] = 0;
  }
  for (int i = 0; i < N; i += 6) {
    CHECK(ts_u64map_put(&m, key_at(i), &present[i]) == 0);
    present[i] = 1;
  }
  size_t expected = 0;
  for (int i = 0; i < N; i++) {
    expected += (size_t)present[i];
    void *v = ts_u64map_get(&m, key_at(i));
    if (present[i] ? v != &present[i] : v != NULL) TS_FAIL("key %d: got %p, present=%d", i, v, present[i]);
  }
  CHECK_EQ(m.count, expected);
  CHECK(ts_u64map_remove(&m, key_at(3)) == NULL); /* already gone */
  CHECK(ts_u64map_get(&m, 0) == NULL);
  CHECK(ts_u64map_put(&m, 0, present) == -1); /* reserved keys */
  CHECK(ts_u64map_put(&m, UINT64_MAX, present) == -1);
  ts_u64map_free(&m);
}

TS_TEST(replace_changes_only_a_present_key_and_never_grows) {
  ts_u64map m = {0};
  int a, b;
  CHECK(ts_u64map_replace(&m, 42, &a) == -1); /* empty map */
  for (int i = 1; i <= 12; i++) CHECK(ts_u64map_put(&m, (uint64_t)i, &a) == 0);
  size_t cap = m.cap, count = m.count, used = m.used;
  CHECK_EQ(cap, 16); /* a 13th key would grow it: put would, replace must not */
  CHECK(ts_u64map_replace(&m, 13, &b) == -1);
  CHECK(ts_u64map_get(&m, 13) == NULL);
  CHECK(ts_u64map_replace(&m, 7, &b) == 0);
  CHECK(ts_u64map_get(&m, 7) == &b);
  CHECK(m.cap == cap && m.count == count && m.used == used);
  CHECK(ts_u64map_remove(&m, 7) == &b);
  CHECK(ts_u64map_replace(&m, 7, &a) == -1); /* a tombstone is not a key */
  ts_u64map_free(&m);
}

TS_TEST(iteration_visits_each_live_key_once) {
  ts_u64map m = {0};
  static int seen[N];
  for (int i = 0; i < N; i++) CHECK(ts_u64map_put(&m, key_at(i), &seen[i]) == 0);
  for (int i = 0; i < N; i += 2) ts_u64map_remove(&m, key_at(i));
  uint64_t key;
  void *value;
  size_t visits = 0;
  for (size_t pos = 0; ts_u64map_next(&m, &pos, &key, &value);) {
    int i = (int)((int *)value - seen);
    CHECK(i >= 0 && i < N && i % 2 == 1 && key == key_at(i));
    seen[i]++;
    visits++;
  }
  CHECK_EQ(visits, N / 2);
  for (int i = 1; i < N; i += 2) CHECK_EQ(seen[i], 1);
  ts_u64map_free(&m);
}

TS_TEST_MAIN
