# dtrain killed with SIGKILL leaves no worker alive.
source "$(dirname "$0")/lib.sh"
D="$T" "$DTRAIN" run --nproc-per-node 3 -- sh -c 'echo "$TORCHELASTIC_ERROR_FILE" > "$D/ef.$RANK"; echo $$ > "$D/pid.$RANK"; exec sleep 120' >/dev/null 2>&1 &
DTRAIN_PID=$!
wait_for "$T/pid.0" "$T/pid.1" "$T/pid.2"
kill -9 "$DTRAIN_PID"; wait "$DTRAIN_PID" 2>/dev/null
DTRAIN_PID=
sleep 0.5
for r in 0 1 2; do
  p=$(cat "$T/pid.$r")
  # Up to 10 s: on a machine loaded 5x over its cores a killed process may wait that long for a CPU.
  for _ in $(seq 100); do alive "$p" || break; sleep 0.1; done
  alive "$p" && { fail "rank $r (pid $p) outlived dtrain"; kill -9 "$p"; } || pass "rank $r gone"
done
# The error files' temp dir (<tmp>/dtrain-err-<run id>-<place>-<pid>-XXXXXX/attempt_0/<rank>/error.json)
# goes with them.
errroot=$(dirname "$(dirname "$(dirname "$(cat "$T/ef.0")")")")
case $errroot in */dtrain-err-[0-9a-f]*-*.*-[0-9]*-??????) pass "error-file dir is dtrain's own ($errroot)" ;; *) fail "unexpected error-file dir '$errroot'" ;; esac
for _ in $(seq 100); do [ -e "$errroot" ] || break; sleep 0.1; done
[ ! -e "$errroot" ] && pass "error-file temp dir removed after SIGKILL" || fail "error-file temp dir $errroot left behind"

# What the workers started goes too: a wrapper script's child (a shell running python, a
# DataLoader's processes) is not reached by the worker's own death signal; dtrain's guard
# process kills each worker's whole process group when dtrain dies. Single node, and
# across (local) nodes, where each node's agent dies with dtrain.
# (--nproc-per-node only for the single node: the hosts' own slots say 1 each.)
for hosts in "" "--hosts localhost:1,127.0.0.1:1"; do
  rm -f "$T"/gpid.*
  D="$T" "$DTRAIN" run $([ -z "$hosts" ] && echo --nproc-per-node 2) $hosts -- sh -c 'sleep 120 & echo $! > "$D/gpid.$RANK"; wait' >/dev/null 2>&1 &
  DTRAIN_PID=$!
  wait_for "$T/gpid.0" "$T/gpid.1"
  kill -9 "$DTRAIN_PID"; wait "$DTRAIN_PID" 2>/dev/null
  DTRAIN_PID=
  for r in 0 1; do
    p=$(cat "$T/gpid.$r")
    for _ in $(seq 100); do alive "$p" || break; sleep 0.1; done
    alive "$p" && { fail "${hosts:-local}: rank $r's child (pid $p) outlived dtrain"; kill -9 "$p"; } || pass "${hosts:-local}: rank $r's child gone"
  done
done
# A worker that exits 0 may leave work of its own running on purpose (an upload started
# with Popen): it is not killed, neither when the worker exits while others still run nor at
# the job's end (torchrun leaves it too). A worker that fails takes its process group along.
rm -f "$T"/late.*
D="$T" "$DTRAIN" run --nproc-per-node 2 -- sh -c '
  if [ "$RANK" = 0 ]; then (sleep 1; touch "$D/late.0") >/dev/null 2>&1 & exit 0; fi
  sleep 2; (sleep 1; touch "$D/late.1") >/dev/null 2>&1 & exit 0' >"$T/out" 2>&1
expect_eq "$?" 0 "background work of a successful worker: job succeeds"
for _ in $(seq 50); do [ -e "$T/late.0" ] && [ -e "$T/late.1" ] && break; sleep 0.1; done
[ -e "$T/late.0" ] && pass "background work of a worker that exited 0 while its peer ran: finished" || fail "rank 0's background work was killed"
[ -e "$T/late.1" ] && pass "background work of the last worker to exit 0: finished after the job" || fail "rank 1's background work was killed"
D="$T" "$DTRAIN" run --nproc-per-node 1 -- sh -c '(sleep 1; touch "$D/late.f") >/dev/null 2>&1 & exit 3' >"$T/out" 2>&1
expect_eq "$?" 3 "background work of a failed worker: the worker's code"
sleep 1.5
[ ! -e "$T/late.f" ] && pass "background work of a failed worker: killed with it" || fail "a failed worker's background work ran on"

# The trainer's private files (the spec snapshot, which may carry an env_file's secrets, and
# the result file) go too: removed by the guard when dtrain is SIGKILLed.
cat >"$T/tr.json" <<'JSON'
{"nproc_per_node": 2, "env": {"OMP_NUM_THREADS": "1"}, "trainer": {"model": {"layers": [32, 64, 4]},
 "data": {"type": "synthetic", "train_samples": 2000000, "eval_samples": 100}, "batch_size": 32, "epochs": 1}}
JSON
"$DTRAIN" run "$T/tr.json" >"$T/tr.out" 2>&1 &
DTRAIN_PID=$!
for _ in $(seq 100); do grep -q "step" "$T/tr.out" && break; sleep 0.1; done
snap=$(ps -o args= --ppid "$DTRAIN_PID" | awk '$2 == "train" {print $3; exit}')
[ -n "$snap" ] && [ -e "$snap" ] && pass "trainer snapshot exists while it runs ($snap)" || fail "no trainer snapshot found: '$snap'"
# (in a directory of the run's own that only its user may enter: at a name in /tmp that any
# user could read in ps, another user could plant a link or a file first; security audit)
[ -n "$snap" ] && [ "$(stat -c %a "$(dirname "$snap")")" = 700 ] && [ -e "$(dirname "$snap")/result.json" -o "$(basename "$snap")" = spec.json ] &&
  pass "trainer snapshot: in a 0700 directory of the run's own" || fail "trainer snapshot directory: $(ls -ld "$(dirname "$snap")")"
kill -9 "$DTRAIN_PID"; wait "$DTRAIN_PID" 2>/dev/null
DTRAIN_PID=
for _ in $(seq 100); do [ -e "$snap" ] || break; sleep 0.1; done
[ -n "$snap" ] && [ ! -e "$snap" ] && pass "trainer snapshot removed after SIGKILL" || fail "trainer snapshot $snap left behind"
# Across nodes, each agent writes its own private snapshot of the spec (env, maybe secrets).
# An agent killed before its workers start (here while its report of the round is held back:
# the window of the rendezvous wait, before any launcher's guard) takes it with it. And an
# agent removes what dead agents left (a host killed whole, guard and all): only dtrain's
# exact names, and only where no process has that pid.
tmp=${TMPDIR:-/tmp}
dead=$(sh -c 'echo $$')
# (the agent's place in its file names: its machine's boot id, 12 hex digits, and pid namespace)
ns=$(tr -dc 0-9a-f </proc/sys/kernel/random/boot_id | cut -c1-12).$(readlink /proc/self/ns/pid | tr -dc 0-9)
for f in "dtrain-0123456789ab-$ns-$dead.json" "dtrain-result-0123456789ab-$ns-$dead.json" "dtrain-0123456789ab-$ns-$$.json" \
         "dtrain-0123456789ab-$ns-$dead.json.keep" "dtrain-0123456789-$ns-$dead.json" "dtrain-0123456789ab-f$ns-$dead.json"; do
  echo '{}' > "$tmp/$f"
done
# (an agent's files are in a private directory of its own now: a dead one's goes too)
mkdir -p "$tmp/dtrain-0123456789ab-$ns-$dead-Ab3dEf" && echo '{}' >"$tmp/dtrain-0123456789ab-$ns-$dead-Ab3dEf/spec.json"
DTRAIN_TEST_REPORT_DELAY=127.0.0.1:8000 timeout -k 5 40 "$DTRAIN" run "$T/tr.json" --nproc-per-node 1 --max-restarts 0 \
  --hosts localhost:1,127.0.0.1:1 >"$T/ag.out" 2>&1 &
DTRAIN_PID=$!
agent=""
for _ in $(seq 100); do agent=$(pgrep -f "^$DTRAIN agent .*--node 127\.0\.0\.1( |$)" | head -1); [ -n "$agent" ] && break; sleep 0.1; done
runid=$(ps -o args= -p "$agent" | sed -n 's/.*--run-id \([0-9a-f]*\).*/\1/p')
snap=""
for _ in $(seq 200); do snap=$(ls -d "$tmp/dtrain-$runid-$ns-$agent-"??????/spec.json 2>/dev/null | head -1); [ -n "$snap" ] && break; sleep 0.1; done
[ -n "$runid" ] && [ -n "$snap" ] && [ -e "$snap" ] && pass "agent snapshot exists ($snap)" || fail "no agent snapshot '$tmp/dtrain-$runid-$ns-$agent-XXXXXX/spec.json'"
[ -n "$snap" ] && [ "$(stat -c %a "$(dirname "$snap")")" = 700 ] && pass "agent snapshot: in a directory only its user may enter" || fail "agent snapshot directory mode"
for f in "dtrain-0123456789ab-$ns-$dead.json" "dtrain-result-0123456789ab-$ns-$dead.json" "dtrain-0123456789ab-$ns-$dead-Ab3dEf"; do
  [ ! -e "$tmp/$f" ] && pass "a dead agent's $f removed" || { fail "a dead agent's $f left"; rm -rf "$tmp/$f"; }
done
for f in "dtrain-0123456789ab-$ns-$$.json" "dtrain-0123456789ab-$ns-$dead.json.keep" "dtrain-0123456789-$ns-$dead.json" \
         "dtrain-0123456789ab-f$ns-$dead.json"; do
  [ -e "$tmp/$f" ] && pass "$f kept (pid alive, another machine's or pid namespace's, or not dtrain's name)" || fail "$f removed"
  rm -f "$tmp/$f"
done
kill -9 "$agent"
for _ in $(seq 50); do [ -e "$snap" ] || break; sleep 0.1; done
[ -n "$snap" ] && [ ! -e "$(dirname "$snap")" ] && pass "agent SIGKILLed before its workers started: its snapshot's directory removed" || { fail "agent snapshot $snap left"; [ -n "$snap" ] && rm -rf "$(dirname "$snap")"; }
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 1 "the job fails: its node was lost (max_restarts 0)"
# The run's private directory on the launcher's host ($TMPDIR/dtrain-run-<run id>-<place>-<pid>-
# XXXXXX: the trainer's spec snapshot, the result file) has a guard of its own over the whole
# run: the launcher's guards live only while workers run, so a SIGKILL in a restart's back-off
# left it, and so did one of a multi-node launcher (which has none on its host).
mkdir -p "$T/tmp"
cat >"$T/slow.json" <<'JSON'
{"nproc_per_node": 1, "max_restarts": 2, "restart_backoff_s": 30, "env": {"OMP_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [4, 8, 2]}, "data": {"type": "synthetic", "train_samples": 64, "eval_samples": 16},
 "batch_size": 8, "epochs": 1000000, "log_every_steps": 1000000}}
JSON
TMPDIR="$T/tmp" "$DTRAIN" run "$T/slow.json" >"$T/bo.out" 2>"$T/bo.err" &
DTRAIN_PID=$!
w=""
for _ in $(seq 100); do w=$(ps -o pid=,args= --ppid "$DTRAIN_PID" | awk '$3 == "train" {print $1; exit}'); [ -n "$w" ] && break; sleep 0.1; done
rundir=$(ls -d "$T/tmp"/dtrain-run-* 2>/dev/null | head -1)
[ -n "$rundir" ] && [ -e "$rundir/spec.json" ] && pass "back-off: the run's private directory exists ($rundir)" || fail "back-off: no private directory in $T/tmp: $(ls "$T/tmp")"
kill -9 "$w"
for _ in $(seq 100); do grep -q "event restart" "$T/bo.err" && break; sleep 0.1; done
expect_grep "event restart \(round 1\)" "$T/bo.err" "back-off: the worker's death starts a restart"
sleep 0.3
kill -9 "$DTRAIN_PID"; wait "$DTRAIN_PID" 2>/dev/null; DTRAIN_PID=
for _ in $(seq 50); do [ -e "$rundir" ] || break; sleep 0.1; done
[ -n "$rundir" ] && [ ! -e "$rundir" ] && pass "SIGKILL in a restart's back-off: the private directory removed" || fail "SIGKILL in a restart's back-off: $rundir left"
TMPDIR="$T/tmp" "$DTRAIN" run "$T/slow.json" --hosts localhost:1,127.0.0.1:1 >"$T/mn.out" 2>&1 &
DTRAIN_PID=$!
for _ in $(seq 200); do [ "$(pgrep -fc "dtrain train $T/tmp/")" = 2 ] && break; sleep 0.1; done
rundir=$(ls -d "$T/tmp"/dtrain-run-* 2>/dev/null | head -1)
[ -n "$rundir" ] && pass "multi-node: the launcher's private directory exists" || fail "multi-node: no launcher's private directory: $(ls "$T/tmp")"
kill -9 "$DTRAIN_PID"; wait "$DTRAIN_PID" 2>/dev/null; DTRAIN_PID=
for _ in $(seq 100); do [ -z "$(ls "$T/tmp")" ] && break; sleep 0.1; done
expect_eq "$(ls "$T/tmp")" "" "multi-node launcher SIGKILLed: its private directory and the agents' removed"
# Killed with its guard (a cgroup's kill, a host's reboot) or before it had one, a run leaves
# its directory: the next trainer run of the user removes it when its pid is gone here, and
# nothing else (a live pid's, another host's or pid namespace's, a symbolic link, another name).
place=$(TMPDIR="$T/tmp" "$DTRAIN" run --dry-run "$T/slow.json" | sed -n 's|.*/dtrain-run-[0-9a-f]*-\([0-9a-f]*\.[0-9]*\)-[0-9]*-XXXXXX/spec.json$|\1|p')
[ -n "$place" ] && pass "the plan shows the directory's name ($place)" || fail "no place in the plan's spec path"
mkdir -p "$T/tmp/keep" && echo x >"$T/tmp/keep/x"
for d in "dtrain-run-0123456789ab-$place-$dead-Ab3dEf" "dtrain-run-0123456789ab-$place-$$-Ab3dEf" \
         "dtrain-run-0123456789ab-0.1-$dead-Ab3dEf" "dtrain-runs-0123456789ab-$place-$dead-Ab3dEf" \
         "dtrain-err-0123456789ab-$place-$dead-Ab3dEf" "dtrain-err-0123456789ab-$place-$$-Ab3dEf"; do
  mkdir -p "$T/tmp/$d" && echo '{}' >"$T/tmp/$d/spec.json"
done
ln -s keep "$T/tmp/dtrain-run-aaaaaaaaaaaa-$place-$dead-Ab3dEf"
TMPDIR="$T/tmp" "$DTRAIN" run "$T/tr.json" --nproc-per-node 1 >/dev/null 2>"$T/sweep.err" &
DTRAIN_PID=$!
for _ in $(seq 100); do [ -e "$T/tmp/dtrain-run-0123456789ab-$place-$dead-Ab3dEf" ] || [ -e "$T/tmp/dtrain-err-0123456789ab-$place-$dead-Ab3dEf" ] || break; sleep 0.1; done
kill -9 "$DTRAIN_PID"; wait "$DTRAIN_PID" 2>/dev/null; DTRAIN_PID=
[ ! -e "$T/tmp/dtrain-run-0123456789ab-$place-$dead-Ab3dEf" ] && pass "a dead run's private directory removed by the next run" || fail "a dead run's private directory left"
[ ! -e "$T/tmp/dtrain-err-0123456789ab-$place-$dead-Ab3dEf" ] && pass "a dead launch's error-file directory removed by the next launch" || fail "a dead launch's error-file directory left"
for d in "dtrain-run-0123456789ab-$place-$$-Ab3dEf" "dtrain-err-0123456789ab-$place-$$-Ab3dEf" "dtrain-run-0123456789ab-0.1-$dead-Ab3dEf" \
         "dtrain-runs-0123456789ab-$place-$dead-Ab3dEf" "dtrain-run-aaaaaaaaaaaa-$place-$dead-Ab3dEf" keep/x; do
  [ -e "$T/tmp/$d" ] && pass "$d kept" || fail "$d removed"
done
# The guard killed by hand while the job runs: the job loses that protection, nothing else
# (before: the launcher's last word to the dead guard raised SIGPIPE after the run, and a job
# that had succeeded exited 141).
cat >"$T/guard.json" <<JSON
{"nproc_per_node": 2, "env": {"OMP_NUM_THREADS": "1"}, "trainer": {"model": {"layers": [4, 8, 3]},
 "data": {"type": "synthetic", "train_samples": 256, "eval_samples": 32}, "batch_size": 16,
 "epochs": 20000, "log_every_steps": 1000000}}
JSON
# (dtrain given a descriptor of its parent's, 7: its guards, which may outlive it, hold nothing
# but their own three, nor any store connection)
"$DTRAIN" run "$T/guard.json" >"$T/g.out" 2>"$T/g.err" 7>"$T/fd7" &
DTRAIN_PID=$!
for _ in $(seq 100); do grep -q "trainer:" "$T/g.out" 2>/dev/null && break; sleep 0.05; done
guards=$(ps -o pid= -o args= --ppid "$DTRAIN_PID" | awk '$2 == "dtrain-guard" {print $1}')
[ -n "$guards" ] && pass "the run's guards found" || fail "no dtrain-guard under the launcher"
# (closefrom at the spawn needs glibc 2.34: before it, nothing to check)
if [ "$(printf '%s\n' "2.34" "$(getconf GNU_LIBC_VERSION | awk '{print $2}')" | sort -V | head -1)" = 2.34 ]; then
  fds=$(for g in $guards; do ls /proc/$g/fd; done | sort -u | tr '\n' ' ')
  expect_eq "$fds" "0 1 2 " "the guards hold no descriptor of dtrain's but their own"
fi
kill -KILL $guards 2>/dev/null
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 0 "guards killed by hand: the job still succeeds"
expect_grep "trained: " "$T/g.out" "guards killed by hand: the training finished"
finish
