/* The host-memory backend: buffers in sealed memfds travel as fds, and a
 * consumer maps each allocation once per channel; mappings it keeps past
 * their views make later shares of them a frame alone (backend_host_keep.c). */
#include "backend.h"
#include "backend_host.h"
#include "backend_ucx.h"
#include "error_detail.h"
#include "log.h"
#include "session.h"
#include "wire_checks.h"
#include "tshare/share.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

host_chan *ts_host_chan(tshare_channel *ch) { return *ts_backend_data(ch, &ts_host_backend); }

static ts_u64map *mappings_of(tshare_channel *ch) { return &ts_host_chan(ch)->mappings; }

/* ---- producer side ------------------------------------------------------ */

/* A memfd share: the one frame both a producer's buffer and a forwarded host
 * view travel as; fd -1 for memory the peer keeps mapped (TSHARE_MEM_HOST_KEPT).
 * tag is checked; e is consumed. */
static int send_memfd_share(tshare_channel *ch, uint64_t alloc_id, uint64_t alloc_size, int fd, bool unsealed,
                            uint32_t share_flags, const tshare_tensor_desc *desc, const char *tag, ts_export *e,
                            int timeout_ms, uint64_t *share_id) {
  if (!(ts_conn_caps(&ch->conn) & TS_TRANSPORT_PASSES_FDS)) {
    ts_export_drop(e);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "share: host memory travels as an fd, which a %s channel cannot carry: open a socket channel "
                   "on one host (tshare_socketpair, tshare_listen/tshare_connect of a plain name, or tshare-launch "
                   "--channel socket)",
                   ch->conn.stream->name);
  }
  if (!(ch->conn.peer.capabilities & TSHARE_CAP_HOST_MEMFD)) {
    ts_export_drop(e);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_MISMATCH,
                   "share: peer %s does not import host memory (no memfd capability in its hello)",
                   ch->conn.peer_label);
  }
  if (unsealed && !(ch->conn.peer.capabilities & TSHARE_CAP_HOST_FD)) {
    ts_export_drop(e);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_MISMATCH,
                   "share: the memory is an unsealed file (not a tshare memfd) and peer %s does not take such files "
                   "(no host-fd capability in its hello): copy it into tshare_host_buffer_create() memory",
                   ch->conn.peer_label);
  }
  tshare_frame f;
  ts_frame_clear(&f, TSHARE_FRAME_SHARE);
  f.flags = fd >= 0 ? TSHARE_FRAME_FLAG_FD_ATTACHED : 0;
  tshare_share_frame *s = &f.u.share;
  s->alloc_id = alloc_id;
  s->mem_kind = fd < 0 ? TSHARE_MEM_HOST_KEPT : unsealed ? TSHARE_MEM_HOST_FD : TSHARE_MEM_HOST_MEMFD;
  s->share_flags = share_flags;
  s->device_type = TSHARE_DEVICE_CPU;
  s->alloc_size = alloc_size;
  s->tensor = *desc;
  s->tag_len = (uint8_t)(tag ? strlen(tag) : 0);
  if (s->tag_len) memcpy(s->tag, tag, s->tag_len);
  return ts_share_send_export(ch, &f, fd, e, timeout_ms, share_id);
}

static int share_host(tshare_channel *ch, tshare_host_buffer *buf, const tshare_tensor_desc *desc, const char *tag,
                      void *user_data, int timeout_ms, uint64_t *share_id) {
  if (ch->closed || ch->conn.wfd < 0)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE, "share: channel is closed");
  /* Across hosts the memory cannot travel as an fd: the peer reads it. */
  if (!(ts_conn_caps(&ch->conn) & TS_TRANSPORT_PASSES_FDS) && ts_ucx_carries_host(ch))
    return ts_ucx_share_host(ch, buf, desc, TSHARE_DEVICE_CPU, tag, user_data, timeout_ms, share_id);
  size_t tag_len = tag ? strlen(tag) : 0;
  if (tag_len > TSHARE_TAG_MAX)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_TOO_LARGE, "share: tag of %zu bytes over %d", tag_len,
                   TSHARE_TAG_MAX);
  bool kept = false, unsealed = ts_host_buffer_unsealed(buf);
  uint32_t share_flags = 0;
  /* An unsealed file is never lent: a consumer keeping it mapped would stay
   * exposed to a truncation long after the share. */
  int rc = unsealed ? TSHARE_OK : ts_host_lend(ch, buf, &kept, &share_flags);
  if (rc != TSHARE_OK) return rc;
  ts_export *e = malloc(sizeof *e);
  if (!e) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  e->user_data = user_data;
  e->release = ts_host_buffer_release;
  e->owner = buf;
  e->backend = &ts_host_backend; /* its export_done retires a buffer the release leaves unused */
  ts_host_buffer_retain(buf);
  return send_memfd_share(ch, tshare_host_buffer_id(buf), tshare_host_buffer_size(buf),
                          kept ? -1 : tshare_host_buffer_fd(buf), unsealed, share_flags, desc, tag, e, timeout_ms,
                          share_id);
}

int tshare_share_host(tshare_channel *ch, tshare_host_buffer *buf, const tshare_tensor_desc *desc, const char *tag,
                      void *user_data, int timeout_ms, uint64_t *share_id) {
  if (share_id) *share_id = 0;
  if (!ch || !buf || !desc) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "share", share_host(ch, buf, desc, tag, user_data, timeout_ms, share_id));
}

/* The host half of sharing a received view on: the memfd the mapping kept
 * travels under this process's id for the allocation. */
static int host_share_view(tshare_channel *ch, tshare_view *v, const tshare_tensor_desc *desc, void *stream,
                           const char *tag, ts_export *e, int timeout_ms, uint64_t *share_id) {
  (void)stream;
  ts_mapping *m = v->memory;
  if (!m || m->fd < 0) {
    ts_export_drop(e);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE,
                   m ? "share: the view's memfd was closed once mapped (its channel was opened with keep_host_fds "
                       "0, or its mapping was kept idle past the budget of fds for idle mappings), so the view "
                       "cannot be shared on"
                     : "share: the view has no mapped memory to share on");
  }
  return send_memfd_share(ch, m->forward_id, m->size, m->fd, m->unsealed, 0, desc, tag, e, timeout_ms, share_id);
}

/* ---- consumer side ------------------------------------------------------ */

void ts_host_unmap(ts_mapping *m) {
  if (m->base) munmap(m->base, m->size);
  if (m->fd >= 0) close(m->fd);
  free(m);
}

void ts_host_drop_mapping_locked(tshare_channel *ch, ts_mapping *m) {
  if (--m->views != 0) return;
  if (m->kept) {
    ts_host_kept_idle_locked(m);
    return;
  }
  ts_u64map_remove(mappings_of(ch), m->alloc_id);
  if (m->retired_in_use && ts_host_defer_unmap_locked(ch, m)) return; /* at the next idle (retired_later) */
  TS_LOG(TS_LOG_DEBUG, "unmapped allocation %llu of %s: its last view went", (unsigned long long)m->alloc_id,
         ch->conn.peer_label);
  ts_host_unmap(m);
}

void ts_host_drop_mapping_in_child(tshare_channel *ch, ts_mapping *m) {
  /* Only tried: a thread of the parent may have held the lock at fork, and
   * the child has no such thread to let it go. Then the mapping stays. A
   * kept mapping goes too: the child receives nothing on the channel. */
  if (pthread_mutex_trylock(&ch->lock) != 0) return;
  if (--m->views == 0) {
    ts_u64map_remove(mappings_of(ch), m->alloc_id);
    ts_host_unmap(m);
  }
  pthread_mutex_unlock(&ch->lock);
}

static ts_release_done host_release(tshare_view *v) {
  tshare_channel *ch = v->ch;
  /* Unmapped before the release goes out: once the producer frees the
   * memory, nothing here may still reference it. */
  pthread_mutex_lock(&ch->lock);
  if (v->memory) ts_host_drop_mapping_locked(ch, v->memory);
  pthread_mutex_unlock(&ch->lock);
  return TS_RELEASE_NOW;
}

static void host_release_in_child(tshare_view *v) {
  if (v->memory) ts_host_drop_mapping_in_child(v->ch, v->memory);
}

static void host_source_retain(void *buf) { ts_host_buffer_retain(buf); }

static void host_memory_ref_locked(tshare_channel *ch, void *memory) {
  (void)ch;
  ((ts_mapping *)memory)->views++;
}

static void host_memory_unref_locked(tshare_channel *ch, void *memory) { ts_host_drop_mapping_locked(ch, memory); }

static void host_memory_keep_locked(tshare_channel *ch, void *memory, uint32_t share_flags) {
  ts_mapping *m = memory;
  if (!m->unsealed) ts_host_maybe_keep_locked(ch, m, share_flags);
}

static void host_memory_unref_in_child(tshare_channel *ch, void *memory) { ts_host_drop_mapping_in_child(ch, memory); }

static int host_chan_init(tshare_channel *ch) {
  void **slot = ts_backend_data(ch, &ts_host_backend);
  *slot = calloc(1, sizeof(host_chan));
  return *slot ? TSHARE_OK : TSHARE_E_NOMEM;
}

static void host_chan_free(tshare_channel *ch) {
  void **slot = ts_backend_data(ch, &ts_host_backend);
  host_chan *h = *slot;
  if (!h) return; /* the channel failed to open before its init */
  ts_host_keep_free(ch, h);
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&h->mappings, &pos, &key, &value);) ts_host_unmap(value);
  ts_u64map_free(&h->mappings);
  free(h);
  *slot = NULL;
}

/* What an unsealed file (TSHARE_MEM_HOST_FD) must be: its owner could
 * shrink it under the mapping (SIGBUS here), so it is taken only from a peer
 * of this process's uid, who could as well ptrace it. */
static int check_unsealed_locked(tshare_channel *ch, const tshare_share_frame *s, const struct stat *st) {
  if (ch->conn.peer.uid != (uint32_t)getuid())
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PERMISSION,
                   "import: share %llu is an unsealed file, taken only from a peer of this uid (%ld); %s runs as "
                   "uid %lu",
                   (unsigned long long)s->share_id, (long)getuid(), ch->conn.peer_label,
                   (unsigned long)ch->conn.peer.uid);
  if (!S_ISREG(st->st_mode))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                   "import: share %llu: the fd is not a regular file (a pipe, socket or device)",
                   (unsigned long long)s->share_id);
  return TSHARE_OK;
}

/* A new mapping of the fd (checked: a memfd sealed against shrinking; a
 * TSHARE_MEM_HOST_FD file was checked by the caller), in the channel's
 * mappings (ch->lock held). */
static int map_new_locked(tshare_channel *ch, const tshare_share_frame *s, int fd, const struct stat *st,
                          ts_mapping **out) {
  bool unsealed = s->mem_kind == TSHARE_MEM_HOST_FD;
  int seals = fcntl(fd, F_GET_SEALS);
  if (!unsealed && (seals < 0 || !(seals & F_SEAL_SHRINK)))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                   "import: share %llu: fd is not a memfd sealed against shrinking", (unsigned long long)s->share_id);
  ts_mapping *m = calloc(1, sizeof *m);
  if (!m) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "import: out of memory");
  m->alloc_id = s->alloc_id;
  m->fd = -1;
  m->size = (size_t)s->alloc_size;
  m->ino = (unsigned long)st->st_ino;
  m->dev = (unsigned long)st->st_dev;
  m->unsealed = unsealed;
  if (m->size) {
    m->base = mmap(NULL, m->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m->base == MAP_FAILED) {
      int e = errno;
      free(m);
      return ts_errsys(ch->err, sizeof ch->err, TSHARE_E_SYSTEM, e, "import: mmap(%llu bytes)",
                       (unsigned long long)s->alloc_size);
    }
  }
  if (ts_u64map_put(mappings_of(ch), m->alloc_id, m) != 0) {
    ts_host_unmap(m);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "import: out of memory");
  }
  m->forward_id = ts_host_next_alloc_id();
  TS_LOG(TS_LOG_DEBUG, "mapped allocation %llu (%zu bytes) of %s", (unsigned long long)m->alloc_id, m->size,
         ch->conn.peer_label);
  *out = m;
  return TSHARE_OK;
}

/* The mapping a memfd share with its fd lands in: the channel's one for the
 * allocation, or a new one that takes *fdp (set to -1) so views can be
 * shared on, unless keep_host_fds is off (ch->lock held). */
static int map_memfd_locked(tshare_channel *ch, const tshare_share_frame *s, int *fdp, ts_mapping **out) {
  struct stat st;
  if (fstat(*fdp, &st) != 0) return ts_errsys(ch->err, sizeof ch->err, TSHARE_E_SYSTEM, errno, "import: fstat");
  if (s->mem_kind == TSHARE_MEM_HOST_FD) { /* before the size: a pipe or socket has none */
    int rc = check_unsealed_locked(ch, s, &st);
    if (rc != TSHARE_OK) return rc;
  }
  if ((uint64_t)st.st_size < s->alloc_size)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_OUT_OF_BOUNDS,
                   "import: share %llu claims %llu bytes, the memfd has %lld", (unsigned long long)s->share_id,
                   (unsigned long long)s->alloc_size, (long long)st.st_size);
  ts_mapping *m = ts_u64map_get(mappings_of(ch), s->alloc_id);
  if (m && (m->ino != (unsigned long)st.st_ino || m->dev != (unsigned long)st.st_dev || m->size != s->alloc_size))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                   "import: allocation %llu arrived with another file or size than before",
                   (unsigned long long)s->alloc_id);
  if (!m) { /* else the same inode, checked when it was mapped */
    int rc = map_new_locked(ch, s, *fdp, &st, &m);
    if (rc != TSHARE_OK) return rc;
    if (ch->opts.keep_host_fds) { /* else the caller closes it: the mapping holds the memory */
      m->fd = *fdp;
      *fdp = -1;
    }
  }
  *out = m;
  return TSHARE_OK;
}

/* Map a host share into v, once per allocation and channel: a memfd that
 * came with the frame, or a mapping this end keeps (TSHARE_MEM_HOST_KEPT). */
static int host_import(tshare_channel *ch, const tshare_frame *f, int *fdp, void *stream, tshare_view *v) {
  (void)stream;
  const tshare_share_frame *s = &f->u.share;
  bool kept_share = s->mem_kind == TSHARE_MEM_HOST_KEPT;
  if (!kept_share && *fdp < 0)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL, "import: share %llu has no fd",
                   (unsigned long long)s->share_id);
  pthread_mutex_lock(&ch->lock);
  ts_mapping *m = NULL;
  int rc = kept_share ? ts_host_kept_mapping_locked(ch, s, &m) : map_memfd_locked(ch, s, fdp, &m);
  if (rc == TSHARE_OK) {
    if (!kept_share && !m->unsealed) ts_host_maybe_keep_locked(ch, m, s->share_flags);
    m->views++;
  }
  pthread_mutex_unlock(&ch->lock);
  if (rc != TSHARE_OK) return rc;
  v->memory = m;
  v->data = m->base ? (char *)m->base + s->tensor.byte_offset : NULL;
  return TSHARE_OK;
}

/* TSHARE_SET_AGAIN=0 (a debugging switch) leaves TSHARE_CAP_SET_AGAIN out
 * of the hello: every set travels whole, as to a peer without it. */
static bool sets_again_offered(void) {
  const char *s = getenv("TSHARE_SET_AGAIN");
  return !(s && strcmp(s, "0") == 0);
}

static uint64_t host_hello_caps(uint32_t transport_caps) {
  if (!(transport_caps & TS_TRANSPORT_PASSES_FDS)) return 0;
  return TSHARE_CAP_FD_PASSING | TSHARE_CAP_HOST_MEMFD | TSHARE_CAP_TENSOR_SETS | TSHARE_CAP_HOST_KEPT |
         TSHARE_CAP_HOST_FD | TSHARE_CAP_SET_HOST_KEPT | (sets_again_offered() ? TSHARE_CAP_SET_AGAIN : 0);
}

static const char *host_mem_kind_name(int mem_kind) {
  return mem_kind == TSHARE_MEM_HOST_KEPT ? "host memfd kept mapped"
         : mem_kind == TSHARE_MEM_HOST_FD ? "host unsealed file"
                                          : "host memfd";
}

const ts_backend ts_host_backend = {
    .name = "host",
    .mem_kinds = TS_MEM_KIND_BIT(TSHARE_MEM_HOST_MEMFD) | TS_MEM_KIND_BIT(TSHARE_MEM_HOST_KEPT) |
                 TS_MEM_KIND_BIT(TSHARE_MEM_HOST_FD),
    .mem_kind_name = host_mem_kind_name,
    .hello_caps = host_hello_caps,
    .chan_init = host_chan_init,
    .peer_gone = ts_host_peer_gone,
    .on_frame = ts_host_on_retire, /* retire frames naming host memory (backend.h) */
    .housekeeping = ts_host_housekeeping,
    .idle = ts_host_idle,
    .export_done = ts_host_export_done,
    .chan_free = host_chan_free,
    /* A forked child's copy: the same, its mappings are its own to unmap. */
    .chan_free_in_child = host_chan_free,
    .import = host_import,
    .release = host_release,
    .release_in_child = host_release_in_child,
    .share_view = host_share_view,
    .source_retain = host_source_retain,
    .source_release = ts_host_buffer_release,
    .source_lend = ts_host_lend_in_set,
    .set_remote_check = ts_ucx_set_remote_check, /* across hosts, a set's buffers are read over UCX */
    .set_send_remote = ts_ucx_set_send_remote,
    .share_remote = ts_ucx_share_remote, /* a share across hosts: read over UCX (GPU bytes staged too) */
    .source_keep_state = ts_host_keep_state_in_set,
    .memory_ref_locked = host_memory_ref_locked,
    .memory_unref_locked = host_memory_unref_locked,
    .memory_unref_in_child = host_memory_unref_in_child,
    .memory_keep_locked = host_memory_keep_locked,
};
