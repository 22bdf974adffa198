/* The load test: K consumers, N shares each, random sizes, random release
 * order (the consumers hold a random number of views and let a random one
 * go); memory is looked at after a warm-up and at the end. */
#include "stress.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define WARMUP_SHARES 10000
#define RSS_GROWTH_MAX_KIB 8192
#define GPU_SLACK (4ll << 20)

typedef struct lane {
  stress_peer peer;
  stress_source *src;
  long shares;
  int rc;
  pthread_barrier_t *warm;
} lane;

/* A consumer process and the memory to share with it. */
static int lane_open(lane *l, stress_mem mem, const char *arg, uint32_t seed, long shares, char *why, size_t cap) {
  l->shares = shares;
  if (stress_peer_start("consumer", mem, arg, &l->peer, why, cap) != 0) return -1;
  return (l->src = stress_source_create(mem, seed, why, cap)) ? 0 : -1;
}

/* Close the channel, free the memory, and the consumer's exit code. */
static int lane_close(lane *l) {
  tshare_channel_close(l->peer.ch);
  stress_source_destroy(l->src);
  return stress_peer_wait(&l->peer, STRESS_TIMEOUT_MS);
}

/* Share, say bye, wait for every release. With warm set, every lane meets
 * the main thread there after WARMUP_SHARES (it looks at memory meanwhile). */
static void *run_lane(void *arg) {
  lane *l = arg;
  l->rc = TSHARE_OK;
  for (long i = 0; i < l->shares; i++) {
    if (i == WARMUP_SHARES && l->warm) pthread_barrier_wait(l->warm), pthread_barrier_wait(l->warm);
    if (l->rc == TSHARE_OK) l->rc = stress_source_share(l->src, l->peer.ch, (uint64_t)i, true, STRESS_TIMEOUT_MS);
  }
  if (l->warm && l->shares <= WARMUP_SHARES) pthread_barrier_wait(l->warm), pthread_barrier_wait(l->warm);
  if (l->rc == TSHARE_OK) l->rc = tshare_channel_send_bye(l->peer.ch, 0, STRESS_TIMEOUT_MS);
  if (l->rc == TSHARE_OK) l->rc = tshare_channel_wait_released(l->peer.ch, 0, STRESS_TIMEOUT_MS);
  if (l->rc != TSHARE_OK)
    fprintf(stderr, "lane: %s: %s\n", tshare_status_name(l->rc), tshare_channel_last_error(l->peer.ch));
  return NULL;
}

int stress_load(int argc, char **argv) {
  stress_mem mem;
  if (stress_mem_arg(argc, argv, &mem) != 0) return 2;
  int consumers = (int)stress_opt(argc, argv, "--consumers", 4);
  long shares = stress_opt(argc, argv, "--shares", 100000);
  uint32_t seed = (uint32_t)stress_opt(argc, argv, "--seed", (long)time(NULL));
  char why[256];
  if (consumers < 1 || consumers > 64 || shares < 1) {
    fprintf(stderr, "load: --consumers 1..64, --shares >= 1\n");
    return 2;
  }
  if (stress_mem_ready(mem, why, sizeof why) != 0) {
    printf("SKIP: %s\n", why);
    return STRESS_SKIP;
  }
  printf("load (%s memory): %d consumers x %ld shares, random sizes 64 B..64 KiB (1 in 256 a fresh allocation up to "
         "256 KiB), random release order, seed %u\n",
         stress_mem_name(mem), consumers, shares, seed);
  fflush(stdout);
  /* One short lane first, so that what the driver and the allocator set up
   * once per process (its fds among them) is in the baseline. */
  lane first = {0};
  if (lane_open(&first, mem, "3", seed, 512, why, sizeof why) != 0) {
    fprintf(stderr, "load: %s\n", why);
    return 1;
  }
  run_lane(&first);
  if (lane_close(&first) != 0 || first.rc != TSHARE_OK) {
    fprintf(stderr, "load: the first lane failed: %s\n", tshare_status_name(first.rc));
    return 1;
  }
  stress_snapshot start, warm, end, closed;
  stress_snapshot_take(&start);
  lane *lanes = calloc((size_t)consumers, sizeof *lanes);
  pthread_barrier_t barrier;
  pthread_barrier_init(&barrier, NULL, (unsigned)consumers + 1);
  pthread_t *threads = calloc((size_t)consumers, sizeof *threads);
  if (!lanes || !threads) return 1;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 0; i < consumers; i++) {
    char arg[48];
    snprintf(arg, sizeof arg, "%u,report", seed + (uint32_t)i * 7919u);
    if (lane_open(&lanes[i], mem, arg, seed + (uint32_t)i, shares, why, sizeof why) != 0) {
      fprintf(stderr, "load: %s\n", why);
      return 1;
    }
    lanes[i].warm = &barrier;
    pthread_create(&threads[i], NULL, run_lane, &lanes[i]);
  }
  pthread_barrier_wait(&barrier); /* every lane is past its warm-up */
  stress_snapshot_take(&warm);
  pthread_barrier_wait(&barrier);
  int failed = 0;
  for (int i = 0; i < consumers; i++) {
    pthread_join(threads[i], NULL);
    failed += lanes[i].rc != TSHARE_OK;
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  stress_snapshot_take(&end); /* everything released, channels still open */
  for (int i = 0; i < consumers; i++) {
    int code = lane_close(&lanes[i]);
    if (code != 0) {
      fprintf(stderr, "load: consumer %d exited %d\n", i, code);
      failed++;
    }
  }
  stress_snapshot_take(&closed);
  double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  stress_snapshot_print(stdout, "producer at start", &start);
  stress_snapshot_print(stdout, "after the warm-up", &warm);
  stress_snapshot_print(stdout, "after every release", &end);
  stress_snapshot_print(stdout, "channels closed", &closed);
  bool no_growth = end.fds <= warm.fds && end.cuda_events <= (uint64_t)consumers * STRESS_EVENTS_PER_CHANNEL &&
                   end.rss_kib - warm.rss_kib <= RSS_GROWTH_MAX_KIB &&
                   (warm.gpu_free < 0 || end.gpu_free + GPU_SLACK >= warm.gpu_free) &&
                   /* the CUDA driver may open an fd of its own the first time a thread uses it */
                   closed.fds <= start.fds + (mem == STRESS_CUDA ? consumers : 0);
  printf("load %s: %ld shares in %.1f s (%.0f/s), %d lanes failed; producer growth after the warm-up: fds %+ld, "
         "RSS %+ld KiB, CUDA events %+lld (%llu held, bound %d)",
         stress_mem_name(mem), shares * consumers, secs, (double)(shares * consumers) / secs, failed,
         end.fds - warm.fds, end.rss_kib - warm.rss_kib, (long long)end.cuda_events - (long long)warm.cuda_events, (unsigned long long)end.cuda_events,
         consumers * STRESS_EVENTS_PER_CHANNEL);
  if (warm.gpu_free >= 0) printf(", GPU free %+lld KiB", (end.gpu_free - warm.gpu_free) / 1024);
  printf("; fds after closing %ld (at start %ld): %s\n", closed.fds, start.fds,
         failed == 0 && no_growth ? "no error, no leak, no growth" : "FAILED");
  pthread_barrier_destroy(&barrier);
  free(lanes);
  free(threads);
  return failed == 0 && no_growth ? 0 : 1;
}
