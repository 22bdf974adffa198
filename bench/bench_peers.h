/* bench_peers: the consumer processes of a bench run and how the producer
 * steers them.
 *
 * Each consumer is this binary again (`--consumer RANK`, posix_spawn), with a
 * tshare socket channel on fd 3 and a control socket on fd 4. The producer
 * writes one command per line on the control socket ("recv 10000"); the
 * consumer runs its side against the channel and answers with one line,
 * "ok key=value ..." or "error why". The control socket never carries the
 * measured traffic. */
#ifndef TSHARE_BENCH_PEERS_H
#define TSHARE_BENCH_PEERS_H

#include "tshare/channel.h"
#include "tshare/share.h"
#include "tshare/spawn.h"

#include <stddef.h>
#include <stdio.h>

#define BP_DATA_FD 3
#define BP_CONTROL_FD 4

typedef struct bp_peer {
  tshare_process *proc;
  int ctl;
  char in[1024]; /* answer bytes read but not yet returned */
  size_t in_len;
  tshare_channel *ch; /* the producer's end of the data channel */
} bp_peer;

/* Spawn `exe --consumer rank transport spin_us` and open the data channel
 * (transport "ring" or "socket"; spin_us < 0: the default) with the same
 * settings on this end. 0, or -1 with why. */
int bp_start(bp_peer *p, const char *exe, int rank, const char *transport, int spin_us, char *why, size_t cap);

/* The channel options both ends of a bench channel use. */
void bp_channel_options(tshare_channel_options *o, const char *name, const char *transport, int spin_us);

/* Send a command line (no newline needed). 0, or -1 if the consumer is gone. */
int bp_send(bp_peer *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Read the answer to the last command: 0 for "ok ...", -1 otherwise (line
 * then says why: the consumer's error, or that it died or timed out). */
int bp_reply(bp_peer *p, char *line, size_t cap, int timeout_ms);

/* The number after "key=" in an answer; NaN when absent. */
double bp_field(const char *line, const char *key);

/* Tell the consumer to quit, close the channel and reap it. */
void bp_stop(bp_peer *p);

/* For commands whose frames the consumer reads with the raw frame calls
 * (tshare_channel_recv_frame): the consumer drives its channel between
 * commands (tshare_channel_poll), which would queue a frame sent right after
 * the command line as a share for tshare_view_recv, where the raw read never
 * sees it. So the consumer says "ready" once it reads raw, and the producer
 * waits for that before its first frame. 0, or -1 with line saying why. */
int bp_await_ready(bp_peer *p, char *line, size_t cap, int timeout_ms);
void bp_consumer_ready(void);

/* The consumer's side: read commands on fd 4 and answer each with handle(). */
typedef int (*bp_handler)(tshare_channel *ch, const char *cmd, char *reply, size_t cap);
int bp_consumer_loop(tshare_channel *ch, bp_handler handle);

#endif
