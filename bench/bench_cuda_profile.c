/* Where a CUDA hand-off's time goes (bench_cuda_profile.h). */
#include "bench_cuda_profile.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---- the driver calls alone ---------------------------------------------- */

#define BATCH 8 /* calls timed together: the clock's own cost spread over them */

typedef enum probe_kind {
  P_EVENT_RECORD,
  P_STREAM_WAIT_EVENT,
  P_WRITE_VALUE64,
  P_WAIT_VALUE64,
  P_IPC_GET_MEM_HANDLE,
  P_POINTER_GET_ATTRIBUTE,
  P_POINTER_GET_ATTRIBUTES,
  P_MEM_GET_ADDRESS_RANGE,
  P_CTX_GET_CURRENT,
  P_EVENT_QUERY,
  P_CTX_PUSH_POP,
  P_STREAM_QUERY,
  P_STREAM_GET_CTX,
  P_PROBES
} probe_kind;

static const char *const probe_keys[P_PROBES][2] = {
    {"drv_event_record", "cuEventRecord, an interprocess event"},
    {"drv_stream_wait_event", "cuStreamWaitEvent on that event"},
    {"drv_write_value64", "cuStreamWriteValue64"},
    {"drv_wait_value64", "cuStreamWaitValue64, value already there"},
    {"drv_ipc_get_mem_handle", "cuIpcGetMemHandle, a known allocation"},
    {"drv_pointer_get_attribute", "cuPointerGetAttribute (buffer id)"},
    {"drv_pointer_get_attributes", "cuPointerGetAttributes (id, context, device)"},
    {"drv_mem_get_address_range", "cuMemGetAddressRange"},
    {"drv_ctx_get_current", "cuCtxGetCurrent"},
    {"drv_event_query", "cuEventQuery, an event passed"},
    {"drv_ctx_push_pop", "cuCtxPushCurrent + cuCtxPopCurrent"},
    {"drv_stream_query", "cuStreamQuery, an idle stream"},
    {"drv_stream_get_ctx", "cuStreamGetCtx"},
};

/* The driver's own entry points, not the stand-ins (their phase check
 * would be timed too). */
typedef struct probe_api {
  CUresult(CUDAAPI *event_record)(CUevent, CUstream);
  CUresult(CUDAAPI *stream_wait_event)(CUstream, CUevent, unsigned);
  CUresult(CUDAAPI *write_value64)(CUstream, CUdeviceptr, cuuint64_t, unsigned);
  CUresult(CUDAAPI *wait_value64)(CUstream, CUdeviceptr, cuuint64_t, unsigned);
  CUresult(CUDAAPI *ipc_get_mem_handle)(CUipcMemHandle *, CUdeviceptr);
  CUresult(CUDAAPI *pointer_get_attribute)(void *, CUpointer_attribute, CUdeviceptr);
  CUresult(CUDAAPI *pointer_get_attributes)(unsigned, CUpointer_attribute *, void **, CUdeviceptr);
  CUresult(CUDAAPI *mem_get_address_range)(CUdeviceptr *, size_t *, CUdeviceptr);
  CUresult(CUDAAPI *ctx_get_current)(CUcontext *);
  CUresult(CUDAAPI *event_query)(CUevent);
  CUresult(CUDAAPI *ctx_push)(CUcontext);
  CUresult(CUDAAPI *ctx_pop)(CUcontext *);
  CUresult(CUDAAPI *stream_query)(CUstream);
  CUresult(CUDAAPI *stream_get_ctx)(CUstream, CUcontext *);
  CUresult(CUDAAPI *stream_synchronize)(CUstream);
} probe_api;

#define PROBE_STR2(x) #x
#define PROBE_ABI(x) PROBE_STR2(x)
#define PROBE_LOOKUP(field, fn) *(void **)&api->field = bc_real(PROBE_ABI(fn))

static int probe_api_load(probe_api *api) {
  PROBE_LOOKUP(event_record, cuEventRecord);
  PROBE_LOOKUP(stream_wait_event, cuStreamWaitEvent);
  PROBE_LOOKUP(write_value64, cuStreamWriteValue64);
  PROBE_LOOKUP(wait_value64, cuStreamWaitValue64);
  PROBE_LOOKUP(ipc_get_mem_handle, cuIpcGetMemHandle);
  PROBE_LOOKUP(pointer_get_attribute, cuPointerGetAttribute);
  PROBE_LOOKUP(pointer_get_attributes, cuPointerGetAttributes);
  PROBE_LOOKUP(mem_get_address_range, cuMemGetAddressRange);
  PROBE_LOOKUP(ctx_get_current, cuCtxGetCurrent);
  PROBE_LOOKUP(event_query, cuEventQuery);
  PROBE_LOOKUP(ctx_push, cuCtxPushCurrent);
  PROBE_LOOKUP(ctx_pop, cuCtxPopCurrent);
  PROBE_LOOKUP(stream_query, cuStreamQuery);
  PROBE_LOOKUP(stream_get_ctx, cuStreamGetCtx);
  PROBE_LOOKUP(stream_synchronize, cuStreamSynchronize);
  /* All but the stream memory operations are older than CUDA 12. */
  return api->event_record && api->stream_wait_event && api->ipc_get_mem_handle && api->pointer_get_attribute &&
         api->pointer_get_attributes && api->mem_get_address_range && api->ctx_get_current && api->event_query &&
         api->ctx_push && api->ctx_pop && api->stream_query && api->stream_get_ctx && api->stream_synchronize;
}

/* What the probes work on. */
typedef struct probe_env {
  probe_api api;
  CUstream stream;
  CUcontext ctx;
  CUevent ipc_event;   /* recorded once and passed */
  CUdeviceptr alloc;   /* a known allocation */
  CUdeviceptr word;    /* 8 bytes the stream memory operations write and wait on */
  uint64_t value;      /* the last value written there */
} probe_env;

static CUresult probe_once(probe_env *e, probe_kind k) {
  const probe_api *a = &e->api;
  CUcontext ctx;
  CUipcMemHandle h;
  unsigned long long id;
  CUdeviceptr base;
  size_t size;
  switch (k) {
  case P_EVENT_RECORD: return a->event_record(e->ipc_event, e->stream);
  case P_STREAM_WAIT_EVENT: return a->stream_wait_event(e->stream, e->ipc_event, 0);
  case P_WRITE_VALUE64: return a->write_value64(e->stream, e->word, ++e->value, 0);
  case P_WAIT_VALUE64: return a->wait_value64(e->stream, e->word, e->value, CU_STREAM_WAIT_VALUE_GEQ);
  case P_IPC_GET_MEM_HANDLE: return a->ipc_get_mem_handle(&h, e->alloc);
  case P_POINTER_GET_ATTRIBUTE: return a->pointer_get_attribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, e->alloc);
  case P_POINTER_GET_ATTRIBUTES: {
    CUpointer_attribute attrs[3] = {CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_CONTEXT,
                                    CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
    int ordinal;
    void *out[3] = {&id, &ctx, &ordinal};
    return a->pointer_get_attributes(3, attrs, out, e->alloc);
  }
  case P_MEM_GET_ADDRESS_RANGE: return a->mem_get_address_range(&base, &size, e->alloc + 64);
  case P_CTX_GET_CURRENT: return a->ctx_get_current(&ctx);
  case P_EVENT_QUERY: return a->event_query(e->ipc_event);
  case P_CTX_PUSH_POP: {
    CUresult rc = a->ctx_push(e->ctx);
    return rc == CUDA_SUCCESS ? a->ctx_pop(&ctx) : rc;
  }
  case P_STREAM_QUERY: return a->stream_query(e->stream);
  case P_STREAM_GET_CTX: return a->stream_get_ctx(e->stream, &ctx);
  default: return CUDA_ERROR_INVALID_VALUE;
  }
}

/* p50 of one call, over batches of BATCH; the stream drained between
 * batches (untimed), so the queued work never grows. NaN on failure. */
static double probe_p50_us(probe_env *e, probe_kind k, long batches) {
  bs_samples ns = {0};
  CUresult rc = CUDA_SUCCESS;
  for (long i = 0; i < batches + batches / 10 && rc == CUDA_SUCCESS; i++) {
    uint64_t t0 = bs_now_ns();
    for (int j = 0; j < BATCH && rc == CUDA_SUCCESS; j++) rc = probe_once(e, k);
    uint64_t t1 = bs_now_ns();
    if (i >= batches / 10) bs_add(&ns, (double)(t1 - t0) / BATCH); /* the first tenth warms up */
    if (rc == CUDA_SUCCESS) rc = e->api.stream_synchronize(e->stream);
  }
  double p50 = rc == CUDA_SUCCESS ? bs_percentile(&ns, 50) / 1000.0 : NAN;
  bs_free(&ns);
  return p50;
}

/* Why the stream memory operations cannot be timed here, or NULL. */
static const char *no_stream_mem_ops(const probe_env *e, const ts_cuda_api *cu) {
  if (!e->api.write_value64 || !e->api.wait_value64) return "the driver lacks cuStreamWriteValue64/WaitValue64";
  CUdevice dev;
  int can = 0;
  if (cu->cuCtxGetDevice(&dev) != CUDA_SUCCESS ||
      cu->cuDeviceGetAttribute(&can, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev) != CUDA_SUCCESS || !can)
    return "the device does not support 64-bit stream memory operations";
  return NULL;
}

static void probe_rows(bench *b, probe_env *e, const ts_cuda_api *cu) {
  long batches = b->opt.iters > 100 ? b->opt.iters : 100;
  const char *no_mem_ops = no_stream_mem_ops(e, cu);
  for (int k = 0; k < P_PROBES; k++) {
    const char *key = probe_keys[k][0], *label = probe_keys[k][1];
    if ((k == P_WRITE_VALUE64 || k == P_WAIT_VALUE64) && no_mem_ops) {
      br_skip(&b->rep, BR_VALUE, "profile", key, label, no_mem_ops);
      continue;
    }
    double us = probe_p50_us(e, (probe_kind)k, batches);
    if (isnan(us)) {
      br_skip(&b->rep, BR_VALUE, "profile", key, label, "the call failed");
      continue;
    }
    br_row *row = br_add(&b->rep, BR_VALUE, "profile", key, label, "us");
    row->value = us;
    row->n = batches * BATCH;
    snprintf(row->note, sizeof row->note, "p50 per call, timed %d calls at a time", BATCH);
  }
}

void bench_cuda_driver_rows(bench *b, CUstream stream) {
  int status;
  const char *why = "";
  const ts_cuda_api *cu = ts_cuda(&status, &why);
  probe_env e;
  memset(&e, 0, sizeof e);
  e.stream = stream;
  const char *fail = !cu                                               ? why
                     : !probe_api_load(&e.api)                         ? "the driver lacks a call on the hand-off path"
                     : cu->cuStreamGetCtx(stream, &e.ctx) != CUDA_SUCCESS ? "cuStreamGetCtx failed"
                     : cu->cuEventCreate(&e.ipc_event, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS
                         ? "cuEventCreate failed"
                     : cu->cuMemAlloc(&e.alloc, 1u << 20) != CUDA_SUCCESS || cu->cuMemAlloc(&e.word, 8) != CUDA_SUCCESS
                         ? "cuMemAlloc failed"
                     : cu->cuMemsetD8(e.word, 0, 8) != CUDA_SUCCESS ||
                             cu->cuEventRecord(e.ipc_event, stream) != CUDA_SUCCESS ||
                             cu->cuStreamSynchronize(stream) != CUDA_SUCCESS
                         ? "preparing the probes failed"
                         : NULL;
  if (fail) br_skip(&b->rep, BR_VALUE, "profile", "drv_event_record", "cuda: driver calls alone", fail);
  else probe_rows(b, &e, cu);
  if (e.ipc_event) cu->cuEventDestroy(e.ipc_event);
  if (e.alloc) cu->cuMemFree(e.alloc);
  if (e.word) cu->cuMemFree(e.word);
}

/* ---- tshare's own work per phase -------------------------------------------- */

/* The consumer's tally of phase ("imp=" or "rel=") in its answer. */
static void reply_tally(const char *reply, const char *field, long n, bc_tally *out) {
  const char *at = strstr(reply, field);
  bc_decode(at ? at + strlen(field) : NULL, n, out);
}

static void phase_row(bench *b, const char *key, const char *label, const char *phase_key, const char *phase,
                      double phase_us, const bc_tally *t) {
  char k[48], l[80], calls[160];
  snprintf(k, sizeof k, "own_%s_%s", key, phase_key);
  snprintf(l, sizeof l, "%s %s: tshare's own work", label, phase);
  if (isnan(phase_us)) {
    br_skip(&b->rep, BR_VALUE, "profile", k, l, "its latency row was not measured");
    return;
  }
  double driver = bc_tally_us(t);
  br_row *row = br_add(&b->rep, BR_VALUE, "profile", k, l, "us");
  row->value = phase_us - driver;
  bc_tally_describe(t, calls, sizeof calls);
  char note[1200]; /* room for any figure, then cut to the row's note */
  snprintf(note, sizeof note, "of %.2f us: driver %.2f us in %.1f calls (%s)", phase_us, driver, bc_tally_calls(t),
           calls);
  bs_copy(row->note, sizeof row->note, note);
}

void bench_cuda_profile_rows(bench *b, const char *key, const char *label, const bench_phases *phases,
                             const bc_tally *share, const char *reply, long n) {
  bc_tally imp, rel;
  reply_tally(reply, "imp=", n, &imp);
  reply_tally(reply, "rel=", n, &rel);
  phase_row(b, key, label, "share", "share call", phases->share_us, share);
  phase_row(b, key, label, "import", "import", phases->import_us, &imp);
  phase_row(b, key, label, "release", "release", phases->release_us, &rel);
  /* The same, as a table to paste into docs/benchmarks.md. */
  printf("| %s | share call | %.2f | %.2f | %.2f |\n| %s | import | %.2f | %.2f | %.2f |\n"
         "| %s | release | %.2f | %.2f | %.2f |\n",
         label, phases->share_us, bc_tally_us(share), phases->share_us - bc_tally_us(share), label,
         phases->import_us, bc_tally_us(&imp), phases->import_us - bc_tally_us(&imp), label, phases->release_us,
         bc_tally_us(&rel), phases->release_us - bc_tally_us(&rel));
}

/* ---- consumer side ------------------------------------------------------- */

int bench_cuda_consume_profiled(tshare_channel *ch, void *stream, long n, long warmup, char *reply, size_t cap) {
  int status;
  const char *why = "";
  const ts_cuda_api *cu = ts_cuda(&status, &why);
  if (!bc_active(cu, reply, cap)) return -1;
  bc_reset();
  for (long i = 0; i < n; i++) {
    tshare_share_info info;
    int got;
    while ((got = tshare_channel_peek_share(ch, BENCH_TIMEOUT_MS, &info)) == TSHARE_E_TIMEOUT) {
    }
    tshare_view *v = NULL;
    bool timed = i >= warmup;
    if (timed) bc_set_phase(BC_IMPORT);
    if (got == TSHARE_OK) got = tshare_view_recv_stream(ch, stream, BENCH_TIMEOUT_MS, &v);
    if (timed) bc_set_phase(BC_RELEASE);
    if (v) tshare_view_release(v);
    (void)tshare_channel_poll(ch, 0);
    bc_set_phase(BC_OFF);
    if (got != TSHARE_OK) {
      snprintf(reply, cap, "recv: %s", tshare_channel_last_error(ch));
      return -1;
    }
  }
  char imp[240], rel[240];
  bc_encode(BC_IMPORT, imp, sizeof imp);
  bc_encode(BC_RELEASE, rel, sizeof rel);
  snprintf(reply, cap, "imp=%s rel=%s", imp, rel);
  return 0;
}
