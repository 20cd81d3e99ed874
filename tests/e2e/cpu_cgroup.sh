#!/usr/bin/env bash
# A job in a cgroup with a CPU quota (`docker --cpus`, a Kubernetes CPU limit) on a host
# whose affinity mask shows more CPUs: dtrain sizes by the quota, not the mask.
# - nproc_per_node "auto" starts one worker per CPU of the quota (validate says why);
# - one worker gets OMP_NUM_THREADS = the quota's CPUs, with a notice;
# - the trainer's "auto" prefetch counts the quota's CPUs for its spare core.
# A real cgroup (v1 or v2) made under this process's own, with a quota of 1 CPU; 77 = SKIP
# where none can be made (not root, a read-only /sys/fs/cgroup, v2 without the cpu
# controller for children) or where this machine has only one CPU (no quota below it).
source "$(dirname "$0")/lib.sh"
unset OMP_NUM_THREADS OPENBLAS_NUM_THREADS

[ "$(id -u)" = 0 ] || { echo "SKIP: needs root to make a cpu cgroup"; exit 77; }
CPUS="$(nproc)"
[ "$CPUS" -ge 2 ] || { echo "SKIP: one CPU here: a quota of 1 CPU binds nothing"; exit 77; }
CG=""
v1dir="$(awk '$5 ~ /^\/sys\/fs\/cgroup\// && $0 ~ / - cgroup cgroup / && $NF ~ /(^|,)cpu(,|$)/ {print $5; exit}' /proc/self/mountinfo)"
if [ -n "$v1dir" ] && grep -qE '^[0-9]+:([^:]*,)?cpu(,[^:]*)?:' /proc/self/cgroup; then
  own="$(awk -F: '$2 ~ /(^|,)cpu(,|$)/ {print $3}' /proc/self/cgroup)"
  base="$v1dir${own%/}"
  [ -d "$base" ] || base="$v1dir"
  if mkdir "$base/dtrain-e2e-$$" 2>/dev/null; then
    CG="$base/dtrain-e2e-$$"
    { echo 100000 >"$CG/cpu.cfs_period_us" && echo 100000 >"$CG/cpu.cfs_quota_us"; } || CG=""
  fi
elif [ -e /sys/fs/cgroup/cgroup.controllers ]; then
  own="$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup)"
  base="/sys/fs/cgroup${own%/}"
  grep -qw cpu "$base/cgroup.subtree_control" 2>/dev/null || echo +cpu >"$base/cgroup.subtree_control" 2>/dev/null
  if grep -qw cpu "$base/cgroup.subtree_control" 2>/dev/null && mkdir "$base/dtrain-e2e-$$" 2>/dev/null; then
    CG="$base/dtrain-e2e-$$"
    echo "100000 100000" >"$CG/cpu.max" || CG=""
  fi
fi
if [ -z "$CG" ]; then
  [ -d "${base:-/nonexistent}/dtrain-e2e-$$" ] && rmdir "$base/dtrain-e2e-$$"
  echo "SKIP: no cpu cgroup with a quota can be made here"
  exit 77
fi
use_cgroup
# No GPU counted: "auto" would be one per GPU.
export CUDA_VISIBLE_DEVICES=

# nproc_per_node "auto": the quota's 1 CPU in the cgroup, the affinity's CPUs outside it.
cat >"$T/auto.json" <<'JSON'
{"nproc_per_node": "auto", "command": ["sh", "-c", "echo world=$WORLD_SIZE omp=${OMP_NUM_THREADS:-unset}"]}
JSON
in_cgroup "$DTRAIN" validate "$T/auto.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "validate in the cgroup: exit 0"
expect_grep "^nproc_per_node: +1 \(auto: 1 CPU \(the CPU quota of 1 CPU of this process's cgroup $CG, of $CPUS in its affinity mask\)\)$" "$T/out" \
  "validate in the cgroup: auto is the quota's 1 CPU, and says why"
# Outside: what this runner is given (a CI container may have a quota of its own: then the
# outside checks, which expect none, are skipped).
"$DTRAIN" validate "$T/auto.json" >"$T/out" 2>"$T/err"
OUTSIDE=1
if grep -q "^nproc_per_node: .*(auto: " "$T/out"; then
  OUTSIDE=0
  echo "note: this runner has a CPU quota of its own: $(grep '^nproc_per_node' "$T/out"); outside checks skipped"
else
  expect_grep "^nproc_per_node: +$CPUS \(auto\)$" "$T/out" "validate outside: auto is the affinity's $CPUS"
fi
in_cgroup "$DTRAIN" run "$T/auto.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "run auto in the cgroup: exit 0"
expect_grep "world=1 omp=1$" "$T/out" "run auto in the cgroup: one worker, OMP_NUM_THREADS=1"
expect_eq "$(grep -c 'world=' "$T/out")" 1 "run auto in the cgroup: exactly one worker started"
expect_grep "^dtrain: setting OMP_NUM_THREADS=1 for the worker: this process may use 1 CPU \(the CPU quota of 1 CPU of this process's cgroup $CG, of $CPUS in its affinity mask\)" \
  "$T/err" "run in the cgroup: the notice names the quota"

# A multi-node spec: "auto" is each host's own count, not the launcher's quota.
cat >"$T/hosts.json" <<'JSON'
{"nproc_per_node": "auto", "nodes": [{"host": "hosta"}, {"host": "hostb"}], "command": ["true"]}
JSON
in_cgroup "$DTRAIN" validate "$T/hosts.json" >"$T/out" 2>"$T/err"
expect_grep "^nproc_per_node: +auto \(counted on each host: its GPUs, else its usable CPUs\)$" "$T/out" \
  "validate of hosts in the cgroup: auto is counted on each host, not by this host's quota"

# One worker outside the cgroup: OMP_NUM_THREADS left unset, no notice; the user's value wins inside.
cat >"$T/one.json" <<'JSON'
{"nproc_per_node": 1, "command": ["sh", "-c", "echo omp=${OMP_NUM_THREADS:-unset}"]}
JSON
if [ "$OUTSIDE" = 1 ]; then
  "$DTRAIN" run "$T/one.json" >"$T/out" 2>"$T/err"
  expect_grep "omp=unset$" "$T/out" "one worker outside: OMP_NUM_THREADS unset"
  grep -q "setting OMP_NUM_THREADS" "$T/err" && fail "one worker outside: a notice: $(cat "$T/err")" || pass "one worker outside: no notice"
fi
in_cgroup "$DTRAIN" run "$T/one.json" --env OMP_NUM_THREADS=3 >"$T/out" 2>"$T/err"
expect_grep "omp=3$" "$T/out" "in the cgroup with --env OMP_NUM_THREADS=3: the user's value"
grep -q "setting OMP_NUM_THREADS" "$T/err" && fail "user's value: a notice anyway" || pass "user's value: no notice"

# A quota that changes between attempts (the worker of attempt 0 raises it to 2 CPUs, then
# fails): the restart's default is said again, not changed silently.
if [ -e "$CG/cpu.cfs_quota_us" ]; then raise="echo 200000 >$CG/cpu.cfs_quota_us"; else raise="echo '200000 100000' >$CG/cpu.max"; fi
cat >"$T/requota.json" <<JSON
{"nproc_per_node": 1, "max_restarts": 1, "command": ["sh", "-c",
  "echo attempt=\$TORCHELASTIC_RESTART_COUNT omp=\${OMP_NUM_THREADS:-unset}; [ \$TORCHELASTIC_RESTART_COUNT = 0 ] && { $raise; exit 1; }; exit 0"]}
JSON
in_cgroup "$DTRAIN" run "$T/requota.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "quota raised between attempts: exit 0"
expect_grep "attempt=0 omp=1$" "$T/out" "quota raised: attempt 0 under 1 CPU"
if [ "$CPUS" -gt 2 ]; then
  expect_grep "attempt=1 omp=2$" "$T/out" "quota raised: attempt 1 under 2 CPUs"
  expect_grep "^dtrain: restart 1: setting OMP_NUM_THREADS=2 for the worker \(it was 1\): this process may use 2 CPUs" "$T/err" "quota raised: said"
else
  expect_grep "attempt=1 omp=unset$" "$T/out" "quota raised to all $CPUS CPUs: attempt 1 unset"
  expect_grep "^dtrain: restart 1: OMP_NUM_THREADS is no longer set for the worker \(it was 1\): this process may use $CPUS CPUs" "$T/err" "quota raised: said"
fi
if [ -e "$CG/cpu.cfs_quota_us" ]; then echo 100000 >"$CG/cpu.cfs_quota_us"; else echo "100000 100000" >"$CG/cpu.max"; fi

# The trainer's "auto" prefetch: one worker with one BLAS thread has a spare core among the
# affinity's CPUs, none under a quota of 1 CPU.
cat >"$T/train.json" <<'JSON'
{"nproc_per_node": 1, "env": {"OMP_NUM_THREADS": "1"}, "trainer": {"model": {"layers": [8, 16, 2]},
 "data": {"type": "synthetic", "train_samples": 256}, "batch_size": 16, "max_steps": 3, "device": "cpu"}}
JSON
if [ "$OUTSIDE" = 1 ]; then
  "$DTRAIN" run "$T/train.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "trainer outside: exit 0"
  expect_grep "batches prefetched" "$T/out" "trainer outside: a spare core, batches prefetched"
fi
in_cgroup "$DTRAIN" run "$T/train.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "trainer in the cgroup: exit 0"
expect_grep "batches loaded inline" "$T/out" "trainer in the cgroup: no spare core under the quota, batches loaded inline"
# The BLAS threads the start line shows: one worker's OpenBLAS under the quota computes on its
# 1 CPU, through dtrain run (OMP_NUM_THREADS) and by hand (`dtrain train` caps it itself).
cat >"$T/blas.json" <<'JSON'
{"nproc_per_node": 1, "trainer": {"model": {"layers": [8, 16, 2]},
 "data": {"type": "synthetic", "train_samples": 256}, "batch_size": 16, "max_steps": 3, "device": "cpu"}}
JSON
in_cgroup "$DTRAIN" run "$T/blas.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "one CPU worker in the cgroup: exit 0"
expect_grep "math on cpu \(OpenBLAS, 1 thread\)," "$T/out" "one CPU worker in the cgroup: OpenBLAS on 1 thread"
in_cgroup "$DTRAIN" train "$T/blas.json" >"$T/out" 2>&1; expect_eq "$?" 0 "dtrain train by hand in the cgroup: exit 0"
expect_grep "math on cpu \(OpenBLAS, 1 thread\)," "$T/out" "dtrain train by hand in the cgroup: OpenBLAS capped at the quota's 1 CPU"
if [ "$OUTSIDE" = 1 ]; then
  "$DTRAIN" train "$T/blas.json" >"$T/out" 2>&1
  expect_grep "math on cpu \(OpenBLAS, ([2-9]|[1-9][0-9]+) threads\)," "$T/out" "dtrain train by hand outside: OpenBLAS on every CPU"
fi
finish
