#!/usr/bin/env bash
# Sets up (if needed), builds, and runs the main job: configs/quickstart.json unless a
# spec is given.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
exec build/bin/dtrain run "${1:-configs/quickstart.json}" "${@:2}"
