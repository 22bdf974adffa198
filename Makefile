# The two commands a new user runs:
#   make demo   build, then share tensors between a producer and two consumers
#   make test   build, then run every test (GPU tests skip without a GPU)
# More: make bench (tshare against the floor and torch.multiprocessing; BENCH_ARGS=--quick),
# make asan (tests under ASan+UBSan), make fuzz (libFuzzer on the decoder),
# make install PREFIX=..., make clean.

BUILD_DIR ?= build
ASAN_BUILD_DIR ?= build-asan
PREFIX ?= /usr/local
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
FUZZ_SECONDS ?= 60
# CI builds with -Werror; the exported flags never carry it.
CMAKE_FLAGS ?= $(if $(CI),-DTSHARE_WERROR=ON)

.PHONY: all deps build demo test bench asan fuzz install clean

all: build

deps:
	@./scripts/install-deps.sh

$(BUILD_DIR)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD_DIR) -DCMAKE_INSTALL_PREFIX=$(PREFIX) $(CMAKE_FLAGS)

build: deps $(BUILD_DIR)/CMakeCache.txt
	cmake --build $(BUILD_DIR) -j $(JOBS)

demo: build
	$(BUILD_DIR)/launcher/tshare-launch demo --tensors 8 --consumers 2

test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS)

bench: build
	$(BUILD_DIR)/bench/tshare-bench --out $(BUILD_DIR)/bench-results $(BENCH_ARGS)

asan: deps
	cmake -S . -B $(ASAN_BUILD_DIR) -DCMAKE_BUILD_TYPE=Debug -DTSHARE_SANITIZE=address,undefined $(CMAKE_FLAGS)
	cmake --build $(ASAN_BUILD_DIR) -j $(JOBS)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --test-dir $(ASAN_BUILD_DIR) --output-on-failure -j $(JOBS)

fuzz: build
	@test -x $(BUILD_DIR)/tests/fuzz/fuzz_decoder || { echo "make fuzz needs clang with its libFuzzer runtime (Debian: apt-get install clang); see the cmake output"; exit 1; }
	mkdir -p $(BUILD_DIR)/fuzz-corpus
	$(BUILD_DIR)/tests/fuzz/fuzz_decoder -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	  $(BUILD_DIR)/fuzz-corpus tests/fuzz/corpus

install: build
	cmake --install $(BUILD_DIR) --prefix $(PREFIX)

clean:
	rm -rf $(BUILD_DIR) $(ASAN_BUILD_DIR)
