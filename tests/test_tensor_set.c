/* Tensor sets between two real processes: sets of 1, 290 and 10,000 named
 * tensors with metadata, each memory travelling once, writes seen by the
 * producer, one release for the whole set, a dead consumer freeing
 * everything; the builder's bounds; hostile sets from a hand-rolled peer
 * (refused, released back, fds closed, the channel usable after); a peer of
 * the previous wire minor refused. */
#include "hostile_set.h"
#include "harness.h"
#include "proc_util.h"
#include "tshare/cuda.h"
#include "tshare/set.h"

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/mman.h>

static const tshare_dtype F32 = {TSHARE_DTYPE_FLOAT, 32, 1};
#define ELEMS 4 /* floats in each tensor of the sets below */

/* The sets both ends agree on: tensor i of a set lives in memory i % mems at
 * byte offset (i / mems) * 16, holds 10i, 10i+1, ..., and is named name_of(i). */
typedef struct set_plan {
  size_t count, mems, meta_len;
} set_plan;

static const set_plan PLANS[] = {{1, 1, 0}, {290, 1, 100}, {10000, 3, 5000}};
#define NPLANS (sizeof PLANS / sizeof *PLANS)

/* Names of 1 byte (tensor 0), of 1024 bytes (tensor 1) and a real model's. */
static void name_of(size_t i, char *out) {
  if (i == 0) {
    strcpy(out, "w");
  } else if (i == 1) {
    memset(out, 'n', TSHARE_SET_NAME_MAX);
    out[TSHARE_SET_NAME_MAX] = '\0';
  } else {
    snprintf(out, TSHARE_SET_NAME_MAX + 1, "vision_tower.vision_model.encoder.layers.%zu.self_attn.out_proj.weight", i);
  }
}

static uint8_t meta_byte(size_t i) { return (uint8_t)(i * 7 + 3); }

static tshare_tensor_desc desc_of(const set_plan *p, size_t i) {
  int64_t n = ELEMS;
  return tshare_tensor_contiguous(F32, 1, &n, (uint64_t)(i / p->mems) * ELEMS * sizeof(float));
}

static tshare_set_builder *build(const set_plan *p, tshare_host_buffer **bufs) {
  tshare_set_builder *b = tshare_set_builder_create();
  CHECK(b);
  char name[TSHARE_SET_NAME_MAX + 1];
  tshare_error err;
  for (size_t i = 0; i < p->count; i++) {
    tshare_tensor_desc d = desc_of(p, i);
    float *f = (float *)((char *)tshare_host_buffer_data(bufs[i % p->mems]) + d.byte_offset);
    for (int j = 0; j < ELEMS; j++) f[j] = (float)(10 * i + (size_t)j);
    name_of(i, name);
    CHECK_RC(tshare_set_builder_add_host(b, name, bufs[i % p->mems], &d, &err), TSHARE_OK, err.message);
  }
  uint8_t *meta = malloc(p->meta_len + 1);
  for (size_t i = 0; i < p->meta_len; i++) meta[i] = meta_byte(i);
  CHECK_RC(tshare_set_builder_set_meta(b, meta, p->meta_len, &err), TSHARE_OK, err.message);
  free(meta);
  CHECK_EQ(tshare_set_builder_count(b), p->count);
  return b;
}

/* Everything the plan says, read through the set; tensor 0 is written. */
static void check_set(tshare_set *s, const set_plan *p) {
  CHECK_EQ(tshare_set_count(s), p->count);
  char name[TSHARE_SET_NAME_MAX + 1];
  for (size_t i = 0; i < p->count; i++) {
    name_of(i, name);
    if (strcmp(tshare_set_name(s, i), name) != 0) TS_FAIL("name %zu is '%s'", i, tshare_set_name(s, i));
    const float *f = tshare_set_data(s, i);
    for (int j = 0; j < ELEMS; j++)
      if (f[j] != (float)(10 * i + (size_t)j)) TS_FAIL("tensor %zu [%d] = %f", i, j, (double)f[j]);
    CHECK_EQ(tshare_set_desc(s, i)->shape[0], ELEMS);
  }
  CHECK(tshare_set_name(s, p->count) == NULL);
  name_of(p->count - 1, name);
  CHECK_EQ(tshare_set_find(s, name), (long)p->count - 1);
  CHECK_EQ(tshare_set_find(s, "no such tensor"), -1);
  size_t len;
  const uint8_t *meta = tshare_set_meta(s, &len);
  CHECK_EQ(len, p->meta_len);
  for (size_t i = 0; i < len; i++)
    if (meta[i] != meta_byte(i)) TS_FAIL("metadata byte %zu is %u", i, meta[i]);
  CHECK(len || meta == NULL);
}

/* This process keeps no host mapping past its views (TSHARE_HOST_KEPT_MAX,
 * read once, before its first channel). */
static void keep_no_host_mappings(void) { CHECK(setenv("TSHARE_HOST_KEPT_MAX", "0", 1) == 0); }

/* Receives each plan's set; each memory came with one fd however many tensors
 * it holds; the set stays until its last view goes. */
static void consumer_receives_sets(int fd) {
  keep_no_host_mappings(); /* a set's memory goes with its last view (test_set_kept: kept ones) */
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  for (size_t k = 0; k < NPLANS; k++) {
    int fds_before = count_open_fds();
    tshare_set *s;
    CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(count_open_fds() - fds_before, (int)PLANS[k].mems); /* one memfd per memory, kept mapped */
    CHECK_EQ(count_mappings("memfd:tshare-set"), (int)PLANS[k].mems);
    check_set(s, &PLANS[k]);
    tshare_view *v;
    CHECK_RC(tshare_set_view(s, 0, &v), TSHARE_OK, "");
    CHECK_EQ(tshare_view_share_id(v), tshare_set_id(s));
    tshare_set_release(s); /* the view keeps it */
    float *w = tshare_view_data(v);
    w[0] = -1.0f - (float)k; /* the producer waits for the release, then reads it */
    tshare_view_release(v);
    CHECK_EQ(count_mappings("memfd:tshare-set"), 0);
    CHECK_EQ(count_open_fds(), fds_before);
  }
  tshare_set *none;
  CHECK_RC(tshare_set_recv(ch, 10000, &none), TSHARE_END, tshare_channel_last_error(ch));
  CHECK(none == NULL);
  tshare_channel_close(ch);
}

static tshare_host_buffer **make_buffers(size_t n, size_t size) {
  tshare_host_buffer **bufs = calloc(n, sizeof *bufs);
  for (size_t i = 0; i < n; i++) CHECK_RC(tshare_host_buffer_create(size, "tshare-set", &bufs[i], NULL), TSHARE_OK, "");
  return bufs;
}

static void destroy_buffers(tshare_host_buffer **bufs, size_t n) {
  for (size_t i = 0; i < n; i++) tshare_host_buffer_destroy(bufs[i]);
  free(bufs);
}

TS_TEST(sets_of_1_290_and_10000_tensors_round_trip) {
  int sock;
  pid_t pid = fork_with_socket(consumer_receives_sets, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  for (size_t k = 0; k < NPLANS; k++) {
    const set_plan *p = &PLANS[k];
    tshare_host_buffer **bufs = make_buffers(p->mems, (p->count / p->mems + 1) * ELEMS * sizeof(float));
    tshare_set_builder *b = build(p, bufs);
    uint64_t id;
    CHECK_RC(tshare_set_send(ch, b, NULL, 10000, &id), TSHARE_OK, tshare_channel_last_error(ch));
    tshare_set_builder_destroy(b); /* the sent set keeps its own references */
    CHECK_EQ(tshare_share_is_released(ch, id), 0);
    CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(tshare_channel_outstanding(ch), 0);
    for (size_t m = 0; m < p->mems; m++) CHECK_EQ(tshare_host_buffer_outstanding(bufs[m]), 0);
    CHECK_EQ(((float *)tshare_host_buffer_data(bufs[0]))[0], -1.0f - (float)k); /* the consumer's write */
    destroy_buffers(bufs, p->mems);
  }
  CHECK_RC(tshare_channel_send_bye(ch, 0, 1000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

/* Takes the 290-tensor set and a view of it, then dies holding both. */
static void consumer_dies_holding_a_set(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  tshare_set *s;
  CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_view *v;
  CHECK_RC(tshare_set_view(s, 5, &v), TSHARE_OK, "");
  kill(getpid(), SIGKILL);
}

TS_TEST(a_consumer_killed_holding_a_set_frees_everything) {
  int sock;
  pid_t pid = fork_with_socket(consumer_dies_holding_a_set, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  tshare_host_buffer **bufs = make_buffers(1, 4096 * 4);
  tshare_set_builder *b = build(&PLANS[1], bufs);
  uint64_t id;
  CHECK_RC(tshare_set_send(ch, b, NULL, 10000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_set_builder_destroy(b);
  CHECK_EQ(tshare_host_buffer_outstanding(bufs[0]), 1);
  CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_share_is_released(ch, id), 1);
  CHECK_EQ(tshare_host_buffer_outstanding(bufs[0]), 0);
  int st = wait_child(pid);
  CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
  tshare_channel_close(ch);
  destroy_buffers(bufs, 1);
}

/* ---- views released from other threads ------------------------------------ */

typedef struct view_batch {
  tshare_view **views;
  size_t count;
} view_batch;

static void *release_views(void *arg) {
  view_batch *b = arg;
  for (size_t i = 0; i < b->count; i++) tshare_view_release(b->views[i]);
  return NULL;
}

typedef struct desc_readers {
  tshare_view **views;
  const tshare_tensor_desc *want; /* each member's, copied from the set */
  size_t count;
  size_t wrong;
} desc_readers;

/* Every view's descriptor, against the member's. */
static void *read_descs(void *arg) {
  desc_readers *r = arg;
  size_t wrong = 0;
  for (size_t i = 0; i < r->count; i++) {
    const tshare_tensor_desc *d = tshare_view_desc(r->views[i]);
    if (!d || memcmp(d, &r->want[i], sizeof *d) != 0) wrong++;
  }
  r->wrong = wrong;
  return NULL;
}

/* Every tensor of the 290-tensor set as a view, released by four threads
 * while this one lets go of the handle and drives the channel: one release
 * goes out when the last view went, whichever thread that was. Before that,
 * four threads read every view's descriptor at once, which a view fills in
 * when first read: each is its member's, whichever thread filled it. */
static void consumer_releases_from_threads(int fd) {
  keep_no_host_mappings(); /* a set's memory goes with its last view (test_set_kept: kept ones) */
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  tshare_set *s;
  CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_OK, tshare_channel_last_error(ch));
  size_t n = tshare_set_count(s);
  tshare_view **views = calloc(n, sizeof *views);
  for (size_t i = 0; i < n; i++) CHECK_RC(tshare_set_view(s, i, &views[i]), TSHARE_OK, "");
  tshare_tensor_desc *want = calloc(n, sizeof *want);
  for (size_t i = 0; i < n; i++) want[i] = *tshare_set_desc(s, i);
  tshare_set_release(s); /* the views keep the set, and what their descriptors are filled from */
  pthread_t threads[4];
  desc_readers readers[4];
  for (size_t t = 0; t < 4; t++) {
    readers[t] = (desc_readers){views, want, n, 0};
    CHECK(pthread_create(&threads[t], NULL, read_descs, &readers[t]) == 0);
  }
  for (size_t t = 0; t < 4; t++) {
    pthread_join(threads[t], NULL);
    CHECK_EQ(readers[t].wrong, 0);
  }
  free(want);
  view_batch batches[4];
  for (size_t t = 0; t < 4; t++) {
    batches[t] = (view_batch){views + t * n / 4, (t + 1) * n / 4 - t * n / 4};
    CHECK(pthread_create(&threads[t], NULL, release_views, &batches[t]) == 0);
  }
  for (size_t t = 0; t < 4; t++) pthread_join(threads[t], NULL);
  free(views);
  CHECK_EQ(count_mappings("memfd:tshare-set"), 0);
  tshare_set *none;
  CHECK_RC(tshare_set_recv(ch, 10000, &none), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(views_released_from_threads_release_the_set_once) {
  int sock;
  pid_t pid = fork_with_socket(consumer_releases_from_threads, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  tshare_host_buffer **bufs = make_buffers(1, 4096 * 4);
  tshare_set_builder *b = build(&PLANS[1], bufs);
  uint64_t id;
  CHECK_RC(tshare_set_send(ch, b, NULL, 10000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_set_builder_destroy(b);
  CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_host_buffer_outstanding(bufs[0]), 0);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 1000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
  destroy_buffers(bufs, 1);
}

/* ---- a process out of fds ---------------------------------------------------- */

enum { MANY_MEMS = 80, LOW_FD_LIMIT = 48 };

/* Under an fd limit of 48 a set of 80 memories cannot be held: it is refused
 * naming EMFILE, what it had mapped goes, and the next set comes. */
static void consumer_out_of_fds(int fd) {
  struct rlimit rl;
  CHECK(getrlimit(RLIMIT_NOFILE, &rl) == 0);
  if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < LOW_FD_LIMIT) TS_SKIP("hard fd limit %lu", rl.rlim_max);
  rl.rlim_cur = LOW_FD_LIMIT;
  CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0);
  keep_no_host_mappings(); /* every fd it held goes with the set */
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  int fds_before = count_open_fds();
  expect_refused(ch, TSHARE_E_LIMIT, "EMFILE, RLIMIT_NOFILE 48"); /* the cause and the limit, by name */
  CHECK_EQ(count_mappings("memfd:tshare-set"), 0);
  tshare_set *s;
  CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_OK, tshare_channel_last_error(ch));
  check_set(s, &PLANS[0]);
  tshare_set_release(s);
  CHECK_EQ(count_open_fds(), fds_before);
  CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(a_set_over_the_fd_limit_is_refused_and_the_next_one_comes) {
  int sock;
  pid_t pid = fork_with_socket(consumer_out_of_fds, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  const set_plan many = {MANY_MEMS, MANY_MEMS, 0};
  tshare_host_buffer **bufs = make_buffers(MANY_MEMS, 4096);
  tshare_set_builder *b = build(&many, bufs);
  uint64_t ids[2];
  CHECK_RC(tshare_set_send(ch, b, NULL, 10000, &ids[0]), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_set_builder_destroy(b);
  tshare_host_buffer **one = make_buffers(1, 4096);
  b = build(&PLANS[0], one);
  CHECK_RC(tshare_set_send(ch, b, NULL, 10000, &ids[1]), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_set_builder_destroy(b);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 1000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, 0, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  for (size_t m = 0; m < MANY_MEMS; m++) CHECK_EQ(tshare_host_buffer_outstanding(bufs[m]), 0);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
  destroy_buffers(bufs, MANY_MEMS);
  destroy_buffers(one, 1);
}

/* A consumer that looks for a set without waiting (what a binding's recv of
 * "a share or a set, whichever comes first" does) while single shares come
 * reads no further than the first share: the shares behind it stay with the
 * producer's stream, not in this end's fd budget, and none is refused. */
#define SHARES_BEHIND 24
static int sent_all[2]; /* the producer writes a byte once every share went out */

static void consumer_looks_for_sets_between_shares(int fd) {
  close(sent_all[1]);
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = "consumer";
  o.max_unclaimed_fds = 2;
  tshare_channel *ch = NULL;
  tshare_error err;
  CHECK_RC(tshare_channel_open_socket(fd, &o, &ch, &err), TSHARE_OK, err.message);
  char byte;
  CHECK_EQ(read(sent_all[0], &byte, 1), 1);
  for (int i = 0; i < SHARES_BEHIND; i++) {
    tshare_set *s = NULL;
    CHECK_RC(tshare_set_recv(ch, 0, &s), TSHARE_E_TIMEOUT, tshare_channel_last_error(ch));
    tshare_view *v;
    CHECK_RC(tshare_view_recv(ch, 10000, &v), TSHARE_OK, tshare_channel_last_error(ch));
    char want[16];
    snprintf(want, sizeof want, "%d", i);
    if (strcmp(tshare_view_tag(v), want) != 0) TS_FAIL("share %d came as '%s'", i, tshare_view_tag(v));
    tshare_view_release(v);
  }
  tshare_view *none;
  CHECK_RC(tshare_view_recv(ch, 10000, &none), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(looking_for_a_set_does_not_read_past_a_waiting_share) {
  CHECK(pipe(sent_all) == 0);
  int sock;
  pid_t pid = fork_with_socket(consumer_looks_for_sets_between_shares, &sock);
  close(sent_all[0]);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  tshare_host_buffer **bufs = make_buffers(SHARES_BEHIND, 4096);
  for (int i = 0; i < SHARES_BEHIND; i++) {
    tshare_tensor_desc d = desc_of(&PLANS[0], 0);
    char tag[16];
    snprintf(tag, sizeof tag, "%d", i);
    CHECK_RC(tshare_share_host(ch, bufs[i], &d, tag, NULL, 10000, NULL), TSHARE_OK, tshare_channel_last_error(ch));
  }
  CHECK_RC(tshare_channel_send_bye(ch, 0, 1000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(write(sent_all[1], "x", 1), 1);
  close(sent_all[1]);
  CHECK_RC(tshare_channel_wait_released(ch, 0, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
  destroy_buffers(bufs, SHARES_BEHIND);
}

/* ---- the builder's bounds ------------------------------------------------- */

static void count_retain(void *keep) { ++*(int *)keep; }
static void count_drop(void *keep) { ++*(int *)keep; }

TS_TEST(the_builder_refuses_what_a_peer_would) {
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(4096, "tshare-set", &buf, NULL), TSHARE_OK, "");
  tshare_set_builder *b = tshare_set_builder_create();
  int64_t n = 16;
  tshare_tensor_desc d = tshare_tensor_contiguous(F32, 1, &n, 0);
  tshare_error err;
  CHECK_RC(tshare_set_builder_add_host(b, "a", buf, &d, &err), TSHARE_OK, err.message);
  CHECK_RC(tshare_set_builder_add_host(b, "a", buf, &d, &err), TSHARE_E_INVALID_ARG, err.message);
  CHECK(strstr(err.message, "'a' is already") != NULL);
  char long_name[TSHARE_SET_NAME_MAX + 2];
  memset(long_name, 'x', sizeof long_name - 1);
  long_name[sizeof long_name - 1] = '\0';
  CHECK_RC(tshare_set_builder_add_host(b, long_name, buf, &d, &err), TSHARE_E_TOO_LARGE, err.message);
  CHECK(strstr(err.message, "1025 bytes") != NULL);
  CHECK_RC(tshare_set_builder_add_host(b, "", buf, &d, &err), TSHARE_E_TOO_LARGE, err.message);
  CHECK_RC(tshare_set_builder_add_host(b, "bad\xff", buf, &d, &err), TSHARE_E_MALFORMED, err.message);
  d.byte_offset = 4096 - 8; /* 16 floats from here run past the buffer */
  CHECK_RC(tshare_set_builder_add_host(b, "outside", buf, &d, &err), TSHARE_E_OUT_OF_BOUNDS, err.message);
  printf("%s\n", err.message);
  void *big = calloc(1, TSHARE_SET_META_MAX + 1);
  CHECK_RC(tshare_set_builder_set_meta(b, big, TSHARE_SET_META_MAX + 1, &err), TSHARE_E_TOO_LARGE, err.message);
  CHECK_RC(tshare_set_builder_set_meta(b, big, TSHARE_SET_META_MAX, &err), TSHARE_OK, err.message);
  free(big);
  /* Not device memory at all: refused with why (no driver here; on a GPU
   * machine, not memory of cudaMalloc), and nothing is added. */
  int rc = tshare_set_builder_add_cuda(b, "gpu.weight", (void *)0x1000, &d, &err);
  CHECK(rc == TSHARE_E_NO_DEVICE || rc == TSHARE_E_INVALID_ARG);
  printf("%s\n", err.message);
  int dropped = 0;
  rc = tshare_set_builder_add_cuda_keep(b, "gpu.kept", (void *)0x1000, &d, count_retain, count_drop, &dropped, &err);
  CHECK(rc == TSHARE_E_NO_DEVICE || rc == TSHARE_E_INVALID_ARG);
  CHECK_EQ(dropped, 1); /* the keep goes at once when the call fails */
  rc = tshare_set_builder_add_cuda_keep(b, "gpu.kept", (void *)0x1000, &d, NULL, count_drop, &dropped, &err);
  CHECK_RC(rc, TSHARE_E_INVALID_ARG, err.message);
  CHECK_EQ(dropped, 2);
  CHECK_RC(tshare_set_builder_add_cuda_buffer(b, "gpu.buffer", NULL, &d, &err), TSHARE_E_INVALID_ARG, err.message);
  CHECK_EQ(tshare_set_builder_count(b), 1);
  CHECK_EQ(tshare_host_buffer_outstanding(buf), 1); /* the builder's reference */
  tshare_set_builder_destroy(b);
  CHECK_EQ(tshare_host_buffer_outstanding(buf), 0);
  tshare_set_builder_destroy(NULL);
  tshare_host_buffer_destroy(buf);
}

/* ---- hostile sets ------------------------------------------------------------ */

/* An end frame that says the producer's stream must be waited for. */
static void send_end_with_event(tshare_channel *ch, uint64_t id) {
  tshare_frame f = set_step(TSHARE_SET_END, id);
  f.flags = TSHARE_FRAME_FLAG_HAS_EVENT;
  f.u.set.u.end.event_slot = 0;
  f.u.set.u.end.event_generation = 1;
  send_raw(ch, &f, -1);
}

/* Sets 11..15, 19 and 18 are each wrong in one way, each sent once the one
 * before came back; 16 is right; then 17 is cut off by this process's end. */
static void hostile_producer(int fd) {
  tshare_channel *ch = open_socket_only_channel(fd, "hostile");
  int memfd = sealed_memfd();
  send_begin(ch, 11, 1, 1); /* a tensor past its memory's end */
  send_mem(ch, 11, memfd, TSHARE_MEM_HOST_MEMFD);
  send_member(ch, 11, 0, "a", 4096 - 32);
  send_end(ch, 11);
  wait_released_back(ch, 11);
  send_begin(ch, 12, 2, 2); /* two tensors of one name */
  send_mem(ch, 12, memfd, TSHARE_MEM_HOST_MEMFD);
  send_member(ch, 12, 0, "a", 0);
  send_member(ch, 12, 1, "a", 64);
  send_end(ch, 12);
  wait_released_back(ch, 12);
  send_begin(ch, 13, 2, 2); /* cut off by a share */
  send_mem(ch, 13, memfd, TSHARE_MEM_HOST_MEMFD);
  int64_t n = 4;
  tshare_frame share = memfd_share_frame(4096, tshare_tensor_contiguous(F32, 1, &n, 0));
  share.u.share.share_id = 100;
  share.u.share.alloc_id = 100;
  send_raw(ch, &share, memfd);
  wait_released_back(ch, 13);
  send_begin(ch, 14, 1, 1); /* CUDA memory */
  send_mem(ch, 14, -1, TSHARE_MEM_CUDA_IPC);
  send_member(ch, 14, 0, "a", 0);
  send_end(ch, 14);
  wait_released_back(ch, 14);
  send_begin(ch, 15, 2, 2); /* ends before its tensors do */
  send_mem(ch, 15, memfd, TSHARE_MEM_HOST_MEMFD);
  send_member(ch, 15, 0, "a", 0);
  send_end(ch, 15);
  wait_released_back(ch, 15);
#ifdef TSHARE_TEST_HAVE_CUDA /* chunk frames are the CUDA backend's */
  send_begin(ch, 19, 1, 1);  /* a chunk frame, then host memory of one piece */
  tshare_frame chunk;
  memset(&chunk, 0, sizeof chunk);
  chunk.type = TSHARE_FRAME_CHUNK;
  chunk.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  chunk.u.chunk = (tshare_chunk_frame){.alloc_id = 1900, .index = 1, .count = 2, .size = 4096};
  send_raw(ch, &chunk, memfd);
  send_mem(ch, 19, memfd, TSHARE_MEM_HOST_MEMFD);
  send_member(ch, 19, 0, "a", 0);
  send_end(ch, 19);
  wait_released_back(ch, 19);
#endif
  send_begin(ch, 18, 1, 1); /* an event to wait on, and no device memory */
  send_mem(ch, 18, memfd, TSHARE_MEM_HOST_MEMFD);
  send_member(ch, 18, 0, "a", 0);
  send_end_with_event(ch, 18);
  wait_released_back(ch, 18);
  send_begin(ch, 16, 2, 2); /* right */
  send_mem(ch, 16, memfd, TSHARE_MEM_HOST_MEMFD);
  send_member(ch, 16, 0, "a", 0);
  send_member(ch, 16, 1, "b", 64);
  send_end(ch, 16);
  wait_released_back(ch, 16);
  wait_released_back(ch, 100);
  send_begin(ch, 17, 1, 1); /* cut off: this process ends */
  send_mem(ch, 17, memfd, TSHARE_MEM_HOST_MEMFD);
  close(memfd);
  _exit(0);
}

/* Refused with whatever code the machine gives (a device there or not). */
static void expect_refused_any(tshare_channel *ch, const char *cause) {
  tshare_set *s = (tshare_set *)1;
  int rc = tshare_set_recv(ch, 5000, &s);
  CHECK(rc != TSHARE_OK && rc != TSHARE_E_TIMEOUT);
  CHECK(s == NULL);
  const char *msg = tshare_channel_last_error(ch);
  printf("%s\n", msg);
  if (!strstr(msg, cause)) TS_FAIL("'%s' does not say '%s'", msg, cause);
}

TS_TEST(hostile_sets_are_refused_released_back_and_the_channel_goes_on) {
  int sock;
  pid_t pid = fork_with_socket(hostile_producer, &sock);
  tshare_channel *ch = open_socket_channel(sock, "consumer", NULL, NULL);
  /* The CUDA sets below start the driver where there is one, which opens
   * its device files for good: counted in before, not taken for a leak. */
  (void)tshare_cuda_device_count();
  int fds_before = count_open_fds();
  expect_refused(ch, TSHARE_E_OUT_OF_BOUNDS, "tensor set 11");
  expect_refused(ch, TSHARE_E_PROTOCOL, "two tensors are named 'a'");
  expect_refused(ch, TSHARE_E_PROTOCOL, "cut off by a share frame");
  expect_refused_any(ch, "memory 0"); /* CUDA memory under a handle of zeros: no device maps it */
  expect_refused(ch, TSHARE_E_PROTOCOL, "ended with 1 of 2 tensors");
#ifdef TSHARE_TEST_HAVE_CUDA
  expect_refused(ch, TSHARE_E_PROTOCOL, "chunks came before a share of one piece");
#endif
  expect_refused(ch, TSHARE_E_PROTOCOL, "an event came with a set of no device memory");
  CHECK_EQ(count_mappings("memfd:tshare-evil"), 0);
  tshare_set *s;
  CHECK_RC(tshare_set_recv(ch, 5000, &s), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_set_id(s), 16);
  CHECK(strcmp(tshare_set_name(s, 1), "b") == 0);
  CHECK_EQ(count_mappings("memfd:tshare-evil"), 1);
  tshare_set_release(s);
  CHECK_RC(tshare_channel_poll(ch, 0), TSHARE_E_TIMEOUT, tshare_channel_last_error(ch)); /* its release goes */
  /* The share that cut set 13 off still came; released here. */
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_view_share_id(v), 100);
  tshare_view_release(v);
  expect_refused(ch, TSHARE_E_PEER_CLOSED, "in the middle of it");
  CHECK_EQ(count_mappings("memfd:tshare-evil"), 0);
  CHECK_EQ(count_open_fds(), fds_before);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
  close(sock);
}

/* ---- a peer of the previous minor ------------------------------------------- */

/* A hello of wire 1.2, as a peer built before tensor sets sends it; then it
 * waits for the other end to close. */
static void minor_2_peer(int fd) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_HELLO;
  f.u.hello.pid = (uint32_t)getpid();
  f.u.hello.uid = (uint32_t)getuid();
  f.u.hello.capabilities = TSHARE_CAP_FD_PASSING | TSHARE_CAP_HOST_MEMFD;
  snprintf(f.u.hello.name, sizeof f.u.hello.name, "old");
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  CHECK_RC(tshare_wire_encode(&f, buf, sizeof buf, &len, NULL), TSHARE_OK, "");
  buf[5] = 2; /* the header's minor */
  CHECK(write(fd, buf, len) == (ssize_t)len);
  /* Reads the other end's frames until its bye: nothing else may come. */
  tshare_decoder *d = tshare_decoder_create(NULL);
  for (bool bye = false; !bye;) {
    uint8_t *space;
    size_t avail;
    CHECK_RC(tshare_decoder_space(d, &space, &avail), TSHARE_OK, "");
    ssize_t n = read(fd, space, avail);
    CHECK(n > 0);
    tshare_decoder_commit(d, (size_t)n);
    while (!bye && tshare_decoder_next(d, &f) == TSHARE_OK) {
      CHECK(f.type == TSHARE_FRAME_HELLO || f.type == TSHARE_FRAME_BYE);
      bye = f.type == TSHARE_FRAME_BYE;
    }
  }
  tshare_decoder_destroy(d);
}

TS_TEST(a_peer_of_the_previous_minor_is_refused_a_set) {
  int sock;
  pid_t pid = fork_with_socket(minor_2_peer, &sock);
  tshare_channel *ch = open_socket_only_channel(sock, "producer");
  CHECK_EQ(tshare_channel_peer(ch)->minor, 2);
  tshare_host_buffer **bufs = make_buffers(1, 4096);
  tshare_set_builder *b = build(&PLANS[0], bufs);
  uint64_t id = 5;
  CHECK_RC(tshare_set_send(ch, b, NULL, 1000, &id), TSHARE_E_PEER_MISMATCH, tshare_channel_last_error(ch));
  printf("%s\n", tshare_channel_last_error(ch));
  CHECK(strstr(tshare_channel_last_error(ch), "wire 1.2") != NULL);
  CHECK_EQ(id, 0);
  CHECK_EQ(tshare_channel_outstanding(ch), 0);
  tshare_set_builder_destroy(b);
  CHECK_EQ(tshare_host_buffer_outstanding(bufs[0]), 0);
  destroy_buffers(bufs, 1);
  tshare_channel_close(ch);
  close(sock); /* the old peer reads until it ends */
  CHECK_CHILD_OK(pid);
}

TS_TEST_MAIN
