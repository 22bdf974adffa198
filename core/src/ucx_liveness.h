/* Liveness of channels across hosts: heartbeats and the silence that ends a
 * channel, beside UCX's own error mode PEER (which sees a killed process,
 * but not a link that goes down while both processes live).
 *
 * The rule: each end sends a heartbeat (its own active message, never a
 * frame) when it sent nothing for heartbeat_ms; every message from the peer
 * counts as life; an end that heard nothing for timeout_ms declares the peer
 * dead. A process-wide thread does both for every UCX endpoint, so an end
 * answers while its application is blocked in a receive, busy elsewhere or
 * idle between calls, and the silence is found while nobody calls into
 * tshare (the channel's fd then wakes a poll loop). Once the process calls
 * exit() the thread ticks no more (UCX's own teardown follows).
 *
 * Settings, read when an endpoint is made:
 *   TSHARE_UCX_HEARTBEAT_MS     10-60000, default 250
 *   TSHARE_UCX_PEER_TIMEOUT_MS  at least twice the heartbeat, at most
 *                               3600000, default 1000
 * Each heartbeat carries its sender's interval: an end never declares a
 * peer dead before two of the peer's intervals passed, whatever its own
 * timeout says. */
#ifndef TSHARE_UCX_LIVENESS_H
#define TSHARE_UCX_LIVENESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TS_UCX_HEARTBEAT_ENV "TSHARE_UCX_HEARTBEAT_MS"
#define TS_UCX_PEER_TIMEOUT_ENV "TSHARE_UCX_PEER_TIMEOUT_MS"
#define TS_UCX_HEARTBEAT_MS_DEFAULT 250
#define TS_UCX_PEER_TIMEOUT_MS_DEFAULT 1000

typedef struct ts_ucx_liveness {
  int heartbeat_ms;      /* this end's interval */
  int timeout_ms;        /* this end's silence bound */
  int peer_heartbeat_ms; /* the interval the peer's heartbeats announce (0: none came yet) */
  int64_t last_sent_ms, last_heard_ms;
} ts_ucx_liveness;

/* The settings from the environment; TSHARE_E_INVALID_ARG naming the
 * variable for a value out of its range. The clocks start now. */
int ts_ucx_liveness_init(ts_ucx_liveness *l, char *msg, size_t cap);
/* Whether this end was quiet for its interval. */
bool ts_ucx_heartbeat_due(const ts_ucx_liveness *l, int64_t now_ms);
/* The silence after which the peer is dead: this end's timeout, or two of
 * the peer's intervals when that is longer. */
int ts_ucx_peer_timeout_ms(const ts_ucx_liveness *l);
bool ts_ucx_peer_silent(const ts_ucx_liveness *l, int64_t now_ms);

/* A heartbeat's payload: the sender's interval, 4 bytes little-endian. */
#define TS_UCX_HEARTBEAT_LEN 4
void ts_ucx_heartbeat_encode(uint8_t out[TS_UCX_HEARTBEAT_LEN], int heartbeat_ms);
/* The interval a heartbeat announces, or 0 when it is not one (wrong
 * length, out of range): a hostile peer's bytes. */
int ts_ucx_heartbeat_decode(const void *data, size_t len);

/* The thread. watch: tick(item) runs every few ms (a quarter of the
 * shortest interval watched, 5-50 ms) until unwatch(item) returns, which
 * waits for a running tick. tick takes whatever locks item needs; unwatch
 * must not be called with them held. */
typedef void (*ts_ucx_tick_fn)(void *item);
int ts_ucx_liveness_watch(void *item, ts_ucx_tick_fn tick, int heartbeat_ms, char *msg, size_t cap);
void ts_ucx_liveness_unwatch(void *item);

#endif
