// Proves the installed bridge works: a tensor sent to a forked process, a
// write there, seen here.
#include <tshare/torch.h>

#include <ATen/ATen.h>

#include <cstdio>
#include <sys/wait.h>
#include <unistd.h>

int main() {
  int sv[2];
  if (tshare_socketpair(sv, nullptr) != TSHARE_OK) return 1;
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    tshare_channel *raw = nullptr;
    if (tshare_channel_open_socket(sv[1], nullptr, &raw, nullptr) != TSHARE_OK) _exit(2);
    tshare::torch::ChannelPtr ch(raw);
    auto r = tshare::torch::recv(ch.get(), {5000});
    if (!r || !at::equal(r->tensor, at::arange(6, at::kFloat).view({2, 3}).t())) _exit(3);
    r->tensor.mul_(10);
    r.reset();
    ch.reset();
    _exit(0);
  }
  close(sv[1]);
  tshare_channel *raw = nullptr;
  if (tshare_channel_open_socket(sv[0], nullptr, &raw, nullptr) != TSHARE_OK) return 4;
  tshare::torch::ChannelPtr ch(raw);
  at::Tensor t = at::arange(6, at::kFloat).view({2, 3});
  tshare::torch::send(ch.get(), t.t());
  if (tshare_channel_wait_released(ch.get(), 0, 5000) != TSHARE_OK) return 5;
  int st;
  waitpid(pid, &st, 0);
  bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0 && at::equal(t, at::arange(6, at::kFloat).view({2, 3}) * 10);
  std::printf("torch package consumer: %s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 6;
}
