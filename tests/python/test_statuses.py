"""The status constants of the tshare package against the C library's list:

  test_statuses.py ERRORS_H      (exit 0 pass, 1 fail, 77 skip with the reason)

Every tshare.E_* (and OK, END) has the value errors.h gives its TSHARE_
name, and the statuses a caller compares Error.code with are there, E_BUSY
(a call beside another thread's on one channel) among them."""
import re
import sys

import harness  # noqa: F401  exits 77 without torch
import tshare

EXPECTED = ("OK", "END", "E_BUSY", "E_TIMEOUT", "E_PEER_CLOSED", "E_STATE", "E_INVALID_ARG", "E_UNSUPPORTED")


def c_statuses(errors_h):
    with open(errors_h) as f:
        return {m.group(1): int(m.group(2)) for m in re.finditer(r"X\(TSHARE_(\w+),\s*(-?\d+),", f.read())}


def main(errors_h):
    c = c_statuses(errors_h)
    assert c.get("E_BUSY") == -25, "errors.h has no TSHARE_E_BUSY -25: %s" % sorted(c)
    exported = {n: getattr(tshare, n) for n in dir(tshare) if re.fullmatch(r"E_\w+|OK|END", n)}
    for name in EXPECTED:
        assert name in exported, "tshare.%s is missing" % name
    for name, value in sorted(exported.items()):
        assert c.get(name) == value, "tshare.%s is %r, errors.h says %r" % (name, value, c.get(name))
    print("%d statuses match errors.h" % len(exported))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: test_statuses.py ERRORS_H")
        sys.exit(2)
    main(sys.argv[1])
    print("ok")
