#include "demo.h"

#include "demo_gpu.h"
#include "tshare/tshare.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SEGMENT_BYTES (4u << 20) /* each tensor sits at an offset inside one of two segments */
#define TIMEOUT_MS 30000

/* The dtypes the demo cycles through, so every element size and kind travels. */
static const tshare_dtype demo_dtypes[] = {
    {TSHARE_DTYPE_FLOAT, 32, 1}, {TSHARE_DTYPE_INT, 64, 1}, {TSHARE_DTYPE_FLOAT, 64, 1}, {TSHARE_DTYPE_INT, 32, 1},
    {TSHARE_DTYPE_UINT, 8, 1},   {TSHARE_DTYPE_INT, 16, 1}, {TSHARE_DTYPE_BOOL, 8, 1},   {TSHARE_DTYPE_FLOAT, 16, 1}};
#define NDTYPES (int)(sizeof demo_dtypes / sizeof demo_dtypes[0])

/* Expected value of logical element k of tensor i, as a small integer that
 * every demo dtype represents exactly. */
static long long expected(int i, long long k, tshare_dtype dt) {
  long long v = ((long long)i * 7919 + k * 31) % 2039;
  if (dt.code == TSHARE_DTYPE_BOOL) return v & 1;
  if (dt.bits == 8) return v % 127;
  return v - 1000; /* negatives too, where the dtype has them */
}

static uint16_t to_half(long long v) { /* exact for |v| < 2048 */
  if (v == 0) return 0;
  uint16_t sign = (uint16_t)(v < 0 ? 0x8000 : 0);
  unsigned long long m = (unsigned long long)(v < 0 ? -v : v);
  int e = 63 - __builtin_clzll(m);
  return (uint16_t)(sign | (uint16_t)((e + 15) << 10) | (uint16_t)(((m << 10) >> e) & 0x3ff));
}

static void store(void *p, tshare_dtype dt, long long v) {
  switch (dt.code) {
  case TSHARE_DTYPE_FLOAT:
    if (dt.bits == 16)
      *(uint16_t *)p = to_half(v);
    else if (dt.bits == 32)
      *(float *)p = (float)v;
    else
      *(double *)p = (double)v;
    break;
  case TSHARE_DTYPE_UINT:
  case TSHARE_DTYPE_BOOL:
    *(uint8_t *)p = (uint8_t)v;
    break;
  default:
    if (dt.bits == 16)
      *(int16_t *)p = (int16_t)v;
    else if (dt.bits == 32)
      *(int32_t *)p = (int32_t)v;
    else
      *(int64_t *)p = (int64_t)v;
  }
}

static bool matches(const void *p, tshare_dtype dt, long long v) {
  switch (dt.code) {
  case TSHARE_DTYPE_FLOAT:
    if (dt.bits == 16) return *(const uint16_t *)p == to_half(v);
    if (dt.bits == 32) return *(const float *)p == (float)v;
    return *(const double *)p == (double)v;
  case TSHARE_DTYPE_UINT:
  case TSHARE_DTYPE_BOOL:
    return *(const uint8_t *)p == (uint8_t)v;
  default:
    if (dt.bits == 16) return *(const int16_t *)p == (int16_t)v;
    if (dt.bits == 32) return *(const int32_t *)p == (int32_t)v;
    return *(const int64_t *)p == (int64_t)v;
  }
}

/* Visit every element of a strided view in logical (row-major) order. The
 * base points at element [0,...,0]. Returns the number of mismatches, and the
 * first one in *bad_k. */
static long long check_or_fill(void *base, const tshare_tensor_desc *d, int i, bool fill, long long *bad_k) {
  size_t item = tshare_dtype_itemsize(d->dtype);
  long long n = (long long)tshare_tensor_numel(d), bad = 0;
  for (long long k = 0; k < n; k++) {
    long long rest = k, off = 0;
    for (int dim = d->ndim - 1; dim >= 0; dim--) {
      off += (rest % d->shape[dim]) * d->strides[dim];
      rest /= d->shape[dim];
    }
    char *p = (char *)base + off * (long long)item;
    if (fill)
      store(p, d->dtype, expected(i, k, d->dtype));
    else if (!matches(p, d->dtype, expected(i, k, d->dtype)) && bad++ == 0)
      *bad_k = k;
  }
  return bad;
}

/* Tensor i's layout: 1-D, a 2-D matrix, or a transposed (non-contiguous) view. */
static tshare_tensor_desc layout_of(int i, uint64_t offset) {
  tshare_tensor_desc d;
  memset(&d, 0, sizeof d);
  d.dtype = demo_dtypes[i % NDTYPES];
  d.byte_offset = offset;
  switch (i % 3) {
  case 0:
    d.ndim = 1;
    d.shape[0] = 64 + 7 * i;
    d.strides[0] = 1;
    break;
  case 1:
    d.ndim = 2;
    d.shape[0] = 3 + i % 5;
    d.shape[1] = 17 + i;
    tshare_tensor_set_contiguous(&d);
    break;
  default: /* the transpose of a row-major rows x cols matrix */
    d.ndim = 2;
    d.shape[0] = 9 + i;
    d.shape[1] = 5;
    d.strides[0] = 1;
    d.strides[1] = 9 + i;
  }
  return d;
}

static bool same_layout(const tshare_tensor_desc *got, int i) {
  tshare_tensor_desc want = layout_of(i, got->byte_offset);
  if (got->ndim != want.ndim || got->dtype.code != want.dtype.code || got->dtype.bits != want.dtype.bits ||
      got->dtype.lanes != want.dtype.lanes)
    return false;
  for (int k = 0; k < want.ndim; k++)
    if (got->shape[k] != want.shape[k] || got->strides[k] != want.strides[k]) return false;
  return true;
}

static const char *describe(const tshare_tensor_desc *d, char *buf, size_t cap) {
  char dt[24];
  int n = snprintf(buf, cap, "%s[", tshare_dtype_name(d->dtype, dt, sizeof dt));
  for (int k = 0; k < d->ndim && n > 0 && (size_t)n < cap; k++)
    n += snprintf(buf + n, cap - (size_t)n, "%s%lld", k ? "x" : "", (long long)d->shape[k]);
  if (n > 0 && (size_t)n < cap)
    snprintf(buf + n, cap - (size_t)n, "]%s", d->strides[0] == 1 && d->ndim > 1 ? " (transposed view)" : "");
  return buf;
}

static int fail(const char *what, int rc, const char *detail) {
  fprintf(stderr, "%s: %s (%s)\n", what, detail, tshare_status_name(rc));
  return 1;
}

/* Device memory is filled and read through host staging copies (demo_gpu.h);
 * the layouts and checks are the host demo's. */

int demo_producer_main(int tensors, bool cuda) {
  tshare_role role;
  tshare_error err;
  int rc = tshare_role_from_env(&role, &err);
  if (rc != TSHARE_OK) return fail("role", rc, err.message);
  tshare_channel *ch[TSHARE_ROLE_CHANNELS_MAX] = {0};
  for (int c = 0; c < role.nchannels; c++) {
    rc = tshare_role_open_channel(&role, c, NULL, &ch[c], &err);
    if (rc != TSHARE_OK) return fail("open channel", rc, err.message);
  }
  tshare_host_buffer *seg[2] = {NULL, NULL};
  tshare_cuda_buffer *dseg[2] = {NULL, NULL};
  void *staging[2] = {NULL, NULL};
  void *stream = NULL;
  if (cuda && (rc = demo_gpu_open(&stream, &err)) != TSHARE_OK) return fail("GPU", rc, err.message);
  for (int s = 0; s < 2; s++) {
    if (cuda) {
      /* fd capabilities travel only on sockets; pipes get legacy handles */
      rc = tshare_cuda_buffer_create_kind(
          0, SEGMENT_BYTES,
          tshare_channel_kind_of(ch[0]) == TSHARE_CHANNEL_PIPES ? TSHARE_CUDA_HANDLE_LEGACY : TSHARE_CUDA_HANDLE_AUTO,
          &dseg[s], &err);
      staging[s] = calloc(1, SEGMENT_BYTES);
      if (rc == TSHARE_OK && !staging[s]) rc = TSHARE_E_NOMEM;
    } else {
      rc = tshare_host_buffer_create(SEGMENT_BYTES, s ? "tshare-demo-segment-1" : "tshare-demo-segment-0", &seg[s],
                                     &err);
      if (rc == TSHARE_OK) staging[s] = tshare_host_buffer_data(seg[s]);
    }
    if (rc != TSHARE_OK) return fail("allocate", rc, err.message);
  }
  /* Place the tensors one after another in alternating segments, 256-byte aligned. */
  tshare_tensor_desc *desc = calloc((size_t)tensors, sizeof *desc);
  uint64_t used[2] = {0, 0};
  for (int i = 0; i < tensors; i++) {
    int s = i % 2;
    desc[i] = layout_of(i, used[s]);
    uint64_t begin, end;
    tshare_error terr;
    rc = tshare_tensor_check(&desc[i], SEGMENT_BYTES, &begin, &end, &terr);
    if (rc != TSHARE_OK) return fail("layout (too many tensors for the demo segments?)", rc, terr.message);
    used[s] = (end + 255) / 256 * 256;
    long long unused;
    check_or_fill((char *)staging[s] + desc[i].byte_offset, &desc[i], i, true, &unused);
  }
  /* Queued on the stream; each share records an event after it, so the
   * consumers' streams wait for the copy without a host sync here. */
  for (int s = 0; cuda && s < 2; s++)
    if ((rc = demo_gpu_upload(stream, tshare_cuda_buffer_ptr(dseg[s]), staging[s], used[s], &err)) != TSHARE_OK)
      return fail("copy to the GPU", rc, err.message);
  for (int i = 0; i < tensors; i++) {
    char tag[16], what[96];
    snprintf(tag, sizeof tag, "t%d", i);
    for (int c = 0; c < role.nchannels; c++) {
      rc = cuda ? tshare_share_cuda_buffer(ch[c], dseg[i % 2], &desc[i], stream, tag, NULL, TIMEOUT_MS, NULL)
                : tshare_share_host(ch[c], seg[i % 2], &desc[i], tag, NULL, TIMEOUT_MS, NULL);
      if (rc != TSHARE_OK) return fail("share", rc, tshare_channel_last_error(ch[c]));
    }
    printf("shared #%d %s at byte %llu of %s segment %d with %d consumer%s\n", i, describe(&desc[i], what, sizeof what),
           (unsigned long long)desc[i].byte_offset, cuda ? "GPU" : "host", i % 2, role.nchannels,
           role.nchannels == 1 ? "" : "s");
  }
  for (int c = 0; c < role.nchannels; c++) {
    rc = tshare_channel_send_bye(ch[c], 0, TIMEOUT_MS);
    if (rc != TSHARE_OK) return fail("bye", rc, tshare_channel_last_error(ch[c]));
  }
  /* The memory stays ours until every consumer released every share. */
  for (int c = 0; c < role.nchannels; c++) {
    rc = tshare_channel_wait_released(ch[c], 0, TIMEOUT_MS);
    if (rc != TSHARE_OK) return fail("wait for releases", rc, tshare_channel_last_error(ch[c]));
  }
  size_t held = 0;
  for (int c = 0; c < role.nchannels; c++) held += tshare_channel_outstanding(ch[c]);
  for (int s = 0; cuda && s < 2; s++) { /* read the GPU copy back to check it */
    memset(staging[s], 0, SEGMENT_BYTES);
    if ((rc = demo_gpu_download(stream, staging[s], tshare_cuda_buffer_ptr(dseg[s]), used[s], &err)) != TSHARE_OK)
      return fail("copy from the GPU", rc, err.message);
  }
  /* The producer's own copy must be intact too: sharing must never cost data. */
  long long damaged = 0, bad_k = 0;
  for (int i = 0; i < tensors; i++)
    damaged += check_or_fill((char *)staging[i % 2] + desc[i].byte_offset, &desc[i], i, false, &bad_k) != 0;
  printf("all %d consumers released every share; %zu still held; %lld tensors changed on this side\n", role.nchannels,
         held, damaged);
  tshare_role_report(&role, "shared", tensors);
  for (int c = 0; c < role.nchannels; c++) tshare_channel_close(ch[c]);
  for (int s = 0; s < 2; s++) {
    if (cuda) {
      tshare_cuda_buffer_release(dseg[s]);
      free(staging[s]);
    } else {
      tshare_host_buffer_destroy(seg[s]);
    }
  }
  free(desc);
  return held == 0 && damaged == 0 ? 0 : 1;
}

int demo_consumer_main(int tensors, bool cuda) {
  tshare_role role;
  tshare_error err;
  int rc = tshare_role_from_env(&role, &err);
  if (rc != TSHARE_OK) return fail("role", rc, err.message);
  tshare_channel *ch;
  rc = tshare_role_open_channel(&role, 0, NULL, &ch, &err);
  if (rc != TSHARE_OK) return fail("open channel", rc, err.message);
  int received = 0, intact = 0;
  void *stream = NULL, *host = NULL;
  if (cuda && (rc = demo_gpu_open(&stream, &err)) != TSHARE_OK) return fail("GPU", rc, err.message);
  if (cuda && !(host = malloc(SEGMENT_BYTES))) return fail("GPU", TSHARE_E_NOMEM, "no memory for the staging copy");
  for (;;) {
    tshare_view *v;
    rc = tshare_view_recv_stream(ch, stream, TIMEOUT_MS, &v);
    if (rc == TSHARE_END) break;
    if (rc != TSHARE_OK) return fail("receive", rc, tshare_channel_last_error(ch));
    received++;
    int i = atoi(tshare_view_tag(v) + 1);
    const tshare_tensor_desc *d = tshare_view_desc(v);
    long long n = (long long)tshare_tensor_numel(d), bad_k = 0;
    /* The layout must be the one the producer chose for tensor i, and then
     * every element must hold its value. */
    void *data = tshare_view_data(v);
    if (tshare_view_device_type(v) == TSHARE_DEVICE_CUDA) {
      /* Copy the bytes the view spans, on the stream that waited for the
       * producer's event, then check them here. */
      uint64_t begin, end;
      tshare_tensor_check(d, d->byte_offset + SEGMENT_BYTES, &begin, &end, NULL);
      if (!host || end - d->byte_offset > SEGMENT_BYTES)
        return fail("copy from the GPU", TSHARE_E_TOO_LARGE, "the view spans more than a demo segment");
      if ((rc = demo_gpu_download(stream, host, data, end - d->byte_offset, &err)) != TSHARE_OK)
        return fail("copy from the GPU", rc, err.message);
      data = host;
    }
    long long bad = same_layout(d, i) ? check_or_fill(data, d, i, false, &bad_k) : n;
    char what[96];
    if (bad == 0) {
      intact++;
      printf("#%d %s: %lld/%lld elements intact\n", i, describe(d, what, sizeof what), n, n);
    } else {
      printf("#%d %s: %lld of %lld elements WRONG (first at element %lld)\n", i, describe(d, what, sizeof what), bad, n,
             bad_k);
    }
    tshare_view_release(v);
  }
  tshare_role_report(&role, "verified", intact);
  tshare_channel_close(ch);
  free(host);
  if (received != tensors) fprintf(stderr, "expected %d tensors, received %d\n", tensors, received);
  return intact == tensors && received == tensors ? 0 : 1;
}
