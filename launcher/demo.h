/* The built-in demo roles of `tshare-launch demo`: a producer that shares N
 * tensors of known contents and a consumer that checks every element. They
 * run as `tshare-launch __role producer|consumer --tensors N [--device cuda]` under the
 * launcher, using only the public C API. */
#ifndef TSHARE_LAUNCHER_DEMO_H
#define TSHARE_LAUNCHER_DEMO_H

#include <stdbool.h>

/* cuda: the tensors live in GPU memory (owned, exported buffers) */
int demo_producer_main(int tensors, bool cuda);
int demo_consumer_main(int tensors, bool cuda);

#endif
