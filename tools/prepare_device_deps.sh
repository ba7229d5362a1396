#!/usr/bin/env bash
# Copies the build dependencies the GPU machine lacks (it has no package
# registry) into .deps/, which the device run carries: GoogleTest sources and
# the header-only CLI11 and nlohmann/json. Run here, on a Debian machine with
# googletest, libcli11-dev and nlohmann-json3-dev installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
deps="$root/.deps"
rm -rf "$deps"
mkdir -p "$deps/include"
cp -r /usr/src/googletest "$deps/googletest"
cp -r /usr/include/CLI "$deps/include/CLI"
cp -r /usr/include/nlohmann "$deps/include/nlohmann"
du -sh "$deps"
