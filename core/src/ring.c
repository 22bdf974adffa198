/* The shared-memory byte ring: see ring.h for what is trusted and why. */
#include "ring.h"

#include "error_detail.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

_Static_assert(sizeof(ts_ring_ctl) <= TS_RING_HEADER, "the control page holds the ring's header");
/* Where each word lies is shared with peers of earlier versions. */
_Static_assert(offsetof(ts_ring_ctl, tail) == 0 && offsetof(ts_ring_ctl, writer_waits) == 8 &&
                   offsetof(ts_ring_ctl, head) == 64 && offsetof(ts_ring_ctl, reader_waits) == 72 &&
                   offsetof(ts_ring_ctl, bell) == 128 && offsetof(ts_ring_ctl, reader_waits_own) == 192,
               "the control page's layout");

static bool cap_ok(uint64_t cap) { return cap >= TS_RING_CAP_MIN && cap <= TS_RING_CAP_MAX && (cap & (cap - 1)) == 0; }

static int map_ring(ts_ring *r, int fd, uint32_t cap, char *err, size_t err_cap) {
  size_t len = TS_RING_HEADER + (size_t)cap;
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return ts_errsys(err, err_cap, TSHARE_E_SYSTEM, errno, "ring: mmap of %zu bytes", len);
  memset(r, 0, sizeof *r);
  r->ctl = p;
  r->data = (uint8_t *)p + TS_RING_HEADER;
  r->map_len = len;
  r->cap = cap;
  return TSHARE_OK;
}

int ts_ring_create(ts_ring *r, uint32_t cap, int *memfd, char *err, size_t err_cap) {
  *memfd = -1;
  memset(r, 0, sizeof *r);
  if (!cap_ok(cap)) return ts_errf(err, err_cap, TSHARE_E_INVALID_ARG, "ring: capacity %u is not a power of two in range", cap);
  int fd = memfd_create("tshare-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return ts_errsys(err, err_cap, TSHARE_E_SYSTEM, errno, "ring: memfd_create");
  /* Sealed against shrinking: a peer that truncated the file would turn the
   * other end's next access into SIGBUS. */
  if (ftruncate(fd, (off_t)(TS_RING_HEADER + (size_t)cap)) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    int rc = ts_errsys(err, err_cap, TSHARE_E_SYSTEM, errno, "ring: sizing and sealing the memfd");
    close(fd);
    return rc;
  }
  int rc = map_ring(r, fd, cap, err, err_cap);
  if (rc != TSHARE_OK) {
    close(fd);
    return rc;
  }
  /* The reader has not said how it waits yet: until it does, every frame
   * also nudges the socket, so that a poll loop started on the reader's side
   * as its channel opens wakes for frames written before it could ask. */
  atomic_store_explicit(&r->ctl->reader_waits, TS_RING_SOCKET, memory_order_relaxed);
  atomic_store_explicit(&r->ctl->reader_waits_own, TS_RING_WAITS_UNUSED, memory_order_relaxed);
  *memfd = fd;
  return TSHARE_OK;
}

int ts_ring_attach(ts_ring *r, int fd, uint32_t cap, char *err, size_t err_cap) {
  memset(r, 0, sizeof *r);
  if (!cap_ok(cap))
    return ts_errf(err, err_cap, TSHARE_E_PROTOCOL, "ring: the peer's ring capacity %u is not a power of two in %u..%u",
                   cap, TS_RING_CAP_MIN, TS_RING_CAP_MAX);
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK))
    return ts_errf(err, err_cap, TSHARE_E_PROTOCOL, "ring: the peer's ring is not a memfd sealed against shrinking");
  struct stat st;
  if (fstat(fd, &st) != 0) return ts_errsys(err, err_cap, TSHARE_E_SYSTEM, errno, "ring: fstat");
  if ((uint64_t)st.st_size != TS_RING_HEADER + (uint64_t)cap)
    return ts_errf(err, err_cap, TSHARE_E_PROTOCOL, "ring: the peer's ring memfd holds %lld bytes, its capacity says %llu",
                   (long long)st.st_size, (unsigned long long)(TS_RING_HEADER + (uint64_t)cap));
  return map_ring(r, fd, cap, err, err_cap);
}

void ts_ring_unmap(ts_ring *r) {
  if (r->ctl) munmap(r->ctl, r->map_len);
  memset(r, 0, sizeof *r);
}

/* Writer: the reader's head, read once; it may only move forward, up to what
 * was written. Returns the bytes in use, or -1. */
static int64_t used_by_reader(ts_ring *r) {
  uint64_t h = atomic_load_explicit(&r->ctl->head, memory_order_acquire);
  if (h - r->seen > r->mine - r->seen) return -1;
  r->seen = h;
  return (int64_t)(r->mine - h);
}

int ts_ring_room(ts_ring *r, size_t len) {
  int64_t used = used_by_reader(r);
  if (used < 0) return TS_RING_CORRUPT;
  return r->cap - (uint64_t)used >= len;
}

long ts_ring_slot(ts_ring *r, size_t want, uint8_t **slot) {
  if (r->cap - (r->mine - r->seen) < want && used_by_reader(r) < 0) return TS_RING_CORRUPT;
  uint64_t off = r->mine & (r->cap - 1);
  uint64_t free_bytes = r->cap - (r->mine - r->seen), to_end = r->cap - off;
  *slot = r->data + off;
  return (long)(free_bytes < to_end ? free_bytes : to_end);
}

void ts_ring_publish(ts_ring *r, size_t len) {
  r->mine += len;
  atomic_store_explicit(&r->ctl->tail, r->mine, memory_order_release);
}

int ts_ring_write(ts_ring *r, const void *buf, size_t len) {
  /* The head can only have moved forward since it was seen: the room seen
   * then is there still, and reading head again would pull the reader's
   * line over for nothing. */
  if (r->cap - (r->mine - r->seen) < len) {
    int room = ts_ring_room(r, len);
    if (room <= 0) return room;
  }
  uint64_t off = r->mine & (r->cap - 1);
  size_t first = len < r->cap - off ? len : (size_t)(r->cap - off);
  memcpy(r->data + off, buf, first);
  memcpy(r->data, (const uint8_t *)buf + first, len - first);
  ts_ring_publish(r, len);
  return 1;
}

/* Reader: the writer's tail, read once; it may only move forward and never
 * more than the capacity past what was consumed. */
long ts_ring_available(ts_ring *r) {
  uint64_t t = atomic_load_explicit(&r->ctl->tail, memory_order_acquire);
  if (t - r->mine > r->cap || t - r->mine < r->seen - r->mine) return TS_RING_CORRUPT;
  r->seen = t;
  return (long)(t - r->mine);
}

long ts_ring_read(ts_ring *r, void *buf, size_t cap) {
  long avail = ts_ring_available(r);
  if (avail <= 0) return avail;
  size_t n = (size_t)avail < cap ? (size_t)avail : cap;
  uint64_t off = r->mine & (r->cap - 1);
  size_t first = n < r->cap - off ? n : (size_t)(r->cap - off);
  memcpy(buf, r->data + off, first);
  memcpy((uint8_t *)buf + first, r->data, n - first);
  r->mine += n;
  atomic_store_explicit(&r->ctl->head, r->mine, memory_order_release);
  return (long)n;
}

void ts_ring_reader_waits(ts_ring *r, int how) {
  /* Both words: the writer reads its own line's word once this end wrote
   * it, the first layout's word while it was never written. */
  atomic_store_explicit(&r->ctl->reader_waits_own, (uint32_t)how, memory_order_relaxed);
  atomic_store_explicit(&r->ctl->reader_waits, (uint32_t)how, memory_order_relaxed);
  atomic_thread_fence(memory_order_seq_cst); /* then look at the tail again: see ts_ring_wake_reader */
}

void ts_ring_writer_waits(ts_ring *r, int how) {
  atomic_store_explicit(&r->ctl->writer_waits, (uint32_t)how, memory_order_relaxed);
  atomic_thread_fence(memory_order_seq_cst);
}

/* The other half of the fence pair: a published index, then the waiter's
 * word. Either the waiter sees the index or this sees the word. */
int ts_ring_wake_reader(ts_ring *r) {
  atomic_thread_fence(memory_order_seq_cst);
  _Atomic uint32_t *word = &r->ctl->reader_waits_own;
  uint32_t how = atomic_load_explicit(word, memory_order_relaxed);
  if (how == TS_RING_WAITS_UNUSED) { /* a reader of the first layout, or one that has not said yet */
    word = &r->ctl->reader_waits;
    how = atomic_load_explicit(word, memory_order_relaxed);
  }
  if (how == TS_RING_AWAKE) return TS_RING_AWAKE;
  how = atomic_exchange_explicit(word, TS_RING_AWAKE, memory_order_relaxed);
  if (how == TS_RING_FUTEX) ts_ring_ring_bell(r);
  return how == TS_RING_FUTEX || how == TS_RING_SOCKET ? (int)how : TS_RING_AWAKE;
}

int ts_ring_wake_writer(ts_ring *r) {
  atomic_thread_fence(memory_order_seq_cst);
  if (atomic_load_explicit(&r->ctl->writer_waits, memory_order_relaxed) == TS_RING_AWAKE) return TS_RING_AWAKE;
  uint32_t how = atomic_exchange_explicit(&r->ctl->writer_waits, TS_RING_AWAKE, memory_order_relaxed);
  return how == TS_RING_SOCKET ? TS_RING_SOCKET : TS_RING_AWAKE;
}

void ts_ring_ring_bell(ts_ring *r) {
  atomic_fetch_add_explicit(&r->ctl->bell, 1, memory_order_release);
  /* Not FUTEX_PRIVATE: the sleeper is another process. */
  syscall(SYS_futex, (uint32_t *)&r->ctl->bell, FUTEX_WAKE, 1, NULL, NULL, 0);
}

void ts_ring_sleep(ts_ring *r, uint32_t seen, long timeout_us) {
  struct timespec ts = {.tv_sec = timeout_us / 1000000, .tv_nsec = (timeout_us % 1000000) * 1000};
  /* EAGAIN (the bell moved), EINTR, ETIMEDOUT: the caller looks again. */
  syscall(SYS_futex, (uint32_t *)&r->ctl->bell, FUTEX_WAIT, seen, &ts, NULL, 0);
}
