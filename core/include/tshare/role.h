/* tshare/role.h - the environment contract between tshare-launch and roles.
 *
 * tshare-launch starts every role with these variables set:
 *
 *   TSHARE_ROLE           "producer" or "consumer"
 *   TSHARE_RANK           0 for the producer; 0..K-1 for the consumers
 *   TSHARE_NUM_CONSUMERS  K
 *   TSHARE_CHANNEL_FDS    the role's channels, comma-separated, in order:
 *                         "N" is a Unix socket at fd N, "R:W" a pipe pair
 *                         (read fd R, write fd W), "ucx" a channel across hosts
 *                         that the role opens itself (at most one, the last:
 *                         see TSHARE_UCX_LISTEN). The producer has K, one per
 *                         consumer rank, and the ucx one when the launcher was
 *                         given --listen or --connect; a consumer has 1, to the
 *                         producer.
 *   TSHARE_CHANNEL_IDS    optional: the inode number (fstat's st_ino) of every
 *                         fd in TSHARE_CHANNEL_FDS, in the same shape ("I" for
 *                         a socket, "IR:IW" for a pipe pair), so that an fd
 *                         number the program closed and reused is told apart
 *                         from the launcher's channel; "ucx" for the ucx
 *                         entry
 *   TSHARE_UCX_LISTEN     with a "ucx" entry, one of these two: the ucx://
 *   TSHARE_UCX_CONNECT    address the role listens on (and accepts one peer)
 *                         or connects to when it opens that channel; the
 *                         token is the environment's TSHARE_TOKEN. The open
 *                         waits up to TSHARE_UCX_WAIT_MS (default 60000) for
 *                         the other node.
 *   TSHARE_REPORT_FD      optional: write "key=value" lines here to have them
 *                         shown in the launcher's summary (shared, verified)
 *
 * The channel fds are dup2'd to these numbers (from 3 up) and are the only
 * fds the role inherits besides stdio.
 */
#ifndef TSHARE_ROLE_H
#define TSHARE_ROLE_H

#include "tshare/channel.h"
#include "tshare/errors.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TSHARE_ENV_ROLE "TSHARE_ROLE"
#define TSHARE_ENV_RANK "TSHARE_RANK"
#define TSHARE_ENV_NUM_CONSUMERS "TSHARE_NUM_CONSUMERS"
#define TSHARE_ENV_CHANNEL_FDS "TSHARE_CHANNEL_FDS"
#define TSHARE_ENV_REPORT_FD "TSHARE_REPORT_FD"
#define TSHARE_ENV_CHANNEL_IDS "TSHARE_CHANNEL_IDS"
#define TSHARE_ENV_UCX_LISTEN "TSHARE_UCX_LISTEN"
#define TSHARE_ENV_UCX_CONNECT "TSHARE_UCX_CONNECT"
#define TSHARE_ENV_UCX_WAIT_MS "TSHARE_UCX_WAIT_MS"
#define TSHARE_ROLE_CHANNEL_UCX "ucx" /* the TSHARE_CHANNEL_FDS (and _IDS) entry of a channel across hosts */

#define TSHARE_ROLE_CHANNELS_MAX 64

typedef struct tshare_role_channel {
  tshare_channel_kind kind;
  int read_fd, write_fd;                  /* equal for sockets; -2 for ucx (no fd); -1 once opened */
  unsigned long long read_ino, write_ino; /* from TSHARE_CHANNEL_IDS; 0: not given */
} tshare_role_channel;

typedef struct tshare_role {
  char name[32];
  int rank;
  int num_consumers;
  int nchannels;
  tshare_role_channel channels[TSHARE_ROLE_CHANNELS_MAX];
  int report_fd; /* -1 when not set */
} tshare_role;

/* Parse the variables above. TSHARE_E_NOT_FOUND when TSHARE_ROLE is unset
 * (not started by tshare-launch); TSHARE_E_MALFORMED naming the variable when
 * one does not parse or names an fd that is not open. */
TSHARE_API int tshare_role_from_env(tshare_role *role, tshare_error *err);

/* Open channel index (0-based) of the role; the channel takes its fds. opts
 * may be NULL; its name defaults to "<role> <rank>". Before taking them it
 * checks that each fd still is what the launcher gave: a Unix stream socket
 * (or a pipe end) with the inode TSHARE_CHANNEL_IDS names. When the program
 * closed the fd and the number now holds something else (its log file),
 * TSHARE_E_STATE names the fd and what it is now, and the fd is left open
 * and untouched. The ucx channel is opened by its address instead (listen
 * and accept one peer, or connect), waiting up to TSHARE_UCX_WAIT_MS. */
TSHARE_API int tshare_role_open_channel(tshare_role *role, int index, const tshare_channel_options *opts,
                                        tshare_channel **out, tshare_error *err);

/* Report a figure for tshare-launch's summary (keys it shows: "shared" for
 * the producer, "verified" for consumers), through the report fd if there is
 * one. tshare_role_report sets the figure (the last value reported stands);
 * tshare_role_report_add adds delta to it (from 0), for a role that counts
 * as it goes. Lines: "key=value" and "key+=delta". */
TSHARE_API void tshare_role_report(const tshare_role *role, const char *key, long long value);
TSHARE_API void tshare_role_report_add(const tshare_role *role, const char *key, long long delta);

#ifdef __cplusplus
}
#endif
#endif /* TSHARE_ROLE_H */
