#include "cuda_internal.h"
#include "backend_cuda_hooks.h"
#include "backend_host_mapping.h"
