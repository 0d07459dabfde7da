#!/usr/bin/env bash
# Prints the highest CPU kernel level (scalar, avx2, avx512, avx512_bf16) that this machine runs,
# from /proc/cpuinfo's flags (Linux lists only what the CPU has and the OS enables), as CMake's
# SCATTER_ADD_MAX_ISA names it: `make test` compiles its sanitizer, fuzz and CUDA host builds up
# to this level only.
set -euo pipefail
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2 || true) "
if [[ -z ${flags// /} ]]; then  # no flags to read: every level, as a build without the option
  echo avx512_bf16
  exit 0
fi
has() {
  local f
  for f in "$@"; do [[ $flags == *" $f "* ]] || return 1; done
}
if has avx512f avx512bw avx512vl avx512dq avx512_bf16 fma f16c popcnt; then
  echo avx512_bf16
elif has avx512f avx512bw avx512vl avx512dq fma f16c popcnt; then
  echo avx512
elif has avx2 fma f16c popcnt; then
  echo avx2
else
  echo scalar
fi
