/* Kept host mappings: a consumer keeps a producer's memfd mapped past its
 * last view, says so, and later shares of the buffer come without an fd
 * (TSHARE_MEM_HOST_KEPT) until the producer retires it. Each half is
 * tested against a peer that speaks frames by hand, so what travels is
 * seen, and what a lying peer sends is refused. */
#include "harness.h"
#include "proc_util.h"
#include "tshare/hostmem.h"
#include "tshare/share.h"
#include "tshare/wire.h"

#include <sys/mman.h>
#include <sys/resource.h>

#define I32 ((tshare_dtype){TSHARE_DTYPE_INT, 32, 1})
enum { INTS = 1024, KEPT_ALLOC = 7 };

static tshare_tensor_desc ints(int64_t n) {
  tshare_tensor_desc d;
  memset(&d, 0, sizeof d);
  d.dtype = I32;
  d.ndim = 1;
  d.shape[0] = n;
  d.strides[0] = 1;
  return d;
}

static void fill(int32_t *p, int32_t v) {
  for (int i = 0; i < INTS; i++) p[i] = v + i;
}

static void check_filled(const int32_t *p, int32_t v) {
  for (int i = 0; i < INTS; i++)
    if (p[i] != v + i) TS_FAIL("element %d is %d, expected %d", i, p[i], v + i);
}

static void send_frame(tshare_channel *ch, const tshare_frame *f, int fd) {
  CHECK_RC(tshare_channel_send_frame(ch, f, fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
}

/* The next frame, of type want (its fd, if any, closed). */
static tshare_frame expect_frame(tshare_channel *ch, int want, int *fd_out) {
  tshare_frame f;
  int fd = -1;
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  if (f.type != want) TS_FAIL("got a %s frame, expected %s", tshare_frame_type_name(f.type), tshare_frame_type_name(want));
  if (fd_out)
    *fd_out = fd;
  else if (fd >= 0)
    close(fd);
  return f;
}

static tshare_frame retire_frame(uint8_t closed, uint64_t alloc_id) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RETIRE;
  f.u.retire.closed = closed;
  f.u.retire.mem_kind = TSHARE_MEM_HOST_MEMFD;
  f.u.retire.count = 1;
  f.u.retire.alloc_ids[0] = alloc_id;
  return f;
}

static tshare_frame release_frame(uint64_t share_id) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RELEASE;
  f.u.release.count = 1;
  f.u.release.share_ids[0] = share_id;
  return f;
}

/* ---- the producer half, against a consumer speaking frames by hand ------- */

/* The hand consumer's last release, then its bye. */
static void release_then_bye(tshare_channel *ch, uint64_t share_id) {
  tshare_frame rel = release_frame(share_id);
  send_frame(ch, &rel, -1);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

/* The producer's end: its buffer destroyed, the last share's release makes
 * it go here at once (the retire goes to the consumer), then the bye. */
static void destroy_wait_and_end(tshare_channel *ch, tshare_host_buffer *buf, uint64_t id, const char *name,
                                 pid_t consumer) {
  tshare_host_buffer_destroy(buf);
  CHECK_RC(tshare_channel_wait_released(ch, id, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(count_mappings(name), 0);
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(consumer);
  tshare_channel_close(ch);
}

static void hand_consumer_keeps_the_buffer(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "hand consumer", NULL, NULL);
  /* First share: the memfd travels, with the offer to keep it. */
  int mfd;
  tshare_frame f = expect_frame(ch, TSHARE_FRAME_SHARE, &mfd);
  CHECK_EQ(f.u.share.mem_kind, TSHARE_MEM_HOST_MEMFD);
  CHECK(mfd >= 0);
  CHECK(f.u.share.share_flags & TSHARE_SHARE_FLAG_RETIRE_NOTICE);
  uint64_t alloc = f.u.share.alloc_id;
  int32_t *p = mmap(NULL, f.u.share.alloc_size, PROT_READ, MAP_SHARED, mfd, 0);
  CHECK(p != MAP_FAILED);
  close(mfd);
  check_filled(p, 100);
  tshare_frame kept = retire_frame(TSHARE_RETIRE_KEPT, alloc);
  send_frame(ch, &kept, -1); /* before the release: the producer reads it first */
  tshare_frame rel = release_frame(f.u.share.share_id);
  send_frame(ch, &rel, -1);
  /* Second share: the frame alone; the memory is the same, updated in place. */
  int none;
  f = expect_frame(ch, TSHARE_FRAME_SHARE, &none);
  CHECK_EQ(f.u.share.mem_kind, TSHARE_MEM_HOST_KEPT);
  CHECK_EQ(none, -1);
  CHECK_EQ(f.u.share.alloc_id, alloc);
  check_filled(p, 200);
  uint64_t last = f.u.share.share_id;
  /* The producer destroyed the buffer: once released, it is retired. */
  rel = release_frame(last);
  send_frame(ch, &rel, -1);
  f = expect_frame(ch, TSHARE_FRAME_RETIRE, NULL);
  CHECK_EQ(f.u.retire.closed, TSHARE_RETIRE_FREED);
  CHECK_EQ(f.u.retire.mem_kind, TSHARE_MEM_HOST_MEMFD);
  CHECK_EQ(f.u.retire.count, 1);
  CHECK_EQ(f.u.retire.alloc_ids[0], alloc);
  munmap(p, INTS * sizeof(int32_t));
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(a_buffer_the_consumer_keeps_goes_without_its_fd_and_is_retired_when_destroyed) {
  int sock;
  pid_t pid = fork_with_socket(hand_consumer_keeps_the_buffer, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  tshare_host_buffer *buf;
  tshare_error err;
  CHECK_RC(tshare_host_buffer_create(INTS * sizeof(int32_t), "tshare-kept", &buf, &err), TSHARE_OK, err.message);
  tshare_tensor_desc d = ints(INTS);
  uint64_t id;
  fill(tshare_host_buffer_data(buf), 100);
  CHECK_RC(tshare_share_host(ch, buf, &d, NULL, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, id, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  fill(tshare_host_buffer_data(buf), 200); /* updated in place, shared again */
  CHECK_RC(tshare_share_host(ch, buf, &d, NULL, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  destroy_wait_and_end(ch, buf, id, "memfd:tshare-kept", pid);
}

/* A consumer that says it keeps allocations it never got, and retires and
 * closes things at random, changes nothing: the next share still carries
 * its fd, and the producer's memory goes when it is released. */
static void hand_consumer_lies(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "lying consumer", NULL, NULL);
  for (uint8_t closed = TSHARE_RETIRE_FREED; closed <= TSHARE_RETIRE_KEPT; closed++) {
    tshare_frame lie = retire_frame(closed, 12345);
    send_frame(ch, &lie, -1);
  }
  int mfd;
  tshare_frame f = expect_frame(ch, TSHARE_FRAME_SHARE, &mfd);
  CHECK_EQ(f.u.share.mem_kind, TSHARE_MEM_HOST_MEMFD);
  CHECK(mfd >= 0);
  close(mfd);
  release_then_bye(ch, f.u.share.share_id);
}

TS_TEST(a_consumer_claiming_to_keep_what_it_never_got_changes_nothing) {
  int sock;
  pid_t pid = fork_with_socket(hand_consumer_lies, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(4096, "tshare-lied-to", &buf, NULL), TSHARE_OK, "");
  tshare_tensor_desc d = ints(16);
  uint64_t id;
  CHECK_RC(tshare_share_host(ch, buf, &d, NULL, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  destroy_wait_and_end(ch, buf, id, "memfd:tshare-lied-to", pid);
}

/* ---- the consumer half, against a producer speaking frames by hand ------- */

static tshare_frame share_of(uint64_t share_id, uint64_t alloc_id, uint64_t alloc_size, int mem_kind) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SHARE;
  f.flags = mem_kind == TSHARE_MEM_HOST_MEMFD ? TSHARE_FRAME_FLAG_FD_ATTACHED : 0;
  f.u.share.share_id = share_id;
  f.u.share.alloc_id = alloc_id;
  f.u.share.mem_kind = (uint8_t)mem_kind;
  f.u.share.device_type = TSHARE_DEVICE_CPU;
  f.u.share.alloc_size = alloc_size;
  f.u.share.share_flags = TSHARE_SHARE_FLAG_RETIRE_NOTICE;
  f.u.share.tensor = ints(INTS);
  return f;
}

/* Receives shares 1 and 2 (kept) and checks their contents, then expects
 * the refusals the hand producer provokes; the channel goes on each time. */
static void consumer_of_a_hand_producer(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  tshare_view *v;
  for (int32_t round = 1; round <= 2; round++) {
    CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
    check_filled(tshare_view_data(v), 1000 * round);
    tshare_view_release(v);
    CHECK_EQ(count_mappings("memfd:tshare-hand"), 1); /* kept while idle */
  }
  /* 3: kept memory this end never mapped; 4: kept memory of the wrong size;
   * 6: kept memory after its retire (5 is the retire's witness, with its fd). */
  const char *want[] = {"keeps no mapping", "was mapped with", NULL, "keeps no mapping"};
  for (int i = 0; i < 4; i++) {
    int rc = tshare_view_recv(ch, 5000, &v);
    if (!want[i]) { /* share 5: a fresh memfd share after the retire */
      CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(ch));
      tshare_view_release(v);
      continue;
    }
    CHECK_RC(rc, TSHARE_E_PROTOCOL, tshare_channel_last_error(ch));
    if (!strstr(tshare_channel_last_error(ch), want[i]))
      TS_FAIL("'%s' does not say '%s'", tshare_channel_last_error(ch), want[i]);
  }
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
  CHECK_EQ(count_mappings("memfd:tshare-hand"), 0);
}

/* Releases and retire frames until every share in first..last came back;
 * the alloc ids of KEPT notices seen are counted into *kept. */
static void collect_releases(tshare_channel *ch, uint64_t first, uint64_t last, int *kept) {
  bool back[16] = {false};
  uint64_t n = 0;
  while (n < last - first + 1) {
    tshare_frame f;
    int fd = -1;
    CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(fd, -1);
    if (f.type == TSHARE_FRAME_RETIRE) {
      CHECK_EQ(f.u.retire.closed, TSHARE_RETIRE_KEPT);
      CHECK_EQ(f.u.retire.mem_kind, TSHARE_MEM_HOST_MEMFD);
      *kept += (int)f.u.retire.count;
      continue;
    }
    CHECK_EQ(f.type, TSHARE_FRAME_RELEASE);
    for (uint32_t i = 0; i < f.u.release.count; i++) {
      uint64_t id = f.u.release.share_ids[i];
      CHECK(id >= first && id <= last && !back[id]);
      back[id] = true;
      n++;
    }
  }
}

/* The hand producer's end: its bye, the consumer's exit, its buffers. */
static void end_hand_producer(tshare_channel *ch, pid_t consumer, tshare_host_buffer *a, tshare_host_buffer *b) {
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(consumer);
  tshare_host_buffer_destroy(a);
  tshare_host_buffer_destroy(b);
  tshare_channel_close(ch);
}

TS_TEST(a_consumer_keeps_a_mapping_and_refuses_kept_shares_of_memory_it_does_not_keep) {
  int sock;
  pid_t pid = fork_with_socket(consumer_of_a_hand_producer, &sock);
  tshare_channel *ch = open_socket_channel(sock, "hand producer", NULL, NULL);
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(INTS * sizeof(int32_t), "tshare-hand", &buf, NULL), TSHARE_OK, "");
  uint64_t size = tshare_host_buffer_size(buf);
  fill(tshare_host_buffer_data(buf), 1000);
  tshare_frame f = share_of(1, KEPT_ALLOC, size, TSHARE_MEM_HOST_MEMFD);
  send_frame(ch, &f, tshare_host_buffer_fd(buf));
  int kept = 0;
  collect_releases(ch, 1, 1, &kept);
  if (kept == 0) { /* the notice may follow the release */
    tshare_frame g = expect_frame(ch, TSHARE_FRAME_RETIRE, NULL);
    CHECK_EQ(g.u.retire.closed, TSHARE_RETIRE_KEPT);
    CHECK_EQ(g.u.retire.alloc_ids[0], KEPT_ALLOC);
  }
  fill(tshare_host_buffer_data(buf), 2000);
  f = share_of(2, KEPT_ALLOC, size, TSHARE_MEM_HOST_KEPT);
  send_frame(ch, &f, -1);
  f = share_of(3, KEPT_ALLOC + 1, size, TSHARE_MEM_HOST_KEPT);
  send_frame(ch, &f, -1);
  f = share_of(4, KEPT_ALLOC, size * 2, TSHARE_MEM_HOST_KEPT);
  send_frame(ch, &f, -1);
  tshare_frame freed = retire_frame(TSHARE_RETIRE_FREED, KEPT_ALLOC);
  send_frame(ch, &freed, -1);
  tshare_host_buffer *other;
  CHECK_RC(tshare_host_buffer_create(4096, "tshare-witness", &other, NULL), TSHARE_OK, "");
  f = share_of(5, KEPT_ALLOC + 2, tshare_host_buffer_size(other), TSHARE_MEM_HOST_MEMFD);
  f.u.share.tensor = ints(16);
  f.u.share.share_flags = 0;
  send_frame(ch, &f, tshare_host_buffer_fd(other));
  f = share_of(6, KEPT_ALLOC, size, TSHARE_MEM_HOST_KEPT);
  send_frame(ch, &f, -1);
  collect_releases(ch, 2, 6, &kept);
  end_hand_producer(ch, pid, buf, other);
}

/* Memory its owner retired goes once the consumer would wait, not while the
 * frames after the retire wait to be read: the unmaps (each the last
 * reference, freeing the pages) would hold back the next hand-off and this
 * end's releases. */
static int go[2]; /* the hand producer says: the retire and the next share are sent */

static void consumer_of_a_retire_and_a_share(int fd) {
  close(go[1]); /* a producer that dies before its byte ends the read */
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  check_filled(tshare_view_data(v), 3000);
  tshare_view_release(v);
  CHECK_EQ(count_mappings("memfd:tshare-retired"), 1); /* kept while idle */
  char byte;
  CHECK(read(go[0], &byte, 1) == 1);
  /* The retire and the share behind it are both queued: in the ring (its
   * entry), or on the socket, where one read takes both (a read stops only
   * after bytes that carried fds, as share 1's did). */
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  check_filled(tshare_view_data(v), 4000);
  CHECK_EQ(count_mappings("memfd:tshare-retired"), 1); /* retired, still mapped: a frame came behind it */
  tshare_view_release(v);
  int rc = tshare_channel_poll(ch, 0); /* the bye may have come */
  if (rc != TSHARE_E_TIMEOUT) CHECK_RC(rc, TSHARE_END, tshare_channel_last_error(ch));
  CHECK_EQ(count_mappings("memfd:tshare-retired"), 0); /* nothing left to read: it went */
  CHECK_EQ(count_mappings("memfd:tshare-after"), 1);    /* kept, not retired */
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
  CHECK_EQ(count_mappings("memfd:tshare-after"), 0);
}

TS_TEST(memory_its_owner_retired_is_unmapped_once_the_consumer_would_wait) {
  CHECK(pipe(go) == 0);
  int sock;
  pid_t pid = fork_with_socket(consumer_of_a_retire_and_a_share, &sock);
  close(go[0]);
  tshare_channel *ch = open_socket_channel(sock, "hand producer", NULL, NULL);
  tshare_host_buffer *retired, *after;
  CHECK_RC(tshare_host_buffer_create(INTS * sizeof(int32_t), "tshare-retired", &retired, NULL), TSHARE_OK, "");
  CHECK_RC(tshare_host_buffer_create(INTS * sizeof(int32_t), "tshare-after", &after, NULL), TSHARE_OK, "");
  fill(tshare_host_buffer_data(retired), 3000);
  fill(tshare_host_buffer_data(after), 4000);
  tshare_frame f = share_of(1, KEPT_ALLOC, tshare_host_buffer_size(retired), TSHARE_MEM_HOST_MEMFD);
  send_frame(ch, &f, tshare_host_buffer_fd(retired));
  tshare_frame freed = retire_frame(TSHARE_RETIRE_FREED, KEPT_ALLOC);
  send_frame(ch, &freed, -1);
  f = share_of(2, KEPT_ALLOC + 1, tshare_host_buffer_size(after), TSHARE_MEM_HOST_MEMFD);
  send_frame(ch, &f, tshare_host_buffer_fd(after));
  CHECK(write(go[1], "g", 1) == 1);
  int kept = 0;
  collect_releases(ch, 1, 2, &kept);
  end_hand_producer(ch, pid, retired, after);
  close(go[1]);
}

/* ---- bounds ------------------------------------------------------------------ */

enum { DISTINCT = 40, FD_LIMIT = 64 };

/* Takes DISTINCT shares of distinct memfds, releasing each at once, under
 * TSHARE_HOST_KEPT_MAX and an fd limit: it keeps at most that many, and
 * its idle kept mappings hold at most a quarter of the fd limit. */
static void consumer_under_bounds(int fd) {
  struct rlimit rl = {FD_LIMIT, FD_LIMIT};
  CHECK(getrlimit(RLIMIT_NOFILE, &rl) == 0);
  if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < FD_LIMIT) TS_SKIP("hard fd limit under %d", FD_LIMIT);
  rl.rlim_cur = FD_LIMIT;
  CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0);
  int fds_before = count_open_fds();
  tshare_channel *ch = open_socket_channel(fd, "bounded consumer", NULL, NULL);
  for (int i = 0; i < DISTINCT; i++) {
    tshare_view *v;
    CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(((int32_t *)tshare_view_data(v))[0], i);
    tshare_view_release(v);
  }
  int kept = count_mappings("memfd:tshare-bounded");
  printf("bounded consumer: %d mappings kept, %d fds open (%d before)\n", kept, count_open_fds(), fds_before);
  CHECK_EQ(kept, DISTINCT - 10); /* TSHARE_HOST_KEPT_MAX */
  CHECK(count_open_fds() <= fds_before + FD_LIMIT / 4 + 4); /* the channel's own fds besides */
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(kept_mappings_stay_within_their_count_and_their_fds_within_the_fd_budget) {
  setenv("TSHARE_HOST_KEPT_MAX", "30", 1);
  int sock;
  pid_t pid = fork_with_socket(consumer_under_bounds, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  tshare_host_buffer *b[DISTINCT];
  tshare_tensor_desc d = ints(16);
  for (int i = 0; i < DISTINCT; i++) {
    CHECK_RC(tshare_host_buffer_create(4096, "tshare-bounded", &b[i], NULL), TSHARE_OK, "");
    ((int32_t *)tshare_host_buffer_data(b[i]))[0] = i;
    uint64_t id;
    CHECK_RC(tshare_share_host(ch, b[i], &d, NULL, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_RC(tshare_channel_wait_released(ch, id, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  }
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  for (int i = 0; i < DISTINCT; i++) tshare_host_buffer_destroy(b[i]);
  tshare_channel_close(ch);
}

/* ---- a library producer and consumer: the weight-sync pattern ------------- */

enum { ROUNDS = 50 };

static void consumer_sees_every_update(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  int fds_after_first = -1;
  for (int32_t r = 0; r < ROUNDS; r++) {
    tshare_view *v;
    CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
    check_filled(tshare_view_data(v), r);
    tshare_view_release(v);
    if (r == 1) fds_after_first = count_open_fds();
    if (r > 1) CHECK_EQ(count_open_fds(), fds_after_first);
    CHECK_EQ(count_mappings("memfd:tshare-weights"), 1);
  }
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
  CHECK_EQ(count_mappings("memfd:tshare-weights"), 0);
}

TS_TEST(a_buffer_updated_in_place_and_shared_again_reaches_the_consumer_every_time) {
  int sock;
  pid_t pid = fork_with_socket(consumer_sees_every_update, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(INTS * sizeof(int32_t), "tshare-weights", &buf, NULL), TSHARE_OK, "");
  tshare_tensor_desc d = ints(INTS);
  for (int32_t r = 0; r < ROUNDS; r++) {
    fill(tshare_host_buffer_data(buf), r);
    uint64_t id;
    CHECK_RC(tshare_share_host(ch, buf, &d, NULL, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_RC(tshare_channel_wait_released(ch, id, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  }
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_host_buffer_destroy(buf);
  tshare_channel_close(ch);
}

/* ---- a buffer dropped just before the bye ------------------------------- */

static void consumer_unmaps_at_the_bye(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  check_filled(tshare_view_data(v), 11);
  tshare_view_release(v);
  CHECK_EQ(count_mappings("memfd:tshare-last-words"), 1); /* kept for the next share of it */
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  /* The producer dropped the buffer and said bye with no turn between: the
   * retire went before the bye, so the mapping is gone while the channel
   * is still open (a consumer may keep it open a long time after a bye). */
  CHECK_EQ(count_mappings("memfd:tshare-last-words"), 0);
  tshare_channel_close(ch);
}

TS_TEST(a_buffer_dropped_just_before_the_bye_is_unmapped_by_the_consumer_at_the_bye) {
  int sock;
  pid_t pid = fork_with_socket(consumer_unmaps_at_the_bye, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(INTS * sizeof(int32_t), "tshare-last-words", &buf, NULL), TSHARE_OK, "");
  tshare_tensor_desc d = ints(INTS);
  fill(tshare_host_buffer_data(buf), 11);
  uint64_t id;
  CHECK_RC(tshare_share_host(ch, buf, &d, NULL, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, id, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_host_buffer_destroy(buf);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

TS_TEST_MAIN
