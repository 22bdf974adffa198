/* Spare blocks: see spare_blocks.h for why. */
#include "spare_blocks.h"

#include <stdalign.h>
#include <stdlib.h>

/* Each block starts with its usable size; the caller's bytes follow,
 * aligned as malloc's are. */
typedef struct block_head {
  alignas(max_align_t) size_t size;
} block_head;

/* A spare block this much bigger than asked for is freed rather than kept
 * busy: a cache that once served a huge set would pin that memory. */
#define WASTE_FACTOR 4

void *ts_spare_alloc(ts_spare_blocks *c, size_t size) {
  for (int i = 0; i < TS_SPARE_SLOTS; i++) {
    if (!atomic_load_explicit(&c->slot[i], memory_order_relaxed)) continue;
    block_head *h = atomic_exchange_explicit(&c->slot[i], NULL, memory_order_acquire);
    if (!h) continue; /* another thread took it */
    if (h->size >= size && h->size / WASTE_FACTOR <= size) return h + 1;
    free(h);
  }
  if (size > (size_t)-1 - sizeof(block_head)) return NULL;
  block_head *h = malloc(sizeof *h + size);
  if (!h) return NULL;
  h->size = size;
  return h + 1;
}

void ts_spare_free(ts_spare_blocks *c, void *p) {
  if (!p) return;
  block_head *h = (block_head *)p - 1;
  for (int i = 0; i < TS_SPARE_SLOTS; i++) {
    void *empty = NULL;
    if (atomic_compare_exchange_strong_explicit(&c->slot[i], &empty, h, memory_order_release, memory_order_relaxed))
      return;
  }
  free(h);
}
