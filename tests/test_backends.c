/* The backend table's registry (backends.c): a backend that lives only in
 * this test program, registered at run time, is found by the session like
 * the built-in ones. It is a "heap" backend: a share names memory of this
 * very process by its address (in the handle bytes of a CUDA IPC share,
 * which it stands in for: the wire has no kind of its own for it), so it
 * works only between two channels of one process. Its hooks count their
 * calls, and its per-channel state lives in the channel's backend data. */
#include "backend.h"
#include "error_detail.h"
#include "harness.h"
#include "session.h"
#include "tshare/share.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* What the heap backend's hooks saw, over every channel. */
static atomic_int inits, frees, imports, releases, housekeepings, gone;

typedef struct heap_chan {
  int imports; /* views imported on this channel */
} heap_chan;

/* The handle bytes of a heap share: whose memory, and where. */
typedef struct heap_handle {
  long pid;
  void *base;
} heap_handle;

static const ts_backend heap_backend;

static uint64_t heap_hello_caps(uint32_t transport_caps) {
  (void)transport_caps;
  return 0;
}

static const char *heap_mem_kind_name(int kind) {
  (void)kind;
  return "heap memory";
}

static int heap_chan_init(tshare_channel *ch) {
  void **slot = ts_backend_data(ch, &heap_backend);
  *slot = calloc(1, sizeof(heap_chan));
  atomic_fetch_add(&inits, 1);
  return *slot ? TSHARE_OK : TSHARE_E_NOMEM;
}

static void heap_chan_free(tshare_channel *ch) {
  void **slot = ts_backend_data(ch, &heap_backend);
  free(*slot);
  *slot = NULL;
  atomic_fetch_add(&frees, 1);
}

static void heap_peer_gone(tshare_channel *ch) {
  (void)ch;
  atomic_fetch_add(&gone, 1);
}

static int heap_housekeeping(tshare_channel *ch, int64_t deadline, ts_backend_wait *wait) {
  (void)ch, (void)deadline;
  *wait = TS_BACKEND_IDLE;
  atomic_fetch_add(&housekeepings, 1);
  return TSHARE_OK;
}

static int heap_import(tshare_channel *ch, const tshare_frame *f, int *fdp, void *stream, struct tshare_view *v) {
  (void)fdp, (void)stream;
  heap_handle h;
  memcpy(&h, f->u.share.handle, sizeof h);
  if (h.pid != (long)getpid())
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED, "import: heap memory of process %ld", h.pid);
  heap_chan *hc = *ts_backend_data(ch, &heap_backend);
  hc->imports++;
  v->memory = h.base;
  v->data = (char *)h.base + f->u.share.tensor.byte_offset;
  atomic_fetch_add(&imports, 1);
  return TSHARE_OK;
}

static ts_release_done heap_release(struct tshare_view *v) {
  (void)v;
  atomic_fetch_add(&releases, 1);
  return TS_RELEASE_NOW; /* nothing to wait for: the session sends the release */
}

static int heap_share_view(tshare_channel *ch, struct tshare_view *v, const tshare_tensor_desc *desc, void *stream,
                           const char *tag, struct ts_export *e, int timeout_ms, uint64_t *share_id) {
  (void)v, (void)desc, (void)stream, (void)tag, (void)timeout_ms, (void)share_id;
  ts_export_drop(e);
  return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED, "share: heap views are not shared on");
}

static const ts_backend heap_backend = {
    .name = "heap",
    .mem_kinds = TS_MEM_KIND_BIT(TSHARE_MEM_CUDA_IPC),
    .mem_kind_name = heap_mem_kind_name,
    .hello_caps = heap_hello_caps,
    .chan_init = heap_chan_init,
    .peer_gone = heap_peer_gone,
    .chan_free = heap_chan_free,
    .housekeeping = heap_housekeeping,
    .import = heap_import,
    .release = heap_release,
    .share_view = heap_share_view,
};

/* ---- the producer's side: a heap share sent through the session ------- */

static void count_drop(void *owner) { atomic_fetch_add((atomic_int *)owner, 1); }

static int share_heap(tshare_channel *ch, void *base, size_t size, const tshare_tensor_desc *desc, atomic_int *dropped,
                      uint64_t *share_id) {
  ts_export *e = calloc(1, sizeof *e);
  CHECK(e != NULL);
  e->release = count_drop;
  e->owner = dropped;
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SHARE;
  tshare_share_frame *s = &f.u.share;
  s->alloc_id = 7;
  s->alloc_size = size;
  s->mem_kind = TSHARE_MEM_CUDA_IPC;
  s->device_type = TSHARE_DEVICE_CUDA;
  s->handle_len = TSHARE_HANDLE_MAX;
  heap_handle h = {(long)getpid(), base};
  memcpy(s->handle, &h, sizeof h);
  s->tensor = *desc;
  return ts_share_send_export(ch, &f, -1, e, 5000, share_id);
}

/* ---- two channels of this process -------------------------------------- */

typedef struct opener {
  int fd;
  tshare_channel *ch;
  int rc;
} opener;

static void *open_end(void *arg) {
  opener *o = arg;
  tshare_error err;
  o->rc = tshare_channel_open_socket(o->fd, NULL, &o->ch, &err);
  return NULL;
}

static void open_pair(tshare_channel **producer, tshare_channel **consumer) {
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  opener other = {sv[1], NULL, -1};
  pthread_t t;
  CHECK(pthread_create(&t, NULL, open_end, &other) == 0);
  opener mine = {sv[0], NULL, -1};
  open_end(&mine);
  CHECK(pthread_join(t, NULL) == 0);
  CHECK_EQ(mine.rc, TSHARE_OK);
  CHECK_EQ(other.rc, TSHARE_OK);
  *producer = mine.ch;
  *consumer = other.ch;
}

static tshare_tensor_desc ints(int64_t n, uint64_t offset) {
  return tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, &n, offset);
}

/* A share of the heap backend's memory goes out, is imported by it, read,
 * released through it, and comes back to the producer. */
TS_TEST(a_registered_backend_shares_receives_and_releases_over_a_channel_pair) {
  CHECK_RC(ts_backend_register(&heap_backend), TSHARE_OK, "register");
  tshare_channel *producer, *consumer;
  open_pair(&producer, &consumer);
  CHECK_EQ(atomic_load(&inits), 2); /* each channel's backend data, from its own init hook */

  int32_t numbers[16];
  for (int i = 0; i < 16; i++) numbers[i] = i * 3;
  tshare_tensor_desc d = ints(8, 8 * sizeof(int32_t)); /* the second half */
  atomic_int dropped = 0;
  uint64_t id = 0;
  CHECK_RC(share_heap(producer, numbers, sizeof numbers, &d, &dropped, &id), TSHARE_OK,
           tshare_channel_last_error(producer));
  CHECK_EQ(tshare_share_is_released(producer, id), 0);

  tshare_view *v;
  CHECK_RC(tshare_view_recv(consumer, 5000, &v), TSHARE_OK, tshare_channel_last_error(consumer));
  CHECK_EQ(atomic_load(&imports), 1);
  CHECK(atomic_load(&housekeepings) > 0); /* the receive ran every backend's housekeeping */
  const int32_t *got = tshare_view_data(v);
  CHECK(got == numbers + 8); /* no copy: the memory itself, at the share's offset */
  for (int i = 0; i < 8; i++) CHECK_EQ(got[i], (i + 8) * 3);
  heap_chan *hc = *ts_backend_data(consumer, &heap_backend);
  CHECK_EQ(hc->imports, 1);

  tshare_view_release(v);
  CHECK_EQ(atomic_load(&releases), 1);
  /* This thread drives the consumer: its release goes with its next call. */
  int rc = tshare_channel_poll(consumer, 0);
  CHECK(rc == TSHARE_E_TIMEOUT || rc == TSHARE_OK);
  CHECK_RC(tshare_channel_wait_released(producer, id, 5000), TSHARE_OK, tshare_channel_last_error(producer));
  CHECK_EQ(tshare_share_is_released(producer, id), 1);
  CHECK_EQ(atomic_load(&dropped), 1); /* the session's release epilogue reached the producer */

  tshare_channel_close(consumer);
  tshare_channel_close(producer);
  CHECK_EQ(atomic_load(&frees), 2);
  CHECK(atomic_load(&gone) >= 2);
}

/* The host backend is still found for its kind beside a registered one. */
TS_TEST(a_registered_backend_leaves_the_other_kinds_to_the_built_in_ones) {
  CHECK_RC(ts_backend_register(&heap_backend), TSHARE_OK, "register");
  CHECK(ts_backend_for_mem_kind(TSHARE_MEM_CUDA_IPC) == &heap_backend);
  const ts_backend *host = ts_backend_for_mem_kind(TSHARE_MEM_HOST_MEMFD);
  CHECK(host != NULL && host != &heap_backend);
  CHECK(ts_backend_for_mem_kind(0) == NULL);
  CHECK(ts_backend_for_mem_kind(99) == NULL);
}

/* A table without a required hook, or claiming what another registered
 * backend claims, is refused. */
TS_TEST(a_backend_table_missing_hooks_or_overlapping_is_refused) {
  ts_backend incomplete = heap_backend;
  incomplete.release = NULL;
  CHECK_EQ(ts_backend_register(&incomplete), TSHARE_E_INVALID_ARG);
  CHECK_EQ(ts_backend_register(NULL), TSHARE_E_INVALID_ARG);
  ts_backend frames_without_handler = heap_backend;
  frames_without_handler.frame_types = TS_FRAME_TYPE_BIT(TSHARE_FRAME_EVENT);
  CHECK_EQ(ts_backend_register(&frames_without_handler), TSHARE_E_INVALID_ARG);
  CHECK_RC(ts_backend_register(&heap_backend), TSHARE_OK, "register");
  ts_backend twin = heap_backend;
  twin.name = "twin";
  CHECK_EQ(ts_backend_register(&twin), TSHARE_E_INVALID_ARG);
}

TS_TEST_MAIN
