"""A Python role that closed its channel's fd and got the number back for its
own log file: tshare.role().channel(0) refuses it, naming the fd and what it
is now, and the file stays open and writable.

  test_role_fd.py LAUNCHER   runs tshare-launch with this file as the consumer
  test_role_fd.py --role     the consumer (exit 0 when the file survived)
"""
import os
import subprocess
import sys
import tempfile

try:
    import torch  # noqa: F401  the package needs it
except ImportError:
    print("SKIP: this Python has no torch (Debian: apt-get install python3-torch)")
    sys.exit(77)

import tshare


def consumer():
    role = tshare.role()
    assert role is not None, "not started by tshare-launch"
    fd = int(os.environ["TSHARE_CHANNEL_FDS"])
    os.close(fd)
    log_fd, path = tempfile.mkstemp(prefix="tshare-role-log-")
    try:
        assert log_fd == fd, "the log file got fd %d, not the channel's %d" % (log_fd, fd)
        try:
            role.channel(0)
            raise AssertionError("channel(0) took fd %d, which is the program's log file" % fd)
        except tshare.Error as e:
            print("refused:", e)
            assert e.code == tshare.E_STATE, e.status
            assert ("fd %d " % fd) in str(e) and path in str(e), str(e)
        assert os.write(log_fd, b"still mine\n") == 11
        assert os.pread(log_fd, 64, 0) == b"still mine\n"
        print("the log file is still open and writable")
    finally:
        os.close(log_fd)
        os.unlink(path)


def main():
    if sys.argv[1] == "--role":
        consumer()
        return 0
    me = "%s %s --role" % (sys.executable, os.path.abspath(__file__))
    run = subprocess.run([sys.argv[1], "--producer", "true", "--consumer", me, "--timeout", "30"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    print(run.stdout)
    assert run.returncode == 0, "tshare-launch exited %d" % run.returncode
    assert "refused: tshare: role channel 0: role: fd 3 is no longer tshare-launch's channel" in run.stdout
    assert "the log file is still open and writable" in run.stdout
    print("test_role_fd: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
