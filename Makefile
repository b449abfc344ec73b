# Thin wrapper over the CMake presets (see CMakePresets.json).
#   make demo   installs what is missing, builds, runs the main job on its embedded default
#   make test   builds and runs every test (dev preset)
#   make asan   builds and runs the tests under AddressSanitizer + UBSan
.PHONY: all deps build release demo test asan format clean

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

format:
	clang-format -i $$(git ls-files '*.h' '*.cc')

clean:
	rm -rf build
