#!/usr/bin/env python3
"""Checks the layer rules of core/src by reading includes and calls.

    check_layers.py [ROOT]      ROOT: the source tree (default: this file's ../)

Prints one line per violation, `path:line: rule: what`, and a summary line;
exits 1 when there is any violation, 0 when there is none, 2 on bad usage.
Standard library only.

The layers (a file's layer comes from its name, by the table below):
  connection   the connection and its transports, below everything else
  session      the channel, shares and sets: the public API's engine
  table        backend.h and backends.c: the one way from the session to a backend
  backend      one memory backend; its files share a family prefix
  utility      everything else: wire, errors, log, clock, u64map, vec, bytes,
               error_detail, cuda_driver, and the orchestration above the
               session (role, spawn, rendezvous, tensor). The rules name
               neither, so utilities may be included from anywhere.

The rules:
  connection-includes-upper   a connection or transport file includes a
                              session or backend header, or the table (core/src
                              or the public tshare/ headers of those layers)
  session-includes-backend    a session file includes a backend's own header
                              (the table, backend.h, is the way in)
  session-calls-backend       a session file calls (or declares) a backend's
                              function by name (ts_cuda_..., ts_host_...);
                              calls through the table's members (->fn(...))
                              are the way
  backend-includes-backend    a backend file includes a header of another
                              backend family (its own family's are fine)
  core-src-outside-core       launcher/, python/, torch_bridge/, examples/ or a
                              build file there includes a core/src header or
                              adds core/src to an include path
  test-includes-internals     a test includes a core/src header it may not
                              (the rule for tests below)
  function-over-80-lines      a function in core/src longer than 80 lines
                              (signature to closing brace), unless it is in
                              FUNCTION_ALLOWLIST with a reason
  file-over-600-lines         a file in core/src longer than 600 lines whose
                              header comment has no line `One concern: <why>`

Tests (tests/, any depth) may include core/src internals only as unit tests
of one module: tests/.../test_M.c or fuzz_M.c unit-tests the core/src module
M (a core/src file named M.c, M.h or M_*.c/h exists), or the module that
TEST_MODULES names for it (several, for a test of how modules meet). Such a test may include M's own headers (M.h,
M_*.h), the core/src headers M's own files include, utility headers, and
the other headers of M's layer (of M's family, for a backend; none for a
utility): what M's layer can see, no more (a unit test of the spin policy
may use the ring's internals, not the session's; one of u64map nothing but
utilities). Every other file under tests/ (public-API tests, helpers)
includes no core/src header. tests/layers/ holds this
script's fixtures and is not checked.
"""

import fnmatch
import os
import re
import sys

CONNECTION, SESSION, TABLE, BACKEND, UTILITY = "connection", "session", "table", "backend", "utility"

# core/src file name -> layer: the first pattern that matches wins.
LAYER_BY_NAME = [
    ("backend.h", TABLE),
    ("backends.c", TABLE),
    ("cuda_driver*", UTILITY),
    ("conn*", CONNECTION),
    ("transport*", CONNECTION),
    ("ring*", CONNECTION),
    ("hello*", CONNECTION),
    ("fd_queue*", CONNECTION),
    ("spin_policy*", CONNECTION),
    ("session*", SESSION),
    ("backend_*", BACKEND),
    ("cuda_*", BACKEND),
]
DEFAULT_LAYER = UTILITY

# A backend file's family: the first pattern that matches wins; any other
# backend_X* file is family X.
FAMILY_BY_NAME = [
    ("backend_host*", "host"),
    ("backend_ucx*", "host"),  # host memory read across hosts: the host buffers' references are its own
    ("backend_cuda*", "cuda"),
    ("cuda_*", "cuda"),
]

# Public headers (core/include/tshare/) that belong to a layer the rules name;
# the others (errors, wire, tensor, version, role, spawn, rendezvous) count as
# utilities. tshare.h includes them all, so it counts as the session.
PUBLIC_LAYER = {
    "tshare/channel.h": SESSION,
    "tshare/share.h": SESSION,
    "tshare/set.h": SESSION,
    "tshare/tshare.h": SESSION,
    "tshare/cuda.h": BACKEND,
    "tshare/hostmem.h": BACKEND,
}

# Tests whose file name does not say the module they unit-test.
TEST_MODULES = {
    "tests/gpu/test_retire_acks.c": "backend_cuda",
    "tests/gpu/test_cuda_hello.c": "backend_cuda",  # the hello a channel builds from the backends
    "tests/gpu/test_cuda_held.c": "backend_cuda",  # owned buffers named on the wire by the backend's id
    "tests/fuzz/fuzz_sets.c": "session_set",  # sets assembled by a channel from a hand-written peer
    "tests/test_session_loopback.c": "session",  # channels over the in-process transport
    # the policy, and the ring receives that follow it in real channels (read through the session's channel)
    "tests/test_spin_policy.c": ("transport_ring", "session"),
    # remote host memory over UCX, and a hostile producer's registrations made with UCP's own calls
    "tests/test_ucx_mem.c": ("backend_ucx", "ucx_api"),
    # tensor sets of remote memory, and a hostile producer's registrations made with UCP's own calls
    "tests/test_ucx_set.c": ("backend_ucx", "ucx_api"),
}

# Functions allowed over 80 lines: "path:function": "why". Keep it empty.
FUNCTION_ALLOWLIST = {}

FUNCTION_MAX_LINES = 80
FILE_MAX_LINES = 600
ONE_CONCERN = re.compile(r"One concern:")

CORE_SRC = "core/src"
OUTSIDE_CORE = ["launcher", "python", "torch_bridge", "examples"]
# Where a quoted include of each part of the tree is found, besides the
# including file's own folder: a name found there is not core/src's.
INCLUDE_DIRS = {
    "launcher": ["core/include", "core/internal"],
    "python": ["python/src", "core/include", "core/internal"],
    "torch_bridge": ["torch_bridge/include", "torch_bridge/src", "core/include"],
    "examples": ["core/include", "torch_bridge/include"],
    "tests": ["tests", "core/include", "core/internal", "torch_bridge/include"],
}
SOURCE_EXTS = (".c", ".h", ".cc", ".cpp", ".hpp", ".cu")
BUILD_FILES = ("CMakeLists.txt", "setup.py")
BUILD_EXTS = (".cmake",)
SKIP_DIRS = {".git", "__pycache__", "node_modules"}
FIXTURES = "tests/layers"

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
PREPROCESSOR = re.compile(r"^\s*#")


def match_table(name, table, default):
    for pattern, value in table:
        if fnmatch.fnmatchcase(name, pattern):
            return value
    return default


def layer_of(name):
    return match_table(name, LAYER_BY_NAME, DEFAULT_LAYER)


def family_of(name):
    fam = match_table(name, FAMILY_BY_NAME, None)
    if fam is None and name.startswith("backend_"):
        fam = re.split(r"[_.]", name[len("backend_"):])[0]
    return fam


def call_prefixes(family):
    return ("ts_%s_" % family, "ts_backend_%s_" % family)


RULES = ("connection-includes-upper", "session-includes-backend", "session-calls-backend",
         "backend-includes-backend", "core-src-outside-core", "test-includes-internals",
         "function-over-80-lines", "file-over-600-lines")


class Violations:
    def __init__(self):
        self.items = []

    def add(self, path, line, rule, what):
        assert rule in RULES, rule
        self.items.append((path, line, rule, what))

    def lines(self):
        return ["%s:%d: %s: %s" % item for item in sorted(set(self.items))]


def strip_c(text, keep_strings):
    """Comments (and string and char literals unless keep_strings) blanked,
    newlines kept, so line numbers stay right."""
    out, i, n = [], 0, len(text)
    while i < n:
        two = text[i:i + 2]
        if two == "/*":
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
        elif two == "//":
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(" " * (end - i))
            i = end
        elif text[i] in "\"'":
            quote, j = text[i], i + 1
            while j < n and text[j] != quote and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(text[i:j] if keep_strings else quote + " " * max(0, j - i - 2) + quote)
            i = j
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def blank_preprocessor(text):
    """Preprocessor lines (with their continuations) blanked."""
    lines, out, continued = text.split("\n"), [], False
    for line in lines:
        if continued or PREPROCESSOR.match(line):
            continued = line.rstrip().endswith("\\")
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def includes(text):
    """(line number, kind, path) of each #include outside comments."""
    found = []
    for number, line in enumerate(strip_c(text, keep_strings=True).split("\n"), 1):
        m = INCLUDE.match(line)
        if m:
            found.append((number, m.group(1), m.group(2)))
    return found


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


SIGNATURE_END = re.compile(r"(\w+)\s*\(([^()]|\([^()]*\))*\)\s*$")
ATTRIBUTE = re.compile(r"__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)")


def functions(text):
    """(name, first line, last line) of each function definition."""
    code = blank_preprocessor(strip_c(text, keep_strings=False))
    found, depth, start, begin = [], 0, 0, None
    for i, ch in enumerate(code):
        if ch == "{":
            if depth == 0:
                begin = function_head(code, start, i)
            depth += 1
        elif ch == "}":
            depth = max(0, depth - 1)
            if depth == 0:
                if begin:
                    found.append((begin[0], begin[1], line_of(code, i)))
                begin, start = None, i + 1
        elif ch == ";" and depth == 0:
            start = i + 1
    return found


def function_head(code, start, brace):
    """(name, line) when the text before a top-level brace is a function's
    signature: it ends in a parameter list and assigns nothing."""
    head = ATTRIBUTE.sub(lambda m: " " * len(m.group(0)), code[start:brace])
    if "=" in head:
        return None
    m = SIGNATURE_END.search(head)
    if not m:
        return None
    name = m.group(1)
    if name.isupper():  # a macro that defines a function: TS_TEST(name)
        name = re.sub(r"\s+", "", head[m.start(1):m.end()].strip())
    return name, line_of(code, start + m.start(1))


class Tree:
    def __init__(self, root):
        self.root = root
        self.src = os.path.join(root, CORE_SRC)
        self.src_names = sorted(os.listdir(self.src)) if os.path.isdir(self.src) else []
        self.texts = {}

    def read(self, rel):
        if rel not in self.texts:
            with open(os.path.join(self.root, rel), encoding="utf-8", errors="replace") as f:
                self.texts[rel] = f.read()
        return self.texts[rel]

    def exists(self, rel):
        return os.path.isfile(os.path.join(self.root, rel))

    def walk(self, top, want):
        """Paths (relative to the root) of the files under top that want() takes."""
        base = os.path.join(self.root, top)
        if os.path.isfile(base):
            return [top] if want(os.path.basename(top)) else []
        paths = []
        for dirpath, dirnames, filenames in os.walk(base):
            rel_dir = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            dirnames[:] = sorted(d for d in dirnames
                                 if d not in SKIP_DIRS and not d.startswith("build")
                                 and rel_dir + "/" + d != FIXTURES)
            paths += [rel_dir + "/" + f for f in sorted(filenames) if want(f)]
        return paths

    def core_src_header(self, including, kind, path):
        """The core/src header that an include in file `including` reaches,
        or None. Inside core/src a quoted name is a sibling."""
        if "core/src/" in path:
            name = path.split("core/src/", 1)[1]
            return name if name in self.src_names else os.path.basename(path)
        if including.startswith(CORE_SRC + "/"):
            return path if kind == '"' and path in self.src_names else None
        if kind != '"' or os.path.basename(path) not in self.src_names:
            return None
        here = os.path.dirname(including)
        for d in [here] + INCLUDE_DIRS.get(including.split("/", 1)[0], []):
            if self.exists(os.path.normpath(os.path.join(d, path))):
                return None
        return os.path.basename(path)


def may_include(src_name, header):
    """None when a core/src file may include this header (a core/src name or
    a public tshare/ path), else the rule it breaks."""
    layer = layer_of(src_name)
    if header.startswith("tshare/"):
        target_layer, target_family = PUBLIC_LAYER.get(header, UTILITY), None
    else:
        target_layer, target_family = layer_of(header), family_of(header)
    if layer == CONNECTION and target_layer in (SESSION, BACKEND, TABLE):
        return "connection-includes-upper", target_layer
    if header.startswith("tshare/"):
        return None
    if layer == SESSION and target_layer == BACKEND:
        return "session-includes-backend", target_layer
    if layer == BACKEND and target_layer == BACKEND and target_family != family_of(src_name):
        return "backend-includes-backend", "backend " + str(target_family)
    return None


def describe(name, layer):
    return "%s (%s)" % (name, layer if layer != BACKEND else "backend " + str(family_of(name)))


def check_core_includes(tree, out):
    for name in tree.src_names:
        if not name.endswith(SOURCE_EXTS):
            continue
        rel = CORE_SRC + "/" + name
        for number, kind, path in includes(tree.read(rel)):
            header = path if path.startswith("tshare/") else tree.core_src_header(rel, kind, path)
            if header is None:
                continue
            broken = may_include(name, header)
            if broken:
                out.add(rel, number, broken[0], '%s includes "%s" (%s)'
                        % (describe(name, layer_of(name)), path, broken[1]))


def utility_function_names(tree):
    """Functions declared by utility headers (core/src and core/internal):
    ts_cuda_push and the like are the driver's, not a backend's."""
    names = set()
    headers = [CORE_SRC + "/" + n for n in tree.src_names if n.endswith(".h") and layer_of(n) == UTILITY]
    headers += tree.walk("core/internal", lambda f: f.endswith(".h"))
    for rel in headers:
        code = strip_c(tree.read(rel), keep_strings=False)
        names.update(re.findall(r"\b(ts_\w+)\s*\(", code))
    return names


def brace_depths(code):
    """The brace depth at each offset of comment-free code."""
    depths, depth = [], 0
    for ch in code:
        if ch == "}":
            depth = max(0, depth - 1)
        depths.append(depth)
        if ch == "{":
            depth += 1
    return depths


def check_session_calls(tree, out):
    families = {family_of(n) for n in tree.src_names if layer_of(n) == BACKEND} - {None}
    prefixes = tuple(p for fam in sorted(families) for p in call_prefixes(fam))
    if not prefixes:
        return
    exempt = utility_function_names(tree)
    call = re.compile(r"(?<!->)(?<!-> )(?<![.\w])(ts_\w+)\s*\(")
    for name in tree.src_names:
        if layer_of(name) != SESSION or not name.endswith(SOURCE_EXTS):
            continue
        rel = CORE_SRC + "/" + name
        code = blank_preprocessor(strip_c(tree.read(rel), keep_strings=False))
        depth = brace_depths(code)
        for m in call.finditer(code):
            fn = m.group(1)
            if fn.startswith(prefixes) and fn not in exempt:
                verb = "calls" if depth[m.start(1)] > 0 else "declares"  # outside a body: a prototype
                out.add(rel, line_of(code, m.start(1)), "session-calls-backend",
                        "%s %s %s() by name, not through the backend table" % (name, verb, fn))


def check_outside_core(tree, out):
    for top in OUTSIDE_CORE:
        for rel in tree.walk(top, lambda f: f.endswith(SOURCE_EXTS)):
            for number, kind, path in includes(tree.read(rel)):
                header = tree.core_src_header(rel, kind, path)
                if header:
                    out.add(rel, number, "core-src-outside-core",
                            '%s includes "%s", a core/src header' % (os.path.basename(rel), path))
    build = lambda f: f in BUILD_FILES or f.endswith(BUILD_EXTS)
    for rel in [p for top in OUTSIDE_CORE for p in tree.walk(top, build)] + tree.walk("setup.py", build):
        code = "\n".join(line.split("#", 1)[0] for line in tree.read(rel).split("\n"))
        for m in re.finditer(r"core/src\b", code):
            if on_include_path(code, m.start()):
                out.add(rel, line_of(code, m.start()), "core-src-outside-core",
                        "%s puts core/src on an include path" % os.path.basename(rel))


def on_include_path(code, at):
    """Whether the core/src at offset `at` of a build file (CMake or
    setup.py, comments blanked) is an include directory: an -I flag, or an
    argument of a call or list whose name says include
    (target_include_directories(...), include_dirs = [...])."""
    if re.search(r"-I\S*$", code[max(0, at - 200):at]):
        return True
    depth = 0
    for i in range(at - 1, -1, -1):
        if code[i] in ")]":
            depth += 1
        elif code[i] in "([":
            if depth == 0:
                return re.search(r"include\w*\s*=?\s*$", code[max(0, i - 80):i], re.IGNORECASE) is not None
            depth -= 1
    return False


def test_module(tree, rel):
    """The core/src module a test file unit-tests, or None."""
    if rel in TEST_MODULES:
        return TEST_MODULES[rel]
    m = re.match(r"(?:test|fuzz)_(\w+)\.\w+$", os.path.basename(rel))
    if not m:
        return None
    module = m.group(1)
    for name in tree.src_names:
        if re.match(re.escape(module) + r"(\.[ch]|_\w*\.[ch])$", name):
            return module
    return None


def module_headers(tree, module):
    """The core/src headers a unit test of `module` may include: the
    module's own (M.h, M_*.h), those its own files include, utilities, and
    the other headers of its layer (of its family, for a backend)."""
    own = [n for n in tree.src_names if re.match(re.escape(module) + r"(\.[ch]|_\w*\.[ch])$", n)]
    allowed = {n for n in own if n.endswith(".h")}
    for name in own:
        rel = CORE_SRC + "/" + name
        allowed.update(h for _, kind, path in includes(tree.read(rel))
                       for h in [tree.core_src_header(rel, kind, path)] if h)
    allowed.update(n for n in tree.src_names if n.endswith(".h") and layer_of(n) == UTILITY)
    layer = layer_of(module + ".c")
    if layer != UTILITY:  # its layer's other internals (a backend: its family's)
        allowed.update(n for n in tree.src_names if n.endswith(".h") and layer_of(n) == layer
                       and (layer != BACKEND or family_of(n) == family_of(module + ".c")))
    return allowed


def check_tests(tree, out):
    for rel in tree.walk("tests", lambda f: f.endswith(SOURCE_EXTS)):
        module = test_module(tree, rel)
        modules = module if isinstance(module, tuple) else (module,) if module else ()
        allowed = set().union(*(module_headers(tree, m) for m in modules))
        module = " and ".join(modules) or None
        for number, kind, path in includes(tree.read(rel)):
            header = tree.core_src_header(rel, kind, path)
            if header is None or header in allowed:
                continue
            if module is None:
                what = "but unit-tests no core/src module (name it test_M.c or list it in TEST_MODULES)"
            else:
                what = ("(%s) but unit-tests %s: only %s's own headers, those its files include, "
                        "utilities and its layer's" % (layer_of(header), module, module))
            out.add(rel, number, "test-includes-internals",
                    '%s includes "%s" %s' % (os.path.basename(rel), path, what))


def header_comment(text):
    """The comments before the first line of code."""
    code = strip_c(text, keep_strings=True)
    first = re.search(r"\S", code)
    return text[:first.start()] if first else text


def check_sizes(tree, out):
    for name in tree.src_names:
        if not name.endswith(SOURCE_EXTS):
            continue
        rel = CORE_SRC + "/" + name
        text = tree.read(rel)
        count = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        if count > FILE_MAX_LINES and not ONE_CONCERN.search(header_comment(text)):
            out.add(rel, 1, "file-over-600-lines",
                    "%s has %d lines and its header comment has no 'One concern: <why>' line"
                    % (name, count))
        for fn, first, last in functions(text):
            length = last - first + 1
            if length > FUNCTION_MAX_LINES and "%s:%s" % (rel, fn) not in FUNCTION_ALLOWLIST:
                out.add(rel, first, "function-over-80-lines",
                        "%s() in %s has %d lines" % (fn, name, length))


def check(root):
    tree, out = Tree(root), Violations()
    if not tree.src_names:
        raise SystemExit("check_layers: no %s under %s" % (CORE_SRC, root))
    check_core_includes(tree, out)
    check_session_calls(tree, out)
    check_outside_core(tree, out)
    check_tests(tree, out)
    check_sizes(tree, out)
    return out.lines()


def main(argv):
    if len(argv) > 2 or (len(argv) == 2 and argv[1].startswith("-")):
        sys.stderr.write(__doc__)
        return 2
    root = argv[1] if len(argv) == 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    lines = check(os.path.abspath(root))
    for line in lines:
        print(line)
    print("layers: %d violation%s" % (len(lines), "" if len(lines) == 1 else "s") if lines else "layers: clean")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
