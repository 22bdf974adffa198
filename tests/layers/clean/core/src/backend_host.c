#include "backend.h"
#include "backend_host_mapping.h"
#include "tshare/cuda.h"
int ts_host_flush(void *ch) { return ch != 0; }
