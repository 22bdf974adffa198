/* Fan-out of a tensor set: one call hands the same built set to N channels,
 * one call waits for all their releases, and each channel's outcome is
 * reported on its own, so a dead or stuck consumer neither stops nor hides
 * the others. Built on the public set and share calls only: the set sent to
 * N channels is N sends of one builder (each channel's send takes its own
 * references on the buffers). */
#include "tshare/set.h"

#include "clock.h"
#include "error_detail.h"

#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The longest one sleep on the channels' fds lasts. Those fds are
 * edge-triggered wake-ups; a bounded sleep re-drives every channel anyway,
 * so a wake-up that went to another caller costs at most this long. */
#define FANOUT_POLL_SLICE_MS 100

/* results[i], when the caller asked for results: the status, and for a
 * failure the consumer's identity (its hello's name and pid) and what went
 * wrong: `detail`, or else what its channel said, copied now, before a later
 * call on the channel replaces it. */
static void note_result(tshare_error *results, size_t i, tshare_channel *ch, int rc, const char *doing,
                        const char *detail) {
  if (!results) return;
  if (rc == TSHARE_OK) {
    ts_error_fill(&results[i], TSHARE_OK, "");
    return;
  }
  if (!detail) detail = ch ? tshare_channel_last_error(ch) : "the channel is NULL";
  if (strcmp(detail, "no error") == 0 || detail[0] == '\0') detail = tshare_status_str(rc);
  const tshare_hello *peer = ch ? tshare_channel_peer(ch) : NULL;
  char pid[24] = "";
  if (peer) snprintf(pid, sizeof pid, "pid %u", (unsigned)peer->pid);
  char msg[TSHARE_ERROR_MSG_MAX];
  if (peer && !strstr(detail, pid)) /* the channel's own detail may name the peer already */
    snprintf(msg, sizeof msg, "consumer %zu ('%.64s', %s): %s: %.160s", i, peer->name, pid, doing, detail);
  else
    snprintf(msg, sizeof msg, "consumer %zu: %s: %.200s", i, doing, detail);
  ts_error_fill(&results[i], rc, msg);
}

#define WAITING "waiting for the set's release"

static void note_all(tshare_error *results, size_t n, int rc, const char *why) {
  for (size_t i = 0; results && i < n; i++) ts_error_fill(&results[i], rc, why);
}

int tshare_set_send_all(const tshare_set_builder *b, tshare_channel *const *chs, size_t n, void *user_data,
                        int timeout_ms, uint64_t *set_ids, tshare_error *results) {
  if (n > 0 && (!chs || !set_ids)) {
    note_all(results, n, TSHARE_E_INVALID_ARG, "set fan-out: the channel list and set_ids are required");
    return TSHARE_E_INVALID_ARG;
  }
  if (!b) {
    for (size_t i = 0; i < n; i++) set_ids[i] = 0;
    note_all(results, n, TSHARE_E_INVALID_ARG, "set fan-out: the builder is NULL");
    return TSHARE_E_INVALID_ARG;
  }
  int64_t deadline = ts_deadline(timeout_ms);
  int first = TSHARE_OK;
  for (size_t i = 0; i < n; i++) {
    /* Every channel gets what is left of the one deadline, 0 included: a
     * consumer whose socket has room still gets the set after a slow one. */
    int rc = chs[i] ? tshare_set_send(chs[i], b, user_data, ts_remaining(deadline), &set_ids[i])
                    : TSHARE_E_INVALID_ARG;
    if (rc != TSHARE_OK) set_ids[i] = 0;
    note_result(results, i, chs[i], rc, "sending the set", NULL);
    if (rc != TSHARE_OK && first == TSHARE_OK) first = rc;
  }
  return first;
}

/* Drives each channel still waited on without waiting (as its fd asks: until
 * it reports a timeout, or the set came back); TSHARE_AGAIN marks those. */
static size_t drive_pending(tshare_channel *const *chs, const uint64_t *set_ids, size_t n, int *status,
                            tshare_error *results) {
  size_t left = 0;
  for (size_t i = 0; i < n; i++) {
    if (status[i] != TSHARE_AGAIN) continue;
    int rc = tshare_channel_wait_released(chs[i], set_ids[i], 0);
    if (rc == TSHARE_E_TIMEOUT) {
      left++;
      continue;
    }
    status[i] = rc;
    note_result(results, i, chs[i], rc, WAITING, NULL);
  }
  return left;
}

/* Sleeps until a pending channel's fd is readable, at most ms (< 0: a slice). */
static int sleep_on_pending(tshare_channel *const *chs, size_t n, const int *status, struct pollfd *fds, int ms) {
  nfds_t count = 0;
  for (size_t i = 0; i < n; i++) {
    int fd = status[i] == TSHARE_AGAIN ? tshare_channel_fd(chs[i]) : -1;
    if (fd >= 0) fds[count++] = (struct pollfd){.fd = fd, .events = POLLIN};
  }
  if (ms < 0 || ms > FANOUT_POLL_SLICE_MS) ms = FANOUT_POLL_SLICE_MS;
  return poll(fds, count, ms); /* EINTR and errors: the caller drives again */
}

/* The first failure in channel order, or TSHARE_OK. */
static int first_failure(const int *status, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (status[i] != TSHARE_OK) return status[i];
  return TSHARE_OK;
}

static int wait_all(tshare_channel *const *chs, const uint64_t *set_ids, size_t n, int timeout_ms, int *status,
                    struct pollfd *fds, tshare_error *results) {
  for (size_t i = 0; i < n; i++) {
    status[i] = TSHARE_AGAIN; /* waited on */
    if (!chs[i]) status[i] = TSHARE_E_INVALID_ARG;
    else if (set_ids[i] == 0) status[i] = TSHARE_OK; /* nothing was sent there: nothing to wait for */
    if (status[i] != TSHARE_AGAIN) note_result(results, i, chs[i], status[i], WAITING, NULL);
  }
  int64_t deadline = ts_deadline(timeout_ms);
  while (drive_pending(chs, set_ids, n, status, results) > 0) {
    int ms = ts_remaining(deadline);
    if (ms == 0) break;
    sleep_on_pending(chs, n, status, fds, ms);
  }
  for (size_t i = 0; i < n; i++) {
    if (status[i] != TSHARE_AGAIN) continue;
    status[i] = TSHARE_E_TIMEOUT;
    char why[96];
    snprintf(why, sizeof why, "set %llu not released within %d ms", (unsigned long long)set_ids[i], timeout_ms);
    note_result(results, i, chs[i], TSHARE_E_TIMEOUT, WAITING, why);
  }
  return first_failure(status, n);
}

int tshare_set_wait_all(tshare_channel *const *chs, const uint64_t *set_ids, size_t n, int timeout_ms,
                        tshare_error *results) {
  if (n == 0) return TSHARE_OK;
  if (!chs || !set_ids) {
    note_all(results, n, TSHARE_E_INVALID_ARG, "set fan-out: the channel list and set_ids are required");
    return TSHARE_E_INVALID_ARG;
  }
  int *status = calloc(n, sizeof *status);
  struct pollfd *fds = calloc(n, sizeof *fds);
  int rc = status && fds ? wait_all(chs, set_ids, n, timeout_ms, status, fds, results) : TSHARE_E_NOMEM;
  if (rc == TSHARE_E_NOMEM && !(status && fds)) note_all(results, n, rc, "set fan-out: out of memory");
  free(status);
  free(fds);
  return rc;
}
