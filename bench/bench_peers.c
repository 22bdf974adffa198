#include "bench_peers.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

void bp_channel_options(tshare_channel_options *o, const char *name, const char *transport, int spin_us) {
  tshare_channel_options_init(o);
  o->name = name;
  o->transport = strcmp(transport, "socket") == 0 ? TSHARE_TRANSPORT_SOCKET : TSHARE_TRANSPORT_RING;
  o->spin_us = spin_us;
}

int bp_start(bp_peer *p, const char *exe, int rank, const char *transport, int spin_us, char *why, size_t cap) {
  memset(p, 0, sizeof *p);
  p->ctl = -1;
  int data[2], ctl[2];
  tshare_error err;
  if (tshare_socketpair(data, &err) != TSHARE_OK) {
    snprintf(why, cap, "%s", err.message);
    return -1;
  }
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ctl) != 0) {
    snprintf(why, cap, "socketpair: %s", strerror(errno));
    close(data[0]);
    close(data[1]);
    return -1;
  }
  char rank_s[16];
  snprintf(rank_s, sizeof rank_s, "%d", rank);
  char spin_s[16];
  snprintf(spin_s, sizeof spin_s, "%d", spin_us);
  char *argv[] = {(char *)exe, (char *)"--consumer", rank_s, (char *)transport, spin_s, NULL};
  tshare_fd_map fds[2] = {{BP_DATA_FD, data[1]}, {BP_CONTROL_FD, ctl[1]}};
  tshare_spawn_options so = {.file = exe, .argv = argv, .fds = fds, .nfds = 2};
  int rc = tshare_spawn(&so, &p->proc, &err);
  close(data[1]);
  close(ctl[1]);
  if (rc != TSHARE_OK) {
    snprintf(why, cap, "%s", err.message);
    close(data[0]);
    close(ctl[0]);
    return -1;
  }
  p->ctl = ctl[0];
  tshare_channel_options o;
  bp_channel_options(&o, "bench producer", transport, spin_us);
  if (tshare_channel_open_socket(data[0], &o, &p->ch, &err) != TSHARE_OK) {
    snprintf(why, cap, "opening the channel to consumer %d: %s", rank, err.message);
    bp_stop(p);
    return -1;
  }
  return 0;
}

int bp_send(bp_peer *p, const char *fmt, ...) {
  char line[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line - 1, fmt, ap);
  va_end(ap);
  if (n < 0 || n >= (int)sizeof line - 1) return -1;
  line[n++] = '\n';
  for (int off = 0; off < n;) {
    ssize_t w = send(p->ctl, line + off, (size_t)(n - off), MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    off += (int)w;
  }
  return 0;
}

int bp_reply(bp_peer *p, char *line, size_t cap, int timeout_ms) {
  for (;;) {
    char *nl = memchr(p->in, '\n', p->in_len);
    if (nl) {
      size_t n = (size_t)(nl - p->in);
      snprintf(line, cap, "%.*s", (int)n, p->in);
      memmove(p->in, nl + 1, p->in_len - n - 1);
      p->in_len -= n + 1;
      return strncmp(line, "ok", 2) == 0 ? 0 : -1;
    }
    struct pollfd pfd = {.fd = p->ctl, .events = POLLIN, .revents = 0};
    int n = poll(&pfd, 1, timeout_ms);
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) {
      snprintf(line, cap, "consumer did not answer within %d ms", timeout_ms);
      return -1;
    }
    ssize_t r = n > 0 && p->in_len < sizeof p->in ? read(p->ctl, p->in + p->in_len, sizeof p->in - p->in_len) : -1;
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      char how[64];
      tshare_exit_status st;
      if (tshare_process_wait(p->proc, 2000, &st) != TSHARE_OK) st = tshare_process_status(p->proc);
      snprintf(line, cap, "consumer ended (%s)", tshare_exit_describe(st, how, sizeof how));
      return -1;
    }
    p->in_len += (size_t)r;
  }
}

int bp_await_ready(bp_peer *p, char *line, size_t cap, int timeout_ms) {
  if (bp_reply(p, line, cap, timeout_ms) != 0) return -1;
  if (strcmp(line, "ok ready") == 0) return 0;
  char got[256];
  snprintf(got, sizeof got, "%s", line);
  snprintf(line, cap, "consumer answered '%s', not ready", got);
  return -1;
}

void bp_consumer_ready(void) {
  static const char ready[] = "ok ready\n";
  (void)send(BP_CONTROL_FD, ready, sizeof ready - 1, MSG_NOSIGNAL); /* a dead producer: the next read says so */
}

double bp_field(const char *line, const char *key) {
  size_t k = strlen(key);
  for (const char *s = line; (s = strstr(s, key)); s += k)
    if ((s == line || s[-1] == ' ') && s[k] == '=') return strtod(s + k + 1, NULL);
  return NAN;
}

void bp_stop(bp_peer *p) {
  if (p->ctl >= 0) {
    bp_send(p, "quit");
    close(p->ctl);
  }
  tshare_channel_close(p->ch);
  if (p->proc) {
    tshare_exit_status st;
    if (tshare_process_wait(p->proc, 10000, &st) != TSHARE_OK) tshare_process_terminate(p->proc, 1000, &st);
    tshare_process_destroy(p->proc);
  }
  memset(p, 0, sizeof *p);
  p->ctl = -1;
}

/* Between commands the channel is still driven, as a real consumer's would
 * be: releases queued by the last command go out, and whatever they were
 * waiting for on the GPU is polled every millisecond. */
static int next_command(tshare_channel *ch, char *buf, size_t cap, size_t *len) {
  for (;;) {
    char *nl = memchr(buf, '\n', *len);
    if (nl) return (int)(nl - buf);
    struct pollfd p[2] = {{.fd = BP_CONTROL_FD, .events = POLLIN, .revents = 0},
                          {.fd = tshare_channel_fd(ch), .events = POLLIN, .revents = 0}};
    int n = poll(p, 2, 1);
    if (n < 0 && errno != EINTR) return -1;
    if (p[0].revents) {
      ssize_t r = *len < cap ? read(BP_CONTROL_FD, buf + *len, cap - *len) : -1;
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return -1;
      *len += (size_t)r;
    } else {
      (void)tshare_channel_poll(ch, 0);
    }
  }
}

int bp_consumer_loop(tshare_channel *ch, bp_handler handle) {
  char in[1024], reply[512];
  size_t len = 0;
  for (int n; (n = next_command(ch, in, sizeof in, &len)) >= 0;) {
    char cmd[256];
    snprintf(cmd, sizeof cmd, "%.*s", n, in);
    memmove(in, in + n + 1, len - (size_t)n - 1);
    len -= (size_t)n + 1;
    if (strcmp(cmd, "quit") == 0) break;
    reply[0] = 0;
    int rc = handle(ch, cmd, reply, sizeof reply);
    (void)tshare_channel_poll(ch, 0); /* the last release goes out now */
    char line[600];
    int k = snprintf(line, sizeof line, "%s %s\n", rc == 0 ? "ok" : "error", reply);
    if (k > (int)sizeof line - 1) k = (int)sizeof line - 1;
    if (send(BP_CONTROL_FD, line, (size_t)k, MSG_NOSIGNAL) != k) break;
  }
  return 0;
}
