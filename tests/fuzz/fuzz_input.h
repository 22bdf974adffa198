/* A fuzz target's input, read a byte at a time: zeros once it ran out, so
 * an operation cut short by the end of the input still runs. */
#ifndef TSHARE_FUZZ_INPUT_H
#define TSHARE_FUZZ_INPUT_H

#include <stddef.h>
#include <stdint.h>

typedef struct input {
  const uint8_t *p;
  size_t n;
} input;

static inline uint8_t take(input *in) {
  if (in->n == 0) return 0;
  in->n--;
  return *in->p++;
}

#endif
