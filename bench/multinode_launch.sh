#!/usr/bin/env bash
# Multi-node launch overhead on the netns test bed (scripts/testbed, needs root): wall time
# until 3 hosts x 2 workers running `true` have all finished, dtrain (one command, ssh to each
# host, pre-flight included) vs torchrun the way users run it across hosts: one
# `torchrun --nnodes 3 --rdzv_backend c10d` per host, started over ssh in parallel.
# Interleaved runs; prints medians and the ratio.
# Usage: bench/multinode_launch.sh [runs]   (needs build/bin/dtrain and python3-torch)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${1:-5}"
DTRAIN="$PWD/build/bin/dtrain"
[ -x "$DTRAIN" ] || { echo "build first: scripts/build.sh" >&2; exit 2; }
trap 'scripts/testbed/testbed.sh down >/dev/null 2>&1' EXIT
scripts/testbed/testbed.sh up 3 >/dev/null
source /tmp/dtrain-testbed/env
T=$(mktemp -d)
printf 'h1 slots=2\nh2 slots=2\nh3 slots=2\n' > "$T/hosts"
cat > "$T/job.json" <<JSON
{"name": "bench", "command": ["true"], "hostfile": "$T/hosts", "ssh": {"options": ["-F", "$TESTBED_SSH_CONFIG"]}}
JSON
# torchrun looks its host name up; the test bed's names live only in ssh_config, so each
# torchrun gets an /etc/hosts that knows them (a private mount, nothing changes outside).
{ echo "127.0.0.1 localhost"; for h in h1 h2 h3; do v="TESTBED_ADDR_$h"; echo "${!v} $h"; done; } > "$T/etc_hosts"
now() { date +%s%N; }
torchrun_all() {
  local port=$((29500 + RANDOM % 1000)) pids=() h
  for h in h1 h2 h3; do
    ssh -F "$TESTBED_SSH_CONFIG" "$h" "OMP_NUM_THREADS=1 unshare -m sh -c 'mount --bind $T/etc_hosts /etc/hosts; exec \"\$0\" \"\$@\"' /usr/bin/python3 -m torch.distributed.run --redirects 9:1 --tee 9:1 \
      --nnodes 3 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint $TESTBED_ADDR_h1:$port --rdzv_id bench$port \
      --no_python true" >/dev/null 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || return 1; done
}
d=(); t=()
for i in $(seq "$RUNS"); do
  s=$(now); "$DTRAIN" run "$T/job.json" >/dev/null 2>&1; d+=($(( $(now) - s )))
  s=$(now); torchrun_all; t+=($(( $(now) - s )))
done
python3 bench/compare_medians.py "${d[*]}" "${t[*]}"
rm -rf "$T"
