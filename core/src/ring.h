/* A single-producer/single-consumer byte ring in memory two processes map:
 * the ring transport's fast path (transport_ring.c). Each end creates the ring it
 * writes into (a sealed memfd, passed over the socket during the hello) and
 * maps the one its peer writes into.
 *
 * The peer can write anything into either ring at any time, so nothing read
 * from shared memory is trusted: each end keeps its own copy of the index it
 * owns and only publishes it; the peer's index is read once per call and
 * must lie between what was last seen and the ring's capacity, else the call
 * fails with TS_RING_CORRUPT. Bytes are copied out before anyone decodes
 * them (transport_ring.c feeds them to the same decoder that checks socket frames).
 *
 * Waiting: the reader of a ring sleeps on that ring's bell (a shared futex
 * word) after saying so in reader_waits; the writer rings the bell only when
 * it was told to, so a busy reader costs the writer no system call. */
#ifndef TSHARE_RING_H
#define TSHARE_RING_H

#include "conn_status.h" /* TS_RING_CORRUPT */

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TS_RING_CAP_DEFAULT (1u << 20) /* bytes per direction: ~5,000 share frames in flight */
#define TS_RING_CAP_MIN (1u << 12)     /* at least one frame of TSHARE_WIRE_FRAME_MAX */
#define TS_RING_CAP_MAX (1u << 26)
#define TS_RING_HEADER 4096 /* the control page before the data */

/* What a waiting end asks of the other in reader_waits / writer_waits. */
#define TS_RING_AWAKE 0  /* nothing: it looks again on its own */
#define TS_RING_FUTEX 1  /* it sleeps on the bell: bump it and FUTEX_WAKE */
#define TS_RING_SOCKET 2 /* it sleeps in poll() on the socket: send a nudge frame there */

/* reader_waits_own before the reader first writes it: a reader that only
 * knows the first layout never does, and its writer reads reader_waits. */
#define TS_RING_WAITS_UNUSED UINT32_MAX

/* The control page. Each line is written by one end only (by rule: a
 * hostile peer may write all of them). Where the words lie is shared with
 * peers of earlier versions: words are only ever added after the last.
 *
 * Per frame the writer stores tail and reads how the reader waits; the
 * reader loads tail and stores head. So head (stored by the reader per
 * read) and the reader's waiting word (read by the writer per write) must
 * not share a line, or every frame moves that line across: the reader keeps
 * its word on a line of its own (reader_waits_own) and mirrors it into
 * reader_waits, the word of the first layout, for writers that read that
 * one. The writer reads head only when the room it last saw runs out. */
typedef struct ts_ring_ctl {
  _Alignas(64) _Atomic uint64_t tail;     /* bytes ever written (the writer's) */
  _Atomic uint32_t writer_waits;          /* TS_RING_AWAKE or TS_RING_SOCKET (the writer's) */
  _Alignas(64) _Atomic uint64_t head;     /* bytes ever consumed (the reader's) */
  _Atomic uint32_t reader_waits;          /* TS_RING_* (the reader's; TS_RING_SOCKET from creation) */
  _Alignas(64) _Atomic uint32_t bell;     /* the reader's futex word: bumped by whoever wakes it */
  _Alignas(64) _Atomic uint32_t reader_waits_own; /* reader_waits on its own line; TS_RING_WAITS_UNUSED from creation */
} ts_ring_ctl;

typedef struct ts_ring {
  ts_ring_ctl *ctl; /* NULL: no ring */
  uint8_t *data;
  size_t map_len;
  uint64_t cap;  /* power of two */
  uint64_t mine; /* our index: tail for the ring we write, head for the one we read */
  uint64_t seen; /* the peer's index as last read and accepted */
} ts_ring;

/* A new ring of cap bytes (a power of two within the bounds) to write into;
 * *memfd gets its sealed memfd for the peer (the caller closes it). */
int ts_ring_create(ts_ring *r, uint32_t cap, int *memfd, char *err, size_t err_cap);
/* Map the peer's ring (its memfd, cap as its setup frame said) to read from,
 * after checking that it is a memfd sealed against shrinking, of the size
 * that cap implies. The caller keeps fd. */
int ts_ring_attach(ts_ring *r, int fd, uint32_t cap, char *err, size_t err_cap);
void ts_ring_unmap(ts_ring *r);

/* Writer: append len bytes whole (1), or nothing when there is no room (0),
 * or TS_RING_CORRUPT. Publishes them to the reader. The reader's head is
 * read (and checked) only when the room seen at the last read is too small. */
int ts_ring_write(ts_ring *r, const void *buf, size_t len);
/* Writer: whether len bytes would fit now (1/0, or TS_RING_CORRUPT). */
int ts_ring_room(ts_ring *r, size_t len);
/* Writer, to build bytes in place: *slot gets where the next bytes go and
 * the result is how many fit there in one piece (up to the ring's end; 0
 * when full), or TS_RING_CORRUPT. The head is read again only when fewer
 * than want bytes were free at the last read. ts_ring_publish(r, len), len
 * at most that count, hands them to the reader. The peer may scribble on
 * the slot meanwhile: write there, never read back. */
long ts_ring_slot(ts_ring *r, size_t want, uint8_t **slot);
void ts_ring_publish(ts_ring *r, size_t len);

/* Reader: copy up to cap bytes out; the count, or TS_RING_CORRUPT. */
long ts_ring_read(ts_ring *r, void *buf, size_t cap);
/* Reader: bytes waiting (0 when none), or TS_RING_CORRUPT. */
long ts_ring_available(ts_ring *r);

/* After publishing (a write, or a read), what the end waiting on the other
 * side asked for (TS_RING_AWAKE, _FUTEX or _SOCKET), cleared so that one
 * sleep costs one wake-up. For TS_RING_FUTEX, wake_reader rang the bell. A
 * writer only ever waits in poll() (a full ring is the slow path). */
int ts_ring_wake_reader(ts_ring *r);
int ts_ring_wake_writer(ts_ring *r);
/* Say how this end is about to wait; then look again before sleeping. */
void ts_ring_reader_waits(ts_ring *r, int how);
void ts_ring_writer_waits(ts_ring *r, int how);

/* Writer: whether the ring's reader (the peer, for the ring this end writes)
 * said it sleeps (TS_RING_FUTEX or TS_RING_SOCKET in reader_waits): then it
 * waits for what this end sends, and a receive here has nothing to spin
 * for. Only a hint, like every word the peer writes; every version of the
 * ring keeps it current, so it needs no new field. */
static inline bool ts_ring_reader_asleep(const ts_ring *r) {
  uint32_t how = atomic_load_explicit(&r->ctl->reader_waits_own, memory_order_relaxed);
  if (how == TS_RING_WAITS_UNUSED) how = atomic_load_explicit(&r->ctl->reader_waits, memory_order_relaxed);
  return how != TS_RING_AWAKE;
}

/* Reader: what this end last said in reader_waits (TS_RING_*). */
static inline uint32_t ts_ring_reader_said(const ts_ring *r) {
  uint32_t how = atomic_load_explicit(&r->ctl->reader_waits_own, memory_order_relaxed);
  return how == TS_RING_WAITS_UNUSED ? atomic_load_explicit(&r->ctl->reader_waits, memory_order_relaxed) : how;
}

/* The bell: ring it (any thread, any process), or sleep on it while it still
 * reads `seen` (at most timeout_us; spurious returns are fine). */
void ts_ring_ring_bell(ts_ring *r);
void ts_ring_sleep(ts_ring *r, uint32_t seen, long timeout_us);

static inline void ts_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

#endif
