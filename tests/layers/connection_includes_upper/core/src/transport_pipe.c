/* the pipe transport */
#include "backend.h"
