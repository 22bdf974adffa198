# The two commands a new user runs:
#   make demo   build, then share tensors between a producer and two consumers
#   make test   build, then run every test (GPU tests skip without a GPU)
# More: make bench (tshare against the floor and torch.multiprocessing; BENCH_ARGS=--quick),
# make asan (tests under ASan+UBSan), make tsan (tests under ThreadSanitizer),
# make valgrind (CPU tests under valgrind),
# make fuzz (libFuzzer on the decoder and share validation), make faults (fault
# trials), make load (the load test), make gpu-sanitize (compute-sanitizer memcheck
# and racecheck, on a GPU machine), make install PREFIX=..., make install-python
# (the tshare Python package through pip; PYTHON=v/bin/python), make clean.

BUILD_DIR ?= build
ASAN_BUILD_DIR ?= build-asan
VALGRIND_BUILD_DIR ?= build-valgrind
TSAN_BUILD_DIR ?= build-tsan
PREFIX ?= /usr/local
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
FUZZ_SECONDS ?= 60
FUZZ_RING_SECONDS ?= $(FUZZ_SECONDS)
FUZZ_CONN_SECONDS ?= $(FUZZ_SECONDS)
FUZZ_SETS_SECONDS ?= $(FUZZ_SECONDS)
# CI builds with -Werror; the exported flags never carry it.
CMAKE_FLAGS ?= $(if $(CI),-DTSHARE_WERROR=ON)

# The make that CMake runs inherits this: its progress lines, without the
# "Entering directory" chatter.
MAKEFLAGS += --no-print-directory

.PHONY: all deps deps-checked configure build demo test bench asan tsan valgrind fuzz faults load gpu-sanitize install install-python clean

all: build

# Every build checks what it needs (scripts/install-deps.sh); with nothing
# missing that costs no probe, its answers kept in DEPS_CACHE. That file
# changes only where an answer changed or apt installed something, and then
# CMake looks again. make deps tries packages it could not install before.
DEPS_CACHE = $(BUILD_DIR)/install-deps.cache
deps:
	@./scripts/install-deps.sh --retry --cache $(DEPS_CACHE)

# (CMake leaves CMakeCache.txt's time alone when nothing in it changed: a
# stamp of its own says when CMake last looked.)
configure: deps-checked
	@if [ ! -f $(BUILD_DIR)/CMakeCache.txt ] || [ $(DEPS_CACHE) -nt $(BUILD_DIR)/install-deps.configured ]; then \
	  echo "cmake -S . -B $(BUILD_DIR) -DCMAKE_INSTALL_PREFIX=$(PREFIX) $(CMAKE_FLAGS)"; \
	  cmake -S . -B $(BUILD_DIR) -DCMAKE_INSTALL_PREFIX=$(PREFIX) $(CMAKE_FLAGS) && touch $(BUILD_DIR)/install-deps.configured; fi

deps-checked:
	@./scripts/install-deps.sh --cache $(DEPS_CACHE)

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# Only what the demo runs (the launcher, the examples, the Python package);
# the tests, fuzzers and bench build with make test and make bench.
demo: configure
	cmake --build $(BUILD_DIR) -j $(JOBS) --target demo_programs
	$(BUILD_DIR)/launcher/tshare-launch demo --tensors 8 --consumers 2
	@./examples/python/run_demo.sh $(BUILD_DIR)

# The run ends with what this build left out and the tests skipped, per reason.
test: build
	@rc=0; ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) \
	  --output-junit $(abspath $(BUILD_DIR))/Testing/junit.xml || rc=$$?; \
	cmake -DBUILD_DIR=$(abspath $(BUILD_DIR)) -P cmake/summary.cmake; exit $$rc

bench: build
	$(BUILD_DIR)/bench/tshare-bench --out $(BUILD_DIR)/bench-results $(BENCH_ARGS)

asan: deps-checked
	cmake -S . -B $(ASAN_BUILD_DIR) -DCMAKE_BUILD_TYPE=Debug -DTSHARE_SANITIZE=address,undefined $(CMAKE_FLAGS)
	cmake --build $(ASAN_BUILD_DIR) -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --test-dir $(ASAN_BUILD_DIR) --output-on-failure -j $(JOBS)

# Every test under ThreadSanitizer: views are released from any thread, so the
# channel's locks and atomics are checked here (CI runs it). Without LibTorch:
# it is not built with TSan, and its own thread pool would be what is reported.
# UCX's memory hooks (libucm) are off: they wrap madvise, which a thread's exit
# calls after TSan let go of the thread, and TSan then faults in them.
tsan: deps-checked
	cmake -S . -B $(TSAN_BUILD_DIR) -DCMAKE_BUILD_TYPE=Debug -DTSHARE_SANITIZE=thread -DTSHARE_WITH_TORCH=OFF $(CMAKE_FLAGS)
	cmake --build $(TSAN_BUILD_DIR) -j $(JOBS)
	UCX_MEM_EVENTS=no UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none \
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
	  ctest --test-dir $(TSAN_BUILD_DIR) --output-on-failure -j $(JOBS)

# Every CPU test binary under valgrind memcheck, children included; a leak or
# an error fails the test. Left to make asan: the bench, the libFuzzer run
# (its replay of the corpus stays) and the stress runs (too slow under
# valgrind), the tests that count a process's fds or lower its fd limit
# (valgrind holds fds of its own), one with a 20 s limit, and one that kills
# the launcher 0.4 s in (under valgrind its roles have not started by then).
# tests/valgrind.supp names the one finding outside tshare (in LibTorch's
# libcpuinfo) and why it is harmless.
VALGRIND_SKIP = sigkill_to_the_launcher|fds_land_at_their_numbers|die_with_parent_spawns|roles_inherit_only_their_fds|demo_device_cuda_without_gpu|non_executable_file|decoder_smoke|test_hostile\.(both_ends|fds_on_frames|an_fd_on_a_frame|a_peer_cannot_fill|out_of_fds|views_without)
# Valgrind's own messages go to valgrind-PID.log files in the build tree,
# so they never mix into the output the tests check.
VALGRIND = valgrind;--error-exitcode=99;--leak-check=full;--errors-for-leak-kinds=definite;--suppressions=$(abspath tests/valgrind.supp);--trace-children=yes;--trace-children-skip=*/sh,*/sleep,*/env,*/true,*/false,*/python3*;--log-file=$(abspath $(VALGRIND_BUILD_DIR))/valgrind-%p.log
valgrind: deps-checked
	@command -v valgrind >/dev/null || { echo "make valgrind needs valgrind (Debian: apt-get install valgrind)"; exit 1; }
	cmake -S . -B $(VALGRIND_BUILD_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTSHARE_TEST_SLOWDOWN=6 "-DCMAKE_CROSSCOMPILING_EMULATOR=$(VALGRIND)" $(CMAKE_FLAGS)
	cmake --build $(VALGRIND_BUILD_DIR) -j $(JOBS)
	rm -f $(VALGRIND_BUILD_DIR)/valgrind-*.log
	ctest --test-dir $(VALGRIND_BUILD_DIR) --output-on-failure -j $(JOBS) -LE 'bench|stress|gpu' \
	  -E '$(VALGRIND_SKIP)' --timeout 900; \
	rc=$$?; bad=$$(grep -l 'ERROR SUMMARY: [1-9]\|definitely lost: [1-9]' $(VALGRIND_BUILD_DIR)/valgrind-*.log 2>/dev/null); \
	[ -z "$$bad" ] || { echo "valgrind found errors:"; for f in $$bad; do echo "== $$f"; cat "$$f"; done; rc=1; }; \
	echo "valgrind: $$(ls $(VALGRIND_BUILD_DIR)/valgrind-*.log | wc -l) processes checked"; exit $$rc

# Fault trials and the load test (tests/stress): host memory, then GPU memory
# where a device is usable. FAULT_TRIALS / LOAD_SHARES scale them.
FAULT_TRIALS ?= 100
LOAD_SHARES ?= 100000
faults: build
	./tests/stress/run.sh faults $(BUILD_DIR) $(FAULT_TRIALS)

load: build
	./tests/stress/run.sh load $(BUILD_DIR) $(LOAD_SHARES)

gpu-sanitize: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -L sanitizer

# libFuzzer (ASan+UBSan) on the frame decoder and share validation, the
# ring, a ring channel against a hand-written peer, and tensor sets a channel
# assembles from a hand-written peer, each for
# FUZZ_SECONDS. A crash is copied into tests/fuzz/corpus* as regress-*, where
# the corpus replay (make test) runs it from then on, and the target fails.
fuzz: build
	@test -x $(BUILD_DIR)/tests/fuzz/fuzz_decoder || { echo "make fuzz needs clang with its libFuzzer runtime (Debian: apt-get install clang); see the cmake output"; exit 1; }
	mkdir -p $(BUILD_DIR)/fuzz-corpus $(BUILD_DIR)/fuzz-crashes
	rc=0; $(BUILD_DIR)/tests/fuzz/fuzz_decoder -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 -max_len=4200 \
	  -dict=tests/fuzz/wire.dict -artifact_prefix=$(BUILD_DIR)/fuzz-crashes/ $(BUILD_DIR)/fuzz-corpus tests/fuzz/corpus || rc=$$?; \
	for f in $(BUILD_DIR)/fuzz-crashes/*; do [ -f "$$f" ] || continue; \
	  cp "$$f" tests/fuzz/corpus/regress-$$(sha1sum "$$f" | cut -c1-16); \
	  echo "fuzz: $$f added to tests/fuzz/corpus as a regression input"; rc=1; done; \
	mkdir -p $(BUILD_DIR)/fuzz-corpus-ring $(BUILD_DIR)/fuzz-crashes-ring; \
	$(BUILD_DIR)/tests/fuzz/fuzz_ring -max_total_time=$(FUZZ_RING_SECONDS) -print_final_stats=1 -max_len=4200 \
	  -dict=tests/fuzz/wire.dict -artifact_prefix=$(BUILD_DIR)/fuzz-crashes-ring/ $(BUILD_DIR)/fuzz-corpus-ring \
	  tests/fuzz/corpus_ring || rc=$$?; \
	for f in $(BUILD_DIR)/fuzz-crashes-ring/*; do [ -f "$$f" ] || continue; \
	  cp "$$f" tests/fuzz/corpus_ring/regress-$$(sha1sum "$$f" | cut -c1-16); \
	  echo "fuzz: $$f added to tests/fuzz/corpus_ring as a regression input"; rc=1; done; \
	mkdir -p $(BUILD_DIR)/fuzz-corpus-conn $(BUILD_DIR)/fuzz-crashes-conn; \
	$(BUILD_DIR)/tests/fuzz/fuzz_conn -max_total_time=$(FUZZ_CONN_SECONDS) -print_final_stats=1 -max_len=600 -timeout=60 \
	  -artifact_prefix=$(BUILD_DIR)/fuzz-crashes-conn/ $(BUILD_DIR)/fuzz-corpus-conn tests/fuzz/corpus_conn || rc=$$?; \
	for f in $(BUILD_DIR)/fuzz-crashes-conn/*; do [ -f "$$f" ] || continue; \
	  cp "$$f" tests/fuzz/corpus_conn/regress-$$(sha1sum "$$f" | cut -c1-16); \
	  echo "fuzz: $$f added to tests/fuzz/corpus_conn as a regression input"; rc=1; done; \
	mkdir -p $(BUILD_DIR)/fuzz-corpus-sets $(BUILD_DIR)/fuzz-crashes-sets; \
	$(BUILD_DIR)/tests/fuzz/fuzz_sets -max_total_time=$(FUZZ_SETS_SECONDS) -print_final_stats=1 -max_len=600 -timeout=60 \
	  -artifact_prefix=$(BUILD_DIR)/fuzz-crashes-sets/ $(BUILD_DIR)/fuzz-corpus-sets tests/fuzz/corpus_sets || rc=$$?; \
	for f in $(BUILD_DIR)/fuzz-crashes-sets/*; do [ -f "$$f" ] || continue; \
	  cp "$$f" tests/fuzz/corpus_sets/regress-$$(sha1sum "$$f" | cut -c1-16); \
	  echo "fuzz: $$f added to tests/fuzz/corpus_sets as a regression input"; rc=1; done; exit $$rc

install: build
	cmake --install $(BUILD_DIR) --prefix $(PREFIX)

# The Python package, built and installed by pip (setup.py compiles the
# extension; the CMake build is not touched): into PYTHON's environment, by
# default the interpreter CMake built the package for, else python3.
# PYTHON=v/bin/python installs into a venv; PYTHON_SITE=DIR into a directory
# (pip --target); PIP_ARGS adds to pip's arguments. Debian's own interpreter
# refuses pip installs (externally managed): use a venv
# (python3 -m venv --system-site-packages v) for its torch.
PYTHON ?= $(shell cat $(BUILD_DIR)/python/interpreter 2>/dev/null || command -v python3)
install-python:
	@test -n "$(PYTHON)" || { echo "install-python: no python3 found; name one with PYTHON=/path/to/python3"; exit 1; }
	$(PYTHON) -m pip install --no-build-isolation --no-deps $(if $(PYTHON_SITE),--target $(PYTHON_SITE)) $(PIP_ARGS) . || \
	  { echo "install-python: pip could not install into $(PYTHON) (see above); a venv: python3 -m venv --system-site-packages v && make install-python PYTHON=v/bin/python"; exit 1; }
	@echo "installed: import tshare with $(PYTHON)$(if $(PYTHON_SITE), (PYTHONPATH=$(PYTHON_SITE)))"

clean:
	rm -rf $(BUILD_DIR) $(ASAN_BUILD_DIR) $(TSAN_BUILD_DIR) $(VALGRIND_BUILD_DIR)
