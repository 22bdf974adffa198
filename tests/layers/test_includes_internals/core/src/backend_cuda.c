#include "backend.h"
#include "backend_cuda_hooks.h"
