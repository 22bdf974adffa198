/* What the UCX benches share (tshare-bench's bench_ucx.c and
 * tshare-ucx-cuda-sets): the two ends of a ucx:// channel, and the model
 * their set rows send: a transformer's 290 tensors, as its state_dict names
 * and shapes them (per layer 4 attention weights and biases, 2 MLP weights,
 * 2 norms; then the embedding and the final norm). */
#ifndef TSHARE_BENCH_UCX_COMMON_H
#define TSHARE_BENCH_UCX_COMMON_H

#include "tshare/tshare.h"

#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

/* The listener's end (listen) or the connector's of a channel at address,
 * token "bench-token"; the connector tries again while the listener is not
 * up yet. A status, err filled on failure. */
static inline int bench_ucx_open(const char *address, int listen, tshare_channel **out, tshare_error *err) {
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.token = "bench-token";
  o.handshake_timeout_ms = 10000;
  *out = NULL;
  int rc = TSHARE_OK;
  if (listen) {
    tshare_listener *l;
    rc = tshare_listen(address, &l, err);
    if (rc == TSHARE_OK) {
      rc = tshare_listener_accept(l, &o, 20000, out, err);
      tshare_listener_close(l);
    }
    return rc;
  }
  for (int tries = 0; tries < 100; tries++) {
    rc = tshare_connect(address, &o, 2000, out, err);
    if (rc != TSHARE_E_NOT_FOUND && rc != TSHARE_E_TIMEOUT) break;
    usleep(20000);
  }
  return rc;
}

#define BENCH_MODEL_LAYERS 24
#define BENCH_MODEL_VOCAB 1000
#define BENCH_MODEL_TENSORS (BENCH_MODEL_LAYERS * 12 + 2)

/* Tensor i of the model of this hidden size: its name, its shape; returns
 * its number of dimensions. */
static inline int bench_model_tensor(int i, int64_t hidden, char *name, size_t cap, int64_t *shape) {
  static const char *const parts[12] = {"q.weight", "k.weight", "v.weight", "o.weight",  "q.bias",      "k.bias",
                                        "v.bias",   "o.bias",   "up.weight", "down.weight", "ln1.weight", "ln2.weight"};
  if (i == BENCH_MODEL_TENSORS - 2) {
    snprintf(name, cap, "embed.weight");
    shape[0] = BENCH_MODEL_VOCAB, shape[1] = hidden;
    return 2;
  }
  if (i == BENCH_MODEL_TENSORS - 1) {
    snprintf(name, cap, "norm.weight");
    shape[0] = hidden;
    return 1;
  }
  int part = i % 12;
  snprintf(name, cap, "layers.%d.%s", i / 12, parts[part]);
  shape[0] = part == 8 ? 4 * hidden : hidden;
  shape[1] = part == 9 ? 4 * hidden : hidden;
  return part < 4 || part == 8 || part == 9 ? 2 : 1;
}

#endif /* TSHARE_BENCH_UCX_COMMON_H */
