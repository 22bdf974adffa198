#!/usr/bin/env python3
"""Proves tests/check_layers.py: every rule is caught where it is broken,
with a line naming file, line and rule, and nothing is reported where the
rules hold.

Each folder here is a tiny tree (core/src, tests, launcher ...) with
expected.txt listing the violations the checker must report, one
`path:line: rule` a line (empty for the clean tree). The size rules need
files of hundreds of lines, so their tree is written by this script into a
temporary folder instead. Every rule of the checker must be expected by at
least one tree. Standard library only; exits 0 when all holds, 1 otherwise.
"""

import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKER = os.path.join(HERE, "..", "check_layers.py")
LINE = re.compile(r"^(\S+):(\d+): ([a-z0-9-]+): (.+)$")

sys.path.insert(0, os.path.dirname(CHECKER))
import check_layers  # noqa: E402  (found beside this folder)

failures = []


def fail(what):
    failures.append(what)
    print("FAILED: " + what)


def run_checker(root):
    p = subprocess.run([sys.executable, CHECKER, root], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True, timeout=60)
    return p.returncode, p.stdout.splitlines(), p.stderr


def found_violations(name, lines):
    """(path, line, rule) of each violation line; the summary line checked."""
    *body, summary = lines or ["(no output)"]
    want_summary = "layers: clean" if not body else "layers: %d violation%s" % (len(body), "s"[:len(body) != 1])
    if summary != want_summary:
        fail("%s: summary %r, expected %r" % (name, summary, want_summary))
    found = set()
    for line in body:
        m = LINE.match(line)
        if not m:
            fail("%s: %r is not 'path:line: rule: what'" % (name, line))
            continue
        path, number, rule, what = m.groups()
        if os.path.basename(path).split(".")[0] not in what:
            fail("%s: %r does not name its file in the message" % (name, line))
        found.add((path, int(number), rule))
    return found


def expect(name, root, expected):
    rc, lines, err = run_checker(root)
    found = found_violations(name, lines)
    for v in sorted(expected - found):
        fail("%s: missed %s:%d: %s" % ((name,) + v))
    for v in sorted(found - expected):
        fail("%s: reported %s:%d: %s, which breaks no rule" % ((name,) + v))
    if rc != (1 if expected else 0):
        fail("%s: exit status %d with %d violations expected (%s)" % (name, rc, len(expected), err.strip()))
    return {v[2] for v in expected}


def read_expected(folder):
    expected = set()
    with open(os.path.join(folder, "expected.txt")) as f:
        for line in f:
            if line.strip():
                path, number, rule = re.match(r"^(\S+):(\d+): ([a-z0-9-]+)$", line.strip()).groups()
                expected.add((path, int(number), rule))
    return expected


def write(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def function(name, lines_in_all, signature_lines=1):
    """A C function of exactly lines_in_all lines, signature to brace, with
    braces in a string and a comment that must not end it."""
    head = ["static int %s(int a," % name, "    int b) {"] if signature_lines == 2 else ["static int %s(int b) {" % name]
    body = ['  const char *s = "}"; /* } */', "  (void)s;"]
    filler = ["  b += %d;" % i for i in range(lines_in_all - len(head) - len(body) - 2)]
    return head + body + filler + ["  return b;", "}"]


def size_tree(root):
    """Files and functions just over and just at the limits."""
    over, at = check_layers.FILE_MAX_LINES + 1, check_layers.FUNCTION_MAX_LINES
    write(root, "core/src/big.c", "/* A file of many lines. */\n" + "int x;\n" * (over - 1))
    write(root, "core/src/big_one_concern.c",
          "/* The frame codec.\n * One concern: the wire's one table of frames. */\n" + "int y;\n" * (over - 2))
    write(root, "core/src/just_600.c", "/* At the limit. */\n" + "int z;\n" * (check_layers.FILE_MAX_LINES - 1))
    lines = ["/* Functions at and over the limit. */", "#include \"big.h\"", ""]
    lines += function("at_the_limit", at) + [""]
    first_long = len(lines) + 1
    lines += function("one_over", at + 1) + [""]
    second_long = len(lines) + 1
    lines += function("one_over_on_two_lines", at + 1, signature_lines=2) + [""]
    lines += ["static const int table[] = {"] + ["  %d," % i for i in range(100)] + ["};", ""]
    lines += ["#define LONG_MACRO(x) \\"] + ["  (x) + \\"] * 100 + ["  0", ""]
    write(root, "core/src/long.c", "\n".join(lines) + "\n")
    return {
        ("core/src/big.c", 1, "file-over-600-lines"),
        ("core/src/long.c", first_long, "function-over-80-lines"),
        ("core/src/long.c", second_long, "function-over-80-lines"),
    }


def allowlist_is_honoured(root):
    saved = dict(check_layers.FUNCTION_ALLOWLIST)
    check_layers.FUNCTION_ALLOWLIST["core/src/long.c:one_over"] = "a reason"
    try:
        lines = check_layers.check(root)
    finally:
        check_layers.FUNCTION_ALLOWLIST.clear()
        check_layers.FUNCTION_ALLOWLIST.update(saved)
    if any("one_over()" in line for line in lines):
        fail("sizes: an allowlisted function was reported: %s" % lines)
    if not any("one_over_on_two_lines()" in line for line in lines):
        fail("sizes: allowlisting one function let another go: %s" % lines)


def bad_usage_is_refused():
    with tempfile.TemporaryDirectory() as empty:
        rc, lines, err = run_checker(empty)
        if rc == 0 or "core/src" not in err:
            fail("a tree without core/src: exit %d, %r (expected a refusal naming core/src)" % (rc, err))
    p = subprocess.run([sys.executable, CHECKER, "--bogus"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       universal_newlines=True, timeout=60)
    if p.returncode != 2:
        fail("an unknown option: exit %d, expected 2" % p.returncode)


def main():
    covered = set()
    for name in sorted(os.listdir(HERE)):
        folder = os.path.join(HERE, name)
        if os.path.isdir(folder) and os.path.exists(os.path.join(folder, "expected.txt")):
            covered |= expect(name, folder, read_expected(folder))
            print("checked %s" % name)
    with tempfile.TemporaryDirectory() as root:
        covered |= expect("sizes", root, size_tree(root))
        allowlist_is_honoured(root)
        print("checked sizes")
    bad_usage_is_refused()
    for rule in sorted(set(check_layers.RULES) - covered):
        fail("no tree here breaks rule %s" % rule)
    print("layers self-test: %s" % ("%d failures" % len(failures) if failures else "all rules caught"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
