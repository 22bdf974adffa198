/* A build without the CUDA toolkit: the GPU rows say so. */
#include "bench.h"

#include <stdio.h>

int bench_cuda_probe(char *why, size_t cap) {
  snprintf(why, cap, "tshare was built without the CUDA toolkit");
  return 0;
}

void *bench_cuda_consumer_stream(void) { return NULL; }

void bench_cuda_describe(char *out, size_t cap) { snprintf(out, cap, "built without CUDA"); }

void bench_cuda(bench *b) { (void)b; }

int bench_cuda_consumer(tshare_channel *ch, const char *cmd, char *reply, size_t cap) {
  (void)ch;
  (void)cmd;
  (void)reply;
  (void)cap;
  return 1;
}
