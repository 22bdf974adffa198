#include "harness.h"
#include "conn.h"
