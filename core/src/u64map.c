#include "u64map.h"

#include <stdlib.h>
#include <string.h>

#define EMPTY 0
#define DELETED UINT64_MAX

static size_t slot_of(uint64_t key, size_t cap) {
  key ^= key >> 33; /* fmix64 from MurmurHash3: ids are sequential, spread them */
  key *= 0xff51afd7ed558ccdULL;
  key ^= key >> 33;
  return (size_t)key & (cap - 1);
}

void ts_u64map_free(ts_u64map *m) {
  free(m->keys);
  free(m->values);
  m->keys = NULL;
  m->values = NULL;
  m->cap = m->count = m->used = 0;
}

void *ts_u64map_get(const ts_u64map *m, uint64_t key) {
  if (m->cap == 0 || key == EMPTY || key == DELETED) return NULL;
  for (size_t i = slot_of(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
    if (m->keys[i] == key) return m->values[i];
    if (m->keys[i] == EMPTY) return NULL;
  }
}

static int grow(ts_u64map *m) {
  size_t cap = m->cap ? m->cap * 2 : 16;
  if (m->count * 4 < m->cap) cap = m->cap; /* mostly tombstones: rehash in place size */
  uint64_t *keys = calloc(cap, sizeof *keys);
  void **values = calloc(cap, sizeof *values);
  if (!keys || !values) {
    free(keys);
    free(values);
    return -1;
  }
  for (size_t i = 0; i < m->cap; i++) {
    uint64_t k = m->keys[i];
    if (k == EMPTY || k == DELETED) continue;
    size_t j = slot_of(k, cap);
    while (keys[j] != EMPTY) j = (j + 1) & (cap - 1);
    keys[j] = k;
    values[j] = m->values[i];
  }
  free(m->keys);
  free(m->values);
  m->keys = keys;
  m->values = values;
  m->cap = cap;
  m->used = m->count;
  return 0;
}

int ts_u64map_replace(ts_u64map *m, uint64_t key, void *value) {
  if (m->cap == 0 || key == EMPTY || key == DELETED) return -1;
  for (size_t i = slot_of(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
    if (m->keys[i] == key) {
      m->values[i] = value;
      return 0;
    }
    if (m->keys[i] == EMPTY) return -1;
  }
}

int ts_u64map_put(ts_u64map *m, uint64_t key, void *value) {
  if (key == EMPTY || key == DELETED) return -1;
  if ((m->used + 1) * 4 > m->cap * 3 && grow(m) != 0) return -1;
  size_t tomb = SIZE_MAX;
  for (size_t i = slot_of(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
    if (m->keys[i] == key) {
      m->values[i] = value;
      return 0;
    }
    if (m->keys[i] == DELETED && tomb == SIZE_MAX) tomb = i;
    if (m->keys[i] == EMPTY) {
      if (tomb != SIZE_MAX)
        i = tomb;
      else
        m->used++;
      m->keys[i] = key;
      m->values[i] = value;
      m->count++;
      return 0;
    }
  }
}

void *ts_u64map_remove(ts_u64map *m, uint64_t key) {
  if (m->cap == 0 || key == EMPTY || key == DELETED) return NULL;
  for (size_t i = slot_of(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
    if (m->keys[i] == key) {
      void *v = m->values[i];
      m->keys[i] = DELETED;
      m->values[i] = NULL;
      m->count--;
      return v;
    }
    if (m->keys[i] == EMPTY) return NULL;
  }
}

int ts_u64map_next(const ts_u64map *m, size_t *pos, uint64_t *key, void **value) {
  for (; *pos < m->cap; (*pos)++) {
    uint64_t k = m->keys[*pos];
    if (k != EMPTY && k != DELETED) {
      if (key) *key = k;
      if (value) *value = m->values[*pos];
      (*pos)++;
      return 1;
    }
  }
  return 0;
}

