#include "conn.h"
#include "ring.h"
#include "backend_cuda_hooks.h"
