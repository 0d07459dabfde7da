#!/usr/bin/env bash
# Uses scatter-add the four ways a C++ project can: the installed CMake package (find_package),
# add_subdirectory, FetchContent, and by hand with pkg-config. Each build of main.cpp must print
# expected.txt. The add_subdirectory and FetchContent builds run with GTest made unfindable, so a
# subproject that still looked for it fails here.
#   tests/cmake_consumer/run.sh [BUILD_DIR]     (BUILD_DIR: a configured and built checkout,
#                                                default .build/release; it is installed from)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
build=$(cd "${1:-$root/.build/release}" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/scatter-add-consumer.XXXXXX")
trap 'rm -rf "$work"' EXIT
jobs=${JOBS:-$(nproc)}

check() {  # check NAME EXECUTABLE
  local rc=0
  "$2" >"$work/out.txt" 2>&1 || rc=$?
  if [ $rc -ne 0 ]; then
    echo "cmake consumer ($1): $2 exited with $rc:" >&2
    cat "$work/out.txt" >&2
    exit 1
  fi
  if ! diff -u "$here/expected.txt" "$work/out.txt" >"$work/diff"; then
    echo "cmake consumer ($1): the output differs from tests/cmake_consumer/expected.txt:" >&2
    cat "$work/diff" >&2
    exit 1
  fi
  echo "cmake consumer ($1): ok"
}
# The two ways that compile the library's sources again build them unoptimised (-O0, no debug
# information): they check how CMake finds and builds it, and -O0 compiles its kernels in about a
# quarter of -O2's time.
configure_and_build() {  # configure_and_build NAME SOURCE_DIR cmake-args...
  local name=$1 src=$2
  shift 2
  cmake -S "$src" -B "$work/$name" "$@" >"$work/$name.log" 2>&1 ||
    { cat "$work/$name.log" >&2; exit 1; }
  cmake --build "$work/$name" -j "$jobs" >>"$work/$name.log" 2>&1 || { cat "$work/$name.log" >&2; exit 1; }
}

cmake --install "$build" --prefix "$work/prefix" >/dev/null
configure_and_build find_package "$here/find_package" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$work/prefix"
check "find_package, installed to a temporary prefix" "$work/find_package/consumer"

unoptimised=(-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-O0)
configure_and_build add_subdirectory "$here/add_subdirectory" "${unoptimised[@]}" -DSCATTER_ADD_SOURCE_DIR="$root" \
  -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON
check "add_subdirectory" "$work/add_subdirectory/consumer"

# This one also without the SIMD kernels (SCATTER_ADD_MAX_ISA=scalar): such a build must link and,
# by the summation contract, print the same bits.
configure_and_build fetchcontent "$here/fetchcontent" "${unoptimised[@]}" -DFETCHCONTENT_SOURCE_DIR_SCATTER_ADD="$root" \
  -DSCATTER_ADD_GIT_REPOSITORY="$root" -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON -DSCATTER_ADD_MAX_ISA=scalar
check "FetchContent, scalar kernels only" "$work/fetchcontent/consumer"

export PKG_CONFIG_PATH="$(dirname "$(find "$work/prefix" -name scatter_add.pc)")"
# shellcheck disable=SC2046  # pkg-config prints several flags
c++ -std=c++17 -O2 "$here/main.cpp" -o "$work/by_hand" $(pkg-config --cflags --libs scatter_add)
check "by hand: c++ main.cpp \$(pkg-config --cflags --libs scatter_add)" "$work/by_hand"
