#!/usr/bin/env bash
# Stops `make test` before it starts when the disk cannot hold what it installs and builds, with
# the numbers, instead of a "No space left on device" from a linker or pip minutes later.
#   scripts/check_disk.sh
# What it counts (MB), from df sampled every 5 s through a `make test` of a clean clone, whose
# peak was 6.5 GB: the C++ builds and hub packages under .build (360) and what the tests write
# to /tmp and pip unpacks (the rest of the peak), .venv (torch 2.13 CPU and the test
# requirements, 1320) unless installed, .venv-cuda (torch with CUDA and its nvidia-* packages as
# the Makefile trims them, 4100) unless installed.
set -euo pipefail
cd "$(dirname "$0")/.."
need=1000
[ -f .venv/.installed ] || need=$((need + 1500))
[ -f .venv-cuda/.installed ] || need=$((need + 4500))
read -r avail mount < <(df -Pm . | awk 'NR == 2 {print $4, $6}')
if [ "$avail" -lt "$need" ]; then
  echo "make test needs about $need MB of free disk here; $mount has $avail MB free. Free some space and run it again." >&2
  exit 1
fi
