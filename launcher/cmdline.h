/* Splitting a "CMD ARGS" option value into an argv, shell-style quoting only. */
#ifndef TSHARE_LAUNCHER_CMDLINE_H
#define TSHARE_LAUNCHER_CMDLINE_H

/* Split text into words: whitespace separates, '...' keeps everything
 * literally, "..." keeps whitespace and honours \" and \\, a backslash
 * outside quotes escapes the next character. No expansion of any kind.
 * Returns a NULL-terminated argv to free with cmdline_free, or NULL with
 * *error set to a static message (unterminated quote, empty command). */
char **cmdline_split(const char *text, const char **error);
void cmdline_free(char **argv);

#endif
