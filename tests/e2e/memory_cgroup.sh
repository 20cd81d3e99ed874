#!/usr/bin/env bash
# A job in a memory cgroup of its own (a container's limit, a Slurm job's): the pre-launch
# check measures against the cgroup's limit, not the host's MemAvailable, and a worker the
# kernel's OOM killer ends is said to have run out of memory, not just "killed by SIGKILL".
# A real cgroup (v1 or v2) made under this process's own; 77 = SKIP where none can be made
# (not root, a read-only /sys/fs/cgroup, v2 without the memory controller for children).
source "$(dirname "$0")/lib.sh"

[ "$(id -u)" = 0 ] || { echo "SKIP: needs root to make a memory cgroup"; exit 77; }
CG=""
if [ -d /sys/fs/cgroup/memory ] && grep -qE '^[0-9]+:([^:]*,)?memory(,[^:]*)?:' /proc/self/cgroup; then
  own="$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' /proc/self/cgroup)"
  base="/sys/fs/cgroup/memory$own"
  [ -d "$base" ] || base=/sys/fs/cgroup/memory
  CG="$base/dtrain-e2e-$$"
  mkdir "$CG" 2>/dev/null || CG=""
  if [ -n "$CG" ]; then
    echo $((256 << 20)) >"$CG/memory.limit_in_bytes" || CG=""
    # (no swapping instead of the OOM killer where swap is accounted)
    [ -n "$CG" ] && [ -e "$CG/memory.memsw.limit_in_bytes" ] && echo $((256 << 20)) >"$CG/memory.memsw.limit_in_bytes"
  fi
elif [ -e /sys/fs/cgroup/cgroup.controllers ]; then
  own="$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup)"
  base="/sys/fs/cgroup$own"
  grep -qw memory "$base/cgroup.subtree_control" 2>/dev/null || echo +memory >"$base/cgroup.subtree_control" 2>/dev/null
  if grep -qw memory "$base/cgroup.subtree_control" 2>/dev/null && mkdir "$base/dtrain-e2e-$$" 2>/dev/null; then
    CG="$base/dtrain-e2e-$$"
    echo $((256 << 20)) >"$CG/memory.max" || CG=""
    [ -n "$CG" ] && [ -e "$CG/memory.swap.max" ] && echo 0 >"$CG/memory.swap.max"
  fi
fi
if [ -z "$CG" ]; then
  [ -d "${base:-}/dtrain-e2e-$$" ] && rmdir "$base/dtrain-e2e-$$"
  echo "SKIP: no memory cgroup can be made here"
  exit 77
fi
use_cgroup

# A job that fits the host (GiBs free) but not the cgroup's 256 MiB: refused before the launch,
# naming the limit that binds.
cat >"$T/big.json" <<'JSON'
{"nproc_per_node": 1, "env": {"OMP_NUM_THREADS": "1"}, "trainer": {"model": {"layers": [784, 4096, 4096, 10]},
 "data": {"type": "synthetic", "train_samples": 1000}, "batch_size": 8, "max_steps": 2, "device": "cpu"}}
JSON
in_cgroup "$DTRAIN" run "$T/big.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "over the cgroup's limit: exit 2"
expect_grep "^dtrain: error: $T/big.json: /trainer/model/layers: this job needs about [0-9]+ MiB of memory on this host \(.*\), more than the [0-9]+ MiB available under the memory limit of 256 MiB of this process's cgroup \($CG\); use smaller layers" "$T/err" "over the cgroup's limit: the limit named, not MemAvailable"
grep -q "^\[rank" "$T/err" && fail "over the cgroup's limit: a worker started" || pass "over the cgroup's limit: no worker started"
"$DTRAIN" run "$T/big.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "the same job outside the cgroup runs"
# validate, in the cgroup, warns with the same numbers (exit 0).
in_cgroup "$DTRAIN" validate "$T/big.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "validate in the cgroup: exit 0"
expect_grep "^dtrain: warning: .*available under the memory limit of 256 MiB of this process's cgroup" "$T/err" "validate in the cgroup: the limit named"

# A worker over the limit is ended by the kernel's OOM killer (SIGKILL): said as such, in the
# failure and the summary, not a bare "killed by SIGKILL".
cat >"$T/hog.json" <<JSON
{"nproc_per_node": 1, "max_restarts": 0, "command": ["python3", "-c", "b = bytearray(b'x') * (600 << 20); print(len(b))"]}
JSON
in_cgroup "$DTRAIN" run "$T/hog.json" --summary-json "$T/s.json" >"$T/out" 2>"$T/err"; rc=$?
[ "$rc" -ne 0 ] && pass "OOM-killed worker: the job fails ($rc)" || fail "OOM-killed worker: the job succeeded"
expect_grep "rank 0 killed by SIGKILL \(the kernel's OOM killer: dtrain's cgroup reached its memory limit of 256 MiB\)" "$T/err" "OOM-killed worker: the OOM killer named"
python3 -c "import json,sys; e=json.load(open(sys.argv[1]))['error']; sys.exit(0 if 'OOM killer' in e else 1)" "$T/s.json" \
  && pass "OOM-killed worker: the summary's error names it" || fail "OOM-killed worker: summary error: $(cat "$T/s.json")"
# A SIGKILL from someone else (no OOM kill meanwhile) is not blamed on memory.
cat >"$T/killed.json" <<'JSON'
{"nproc_per_node": 1, "max_restarts": 0, "command": ["sh", "-c", "kill -9 $$"]}
JSON
in_cgroup "$DTRAIN" run "$T/killed.json" >"$T/out" 2>"$T/err"
grep -q "OOM killer" "$T/err" && fail "a plain SIGKILL blamed on memory: $(grep 'OOM' "$T/err")" || pass "a plain SIGKILL is not blamed on memory"
expect_grep "rank 0 killed by SIGKILL" "$T/err" "a plain SIGKILL: said"
finish
