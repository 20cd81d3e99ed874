# Elastic fault handling across hosts on the netns test bed (3 hosts x 1 slot): whom the
# watchdog blames when the hung rank is on another host than its blocked peers; a signal
# while a lost host is being retried, and in the back-off before a restart.
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/testbed_lib.sh"
testbed_up 3
jq_() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }
SSH_OPTS='"ssh": {"options": ["-F", "'"$TESTBED_SSH_CONFIG"'"], "connect_timeout_s": 3}'

# A worker in a "collective" loop: a step completes (file step touched) once every rank has
# beaten since the last one, and each rank's watchdog shows the last completed step. A
# stopped rank holds every rank's progress, as in an all-reduce: all go silent at once.
# From round 1 on it just exits 0.
cat > "$T/collective.sh" <<'EOF'
#!/bin/sh
d=$1
echo $$ > "$d/pid.$DTRAIN_ROUND.$RANK"
[ "$DTRAIN_ROUND" -ge 1 ] && exit 0
while :; do
  touch "$d/hb.$RANK"
  [ "$(find "$d" -name 'hb.*' -newer "$d/step" | wc -l)" -eq "$WORLD_SIZE" ] && touch "$d/step"
  touch -r "$d/step" "$DTRAIN_WATCHDOG_FILE"
  sleep 0.2
done
EOF
chmod +x "$T/collective.sh"

# 1. The worker on h3 is stopped (SIGSTOP): every rank goes silent at the same moment, and
#    the agents of h1 and h2 each see only their own silent worker. The stopped one on h3 is
#    the one killed and blamed (it was a coin toss which agent acted first). Three times: the
#    wrong blame came about half the time.
for i in 1 2 3; do
  d="$T/hang$i"; mkdir -p "$d"; touch "$d/step"
  cat > "$d/job.json" <<JSON
{"name": "hang", "hostfile": "$TESTBED_HOSTFILE", "max_restarts": 1, "restart_backoff_s": 0.1, "worker_timeout_s": 3,
 "shutdown_timeout_s": 2, $SSH_OPTS, "command": ["$T/collective.sh", "$d"]}
JSON
  "$DTRAIN" run "$d/job.json" --summary-json "$d/sum.json" >"$d/out" 2>"$d/err" &
  DTRAIN_PID=$!
  wait_for "$d/hb.0" "$d/hb.1" "$d/hb.2" "$d/pid.0.2"
  sleep 0.5
  kill -STOP "$(cat "$d/pid.0.2")"
  wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  expect_eq "$rc" 0 "hang $i: restarted and completed"
  expect_grep "event worker_hung \(round 0\) host h3 rank 2: no heartbeat for [0-9.]+ s \(worker_timeout_s 3\); killed as hung \(it was stopped: state T\)" \
    "$d/err" "hang $i: the stopped rank on h3 is blamed"
  expect_eq "$(jq_ "$d/sum.json" "[(e['host'], e['rank']) for e in d['events'] if e['kind'] == 'worker_hung']")" \
    "[('h3', 2)]" "hang $i: one worker_hung event, h3 rank 2"
done
# 2. Ctrl-C while a lost host is retried: h3 is cut off the network, lost (silent heartbeat),
#    and tried again after its cooldown; that ssh waits for its ConnectTimeout (10 s). The
#    launcher kills it at once and ends within a few seconds, as the pre-flight does.
d="$T/retry"; mkdir -p "$d"
cat > "$d/job.json" <<JSON
{"name": "retry", "hostfile": "$TESTBED_HOSTFILE", "min_nodes": 2, "max_restarts": 3, "restart_backoff_s": 1,
 "shutdown_timeout_s": 2, "rendezvous": {"heartbeat_timeout_s": 2},
 "ssh": {"options": ["-F", "$TESTBED_SSH_CONFIG"], "connect_timeout_s": 10},
 "command": ["sh", "-c", "echo \$\$ > $d/pid.\$DTRAIN_ROUND.\$RANK; exec sleep 60"]}
JSON
"$DTRAIN" run "$d/job.json" --summary-json "$d/sum.json" >"$d/out" 2>"$d/err" &
DTRAIN_PID=$!
wait_for "$d/pid.0.0" "$d/pid.0.1" "$d/pid.0.2"
ip link set dtb-v3 down
for _ in $(seq 150); do grep -q "trying h3 .* again" "$d/err" && break; sleep 0.1; done
expect_grep "trying h3 .* again" "$d/err" "retry: h3 is retried"
sleep 0.5
start=$(date +%s%N)
kill -INT "$DTRAIN_PID"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
ms=$(( ($(date +%s%N) - start) / 1000000 ))
ip link set dtb-v3 up
expect_eq "$rc" 130 "retry: Ctrl-C ends the job, exit 130"
[ "$ms" -le 3000 ] && pass "retry: ended ${ms} ms after Ctrl-C" || fail "retry: ended ${ms} ms after Ctrl-C (the retry's ssh was waited for)"
pgrep -f "ssh .* h3 exec" >/dev/null && fail "retry: an ssh to h3 is left" || pass "retry: no ssh to h3 left"
for h in h1 h2 h3; do tb_wait_no_pids $h 8 || fail "retry: leftovers on $h"; done
# 3. Ctrl-C in the back-off before a restart (restart_backoff_s 8): one headline says both,
#    the stop and the failure it was restarting from, on stderr and in the summary's error
#    (as on one node); no worker runs, and the notice does not claim to SIGTERM any.
d="$T/backoff"; mkdir -p "$d"
cat > "$d/job.json" <<JSON
{"name": "bo", "hostfile": "$TESTBED_HOSTFILE", "max_restarts": 3, "restart_backoff_s": 8, "shutdown_timeout_s": 2, $SSH_OPTS,
 "command": ["sh", "-c", "echo \$\$ > $d/pid.\$RANK; if [ \$RANK = 1 ]; then sleep 0.5; exit 4; fi; exec sleep 60"]}
JSON
"$DTRAIN" run "$d/job.json" --summary-json "$d/sum.json" >"$d/out" 2>"$d/err" &
DTRAIN_PID=$!
for _ in $(seq 150); do grep -q "event restart" "$d/err" && break; sleep 0.1; done
sleep 1
kill -INT "$DTRAIN_PID"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 130 "backoff: exit 130"
head="job 'bo' stopped by SIGINT during the back-off before restart 1 of 3, after rank 1 exited with code 4; 2 other worker(s) ended during teardown; exit code 130"
grep -qxF "dtrain: $head" "$d/err" && pass "backoff: one headline for the stop and the failure" || fail "backoff: no headline: $(cat "$d/err")"
expect_grep "^    host:       h2$" "$d/err" "backoff: the failure's details follow"
expect_grep "^dtrain: SIGINT: stopping during the back-off before restart 1 of 3; no worker runs$" "$d/err" "backoff: the notice"
grep -q "SIGTERM to the workers now\|^dtrain: stopped by SIGINT" "$d/err" && fail "backoff: a generic line: $(cat "$d/err")" || pass "backoff: no generic lines"
expect_eq "$(jq_ "$d/sum.json" "(d['error'], d['restarts'], d['stopped_by'])")" "(\"$head\", 1, 'SIGINT')" "backoff: the summary's error, restarts, stopped_by"
finish
