#include "backend.h"
#include "backend_host_mapping.h"
#include "session.h"
#include "cuda_internal.h"
