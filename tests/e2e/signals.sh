# SIGINT/SIGTERM/SIGHUP reach every worker; a worker that ignores SIGTERM is killed after
# the grace period; dtrain exits 128+signal.
source "$(dirname "$0")/lib.sh"
cat > "$T/w.py" <<'PY'
import os, signal, sys, time
d, rank, mode = os.environ["D"], os.environ["RANK"], sys.argv[1]
def on(sig, _):
    open(f"{d}/got.{rank}", "w").write(signal.Signals(sig).name)
    sys.exit(0)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN if mode == "ignore" else on)
open(f"{d}/pid.{rank}", "w").write(str(os.getpid()))
time.sleep(120)
PY
run_case() {  # signal expected_rc
  rm -f "$T"/got.* "$T"/pid.*
  D="$T" "$DTRAIN" run --nproc-per-node 3 -- python3 "$T/w.py" handle >"$T/out" 2>"$T/err" &
  DTRAIN_PID=$!
  wait_for "$T/pid.0" "$T/pid.1" "$T/pid.2" || return
  kill -"$1" "$DTRAIN_PID"
  wait "$DTRAIN_PID"; rc=$?
  DTRAIN_PID=
  expect_eq "$rc" "$2" "SIG$1 gives exit $2"
  for r in 0 1 2; do expect_eq "$(cat "$T/got.$r" 2>/dev/null)" "SIG$1" "rank $r got SIG$1"; done
  expect_grep "stopped by" "$T/err" "SIG$1 reported"
  # Said at once: what happens next, and (Ctrl-C) how to cut the wait short.
  expect_grep "^dtrain: SIG$1: stopping 3 workers \(SIG$1 to the workers now, SIGKILL after 30 s\)$([ "$1" = INT ] && echo '; Ctrl-C again to kill now')$" "$T/err" "SIG$1 teardown announced"
}
run_case INT 130
run_case TERM 143
run_case HUP 129

# Grace kill: workers ignore SIGTERM; --shutdown-timeout 1 -> SIGKILL after ~1 s.
rm -f "$T"/pid.*
D="$T" "$DTRAIN" run --nproc-per-node 2 --shutdown-timeout 1 -- python3 "$T/w.py" ignore >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
wait_for "$T/pid.0" "$T/pid.1"
start=$(date +%s%N)
kill -TERM "$DTRAIN_PID"
wait "$DTRAIN_PID"; rc=$?
DTRAIN_PID=
ms=$(( ($(date +%s%N) - start) / 1000000 ))
expect_eq "$rc" 143 "grace-killed job exits 143"
[ "$ms" -ge 900 ] && [ "$ms" -lt 6000 ] && pass "SIGKILL after the grace period (${ms} ms)" || fail "teardown took ${ms} ms"
for r in 0 1; do alive "$(cat "$T/pid.$r")" && fail "rank $r survived" || pass "rank $r killed"; done
# SIGUSR1/SIGUSR2 are the workers' (as with mpirun; Slurm's --signal=USR1@120 warns a job
# before its time limit): passed on to each worker's own process, the job goes on, and dtrain
# says so. A worker's child (a DataLoader process) is not signalled. A worker without a
# handler dies of it like any failure; a restart's back-off drops the signal with a notice.
cat > "$T/usr.py" <<'PY'
import os, signal, subprocess, sys, time
d, rank = os.environ["D"], os.environ["RANK"]
got = []
signal.signal(signal.SIGUSR1, lambda s, _: got.append("USR1"))
signal.signal(signal.SIGUSR2, lambda s, _: got.append("USR2"))
child = subprocess.Popen(["sleep", "30"])  # default SIGUSR1 action: it would die
open(f"{d}/pid.{rank}", "w").write(str(os.getpid()))
while len(got) < 3: time.sleep(0.02)
print(rank, " ".join(got), "child alive" if child.poll() is None else "child died", flush=True)
child.kill()
PY
rm -f "$T"/pid.*
D="$T" "$DTRAIN" run --nproc-per-node 2 -- python3 "$T/usr.py" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
if wait_for "$T/pid.0" "$T/pid.1"; then
  kill -USR1 "$DTRAIN_PID"; sleep 0.2; kill -USR2 "$DTRAIN_PID"; sleep 0.2; kill -USR1 "$DTRAIN_PID"
  wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  expect_eq "$rc" 0 "SIGUSR1/2: the job goes on and succeeds"
  for r in 0 1; do expect_grep "^\[rank $r\] $r USR1 USR2 USR1 child alive$" "$T/out" "rank $r got USR1, USR2, USR1 in order; its child not signalled"; done
  expect_eq "$(grep -c '^dtrain: SIGUSR1: passed on to 2 workers$' "$T/err")" 2 "SIGUSR1 said twice"
  expect_grep "^dtrain: SIGUSR2: passed on to 2 workers$" "$T/err" "SIGUSR2 said"
fi
cat > "$T/nohandler.sh" <<'SH'
[ -e "$D/again" ] && exit 0; touch "$D/again"; echo $$ > "$D/pid.$RANK"; sleep 30 & wait
SH
rm -f "$T"/pid.* "$T/again"
D="$T" "$DTRAIN" run --nproc-per-node 1 --max-restarts 1 -- bash "$T/nohandler.sh" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
wait_for "$T/pid.0" && kill -USR1 "$DTRAIN_PID"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 0 "no handler: the worker died of SIGUSR1 and the restart succeeded"
expect_grep "event restart \(round 1\) host .* rank 0: rank 0 killed by SIGUSR1; restart 1 of 1" "$T/err" "no handler: a failure like any other, restarted"
# nohup: SIGHUP ignored when dtrain starts stays ignored (the terminal closing must not end
# the job), for dtrain and its workers.
cat > "$T/hup.sh" <<'SH'
echo $$ > "$D/hpid.$RANK"; sleep 1.5; echo "survived"
SH
rm -f "$T"/hpid.*
D="$T" nohup "$DTRAIN" run --nproc-per-node 2 -- bash "$T/hup.sh" >"$T/hup.out" 2>&1 &
DTRAIN_PID=$!
wait_for "$T/hpid.0" "$T/hpid.1" && kill -HUP "$DTRAIN_PID" && kill -HUP "$(cat "$T/hpid.0")"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 0 "nohup: SIGHUP does not stop the job"
expect_eq "$(grep -c survived "$T/hup.out")" 2 "nohup: both workers ran on"
finish
