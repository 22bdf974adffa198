/* Example: a producer that hands batches to worker processes, zero-copy.
 *
 * Run it under tshare-launch:
 *   tshare-launch --producer "batch_producer 24" --consumer batch_consumer --consumers 2
 *
 * Batches are float32 [ROWS x COLS] matrices written into a ring of SLOTS slots
 * inside one shared host buffer. Batch b goes to worker b % K. A slot is only
 * rewritten after the worker that got it released it: that is the lifetime
 * protocol doing its job, not a copy. Uses only the public tshare C API.
 */
#include <tshare/tshare.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { ROWS = 32, COLS = 256, SLOTS = 4, TIMEOUT_MS = 10000 };

/* Value of element (r, c) of batch b: the workers recompute it to check. */
static float batch_value(int b, int r, int c) { return (float)(b * 1000 + r) + (float)c / 256.0f; }

static int die(const char *what, const char *detail) {
  fprintf(stderr, "batch_producer: %s: %s\n", what, detail);
  return 1;
}

int main(int argc, char **argv) {
  int batches = argc > 1 ? atoi(argv[1]) : 16;
  if (batches < 1) return die("usage", "batch_producer [BATCHES]");
  setvbuf(stdout, NULL, _IOLBF, 0);

  tshare_role role;
  tshare_error err;
  if (tshare_role_from_env(&role, &err) != TSHARE_OK) return die("environment", err.message);
  int workers = role.nchannels;
  tshare_channel **ch = calloc((size_t)workers, sizeof *ch);
  for (int w = 0; w < workers; w++)
    if (tshare_role_open_channel(&role, w, NULL, &ch[w], &err) != TSHARE_OK) return die("channel", err.message);

  const size_t slot_bytes = ROWS * COLS * sizeof(float);
  tshare_host_buffer *ring;
  if (tshare_host_buffer_create(SLOTS * slot_bytes, "batch-ring", &ring, &err) != TSHARE_OK)
    return die("allocate", err.message);

  uint64_t slot_share[SLOTS] = {0}; /* the share that last used each slot */
  int slot_worker[SLOTS] = {0};
  for (int b = 0; b < batches; b++) {
    int slot = b % SLOTS, w = b % workers;
    /* Reuse the slot only once its previous batch is released. */
    if (slot_share[slot] &&
        tshare_channel_wait_released(ch[slot_worker[slot]], slot_share[slot], TIMEOUT_MS) != TSHARE_OK)
      return die("wait for release", tshare_channel_last_error(ch[slot_worker[slot]]));
    float *m = (float *)((char *)tshare_host_buffer_data(ring) + (size_t)slot * slot_bytes);
    for (int r = 0; r < ROWS; r++)
      for (int c = 0; c < COLS; c++) m[r * COLS + c] = batch_value(b, r, c);

    const int64_t shape[2] = {ROWS, COLS};
    tshare_tensor_desc desc =
        tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 2, shape, (uint64_t)slot * slot_bytes);
    char tag[32];
    snprintf(tag, sizeof tag, "batch %d", b);
    if (tshare_share_host(ch[w], ring, &desc, tag, NULL, TIMEOUT_MS, &slot_share[slot]) != TSHARE_OK)
      return die("share", tshare_channel_last_error(ch[w]));
    slot_worker[slot] = w;
    printf("sent batch %d to worker %d (slot %d)\n", b, w, slot);
  }
  for (int w = 0; w < workers; w++) {
    if (tshare_channel_send_bye(ch[w], 0, TIMEOUT_MS) != TSHARE_OK ||
        tshare_channel_wait_released(ch[w], 0, TIMEOUT_MS) != TSHARE_OK)
      return die("finish", tshare_channel_last_error(ch[w]));
    tshare_channel_close(ch[w]);
  }
  tshare_role_report(&role, "shared", batches);
  printf("all %d batches handed out and released\n", batches);
  tshare_host_buffer_destroy(ring);
  free(ch);
  return 0;
}
