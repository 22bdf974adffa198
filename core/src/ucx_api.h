/* UCX's UCP, loaded at run time: the core never links UCX. libucp.so.0 is
 * opened with dlopen the first time a ucx:// address is used, and the calls
 * tshare makes are looked up into one table (ts_ucx()).
 *
 * The types below are the parts of UCP 1.x's public ABI that tshare fills in
 * or reads, declared here so the library builds without UCX's headers. UCP
 * structs are versioned by a field mask: the library reads only the fields
 * the mask names, so a struct that stops after the last field tshare sets is
 * enough. tests/test_ucx_api.c checks every offset and constant against
 * UCX's own headers where they are installed. */
#ifndef TSHARE_UCX_API_H
#define TSHARE_UCX_API_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

typedef int ts_ucs_status;
#define TS_UCS_OK 0
#define TS_UCS_INPROGRESS 1
#define TS_UCS_ERR_NO_ELEM (-12)
#define TS_UCS_ERR_BUSY (-15)
#define TS_UCS_ERR_LAST (-100)
/* A ucs_status_ptr_t: NULL (done), an error code cast to a pointer, or a request. */
#define TS_UCS_PTR_IS_ERR(p) ((uintptr_t)(p) >= (uintptr_t)TS_UCS_ERR_LAST)
#define TS_UCS_PTR_STATUS(p) ((ts_ucs_status)(intptr_t)(p))

typedef struct ts_ucp_context *ts_ucp_context_h;
typedef struct ts_ucp_worker *ts_ucp_worker_h;
typedef struct ts_ucp_ep *ts_ucp_ep_h;
typedef struct ts_ucp_config ts_ucp_config;
typedef struct ts_ucp_address ts_ucp_address;
typedef struct ts_ucp_mem *ts_ucp_mem_h;   /* a registration (ucp_mem_map) */
typedef struct ts_ucp_rkey *ts_ucp_rkey_h; /* an unpacked remote key, of one endpoint */

#define TS_UCP_API_MAJOR 1u
#define TS_UCP_API_MINOR 13u /* the oldest UCP whose calls tshare uses (Debian 12's) */

#define TS_UCP_PARAM_FIELD_FEATURES (1ull << 0)
#define TS_UCP_PARAM_FIELD_MT_WORKERS_SHARED (1ull << 5)
#define TS_UCP_FEATURE_RMA (1ull << 1)
#define TS_UCP_FEATURE_WAKEUP (1ull << 4)
#define TS_UCP_FEATURE_AM (1ull << 6)
typedef struct ts_ucp_params {
  uint64_t field_mask;
  uint64_t features;
  size_t request_size;                 /* unused */
  void (*request_init)(void *request); /* unused */
  void (*request_cleanup)(void *request);
  uint64_t tag_sender_mask; /* unused */
  int mt_workers_shared;
} ts_ucp_params;

#define TS_UCP_WORKER_PARAM_FIELD_THREAD_MODE (1ull << 0)
#define TS_UCS_THREAD_MODE_SERIALIZED 1
typedef struct ts_ucp_worker_params {
  uint64_t field_mask;
  int thread_mode;
} ts_ucp_worker_params;

#define TS_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS (1ull << 0)
#define TS_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE (1ull << 1)
#define TS_UCP_EP_PARAM_FIELD_ERR_HANDLER (1ull << 2)
#define TS_UCP_ERR_HANDLING_MODE_PEER 1
typedef struct ts_ucp_ep_params {
  uint64_t field_mask;
  const ts_ucp_address *address;
  int err_mode;
  struct {
    void (*cb)(void *arg, ts_ucp_ep_h ep, ts_ucs_status status);
    void *arg;
  } err_handler;
} ts_ucp_ep_params;

#define TS_UCP_OP_ATTR_FIELD_CALLBACK (1u << 1)
#define TS_UCP_OP_ATTR_FIELD_USER_DATA (1u << 2)
#define TS_UCP_OP_ATTR_FIELD_FLAGS (1u << 4)
#define TS_UCP_AM_SEND_FLAG_EAGER (1u << 1)
#define TS_UCP_EP_CLOSE_FLAG_FORCE (1u << 0)
typedef struct ts_ucp_request_param {
  uint32_t op_attr_mask;
  uint32_t flags;
  void *request;
  void (*send_cb)(void *request, ts_ucs_status status, void *user_data); /* the first member of a union */
  uint64_t datatype;
  void *user_data;
  void *reply_buffer;
  int memory_type;
  uint8_t rest[24]; /* members tshare never names (recv_info, memh): zeroed */
} ts_ucp_request_param;

#define TS_UCP_AM_RECV_ATTR_FLAG_RNDV (1ull << 17)
typedef struct ts_ucp_am_recv_param {
  uint64_t recv_attr;
  ts_ucp_ep_h reply_ep;
} ts_ucp_am_recv_param;
typedef ts_ucs_status (*ts_ucp_am_recv_cb)(void *arg, const void *header, size_t header_length, void *data,
                                           size_t length, const ts_ucp_am_recv_param *param);

#define TS_UCP_AM_HANDLER_PARAM_FIELD_ID (1ull << 0)
#define TS_UCP_AM_HANDLER_PARAM_FIELD_FLAGS (1ull << 1)
#define TS_UCP_AM_HANDLER_PARAM_FIELD_CB (1ull << 2)
#define TS_UCP_AM_HANDLER_PARAM_FIELD_ARG (1ull << 3)
#define TS_UCP_AM_FLAG_WHOLE_MSG (1u << 0)
typedef struct ts_ucp_am_handler_param {
  uint64_t field_mask;
  unsigned id;
  uint32_t flags;
  ts_ucp_am_recv_cb cb;
  void *arg;
} ts_ucp_am_handler_param;

/* Registering memory for remote reads (ucp_mem_map): an existing range. */
#define TS_UCP_MEM_MAP_PARAM_FIELD_ADDRESS (1ull << 0)
#define TS_UCP_MEM_MAP_PARAM_FIELD_LENGTH (1ull << 1)
typedef struct ts_ucp_mem_map_params {
  uint64_t field_mask;
  void *address;
  size_t length;
} ts_ucp_mem_map_params;

/* The calls: X(name, return type, arguments). */
#define TS_UCX_FUNCS(X)                                                                                                \
  X(ucp_config_read, ts_ucs_status, (const char *prefix, const char *file, ts_ucp_config **config))                   \
  X(ucp_config_release, void, (ts_ucp_config * config))                                                               \
  X(ucp_init_version, ts_ucs_status,                                                                                   \
    (unsigned major, unsigned minor, const ts_ucp_params *params, const ts_ucp_config *config,                        \
     ts_ucp_context_h *context))                                                                                       \
  X(ucp_cleanup, void, (ts_ucp_context_h context))                                                                     \
  X(ucp_worker_create, ts_ucs_status,                                                                                  \
    (ts_ucp_context_h context, const ts_ucp_worker_params *params, ts_ucp_worker_h *worker))                          \
  X(ucp_worker_destroy, void, (ts_ucp_worker_h worker))                                                                \
  X(ucp_worker_get_address, ts_ucs_status, (ts_ucp_worker_h worker, ts_ucp_address **address, size_t *length))       \
  X(ucp_worker_release_address, void, (ts_ucp_worker_h worker, ts_ucp_address * address))                             \
  X(ucp_worker_progress, unsigned, (ts_ucp_worker_h worker))                                                           \
  X(ucp_worker_get_efd, ts_ucs_status, (ts_ucp_worker_h worker, int *fd))                                             \
  X(ucp_worker_arm, ts_ucs_status, (ts_ucp_worker_h worker))                                                           \
  X(ucp_worker_set_am_recv_handler, ts_ucs_status, (ts_ucp_worker_h worker, const ts_ucp_am_handler_param *param))    \
  X(ucp_ep_create, ts_ucs_status, (ts_ucp_worker_h worker, const ts_ucp_ep_params *params, ts_ucp_ep_h *ep))         \
  X(ucp_ep_close_nbx, void *, (ts_ucp_ep_h ep, const ts_ucp_request_param *param))                                    \
  X(ucp_ep_flush_nbx, void *, (ts_ucp_ep_h ep, const ts_ucp_request_param *param))                                    \
  X(ucp_am_send_nbx, void *,                                                                                           \
    (ts_ucp_ep_h ep, unsigned id, const void *header, size_t header_length, const void *buffer, size_t count,         \
     const ts_ucp_request_param *param))                                                                               \
  X(ucp_request_check_status, ts_ucs_status, (void *request))                                                          \
  X(ucp_mem_map, ts_ucs_status, (ts_ucp_context_h context, const ts_ucp_mem_map_params *params, ts_ucp_mem_h *memh))  \
  X(ucp_mem_unmap, ts_ucs_status, (ts_ucp_context_h context, ts_ucp_mem_h memh))                                      \
  X(ucp_rkey_pack, ts_ucs_status, (ts_ucp_context_h context, ts_ucp_mem_h memh, void **buffer, size_t *size))         \
  X(ucp_rkey_buffer_release, void, (void *buffer))                                                                     \
  X(ucp_ep_rkey_unpack, ts_ucs_status, (ts_ucp_ep_h ep, const void *buffer, ts_ucp_rkey_h *rkey))                     \
  X(ucp_rkey_destroy, void, (ts_ucp_rkey_h rkey))                                                                      \
  X(ucp_get_nbx, void *,                                                                                               \
    (ts_ucp_ep_h ep, void *buffer, size_t count, uint64_t remote_addr, ts_ucp_rkey_h rkey,                             \
     const ts_ucp_request_param *param))                                                                               \
  X(ucp_request_free, void, (void *request))                                                                           \
  X(ucs_status_string, const char *, (ts_ucs_status status))

#define TS_UCX_MEMBER(name, ret, args) ret(*name) args;
typedef struct ts_ucx_api {
  TS_UCX_FUNCS(TS_UCX_MEMBER)
  ts_ucp_context_h context; /* one per process, with active messages and wake-ups: workers are per channel */
} ts_ucx_api;
#undef TS_UCX_MEMBER

/* The environment variable that names another library to open instead of
 * libucp.so.0 (a path, or a name the loader looks up). */
#define TS_UCX_LIBRARY_ENV "TSHARE_UCX_LIBRARY"

/* The table, loaded and the process's UCP context made on first use; NULL
 * when that failed, with *status TSHARE_E_UNSUPPORTED and *why naming the
 * missing library (or call, or UCP's error) for a message. */
const ts_ucx_api *ts_ucx(int *status, const char **why);

/* UCP's name for a status, also where the table is not loaded. */
const char *ts_ucx_strerror(ts_ucs_status status);

#endif
