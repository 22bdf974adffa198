/* The zeroing bug's regression suite. The seed sample's scenario runs in two
 * real processes, both orderings, on this machine's driver and on an
 * emulated affected driver (libtshare_zeroing_emulator.so via LD_PRELOAD,
 * which zeroes an allocation in cudaIpcGetMemHandle as the WSL2 driver does).
 * Under emulation the raw sequence must lose the data ("1 2" becomes "0 0"),
 * tshare-zeroing-check must say "affected", and tshare's paths must still
 * deliver intact data. */
#include "harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

static char output[65536];

/* Run a command (with LD_PRELOAD of the emulator when emulated), keep its
 * output, return its exit code; 77 from the command is passed on as a skip. */
static int run(const char *cmd, int emulated) {
  const char *emu = getenv("TSHARE_ZEROING_EMULATOR");
  /* ASan must be the first library loaded; a preloaded one before it aborts. */
  if (emulated && getenv("TSHARE_SANITIZED")) TS_SKIP("the emulator is preloaded, which sanitizer builds refuse");
  char full[4096];
  snprintf(full, sizeof full, "%s%s %s 2>&1", emulated ? "LD_PRELOAD=" : "", emulated ? emu : "", cmd);
  FILE *p = popen(full, "r");
  CHECK(p != NULL);
  size_t n = fread(output, 1, sizeof output - 1, p);
  output[n] = '\0';
  int st = pclose(p);
  int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  printf("$ %s\n%s(exit %d)\n", full, output, code);
  if (code == 77 || strstr(output, "no CUDA device")) TS_SKIP("no CUDA device");
  return code;
}

static const char *tool(const char *var) {
  const char *v = getenv(var);
  if (!v) TS_FAIL("%s is not set (run through ctest)", var);
  return v;
}

TS_TEST(seed_native_export_after_write) {
  CHECK_EQ(run(tool("TSHARE_SEED_SCENARIO"), 0), 0);
  CHECK(strstr(output, "after cudaIpcGetMemHandle (exported after the write): 1 2"));
  CHECK(strstr(output, "tensor received: 1 2"));
}

TS_TEST(seed_native_export_before_write) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s --before", tool("TSHARE_SEED_SCENARIO"));
  CHECK_EQ(run(cmd, 0), 0);
  CHECK(strstr(output, "tensor received: 1 2"));
}

/* The seed's output, reproduced: "1 2" before the export, "0 0" after it and
 * in the consumer. */
TS_TEST(seed_emulated_export_after_write_loses_data) {
  CHECK_EQ(run(tool("TSHARE_SEED_SCENARIO"), 1), 1);
  CHECK(strstr(output, "before cudaIpcGetMemHandle: 1 2"));
  CHECK(strstr(output, "after cudaIpcGetMemHandle (exported after the write): 0 0"));
  CHECK(strstr(output, "tensor received: 0 0"));
}

TS_TEST(seed_emulated_export_before_write_keeps_data) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s --before", tool("TSHARE_SEED_SCENARIO"));
  CHECK_EQ(run(cmd, 1), 0);
  CHECK(strstr(output, "tensor received: 1 2"));
}

TS_TEST(check_native_not_affected) {
  CHECK_EQ(run(tool("TSHARE_ZEROING_CHECK"), 0), 0);
  CHECK(strstr(output, "verdict: not affected"));
}

TS_TEST(check_emulated_affected) {
  CHECK_EQ(run(tool("TSHARE_ZEROING_CHECK"), 1), 1);
  CHECK(strstr(output, "verdict: this driver zeroes exported memory"));
  CHECK(strstr(output, "export after write (raw)             copy    LOST"));
  CHECK(strstr(output, "tshare guarded export                copy    intact    -          intact"));
}

/* The auto guard turns itself on when its probe sees the driver zero memory. */
TS_TEST(guard_auto_detects_emulated_driver) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s guard_report", tool("TSHARE_TEST_CUDA"));
  CHECK_EQ(run(cmd, 0), 0);
  CHECK(strstr(output, "guard=0 off: auto, a probe saw this driver keep exported memory intact"));
  CHECK_EQ(run(cmd, 1), 0);
  CHECK(strstr(output, "guard=1 on: auto, a probe saw this driver zero memory"));
}

/* The GPU round trip on the affected driver: slab pieces (exported at
 * allocation) and written foreign memory (guarded by auto) arrive intact. */
TS_TEST(roundtrip_on_emulated_driver) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s roundtrip_offsets", tool("TSHARE_TEST_CUDA"));
  CHECK_EQ(run(cmd, 1), 0);
  CHECK(strstr(output, "PASS: roundtrip_offsets"));
}

TS_TEST_MAIN
