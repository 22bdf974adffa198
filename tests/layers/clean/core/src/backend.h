#include "tshare/channel.h"
typedef struct ts_backend {
  int (*flush)(void *ch);
} ts_backend;
