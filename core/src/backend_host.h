/* The host backend's own declarations, shared by its files (backend_host.c,
 * backend_host_buffer.c). */
#ifndef TSHARE_BACKEND_HOST_H
#define TSHARE_BACKEND_HOST_H

#include "session.h"

#include <stddef.h>
#include <stdint.h>

/* One mapped allocation on the consumer side: a view's `memory`. */
typedef struct ts_mapping {
  uint64_t alloc_id;
  void *base;
  size_t size;
  unsigned long ino, dev; /* of the memfd: a reused alloc_id cannot alias another file */
  size_t views;           /* live views into it */
  int fd;                 /* the memfd, kept so views can be shared on */
  uint64_t forward_id;    /* this process's alloc id for it when shared on */
} ts_mapping;

extern const ts_backend ts_host_backend;

/* backend_host_buffer.c: references held by shares */
struct tshare_host_buffer;
uint64_t ts_host_next_alloc_id(void); /* host allocation ids, unique in the process */
void ts_host_buffer_retain(struct tshare_host_buffer *buf);
void ts_host_buffer_release(void *buf);

/* backend_host.c: a forked child lets go of one view of its copy of mapping m (the last one
 * unmaps it), touching nothing its parent uses. */
void ts_host_drop_mapping_in_child(tshare_channel *ch, ts_mapping *m);

#endif
