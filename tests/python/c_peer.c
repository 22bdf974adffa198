/* A C producer role for tshare-launch, the C side of the Python interop
 * tests: it shares the host tensors of cases.py out of one host buffer per
 * dtype (element k of the 4x6 base is k % 61; bool: k % 3 == 0), with the
 * layouts given as descriptors the way a C program writes them.
 *
 *   c_peer produce            every dtype x layout, tag "dtype/layout"
 *   c_peer produce-negative   a float32 view with a negative stride (tag
 *                             "negative"), then float32/contiguous
 *   c_peer produce-set        every dtype x layout in one tensor set (names
 *                             "dtype/layout", metadata "cases"), the views of
 *                             one dtype in one buffer
 *   c_peer produce-set-negative  a set of float32/contiguous and a view with
 *                             a negative stride ("negative"), then produce-set
 */
#include <tshare/tshare.h>

#include <stdio.h>
#include <string.h>

typedef struct {
  const char *name;
  tshare_dtype dtype;
} dtype_case;

static const dtype_case dtypes[] = {
  {"bool", {TSHARE_DTYPE_BOOL, 8, 1}},      {"uint8", {TSHARE_DTYPE_UINT, 8, 1}},
  {"int8", {TSHARE_DTYPE_INT, 8, 1}},       {"int16", {TSHARE_DTYPE_INT, 16, 1}},
  {"int32", {TSHARE_DTYPE_INT, 32, 1}},     {"int64", {TSHARE_DTYPE_INT, 64, 1}},
  {"float16", {TSHARE_DTYPE_FLOAT, 16, 1}}, {"bfloat16", {TSHARE_DTYPE_BFLOAT, 16, 1}},
  {"float32", {TSHARE_DTYPE_FLOAT, 32, 1}}, {"float64", {TSHARE_DTYPE_FLOAT, 64, 1}},
  {"complex64", {TSHARE_DTYPE_COMPLEX, 64, 1}}, {"complex128", {TSHARE_DTYPE_COMPLEX, 128, 1}}};

/* A small whole number as IEEE half: exact for 0..2047. */
static uint16_t half_of(unsigned v) {
  if (v == 0) return 0;
  unsigned e = 31u - (unsigned)__builtin_clz(v);
  return (uint16_t)(((e + 15u) << 10) | ((v << (10u - e)) & 0x3FFu));
}

static void fill(unsigned char *p, const char *name) {
  for (unsigned k = 0; k < 24; k++) {
    unsigned v = k % 61u;
    if (!strcmp(name, "bool")) p[k] = k % 3u == 0;
    else if (!strcmp(name, "uint8") || !strcmp(name, "int8")) p[k] = (unsigned char)v;
    else if (!strcmp(name, "int16")) ((int16_t *)(void *)p)[k] = (int16_t)v;
    else if (!strcmp(name, "int32")) ((int32_t *)(void *)p)[k] = (int32_t)v;
    else if (!strcmp(name, "int64")) ((int64_t *)(void *)p)[k] = (int64_t)v;
    else if (!strcmp(name, "float16")) ((uint16_t *)(void *)p)[k] = half_of(v);
    else if (!strcmp(name, "bfloat16")) {
      float f = (float)v;
      uint32_t bits;
      memcpy(&bits, &f, 4);
      ((uint16_t *)(void *)p)[k] = (uint16_t)(bits >> 16); /* exact: small whole numbers */
    } else if (!strcmp(name, "float32")) ((float *)(void *)p)[k] = (float)v;
    else if (!strcmp(name, "float64")) ((double *)(void *)p)[k] = (double)v;
    else if (!strcmp(name, "complex64")) {
      ((float *)(void *)p)[2 * k] = (float)v;
      ((float *)(void *)p)[2 * k + 1] = 0.0f;
    } else {
      ((double *)(void *)p)[2 * k] = (double)v;
      ((double *)(void *)p)[2 * k + 1] = 0.0;
    }
  }
}

/* cases.py's layouts as descriptors over the contiguous 4x6 base at offset 0. */
static int layout(const char *name, tshare_dtype dtype, tshare_tensor_desc *d) {
  int64_t base_shape[2] = {4, 6};
  uint64_t item = tshare_dtype_itemsize(dtype);
  *d = tshare_tensor_contiguous(dtype, 2, base_shape, 0);
  if (!strcmp(name, "contiguous")) return 0;
  if (!strcmp(name, "transposed")) {
    d->shape[0] = 6, d->shape[1] = 4, d->strides[0] = 1, d->strides[1] = 6;
  } else if (!strcmp(name, "sliced")) {
    d->shape[0] = 2, d->shape[1] = 3, d->byte_offset = (1 * 6 + 2) * item;
  } else if (!strcmp(name, "strided")) {
    d->shape[1] = 3, d->strides[1] = 2;
  } else if (!strcmp(name, "expanded")) {
    d->shape[0] = 3, d->strides[0] = 0, d->byte_offset = 6 * item;
  } else if (!strcmp(name, "scalar")) {
    d->ndim = 0, d->byte_offset = (2 * 6 + 3) * item;
  } else if (!strcmp(name, "empty")) {
    d->shape[0] = 0;
  } else if (!strcmp(name, "permuted3d")) {
    d->ndim = 3;
    d->shape[0] = 6, d->shape[1] = 2, d->shape[2] = 2;
    d->strides[0] = 1, d->strides[1] = 12, d->strides[2] = 6;
  } else {
    return -1;
  }
  return 0;
}

static const char *layouts[] = {"contiguous", "transposed", "sliced", "strided",
                                "expanded",   "scalar",     "empty",  "permuted3d"};

#define SET_META "cases" /* what peer.py's consumer expects of a set */

#define HELLO_TIMEOUT_MS 60000 /* well within the test's 100 s launcher timeout */

static tshare_role role;
static tshare_channel **channels;

/* To every consumer. */
static int share(tshare_host_buffer *buf, const tshare_tensor_desc *d, const char *tag) {
  for (int c = 0; c < role.nchannels; c++) {
    int rc = tshare_share_host(channels[c], buf, d, tag, NULL, 30000, NULL);
    if (rc != TSHARE_OK) {
      fprintf(stderr, "c_peer: share %s: %s\n", tag, tshare_channel_last_error(channels[c]));
      return rc;
    }
  }
  return TSHARE_OK;
}

static tshare_host_buffer *filled_buffer(const char *dtype_name) {
  tshare_host_buffer *buf = NULL;
  tshare_error err;
  if (tshare_host_buffer_create(24 * 16, "c_peer", &buf, &err) != TSHARE_OK) {
    fprintf(stderr, "c_peer: %s\n", err.message);
    return NULL;
  }
  fill(tshare_host_buffer_data(buf), dtype_name);
  return buf;
}

static int send_to_all(const tshare_set_builder *b) {
  int rc = TSHARE_OK;
  for (int c = 0; c < role.nchannels && rc == TSHARE_OK; c++) {
    rc = tshare_set_send(channels[c], b, NULL, 30000, NULL);
    if (rc != TSHARE_OK) fprintf(stderr, "c_peer: send set: %s\n", tshare_channel_last_error(channels[c]));
  }
  return rc;
}

/* A set no PyTorch consumer can take: float32/contiguous and its rows upside down. */
static int share_negative_set(void) {
  tshare_set_builder *b = tshare_set_builder_create();
  tshare_host_buffer *buf = filled_buffer("float32");
  tshare_error err = {0};
  tshare_tensor_desc d;
  layout("contiguous", (tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, &d);
  int rc = b && buf ? tshare_set_builder_add_host(b, "float32/contiguous", buf, &d, &err) : TSHARE_E_NOMEM;
  d.strides[0] = -6, d.byte_offset = 3 * 6 * 4;
  if (rc == TSHARE_OK) rc = tshare_set_builder_add_host(b, "negative", buf, &d, &err);
  if (rc != TSHARE_OK) fprintf(stderr, "c_peer: build set: %s\n", err.message);
  else rc = send_to_all(b);
  tshare_host_buffer_destroy(buf);
  tshare_set_builder_destroy(b);
  return rc;
}

/* Every case in one set, sent to every consumer: the count of tensors, or -1. */
static int share_one_set(int negative) {
  if (negative && share_negative_set() != TSHARE_OK) return -1;
  tshare_set_builder *b = tshare_set_builder_create();
  tshare_error err = {0};
  int count = 0, rc = b ? TSHARE_OK : TSHARE_E_NOMEM;
  for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0] && rc == TSHARE_OK; i++) {
    tshare_host_buffer *buf = filled_buffer(dtypes[i].name);
    if (!buf) rc = TSHARE_E_NOMEM;
    for (size_t l = 0; buf && l < sizeof layouts / sizeof layouts[0] && rc == TSHARE_OK; l++, count++) {
      char name[64];
      tshare_tensor_desc d;
      snprintf(name, sizeof name, "%s/%s", dtypes[i].name, layouts[l]);
      layout(layouts[l], dtypes[i].dtype, &d);
      rc = tshare_set_builder_add_host(b, name, buf, &d, &err);
    }
    tshare_host_buffer_destroy(buf); /* the builder holds it */
  }
  if (rc == TSHARE_OK) rc = tshare_set_builder_set_meta(b, SET_META, strlen(SET_META), &err);
  if (rc != TSHARE_OK) fprintf(stderr, "c_peer: build set: %s\n", err.message);
  else rc = send_to_all(b);
  tshare_set_builder_destroy(b);
  return rc == TSHARE_OK ? count : -1;
}

/* Every case one share at a time: the count, or -1. */
static int share_each(int negative) {
  int shared = 0;
  for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
    if (negative && strcmp(dtypes[i].name, "float32") != 0) continue;
    tshare_host_buffer *buf = filled_buffer(dtypes[i].name);
    if (!buf) return -1;
    if (negative) {
      tshare_tensor_desc d;
      layout("contiguous", dtypes[i].dtype, &d);
      d.strides[0] = -6, d.byte_offset = 3 * 6 * 4; /* the rows upside down */
      if (share(buf, &d, "negative") != TSHARE_OK) return -1;
    }
    for (size_t l = 0; l < sizeof layouts / sizeof layouts[0]; l++) {
      if (negative && l > 0) break;
      char tag[64];
      tshare_tensor_desc d;
      snprintf(tag, sizeof tag, "%s/%s", dtypes[i].name, layouts[l]);
      layout(layouts[l], dtypes[i].dtype, &d);
      if (share(buf, &d, tag) != TSHARE_OK) return -1;
      shared++;
    }
    tshare_host_buffer_destroy(buf); /* the shares hold it now */
  }
  return shared;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "produce";
  int negative = strstr(mode, "-negative") != NULL;
  tshare_error err;
  tshare_channel *chs[TSHARE_ROLE_CHANNELS_MAX];
  if (tshare_role_from_env(&role, &err) != TSHARE_OK) {
    fprintf(stderr, "c_peer: %s\n", err.message);
    return 2;
  }
  /* The Python consumers import torch before they answer the hello: on a
   * loaded machine that takes longer than the default 10 s. */
  tshare_channel_options opts;
  tshare_channel_options_init(&opts);
  opts.handshake_timeout_ms = HELLO_TIMEOUT_MS;
  for (int c = 0; c < role.nchannels; c++) {
    if (tshare_role_open_channel(&role, c, &opts, &chs[c], &err) != TSHARE_OK) {
      fprintf(stderr, "c_peer: %s\n", err.message);
      return 2;
    }
  }
  channels = chs;
  int shared = strncmp(mode, "produce-set", 11) == 0 ? share_one_set(negative) : share_each(negative);
  if (shared < 0) return 1;
  for (int c = 0; c < role.nchannels; c++) {
    if (tshare_channel_wait_released(chs[c], 0, 60000) != TSHARE_OK) {
      fprintf(stderr, "c_peer: %s\n", tshare_channel_last_error(chs[c]));
      return 1;
    }
  }
  tshare_role_report(&role, "shared", shared);
  printf("C producer: shared %d tensors, all released\n", shared);
  for (int c = 0; c < role.nchannels; c++) tshare_channel_close(chs[c]);
  return 0;
}
