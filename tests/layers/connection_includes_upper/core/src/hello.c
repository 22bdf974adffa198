#include <tshare/cuda.h>
