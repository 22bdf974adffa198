#include "log.h" /* the launcher's own log.h, beside this file */
#include "cuda_driver.h"
#include "tshare/channel.h"
int main(void) { return 0; }
