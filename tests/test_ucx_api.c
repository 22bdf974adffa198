/* The UCP declarations of core/src/ucx_api.h against UCX's own headers:
 * every offset, constant and status tshare relies on, so a UCX whose ABI
 * moved is caught here rather than as memory corruption. Built only where
 * UCX's headers are installed (libucx-dev). */
#include "harness.h"
#include "ucx_api.h"

#include <stddef.h>
#include <ucp/api/ucp.h>

#define SAME_OFFSET(ours, theirs, field) CHECK_EQ(offsetof(ours, field), offsetof(theirs, field))

TS_TEST(struct_offsets_match_ucp_h) {
  SAME_OFFSET(ts_ucp_params, ucp_params_t, field_mask);
  SAME_OFFSET(ts_ucp_params, ucp_params_t, features);
  SAME_OFFSET(ts_ucp_params, ucp_params_t, mt_workers_shared);
  SAME_OFFSET(ts_ucp_worker_params, ucp_worker_params_t, thread_mode);
  SAME_OFFSET(ts_ucp_ep_params, ucp_ep_params_t, address);
  SAME_OFFSET(ts_ucp_ep_params, ucp_ep_params_t, err_mode);
  SAME_OFFSET(ts_ucp_ep_params, ucp_ep_params_t, err_handler);
  CHECK_EQ(offsetof(ts_ucp_ep_params, err_handler.arg), offsetof(ucp_ep_params_t, err_handler.arg));
  SAME_OFFSET(ts_ucp_request_param, ucp_request_param_t, op_attr_mask);
  SAME_OFFSET(ts_ucp_request_param, ucp_request_param_t, flags);
  SAME_OFFSET(ts_ucp_request_param, ucp_request_param_t, request);
  CHECK_EQ(offsetof(ts_ucp_request_param, send_cb), offsetof(ucp_request_param_t, cb.send));
  SAME_OFFSET(ts_ucp_request_param, ucp_request_param_t, datatype);
  SAME_OFFSET(ts_ucp_request_param, ucp_request_param_t, user_data);
  SAME_OFFSET(ts_ucp_request_param, ucp_request_param_t, memory_type);
  CHECK(sizeof(ts_ucp_request_param) >= sizeof(ucp_request_param_t)); /* UCX may read all of it */
  SAME_OFFSET(ts_ucp_am_handler_param, ucp_am_handler_param_t, id);
  SAME_OFFSET(ts_ucp_am_handler_param, ucp_am_handler_param_t, flags);
  SAME_OFFSET(ts_ucp_am_handler_param, ucp_am_handler_param_t, cb);
  SAME_OFFSET(ts_ucp_am_handler_param, ucp_am_handler_param_t, arg);
  SAME_OFFSET(ts_ucp_am_recv_param, ucp_am_recv_param_t, recv_attr);
  SAME_OFFSET(ts_ucp_am_recv_param, ucp_am_recv_param_t, reply_ep);
  SAME_OFFSET(ts_ucp_mem_map_params, ucp_mem_map_params_t, field_mask);
  SAME_OFFSET(ts_ucp_mem_map_params, ucp_mem_map_params_t, address);
  SAME_OFFSET(ts_ucp_mem_map_params, ucp_mem_map_params_t, length);
}

/* The calls' declarations: each member of the table has the type of UCP's
 * own function once tshare's opaque handle types are read as UCP's. */
#define ts_ucs_status ucs_status_t
#define ts_ucp_context_h ucp_context_h
#define ts_ucp_worker_h ucp_worker_h
#define ts_ucp_ep_h ucp_ep_h
#define ts_ucp_config ucp_config_t
#define ts_ucp_address ucp_address_t
#define ts_ucp_mem_h ucp_mem_h
#define ts_ucp_rkey_h ucp_rkey_h
#define ts_ucp_worker_params ucp_worker_params_t
#define ts_ucp_ep_params ucp_ep_params_t
#define ts_ucp_request_param ucp_request_param_t
#define ts_ucp_am_handler_param ucp_am_handler_param_t
#define ts_ucp_mem_map_params ucp_mem_map_params_t
#define ts_ucp_params ucp_params_t
#define SAME_DECLARATION(fn, ret, args)                                                                                \
  _Static_assert(__builtin_types_compatible_p(__typeof__(&fn), ret(*) args), #fn " is declared as in ucp.h");
TS_UCX_FUNCS(SAME_DECLARATION)
#undef SAME_DECLARATION

TS_TEST(constants_match_ucp_h) {
  CHECK_EQ(TS_UCS_OK, UCS_OK);
  CHECK_EQ(TS_UCS_INPROGRESS, UCS_INPROGRESS);
  CHECK_EQ(TS_UCS_ERR_BUSY, UCS_ERR_BUSY);
  CHECK_EQ(TS_UCS_ERR_LAST, UCS_ERR_LAST);
  CHECK_EQ(TS_UCP_PARAM_FIELD_FEATURES, UCP_PARAM_FIELD_FEATURES);
  CHECK_EQ(TS_UCP_PARAM_FIELD_MT_WORKERS_SHARED, UCP_PARAM_FIELD_MT_WORKERS_SHARED);
  CHECK_EQ(TS_UCP_FEATURE_RMA, UCP_FEATURE_RMA);
  CHECK_EQ(TS_UCP_FEATURE_WAKEUP, UCP_FEATURE_WAKEUP);
  CHECK_EQ(TS_UCP_FEATURE_AM, UCP_FEATURE_AM);
  CHECK_EQ(TS_UCP_WORKER_PARAM_FIELD_THREAD_MODE, UCP_WORKER_PARAM_FIELD_THREAD_MODE);
  CHECK_EQ(TS_UCS_THREAD_MODE_SERIALIZED, UCS_THREAD_MODE_SERIALIZED);
  CHECK_EQ(TS_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS, UCP_EP_PARAM_FIELD_REMOTE_ADDRESS);
  CHECK_EQ(TS_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE, UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE);
  CHECK_EQ(TS_UCP_EP_PARAM_FIELD_ERR_HANDLER, UCP_EP_PARAM_FIELD_ERR_HANDLER);
  CHECK_EQ(TS_UCP_ERR_HANDLING_MODE_PEER, UCP_ERR_HANDLING_MODE_PEER);
  CHECK_EQ(TS_UCP_OP_ATTR_FIELD_CALLBACK, UCP_OP_ATTR_FIELD_CALLBACK);
  CHECK_EQ(TS_UCP_OP_ATTR_FIELD_USER_DATA, UCP_OP_ATTR_FIELD_USER_DATA);
  CHECK_EQ(TS_UCP_OP_ATTR_FIELD_FLAGS, UCP_OP_ATTR_FIELD_FLAGS);
  CHECK_EQ(TS_UCP_AM_SEND_FLAG_EAGER, UCP_AM_SEND_FLAG_EAGER);
  CHECK_EQ(TS_UCP_EP_CLOSE_FLAG_FORCE, UCP_EP_CLOSE_FLAG_FORCE);
  CHECK_EQ(TS_UCP_AM_RECV_ATTR_FLAG_RNDV, UCP_AM_RECV_ATTR_FLAG_RNDV);
  CHECK_EQ(TS_UCP_AM_HANDLER_PARAM_FIELD_ID, UCP_AM_HANDLER_PARAM_FIELD_ID);
  CHECK_EQ(TS_UCP_AM_HANDLER_PARAM_FIELD_FLAGS, UCP_AM_HANDLER_PARAM_FIELD_FLAGS);
  CHECK_EQ(TS_UCP_AM_HANDLER_PARAM_FIELD_CB, UCP_AM_HANDLER_PARAM_FIELD_CB);
  CHECK_EQ(TS_UCP_AM_HANDLER_PARAM_FIELD_ARG, UCP_AM_HANDLER_PARAM_FIELD_ARG);
  CHECK_EQ(TS_UCP_AM_FLAG_WHOLE_MSG, UCP_AM_FLAG_WHOLE_MSG);
  CHECK_EQ(TS_UCP_MEM_MAP_PARAM_FIELD_ADDRESS, UCP_MEM_MAP_PARAM_FIELD_ADDRESS);
  CHECK_EQ(TS_UCP_MEM_MAP_PARAM_FIELD_LENGTH, UCP_MEM_MAP_PARAM_FIELD_LENGTH);
  CHECK(TS_UCP_API_MAJOR == UCP_API_MAJOR && TS_UCP_API_MINOR <= UCP_API_MINOR);
}

/* The loaded table works against the installed library: a worker's address
 * is there (a UCP context made with tshare's parameters). */
TS_TEST(the_installed_library_loads) {
  int status;
  const char *why;
  const ts_ucx_api *ucx = ts_ucx(&status, &why);
  if (!ucx) TS_SKIP("%s", why);
  CHECK(ucx->context != NULL);
  CHECK(strcmp(ts_ucx_strerror(TS_UCS_ERR_BUSY), "Device is busy") == 0);
}

TS_TEST_MAIN
