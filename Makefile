# Thin wrapper over the CMake presets (see CMakePresets.json).
#   make demo   installs what is missing, builds, runs the main job on its embedded default
#   make test   builds and runs every test (dev preset)
#   make asan   builds and runs the tests under AddressSanitizer + UBSan
#   make tsan   builds and runs the concurrency tests under ThreadSanitizer
#   make python builds the Python module for Debian's python3; python-install installs it
.PHONY: all deps build release demo test asan tsan fuzz bench format clean python python-install

JOBS ?= $(shell nproc)

all: build

deps:
	@bash scripts/install-deps.sh

build: deps
	cmake --preset dev
	cmake --build --preset dev -j $(JOBS)

release: deps
	cmake --preset release
	cmake --build --preset release -j $(JOBS)

demo: release
	./build/release/tools/kvsnap replay --chart replay.svg

test: build
	ctest --preset dev

asan: deps
	cmake --preset asan
	cmake --build --preset asan -j $(JOBS)
	ctest --preset asan

# The concurrency tests (tests/CMakeLists.txt: tsan_test, c_api_threads) under ThreadSanitizer.
tsan: deps
	cmake --preset tsan
	cmake --build --preset tsan -j $(JOBS)
	ctest --preset tsan

# Runs the snapshot-loader fuzzer for FUZZ_SECONDS (default 60) from a valid seed file.
FUZZ_SECONDS ?= 60
fuzz: deps
	cmake --preset fuzz
	cmake --build --preset fuzz -j $(JOBS)
	mkdir -p build/fuzz/corpus
	KVSNAP_FUZZ_SEED=build/fuzz/corpus ./build/fuzz/fuzz_snapshot_loader
	./build/fuzz/fuzz_snapshot_loader -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=4096 \
	    -max_len=65536 -timeout=10 build/fuzz/corpus

# The Python module, for an interpreter named explicitly (not the first python3 on PATH):
# build/release/python/kvsnap*.so; python-install puts it, its stub and libkvsnap into that
# interpreter's user site-packages, so `import kvsnap` works anywhere.
PYTHON ?= /usr/bin/python3
python: deps
	cmake --preset release -DKVSNAP_PYTHON=$(PYTHON)
	cmake --build --preset release -j $(JOBS) --target kvsnap_python

python-install: python
	cmake --install build/release --component python --prefix "$$($(PYTHON) -m site --user-site)"

bench: release
	./build/release/tools/kvsnap bench

format: deps
	clang-format -i $$(git ls-files '*.h' '*.cc')

clean:
	rm -rf build
