/* Hostile tensor sets beyond those of test_tensor_set: names past what the
 * set announced, metadata past its bound, tensors past the count, memories
 * past the count, tensors in memories that do not exist, a layout larger
 * than its memory, frames of a set that never began. Each is refused with the
 * cause named, released back to the peer, its fds closed, and the next set
 * and share go through. So are frames the decoder refuses alone (counts,
 * names, metadata over the wire's bounds, a name that is not UTF-8): their
 * framing held, so only their set is refused, the error naming the field,
 * and nothing of it stays mapped or open. */
#include "hostile_set.h"
#include "harness.h"
#include "proc_util.h"

static const tshare_dtype F32 = {TSHARE_DTYPE_FLOAT, 32, 1};

/* ---- refused sets, the channel goes on ------------------------------------ */

/* Sets 21..27 each wrong in one way, each sent once the one before came
 * back; then set 28 (right) and share 101; then this end closes. */
static void producer_of_wrong_sets(int fd) {
  tshare_channel *ch = open_socket_only_channel(fd, "hostile");
  int memfd = sealed_memfd();
  tshare_frame f = set_begin_frame(21, 2, 1, 2, 0); /* names longer than announced */
  send_raw(ch, &f, -1);
  send_mem(ch, 21, memfd, TSHARE_MEM_HOST_MEMFD);
  send_member(ch, 21, 0, "a", 0);
  send_member(ch, 21, 1, "bcd", 64);
  send_end(ch, 21);
  wait_released_back(ch, 21);
  f = set_begin_frame(22, 1, 1, 1, 4); /* more metadata than announced */
  send_raw(ch, &f, -1);
  send_mem(ch, 22, memfd, TSHARE_MEM_HOST_MEMFD);
  send_member(ch, 22, 0, "a", 0);
  send_meta(ch, 22, 0, "version=1", 9);
  send_end(ch, 22);
  wait_released_back(ch, 22);
  send_begin(ch, 23, 1, 2); /* more tensors than announced */
  send_mem(ch, 23, memfd, TSHARE_MEM_HOST_MEMFD);
  send_member(ch, 23, 0, "a", 0);
  send_member(ch, 23, 1, "b", 64);
  send_end(ch, 23);
  wait_released_back(ch, 23);
  send_begin(ch, 24, 1, 1); /* more memories than announced */
  send_mem_at(ch, 24, 0, memfd, TSHARE_MEM_HOST_MEMFD);
  send_mem_at(ch, 24, 1, memfd, TSHARE_MEM_HOST_MEMFD);
  send_end(ch, 24);
  wait_released_back(ch, 24);
  int64_t n = 16;
  tshare_tensor_desc d = tshare_tensor_contiguous(F32, 1, &n, 0);
  send_begin(ch, 25, 1, 1); /* a tensor in memory 3 of 1 */
  send_mem(ch, 25, memfd, TSHARE_MEM_HOST_MEMFD);
  f = set_member_frame(25, 0, 0, "a", &d);
  f.u.set.u.member.mem_index = 3;
  send_raw(ch, &f, -1);
  send_end(ch, 25);
  wait_released_back(ch, 25);
  int64_t shape[2] = {1024, 1024}; /* 4 MiB in a memory of 4 KiB, from its start */
  d = tshare_tensor_contiguous(F32, 2, shape, 0);
  send_begin(ch, 26, 1, 1);
  send_mem(ch, 26, memfd, TSHARE_MEM_HOST_MEMFD);
  f = set_member_frame(26, 0, 0, "a", &d);
  send_raw(ch, &f, -1);
  send_end(ch, 26);
  wait_released_back(ch, 26);
  send_member(ch, 27, 0, "a", 0); /* set 27 never began: reported once, released back once */
  send_member(ch, 27, 1, "b", 64);
  send_end(ch, 27);
  wait_released_back(ch, 27);
  send_begin(ch, 28, 2, 2); /* right */
  send_mem(ch, 28, memfd, TSHARE_MEM_HOST_MEMFD);
  send_member(ch, 28, 0, "a", 0);
  send_member(ch, 28, 1, "b", 64);
  send_end(ch, 28);
  wait_released_back(ch, 28);
  int64_t four = 4;
  tshare_frame share = memfd_share_frame(4096, tshare_tensor_contiguous(F32, 1, &four, 0));
  share.u.share.share_id = 101;
  share.u.share.alloc_id = 101;
  send_raw(ch, &share, memfd);
  wait_released_back(ch, 101);
  close(memfd);
  tshare_channel_close(ch);
}

TS_TEST(wrong_sets_are_refused_naming_the_cause_and_the_channel_goes_on) {
  int sock;
  pid_t pid = fork_with_socket(producer_of_wrong_sets, &sock);
  tshare_channel *ch = open_socket_channel(sock, "consumer", NULL, NULL);
  int fds_before = count_open_fds();
  expect_refused(ch, TSHARE_E_PROTOCOL, "names take more than the 2 bytes the set announced");
  expect_refused(ch, TSHARE_E_PROTOCOL, "metadata chunk of 9 bytes at 0 out of order (0 of 4 came)");
  expect_refused(ch, TSHARE_E_PROTOCOL, "tensor 1 out of order (1 of 1 came");
  expect_refused(ch, TSHARE_E_PROTOCOL, "memory 1 out of order (1 of 1 came)");
  expect_refused(ch, TSHARE_E_PROTOCOL, "tensor 0 points into memory 3 of 1");
  expect_refused(ch, TSHARE_E_OUT_OF_BOUNDS, "tensor 0 ('a')");
  CHECK_EQ(count_mappings("memfd:tshare-evil"), 0);
  CHECK_EQ(count_open_fds(), fds_before);
  expect_refused(ch, TSHARE_E_PROTOCOL, "tensor set 27, which did not begin; released back");
  tshare_set *s;
  CHECK_RC(tshare_set_recv(ch, 5000, &s), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_set_id(s), 28);
  CHECK(strcmp(tshare_set_name(s, 1), "b") == 0);
  tshare_set_release(s);
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_view_share_id(v), 101);
  tshare_view_release(v);
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  CHECK_EQ(count_mappings("memfd:tshare-evil"), 0);
  CHECK_EQ(count_open_fds(), fds_before);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

/* ---- frames the decoder refuses: the set goes, the channel stays ---------- */

typedef enum {
  OVER_COUNT,     /* a set of more tensors than TSHARE_SET_MEMBERS_MAX */
  OVER_META,      /* more metadata than TSHARE_SET_META_MAX */
  OVER_NAME,      /* a name longer than TSHARE_SET_NAME_MAX */
  NOT_UTF8,       /* a name that is not UTF-8 */
  HOSTILE_CASES
} hostile_case;

static const struct {
  int status;
  const char *cause;
} CASE_ERRORS[HOSTILE_CASES] = {
    {TSHARE_E_TOO_LARGE, "126989 tensors outside 1..65536"},
    {TSHARE_E_TOO_LARGE, "28036591 bytes of metadata over 16777216"},
    {TSHARE_E_TOO_LARGE, "tensor 0: name of 1025 bytes over 1024"},
    {TSHARE_E_MALFORMED, "name is not UTF-8"},
};

static hostile_case current_case;

/* Set 1, right; then set 2 begun, its memory sent, and the frame of the
 * case, the rest of set 2 after it; once set 2 came back, set 3 and share
 * 101, right, on the same channel; then this end closes. */
static void producer_past_the_bounds(int fd) {
  tshare_channel *ch = open_socket_only_channel(fd, "hostile");
  int memfd = sealed_memfd();
  send_begin(ch, 1, 1, 1);
  send_mem(ch, 1, memfd, TSHARE_MEM_HOST_MEMFD);
  send_member(ch, 1, 0, "a", 0);
  send_end(ch, 1);
  wait_released_back(ch, 1); /* alone: a release frame's error names its last unknown id */
  uint8_t was[4], now[4];
  if (current_case == OVER_COUNT || current_case == OVER_META) {
    tshare_frame f = set_begin_frame(2, 0xF00D, 1, 200000, 0xABCDEF);
    uint32_t found = current_case == OVER_COUNT ? 0xF00Du : 0xABCDEFu, patched = found | 0x01000000u;
    if (current_case == OVER_COUNT) patched = 0x1F00Du; /* 126989 */
    memcpy(was, &found, 4);
    memcpy(now, &patched, 4);
    send_patched(ch, &f, -1, was, now, 4);
  } else {
    send_begin(ch, 2, 1, 4);
    send_mem(ch, 2, memfd, TSHARE_MEM_HOST_MEMFD);
    int64_t n = 4;
    tshare_tensor_desc d = tshare_tensor_contiguous(F32, 1, &n, 0);
    char name[TSHARE_SET_NAME_MAX + 1];
    memset(name, 'n', TSHARE_SET_NAME_MAX);
    name[current_case == OVER_NAME ? TSHARE_SET_NAME_MAX : 4] = '\0';
    tshare_frame f = set_member_frame(2, 0, 0, name, &d);
    if (current_case == OVER_NAME) /* name_len 1024 (00 04, little-endian) made 1025 */
      send_patched(ch, &f, -1, "\x00\x04nnnn", "\x01\x04nnnn", 6);
    else
      send_patched(ch, &f, -1, "nnnn", "nn\xffn", 4);
  }
  send_end(ch, 2); /* dropped with the rest of the refused set */
  wait_released_back(ch, 2);
  send_begin(ch, 3, 1, 1);
  send_mem(ch, 3, memfd, TSHARE_MEM_HOST_MEMFD);
  send_member(ch, 3, 0, "a", 0);
  send_end(ch, 3);
  wait_released_back(ch, 3);
  int64_t four = 4;
  tshare_frame share = memfd_share_frame(4096, tshare_tensor_contiguous(F32, 1, &four, 0));
  share.u.share.share_id = 101;
  share.u.share.alloc_id = 101;
  send_raw(ch, &share, memfd);
  wait_released_back(ch, 101);
  close(memfd);
  tshare_channel_close(ch);
}

TS_TEST(frames_past_the_bounds_refuse_their_set_naming_the_field_and_the_channel_goes_on) {
  for (current_case = 0; current_case < HOSTILE_CASES; current_case++) {
    int fds_before = count_open_fds();
    int sock;
    pid_t pid = fork_with_socket(producer_past_the_bounds, &sock);
    tshare_channel *ch = open_socket_channel(sock, "consumer", NULL, NULL);
    tshare_set *first;
    CHECK_RC(tshare_set_recv(ch, 5000, &first), TSHARE_OK, tshare_channel_last_error(ch));
    ((volatile float *)tshare_set_data(first, 0))[0] = 1.0f;
    tshare_set_release(first);
    expect_refused(ch, CASE_ERRORS[current_case].status, CASE_ERRORS[current_case].cause);
    tshare_set *next;
    CHECK_RC(tshare_set_recv(ch, 5000, &next), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(tshare_set_id(next), 3);
    tshare_set_release(next);
    tshare_view *v;
    CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(tshare_view_share_id(v), 101);
    tshare_view_release(v);
    CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
    tshare_channel_close(ch);
    CHECK_EQ(count_mappings("memfd:tshare-evil"), 0);
    CHECK_EQ(count_open_fds(), fds_before);
    CHECK_CHILD_OK(pid);
  }
}

TS_TEST_MAIN
