#include "tshare/hostmem.h"

#include "backend_host.h"
#include "error_detail.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

struct tshare_host_buffer {
  atomic_size_t refs;        /* creator + outstanding shares + lending channels */
  atomic_size_t outstanding; /* shares not yet released */
  atomic_size_t lent;        /* channels whose peer may keep it mapped (backend_host_keep.c) */
  int fd;
  void *data;
  size_t size;
  uint64_t id;
  bool unsealed;          /* a wrapped file that can be shrunk (TSHARE_MEM_HOST_FD) */
  bool foreign_mapping;   /* data is the wrapper's mapping: not ours to unmap */
  void (*on_last)(void *); /* a wrapped file's owner hears when the last reference went */
  void *on_last_ctx;
};

/* Allocation ids only need to be unique within this process; a counter is the
 * cheapest such identity and is never reused, unlike addresses or inodes. */
static atomic_uint_fast64_t next_buffer_id = 1;

uint64_t ts_host_next_alloc_id(void) { return atomic_fetch_add(&next_buffer_id, 1); }

/* Bumped whenever a buffer is left with only its lending channels'
 * references: those channels then retire it, and look only when this moved. */
static atomic_uint_fast64_t unused_generation;

uint64_t ts_host_buffers_unused_generation(void) { return atomic_load(&unused_generation); }

/* A new buffer's identity and counts, once its memory is in place. */
static int buffer_ready(tshare_host_buffer *b, tshare_host_buffer **out, tshare_error *err) {
  b->id = ts_host_next_alloc_id();
  atomic_init(&b->refs, 1);
  atomic_init(&b->outstanding, 0);
  atomic_init(&b->lent, 0);
  ts_error_fill(err, TSHARE_OK, "");
  *out = b;
  return TSHARE_OK;
}

int tshare_host_buffer_create(size_t size, const char *name, tshare_host_buffer **out, tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX];
  if (!out) return TSHARE_E_INVALID_ARG;
  *out = NULL;
  long page = sysconf(_SC_PAGESIZE);
  size_t rounded = size == 0 ? (size_t)page : (size + (size_t)page - 1) / (size_t)page * (size_t)page;
  if (rounded < size || rounded > ((size_t)1 << 48)) {
    ts_error_fill(err, ts_errf(msg, sizeof msg, TSHARE_E_TOO_LARGE, "host buffer: size %zu too large", size), msg);
    return TSHARE_E_TOO_LARGE;
  }
  tshare_host_buffer *b = calloc(1, sizeof *b);
  if (!b) {
    ts_error_fill(err, TSHARE_E_NOMEM, "host buffer: out of memory");
    return TSHARE_E_NOMEM;
  }
  int rc = TSHARE_OK;
  b->fd = memfd_create(name ? name : "tshare", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (b->fd < 0)
    rc = ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "host buffer: memfd_create");
  else if (ftruncate(b->fd, (off_t)rounded) != 0)
    rc = ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "host buffer: ftruncate(%zu)", rounded);
  /* Sealed so no process holding the fd can shrink it under another's mapping. */
  else if (fcntl(b->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    rc = ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "host buffer: F_ADD_SEALS");
  else {
    b->data = mmap(NULL, rounded, PROT_READ | PROT_WRITE, MAP_SHARED, b->fd, 0);
    if (b->data == MAP_FAILED) {
      b->data = NULL;
      rc = ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "host buffer: mmap(%zu)", rounded);
    }
  }
  if (rc != TSHARE_OK) {
    if (b->fd >= 0) close(b->fd);
    free(b);
    ts_error_fill(err, rc, msg);
    return rc;
  }
  b->size = rounded;
  return buffer_ready(b, out, err);
}

/* The checks a wrapped fd passes: a regular file (tmpfs, /dev/shm, memfd)
 * of at least size bytes. Anything else (a pipe, a socket, a device) could
 * not be mapped by a consumer the way the producer does. */
static int check_wrappable(int fd, size_t size, bool *unsealed, char *msg, size_t cap) {
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) return ts_errsys(msg, cap, TSHARE_E_INVALID_ARG, errno, "host buffer: fstat(fd %d)", fd);
  if (!S_ISREG(st.st_mode))
    return ts_errf(msg, cap, TSHARE_E_INVALID_ARG, "host buffer: fd %d is not a regular file (a pipe, socket or device)",
                   fd);
  if (size == 0 || (uint64_t)st.st_size < size)
    return ts_errf(msg, cap, TSHARE_E_OUT_OF_BOUNDS, "host buffer: fd %d has %lld bytes, %zu claimed", fd,
                   (long long)st.st_size, size);
  int seals = fcntl(fd, F_GET_SEALS);
  *unsealed = seals < 0 || !(seals & F_SEAL_SHRINK);
  return TSHARE_OK;
}

int tshare_host_buffer_wrap_fd(int fd, size_t size, void *data, void (*on_last)(void *ctx), void *ctx,
                               tshare_host_buffer **out, tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX];
  if (!out) return TSHARE_E_INVALID_ARG;
  *out = NULL;
  bool unsealed = true;
  int rc = check_wrappable(fd, size, &unsealed, msg, sizeof msg);
  tshare_host_buffer *b = rc == TSHARE_OK ? calloc(1, sizeof *b) : NULL;
  if (rc == TSHARE_OK && !b) rc = ts_errf(msg, sizeof msg, TSHARE_E_NOMEM, "host buffer: out of memory");
  if (rc == TSHARE_OK) {
    b->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (b->fd < 0) rc = ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "host buffer: dup(fd %d)", fd);
  }
  if (rc == TSHARE_OK && !data) {
    b->data = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, b->fd, 0);
    if (b->data == MAP_FAILED) {
      b->data = NULL;
      rc = ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "host buffer: mmap(%zu)", size);
    }
  }
  if (rc != TSHARE_OK) {
    if (b && b->fd >= 0) close(b->fd);
    free(b);
    ts_error_fill(err, rc, msg);
    return rc;
  }
  if (data) b->data = data, b->foreign_mapping = true;
  b->size = size;
  b->unsealed = unsealed;
  b->on_last = on_last;
  b->on_last_ctx = ctx;
  return buffer_ready(b, out, err);
}

bool ts_host_buffer_unsealed(const tshare_host_buffer *b) { return b->unsealed; }
int tshare_host_buffer_is_sealed(const tshare_host_buffer *b) { return b && !b->unsealed; }

void *tshare_host_buffer_data(const tshare_host_buffer *b) { return b ? b->data : NULL; }
size_t tshare_host_buffer_size(const tshare_host_buffer *b) { return b ? b->size : 0; }
uint64_t tshare_host_buffer_id(const tshare_host_buffer *b) { return b ? b->id : 0; }
int tshare_host_buffer_fd(const tshare_host_buffer *b) { return b ? b->fd : -1; }
size_t tshare_host_buffer_outstanding(const tshare_host_buffer *b) { return b ? atomic_load(&b->outstanding) : 0; }

static void unref(tshare_host_buffer *b) {
  /* Read while this reference still holds b: another thread's may be the
   * last, and free it, as soon as this one is let go. */
  size_t lent = atomic_load(&b->lent);
  size_t left = atomic_fetch_sub(&b->refs, 1) - 1;
  if (left != 0) {
    if (left == lent) atomic_fetch_add(&unused_generation, 1);
    return;
  }
  if (!b->foreign_mapping && b->data) munmap(b->data, b->size);
  close(b->fd);
  if (b->on_last) b->on_last(b->on_last_ctx);
  free(b);
}

void ts_host_buffer_retain(tshare_host_buffer *b) {
  atomic_fetch_add(&b->refs, 1);
  atomic_fetch_add(&b->outstanding, 1);
}

void ts_host_buffer_release(void *owner) {
  tshare_host_buffer *b = owner;
  atomic_fetch_sub(&b->outstanding, 1);
  unref(b);
}

void ts_host_buffer_lend(tshare_host_buffer *b) {
  atomic_fetch_add(&b->refs, 1);
  atomic_fetch_add(&b->lent, 1);
}

void ts_host_buffer_lend_end(tshare_host_buffer *b) {
  atomic_fetch_sub(&b->lent, 1);
  unref(b);
}

bool ts_host_buffer_only_lent(const tshare_host_buffer *b) {
  return atomic_load(&b->refs) == atomic_load(&b->lent);
}

bool ts_host_buffer_held_by_others(const tshare_host_buffer *b) { return atomic_load(&b->refs) > 1; }

bool ts_host_buffer_only_lent_but_one(const tshare_host_buffer *b) {
  return atomic_load(&b->refs) == atomic_load(&b->lent) + 1;
}

void tshare_host_buffer_destroy(tshare_host_buffer *b) {
  if (b) unref(b);
}
