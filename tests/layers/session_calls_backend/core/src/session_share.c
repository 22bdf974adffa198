#include "backend.h"
#include "session.h"

int ts_share_flush(ts_channel *ch) {
  int rc = ch->backend->flush(ch); /* through the table: fine */
  rc += ch->ops.ts_cuda_flush(ch) + ch->ops_ptr->ts_host_map(ch, 0); /* members, even named so */
  ts_cuda_push(); /* the CUDA driver's, a utility: fine */
  /* ts_cuda_flush(ch) in a comment is no call */
  ts_log("ts_host_map(ch) in a string is no call");
  rc += ts_cuda_flush(ch);
  if (rc) rc = ts_host_map(ch, 0);
  return rc;
}
