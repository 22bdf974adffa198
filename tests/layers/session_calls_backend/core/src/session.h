#include "backend.h"
/* backend_host.c: declared here, for the session to call */
int ts_host_map(ts_channel *ch, int flags);
