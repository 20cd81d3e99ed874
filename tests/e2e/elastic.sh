# Elastic restarts through the real binary on this machine: a single node, and two local
# nodes driven through agents. Restart budget, TORCHELASTIC_RESTART_COUNT, events in the
# summary, a hung (SIGSTOPped) worker killed by the watchdog.
source "$(dirname "$0")/lib.sh"
jq_() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }
# The pid of the agent of node $1 (a regex: dots escaped) once it runs (up to 5 s).
agent_of() {
  local pid=""
  for _ in $(seq 100); do pid=$(pgrep -f "^$DTRAIN agent .*--node $1( |\$)" | head -1); [ -n "$pid" ] && break; sleep 0.05; done
  echo "$pid"
}

# kill_second_node JOIN_DELAY AFTER SPEC SUMMARY: runs SPEC on three local nodes (with
# DTRAIN_TEST_JOIN_DELAY=JOIN_DELAY), kills 127.0.0.1's agent AFTER seconds in; sets rc.
kill_second_node() {
  DTRAIN_TEST_JOIN_DELAY="$1" timeout -k 5 60 "$DTRAIN" run "$3" --hosts 'localhost:1,127.0.0.1:1,[::1]:1' \
    --summary-json "$4" >"$T/out" 2>"$T/err" &
  DTRAIN_PID=$!
  local agent
  agent=$(agent_of "127\.0\.0\.1")
  sleep "$2"; kill -9 "$agent"
  wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
}

# A worker that fails on the first attempt: one restart, then success; it sees restart count 1.
cmd='echo "attempt $TORCHELASTIC_RESTART_COUNT round $DTRAIN_ROUND" >> '"$T"'/seen.$RANK; if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then exit 3; fi; [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && exec sleep 30; exit 0'
"$DTRAIN" run --nproc-per-node 2 --max-restarts 2 --summary-json "$T/s1.json" -- sh -c "$cmd" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "single node: fails once, restarts, succeeds"
expect_eq "$(tail -1 "$T/seen.0")" "attempt 1 round 1" "rank 0 saw TORCHELASTIC_RESTART_COUNT=1 after the restart"
expect_eq "$(jq_ "$T/s1.json" "d['restarts']")" 1 "summary: restarts 1"
expect_eq "$(jq_ "$T/s1.json" "[e['kind'] for e in d['events']]")" "['restart']" "summary: one restart event"
expect_grep "event restart \(round 1\) host .* rank 1: rank 1 exited with code 3; restart 1 of 2" "$T/err" "restart event line"

# Budget exhausted: fails within one restart cycle, with the worker's exit code.
start=$(date +%s)
"$DTRAIN" run --nproc-per-node 1 --max-restarts 2 --summary-json "$T/s2.json" -- sh -c 'exit 7' >"$T/out" 2>"$T/err"
rc=$?; took=$(( $(date +%s) - start ))
expect_eq "$rc" 7 "budget exhausted: the worker's exit code"
expect_eq "$(jq_ "$T/s2.json" "d['restarts']")" 2 "summary: restarts 2"
expect_grep "restart budget exhausted: 2 restart\(s\) of 2 used" "$T/err" "summary says the budget is spent"
expect_eq "$(jq_ "$T/s2.json" "d['error']")" "job 'sh' failed: rank 0 exited with code 7; restart budget exhausted: 2 restart(s) of 2 used" \
  "budget exhausted: said in the summary's error"
[ "$took" -lt 10 ] && pass "back-off 1 s + 2 s (${took}s)" || fail "took ${took}s"

# A worker that wrote a TORCHELASTIC_ERROR_FILE (PyTorch's @record): the restart event says
# its message, one line, cut at 160 bytes (it said only "exited with code 1").
cat > "$T/rec.py" <<'PY'
import json, os, sys
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    msg = sys.argv[1] + "\nsecond line"
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
        json.dump({"message": {"message": msg, "extraInfo": {"py_callstack": "Traceback", "timestamp": "0"}}}, f)
    sys.exit(1)
PY
"$DTRAIN" run --nproc-per-node 2 --max-restarts 1 --summary-json "$T/rec.json" -- python3 "$T/rec.py" "ValueError: learning rate must be positive" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "error file: restarted and succeeded"
expect_eq "$(jq_ "$T/rec.json" "d['events'][0]['reason']")" "rank 1 exited with code 1 (ValueError: learning rate must be positive); restart 1 of 1" "error file: its message in the restart event"
expect_grep "event restart \(round 1\) host .* rank 1: rank 1 exited with code 1 \(ValueError: learning rate must be positive\); restart 1 of 1$" "$T/err" "error file: restart event line"
long=$(printf 'RuntimeError: %0300d' 0)
"$DTRAIN" run --hosts localhost:1,127.0.0.1:1 --max-restarts 1 --summary-json "$T/rec2.json" -- python3 "$T/rec.py" "$long" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "error file, two nodes: restarted and succeeded"
expect_eq "$(jq_ "$T/rec2.json" "d['events'][0]['reason']")" "rank 1 on 127.0.0.1 exited with code 1 (${long:0:160}...); restart 1 of 1" "error file, two nodes: message cut to one short line"

# Ctrl-C during a restart's back-off: the restart the events announce is counted, and
# stderr says once that the user stopped it and after which failure (it said "restarts": 0,
# and printed a "job failed" block and a separate "stopped by" line).
echo '{"name": "bo", "command": ["sh", "-c", "exit 4"], "max_restarts": 3, "restart_backoff_s": 20}' > "$T/bo_spec.json"
"$DTRAIN" run "$T/bo_spec.json" --nproc-per-node 1 --summary-json "$T/bo.json" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
for _ in $(seq 100); do grep -q "event restart" "$T/err" && break; sleep 0.1; done
kill -INT "$DTRAIN_PID"; wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 130 "signal in the back-off: exit 130"
expect_eq "$(jq_ "$T/bo.json" "(d['restarts'], [e['reason'] for e in d['events']], d['stopped_by'])")" \
  "(1, ['rank 0 exited with code 4; restart 1 of 3'], 'SIGINT')" "signal in the back-off: restarts agree with the events"
expect_grep "^dtrain: job 'bo' stopped by SIGINT during the back-off before restart 1 of 3, after rank 0 exited with code 4; exit code 130$" "$T/err" "signal in the back-off: one headline"
expect_eq "$(grep -c "failed:\|^dtrain: stopped by" "$T/err")" 0 "signal in the back-off: no second verdict"
expect_grep "^  first failure:" "$T/err" "signal in the back-off: the failure's details"
# Ctrl-C during the teardown after a failure (restarts left; the failed rank's peer ignores
# SIGTERM): the signal ended the job, cutting the restart short. One headline says both, as
# in the back-off (it said "job failed: rank 1 exited with code 9", then "stopped by SIGINT").
cat > "$T/td.sh" <<'SH'
trap '' TERM
if [ "$RANK" = 1 ]; then sleep 0.3; exit 9; fi
exec sleep 60
SH
"$DTRAIN" run --nproc-per-node 2 --max-restarts 2 --summary-json "$T/td.json" -- sh "$T/td.sh" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
for _ in $(seq 100); do grep -q "rank 1 failed; waiting" "$T/err" && break; sleep 0.1; done
kill -INT "$DTRAIN_PID"; wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 130 "signal in the teardown: exit 130"
head="job 'td.sh' stopped by SIGINT during the teardown before restart 1 of 2, after rank 1 exited with code 9; 1 other worker(s) ended during teardown; exit code 130"
grep -qxF "dtrain: $head" "$T/err" && pass "signal in the teardown: one headline" || fail "signal in the teardown: $(cat "$T/err")"
expect_eq "$(grep -c "failed:\|^dtrain: stopped by" "$T/err")" 0 "signal in the teardown: no second verdict"
expect_eq "$(jq_ "$T/td.json" "(d['error'], d['restarts'], d['events'], d['stopped_by'])")" "(\"$head\", 0, [], 'SIGINT')" \
  "signal in the teardown: the summary's error; no restart spent or announced"
# The same across nodes, within the restart's back-off (5 s) while the peer still stops: the
# teardown, not the back-off (it said the back-off whenever its clock had not run out).
echo '{"name": "td2", "max_restarts": 2, "restart_backoff_s": 5, "command": ["sh", "'"$T/td.sh"'"]}' > "$T/td2.json"
"$DTRAIN" run "$T/td2.json" --hosts localhost:1,127.0.0.1:1 >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
for _ in $(seq 100); do grep -q "event restart" "$T/err" && break; sleep 0.1; done
sleep 0.3; kill -INT "$DTRAIN_PID"; wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 130 "signal in the teardown across nodes: exit 130"
expect_grep "^dtrain: job 'td2' stopped by SIGINT during the teardown before restart 1 of 2, after rank 1 exited with code 9" "$T/err" "signal in the teardown across nodes: the teardown, not the back-off"
# A command that cannot be started is not restarted: every attempt would fail the same way.
# (A missing program or #! interpreter is refused before the launch; a #! line that leads
# to itself gets as far as exec: ELOOP, 126.)
printf '#!%s\n' "$T/dtrain-loop-prog" > "$T/dtrain-loop-prog"; chmod +x "$T/dtrain-loop-prog"
printf '{"name": "loop", "command": ["%s", "x"], "nproc_per_node": 2, "max_restarts": 3}' "$T/dtrain-loop-prog" > "$T/loop.json"
start=$(date +%s)
"$DTRAIN" run "$T/loop.json" --summary-json "$T/s2b.json" >"$T/out" 2>"$T/err"
rc=$?; took=$(( $(date +%s) - start ))
expect_eq "$rc" 126 "command that cannot be exec'ed: exit 126"
expect_eq "$(jq_ "$T/s2b.json" "d['restarts']")" 0 "command that cannot be exec'ed: no restart spent"
expect_eq "$(grep -c "cannot run '$T/dtrain-loop-prog'" "$T/err")" 3 "one attempt only (2 worker lines + the summary's tail)"
expect_grep "not restarted: rank [01]'s command '.*dtrain-loop-prog' cannot be started \(see its error below\); fix the command, PATH or cwd in $T/loop.json$" "$T/err" "says why it is not restarted, naming the spec"
[ "$took" -lt 2 ] && pass "no back-off (${took}s)" || fail "took ${took}s"

# A stopped worker that armed its watchdog is killed as hung and restarted.
cat > "$T/hang.sh" <<'SH'
touch "$DTRAIN_WATCHDOG_FILE"
if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 0 ]; then kill -STOP $$; fi
for i in 1 2 3 4; do touch "$DTRAIN_WATCHDOG_FILE"; sleep 0.5; done
SH
cat > "$T/hang.json" <<JSON
{"name": "hang", "command": ["sh", "$T/hang.sh"], "nproc_per_node": 2, "max_restarts": 1, "worker_timeout_s": 2}
JSON
start=$(date +%s.%N)
"$DTRAIN" run "$T/hang.json" --summary-json "$T/s3.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "hung worker detected, restarted, job completes"
expect_grep "event worker_hung \(round 0\) host .* rank 0: no heartbeat for 2\.[0-2] s \(worker_timeout_s 2\); killed as hung" "$T/err" "hung event within worker_timeout_s + 10%"
expect_eq "$(jq_ "$T/s3.json" "[e['kind'] for e in d['events']]")" "['worker_hung', 'restart']" "summary events"

# Silence is measured on the steady clock: a worker whose every touch lands an hour in the
# past (as after the wall clock stepped an hour ahead) is alive, not hung; one that stops
# touching after that is still caught within worker_timeout_s.
cat > "$T/skew.sh" <<'SH'
for i in $(seq 15); do touch -d "@$(date -d '1 hour ago' +%s.%N)" "$DTRAIN_WATCHDOG_FILE"; sleep 0.2; done
[ "$RANK" = 1 ] && exec sleep 30
exit 0
SH
cat > "$T/skew.json" <<JSON
{"name": "skew", "command": ["sh", "$T/skew.sh"], "nproc_per_node": 2, "max_restarts": 0, "worker_timeout_s": 2}
JSON
"$DTRAIN" run "$T/skew.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 137 "watchdog touches an hour old: the worker that stops is killed as hung"
expect_grep "event worker_hung \(round 0\) host .* rank 1: no heartbeat for 2\.[0-2] s \(worker_timeout_s 2\)" "$T/err" "watchdog touches an hour old: only the silence counts, on the steady clock"
expect_eq "$(grep -c 'worker_hung' "$T/err")" 1 "watchdog touches an hour old: the live workers were not killed"

# The hung rank is blamed, not the peer that went silent first waiting for it: rank 0 stops
# beating (as if blocked in an all-reduce), then rank 1 is stopped.
cat > "$T/blame.sh" <<'SH'
touch "$DTRAIN_WATCHDOG_FILE"
if [ "$RANK" = 0 ]; then exec sleep 30; fi
for i in 1 2 3 4 5; do touch "$DTRAIN_WATCHDOG_FILE"; sleep 0.1; done
kill -STOP $$
SH
cat > "$T/blame.json" <<JSON
{"name": "blame", "command": ["sh", "$T/blame.sh"], "nproc_per_node": 2, "max_restarts": 0, "worker_timeout_s": 2}
JSON
"$DTRAIN" run "$T/blame.json" --summary-json "$T/s3b.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 137 "stopped rank killed as hung"
expect_grep "event worker_hung \(round 0\) host .* rank 1: no heartbeat for .* killed as hung \(it was stopped: state T\); also silent: rank 0 .*peers blocked in a collective" "$T/err" "the stopped rank is blamed, not the silent peer"
expect_eq "$(grep -c 'worker_hung' "$T/err")" 1 "only one rank killed as hung"
expect_grep "^dtrain: job '.*' failed: rank 1 hung \(no heartbeat within worker_timeout_s\) and was killed" "$T/err" "the headline says hung, not only SIGKILL"
# A rank that hangs mid-step (not stopped) and its peer, waiting for it, last touched the
# file at the same moment: the event says that which one hung cannot be told, rather than
# pretending the one it killed is the one.
cat > "$T/tie.sh" <<SH
touch "$T/tie.\$RANK"
while [ ! -e "$T/tie.0" ] || [ ! -e "$T/tie.1" ]; do sleep 0.01; done
touch "\$DTRAIN_WATCHDOG_FILE"
exec sleep 30
SH
cat > "$T/tie.json" <<JSON
{"name": "tie", "command": ["sh", "$T/tie.sh"], "nproc_per_node": 2, "max_restarts": 0, "worker_timeout_s": 1}
JSON
"$DTRAIN" run "$T/tie.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 137 "two ranks silent alike: one killed as hung"
expect_grep "event worker_hung \(round 0\) host .* rank [01]: no heartbeat for .*; also silent: rank [01] .*blamed: the one silent longest, by 0\.[0-9]+ s: too close to tell which one hung\)" "$T/err" "silences alike: said that the hung rank cannot be told"

# Two local nodes: a failure on node 1 restarts both nodes; the budget is the job's.
"$DTRAIN" run --hosts localhost:1,127.0.0.1:1 --max-restarts 1 --summary-json "$T/s4.json" -- sh -c "$cmd" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "two nodes: fails once, restarts, succeeds"
expect_eq "$(tail -1 "$T/seen.1")" "attempt 1 round 1" "node 1 worker saw restart count 1, round 1"
expect_eq "$(jq_ "$T/s4.json" "(d['restarts'], [r['exit_code'] for r in d['ranks']])")" "(1, [0, 0])" "summary: 1 restart, final ranks succeeded"
"$DTRAIN" run --hosts localhost:1,127.0.0.1:1 --max-restarts 1 --summary-json "$T/s5.json" -- sh -c 'sleep 0.3; exit 5' >"$T/out" 2>"$T/err"
expect_eq "$?" 5 "two nodes: budget exhausted exits with the worker's code"
expect_grep "restart budget exhausted: 1 restart\(s\) of 1 used" "$T/err" "two nodes: budget message"
expect_grep "^dtrain: job 'sh' failed: rank [01] exited with code 5; .*restart budget exhausted: 1 restart\(s\) of 1 used$" "$T/err" \
  "two nodes: budget in the headline"
expect_eq "$(jq_ "$T/s5.json" "d['error'].endswith('; restart budget exhausted: 1 restart(s) of 1 used')")" True \
  "two nodes: budget in the summary's error"
# A node lost before round 0 has started (its report held back) is lost in round 0, not -1.
DTRAIN_TEST_REPORT_DELAY=127.0.0.1:8000 timeout -k 5 30 "$DTRAIN" run --hosts localhost:1,127.0.0.1:1 \
  --summary-json "$T/s6.json" -- sleep 30 >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
agent=$(agent_of "127\.0\.0\.1")
sleep 0.5; kill -9 "$agent"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 1 "node lost during startup: the job fails"
expect_grep "event node_lost \(round 0\) host 127.0.0.1" "$T/err" "node lost during startup: round 0 on stderr"
expect_eq "$(jq_ "$T/s6.json" "[(e['kind'], e['round']) for e in d['events']]")" "[('node_lost', 0)]" "node lost during startup: round 0 in the summary"

# ... and one frozen there (SIGSTOP: a hung mount, a swapping host) is lost by its heartbeat
# like a running one (before: a starting agent's heartbeat was not watched, and the job waited
# for it for good), and the elastic job goes on without it, then with it again.
cat > "$T/frz.json" <<JSON
{"name": "frz", "max_restarts": 1, "min_nodes": 1, "restart_backoff_s": 0.5, "shutdown_timeout_s": 3,
 "rendezvous": {"heartbeat_timeout_s": 3, "timeout_s": 20},
 "command": ["sh", "-c", "echo \$WORLD_SIZE > $T/frz.\$DTRAIN_ROUND.\$RANK; sleep 3"]}
JSON
DTRAIN_TEST_REPORT_DELAY=127.0.0.1:4000@0 timeout -k 5 60 "$DTRAIN" run "$T/frz.json" --hosts localhost:1,127.0.0.1:1 \
  --summary-json "$T/s7.json" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
for _ in $(seq 100); do [ -e "$T/frz.0.0" ] && break; sleep 0.1; done
agent=$(pgrep -f "^$DTRAIN agent .*--node 127\.0\.0\.1( |$)" | head -1)
kill -STOP "$agent"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
kill -CONT "$agent" 2>/dev/null; kill -9 "$agent" 2>/dev/null
expect_eq "$rc" 0 "agent frozen while starting: the job ends, and succeeds"
expect_grep "event node_lost \(round 0\) host 127.0.0.1: .*lost: no heartbeat for 3 s" "$T/err" "agent frozen while starting: lost by its heartbeat"
expect_eq "$(jq_ "$T/s7.json" "[e['kind'] for e in d['events']][:3]")" "['node_lost', 'host_excluded', 'restart']" "agent frozen while starting: the events"

# An agent frozen for 7 s mid-round (SIGSTOP), within heartbeat_timeout_s 15: nothing is
# lost. On waking it tries the store once more before calling it gone (before: its own pause
# was counted as the store's silence, past the 5 s it gives a store: "the launcher's store
# ... did not answer for 5 s; stopping this node's workers", the node lost, a restart spent).
cat > "$T/thaw.json" <<JSON
{"name": "thaw", "max_restarts": 1, "rendezvous": {"heartbeat_timeout_s": 15},
 "command": ["sh", "-c", "touch $T/thaw.\$RANK; sleep 10"]}
JSON
rm -f "$T"/thaw.[01]
timeout -k 5 60 "$DTRAIN" run "$T/thaw.json" --hosts localhost:1,127.0.0.1:1 --summary-json "$T/thaw.sum" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
for _ in $(seq 200); do [ -e "$T/thaw.0" ] && [ -e "$T/thaw.1" ] && break; sleep 0.05; done
agent=$(agent_of 127.0.0.1)
kill -STOP "$agent"; sleep 7; kill -CONT "$agent"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 0 "agent frozen 7 s mid-round: the job succeeds"
expect_no_grep "did not answer|node_lost" "$T/err" "agent frozen 7 s mid-round: its pause not taken for the store's silence"
expect_eq "$(jq_ "$T/thaw.sum" "d['restarts']")" 0 "agent frozen 7 s mid-round: no restart"

# The trainer's outcome in the summary is the last round's: a round stopped for a host that
# rejoined leaves a stopped outcome (its final checkpoint), and the next round, whose rank 1
# is then SIGKILLed with the budget spent, has none (before: the summary said "stopped" at
# the earlier round's step, its checkpoint since pruned).
cat > "$T/stale.json" <<JSON
{"name": "stale", "max_restarts": 1, "restart_backoff_s": 0.2, "env": {"OMP_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [16, 32, 4]}, "data": {"train_samples": 2560, "eval_samples": 64}, "batch_size": 16,
  "epochs": 100000, "log_every_steps": 1000000, "checkpoint": {"dir": "$T/stale-ck", "every_steps": 50}}}
JSON
timeout -k 5 90 "$DTRAIN" run "$T/stale.json" --hosts localhost:1,127.0.0.1:1 --nnodes 1:2 --summary-json "$T/stale.sum" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
for _ in $(seq 200); do grep -q "trainer: 2 workers" "$T/out" && break; sleep 0.05; done
kill -9 "$(agent_of 127.0.0.1)"
for _ in $(seq 300); do grep -q "node_joined" "$T/err" && [ "$(grep -c "trainer: 2 workers" "$T/out")" -ge 2 ] && break; sleep 0.05; done
sleep 1
back=$(agent_of 127.0.0.1); victim=$(pgrep -P "$back" -f " train " | head -1)
[ -n "$victim" ] && kill -9 "$victim"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 137 "a host rejoined, then a worker killed with the budget spent: exit 137"
expect_grep "event node_joined" "$T/err" "a host rejoined: the round before was stopped for it"
expect_eq "$(jq_ "$T/stale.sum" "d['trainer']")" None "the last round's rank 0 left no outcome: none in the summary, not the stopped round's"

# A node that does not join round 0 in time (DTRAIN_TEST_JOIN_DELAY stages an agent slow to
# start) in an elastic job: the round forms again without it when enough others joined, as a
# host that fails the pre-flight (no restart spent; tried again after its cooldown). Before,
# the joined agents' own timeout ended the job.
echo '{"name": "nj", "min_nodes": 1, "rendezvous": {"timeout_s": 2}, "command": ["sh", "-c", "echo rank $RANK of $WORLD_SIZE round $DTRAIN_ROUND"]}' > "$T/nj.json"
start=$(date +%s%N)
DTRAIN_TEST_JOIN_DELAY=127.0.0.1:6000@0 timeout -k 5 60 "$DTRAIN" run "$T/nj.json" --hosts localhost:1,127.0.0.1:1 \
  --summary-json "$T/nj.sum" >"$T/out" 2>"$T/err"
rc=$?; ms=$(( ($(date +%s%N) - start) / 1000000 ))
expect_eq "$rc" 0 "elastic, a node not joined in time: the job goes on without it, and succeeds"
expect_grep "^\[localhost rank 0\] rank 0 of 1 round 1$" "$T/out" "elastic, a node not joined in time: round 1 runs on the others"
expect_grep "event node_lost \(round 0\) host 127.0.0.1: node 127.0.0.1 \(--hosts\) lost: did not join round 0 within 2 s \(rendezvous.timeout_s\)$" "$T/err" \
  "elastic, a node not joined in time: said, with the timeout"
expect_eq "$(jq_ "$T/nj.sum" "(d['restarts'], [e['kind'] for e in d['events']])")" "(0, ['node_lost', 'host_excluded'])" \
  "elastic, a node not joined in time: no restart spent"
[ "$ms" -lt 5500 ] && pass "elastic, a node not joined in time: decided at the timeout (${ms} ms)" || fail "elastic, a node not joined in time: took ${ms} ms"
# Two late at once: both out before the round forms again (the second was taken into it as
# still there, then lost from it).
DTRAIN_TEST_JOIN_DELAY=127.0.0.1:6000@0,::1:6000@0 timeout -k 5 60 "$DTRAIN" run "$T/nj.json" \
  --hosts 'localhost:1,127.0.0.1:1,[::1]:1' --summary-json "$T/nj2.sum" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "elastic, two nodes not joined in time: the job goes on without both"
expect_grep "^\[localhost rank 0\] rank 0 of 1 round 1$" "$T/out" "elastic, two nodes not joined in time: round 1 runs on the one that joined"
expect_eq "$(jq_ "$T/nj2.sum" "(d['restarts'], sorted((e['kind'], e['host'], e['round']) for e in d['events']))")" \
  "(0, [('host_excluded', '127.0.0.1', 0), ('host_excluded', '::1', 0), ('node_lost', '127.0.0.1', 0), ('node_lost', '::1', 0)])" \
  "elastic, two nodes not joined in time: each lost and excluded once, in round 0, no restart spent"
# A node lost while round 0 forms (its agent killed before it joined): the others, which have
# said nothing yet (an agent speaks once its round forms), form round 1 without it (before,
# they were not counted as there: "0 node(s) available", and the job failed), spending no
# restart, as a host failing the pre-flight.
echo '{"name": "lost0", "min_nodes": 2, "rendezvous": {"timeout_s": 5}, "command": ["sh", "-c", "echo rank $RANK of $WORLD_SIZE round $DTRAIN_ROUND"]}' > "$T/lost0.json"
kill_second_node 127.0.0.1:3000@0 0.5 "$T/lost0.json" "$T/lost0.sum"
expect_eq "$rc" 0 "elastic, a node lost while round 0 forms: the others go on"
expect_eq "$(sort "$T/out")" "$(printf '[::1 rank 1] rank 1 of 2 round 1\n[localhost rank 0] rank 0 of 2 round 1')" \
  "elastic, a node lost while round 0 forms: round 1 runs on the two others"
expect_eq "$(jq_ "$T/lost0.sum" "(d['restarts'], [(e['kind'], e['round']) for e in d['events']])")" "(0, [('node_lost', 0), ('host_excluded', 0)])" \
  "elastic, a node lost while round 0 forms: no restart spent"
# A host let back in joins the new round at once, while the others still stop their workers
# (a trainer's final checkpoint; here a trap that takes 4 s, past timeout_s 3): the round opens
# once they have, so none of them is judged late (before: "round 2 timed out ...: 1 of at
# least 2 node(s) joined (arrived: 127.0.0.1)", and the job failed). The host is late for
# round 0 (frozen before it joins), and comes back after its cooldown.
cat > "$T/adm.json" <<'JSON'
{"name": "adm", "min_nodes": 1, "shutdown_timeout_s": 15, "rendezvous": {"timeout_s": 3},
 "command": ["sh", "-c", "echo rank $RANK of $WORLD_SIZE round $DTRAIN_ROUND; [ $DTRAIN_ROUND -ge 2 ] && exit 0; trap 'sleep 4; exit 0' TERM; sleep 30 & wait"]}
JSON
DTRAIN_TEST_JOIN_DELAY=127.0.0.1:1500@0 timeout -k 5 90 "$DTRAIN" run "$T/adm.json" --hosts 'localhost:1,127.0.0.1:1,[::1]:1' \
  --summary-json "$T/adm.sum" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
agent=$(agent_of "127\.0\.0\.1")
sleep 0.3; kill -STOP "$agent"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
kill -9 "$agent" 2>/dev/null
expect_eq "$rc" 0 "elastic, a host let back in while the others stop their workers: the job succeeds"
expect_eq "$(grep -c ' round 2$' "$T/out")" 3 "elastic, a host let back in: round 2 runs on all three"
expect_eq "$(jq_ "$T/adm.sum" "(d['restarts'], [e['kind'] for e in d['events']])")" "(0, ['node_lost', 'host_excluded', 'node_joined'])" \
  "elastic, a host let back in: excluded once, back once, nobody judged late"
# A host let back in that is late again (the hook holds it back every time) is excluded
# again, spending nothing: the job goes on on the others (spending the budget ended a job
# that ran well on min_nodes).
echo '{"name": "nj", "min_nodes": 1, "max_restarts": 1, "rendezvous": {"timeout_s": 2}, "command": ["sh", "-c", "echo rank $RANK of $WORLD_SIZE round $DTRAIN_ROUND; [ $DTRAIN_ROUND -ge 3 ] && exit 0; sleep 30"]}' > "$T/nj3.json"
DTRAIN_TEST_JOIN_DELAY=127.0.0.1:6000@0 timeout -k 5 60 "$DTRAIN" run "$T/nj3.json" --hosts localhost:1,127.0.0.1:1 \
  --summary-json "$T/nj3.sum" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "elastic, a host late again after its retry: the job goes on without it, and succeeds"
expect_eq "$(jq_ "$T/nj3.sum" "(d['restarts'], [(e['kind'], e['round']) for e in d['events']])")" \
  "(0, [('node_lost', 0), ('host_excluded', 0), ('node_joined', 2), ('node_lost', 2), ('host_excluded', 2)])" \
  "elastic, a host late again after its retry: excluded again, no restart spent"
expect_grep "^\[localhost rank 0\] rank 0 of 1 round 3$" "$T/out" "elastic, a host late again after its retry: round 3 on the other"
# An elastic job that ends while its next round forms (too few nodes came): the summary lists
# the round that ran, every rank of it, the lost node's as lost (it listed only the open
# round's, which no node started: ranks missing, or none).
cat > "$T/elc.json" <<JSON
{"name": "elc", "min_nodes": 2, "max_restarts": 3, "restart_backoff_s": 0.5, "shutdown_timeout_s": 2,
 "rendezvous": {"timeout_s": 1, "heartbeat_timeout_s": 3}, "command": ["sh", "-c", "exec sleep 60"]}
JSON
kill_second_node '::1:8000@1' 1.5 "$T/elc.json" "$T/elc.sum"
expect_eq "$rc" 1 "elastic, too few nodes for the next round: the job fails"
expect_eq "$(jq_ "$T/elc.sum" "[(r['rank'], r['host'], r['stopped_by_dtrain'], r['lost']) for r in d['ranks']]")" \
  "[(0, 'localhost', True, False), (1, '127.0.0.1', False, True), (2, '::1', True, False)]" \
  "elastic, too few nodes for the next round: the summary lists the round that ran, the lost rank as lost"
# Ctrl-C while the restart's round has started on some nodes (one's report held back): the
# headline names the failure that caused the restart, not the same rank's worker of the new
# round that the signal stopped (it said "after rank 1 killed by SIGINT").
cat > "$T/hl.json" <<JSON
{"name": "hl", "min_nodes": 2, "max_restarts": 3, "restart_backoff_s": 0, "shutdown_timeout_s": 5,
 "rendezvous": {"timeout_s": 4, "heartbeat_timeout_s": 3},
 "command": ["sh", "-c", "if [ \$DTRAIN_ROUND = 0 ] && [ \$GROUP_RANK = 1 ]; then sleep 1; touch $T/hl.mark; exit 1; fi; sleep 5"]}
JSON
DTRAIN_TEST_REPORT_DELAY="::1:3000@1" timeout -k 5 60 "$DTRAIN" run "$T/hl.json" --hosts 'localhost:1,127.0.0.1:1,[::1]:1' \
  --summary-json "$T/hl.sum" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
for _ in $(seq 100); do [ -e "$T/hl.mark" ] && break; sleep 0.1; done
sleep 1; kill -INT "$DTRAIN_PID"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 130 "Ctrl-C while a restart's round starts: exit 130"
expect_grep "^dtrain: job 'hl' stopped by SIGINT during the start of restart 1 of 3, after rank 1 exited with code 1; " "$T/err" \
  "Ctrl-C while a restart's round starts: the headline names the failure"
expect_eq "$(jq_ "$T/hl.sum" "[(r['rank'], r['exit_code']) for r in d['ranks'] if r['rank'] == 1]")" "[(1, 1)]" \
  "Ctrl-C while a restart's round starts: the summary's rank 1 is the failure"

# Too few joined for min_nodes: the round's timeout ends the job at rendezvous.timeout_s (the
# launcher's word: the agents wait a little longer), naming who did not join.
start=$(date +%s%N)
DTRAIN_TEST_JOIN_DELAY=127.0.0.1:6000@0,::1:6000@0 timeout -k 5 60 "$DTRAIN" run "$T/nj.json" --nnodes 2:3 \
  --hosts 'localhost:1,127.0.0.1:1,[::1]:1' >"$T/out" 2>"$T/err"
rc=$?; ms=$(( ($(date +%s%N) - start) / 1000000 ))
expect_eq "$rc" 1 "elastic, too few joined: exit 1"
expect_grep "^dtrain: job 'nj' failed: rendezvous round 0 timed out after 2 s: 1 of at least 2 node\(s\) joined \(arrived: localhost\); not joined: 127.0.0.1, ::1$" "$T/err" \
  "elastic, too few joined: the round's timeout names who did not join"
[ "$ms" -lt 5500 ] && pass "elastic, too few joined: ends at the timeout (${ms} ms)" || fail "elastic, too few joined: took ${ms} ms"

# A worker that fails before another node has reported starting the round still restarts
# the job (its failure used to be dropped as a consequence of the restart, and the job then
# waited forever on the other node's healthy workers). The hook holds localhost's report back.
fast='if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then exit 3; fi; [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && exec sleep 60; exit 0'
DTRAIN_TEST_REPORT_DELAY=localhost:700 timeout -k 5 20 "$DTRAIN" run --hosts localhost:1,127.0.0.1:1 --max-restarts 1 \
  -- sh -c "$fast" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "two nodes: a failure before the other node reported its round restarts the job"
expect_grep "rank 1 on 127.0.0.1 exited with code 3; restart 1 of 1" "$T/err" "early failure: restart event"
DTRAIN_TEST_REPORT_DELAY=localhost:700 timeout -k 5 20 "$DTRAIN" run --hosts localhost:1,127.0.0.1:1 \
  -- sh -c "$fast" >"$T/out" 2>"$T/err"
expect_eq "$?" 3 "two nodes, no restarts: an early failure ends the job with the worker's code"

# A host that freezes (SIGSTOP: swapping, a hung driver) with the watchdog on: its peer on the
# other host, blocked waiting for it, is found hung first (its watchdog is shorter than the
# heartbeat timeout) and restarts the job; the frozen host cannot answer the new round and is
# lost by its heartbeat while that round forms. One incident, one restart: the round forms
# again without it (before: a second restart was spent, and with max_restarts 1 the job failed
# although min_nodes 1 let it go on).
cat > "$T/fz.json" <<JSON
{"name": "fz", "max_restarts": 1, "min_nodes": 1, "restart_backoff_s": 0.5, "shutdown_timeout_s": 2, "worker_timeout_s": 2,
 "rendezvous": {"heartbeat_timeout_s": 6},
 "command": ["sh", "-c", "[ \$DTRAIN_ROUND -ge 1 ] && exit 0; echo \$\$ > $T/fz.\$RANK; while :; do [ -e $T/fz.frozen ] || touch \$DTRAIN_WATCHDOG_FILE; sleep 0.2; done"]}
JSON
rm -f "$T"/fz.*[0-9] "$T/fz.frozen"
timeout -k 5 90 "$DTRAIN" run "$T/fz.json" --hosts localhost:1,127.0.0.1:1 --summary-json "$T/s8.json" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
for _ in $(seq 100); do [ -e "$T/fz.0" ] && [ -e "$T/fz.1" ] && break; sleep 0.1; done
agent=$(pgrep -f "^$DTRAIN agent .*--node 127\.0\.0\.1( |$)" | head -1)
kill -STOP "$agent"; kill -STOP -- "-$(cat "$T/fz.1")"; touch "$T/fz.frozen"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
kill -CONT -- "-$(cat "$T/fz.1")" 2>/dev/null; kill -9 -- "-$(cat "$T/fz.1")" 2>/dev/null; kill -CONT "$agent" 2>/dev/null; kill -9 "$agent" 2>/dev/null
expect_eq "$rc" 0 "frozen host under the watchdog: the job goes on without it"
expect_eq "$(jq_ "$T/s8.json" "(d['restarts'], [e['kind'] for e in d['events']][:4])")" "(1, ['worker_hung', 'restart', 'node_lost', 'host_excluded'])" \
  "frozen host under the watchdog: one incident, one restart"

# A real PyTorch script that fails on its first attempt restarts and succeeds.
if /usr/bin/python3 -c "import torch" 2>/dev/null; then
  cat > "$T/flaky.py" <<'PY'
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and dist.get_rank() == 1:
    sys.exit(9)
dist.barrier()
print(f"rank {dist.get_rank()} ok at restart {os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
PY
  timeout 120 "$DTRAIN" run --nproc-per-node 2 --max-restarts 1 --env OMP_NUM_THREADS=1 -- /usr/bin/python3 "$T/flaky.py" >"$T/out" 2>"$T/err"
  expect_eq "$?" 0 "PyTorch job restarts and succeeds"
  expect_grep "^\[rank 0\] rank 0 ok at restart 1$" "$T/out" "PyTorch worker saw TORCHELASTIC_RESTART_COUNT=1"
fi
finish
