#include "cmdline.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

void cmdline_free(char **argv) {
  if (!argv) return;
  for (char **a = argv; *a; a++) free(*a);
  free(argv);
}

char **cmdline_split(const char *text, const char **error) {
  size_t len = strlen(text);
  /* No word can be longer than the text, and there are at most len/2+1 words. */
  char **argv = calloc(len / 2 + 2, sizeof *argv);
  char *word = malloc(len + 1);
  size_t argc = 0;
  *error = NULL;
  if (!argv || !word) {
    free(word);
    free(argv);
    *error = "out of memory";
    return NULL;
  }
  const char *p = text;
  for (;;) {
    while (*p == ' ' || *p == '\t' || *p == '\n') p++;
    if (!*p) break;
    size_t n = 0;
    bool in_word = true;
    while (in_word && *p) {
      char c = *p;
      if (c == ' ' || c == '\t' || c == '\n') {
        in_word = false;
      } else if (c == '\'') {
        const char *end = strchr(p + 1, '\'');
        if (!end) {
          *error = "unterminated ' quote";
          break;
        }
        memcpy(word + n, p + 1, (size_t)(end - p - 1));
        n += (size_t)(end - p - 1);
        p = end + 1;
      } else if (c == '"') {
        p++;
        while (*p && *p != '"') {
          if (*p == '\\' && (p[1] == '"' || p[1] == '\\')) p++;
          word[n++] = *p++;
        }
        if (*p != '"') {
          *error = "unterminated \" quote";
          break;
        }
        p++;
      } else if (c == '\\' && p[1]) {
        word[n++] = p[1];
        p += 2;
      } else {
        word[n++] = c;
        p++;
      }
    }
    if (*error) break;
    word[n] = '\0';
    argv[argc] = strdup(word);
    if (!argv[argc]) {
      *error = "out of memory";
      break;
    }
    argc++;
  }
  free(word);
  if (!*error && argc == 0) *error = "empty command";
  if (*error) {
    cmdline_free(argv);
    return NULL;
  }
  return argv;
}
