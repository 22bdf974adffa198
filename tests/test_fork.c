/* fork() and channels: a channel and its views belong to the process that
 * opened it. A child forked while holding a view releases it and closes the
 * channel without a frame reaching the peer; every other call on the
 * inherited channel is refused with an error naming the owner. */
#include "harness.h"
#include "proc_util.h"
#include "tshare/share.h"

#define N_FLOATS 1024
#define TAG_CHECKPOINT "after the fork"
#define TAG_ACK "ack"

static tshare_tensor_desc floats(int64_t n) {
  tshare_dtype f32 = {TSHARE_DTYPE_FLOAT, 32, 1};
  return tshare_tensor_contiguous(f32, 1, &n, 0);
}

static void fill(tshare_host_buffer *buf, float value) {
  float *f = tshare_host_buffer_data(buf);
  for (int i = 0; i < N_FLOATS; i++) f[i] = value;
}

static bool all_equal(const float *f, float value) {
  for (int i = 0; i < N_FLOATS; i++)
    if (f[i] != value) return false;
  return true;
}

/* The producer shares a buffer of 1s and waits for the consumer's
 * checkpoint (a share sent after its child exited). A release seen by then
 * came from the child: the producer reuses the buffer as a real one would
 * (writes 2s) and fails. Otherwise it acks, and the consumer's own release
 * and bye end the stream. */
static void producer(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "producer", NULL, NULL);
  tshare_host_buffer *buf, *ack;
  CHECK_RC(tshare_host_buffer_create(N_FLOATS * sizeof(float), "tshare-fork-data", &buf, NULL), TSHARE_OK, "");
  CHECK_RC(tshare_host_buffer_create(4096, "tshare-fork-ack", &ack, NULL), TSHARE_OK, "");
  fill(buf, 1.0f);
  tshare_tensor_desc d = floats(N_FLOATS);
  uint64_t id;
  CHECK_RC(tshare_share_host(ch, buf, &d, "ones", NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_view *checkpoint;
  CHECK_RC(tshare_view_recv(ch, 10000, &checkpoint), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK(strcmp(tshare_view_tag(checkpoint), TAG_CHECKPOINT) == 0);
  if (tshare_share_is_released(ch, id) != 0) {
    fill(buf, 2.0f);
    TS_FAIL("the consumer's forked child released share %llu of its parent", (unsigned long long)id);
  }
  tshare_view_release(checkpoint);
  tshare_tensor_desc one = floats(1);
  CHECK_RC(tshare_share_host(ch, ack, &one, TAG_ACK, NULL, 5000, NULL), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, 0, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_view *none;
  CHECK_RC(tshare_view_recv(ch, 10000, &none), TSHARE_END, tshare_channel_last_error(ch));
  tshare_host_buffer_destroy(buf);
  tshare_host_buffer_destroy(ack);
  tshare_channel_close(ch);
}

static tshare_channel *inherited;
static tshare_view *inherited_view;

/* A call refused in the child names the process that owns the channel. */
#define CHECK_REFUSED(expr)                                                                                            \
  do {                                                                                                                 \
    CHECK_RC(expr, TSHARE_E_STATE, tshare_channel_last_error(inherited));                                              \
    CHECK_NAMES_OWNER(tshare_channel_last_error(inherited));                                                           \
  } while (0)

#define CHECK_NAMES_OWNER(msg)                                                                                         \
  do {                                                                                                                 \
    char owner_[64];                                                                                                   \
    snprintf(owner_, sizeof owner_, "belongs to process %d (opened before fork)", (int)getppid());                     \
    if (!strstr((msg), owner_)) TS_FAIL("'%s' does not say '%s'", (msg), owner_);                                      \
  } while (0)

/* The child drops what it inherited and exits: its copy of the mapping goes,
 * nothing goes to the producer. */
static void child_releases_and_closes(int unused) {
  (void)unused;
  CHECK(all_equal(tshare_view_data(inherited_view), 1.0f));
  tshare_view_release(inherited_view);
  CHECK_EQ(count_mappings("memfd:tshare-fork-data"), 0);
  tshare_channel_close(inherited);
}

/* Every call but release and close is refused, and touches nothing. */
static void child_calls_everything(int unused) {
  (void)unused;
  tshare_channel *ch = inherited;
  tshare_view *v = NULL;
  CHECK_REFUSED(tshare_view_recv(ch, 1000, &v));
  CHECK(v == NULL);
  tshare_share_info info;
  CHECK_REFUSED(tshare_channel_peek_share(ch, 1000, &info));
  CHECK_REFUSED(tshare_channel_poll(ch, 1000));
  CHECK_REFUSED(tshare_channel_wait_released(ch, 0, 1000));
  CHECK_REFUSED(tshare_channel_send_bye(ch, 0, 1000));
  CHECK_REFUSED(tshare_channel_send_error(ch, TSHARE_E_PROTOCOL, "from the child"));
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_BYE;
  CHECK_REFUSED(tshare_channel_send_frame(ch, &f, -1, 1000));
  int fd;
  CHECK_REFUSED(tshare_channel_recv_frame(ch, &f, &fd, 1000));
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(4096, "tshare-fork-child", &buf, NULL), TSHARE_OK, "");
  tshare_tensor_desc one = floats(1);
  uint64_t id = 7;
  CHECK_REFUSED(tshare_share_host(ch, buf, &one, NULL, NULL, 1000, &id));
  CHECK_EQ(id, 0);
  CHECK_EQ(tshare_host_buffer_outstanding(buf), 0);
  CHECK_EQ(tshare_channel_fd(ch), -1);
  CHECK_NAMES_OWNER(tshare_channel_last_error(ch));
  CHECK_REFUSED(tshare_share_view(ch, inherited_view, NULL, NULL, NULL, 1000, &id)); /* consumes the view */
  tshare_host_buffer_destroy(buf);
}

/* The consumer: a view of 1s held across a fork whose child runs child_fn;
 * afterwards the view still reads 1s, the producer saw no release, bye or
 * error from the child, and the channel goes on (checkpoint, ack). */
static void consumer_forks_while_holding_a_view(void (*child_fn)(int)) {
  int sock;
  pid_t producer_pid = fork_with_socket(producer, &sock);
  inherited = open_socket_channel(sock, "consumer", NULL, NULL);
  CHECK_RC(tshare_view_recv(inherited, 5000, &inherited_view), TSHARE_OK, tshare_channel_last_error(inherited));
  CHECK_CHILD_OK(fork_child(child_fn, 0));
  CHECK(all_equal(tshare_view_data(inherited_view), 1.0f));

  tshare_host_buffer *mark;
  CHECK_RC(tshare_host_buffer_create(4096, "tshare-fork-mark", &mark, NULL), TSHARE_OK, "");
  tshare_tensor_desc one = floats(1);
  CHECK_RC(tshare_share_host(inherited, mark, &one, TAG_CHECKPOINT, NULL, 5000, NULL), TSHARE_OK,
           tshare_channel_last_error(inherited));
  tshare_view *ack;
  CHECK_RC(tshare_view_recv(inherited, 10000, &ack), TSHARE_OK, tshare_channel_last_error(inherited));
  CHECK(strcmp(tshare_view_tag(ack), TAG_ACK) == 0);
  CHECK(all_equal(tshare_view_data(inherited_view), 1.0f));
  tshare_view_release(ack);
  tshare_view_release(inherited_view);
  CHECK_RC(tshare_channel_wait_released(inherited, 0, 10000), TSHARE_OK, tshare_channel_last_error(inherited));
  CHECK_RC(tshare_channel_send_bye(inherited, 0, 5000), TSHARE_OK, tshare_channel_last_error(inherited));
  CHECK_CHILD_OK(producer_pid);
  tshare_host_buffer_destroy(mark);
  tshare_channel_close(inherited);
}

TS_TEST(a_forked_child_releases_and_closes_without_touching_the_parents_channel) {
  consumer_forks_while_holding_a_view(child_releases_and_closes);
}

TS_TEST(a_forked_child_gets_a_clear_error_from_the_inherited_channel) {
  consumer_forks_while_holding_a_view(child_calls_everything);
}

TS_TEST_MAIN
