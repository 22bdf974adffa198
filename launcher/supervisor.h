/* Running a producer and K consumers as one job: channels wired between them,
 * output prefixed, signals forwarded, everyone stopped when one fails. */
#ifndef TSHARE_LAUNCHER_SUPERVISOR_H
#define TSHARE_LAUNCHER_SUPERVISOR_H

#include "tshare/channel.h"

#include <stdbool.h>

/* Exit codes of tshare-launch. */
enum {
  LAUNCH_OK = 0,
  LAUNCH_ROLE_FAILED = 1, /* a role failed, or the demo found data not intact */
  LAUNCH_USAGE = 2,
  LAUNCH_TIMEOUT = 124,
  LAUNCH_NOT_STARTED = 127 /* a role's program could not be started */
  /* 128 + N: stopped by signal N (any terminating one) sent to the launcher */
};

typedef struct launch_plan {
  char **producer_argv;        /* NULL-terminated */
  char **consumer_argv;        /* every consumer runs this, told its rank by TSHARE_RANK... */
  char ***consumer_argvs;      /* ...unless this holds one command per rank (NULL: none) */
  bool no_prefix;              /* pass role output on without "[role pid N] " */
  const char *log_dir;         /* NULL, or a directory for one log per role and the summary */
  int consumers;               /* K >= 1 */
  tshare_channel_kind channel; /* socket or pipes */
  double timeout_s;            /* <= 0: none */
  double grace_s;              /* between SIGTERM and SIGKILL */
  int expect_verified;         /* > 0: success also needs the consumers' verified= reports to add up to this */
  int expect_shared;           /* > 0: ... and the producer's shared= report to equal this */
  /* A channel across hosts for the producer, after its K: it listens at
   * ucx_listen or connects to ucx_connect (at most one set) when it opens
   * it; NULL: none. */
  const char *ucx_listen, *ucx_connect;
} launch_plan;

/* Run the plan to the end and return tshare-launch's exit code. */
int launch_run(const launch_plan *plan);

#endif
