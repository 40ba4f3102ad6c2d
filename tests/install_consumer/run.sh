#!/usr/bin/env bash
# ctest Install.Consumer: installs a build of fp4moe into a fresh prefix (`cmake --install`), then
# configures, builds and runs tests/install_consumer against it through find_package(fp4moe), with the
# build's compiler and flags (a sanitizer build's library needs its flags at the consumer's link).
#   run.sh CMAKE BUILD_DIR WORK_DIR CXX_COMPILER CXX_FLAGS EXE_LINKER_FLAGS BUILD_TYPE
set -euo pipefail
cmake="$1" build="$2" work="$3" cxx="$4" cxx_flags="$5" linker_flags="$6" build_type="$7"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
rm -rf "$work"
mkdir -p "$work"
"$cmake" --install "$build" --prefix "$work/prefix" > "$work/install.log"
"$cmake" -S "$here" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE="$build_type" \
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_CXX_FLAGS="$cxx_flags" -DCMAKE_EXE_LINKER_FLAGS="$linker_flags" > "$work/configure.log"
"$cmake" --build "$work/build" > "$work/build.log"
"$work/build/consumer"
