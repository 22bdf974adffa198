/* Internal open-addressing hash map from nonzero uint64 keys to pointers.
 * Used for share ids (exports) and allocation ids (imports), where a stream
 * may keep thousands of entries live and every release is a lookup. */
#ifndef TSHARE_U64MAP_H
#define TSHARE_U64MAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct ts_u64map {
  uint64_t *keys; /* 0 = empty slot, UINT64_MAX = deleted */
  void **values;
  size_t cap; /* power of two or 0 */
  size_t count;
  size_t used; /* live + deleted slots */
} ts_u64map;

void ts_u64map_free(ts_u64map *m);
void *ts_u64map_get(const ts_u64map *m, uint64_t key);
int ts_u64map_put(ts_u64map *m, uint64_t key, void *value); /* 0 ok, -1 out of memory */
void *ts_u64map_remove(ts_u64map *m, uint64_t key);         /* the removed value or NULL */
/* Change the value of a key that is there; never allocates. -1 if absent. */
int ts_u64map_replace(ts_u64map *m, uint64_t key, void *value);

/* Iterate: for (size_t i = 0; ts_u64map_next(m, &i, &k, &v);) */
int ts_u64map_next(const ts_u64map *m, size_t *pos, uint64_t *key, void **value);

#endif
