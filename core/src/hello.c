/* The hello and the peer's identity: see hello.h. */
#include "hello.h"

#include "error_detail.h"
#include "transport_ring.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int read_boot_id(uint8_t out[16]) {
  memset(out, 0, 16);
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");
  if (!f) return -1;
  char text[64] = {0};
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  int k = 0;
  for (size_t i = 0; i < n && k < 32; i++) {
    char c = text[i];
    int v = c >= '0' && c <= '9'   ? c - '0'
            : c >= 'a' && c <= 'f' ? c - 'a' + 10
            : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                   : -1;
    if (v < 0) continue;
    out[k / 2] = (uint8_t)(out[k / 2] | (k % 2 ? v : v << 4));
    k++;
  }
  return k == 32 ? 0 : -1;
}

static bool all_zero(const uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (p[i]) return false;
  return true;
}

/* The kernel's credentials of a socket's peer: nothing a peer says about
 * itself counts before this. */
static int check_peer_cred(ts_conn *c, long allow_uid, struct ucred *cred) {
  socklen_t len = sizeof *cred;
  if (getsockopt(c->rfd, SOL_SOCKET, SO_PEERCRED, cred, &len) != 0)
    return ts_errsys(c->err, c->err_cap, TSHARE_E_SYSTEM, errno, "channel: getsockopt(SO_PEERCRED)");
  long allow = allow_uid;
  if (cred->uid == getuid() || allow == TS_CONN_ANY_UID || (allow >= 0 && (uid_t)allow == cred->uid)) return TSHARE_OK;
  return ts_errf(c->err, c->err_cap, TSHARE_E_PERMISSION,
                 "channel: the peer (pid %ld) runs as uid %ld, this process as uid %ld; set allow_uid in the channel "
                 "options to accept it",
                 (long)cred->pid, (long)cred->uid, (long)getuid());
}

/* How messages name the peer: by the pid the kernel reports where there is
 * one (a hello's pid is only the peer's word), else by its word, said so
 * (pipes; a peer in a pid namespace not visible from here; a hand-rolled
 * peer whose hello came without credentials). */
static void name_peer(ts_conn *c) {
  if (c->peer_kpid > 0)
    snprintf(c->peer_label, sizeof c->peer_label, "'%s' (pid %ld)", c->peer.name, (long)c->peer_kpid);
  else
    snprintf(c->peer_label, sizeof c->peer_label, "'%s' (says pid %u)", c->peer.name, c->peer.pid);
}

/* The start time of a process in clock ticks since boot (/proc/PID/stat field
 * 22): with the pid, it names one process for the life of the machine. */
static uint64_t start_time_of(long pid) {
  char path[64], text[1024];
  snprintf(path, sizeof path, "/proc/%ld/stat", pid);
  FILE *f = fopen(path, "re");
  if (!f) return 0;
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = '\0';
  const char *p = strrchr(text, ')'); /* the name may hold anything; fields follow the last ')' */
  unsigned long long start = 0;
  if (p &&
      sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu", &start) != 1)
    start = 0;
  return start;
}

#define KEY_BY_CHANNEL (1ull << 63) /* keys that name a channel, not a process */

static uint64_t peer_key_of(ts_conn *c) {
  static atomic_uint_fast64_t serials;
  uint64_t serial = (uint64_t)atomic_fetch_add(&serials, 1) + 1;
  if (c->peer_kpid <= 0) return KEY_BY_CHANNEL | (serial << 32);
  return ((uint64_t)c->peer_kpid | (start_time_of(c->peer_kpid) << 32)) & ~KEY_BY_CHANNEL;
}

uint64_t ts_conn_origin_key(const ts_conn *c, uint32_t claimed_pid) {
  if (claimed_pid == 0 || claimed_pid == c->peer.pid) return c->peer_key;
  /* Forwarded: the claim is kept, but only among this peer's own. */
  uint64_t h = c->peer_key * 0x9e3779b97f4a7c15ull ^ (uint64_t)claimed_pid * 0xbf58476d1ce4e5b9ull;
  h ^= h >> 29;
  return KEY_BY_CHANNEL | (h >> 1);
}

/* Both hellos: ours out, the peer's in. */
static int exchange_hellos(ts_conn *c, int64_t deadline) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_HELLO;
  f.u.hello = c->self;
  int rc = ts_conn_send(c, &f, -1, ts_remaining(deadline));
  int fd = -1, fd_lost;
  /* The peer may send its first frames right behind its hello: they stay on
   * the socket, where a poll loop started once the channel is open sees them. */
  c->frame_at_a_time = true;
  while (rc == TSHARE_OK && (rc = ts_conn_recv_by(c, &f, &fd, &fd_lost, deadline)) == TS_CONN_WOKEN) {
  }
  c->frame_at_a_time = false;
  if (rc != TSHARE_OK) {
    char why[TSHARE_ERROR_MSG_MAX];
    snprintf(why, sizeof why, "%s", c->err);
    return ts_errf(c->err, c->err_cap, rc, "hello: %s", why);
  }
  if (fd >= 0) close(fd);
  if (f.type == TSHARE_FRAME_ERROR)
    return ts_errf(c->err, c->err_cap, TSHARE_E_PEER_ERROR, "hello: peer refused the channel: %s (%s)",
                   f.u.error.message, tshare_status_name(f.u.error.code));
  if (f.type != TSHARE_FRAME_HELLO) {
    rc = ts_errf(c->err, c->err_cap, TSHARE_E_PROTOCOL, "hello: expected a hello frame, got %s",
                 tshare_frame_type_name(f.type));
    ts_conn_send_error(c, rc, c->err);
    return rc;
  }
  c->peer = f.u.hello;
  return TSHARE_OK;
}

int ts_hello_check_same_boot(ts_conn *c) {
  if (all_zero(c->self.boot_id, 16) || all_zero(c->peer.boot_id, 16) ||
      memcmp(c->self.boot_id, c->peer.boot_id, 16) == 0)
    return TSHARE_OK;
  return ts_errf(c->err, c->err_cap, TSHARE_E_PEER_MISMATCH,
                 "hello: peer %s runs under another boot id: shares cannot cross machines or boots", c->peer_label);
}

/* What the transport's own word says about the peer, checked against its
 * hello: the uid the kernel reported. */
static int check_claims(ts_conn *c, bool credentials, const struct ucred *cred) {
  if (credentials && c->peer.uid != (uint32_t)cred->uid)
    return ts_errf(c->err, c->err_cap, TSHARE_E_PROTOCOL, "hello: peer %s claims uid %u, the kernel says %ld",
                   c->peer_label, c->peer.uid, (long)cred->uid);
  return TSHARE_OK;
}

int ts_conn_hello(ts_conn *c, const tshare_hello *self, long allow_uid, int timeout_ms) {
  int64_t deadline = ts_deadline(timeout_ms);
  c->self = *self;
  c->self.major = TSHARE_WIRE_MAJOR;
  c->self.minor = TSHARE_WIRE_MINOR;
  c->self.pid = (uint32_t)getpid();
  c->self.uid = (uint32_t)getuid();
  read_boot_id(c->self.boot_id);
  bool credentials = (ts_conn_caps(c) & TS_TRANSPORT_PEER_CREDENTIALS) != 0;
  struct ucred cred = {0, 0, 0};
  int rc = credentials ? check_peer_cred(c, allow_uid, &cred) : TSHARE_OK;
  /* Who wrote the peer's hello, as the kernel attaches it to the bytes
   * (SCM_CREDENTIALS): SO_PEERCRED names whoever created a socketpair, which
   * is not the peer once the pair was handed out. Both ends ask before their
   * hello, so each one's hello carries it. */
  int on = 1, off = 0;
  if (rc == TSHARE_OK && credentials) setsockopt(c->rfd, SOL_SOCKET, SO_PASSCRED, &on, sizeof on);
  if (rc == TSHARE_OK) rc = exchange_hellos(c, deadline);
  if (credentials) setsockopt(c->rfd, SOL_SOCKET, SO_PASSCRED, &off, sizeof off);
  if (rc != TSHARE_OK) return rc;
  name_peer(c);
  c->peer_key = peer_key_of(c);
  /* Whom to serve is the session's to say (a transport across hosts will
   * carry peers of other boots): its admit_peer goes first, as the same-boot
   * refusal always did. */
  rc = c->admit_peer ? c->admit_peer(c) : TSHARE_OK;
  if (rc == TSHARE_OK) rc = check_claims(c, credentials, &cred);
  if (rc != TSHARE_OK) {
    ts_conn_send_error(c, rc, c->err);
    return rc;
  }
  const uint8_t ours = TSHARE_WIRE_MINOR;
  c->minor = c->peer.minor < ours ? c->peer.minor : ours;
  /* The ring rides on a socket: its fd frames, nudges and hang-up. */
  if (c->stream == &ts_transport_socket && c->minor >= 2 &&
      (c->self.capabilities & c->peer.capabilities & TSHARE_CAP_RING))
    return ts_ring_transport_setup(c, TS_RING_CAP_DEFAULT, deadline);
  return TSHARE_OK;
}
