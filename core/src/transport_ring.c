/* The ring transport: see transport_ring.h. */
#include "transport_ring.h"

#include "error_detail.h"
#include "wire_checks.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void ring_spill_read(ts_conn *c);

/* ---- sending ------------------------------------------------------------- */

static int ring_corrupt(ts_conn *c, const char *which) {
  if (!c->broken)
    c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_PROTOCOL,
                        "peer %s corrupted the shared ring: its %s moved outside the ring", c->peer_label, which);
  return c->broken;
}

/* A ring frame (SOCKET_NEXT, NUDGE) encoded into buf (at ring setup). */
static size_t ring_op_frame(uint8_t *buf, size_t cap, uint8_t op) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RING;
  f.u.ring.op = op;
  size_t len = 0;
  char err[TSHARE_ERROR_MSG_MAX];
  (void)ts_wire_encode(&f, buf, cap, &len, err, sizeof err); /* cannot fail: a fixed, valid frame */
  return len;
}

/* The peer sleeps in poll() on its socket and asked to be told that the
 * ring moved: one small frame there, best effort (a full socket already
 * wakes it). Never waits; skipped while a cut frame's end is owed. */
static void nudge_peer(ts_conn *c, bool have_send_lock) {
  ts_ring_link *L = c->frame_data;
  if (!have_send_lock && pthread_mutex_trylock(&c->send_lock) != 0) return; /* lost: its waits are sliced */
  if (c->wfd >= 0 && !atomic_load(&c->tail_pending)) {
    size_t len = L->op_len;
    int saved_errno = errno;
    ssize_t r;
    while ((r = c->stream->write(c, L->nudge_frame, len, -1)) < 0 && errno == EINTR) {
    }
    if (r > 0 && (size_t)r < len) ts_conn_keep_tail(c, L->nudge_frame + r, len - (size_t)r);
    errno = saved_errno;
  }
  if (!have_send_lock) pthread_mutex_unlock(&c->send_lock);
}

/* After publishing into ring_out (send_lock held). */
static void wake_ring_reader(ts_conn *c) {
  ts_ring_link *L = c->frame_data;
  if (ts_ring_wake_reader(&L->out) == TS_RING_SOCKET) nudge_peer(c, true);
}

/* Look for a hang-up on the socket without reading it: a peer that died or
 * closed while this end only watched the ring. */
static bool socket_hung_up(ts_conn *c) {
  struct pollfd p = {.fd = c->rfd, .events = POLLRDHUP, .revents = 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR));
}

#define HANG_UP_ASKED_EVERY_US 1000

/* Whether the socket is due to be asked for a hang-up (*last: when it was
 * last asked), by the coarse clock: a frame's worth of time cheaper to read
 * than the precise one (clock.h). */
static bool hang_up_due(const int64_t *last) { return ts_coarse_now_us() - *last >= HANG_UP_ASKED_EVERY_US; }

/* The same, asked at most once a millisecond or a coarse clock tick (*last:
 * when it was last asked), so a stream of ring calls costs no system call. */
static bool socket_hung_up_lately(ts_conn *c, int64_t *last) {
  if (!hang_up_due(last)) return false;
  *last = ts_coarse_now_us();
  return socket_hung_up(c);
}

/* About to wait in poll() on the socket: take what is in the ring (the peer
 * may itself wait for room in it) and ask its writer to nudge the socket
 * from now on, then take again what came in between. */
static void wait_on_socket_too(ts_conn *c) {
  ts_ring_link *L = c->frame_data;
  ring_spill_read(c);
  ts_ring_reader_waits(&L->in, TS_RING_SOCKET);
  ring_spill_read(c);
}

/* The ring is full: the peer is not reading. Wait in poll() on the socket
 * for its nudge (it reads, or it writes to us: read that into the spill
 * buffers so two ends that both send keep going), in slices so a lost nudge
 * costs a slice, never a hang. Once the spill buffer is full the socket's
 * bytes stay there: the wait only watches for a hang-up and sleeps its
 * slices, however much the peer sends. */
#define RING_ROOM_SLICE_MS 10
static int wait_ring_room(ts_conn *c, size_t len, int64_t deadline) {
  ts_ring_link *L = c->frame_data;
  for (;;) {
    ts_ring_writer_waits(&L->out, TS_RING_SOCKET);
    wait_on_socket_too(c);
    int room = ts_ring_room(&L->out, len);
    int left = ts_remaining(deadline);
    int n = 0;
    bool can_read = ts_conn_spill_room(c) > 0;
    struct pollfd p = {.fd = c->rfd, .events = (short)((can_read ? POLLIN : 0) | POLLRDHUP), .revents = 0};
    if (room == 0 && left != 0) {
      n = poll(&p, 1, left < 0 || left > RING_ROOM_SLICE_MS ? RING_ROOM_SLICE_MS : left);
      if (n > 0 && can_read && (p.revents & POLLIN) && !(p.revents & (POLLHUP | POLLRDHUP | POLLERR)))
        ts_conn_spill_read(c);
    }
    ts_ring_writer_waits(&L->out, TS_RING_AWAKE);
    ts_ring_reader_waits(&L->in, TS_RING_AWAKE);
    if (room < 0) return ring_corrupt(c, "head");
    if (room > 0) return TSHARE_OK;
    if (n > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR))) return ts_conn_peer_closed(c, "send");
    if (n < 0 && errno != EINTR) return ts_errsys(c->err, c->err_cap, TSHARE_E_SYSTEM, errno, "poll (send)");
    if (ts_remaining(deadline) == 0)
      return ts_errf(c->err, c->err_cap, TSHARE_E_TIMEOUT, "send: timed out (peer %s does not empty its ring)",
                     c->peer_label);
  }
}

/* Frame bytes into the ring, whole (send_lock held), waiting for room. */
static int ring_put(ts_conn *c, const uint8_t *buf, size_t len, int64_t deadline) {
  ts_ring_link *L = c->frame_data;
  /* The ring stays mapped after the peer is gone: its socket says so. */
  if (socket_hung_up_lately(c, &L->hup_send_us)) return ts_conn_peer_closed(c, "send");
  for (;;) {
    if (c->broken) return c->broken;
    int w = ts_ring_write(&L->out, buf, len);
    if (w < 0) return ring_corrupt(c, "head");
    if (w > 0) {
      wake_ring_reader(c);
      return TSHARE_OK;
    }
    int rc = wait_ring_room(c, len, deadline);
    if (rc != TSHARE_OK) return rc;
  }
}

/* The SOCKET_NEXT entries owed for fd frames already on the socket. */
static int pay_markers_locked(ts_conn *c, int64_t deadline) {
  ts_ring_link *L = c->frame_data;
  while (L->markers_owed > 0) {
    int rc = ring_put(c, L->socket_next_frame, L->op_len, deadline);
    if (rc != TSHARE_OK) return rc;
    if (--L->markers_owed == 0) atomic_store(&c->owed_pending, false);
  }
  return TSHARE_OK;
}

/* A frame onto the ring transport (send_lock held, the tail flushed): fd
 * frames on the socket first, then their place in the ring, so a send that
 * times out on a full socket has sent nothing at all. */
static int ring_send_locked(ts_conn *c, const uint8_t *buf, size_t len, int fd, int64_t deadline) {
  ts_ring_link *L = c->frame_data;
  if (fd < 0) return ring_put(c, buf, len, deadline);
  int rc = ts_stream_send(c, buf, len, fd, deadline); /* OK also when its end waits in the tail */
  if (rc != TSHARE_OK) return rc;
  L->markers_owed++;
  atomic_store(&c->owed_pending, true);
  (void)pay_markers_locked(c, deadline); /* sent either way: the entry goes before anything else */
  return TSHARE_OK;
}

/* ---- receiving ----------------------------------------------------------- */

/* Ring bytes into the ring spill buffer (a send waits for room: the peer may
 * wait for room in our direction). The peer's writer is told if it waits. */
static void ring_spill_read(ts_conn *c) {
  ts_ring_link *L = c->frame_data;
  if (!ts_conn_uses_ring(c) || c->broken) return;
  if (!L->spill && !(L->spill = malloc(TS_SPILL_MAX))) return;
  if (L->spill_off == L->spill_len) L->spill_off = L->spill_len = 0;
  long n = ts_ring_read(&L->in, L->spill + L->spill_len, TS_SPILL_MAX - L->spill_len);
  if (n < 0) {
    (void)ring_corrupt(c, "tail");
    return;
  }
  L->spill_len += (size_t)n;
  if (n > 0 && ts_ring_wake_writer(&L->in) == TS_RING_SOCKET) nudge_peer(c, true);
}

/* Whether the ring may still hold the SOCKET_NEXT entry of the frame read
 * early: ring bytes not yet decoded (a partial frame in its decoder does not
 * count: the ring's writer publishes whole frames). */
static bool ring_may_hold_entry(ts_conn *c) {
  ts_ring_link *L = c->frame_data;
  return L->spill_off < L->spill_len || ts_ring_available(&L->in) != 0;
}

/* A frame read from the socket before its SOCKET_NEXT entry came: it waits
 * in `early`. A peer puts that entry into the ring before it sends anything
 * else but nudges on the socket, so a second one there while the ring holds
 * nothing that could be the first one's entry is the peer's fault. */
static void keep_early(ts_conn *c, const tshare_frame *f, ts_fd_entry e, bool found) {
  ts_ring_link *L = c->frame_data;
  if (!L->has_early) {
    L->early = *f;
    L->early_fd = e;
    L->early_found = found;
    L->has_early = true;
    return;
  }
  if (e.fd >= 0) close(e.fd);
  c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_PROTOCOL,
                      "receive: peer %s sent a %s frame on the socket before the ring entry of the %s frame it sent "
                      "there first",
                      c->peer_label, tshare_frame_type_name(f->type), tshare_frame_type_name(L->early.type));
}

enum { HUP_UNKNOWN = -1, HUP_NO = 0, HUP_YES = 1 };

/* Take the socket bytes already there, so that nudges stop making the fd
 * readable (a poll loop would spin on them). A real frame read early waits
 * for its SOCKET_NEXT entry; while it waits, the socket is still read (a
 * nudge behind it would keep the fd readable forever), unless the ring may
 * hold that entry: the caller takes the ring first. A hang-up is left for the
 * caller to see, after the ring is empty. Returns what its last look at the
 * socket said of a hang-up (HUP_UNKNOWN when it did not look), so a poll
 * loop's check asks the socket once. */
static int drain_nudges(ts_conn *c) {
  ts_ring_link *L = c->frame_data;
  int hup = HUP_UNKNOWN;
  while (!c->broken && !(L->has_early && ring_may_hold_entry(c))) {
    tshare_frame f;
    ts_fd_entry e;
    bool found;
    int rc = ts_stream_frame(c, &f, &e, &found, 0, false);
    if (rc == TSHARE_OK) {
      keep_early(c, &f, e, found);
      continue;
    }
    if (rc != TSHARE_AGAIN) return HUP_UNKNOWN;
    if (c->spill_off == c->spill_len) {
      struct pollfd p = {.fd = c->rfd, .events = POLLIN | POLLRDHUP, .revents = 0};
      int n = poll(&p, 1, 0);
      if (n < 0) return HUP_UNKNOWN;
      hup = n > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR)) ? HUP_YES : HUP_NO;
      if (hup == HUP_YES || !(p.revents & POLLIN)) return hup;
    }
    hup = HUP_UNKNOWN; /* bytes are read now: the next look says */
    if (ts_stream_fill(c, ts_deadline(0)) != TSHARE_OK) return HUP_UNKNOWN;
  }
  return hup;
}

#define RING_SLEEP_SLICE_US 100000 /* a sleeping receive looks for a hang-up this often */

#define SPIN_LOOK_EVERY 16 /* pauses between looks at the clock and at the peer (~1-3 us) */
#define SPIN_GAVE_UP 1     /* spin_on_ring: nothing came; sleep */

/* Spin on the ring for up to budget_ns (the policy says how long and when to
 * give up early), then tell the policy how it went. TSHARE_OK once bytes
 * came, TS_CONN_WOKEN, an error, or SPIN_GAVE_UP. The clock is first read
 * at the first look, not before the first pause: a frame caught within
 * SPIN_LOOK_EVERY pauses (most of them, where spinning pays) costs no clock
 * read, and the budget counts from there (its first pauses are free). */
static int spin_on_ring(ts_conn *c, uint32_t budget_ns) {
  ts_ring_link *L = c->frame_data;
  uint64_t start = 0, last = 0;
  for (unsigned i = 1;; i++) {
    if (ts_conn_take_woken(c)) return TS_CONN_WOKEN;
    long avail = ts_ring_available(&L->in);
    if (avail < 0) return ring_corrupt(c, "tail");
    if (avail > 0) {
      ts_spin_learn(&L->spin, TS_SPIN_CAUGHT);
      return TSHARE_OK;
    }
    ts_cpu_relax();
    if (i % SPIN_LOOK_EVERY != 0) continue;
    uint64_t now = ts_spin_clock_ns();
    if (i == SPIN_LOOK_EVERY) start = last = now;
    int why = ts_spin_should_stop(&L->spin, now - start, now - last, budget_ns, ts_ring_reader_asleep(&L->out));
    if (why != TS_SPIN_GOING) {
      ts_spin_learn(&L->spin, why);
      return SPIN_GAVE_UP;
    }
    last = now;
  }
}

/* Wait for bytes in the ring: spin while the policy says it can pay, then
 * sleep on the bell (in slices, asking the socket for a hang-up after each),
 * or return TS_CONN_WOKEN. With no time left, a poll loop's end asks for a
 * nudge. */
static int wait_ring(ts_conn *c, int64_t deadline) {
  ts_ring_link *L = c->frame_data;
  bool waits = ts_remaining(deadline) != 0;
  /* A receive that waits watches the ring itself: a nudge asked for by an
   * earlier look without waiting (a poll loop's, or the channel's start) is
   * withdrawn, or every frame would cost the peer a socket write, and the
   * peer, taking this end for asleep, would not spin for our answer. */
  if (waits && ts_ring_reader_said(&L->in) == TS_RING_SOCKET) ts_ring_reader_waits(&L->in, TS_RING_AWAKE);
  uint32_t budget = waits ? ts_spin_plan(&L->spin, ts_spin_cpus_milli(), ts_ring_reader_asleep(&L->out)) : 0;
  if (budget > 0) {
    int rc = spin_on_ring(c, budget);
    if (rc != SPIN_GAVE_UP) return rc;
  }
  for (;;) {
    if (ts_conn_take_woken(c)) return TS_CONN_WOKEN;
    long avail = ts_ring_available(&L->in);
    if (avail < 0) return ring_corrupt(c, "tail");
    if (avail > 0) return TSHARE_OK;
    ts_conn_try_flush(c); /* the peer may wait for the rest of an fd frame */
    int left = ts_remaining(deadline);
    if (left == 0) {
      int hup = HUP_UNKNOWN;
      if (atomic_load(&c->pollable)) { /* ask for a nudge, then look once more: no wake-up falls between */
        hup = drain_nudges(c);
        if (c->broken) return c->broken;
        ts_ring_reader_waits(&L->in, TS_RING_SOCKET);
        if ((avail = ts_ring_available(&L->in)) != 0) {
          ts_ring_reader_waits(&L->in, TS_RING_AWAKE);
          if (avail < 0) return ring_corrupt(c, "tail");
          return TSHARE_OK;
        }
      }
      /* Poll loops ask each time (their poll said POLLHUP), others at most once a millisecond. */
      bool hung_up = !atomic_load(&c->pollable) ? socket_hung_up_lately(c, &L->hup_recv_us)
                     : hup == HUP_UNKNOWN       ? socket_hung_up(c)
                                                : hup == HUP_YES;
      if (hung_up && ts_ring_available(&L->in) == 0) return c->broken = ts_conn_peer_closed(c, "receive");
      return ts_err_text(c->err, c->err_cap, TSHARE_E_TIMEOUT, "receive: timed out");
    }
    uint32_t seen = atomic_load_explicit(&L->in.ctl->bell, memory_order_acquire);
    pthread_mutex_lock(&c->wake_lock);
    bool woken = c->woken;
    c->waiting = !woken;
    pthread_mutex_unlock(&c->wake_lock);
    if (woken) continue; /* the loop's top takes it */
    ts_ring_reader_waits(&L->in, TS_RING_FUTEX);
    avail = ts_ring_available(&L->in);
    if (avail == 0) {
      long slice = atomic_load(&c->tail_pending) || atomic_load(&c->owed_pending) ? 1000 : RING_SLEEP_SLICE_US;
      if (left > 0 && (long)left * 1000 < slice) slice = (long)left * 1000;
      ts_ring_sleep(&L->in, seen, slice);
    }
    ts_ring_reader_waits(&L->in, TS_RING_AWAKE);
    pthread_mutex_lock(&c->wake_lock);
    c->waiting = false;
    pthread_mutex_unlock(&c->wake_lock);
    if (avail == 0 && ts_ring_available(&L->in) == 0 && socket_hung_up(c))
      return c->broken = ts_conn_peer_closed(c, "receive");
  }
}

/* A look follows: an ask for nudges left by an earlier look is withdrawn,
 * so the releases this end sends first, which may make the peer send at
 * once, do not cost it a socket write per frame (and this end a read of
 * each nudge). The look asks again if it finds nothing (wait_ring). */
static void ring_look_begins(ts_conn *c) {
  ts_ring_link *L = c->frame_data;
  if (ts_ring_reader_said(&L->in) == TS_RING_SOCKET) ts_ring_reader_waits(&L->in, TS_RING_AWAKE);
}

/* Ring bytes into the ring's decoder: from the spill first, else the ring. */
static int ring_fill(ts_conn *c, int64_t deadline) {
  ts_ring_link *L = c->frame_data;
  for (;;) {
    uint8_t *space;
    size_t cap;
    int rc = tshare_decoder_space(L->dec, &space, &cap);
    if (rc != TSHARE_OK) return ts_errf(c->err, c->err_cap, rc, "receive: %s", tshare_decoder_last_error(L->dec));
    if (L->spill_off < L->spill_len) {
      tshare_decoder_commit(L->dec, ts_take_spilled(L->spill, &L->spill_off, L->spill_len, space, cap));
      return TSHARE_OK;
    }
    long n = ts_ring_read(&L->in, space, cap); /* copied out: the peer cannot change what is decoded */
    if (n < 0) return ring_corrupt(c, "tail");
    if (n > 0) {
      tshare_decoder_commit(L->dec, (size_t)n);
      if (ts_ring_wake_writer(&L->in) == TS_RING_SOCKET) nudge_peer(c, false);
      return TSHARE_OK;
    }
    rc = wait_ring(c, deadline);
    if (rc != TSHARE_OK) return rc;
  }
}

/* The next frame: from the ring, or from the socket where the ring's
 * SOCKET_NEXT entry says the next one went there (an fd frame). */
static int ring_recv(ts_conn *c, tshare_frame *f, ts_fd_entry *e, bool *found, int64_t deadline) {
  ts_ring_link *L = c->frame_data;
  for (;;) {
    if (c->broken) return c->broken;
    if (L->socket_next) {
      int rc = TSHARE_OK;
      if (L->has_early) {
        *f = L->early;
        *e = L->early_fd;
        *found = L->early_found;
        L->has_early = false;
      } else {
        rc = ts_stream_frame(c, f, e, found, deadline, true);
      }
      if (rc == TSHARE_OK) L->socket_next = false;
      return rc;
    }
    int rc = ts_conn_decode(c, L->dec, ring_fill, " (ring)", f, deadline, true);
    if (rc != TSHARE_OK) return rc;
    if (f->type == TSHARE_FRAME_RING && f->u.ring.op == TSHARE_RING_SOCKET_NEXT) {
      L->socket_next = true;
      continue;
    }
    if (f->type == TSHARE_FRAME_RING || (f->flags & TSHARE_FRAME_FLAG_FD_ATTACHED))
      return c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_PROTOCOL,
                                 "receive: peer %s put a %s frame into the ring that does not belong there",
                                 c->peer_label, tshare_frame_type_name(f->type));
    *found = false;
    e->fd = -1;
    e->lost = 0;
    return TSHARE_OK;
  }
}

/* Both ends send the ring they will write into and map the other's. */
static int setup_link(ts_conn *c, uint32_t cap, int64_t deadline) {
  ts_ring_link *L = c->frame_data;
  int memfd = -1;
  int rc = ts_ring_create(&L->out, cap, &memfd, c->err, c->err_cap);
  tshare_frame f;
  memset(&f, 0, sizeof f);
  if (rc == TSHARE_OK) {
    f.type = TSHARE_FRAME_RING;
    f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
    f.u.ring.op = TSHARE_RING_SETUP;
    f.u.ring.capacity = cap;
    rc = ts_conn_send(c, &f, memfd, ts_remaining(deadline));
    close(memfd);
  }
  if (rc != TSHARE_OK) {
    ts_conn_send_error(c, rc, c->err);
    return rc;
  }
  ts_fd_entry e = {.fd = -1, .lost = 0, .at = 0, .last = 0};
  bool found = false;
  c->in_setup = true;
  while ((rc = ts_stream_frame(c, &f, &e, &found, deadline, true)) == TS_CONN_WOKEN) {
  }
  c->in_setup = false;
  if (rc != TSHARE_OK) {
    char why[TSHARE_ERROR_MSG_MAX];
    snprintf(why, sizeof why, "%s", c->err);
    return ts_errf(c->err, c->err_cap, rc, "ring setup: %s", why);
  }
  if (f.type == TSHARE_FRAME_ERROR) {
    if (e.fd >= 0) close(e.fd);
    return ts_errf(c->err, c->err_cap, TSHARE_E_PEER_ERROR, "ring setup: peer refused the channel: %s (%s)",
                   f.u.error.message, tshare_status_name(f.u.error.code));
  }
  if (f.type != TSHARE_FRAME_RING || !found || e.fd < 0) {
    if (e.fd >= 0) close(e.fd);
    if (found && e.lost)
      rc = ts_errf(c->err, c->err_cap, TSHARE_E_LIMIT, "ring setup: the peer's ring could not be received: %s",
                   e.lost == TS_FD_OVER_BUDGET ? "the channel holds its fd budget" : strerror(e.lost));
    else
      rc = ts_errf(c->err, c->err_cap, TSHARE_E_PROTOCOL, "ring setup: expected the peer's ring, got a %s frame%s",
                   tshare_frame_type_name(f.type), found ? "" : " without an fd");
  } else {
    rc = ts_ring_attach(&L->in, e.fd, f.u.ring.capacity, c->err, c->err_cap);
    close(e.fd);
    if (rc == TSHARE_OK && !(L->dec = tshare_decoder_create(&c->limits)))
      rc = ts_errf(c->err, c->err_cap, TSHARE_E_NOMEM, "ring setup: out of memory");
    if (rc != TSHARE_OK) ts_ring_unmap(&L->in);
  }
  if (rc != TSHARE_OK) {
    ts_conn_send_error(c, rc, c->err);
    return rc;
  }
  ts_spin_init(&L->spin, c->spin_us);
  ts_spin_refresh_cpus(); /* the affinity or the quota may have changed since the last channel opened */
  L->op_len = ring_op_frame(L->socket_next_frame, sizeof L->socket_next_frame, TSHARE_RING_SOCKET_NEXT);
  (void)ring_op_frame(L->nudge_frame, sizeof L->nudge_frame, TSHARE_RING_NUDGE); /* the same length */
  /* Until the first receive, the peer's first frames also nudge the socket:
   * a poll loop started now must not sleep through them. */
  ts_ring_reader_waits(&L->in, TS_RING_SOCKET);
  return TSHARE_OK;
}

/* ---- the table ------------------------------------------------------------ */

static bool ring_send_now(ts_conn *c, const uint8_t *buf, size_t len) {
  ts_ring_link *L = c->frame_data;
  if (c->broken || ts_ring_write(&L->out, buf, len) <= 0) return false; /* full, or for the driver to find */
  wake_ring_reader(c);
  return true;
}

/* Encoded in place: into the ring's next bytes when the frame fits there in
 * one piece (the encoder only writes, so a peer scribbling on them harms
 * only what it reads itself), then published. Left to ring_put: a frame
 * that would wrap or not fit, and the socket's hang-up check when due. */
static bool ring_send_frame_now(ts_conn *c, const tshare_frame *f) {
  ts_ring_link *L = c->frame_data;
  if (c->broken || hang_up_due(&L->hup_send_us)) return false;
  uint8_t *slot;
  long room = ts_ring_slot(&L->out, TSHARE_WIRE_FRAME_MAX, &slot);
  size_t len = 0;
  char err[TSHARE_ERROR_MSG_MAX];
  if (room > TSHARE_WIRE_FRAME_MAX) room = TSHARE_WIRE_FRAME_MAX; /* the bound a frame encoded elsewhere meets */
  if (room < TSHARE_WIRE_HEADER_SIZE || ts_wire_encode(f, slot, (size_t)room, &len, err, sizeof err) != TSHARE_OK)
    return false; /* a corrupt head, a full ring or a bad frame: ring_put and the encoder say so */
  ts_ring_publish(&L->out, len);
  wake_ring_reader(c);
  return true;
}

/* A send waits for room on the socket: a peer whose ring is full reads
 * nothing of ours. */
static void ring_send_wait(ts_conn *c, bool begins) {
  ts_ring_link *L = c->frame_data;
  if (begins)
    wait_on_socket_too(c);
  else
    ts_ring_reader_waits(&L->in, TS_RING_AWAKE);
}

/* wake_lock held: the driver may sleep on its ring's bell. */
static void ring_wake(ts_conn *c) {
  ts_ring_link *L = c->frame_data;
  ts_ring_ring_bell(&L->in);
}

static int ring_poll_fd(ts_conn *c) {
  ts_ring_link *L = c->frame_data;
  if (!atomic_exchange(&c->pollable, true)) ts_ring_reader_waits(&L->in, TS_RING_SOCKET);
  return c->rfd;
}

static size_t ring_buffered(ts_conn *c) {
  ts_ring_link *L = c->frame_data;
  long avail = ts_ring_available(&L->in);
  return tshare_decoder_pending(c->dec) + tshare_decoder_pending(L->dec) + (L->spill_len - L->spill_off) +
         (avail > 0 ? (size_t)avail : 0) + (L->socket_next || L->has_early);
}

/* Both locks held (a waker rings in's bell, a sender writes out), or a
 * forked child's copy: unmapped, nothing else touched. The connection goes
 * on as a plain socket one (closed, for ts_conn_close). */
static void ring_close(ts_conn *c, bool fork_copy) {
  ts_ring_link *L = c->frame_data;
  if (!L) return;
  ts_ring_unmap(&L->in);
  ts_ring_unmap(&L->out);
  c->t = c->stream;      /* the socket alone, as before the hello set the ring up */
  if (fork_copy) return; /* a parent's thread may have been using L: it stays, as the child's heap does */
  if (L->has_early && L->early_fd.fd >= 0) close(L->early_fd.fd);
  tshare_decoder_destroy(L->dec);
  free(L->spill);
  free(L);
  c->frame_data = NULL;
}

const ts_transport ts_transport_ring = {
    .name = "ring",
    .caps =
        TS_TRANSPORT_PASSES_FDS | TS_TRANSPORT_PEER_CREDENTIALS | TS_TRANSPORT_SAME_HOST | TS_TRANSPORT_SHARED_MEMORY,
    .send = ring_send_locked,
    .send_now = ring_send_now,
    .send_frame_now = ring_send_frame_now,
    .flush_owed = pay_markers_locked,
    .send_wait = ring_send_wait,
    .look_begins = ring_look_begins,
    .fill = ring_fill,
    .recv = ring_recv,
    .wait = wait_ring,
    .wake = ring_wake,
    .poll_fd = ring_poll_fd,
    .buffered = ring_buffered,
    .close = ring_close,
};

int ts_ring_transport_setup(ts_conn *c, uint32_t cap, int64_t deadline) {
  ts_ring_link *L = calloc(1, sizeof *L);
  if (!L) return ts_errf(c->err, c->err_cap, TSHARE_E_NOMEM, "ring setup: out of memory");
  c->frame_data = L;
  int rc = setup_link(c, cap, deadline);
  if (rc != TSHARE_OK) {
    ring_close(c, false); /* the peer may keep our ring's memfd: only our mapping goes */
    return rc;
  }
  c->t = &ts_transport_ring;
  return TSHARE_OK;
}
