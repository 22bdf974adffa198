/* tshare-ucx-cuda-sets: a model's state_dict (290 bf16 tensors, each in a
 * buffer of its own) across a ucx:// channel as one tensor set, in GPU
 * memory (staged through host memory on both ends: session_stage.c,
 * backend_ucx_device.c) against the same model in host memory, paired in
 * one run: one producer and one consumer, each round sent from host memory
 * and then from GPU memory. Timed per model, from tshare_set_send to the
 * release (the consumer has every byte, on its GPU for the CUDA rounds).
 *
 *   tshare-ucx-cuda-sets [--rounds N] [--hidden H] [--address ucx://HOST:PORT/NAME]
 *
 * Defaults: 20 rounds after 2 of warm-up, hidden 256 (36.6 MiB, the model of
 * tshare-bench's UCX set rows), 127.0.0.1 (UCX_TLS=tcp unless set). Both
 * ends are children forked before either touches CUDA. Prints the rows and
 * the ratio GPU/host; exits 77 with the reason without a GPU or UCX. */
#include "bench_ucx_common.h"
#include "bench_stats.h"
#include "cudakit.h"

#include <tshare/tshare.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define TENSORS BENCH_MODEL_TENSORS
#define WARMUP 2
#define TIMEOUT_MS 60000

static int rounds = 20, hidden = 256;
static char address[128];

static void die(const char *what, const char *detail) {
  fprintf(stderr, "tshare-ucx-cuda-sets: %s: %s\n", what, detail);
  exit(1);
}

/* The model in host buffers (gpu 0) or in cuMemAlloc'd memory (gpu 1). */
static tshare_set_builder *model(const ts_cuda_api *cu, int gpu, double *mib) {
  tshare_set_builder *b = tshare_set_builder_create();
  size_t bytes = 0;
  tshare_error err;
  for (int i = 0; i < TENSORS; i++) {
    char name[64];
    int64_t shape[2];
    int ndim = bench_model_tensor(i, hidden, name, sizeof name, shape);
    tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_BFLOAT, 16, 1}, ndim, shape, 0);
    size_t size = (size_t)tshare_tensor_numel(&d) * 2;
    int rc;
    if (gpu) {
      CUdeviceptr p;
      if (cu->cuMemAlloc(&p, size) != CUDA_SUCCESS || cu->cuMemsetD8(p, (unsigned char)i, size) != CUDA_SUCCESS)
        die("cuMemAlloc", name);
      rc = tshare_set_builder_add_cuda(b, name, (void *)(uintptr_t)p, &d, &err); /* freed at exit */
    } else {
      tshare_host_buffer *buf;
      if (tshare_host_buffer_create(size, "bench-model", &buf, &err) != TSHARE_OK) die("host buffer", err.message);
      memset(tshare_host_buffer_data(buf), i, size);
      rc = tshare_set_builder_add_host(b, name, buf, &d, &err);
      tshare_host_buffer_destroy(buf);
    }
    if (rc != TSHARE_OK) die("add", err.message);
    bytes += size;
  }
  *mib = (double)bytes / (1 << 20);
  return b;
}

static tshare_channel *open_end(int listen) {
  tshare_channel *ch = NULL;
  tshare_error err;
  int rc = bench_ucx_open(address, listen, &ch, &err);
  if (rc == TSHARE_E_UNSUPPORTED) printf("skipped: %s\n", err.message), exit(77);
  if (rc != TSHARE_OK) die(listen ? "accept" : "connect", err.message);
  return ch;
}

static const ts_cuda_api *gpu_or_skip(void) {
  char why[256];
  const ts_cuda_api *cu = ck_init(why, sizeof why);
  if (!cu) printf("skipped: %s\n", why), exit(77);
  return cu;
}

/* Each round: the host model, then the GPU model, each timed from the
 * send to its release. */
static void producer(void) {
  const ts_cuda_api *cu = gpu_or_skip();
  tshare_channel *ch = open_end(1);
  if (!(tshare_channel_peer(ch)->capabilities & TSHARE_CAP_UCX_STAGED))
    printf("skipped: the consumer does not place staged GPU memory on a GPU\n"), exit(77);
  double mib;
  tshare_set_builder *models[2] = {model(cu, 0, &mib), model(cu, 1, &mib)};
  bs_samples took[2] = {{0}, {0}};
  for (int r = 0; r < WARMUP + rounds; r++)
    for (int gpu = 0; gpu < 2; gpu++) {
      uint64_t id, t0 = bs_now_ns();
      if (tshare_set_send(ch, models[gpu], NULL, TIMEOUT_MS, &id) != TSHARE_OK ||
          tshare_channel_wait_released(ch, id, TIMEOUT_MS) != TSHARE_OK)
        die("send", tshare_channel_last_error(ch));
      if (r >= WARMUP) bs_add(&took[gpu], (double)(bs_now_ns() - t0) / 1e3);
    }
  printf("a model of %d bf16 tensors (%.1f MiB), %d rounds, %s (UCX_TLS=%s)\n", TENSORS, mib, rounds, address,
         getenv("UCX_TLS"));
  printf("%-58s %10s %10s\n", "per model, send to release", "p50 us", "p99 us");
  const char *label[2] = {"host memory [ucx]", "GPU memory, staged through host memory [ucx]"};
  for (int gpu = 0; gpu < 2; gpu++)
    printf("%-58s %10.0f %10.0f\n", label[gpu], bs_percentile(&took[gpu], 50), bs_percentile(&took[gpu], 99));
  printf("GPU/host p50: %.2fx (%.2f GB/s GPU to GPU)\n", bs_percentile(&took[1], 50) / bs_percentile(&took[0], 50),
         mib * (1 << 20) / (bs_percentile(&took[1], 50) * 1e3));
  for (int gpu = 0; gpu < 2; gpu++) tshare_set_builder_destroy(models[gpu]), bs_free(&took[gpu]);
  tshare_channel_close(ch);
}

/* Takes every set; the GPU rounds' tensors must be on this end's GPU. */
static void consumer(void) {
  gpu_or_skip();
  tshare_channel *ch = open_end(0);
  for (int r = 0; r < 2 * (WARMUP + rounds); r++) {
    tshare_set *s;
    if (tshare_set_recv(ch, TIMEOUT_MS, &s) != TSHARE_OK) die("receive", tshare_channel_last_error(ch));
    if (tshare_set_cuda_device(s, 0) != (r % 2 ? 0 : -1)) die("receive", "a set landed in the wrong memory");
    tshare_set_release(s);
  }
  tshare_channel_close(ch);
}

int main(int argc, char **argv) {
  snprintf(address, sizeof address, "ucx://127.0.0.1:%d/bench", 21000 + getpid() % 20000);
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) rounds = atoi(argv[++i]);
    else if (strcmp(argv[i], "--hidden") == 0 && i + 1 < argc) hidden = atoi(argv[++i]);
    else if (strcmp(argv[i], "--address") == 0 && i + 1 < argc) snprintf(address, sizeof address, "%s", argv[++i]);
    else return fprintf(stderr, "usage: %s [--rounds N] [--hidden H] [--address ucx://HOST:PORT/NAME]\n", argv[0]), 2;
  }
  if (rounds < 1 || hidden < 1) return fprintf(stderr, "tshare-ucx-cuda-sets: rounds and hidden must be positive\n"), 2;
  if (!getenv("UCX_TLS")) setenv("UCX_TLS", "tcp", 1);
  fflush(stdout);
  pid_t pid[2];
  for (int side = 0; side < 2; side++) {
    pid[side] = fork();
    if (pid[side] < 0) die("fork", "failed");
    if (pid[side] == 0) {
      if (side == 0) producer();
      else consumer();
      fflush(stdout);
      _exit(0);
    }
  }
  int rc = 0;
  for (int left = 2; left > 0; left--) { /* one end that fails or skips ends the other */
    int status;
    pid_t done = wait(&status);
    int side_rc = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    if (side_rc != 0 && rc == 0) {
      rc = side_rc;
      kill(done == pid[0] ? pid[1] : pid[0], SIGKILL);
    }
  }
  return rc;
}
