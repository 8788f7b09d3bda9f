# The two commands of the README:
#   make test   builds everything and runs the C suite and the Python tests
#   make demo   builds and runs `smelt demo`
# Both install what is missing first (scripts/setup-deps). On a machine with a
# GPU the same suite also runs every GPU case.
BUILD ?= build
ASAN_BUILD ?= build-asan
TSAN_BUILD ?= build-tsan
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
# Kernels compiled by the tests land here, not in the user's cache.
export SMELT_TEST_CACHE_DIR ?= $(abspath $(BUILD))/kernel-cache
PYTHON ?= python3

.PHONY: all build deps test test-c test-python demo asan tsan fuzz clean

all: build

deps:
	@PYTHON=$(PYTHON) scripts/setup-deps

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

test: deps build
	@$(MAKE) --no-print-directory test-c test-python

# The compile test must not skip: NVRTC is required, named explicitly where
# only $(PYTHON)'s nvidia-cuda-nvrtc wheel provides it (scripts/setup-deps).
test-c:
	SMELT_NVRTC_PATH="$$(PYTHON=$(PYTHON) scripts/setup-deps --nvrtc-path)" SMELT_REQUIRE_NVRTC=1 \
	  SMELT_CACHE_DIR=$(SMELT_TEST_CACHE_DIR) $(BUILD)/smelt_tests

test-python:
	$(PYTHON) python/build_inplace.py --lib $(BUILD)
	SMELT_CACHE_DIR=$(SMELT_TEST_CACHE_DIR) PYTHONPATH=$(abspath python) $(PYTHON) -m pytest -q python/tests

demo: deps build
	$(BUILD)/smelt demo

# The CPU suite under AddressSanitizer + UBSan (CI runs this).
asan:
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DSMELT_SANITIZE=ON
	cmake --build $(ASAN_BUILD) -j $(JOBS) --target smelt_tests
	SMELT_TEST_NO_CUDA=1 SMELT_CACHE_DIR=$(abspath $(ASAN_BUILD))/kernel-cache \
	  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  LSAN_OPTIONS=suppressions=$(abspath scripts/lsan.supp) \
	  $(ASAN_BUILD)/smelt_tests --exclude compile/

# The threads suite, and the core and cache suites (the cache's concurrent
# compiles), under ThreadSanitizer; the first report fails it (CI runs this).
TSAN_RUN = SMELT_TEST_NO_CUDA=1 SMELT_CACHE_DIR=$(abspath $(TSAN_BUILD))/kernel-cache \
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 $(TSAN_BUILD)/smelt_tests
tsan:
	cmake -S . -B $(TSAN_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSMELT_TSAN=ON
	cmake --build $(TSAN_BUILD) -j $(JOBS) --target smelt_tests
	$(TSAN_RUN) threads/
	$(TSAN_RUN) core/
	$(TSAN_RUN) cache/

# The libFuzzer target (fuzz/) under ASan + UBSan for FUZZ_SECONDS seconds,
# starting from a scratch copy of fuzz/corpus; needs clang with libFuzzer.
# Fails on any report, or when fewer than FUZZ_MIN_CALLS calls were made (CI
# runs this). The log is $(FUZZ_BUILD)/fuzz.log; findings land beside it.
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 180
FUZZ_MIN_CALLS ?= 1000000
fuzz:
	cmake -S . -B $(FUZZ_BUILD) -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSMELT_FUZZ=ON
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target smelt_fuzz
	rm -rf $(FUZZ_BUILD)/corpus && cp -r fuzz/corpus $(FUZZ_BUILD)/corpus
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  SMELT_FUZZ_MIN_CALLS=$(FUZZ_MIN_CALLS) $(FUZZ_BUILD)/smelt_fuzz $(FUZZ_BUILD)/corpus \
	  -max_total_time=$(FUZZ_SECONDS) -runs=1000000000 -max_len=512 -timeout=10 -print_final_stats=1 \
	  -artifact_prefix=$(abspath $(FUZZ_BUILD))/ > $(FUZZ_BUILD)/fuzz.log 2>&1 \
	  || { grep -v -E '(NEW|REDUCE|pulse) ' $(FUZZ_BUILD)/fuzz.log | tail -n 150; exit 1; }
	@grep -E '^(Done|stat::|smelt_fuzz)' $(FUZZ_BUILD)/fuzz.log

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) $(FUZZ_BUILD)
