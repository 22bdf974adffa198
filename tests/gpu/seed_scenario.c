/* The seed sample's scenario with the CUDA runtime alone, no tshare: a
 * producer writes {1, 2} to a cudaMalloc'd tensor, calls cudaIpcGetMemHandle
 * (after the write, or before it with --before), prints the tensor before and
 * after, and hands the handle to a consumer process, which opens it and
 * prints what it sees. Exit 0: both sides saw "1 2"; 1: data was lost; 2: an
 * error. */
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

static int fail(const char *what, cudaError_t rc) {
  fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(rc));
  return 2;
}

static int consumer(int fd) {
  cudaIpcMemHandle_t h;
  if (read(fd, &h, sizeof h) != (ssize_t)sizeof h) return 2;
  void *p;
  int v[2];
  cudaError_t rc = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
  if (rc != cudaSuccess) return fail("consumer: cudaIpcOpenMemHandle", rc);
  if ((rc = cudaMemcpy(v, p, sizeof v, cudaMemcpyDeviceToHost)) != cudaSuccess) return fail("consumer: copy", rc);
  printf("[%d] consumer: tensor received: %d %d\n", (int)getpid(), v[0], v[1]);
  cudaIpcCloseMemHandle(p);
  return v[0] == 1 && v[1] == 2 ? 0 : 1;
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "--consumer") == 0) return consumer(atoi(argv[2]));
  int before = argc == 2 && strcmp(argv[1], "--before") == 0;
  int count;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    printf("SKIP: no CUDA device\n");
    return 77;
  }
  int *d;
  int v[2] = {1, 2}, seen[2];
  cudaIpcMemHandle_t h;
  cudaError_t rc = cudaMalloc((void **)&d, sizeof v);
  if (rc != cudaSuccess) return fail("cudaMalloc", rc);
  if (before && (rc = cudaIpcGetMemHandle(&h, d)) != cudaSuccess) return fail("cudaIpcGetMemHandle", rc);
  if ((rc = cudaMemcpy(d, v, sizeof v, cudaMemcpyHostToDevice)) != cudaSuccess) return fail("cudaMemcpy", rc);
  printf("[%d] producer: before cudaIpcGetMemHandle: %d %d\n", (int)getpid(), v[0], v[1]);
  if (!before && (rc = cudaIpcGetMemHandle(&h, d)) != cudaSuccess) return fail("cudaIpcGetMemHandle", rc);
  if ((rc = cudaMemcpy(seen, d, sizeof seen, cudaMemcpyDeviceToHost)) != cudaSuccess) return fail("read back", rc);
  printf("[%d] producer: after cudaIpcGetMemHandle (%s the write): %d %d\n", (int)getpid(),
         before ? "exported before" : "exported after", seen[0], seen[1]);
  fflush(stdout);
  int fds[2];
  if (pipe(fds) != 0) return 2;
  char fdtext[16];
  snprintf(fdtext, sizeof fdtext, "%d", fds[0]);
  char *cargv[] = {argv[0], (char *)"--consumer", fdtext, NULL};
  pid_t pid;
  if (posix_spawn(&pid, "/proc/self/exe", NULL, NULL, cargv, environ) != 0) return 2;
  close(fds[0]);
  if (write(fds[1], &h, sizeof h) != (ssize_t)sizeof h) return 2;
  close(fds[1]);
  int status;
  waitpid(pid, &status, 0);
  cudaFree(d);
  int consumer_rc = WIFEXITED(status) ? WEXITSTATUS(status) : 2;
  if (consumer_rc == 2) return 2;
  return seen[0] == 1 && seen[1] == 2 && consumer_rc == 0 ? 0 : 1;
}
