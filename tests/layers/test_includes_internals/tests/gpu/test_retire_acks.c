#include "backend_cuda_hooks.h"
#include "backend.h"
#include "session.h"
