#!/usr/bin/env bash
# Installs the Debian packages the build needs, only those missing (idempotent; root or sudo).
#   scripts/install_deps.sh [extra packages...]
set -euo pipefail
pkgs=(cmake g++ make libgtest-dev "$@")
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
# Debian's own python3 needs python3-venv for `python3 -m venv` (a pyenv or other build has it).
if command -v python3 >/dev/null && ! python3 -c "import venv, ensurepip" 2>/dev/null; then
  missing+=(python3-venv)
fi
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "installing: ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
