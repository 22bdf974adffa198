/* GPU tests: tshare's own VMM buffers, which the consumer keeps mapped
 * between shares, travel without their fd once it said so. Each test exits
 * 77 with the reason when no CUDA device (or no POSIX-fd VMM export) is
 * usable. The consumers are this binary again (`test_cuda_held --role NAME
 * ARG`), with a channel on fd 3 and a result pipe on fd 4.
 *
 * The fds a process receives are counted here, beside the library: this
 * binary's recvmsg() counts the SCM_RIGHTS fds of every message before
 * handing it on. */
#include "backend_cuda.h"
#include "cuda_internal.h"
#include "cudakit.h"
#include "harness.h"
#include "tshare/tshare.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define TIMEOUT 20000
#define SHARES 100

static const ts_cuda_api *cu;
static atomic_long fds_received;

typedef ssize_t (*recvmsg_fn)(int, struct msghdr *, int);

ssize_t recvmsg(int fd, struct msghdr *msg, int flags) {
  static recvmsg_fn real;
  if (!real) {
    void *sym = dlsym(RTLD_NEXT, "recvmsg");
    memcpy(&real, &sym, sizeof real); /* a function pointer from dlsym's object pointer */
  }
  ssize_t r = real(fd, msg, flags);
  if (r < 0) return r;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
      atomic_fetch_add(&fds_received, (long)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int)));
  return r;
}

static void need_vmm_gpu(void) {
  char why[256];
  cu = ck_init(why, sizeof why);
  if (!cu) TS_SKIP("%s", why);
  if (tshare_cuda_fd_handles_supported(0) != 1) TS_SKIP("device 0 cannot export VMM memory as POSIX fds");
}

static tshare_channel *open_ch(int fd, const char *name) {
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = name;
  tshare_channel *ch;
  tshare_error err;
  if (tshare_channel_open_socket(fd, &o, &ch, &err) != TSHARE_OK) TS_FAIL("channel: %s", err.message);
  return ch;
}

static tshare_tensor_desc vec_i32(int64_t n) {
  int64_t shape[1] = {n};
  return tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, shape, 0);
}

static long long now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- the consumer ------------------------------------------------------------ */

/* Tags say "BASE STEP N ALLOC": the view holds N int32s base + k*step, of the
 * producer's allocation ALLOC. */
static unsigned long long count_bad_in(const tshare_view *v, CUstream s, unsigned long long *alloc) {
  int base, step, n;
  if (sscanf(tshare_view_tag(v), "%d %d %d %llu", &base, &step, &n, alloc) != 4)
    TS_FAIL("tag '%s'", tshare_view_tag(v));
  unsigned long long bad = 0;
  CHECK(ck_count_bad((CUdeviceptr)(uintptr_t)tshare_view_data(v), (size_t)n, base, step, s, &bad) == CUDA_SUCCESS);
  return bad;
}

/* Once this end said it keeps the memory mapped, say out of turn that the allocation was closed
 * (closed = 1), twice, although this end keeps it mapped. */
static void lie_closed(tshare_channel *ch, unsigned long long alloc) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RETIRE;
  f.u.retire.closed = TSHARE_RETIRE_CLOSED;
  f.u.retire.count = 1;
  f.u.retire.alloc_ids[0] = alloc;
  for (int i = 0; i < 2; i++)
    CHECK_RC(tshare_channel_send_frame(ch, &f, -1, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
}

/* Receives views until bye, each checked on this process's own stream and
 * released at once; arg "lie": answers closed for the memory after the
 * second view (the first's answer said it keeps it). Reports the views, the
 * bad elements, the fds that came with the first view and after it, the
 * mappings closed and the last refusal. */
static int role_counter(const char *arg, tshare_channel *ch, FILE *out) {
  long at_open = atomic_load(&fds_received), after_first = -1;
  CUstream s;
  CHECK(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
  char refusal[TSHARE_ERROR_MSG_MAX] = "none";
  int views = 0, rc;
  unsigned long long bad = 0;
  tshare_view *v;
  while ((rc = tshare_view_recv_stream(ch, s, TIMEOUT, &v)) != TSHARE_END) {
    if (rc != TSHARE_OK) {
      snprintf(refusal, sizeof refusal, "%s", tshare_channel_last_error(ch));
      if (rc == TSHARE_E_TIMEOUT || rc == TSHARE_E_PEER_CLOSED) break;
      continue;
    }
    unsigned long long alloc = 0;
    bad += count_bad_in(v, s, &alloc);
    if (++views == 1) after_first = atomic_load(&fds_received);
    tshare_view_release(v);
    if (views == 2 && strcmp(arg, "lie") == 0) lie_closed(ch, alloc);
  }
  tshare_cuda_export_stats st;
  tshare_cuda_stats(&st);
  long at_end = atomic_load(&fds_received);
  if (after_first < 0) after_first = at_end;
  fprintf(out, "views=%d bad=%llu first_fds=%ld later_fds=%ld closes=%llu refusal=%s\n", views, bad,
          after_first - at_open, at_end - after_first, (unsigned long long)st.import_closes, refusal);
  fflush(out);
  cu->cuStreamDestroy(s);
  return 0;
}

/* Takes the views of two buffers (it keeps both mapped) and releases them,
 * then, once the producer says (a byte on fd 5) that it retired the first
 * and shared the second again behind the notice, takes that share: the
 * retired mapping is still open then (acting on the retire did not hold up
 * the share behind it), and closed by a receive that found nothing to read.
 * Reports the bad elements and the mappings closed at each point. */
static int role_behind(tshare_channel *ch, FILE *out) {
  CUstream s;
  CHECK(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
  tshare_view *v;
  unsigned long long bad = 0, alloc = 0;
  int rc;
  for (int i = 0; i < 2; i++) {
    CHECK_RC(tshare_view_recv_stream(ch, s, TIMEOUT, &v), TSHARE_OK, tshare_channel_last_error(ch));
    bad += count_bad_in(v, s, &alloc);
    tshare_view_release(v);
    rc = tshare_channel_poll(ch, 0); /* the release goes */
    CHECK(rc == TSHARE_OK || rc == TSHARE_E_TIMEOUT);
  }
  char go;
  CHECK(read(5, &go, 1) == 1); /* the retire and the share behind it are queued */
  tshare_cuda_export_stats before, with_share, after_wait;
  tshare_cuda_stats(&before);
  CHECK_RC(tshare_view_recv_stream(ch, s, TIMEOUT, &v), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_cuda_stats(&with_share);
  bad += count_bad_in(v, s, &alloc);
  tshare_view_release(v);
  rc = tshare_channel_poll(ch, 0); /* nothing to read: this receive would wait (the bye comes after the answer) */
  CHECK(rc == TSHARE_OK || rc == TSHARE_E_TIMEOUT || rc == TSHARE_END);
  tshare_cuda_stats(&after_wait);
  while (rc != TSHARE_END && (rc = tshare_view_recv_stream(ch, s, TIMEOUT, &v)) == TSHARE_OK) tshare_view_release(v);
  fprintf(out, "bad=%llu closes_with_share=%llu closes_after_wait=%llu\n", bad,
          (unsigned long long)(with_share.import_closes - before.import_closes),
          (unsigned long long)(after_wait.import_closes - before.import_closes));
  fflush(out);
  cu->cuStreamDestroy(s);
  return 0;
}

static int role_main(int argc, char **argv) {
  if (argc < 4) return 2;
  FILE *out = fdopen(4, "w");
  char why[256];
  cu = ck_init(why, sizeof why);
  if (!cu) {
    fprintf(out, "error %s\n", why);
    return 1;
  }
  tshare_channel *ch = open_ch(3, argv[2]);
  int rc = strcmp(argv[2], "counter") == 0  ? role_counter(argv[3], ch, out)
           : strcmp(argv[2], "behind") == 0 ? role_behind(ch, out)
                                            : 2;
  tshare_channel_close(ch);
  fclose(out);
  return rc;
}

__attribute__((constructor)) static void set_role(void) { ts_role_main = role_main; }

/* ---- the producer ------------------------------------------------------------ */

typedef struct consumer {
  tshare_process *proc;
  tshare_channel *ch; /* the producer's end */
  FILE *results;
} consumer;

/* A consumer running role (its arg); extra >= 0 becomes its fd 5. */
static consumer start_role(const char *role, const char *arg, int extra) {
  int sv[2], res[2];
  tshare_error err;
  if (tshare_socketpair(sv, &err) != TSHARE_OK) TS_FAIL("%s", err.message);
  CHECK(pipe2(res, O_CLOEXEC) == 0);
  char *argv[] = {(char *)"/proc/self/exe", (char *)"--role", (char *)role, (char *)arg, NULL};
  tshare_fd_map fds[3] = {{3, sv[1]}, {4, res[1]}, {5, extra}};
  tshare_spawn_options so = {.file = "/proc/self/exe", .argv = argv, .fds = fds, .nfds = extra >= 0 ? 3 : 2};
  consumer c;
  if (tshare_spawn(&so, &c.proc, &err) != TSHARE_OK) TS_FAIL("spawn: %s", err.message);
  close(sv[1]);
  close(res[1]);
  c.ch = open_ch(sv[0], "producer");
  c.results = fdopen(res[0], "r");
  return c;
}

static consumer start_consumer(const char *arg) { return start_role("counter", arg, -1); }

typedef struct report {
  int views;
  unsigned long long bad, closes;
  long first_fds, later_fds;
  char refusal[TSHARE_ERROR_MSG_MAX];
} report;

/* Bye, the consumer's report line, its exit. */
static const char *finish_line(consumer *c) {
  CHECK_RC(tshare_channel_send_bye(c->ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(c->ch));
  static char line[TSHARE_ERROR_MSG_MAX + 256];
  if (!fgets(line, sizeof line, c->results)) TS_FAIL("the consumer ended without a report");
  line[strcspn(line, "\n")] = '\0';
  printf("consumer: %s\n", line);
  tshare_channel_close(c->ch);
  tshare_exit_status st;
  if (tshare_process_wait(c->proc, TIMEOUT, &st) != TSHARE_OK) {
    tshare_process_terminate(c->proc, 1000, &st);
    TS_FAIL("the consumer did not end");
  }
  CHECK(st.kind == TSHARE_EXIT_CODE && st.value == 0);
  tshare_process_destroy(c->proc);
  fclose(c->results);
  return line;
}

static report finish(consumer *c) {
  const char *line = finish_line(c);
  report r;
  memset(&r, 0, sizeof r);
  if (sscanf(line, "views=%d bad=%llu first_fds=%ld later_fds=%ld closes=%llu", &r.views, &r.bad, &r.first_fds,
             &r.later_fds, &r.closes) != 5)
    TS_FAIL("consumer said: %s", line);
  const char *why = strstr(line, "refusal=");
  snprintf(r.refusal, sizeof r.refusal, "%s", why ? why + 8 : "");
  return r;
}

static unsigned long long alloc_id_of(tshare_cuda_buffer *b) {
  return (unsigned long long)ts_cuda_alloc_export(ts_cuda_buffer_alloc(b))->buffer_id;
}

/* Fill n int32s of b with base + k*3 and share them: the share's id. */
static uint64_t share_filled(tshare_channel *ch, tshare_cuda_buffer *b, int n, int base) {
  CHECK(ck_fill((CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(b), (size_t)n, base, 3, NULL) == CUDA_SUCCESS);
  tshare_tensor_desc d = vec_i32(n);
  char tag[64];
  snprintf(tag, sizeof tag, "%d 3 %d %llu", base, n, alloc_id_of(b));
  uint64_t id;
  CHECK_RC(tshare_share_cuda_buffer(ch, b, &d, NULL, tag, NULL, TIMEOUT, &id), TSHARE_OK,
           tshare_channel_last_error(ch));
  return id;
}

/* The same, then wait for the release. */
static void share_once(tshare_channel *ch, tshare_cuda_buffer *b, int n, int base) {
  uint64_t id = share_filled(ch, b, n, base);
  CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
}

static tshare_cuda_buffer *vmm_buffer(size_t bytes) {
  tshare_cuda_buffer *b;
  tshare_error err;
  CHECK_RC(tshare_cuda_buffer_create_kind(0, bytes, TSHARE_CUDA_HANDLE_FD, &b, &err), TSHARE_OK, err.message);
  return b;
}

static size_t free_gpu_memory(void) {
  size_t free_b = 0, total = 0;
  CHECK(cu->cuMemGetInfo(&free_b, &total) == CUDA_SUCCESS);
  return free_b;
}

/* One owned VMM buffer shared 100 times to one consumer: the first share
 * carries the fd, the others name the memory the consumer keeps mapped;
 * the data is right each time. Released (its last reference) while the
 * consumer keeps it, it is retired, the consumer closes it, and the memory
 * is the device's again. */
TS_TEST(an_owned_vmm_buffer_sends_its_fd_once_then_goes_by_its_id) {
  need_vmm_gpu();
  size_t bytes = 256u << 20, back = 200u << 20;
  consumer c = start_consumer("");
  tshare_cuda_buffer *b = vmm_buffer(bytes);
  int n = (int)(bytes / 4);
  for (int i = 0; i < SHARES; i++) share_once(c.ch, b, i == 0 ? n : 4096 + i, 1000 * i);
  /* Both processes map it now (the consumer's context is made and its
   * kernels loaded), so what comes back below is the buffer. */
  size_t held = free_gpu_memory(), after = held;
  tshare_cuda_buffer_release(b); /* the last reference: the consumer still keeps it mapped */
  for (long long until = now_ms() + 10000; now_ms() < until && after < held + back;) {
    int rc = tshare_channel_poll(c.ch, 5); /* the retire goes, its answer comes */
    CHECK(rc == TSHARE_OK || rc == TSHARE_E_TIMEOUT);
    after = free_gpu_memory();
  }
  printf("free GPU memory: %zu MiB while kept, %zu MiB after the buffer's release\n", held >> 20, after >> 20);
  report r = finish(&c);
  CHECK_EQ(r.views, SHARES);
  CHECK_EQ(r.bad, 0);
  CHECK(r.first_fds >= 1);  /* the first share's fd (and whatever the channel's own setup passed) */
  CHECK_EQ(r.later_fds, 0); /* 99 shares, and not one fd */
  CHECK_EQ(r.closes, 1);    /* its retire closed the kept mapping */
  CHECK(after >= held + back); /* and the 256 MiB are the device's again */
}

/* A slab's pieces go the same way: the slab is the allocation kept. */
TS_TEST(slab_pieces_send_the_slab_fd_once) {
  need_vmm_gpu();
  tshare_cuda_slab *slab;
  tshare_error err;
  CHECK_RC(tshare_cuda_slab_create_kind(0, 8u << 20, TSHARE_CUDA_HANDLE_FD, &slab, &err), TSHARE_OK, err.message);
  consumer c = start_consumer("");
  for (int i = 0; i < SHARES; i++) {
    tshare_cuda_buffer *piece;
    CHECK_RC(tshare_cuda_slab_alloc(slab, 64u << 10, &piece), TSHARE_OK, "slab full");
    share_once(c.ch, piece, 16384, 7 * i);
    tshare_cuda_buffer_release(piece);
  }
  tshare_cuda_slab_release(slab);
  report r = finish(&c);
  CHECK_EQ(r.views, SHARES);
  CHECK_EQ(r.bad, 0);
  CHECK(r.first_fds >= 1);
  CHECK_EQ(r.later_fds, 0);
}

/* A consumer that says it keeps the memory mapped, then answers out of turn
 * that it closed it (twice) while the producer still uses the buffer: the
 * producer frees nothing for it (it writes the buffer and shares it again,
 * which would fail on freed memory, and the data is right), and no longer
 * counts on the mapping: the next shares carry the fd again. */
TS_TEST(a_consumer_that_says_it_closed_what_it_keeps_frees_nothing_early) {
  need_vmm_gpu();
  consumer c = start_consumer("lie");
  tshare_cuda_buffer *b = vmm_buffer(4u << 20);
  share_once(c.ch, b, 4096, 11);
  for (int i = 1; i < 10; i++) share_once(c.ch, b, 4096, 11 + 1000 * i);
  tshare_cuda_buffer_release(b);
  for (long long until = now_ms() + 300; now_ms() < until;) (void)tshare_channel_poll(c.ch, 5);
  report r = finish(&c);
  CHECK_EQ(r.views, 10);
  CHECK_EQ(r.bad, 0);
  /* The second share went by id (the consumer had said it keeps the
   * memory); after the lie the producer no longer counts on that: the eight
   * that followed carried the fd. */
  CHECK_EQ(r.later_fds, 8);
}

/* A producer names its VMM buffer as memory the consumer keeps mapped before
 * the consumer ever mapped it (a share of kind TSHARE_MEM_CUDA_HELD, by
 * hand): refused with the reason, and the channel goes on. */
TS_TEST(a_held_share_of_memory_the_consumer_never_mapped_is_refused) {
  need_vmm_gpu();
  consumer c = start_consumer("");
  tshare_cuda_buffer *b = vmm_buffer(4u << 20);
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SHARE;
  tshare_share_frame *s = &f.u.share;
  s->share_id = 1u << 30;
  s->alloc_id = alloc_id_of(b);
  s->mem_kind = TSHARE_MEM_CUDA_HELD;
  s->device_type = TSHARE_DEVICE_CUDA;
  CHECK_EQ(tshare_cuda_device_uuid(0, s->device_uuid), TSHARE_OK);
  s->alloc_size = tshare_cuda_buffer_size(b);
  s->tensor = vec_i32(16);
  snprintf(s->tag, sizeof s->tag, "0 3 16 %llu", alloc_id_of(b));
  s->tag_len = (uint8_t)strlen(s->tag);
  CHECK_RC(tshare_channel_send_frame(c.ch, &f, -1, TIMEOUT), TSHARE_OK, tshare_channel_last_error(c.ch));
  for (bool back = false; !back;) { /* its release back is this test's to take */
    tshare_frame g;
    int fd = -1;
    CHECK_RC(tshare_channel_recv_frame(c.ch, &g, &fd, TIMEOUT), TSHARE_OK, tshare_channel_last_error(c.ch));
    if (fd >= 0) close(fd);
    for (uint32_t i = 0; g.type == TSHARE_FRAME_RELEASE && i < g.u.release.count; i++)
      back = back || g.u.release.share_ids[i] == s->share_id;
  }
  for (int i = 0; i < 3; i++) share_once(c.ch, b, 4096, 5 + i);
  tshare_cuda_buffer_release(b);
  report r = finish(&c);
  CHECK_EQ(r.views, 3);
  CHECK_EQ(r.bad, 0);
  CHECK(strstr(r.refusal, "does not keep mapped") != NULL);
  CHECK_EQ(r.later_fds, 0); /* the refusal changed nothing: the later shares went by id */
}

/* A consumer that finds the owner's retire of memory it keeps mapped queued
 * ahead of the next share takes that share first: the mapping is closed,
 * and the owner answered, once its receive would wait. Before, closing
 * came first: a new model's set waited behind the closing of every segment
 * of the model before it. The share behind the retire is of a buffer the
 * consumer keeps too (no fd: the two frames reach it in one read on either
 * transport). */
TS_TEST(a_retire_queued_ahead_of_a_share_is_acted_on_once_the_consumer_would_wait) {
  need_vmm_gpu();
  int go[2];
  CHECK(pipe2(go, O_CLOEXEC) == 0);
  consumer c = start_role("behind", "", go[0]);
  close(go[0]);
  tshare_cuda_buffer *first = vmm_buffer(4u << 20), *second = vmm_buffer(4u << 20);
  share_once(c.ch, first, 4096, 11);
  share_once(c.ch, second, 4096, 22);
  unsigned long long first_id = alloc_id_of(first);
  tshare_cuda_buffer_release(first); /* the last reference: the consumer still keeps it mapped */
  struct ts_cuda_chan *cc = ts_cuda_chan_if_used(c.ch);
  CHECK(cc != NULL);
  bool notice_went = false;
  for (long long until = now_ms() + 5000; !notice_went && now_ms() < until;) {
    int rc = tshare_channel_poll(c.ch, 1); /* its retire notice goes */
    CHECK(rc == TSHARE_OK || rc == TSHARE_E_TIMEOUT);
    lent_alloc *lent = ts_u64map_get(&cc->lent, MAPKEY(first_id));
    notice_went = lent && lent->retire_queued && cc->freed_notices.len == 0;
  }
  CHECK(notice_went);
  uint64_t id = share_filled(c.ch, second, 4096, 33); /* behind the notice, kept: no fd */
  CHECK(write(go[1], "x", 1) == 1);
  CHECK_RC(tshare_channel_wait_released(c.ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(c.ch));
  /* The consumer's answer ends the lending (and frees the memory): seen by
   * the answer, not by the device's free memory, which tests running beside
   * this one move. */
  for (long long until = now_ms() + 10000; now_ms() < until && ts_u64map_get(&cc->lent, MAPKEY(first_id));) {
    int rc = tshare_channel_poll(c.ch, 5);
    CHECK(rc == TSHARE_OK || rc == TSHARE_E_TIMEOUT);
  }
  bool answered = ts_u64map_get(&cc->lent, MAPKEY(first_id)) == NULL;
  const char *line = finish_line(&c);
  close(go[1]);
  unsigned long long bad, with_share, after_wait;
  CHECK(sscanf(line, "bad=%llu closes_with_share=%llu closes_after_wait=%llu", &bad, &with_share, &after_wait) == 3);
  CHECK_EQ(bad, 0);
  CHECK_EQ(with_share, 0); /* the retired mapping still open when the share behind it was taken */
  CHECK_EQ(after_wait, 1); /* and closed by the receive that would wait: the first buffer's alone */
  CHECK(answered);         /* and the owner heard so */
  tshare_cuda_buffer_release(second);
}

TS_TEST_MAIN
