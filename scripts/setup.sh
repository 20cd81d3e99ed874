#!/usr/bin/env bash
# Installs dtrain's build and test dependencies from Debian's packages. Idempotent,
# non-interactive; needs root (or sudo). Skips apt entirely when everything is present.
# Usage: scripts/setup.sh [--bench]
set -euo pipefail
pkgs=(cmake g++ make libcli11-dev libboost-dev nlohmann-json3-dev libfmt-dev libgtest-dev
      libssl-dev libopenblas-dev python3-torch procps openssh-server openssh-client iproute2)
# Peers for the side-by-side benchmarks (bench/allreduce_peers.sh): only with --bench.
[ "${1:-}" = "--bench" ] && pkgs+=(openmpi-bin libopenmpi-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all dependencies present"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
