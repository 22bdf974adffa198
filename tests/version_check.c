/* The loaded shared library, the headers and the build agree on the version:
 * version_check EXPECTED ("MAJOR.MINOR.PATCH", from CMake's project()). */
#include "tshare/tshare.h"

#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
  char compiled[32];
  snprintf(compiled, sizeof compiled, "%d.%d.%d", TSHARE_VERSION_MAJOR, TSHARE_VERSION_MINOR, TSHARE_VERSION_PATCH);
  printf("loaded %s (%d), compiled against %s, built as %s\n", tshare_version(), tshare_version_number(), compiled,
         argc > 1 ? argv[1] : "?");
  if (argc != 2 || strcmp(tshare_version(), argv[1]) != 0 || strcmp(compiled, argv[1]) != 0) return 1;
  return tshare_version_number() == TSHARE_VERSION_NUMBER ? 0 : 1;
}
