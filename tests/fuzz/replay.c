/* Runs the fuzz target over every file of the corpus directories given, with
 * whatever compiler and sanitizers this build uses: the corpus (seeds and
 * every crash ever found) is a regression suite even without libFuzzer. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int main(int argc, char **argv) {
  int files = 0;
  for (int i = 1; i < argc; i++) {
    DIR *dir = opendir(argv[i]);
    if (!dir) {
      perror(argv[i]);
      return 1;
    }
    struct dirent *e;
    while ((e = readdir(dir))) {
      if (e->d_name[0] == '.') continue;
      char path[4096];
      snprintf(path, sizeof path, "%s/%s", argv[i], e->d_name);
      FILE *f = fopen(path, "rb");
      if (!f) continue;
      uint8_t buf[1 << 16];
      size_t n = fread(buf, 1, sizeof buf, f);
      fclose(f);
      LLVMFuzzerTestOneInput(buf, n);
      files++;
    }
    closedir(dir);
  }
  printf("replayed %d corpus files\n", files);
  return files > 0 ? 0 : 1;
}
