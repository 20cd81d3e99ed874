# SIGINT/SIGTERM/SIGHUP/SIGQUIT reach every worker; a worker that ignores SIGTERM is killed after
# the grace period; dtrain exits 128+signal.
source "$(dirname "$0")/lib.sh"
cat > "$T/w.py" <<'PY'
import os, signal, sys, time
d, rank, mode = os.environ["D"], os.environ["RANK"], sys.argv[1]
def on(sig, _):
    open(f"{d}/got.{rank}", "w").write(signal.Signals(sig).name)
    sys.exit(0)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
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
# Ctrl-\ (SIGQUIT) too, as under torchrun (before: dtrain died of it at once, the workers were
# SIGKILLed by its guard, with no grace and no summary).
run_case QUIT 131

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
# The grace period is the worker's whole process group's: a wrapper script (bash, the
# worker's own process) dies of the SIGTERM at once, while the python it runs got the SIGTERM
# too and saves a checkpoint; dtrain waits for it (not the whole grace period: until the group
# is empty), and the recorded exit stays the wrapper's, stopped by dtrain.
cat > "$T/save.py" <<'PY'
import os, signal, sys, time
d, rank, mode = os.environ["D"], os.environ["RANK"], sys.argv[1]  # mode: seconds to save, or "ignore"
def on(s, _):
    print(f"rank {rank} saving", flush=True); time.sleep(float(mode)); print(f"rank {rank} checkpoint done", flush=True); sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore" else on)
open(f"{d}/py.{rank}", "w").write(str(os.getpid()))
time.sleep(120)
PY
printf '#!/bin/bash\nset -e\npython3 %s "$@"\n' "$T/save.py" > "$T/train.sh"; chmod +x "$T/train.sh"
granks() { python3 -c "import json,sys; print([(r['rank'], r['exit_code'], r['signal'], r['stopped_by_dtrain']) for r in json.load(open(sys.argv[1]))['ranks']])" "$1"; }
rm -f "$T"/py.*
D="$T" "$DTRAIN" run --nproc-per-node 2 --shutdown-timeout 5 --summary-json "$T/wrap.json" -- "$T/train.sh" 1 >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
if wait_for "$T/py.0" "$T/py.1"; then
  start=$(date +%s%N)
  kill -TERM "$DTRAIN_PID"
  wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  expect_eq "$rc" 143 "wrapper script: SIGTERM gives exit 143"
  for r in 0 1; do expect_grep "^\[rank $r\] rank $r checkpoint done$" "$T/out" "wrapper script: rank $r's python saved its checkpoint in the grace period"; done
  [ "$ms" -ge 900 ] && [ "$ms" -lt 3500 ] && pass "wrapper script: dtrain waited for the save, not the whole grace period (${ms} ms)" || fail "wrapper script: teardown took ${ms} ms (save 1 s, grace 5 s)"
  expect_eq "$(granks "$T/wrap.json")" "[(0, None, 'SIGTERM', True), (1, None, 'SIGTERM', True)]" "wrapper script: the recorded exits are the wrappers', stopped by dtrain"
fi
# A wrapper's python that ignores SIGTERM is SIGKILLed at the grace deadline, its group
# guarded until then; a teardown after a failure names the rank whose group it waits for.
rm -f "$T"/py.*
D="$T" "$DTRAIN" run --nproc-per-node 2 --shutdown-timeout 3 -- bash -c \
  'if [ "$RANK" = 1 ]; then while [ ! -e "$D/py.0" ]; do sleep 0.05; done; exit 3; fi; exec "$0" ignore' "$T/train.sh" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
if wait_for "$T/py.0"; then
  start=$(date +%s%N)
  wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  expect_eq "$rc" 3 "wrapper's python ignoring SIGTERM: the failing rank's exit code"
  [ "$ms" -ge 2700 ] && [ "$ms" -lt 6000 ] && pass "wrapper's python ignoring SIGTERM: SIGKILL at the grace deadline (${ms} ms)" || fail "wrapper's python ignoring SIGTERM: teardown took ${ms} ms (grace 3 s)"
  p=$(cat "$T/py.0")
  alive "$p" && { fail "wrapper's python (pid $p) outlived the grace period"; kill -9 "$p"; } || pass "wrapper's python ignoring SIGTERM: killed"
  expect_grep "^dtrain: rank 1 failed; waiting up to [0-9]+ s more for rank\(s\) 0 to exit after SIGTERM" "$T/err" "teardown notice names the rank whose process group lingers"
fi
# A Ctrl-C in the grace period (here after a SIGTERM) kills the lingering groups at once.
rm -f "$T"/py.*
D="$T" "$DTRAIN" run --nproc-per-node 2 --shutdown-timeout 30 -- "$T/train.sh" ignore >/dev/null 2>"$T/err" &
DTRAIN_PID=$!
if wait_for "$T/py.0" "$T/py.1"; then
  kill -TERM "$DTRAIN_PID"; sleep 0.5
  start=$(date +%s%N); kill -INT "$DTRAIN_PID"; wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  expect_eq "$rc" 143 "Ctrl-C in the grace period: exit 143 (the first signal's)"
  [ "$ms" -lt 1500 ] && pass "Ctrl-C in the grace period: lingering groups killed at once (${ms} ms)" || fail "Ctrl-C in the grace period took ${ms} ms"
  for r in 0 1; do p=$(cat "$T/py.$r"); alive "$p" && { fail "rank $r's python (pid $p) survived"; kill -9 "$p"; } || pass "Ctrl-C in the grace period: rank $r's python killed"; done
fi
# dtrain SIGKILLed while a group lingers: the guard still takes the wrapper's python along.
rm -f "$T"/py.*
D="$T" "$DTRAIN" run --nproc-per-node 1 --shutdown-timeout 30 -- "$T/train.sh" ignore >/dev/null 2>&1 &
DTRAIN_PID=$!
if wait_for "$T/py.0"; then
  kill -TERM "$DTRAIN_PID"; sleep 0.5
  kill -9 "$DTRAIN_PID"; wait "$DTRAIN_PID" 2>/dev/null; DTRAIN_PID=
  p=$(cat "$T/py.0")
  for _ in $(seq 100); do alive "$p" || break; sleep 0.1; done
  alive "$p" && { fail "a lingering group's python (pid $p) outlived a SIGKILLed dtrain"; kill -9 "$p"; } || pass "dtrain SIGKILLed in the grace period: the lingering group's python killed by the guard"
fi
# A scheduler's stop (Slurm's scancel or time limit, a cgroup kill) signals every process of
# the job, the workers before dtrain as often as not: workers that die of it at once are one
# stop of the whole job with dtrain's own signal, not a failure to restart. The same SIGTERM
# sent to a worker alone is a failure like any other, restarted.
cat > "$T/plain.sh" <<'SH'
[ -e "$D/again" ] && exit 0; echo $$ > "$D/pid.$RANK"; exec sleep 60
SH
rm -f "$T"/pid.* "$T/again"
D="$T" "$DTRAIN" run --nproc-per-node 2 --max-restarts 3 --summary-json "$T/sched.json" -- bash "$T/plain.sh" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
if wait_for "$T/pid.0" "$T/pid.1"; then
  w0=$(cat "$T/pid.0"); w1=$(cat "$T/pid.1")
  kill -TERM "$w0" "$w1"
  # dtrain's share comes once dtrain has reaped them (a zombie still answers kill -0), as a
  # scheduler's would, a moment later, whatever the load on this machine.
  for _ in $(seq 400); do kill -0 "$w0" 2>/dev/null || kill -0 "$w1" 2>/dev/null || break; sleep 0.005; done
  kill -TERM "$DTRAIN_PID"
  wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  expect_eq "$rc" 143 "scheduler's stop: exit 143"
  expect_grep "^dtrain: rank\(s\) [01] \(SIGTERM\)(, [01] \(SIGTERM\))? had ended by a stop signal from outside dtrain just before dtrain got SIGTERM: one stop of the whole job \(a scheduler's\), not a failure; no restart$" "$T/err" "scheduler's stop: said in one line"
  expect_grep "^dtrain: stopped by SIGTERM; exit code 143$" "$T/err" "scheduler's stop: the verdict is the stop"
  if grep -q "event restart\|first failure" "$T/err"; then fail "scheduler's stop: a restart or a failure"; else pass "scheduler's stop: no restart, no failure"; fi
  expect_eq "$(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['restarts'], d['stopped_by'], d['error'], d['events'], [r['stopped_by_dtrain'] for r in d['ranks']])" "$T/sched.json")" \
    "0 SIGTERM stopped by SIGTERM; exit code 143 [] [True, True]" "scheduler's stop: the summary"
fi
# The same stop by SIGINT (scancel -s INT): dtrain's SIGINT is its share of that stop, not a
# second Ctrl-C after a failure, so a worker still saving (here 1 s) is not SIGKILLed.
cat > "$T/save.py" <<'PY'
import os, signal, sys, time
d, rank = os.environ["D"], os.environ["RANK"]
def save(sig, _):
    time.sleep(float(os.environ.get("SAVE_S", "1")))
    open(f"{d}/saved.{rank}", "w").write("ok")
    sys.exit(128 + sig)
if rank == "1":
    signal.signal(signal.SIGINT, save)
    signal.signal(signal.SIGTERM, save)
open(f"{d}/pid.{rank}", "w").write(str(os.getpid()))
time.sleep(60)
PY
rm -f "$T"/pid.* "$T"/saved.*
D="$T" "$DTRAIN" run --nproc-per-node 2 --max-restarts 3 -- python3 "$T/save.py" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
if wait_for "$T/pid.0" "$T/pid.1"; then
  w0=$(cat "$T/pid.0")
  kill -INT "$w0" "$(cat "$T/pid.1")"
  for _ in $(seq 400); do kill -0 "$w0" 2>/dev/null || break; sleep 0.005; done
  kill -INT "$DTRAIN_PID"
  wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  expect_eq "$rc" 130 "scheduler's SIGINT: exit 130"
  expect_eq "$(cat "$T/saved.1" 2>/dev/null)" "ok" "scheduler's SIGINT: the worker still saving finished"
  if grep -q "killing the workers now" "$T/err"; then fail "scheduler's SIGINT: taken for a second Ctrl-C"; else pass "scheduler's SIGINT: no SIGKILL"; fi
fi
# A signal later in a long teardown is one after a failure, not a scheduler's stop: the job
# ends as that failure (a worker killed by SIGTERM alone, no restart left).
rm -f "$T"/pid.* "$T"/saved.*
# (rank 1 takes 6 s to save: the signal, 2 s after the death, is well inside that teardown
# and well past kOutsideStopWindow, 0.5 s)
SAVE_S=6 D="$T" "$DTRAIN" run --nproc-per-node 2 --summary-json "$T/late.json" -- python3 "$T/save.py" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
if wait_for "$T/pid.0" "$T/pid.1"; then
  kill -TERM "$(cat "$T/pid.0")"; sleep 2; kill -TERM "$DTRAIN_PID"
  wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  expect_eq "$rc" 143 "a signal late in the teardown: the failure's exit code"
  expect_grep "^dtrain: job 'save.py' failed: rank 0 killed by SIGTERM" "$T/err" "a signal late in the teardown: the failure's headline"
  if grep -q "one stop of the whole job" "$T/err"; then fail "a signal late in the teardown: taken for a scheduler's stop"; else pass "a signal late in the teardown: a failure"; fi
fi
rm -f "$T"/pid.* "$T/again"
D="$T" "$DTRAIN" run --nproc-per-node 1 --max-restarts 1 -- bash "$T/plain.sh" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
if wait_for "$T/pid.0"; then
  touch "$T/again"; kill -TERM "$(cat "$T/pid.0")"
  wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  expect_eq "$rc" 0 "SIGTERM to a worker alone: restarted, then succeeded"
  expect_grep "event restart \(round 1\) host .* rank 0: rank 0 killed by SIGTERM; restart 1 of 1" "$T/err" "SIGTERM to a worker alone: a failure, restarted"
fi

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
# A stop signal before the launch is held until the step in progress ends (tests/e2e/summary.sh),
# but a step that never ends (here the spec is a FIFO no one writes: as a data file on a hung
# NFS mount, or a write to a terminal stopped with Ctrl-S) left Ctrl-C without effect, and only
# SIGKILL ended dtrain. A second stop signal ends dtrain at once by its default action; one
# SIGTERM alone (timeout(1), a scheduler) ends it so 10 s later. Nothing that could block is
# written: the summary still says "running", one line on stderr says why.
cat > "$T/pre.py" <<'PY'
import os, signal, subprocess, sys, time
dtrain, t, sigs = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
for f in ("pf.json", "pfs.json"):
    if os.path.exists(f"{t}/{f}"): os.unlink(f"{t}/{f}")
os.mkfifo(f"{t}/pf.json")
p = subprocess.Popen([dtrain, "run", f"{t}/pf.json", "--summary-json", f"{t}/pfs.json"],
                     stdout=subprocess.DEVNULL, stderr=open(f"{t}/pf.err", "w"))
for _ in range(200):  # (the summary says "running" before the spec is read)
    if os.path.exists(f"{t}/pfs.json") and "running" in open(f"{t}/pfs.json").read(): break
    time.sleep(0.05)
time.sleep(0.2)
t0 = time.time()
for s in sigs:
    p.send_signal(getattr(signal, "SIG" + s)); time.sleep(0.2)
try: rc = p.wait(30)
except subprocess.TimeoutExpired: p.kill(); p.wait(); print("hung"); sys.exit()
took = time.time() - t0
when = "at once" if took < 2 else ("after the grace" if 9 <= took < 14 else f"after {took:.1f} s")
print(f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}", when)
PY
for sigs in INT,INT TERM,INT HUP,TERM; do
  second=SIG${sigs#*,}
  expect_eq "$(python3 "$T/pre.py" "$DTRAIN" "$T" "$sigs")" "killed by $second at once" "pre-flight blocked, $sigs: the second signal ends dtrain by its default action"
  expect_grep "^dtrain: $second again while the job was being checked \(the step in progress has not finished\): ending now by $second; no summary written$" "$T/pf.err" "pre-flight blocked, $sigs: said"
  expect_eq "$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['status'])" "$T/pfs.json")" running "pre-flight blocked, $sigs: the summary still says running"
done
expect_eq "$(python3 "$T/pre.py" "$DTRAIN" "$T" TERM)" "killed by SIGTERM after the grace" "pre-flight blocked, one SIGTERM: dtrain ends by it 10 s later"
expect_grep "^dtrain: SIGTERM 10 s ago while the job was being checked, and the step in progress has not finished: ending now by SIGTERM; no summary written$" "$T/pf.err" "pre-flight blocked, one SIGTERM: said"
# timeout(1) sends its SIGTERM twice, to dtrain and then to its own process group (dtrain
# again): that echo is one request, not a second. The blocked step ends (the spec arrives)
# and the run stops as for one SIGTERM: exit 143 and a summary, not killed without one.
# Whether the two copies reach dtrain apart or merged into one depends on the scheduling, so
# the test also sends them itself, 20 ms apart from one process ("twice"), which is the case
# that used to end dtrain.
cat > "$T/echo.py" <<'PY'
import json, os, signal, subprocess, sys, time
dtrain, t, how = sys.argv[1], sys.argv[2], sys.argv[3]
for f in ("ef.json", "efs.json"):
    if os.path.exists(f"{t}/{f}"): os.unlink(f"{t}/{f}")
os.mkfifo(f"{t}/ef.json")
cmd = [dtrain, "run", f"{t}/ef.json", "--summary-json", f"{t}/efs.json"]
if how == "timeout": cmd = ["timeout", "--preserve-status", "-s", "TERM", "0.5"] + cmd
p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(f"{t}/ef.err", "w"))
if how == "twice":
    for _ in range(200):  # (the summary says "running" before the spec is read)
        if os.path.exists(f"{t}/efs.json") and "running" in open(f"{t}/efs.json").read(): break
        time.sleep(0.05)
    time.sleep(0.2)
    p.send_signal(signal.SIGTERM); time.sleep(0.02); p.send_signal(signal.SIGTERM)
time.sleep(1.5)
try:
    fd = os.open(f"{t}/ef.json", os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: dtrain is gone
    os.write(fd, b'{"command": ["true"], "nproc_per_node": 1}')
    os.close(fd)
except OSError as e:
    print("dtrain gone before the step ended:", e.strerror)
try: rc = p.wait(20)
except subprocess.TimeoutExpired: p.kill(); p.wait(); print("hung"); sys.exit()
s = json.load(open(f"{t}/efs.json"))
print(rc, s["status"], s["stopped_by"])
PY
for how in timeout twice; do
  expect_eq "$(python3 "$T/echo.py" "$DTRAIN" "$T" $how)" "143 failed SIGTERM" "pre-flight blocked, SIGTERM sent twice at once ($how): one stop, with its summary"
  expect_eq "$(grep -c again "$T/ef.err")" 0 "pre-flight blocked, SIGTERM sent twice at once ($how): the echo is not taken for a second signal"
done
# A SIGTERM held while the spec is read, and the spec then refused: the refusal is the outcome
# (exit 2), and the signal is said as what it was, not as one "after the job had ended".
rm -f "$T/badfifo.json"; mkfifo "$T/badfifo.json"
"$DTRAIN" run "$T/badfifo.json" --summary-json "$T/bads.json" >/dev/null 2>"$T/bad.err" &
DTRAIN_PID=$!
sleep 0.5; kill -TERM "$DTRAIN_PID"; sleep 0.3
timeout 5 sh -c 'echo "{\"command\": [" >"$1"' _ "$T/badfifo.json" || fail "SIGTERM, then a bad spec: dtrain no longer reads the spec"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 2 "SIGTERM, then a bad spec: the spec's exit 2 stands"
expect_grep "^dtrain: SIGTERM while the job was being checked, and the check failed first; the outcome stands$" "$T/bad.err" "SIGTERM, then a bad spec: said as such"
expect_grep "badfifo.json:2:1: invalid JSON" "$T/bad.err" "SIGTERM, then a bad spec: the spec's error"
# A stop signal while the launcher parses a long csv (here one with no end: a FIFO fed rows
# without pause) ends the parse at once: exit 143 with its summary. Before, the parse went
# on until the 10 s grace ended dtrain by SIGTERM with no summary.
cat > "$T/csvstop.py" <<'PY'
import json, os, signal, subprocess, sys, threading, time
dtrain, t = sys.argv[1], sys.argv[2]
for f in ("rows.csv", "cs.json"):
    if os.path.exists(f"{t}/{f}"): os.unlink(f"{t}/{f}")
os.mkfifo(f"{t}/rows.csv")
json.dump({"nproc_per_node": 1, "trainer": {"model": {"layers": [2, 4, 3]},
           "data": {"type": "csv", "path": f"{t}/rows.csv"}, "batch_size": 4}}, open(f"{t}/csvstop.json", "w"))
p = subprocess.Popen([dtrain, "run", f"{t}/csvstop.json", "--summary-json", f"{t}/cs.json"],
                     stdout=subprocess.DEVNULL, stderr=open(f"{t}/cs.err", "w"))
sent = [0]
def feed():
    try:
        with open(f"{t}/rows.csv", "w") as f:
            f.write("a,b,label\n")
            chunk = "0.5,1.5,1\n" * 20000
            while p.poll() is None:
                f.write(chunk); f.flush(); sent[0] += 20000
                time.sleep(0.002)
    except (BrokenPipeError, OSError):
        pass
threading.Thread(target=feed, daemon=True).start()
deadline = time.time() + 20
while sent[0] < 400000 and time.time() < deadline: time.sleep(0.01)
t0 = time.time()
p.send_signal(signal.SIGTERM)
try: rc = p.wait(30)
except subprocess.TimeoutExpired: p.kill(); p.wait(); print("hung"); sys.exit()
took = time.time() - t0
s = json.load(open(f"{t}/cs.json"))
print(rc, s["status"], s["stopped_by"], "at once" if took < 3 else f"after {took:.1f} s")
PY
expect_eq "$(python3 "$T/csvstop.py" "$DTRAIN" "$T")" "143 failed SIGTERM at once" "SIGTERM while the launcher parses a csv with no end: the parse stops, exit 143 with its summary"
expect_grep "^dtrain: stopped by SIGTERM before any worker started; exit code 143$" "$T/cs.err" "SIGTERM during the csv parse: said"
rm -f "$T/rows.csv"
# nohup's SIGHUP stays ignored: it is not a first signal, nor a second one.
rm -f "$T/pf.json"; mkfifo "$T/pf.json"
nohup "$DTRAIN" run "$T/pf.json" >/dev/null 2>"$T/pf.err" &
DTRAIN_PID=$!
sleep 0.5; kill -HUP "$DTRAIN_PID"; sleep 0.3; kill -HUP "$DTRAIN_PID"; sleep 0.5
alive "$DTRAIN_PID" && pass "pre-flight blocked under nohup: SIGHUP ignored" || fail "pre-flight blocked under nohup: SIGHUP ended dtrain"
kill -INT "$DTRAIN_PID"; sleep 0.3; kill -INT "$DTRAIN_PID"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 130 "pre-flight blocked under nohup: Ctrl-C twice still ends it"

# Late signals: once the outcome is decided (the launch returned or threw, or the run ended
# before any worker started), a stop signal changes neither the exit code nor the summary; it
# only cuts short what may block for good (a stalled console, a summary written in place to a
# FIFO no one reads), and dtrain exits at once with the outcome's code. Before, the signal's
# default action turned a success into 143, and an error into 143.
cat > "$T/late.py" <<'PY'
import os, signal, subprocess, sys, time
# late.py T STALL WAITFILE DTRAIN ARGS...: dtrain's stdout and stderr a full pipe no one reads
# (STALL=1) or a file; SIGTERM 0.5 s after WAITFILE exists (or after 2 s: "-").
t, stall, wait = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
if stall:
    if os.path.exists(f"{t}/late.fifo"): os.unlink(f"{t}/late.fifo")
    os.mkfifo(f"{t}/late.fifo")
    r = os.open(f"{t}/late.fifo", os.O_RDONLY | os.O_NONBLOCK)  # a reader that never reads
    out = os.open(f"{t}/late.fifo", os.O_WRONLY)
    os.set_blocking(out, False)
    try:
        while True: os.write(out, b"x" * 4096)  # full: dtrain's next write there blocks
    except BlockingIOError: pass
    os.set_blocking(out, True)
else:
    out = os.open(f"{t}/late.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
p = subprocess.Popen(sys.argv[4:], stdout=out, stderr=out)
os.close(out)
for _ in range(200):
    if wait != "-" and os.path.exists(wait): break
    time.sleep(0.01 if wait != "-" else 0.1)
time.sleep(0.5)
if p.poll() is not None: print("ended before the signal:", p.returncode); sys.exit()
p.send_signal(signal.SIGTERM)
t0 = time.time()
try: rc = p.wait(10)
except subprocess.TimeoutExpired: p.kill(); p.wait(); print("hung"); sys.exit()
print(f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}", "at once" if time.time() - t0 < 2 else "late")
PY
rm -f "$T/nobody.fifo" "$T/done"; mkfifo "$T/nobody.fifo"
expect_eq "$(python3 "$T/late.py" "$T" 0 "$T/done" "$DTRAIN" run --summary-json "$T/nobody.fifo" -- sh -c "touch $T/done")" \
  "exit 0 at once" "late SIGTERM while the summary waits on a FIFO no one reads: the success stands"
printf '{"command": ["true"], "nproc_per_node": 0}' >"$T/bad.json"
expect_eq "$(python3 "$T/late.py" "$T" 1 - "$DTRAIN" run "$T/bad.json")" "exit 2 at once" \
  "late SIGTERM while a bad spec's error waits on a stalled console: exit 2 stands"
expect_eq "$(python3 "$T/late.py" "$T" 1 - "$DTRAIN" run --summary-json "$T/cli.json" --bogus -- true)" "exit 2 at once" \
  "late SIGTERM while a refused command line's error waits on a stalled console: exit 2 stands"
# A run that throws after the launch (the temp dir removed by the first attempt: the restart,
# after its 1 s back-off, cannot make its error files' directory), its error held by a
# stalled console; the signal 2.5 s after the start.
mkdir -p "$T/gone"
expect_eq "$(TMPDIR="$T/gone" python3 "$T/late.py" "$T" 1 - "$DTRAIN" run --max-restarts 1 --summary-json "$T/gone.json" -- \
  sh -c "rm -rf '$T/gone'; exit 1")" "exit 2 at once" "late SIGTERM after a run that threw after its launch: its exit 2 stands"
expect_eq "$(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['exit_code'], d['stopped_by'], 'TMPDIR' in d['error'])" "$T/gone.json")" \
  "2 None True" "late SIGTERM after a run that threw after its launch: the summary is the error's"
# A failure's exit code stands the same way.
rm -f "$T/done"
expect_eq "$(python3 "$T/late.py" "$T" 0 "$T/done" "$DTRAIN" run --summary-json "$T/nobody.fifo" -- sh -c "touch $T/done; exit 3")" \
  "exit 3 at once" "late SIGTERM while the summary waits on a FIFO no one reads: a failure's code stands"
# Under a terminal (script gives dtrain one, in the foreground), a worker that asks for a
# password on /dev/tty: each worker has a session of its own and no controlling terminal, so
# getpass falls back to stdin (/dev/null) and fails at once (before: each worker, a background
# group of the terminal's session, was stopped by SIGTTIN, and the job hung silently).
if command -v script >/dev/null; then
  timeout 60 script -qec "$DTRAIN run --nproc-per-node 2 -- /usr/bin/python3 -c \"import os, getpass; assert os.getsid(0) == os.getpid(); getpass.getpass('pw: ')\"" /dev/null >"$T/tty.out" 2>&1
  expect_eq "$?" 1 "a worker reading /dev/tty under a terminal fails instead of hanging"
  expect_grep "EOFError" "$T/tty.out" "getpass found no terminal and said so"
fi
# One Ctrl-C on a terminal to `timeout 60 dtrain run`: timeout(1) passes the SIGINT on to
# dtrain and to its process group, so that it arrives two or three times at once; those are
# echoes of the one Ctrl-C, not the second that kills the workers now (before: SIGKILL at once,
# and no final checkpoint). The trainer then stops with its final checkpoint.
cat > "$T/ctrlc.py" <<'PY'
# ctrlc.py ARGV...: ARGV on a terminal (a pty); one Ctrl-C once $READY shows; the output, then
# the exit status.
import os, pty, select, sys, time
pid, fd = pty.fork()
if pid == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
out, sent, t0 = b"", False, time.time()
while time.time() - t0 < 60:
    r, _, _ = select.select([fd], [], [], 0.1)
    if r:
        try: chunk = os.read(fd, 65536)
        except OSError: break
        if not chunk: break
        out += chunk
    if not sent and os.environ["READY"].encode() in out:
        os.write(fd, b"\x03"); sent = True
else:
    os.kill(pid, 9)
_, st = os.waitpid(pid, 0)
sys.stdout.write(out.decode(errors="replace").replace("\r", "\n"))
print("status", os.waitstatus_to_exitcode(st))
PY
cat > "$T/cc.json" <<JSON
{"name": "cc", "nproc_per_node": 2, "shutdown_timeout_s": 20, "env": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [16, 64, 4]}, "data": {"type": "synthetic", "train_samples": 4096, "eval_samples": 128},
  "batch_size": 16, "epochs": 2000, "log_every_steps": 50, "checkpoint": {"dir": "$T/cc-ck", "every_steps": 1000000}}}
JSON
for i in 1 2 3; do
  rm -rf "$T/cc-ck"
  READY="step 50/" python3 "$T/ctrlc.py" timeout 120 "$DTRAIN" run "$T/cc.json" >"$T/cc.out" 2>&1
  expect_grep "^status 130$" "$T/cc.out" "one Ctrl-C under timeout(1) ($i): exit 130"
  expect_no_grep "killing the workers now" "$T/cc.out" "one Ctrl-C under timeout(1) ($i): timeout's echoes are not a second Ctrl-C"
  expect_grep "SIGINT: stopping at step [0-9]+ of [0-9]+; final checkpoint written" "$T/cc.out" "one Ctrl-C under timeout(1) ($i): the final checkpoint"
done
finish
