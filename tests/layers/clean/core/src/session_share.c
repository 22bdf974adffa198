#include "backend.h"
#include "conn.h"
#include "log.h"
#include "cuda_driver.h"
#include "tshare/cuda.h"
int ts_share_flush(const ts_backend *b, void *ch) {
  ts_log("ts_cuda_flush(ch) in a string is no call");
  ts_cuda_push(); /* the driver's, a utility */
  return b->flush(ch) + b -> flush(ch);
}
