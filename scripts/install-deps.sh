#!/usr/bin/env bash
# Installs the Debian packages kvsnap builds against, only those that are missing.
# Safe to run repeatedly; does nothing (and needs no root) when all are present.
set -euo pipefail

packages=(
  cmake ninja-build g++ make pkg-config lld
  libgtest-dev libgmock-dev libbenchmark-dev
  libfmt-dev nlohmann-json3-dev libcli11-dev libopenblas-dev libxxhash-dev
  clang libclang-rt-dev clang-format python3
  libdlpack-dev python3-dev python3-numpy python3-pytest pybind11-dev
  libhiredis-dev libsodium-dev redis-server
  golang-go
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "install-deps: installing packages needs root: run this as root, or install sudo" >&2
    exit 1
  fi
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
