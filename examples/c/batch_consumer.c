/* Example: a worker that receives batches from batch_producer and computes on
 * them in place (row means), without copying them out of the producer's
 * memory. Checks every element against the producer's formula and exits 1 if
 * any differs. Uses only the public tshare C API. */
#include <tshare/tshare.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static float batch_value(int b, int r, int c) { return (float)(b * 1000 + r) + (float)c / 256.0f; }

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  tshare_role role;
  tshare_error err;
  if (tshare_role_from_env(&role, &err) != TSHARE_OK) {
    fprintf(stderr, "batch_consumer: %s\n", err.message);
    return 1;
  }
  tshare_channel *ch;
  if (tshare_role_open_channel(&role, 0, NULL, &ch, &err) != TSHARE_OK) {
    fprintf(stderr, "batch_consumer: %s\n", err.message);
    return 1;
  }
  int received = 0, wrong = 0;
  for (;;) {
    tshare_view *v;
    int rc = tshare_view_recv(ch, 10000, &v);
    if (rc == TSHARE_END) break; /* the producer said bye */
    if (rc != TSHARE_OK) {
      fprintf(stderr, "batch_consumer: %s\n", tshare_channel_last_error(ch));
      return 1;
    }
    const tshare_tensor_desc *d = tshare_view_desc(v);
    const float *m = tshare_view_data(v);
    int b = atoi(tshare_view_tag(v) + 6); /* "batch N" */
    double first_mean = 0, last_mean = 0;
    for (int64_t r = 0; r < d->shape[0]; r++) {
      double sum = 0;
      for (int64_t c = 0; c < d->shape[1]; c++) {
        float x = m[r * d->strides[0] + c * d->strides[1]];
        if (x != batch_value(b, (int)r, (int)c)) wrong++;
        sum += x;
      }
      if (r == 0) first_mean = sum / (double)d->shape[1];
      last_mean = sum / (double)d->shape[1];
    }
    printf("worker %d: %s [%lldx%lld] row means %.3f .. %.3f\n", role.rank, tshare_view_tag(v), (long long)d->shape[0],
           (long long)d->shape[1], first_mean, last_mean);
    tshare_view_release(v); /* the producer may now reuse the slot */
    received++;
  }
  tshare_role_report(&role, "verified", wrong ? 0 : received);
  tshare_channel_close(ch);
  if (wrong) fprintf(stderr, "batch_consumer: %d elements differ from what the producer wrote\n", wrong);
  return wrong ? 1 : 0;
}
