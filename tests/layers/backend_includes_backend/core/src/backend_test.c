#include "backend.h"
#include "backend_test_state.h"
#include "backend_cuda_hooks.h"
