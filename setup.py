"""Builds the tshare Python package: python/tshare and its extension
tshare._tshare, compiled from the C sources cmake/sources.txt lists (the list
CMake builds libtshare and the extension from). The version is
core/include/tshare/version.h's, the one source of it.

It needs a C compiler and Python's headers, nothing else: the extension links
only libc, and opens the CUDA driver with dlopen at run time, so one build
loads on machines with and without a GPU. CUDA shares need the CUDA toolkit's
cuda.h at build time; TSHARE_WITH_CUDA (environment) is AUTO (use it where it
is found, the default), ON (fail without it) or OFF.

    pip install --no-build-isolation .
    pip wheel --no-build-isolation --no-deps -w dist .
"""
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.egg_info import egg_info

ROOT = os.path.dirname(os.path.abspath(__file__))


def read_version():
    """MAJOR.MINOR.PATCH from version.h's TSHARE_VERSION_* macros."""
    with open(os.path.join(ROOT, "core", "include", "tshare", "version.h")) as f:
        text = f.read()
    parts = [re.search(r"^#define TSHARE_VERSION_%s (\d+)$" % p, text, re.M) for p in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        sys.exit("setup.py: core/include/tshare/version.h defines no TSHARE_VERSION_MAJOR, _MINOR and _PATCH")
    return ".".join(m.group(1) for m in parts)


def read_sources(*groups):
    """The sources cmake/sources.txt lists under GROUPS, as paths from the
    repository root (setuptools takes relative paths only)."""
    sources = []
    with open(os.path.join(ROOT, "cmake", "sources.txt")) as f:
        for line in f:
            fields = line.split()
            if len(fields) == 2 and not line.startswith("#") and fields[0] in groups:
                sources.append(fields[1])
    if not sources:
        sys.exit("setup.py: cmake/sources.txt lists no source under %s" % " ".join(groups))
    return sources


def cuda_include_dir():
    """The directory holding cuda.h ("" where the compiler finds it on its
    own), or None to build without CUDA shares."""
    given = os.environ.get("TSHARE_WITH_CUDA", "AUTO")
    wanted = given.upper()
    if wanted not in ("AUTO", "ON", "OFF"):
        sys.exit("setup.py: TSHARE_WITH_CUDA=%s: use AUTO, ON or OFF" % given)
    if wanted == "OFF":
        return None
    roots = [os.environ[v] for v in ("CUDA_HOME", "CUDA_PATH", "CUDAToolkit_ROOT") if os.environ.get(v)]
    candidates = [os.path.join(r, "include") for r in roots] + ["/usr/local/cuda/include", "/usr/include"]
    for d in candidates:
        if os.path.isfile(os.path.join(d, "cuda.h")):
            return "" if d == "/usr/include" else d
    if wanted == "ON":
        sys.exit("setup.py: TSHARE_WITH_CUDA=ON but no cuda.h in %s; set CUDA_HOME to the CUDA toolkit" % candidates)
    print("setup.py: no cuda.h in %s (set CUDA_HOME to the CUDA toolkit): the package shares host memory only"
          % candidates, file=sys.stderr)
    return None


def extension():
    cuda = cuda_include_dir()
    macros = [("_GNU_SOURCE", None)]
    include_dirs = ["core/include", "core/internal", "python/src"]
    if cuda is None:
        sources = read_sources("core", "no-cuda", "python")
    else:
        sources = read_sources("core", "cuda", "python")
        macros.append(("TSHARE_HAVE_CUDA", "1"))
        include_dirs += [cuda] if cuda else []
    return Extension(
        "tshare._tshare",
        sources=sources,
        include_dirs=include_dirs,
        # TSHARE_API empty: the library's functions stay inside the extension
        # (never interposed by, or interposing on, a libtshare.so in the process).
        define_macros=macros + [("TSHARE_API", "")],
        # As CMake builds it: C11, only PyInit__tshare exported.
        extra_compile_args=["-std=c11", "-fvisibility=hidden", "-pthread"],
        # glibc 2.34 and newer hold dlopen and threads in libc itself:
        # --as-needed records libdl and libpthread only where they are real.
        extra_link_args=["-Wl,--as-needed", "-pthread", "-ldl"],
    )


def torch_native_extension():
    """tshare._torch_native (python/native/set_tensors.cpp: a received set's
    tensors made in C++) against the torch of the interpreter running setup.py
    (pip install --no-build-isolation), or None where it has no torch or
    TSHARE_TORCH_NATIVE_BUILD=0. Optional: where it does not compile (no
    pybind11 headers, say) the package is built without it, and works."""
    if os.environ.get("TSHARE_TORCH_NATIVE_BUILD", "1") == "0":
        return None
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception:  # no torch here: received sets are made in Python
        print("setup.py: this interpreter has no torch: tshare._torch_native is not built", file=sys.stderr)
        return None
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    ext = cpp_extension.CppExtension(
        "tshare._torch_native",
        ["python/native/set_tensors.cpp"],
        extra_compile_args=["-std=c++17", "-fvisibility=hidden", "-D_GLIBCXX_USE_CXX11_ABI=%d" % abi],
    )
    ext.optional = True
    return ext


class ParallelBuildExt(build_ext):
    """Compiles the extension's files on every CPU this process may use
    (setuptools compiles one file at a time)."""

    def build_extensions(self):
        compile_one_by_one = self.compiler.compile
        jobs = len(os.sched_getaffinity(0))

        def compile_in_parallel(sources, *args, **kwargs):
            with ThreadPoolExecutor(jobs) as pool:
                objects = pool.map(lambda source: compile_one_by_one([source], *args, **kwargs), sources)
                return [o for per_source in objects for o in per_source]

        self.compiler.compile = compile_in_parallel
        super().build_extensions()


class EggInfoInBuildDir(egg_info):
    """Writes tshare.egg-info where setup()'s options say, creating that
    directory first (setuptools refuses one that does not exist yet)."""

    def finalize_options(self):
        if self.egg_base:
            os.makedirs(self.egg_base, exist_ok=True)
        super().finalize_options()


setup(
    version=read_version(),
    package_dir={"": "python"},
    packages=["tshare"],
    package_data={"tshare": ["*.pyi", "py.typed"]},
    ext_modules=[e for e in (extension(), torch_native_extension()) if e is not None],
    cmdclass={"build_ext": ParallelBuildExt, "egg_info": EggInfoInBuildDir},
    # setuptools' own build tree, kept inside the ignored build/ (by default
    # it would write build/lib.* beside CMake's files and an egg-info into python/).
    options={"build": {"build_base": "build/pip"}, "egg_info": {"egg_base": "build/pip"}},
    zip_safe=False,
)
