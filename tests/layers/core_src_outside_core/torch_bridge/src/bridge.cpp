#include <core/src/ring.h>
