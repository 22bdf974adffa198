#include "conn.h"
#include "cuda_internal.h"
