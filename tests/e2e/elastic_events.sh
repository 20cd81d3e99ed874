# Elastic events across nodes, on this machine: which round an event carries between a
# restart's announcement and its round's start, and who a restart (or the job's failure) is
# blamed on when a node vanishes and its peers' collectives fail with it.
# Two made-up hosts go through a fake ssh on PATH (TEST-NET addresses, nothing leaves this
# machine): FAR runs the remote command here, and its agent's end reaches the launcher 0.5 s
# late, as over a network; DOWN is unreachable, and its retry holds on until a restart has
# been announced, then fails.
source "$(dirname "$0")/lib.sh"
jq_() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }
# (not addresses of this machine: a host of a test bed may own one, and is then local)
mine=" $(hostname -I 2>/dev/null) "
free=()
for a in 198.51.100.7 198.51.100.8 203.0.113.7 203.0.113.8; do case "$mine" in *" $a "*) ;; *) free+=("$a") ;; esac; done
FAR=${free[0]} DOWN=${free[1]}
export FAKE_DIR="$T" FAKE_FAR="$FAR"
mkdir -p "$T/bin"
cat > "$T/bin/ssh" <<'SH'
#!/bin/sh
for a; do host=$last; last=$a; done
case "$host" in
  "$FAKE_FAR")
    export SSH_CONNECTION="127.0.0.1 1 127.0.0.1 22"
    sh -c "${last#exec }"; rc=$?
    case "$last" in *" agent "*) sleep 0.5 ;; esac
    exit $rc ;;
  *)
    case "$last" in *" agent "*)
      touch "$FAKE_DIR/retrying"
      for _ in $(seq 100); do grep -q "event restart" "$FAKE_DIR/err" && break; sleep 0.1; done ;;
    esac
    echo "ssh: connect to host $host port 22: Connection refused" >&2
    exit 255 ;;
esac
SH
chmod +x "$T/bin/ssh"
BIN=$(readlink -f "$DTRAIN")
# The pid of this run's agent for NODE (a descendant of the launcher, never found by name alone).
agent_of() {
  ps -e -o pid=,ppid=,args= | awk -v root="$DTRAIN_PID" -v bin="$BIN" -v node="$1" '
    { parent[$1] = $2; if ($3 == bin && $4 == "agent") for (i = 5; i < NF; i++) if ($i == "--node" && $(i + 1) == node) cand[$1] = 1 }
    END { for (p in cand) for (q = p; q > 1; q = parent[q]) if (parent[q] == root) { print p; exit } }'
}
wait_grep() {  # PATTERN FILE: up to 20 s
  for _ in $(seq 200); do grep -qE -- "$1" "$2" && return 0; sleep 0.1; done
  fail "timed out waiting for /$1/ in $2"; return 1
}
events_() { jq_ "$1" "[(e['kind'], e['round']) for e in d['events']]"; }

# 1. A retry that fails during a restart's back-off is an event of the round that restart
# opens (it said the previous round's number, after the restart had announced the next).
cmd='if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then while [ ! -e "$D/retrying" ]; do sleep 0.05; done; exit 3; fi; exit 0'
D="$T" PATH="$T/bin:$PATH" timeout -k 5 30 "$DTRAIN" run --hosts localhost:1,$DOWN:1 --nnodes 1:2 --max-restarts 1 \
  --summary-json "$T/retry.json" -- sh -c "$cmd" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "retry in the back-off: the job restarts and succeeds"
expect_eq "$(events_ "$T/retry.json")" "[('host_excluded', 0), ('restart', 1), ('host_excluded', 1)]" \
  "retry in the back-off: its host_excluded carries the announced round"
expect_grep "event host_excluded \(round 1\) host $DOWN: $DOWN \(--hosts\) did not come back: its agent \(ssh\) exited with 255: ssh: connect to host $DOWN port 22: Connection refused" \
  "$T/err" "retry in the back-off: round 1 on stderr too"

# 2. A node lost while the next round forms (its report of round 1 held back) is lost in
# that round, the one its restart event announced (it said the round before). The round never
# started: it forms again without the node, spending no second restart (docs/elastic.md).
cmd='echo $$ > "$D/pid.$RANK.$TORCHELASTIC_RESTART_COUNT"; case $TORCHELASTIC_RESTART_COUNT in 0) [ "$RANK" = 0 ] && exit 3; exec sleep 60 ;; esac; exit 0'
D="$T" DTRAIN_TEST_REPORT_DELAY=127.0.0.1:8000@1 timeout -k 5 30 "$DTRAIN" run --hosts localhost:1,127.0.0.1:1 --nnodes 1:2 \
  --max-restarts 2 --summary-json "$T/forming.json" -- sh -c "$cmd" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
wait_for "$T/pid.0.1" && kill -9 "$(agent_of 127.0.0.1)"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 0 "node lost while round 1 forms: restarted without it, succeeded"
# (then the host may come back and join round 3 before the job ends)
expect_eq "$(events_ "$T/forming.json" | sed -E "s/, \('node_joined', [0-9]+\)//")" "[('restart', 1), ('node_lost', 1), ('host_excluded', 1)]" \
  "node lost while round 1 forms: its events carry round 1"
expect_eq "$(jq_ "$T/forming.json" "d['restarts']")" 1 "node lost while round 1 forms: one restart"

# 3. A node vanishes (its agent SIGKILLed) while its workers are in a collective: the peer on
# the other node fails ("lost rank 1"), and its report reaches the launcher before the lost
# node's (0.5 s late here). The restart is the lost node's, not the collateral rank's.
cat > "$T/train.json" <<JSON
{"name": "vanish", "trainer": {"model": {"layers": [32, 64, 4]},
  "data": {"type": "synthetic", "train_samples": 4096, "eval_samples": 0, "seed": 3},
  "batch_size": 16, "epochs": 1000000, "optimizer": {"type": "sgd", "lr": 0.01}, "log_every_steps": 500}}
JSON
vanish() {  # SUMMARY ARGS...: starts the job, SIGKILLs $FAR's agent once both ranks train
  # (no `timeout` around it: it would pass a SIGINT on to its whole process group too, a
  # second Ctrl-C that may find dtrain writing its summary)
  PATH="$T/bin:$PATH" "$DTRAIN" run "$T/train.json" --hosts localhost:1,$FAR:1 --summary-json "$1" \
    "${@:2}" >"$T/out" 2>"$T/err" &
  DTRAIN_PID=$!
  wait_grep "^\[localhost rank 0\] epoch .* step " "$T/out" && kill -9 "$(agent_of $FAR)"
}
vanish "$T/vanish.json" --nnodes 1:2 --max-restarts 1
wait_grep "event restart" "$T/err"
kill -INT "$DTRAIN_PID"; wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 130 "vanished node: stopped by SIGINT in the back-off"
expect_grep "^\[localhost rank 0\] .*lost rank 1" "$T/err" "vanished node: its peer failed with it (the race is staged)"
expect_eq "$(jq_ "$T/vanish.json" "[(e['kind'], e['round'], e['host'], e['rank']) for e in d['events']][:3]")" \
  "[('node_lost', 0, '$FAR', None), ('host_excluded', 0, '$FAR', None), ('restart', 1, '$FAR', None)]" \
  "vanished node: the restart is the lost node's"
expect_grep "^dtrain: event restart \(round 1\) host $FAR: node $FAR \(--hosts\) lost: its agent \(ssh\) exited with 137.*; 1 node\(s\) left \(min_nodes 1\); restart 1 of 1$" \
  "$T/err" "vanished node: the restart event names the node"
expect_eq "$(jq_ "$T/vanish.json" "d['restarts']")" 1 "vanished node: one incident, one restart"
# Without restarts the job fails on the lost node, exit 1, not on the rank that lost its peer.
vanish "$T/vanish0.json"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 1 "vanished node, no restarts: exit 1 (a node was lost)"
expect_grep "^dtrain: job 'vanish' failed: node $FAR \(--hosts\) lost: its agent \(ssh\) exited with 137" "$T/err" \
  "vanished node, no restarts: the headline blames the node"
expect_eq "$(jq_ "$T/vanish0.json" "d['error'].startswith(\"job 'vanish' failed: node $FAR (--hosts) lost: \")")" True \
  "vanished node, no restarts: so does the summary's error"
# (the peer lost rank 1 and waited for the teardown's SIGTERM: stopped by dtrain, exit 143,
# not a failure of its own; docs/elastic.md, "The built-in trainer")
expect_eq "$(jq_ "$T/vanish0.json" "[(r['rank'], r['exit_code'], r['stopped_by_dtrain'], r['lost']) for r in d['ranks']]")" "[(0, 143, True, False), (1, None, False, True)]" \
  "vanished node, no restarts: the peer's exit is listed (stopped by dtrain), the lost rank marked lost"
finish
