/* tshare-launch: run a producer and K consumers wired with tshare channels. */
#include "cmdline.h"
#include "demo.h"
#include "supervisor.h"

#include "tshare/cuda.h"
#include "tshare/role.h"

#include <ctype.h>
#include <errno.h>
#include <stdbool.h>
#include <getopt.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char usage_text[] =
    "usage: tshare-launch demo [--tensors N] [--consumers K] [--device cpu|cuda|auto] [--api c|torch|auto] [OPTIONS]\n"
    "       tshare-launch --producer \"CMD ARGS\" --consumer \"CMD ARGS\" [--consumers K] [OPTIONS]\n"
    "\n"
    "Starts one producer and K consumers, connects the producer to each consumer\n"
    "with a tshare channel, prefixes every line they print with role and pid,\n"
    "and prints a summary. When one role fails, the others get SIGTERM and, after\n"
    "the grace period, SIGKILL; a terminating signal to the launcher (SIGINT, SIGTERM,\n"
    "SIGHUP, SIGQUIT, SIGUSR1, ...) is forwarded to every role the same way. Roles die\n"
    "with the launcher even when it is SIGKILLed, and processes the roles leave\n"
    "behind (daemons that called setsid()) are stopped before it exits. Ctrl-Z\n"
    "(SIGTSTP) stops the roles and the launcher; SIGCONT (fg, bg) continues them.\n"
    "Output never holds up supervision: once the launcher's reader took nothing for\n"
    "1 s, role lines beyond 256 KiB per role and stream are dropped (counted at the end).\n"
    "\n"
    "demo            built-in roles: the producer shares N tensors of known contents\n"
    "                (several dtypes, offsets inside shared segments, transposed views)\n"
    "                with every consumer; each consumer checks every element.\n"
    "                Exits 0 only if every tensor arrived intact.\n"
    "  --tensors N   tensors to share (default 8, at most 1000)\n"
    "  --device D    cpu, cuda or auto (default auto: cuda where a device is usable, else cpu);\n"
    "                cuda exits 1 with the reason when no device is usable\n"
    "  --api A       c, torch or auto (default auto: torch where the LibTorch bridge and its\n"
    "                examples are built). torch runs examples/torch instead: a weights server\n"
    "                shares a model's weights with every consumer and hands N batches out\n"
    "                round robin; each consumer checks its batches arrived intact and writes\n"
    "                the logits back in place, and the server checks every answer\n"
    "\n"
    "--producer \"CMD ARGS\", --consumer \"CMD ARGS\"\n"
    "                run your own programs. Quoting as in a shell ('...', \"...\", \\);\n"
    "                no expansion. One --consumer: every consumer runs it; --consumer\n"
    "                once per consumer: consumer N runs the Nth (K is their number).\n"
    "\n"
    "OPTIONS\n"
    "  --consumers K    number of consumers (default 1, at most 64)\n"
    "  --channel KIND   socket (default; host memory travels as fds) or pipe (no fds)\n"
    "  --listen ucx://HOST:PORT/NAME, --connect ucx://HOST:PORT/NAME\n"
    "                   give the producer one more channel, its last, to a role group\n"
    "                   on another node (started there by the cluster's tool): the\n"
    "                   producer listens there, or connects there, when it opens it.\n"
    "                   The token both nodes share comes from TSHARE_TOKEN\n"
    "  --timeout S      stop everything after S seconds (exit 124); time stopped by\n"
    "                   SIGTSTP does not count\n"
    "  --grace S        seconds between SIGTERM and SIGKILL when stopping (default 3)\n"
    "  --no-prefix      pass role output on as it is, without \"[role pid N] \"\n"
    "  --log-dir DIR    write each role's output to DIR/producer.log, DIR/consumer-N.log\n"
    "                   (not to the terminal) and the summary to DIR/summary.txt too\n"
    "  --version        the launcher's, the library's and the wire format's versions\n"
    "  -h, --help       this text\n"
    "\n"
    "ENVIRONMENT given to every role (read it with tshare_role_from_env()):\n"
    "  TSHARE_ROLE           producer | consumer\n"
    "  TSHARE_RANK           0 for the producer, 0..K-1 for the consumers\n"
    "  TSHARE_NUM_CONSUMERS  K\n"
    "  TSHARE_CHANNEL_FDS    the role's channels, comma-separated: N is a socket at fd N,\n"
    "                        R:W a pipe pair; the producer has K (one per consumer rank),\n"
    "                        a consumer has 1. Fds start at 3; no other fd is inherited.\n"
    "  TSHARE_CHANNEL_IDS    the inode of each of those fds, in the same shape: a role\n"
    "                        will not take an fd number it closed and reused\n"
    "  TSHARE_UCX_LISTEN,    with --listen or --connect: the address, and \"ucx\" as the\n"
    "  TSHARE_UCX_CONNECT    producer's last entry of the two lists above\n"
    "  TSHARE_REPORT_FD      write \"shared=N\" / \"verified=N\" lines here for the summary\n"
    "  stdin is /dev/null; stdout and stderr go through the launcher.\n"
    "\n"
    "EXIT STATUS\n"
    "  0 every role exited 0 (demo: and every tensor arrived intact); 1 a role failed\n"
    "  (the summary names it and how it ended); 2 usage error; 124 timeout;\n"
    "  127 a role's program could not be started; 128+N stopped by signal N.\n";

__attribute__((format(printf, 1, 2))) static int usage_error(const char *fmt, ...);
static int usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "tshare-launch: ");
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fprintf(stderr, "\nTry 'tshare-launch --help'.\n");
  return LAUNCH_USAGE;
}

static int parse_count(const char *s, int min, int max, int *out) {
  if (!isdigit((unsigned char)s[0])) return -1; /* strtol would skip spaces and take a sign */
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end || end == s || v < min || v > max) return -1;
  *out = (int)v;
  return 0;
}

static int parse_seconds(const char *s, double *out) {
  if (!isdigit((unsigned char)s[0]) && s[0] != '.') return -1;
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || *end || end == s || !(v > 0) || v > 1e7) return -1;
  *out = v;
  return 0;
}

/* The hidden entry point of the demo roles: tshare-launch __role NAME --tensors N */
static int role_main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0); /* stdout is the launcher's pipe: keep lines in order */
  int tensors = 8;
  if (argc >= 5 && strcmp(argv[3], "--tensors") == 0 && parse_count(argv[4], 1, 1000, &tensors) != 0) return 2;
  bool cuda = argc >= 7 && strcmp(argv[5], "--device") == 0 && strcmp(argv[6], "cuda") == 0;
  if (strcmp(argv[2], "producer") == 0) return demo_producer_main(tensors, cuda);
  if (strcmp(argv[2], "consumer") == 0) return demo_consumer_main(tensors, cuda);
  fprintf(stderr, "tshare-launch: unknown role '%s'\n", argv[2]);
  return 2;
}

/* The LibTorch example named name: installed beside us (../libexec/tshare),
 * or in the build tree this launcher came from. */
static bool find_torch_example(const char *self, const char *name, char *out, size_t cap) {
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s", self);
  char *slash = strrchr(dir, '/');
  if (slash) *slash = '\0';
  int len = snprintf(out, cap, "%s/../libexec/tshare/%s", dir, name);
  if (len > 0 && (size_t)len < cap && access(out, X_OK) == 0) return true;
#ifdef TSHARE_TORCH_EXAMPLES_DIR
  len = snprintf(out, cap, "%s/%s", TSHARE_TORCH_EXAMPLES_DIR, name);
  if (len > 0 && (size_t)len < cap && access(out, X_OK) == 0) return true;
#endif
  return false;
}

int main(int argc, char **argv) {
  if (argc >= 3 && strcmp(argv[1], "__role") == 0) return role_main(argc, argv);

  enum {
    OPT_TENSORS = 256,
    OPT_CONSUMERS,
    OPT_DEVICE,
    OPT_PRODUCER,
    OPT_CONSUMER,
    OPT_CHANNEL,
    OPT_TIMEOUT,
    OPT_GRACE,
    OPT_API,
    OPT_NO_PREFIX,
    OPT_LOG_DIR,
    OPT_VERSION,
    OPT_LISTEN,
    OPT_CONNECT
  };
  static const struct option longopts[] = {{"tensors", required_argument, NULL, OPT_TENSORS},
                                           {"consumers", required_argument, NULL, OPT_CONSUMERS},
                                           {"device", required_argument, NULL, OPT_DEVICE},
                                           {"producer", required_argument, NULL, OPT_PRODUCER},
                                           {"consumer", required_argument, NULL, OPT_CONSUMER},
                                           {"channel", required_argument, NULL, OPT_CHANNEL},
                                           {"timeout", required_argument, NULL, OPT_TIMEOUT},
                                           {"grace", required_argument, NULL, OPT_GRACE},
                                           {"api", required_argument, NULL, OPT_API},
                                           {"no-prefix", no_argument, NULL, OPT_NO_PREFIX},
                                           {"log-dir", required_argument, NULL, OPT_LOG_DIR},
                                           {"version", no_argument, NULL, OPT_VERSION},
                                           {"listen", required_argument, NULL, OPT_LISTEN},
                                           {"connect", required_argument, NULL, OPT_CONNECT},
                                           {"help", no_argument, NULL, 'h'},
                                           {NULL, 0, NULL, 0}};
  int tensors = 8, consumers = 1;
  const char *device = "auto", *api = "auto", *producer_cmd = NULL;
  const char *consumer_cmds[TSHARE_ROLE_CHANNELS_MAX];
  int nconsumer_cmds = 0;
  bool consumers_given = false;
  launch_plan plan = {.consumers = 1, .channel = TSHARE_CHANNEL_SOCKET, .timeout_s = 0, .grace_s = 3.0};
  int opt;
  opterr = 0;
  /* GNU getopt permutes: options may come before or after the 'demo' word. */
  while ((opt = getopt_long(argc, argv, ":h", longopts, NULL)) != -1) {
    switch (opt) {
    case OPT_TENSORS:
      if (parse_count(optarg, 1, 1000, &tensors))
        return usage_error("--tensors '%s': give a number from 1 to 1000", optarg);
      break;
    case OPT_CONSUMERS:
      if (parse_count(optarg, 1, TSHARE_ROLE_CHANNELS_MAX, &consumers))
        return usage_error("--consumers '%s': give a number from 1 to 64", optarg);
      consumers_given = true;
      break;
    case OPT_DEVICE:
      device = optarg;
      break;
    case OPT_API:
      api = optarg;
      break;
    case OPT_PRODUCER:
      producer_cmd = optarg;
      break;
    case OPT_CONSUMER: /* once: every consumer runs it; once per rank: each its own */
      if (nconsumer_cmds == TSHARE_ROLE_CHANNELS_MAX) return usage_error("%s", "--consumer: at most 64");
      consumer_cmds[nconsumer_cmds++] = optarg;
      break;
    case OPT_NO_PREFIX:
      plan.no_prefix = true;
      break;
    case OPT_LOG_DIR:
      if (mkdir(optarg, 0755) != 0 && errno != EEXIST)
        return usage_error("--log-dir '%s': %s", optarg, strerror(errno));
      plan.log_dir = optarg;
      break;
    case OPT_VERSION:
      printf("tshare-launch %d.%d.%d (libtshare %s, wire format %d.%d)\n", TSHARE_VERSION_MAJOR, TSHARE_VERSION_MINOR,
             TSHARE_VERSION_PATCH, tshare_version(), TSHARE_WIRE_MAJOR, TSHARE_WIRE_MINOR);
      return 0;
    case OPT_CHANNEL:
      if (strcmp(optarg, "socket") == 0)
        plan.channel = TSHARE_CHANNEL_SOCKET;
      else if (strcmp(optarg, "pipe") == 0)
        plan.channel = TSHARE_CHANNEL_PIPES;
      else
        return usage_error("--channel '%s': use socket or pipe", optarg);
      break;
    case OPT_LISTEN:
    case OPT_CONNECT:
      if (plan.ucx_listen || plan.ucx_connect)
        return usage_error("%s", "--listen and --connect: give one, once (the producer's one channel across hosts)");
      if (strncmp(optarg, "ucx://", 6) != 0)
        return usage_error("%s '%s': give a ucx://HOST:PORT/NAME address", opt == OPT_LISTEN ? "--listen" : "--connect",
                           optarg);
      *(opt == OPT_LISTEN ? &plan.ucx_listen : &plan.ucx_connect) = optarg;
      break;
    case OPT_TIMEOUT:
      if (parse_seconds(optarg, &plan.timeout_s)) return usage_error("--timeout '%s': give seconds > 0", optarg);
      break;
    case OPT_GRACE:
      if (parse_seconds(optarg, &plan.grace_s)) return usage_error("--grace '%s': give seconds > 0", optarg);
      break;
    case 'h':
      fputs(usage_text, stdout);
      return 0;
    case ':':
      return usage_error("option '%s' needs a value", argv[optind - 1]);
    default:
      return usage_error("unknown option '%s'", argv[optind - 1]);
    }
  }
  bool demo = optind < argc && strcmp(argv[optind], "demo") == 0;
  if (optind + (demo ? 1 : 0) < argc) return usage_error("unexpected argument '%s'", argv[optind + (demo ? 1 : 0)]);
  plan.consumers = consumers;

  char **producer_argv = NULL;
  char tensors_text[16];
  if (demo) {
    if (producer_cmd || nconsumer_cmds) return usage_error("%s", "demo runs its own roles: drop --producer/--consumer");
    if (plan.ucx_listen || plan.ucx_connect)
      return usage_error("%s", "demo runs on one host: --listen and --connect are for your own roles");
    if (strcmp(device, "cpu") != 0 && strcmp(device, "auto") != 0 && strcmp(device, "cuda") != 0)
      return usage_error("--device '%s': use cpu, cuda or auto", device);
    bool cuda = false;
    const char *device_note = "";
    if (strcmp(device, "cpu") != 0) {
      tshare_error cerr;
      int crc = tshare_cuda_init(&cerr);
      cuda = crc == TSHARE_OK;
      if (!cuda && strcmp(device, "cuda") == 0) {
        fprintf(stderr, "tshare-launch: --device cuda: %s\n", cerr.message);
        return crc == TSHARE_E_UNSUPPORTED ? LAUNCH_USAGE : LAUNCH_ROLE_FAILED;
      }
      if (strcmp(device, "auto") == 0)
        device_note = cuda ? " (auto: a CUDA device is usable)" : " (auto: no CUDA device)";
    }
    if (strcmp(api, "c") != 0 && strcmp(api, "torch") != 0 && strcmp(api, "auto") != 0)
      return usage_error("--api '%s': use c, torch or auto", api);
    if (plan.channel == TSHARE_CHANNEL_PIPES && !cuda)
      return usage_error("%s", "the cpu demo shares host memory, which travels as fds: use --channel socket");
    static char self[PATH_MAX], server[PATH_MAX], worker[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) {
      perror("tshare-launch: readlink /proc/self/exe");
      return LAUNCH_NOT_STARTED;
    }
    self[n] = '\0';
    bool torch = strcmp(api, "c") != 0 && find_torch_example(self, "weights_server", server, sizeof server) &&
                 find_torch_example(self, "inference_worker", worker, sizeof worker);
    if (!torch && strcmp(api, "torch") == 0) {
      fprintf(stderr, "tshare-launch: --api torch: the LibTorch examples (weights_server, inference_worker) are not "
                      "built or installed; build tshare with LibTorch (see the README)\n");
      return LAUNCH_USAGE;
    }
    printf("tshare-launch demo: %d %s, %d consumer%s, device %s%s, %s\n", tensors, torch ? "batches" : "tensors",
           consumers, consumers == 1 ? "" : "s", cuda ? "cuda" : "cpu", device_note,
           torch ? "LibTorch bridge (examples/torch)" : "C API");
    fflush(stdout);
    snprintf(tensors_text, sizeof tensors_text, "%d", tensors);
    if (torch) {
      static char *pargv[8], *cargv[2];
      char *p[] = {server, "--batches", tensors_text, cuda ? "--device" : NULL, "cuda", NULL};
      memcpy(pargv, p, sizeof p);
      cargv[0] = worker;
      plan.producer_argv = pargv;
      plan.consumer_argv = cargv;
      plan.expect_shared = tensors;
      plan.expect_verified = tensors; /* each batch goes to one consumer */
      return launch_run(&plan);
    }
    static char *pargv[8], *cargv[8];
    char *p[] = {self, "__role", "producer", "--tensors", tensors_text, cuda ? "--device" : NULL, "cuda", NULL};
    char *c[] = {self, "__role", "consumer", "--tensors", tensors_text, cuda ? "--device" : NULL, "cuda", NULL};
    memcpy(pargv, p, sizeof p);
    memcpy(cargv, c, sizeof c);
    plan.producer_argv = pargv;
    plan.consumer_argv = cargv;
    plan.expect_shared = tensors;
    plan.expect_verified = tensors * consumers;
    return launch_run(&plan);
  }
  if (nconsumer_cmds > 1) { /* one per rank */
    if (consumers_given && consumers != nconsumer_cmds)
      return usage_error("--consumer given %d times for --consumers %d: give it once (every consumer runs it) or once "
                         "per consumer",
                         nconsumer_cmds, consumers);
    plan.consumers = nconsumer_cmds;
  }
  if (!producer_cmd || !nconsumer_cmds) {
    if (argc == 1) {
      fputs(usage_text, stderr);
      return LAUNCH_USAGE;
    }
    return usage_error("%s", "give 'demo', or both --producer and --consumer");
  }
  const char *token = getenv("TSHARE_TOKEN");
  if ((plan.ucx_listen || plan.ucx_connect) && (!token || !*token))
    return usage_error("%s %s: set TSHARE_TOKEN to the secret both nodes share",
                       plan.ucx_listen ? "--listen" : "--connect", plan.ucx_listen ? plan.ucx_listen : plan.ucx_connect);
  const char *why;
  if (!(producer_argv = cmdline_split(producer_cmd, &why))) return usage_error("--producer: %s", why);
  char **per_rank[TSHARE_ROLE_CHANNELS_MAX] = {0};
  for (int i = 0; i < nconsumer_cmds; i++)
    if (!(per_rank[i] = cmdline_split(consumer_cmds[i], &why))) return usage_error("--consumer: %s", why);
  plan.producer_argv = producer_argv;
  plan.consumer_argv = per_rank[0];
  plan.consumer_argvs = nconsumer_cmds > 1 ? per_rank : NULL;
  int rc = launch_run(&plan);
  cmdline_free(producer_argv);
  for (int i = 0; i < nconsumer_cmds; i++) cmdline_free(per_rank[i]);
  return rc;
}
