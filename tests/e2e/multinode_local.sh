# Multi-node through agents on this machine (local host entries run without ssh): the
# torchrun environment per node, output and logs, teardown on a failure and on signals,
# the built-in trainer across nodes, and no orphans when the launcher is SIGKILLed.
source "$(dirname "$0")/lib.sh"
HOSTS="localhost:2,127.0.0.1:1"

# Environment contract: 2 nodes, 2 + 1 workers, ranks contiguous per node.
"$DTRAIN" run --hosts "$HOSTS" --log-dir "$T/logs" -- sh -c "env > $T/env.\$RANK; echo hello from \$RANK" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "3 workers on 2 nodes exit 0"
v() { grep -E "^$2=" "$T/env.$1" | head -1 | cut -d= -f2-; }
for r in 0 1 2; do [ -f "$T/env.$r" ] || fail "rank $r did not run"; done
expect_eq "$(v 0 GROUP_RANK) $(v 1 GROUP_RANK) $(v 2 GROUP_RANK)" "0 0 1" "GROUP_RANK per node"
expect_eq "$(v 0 LOCAL_RANK) $(v 1 LOCAL_RANK) $(v 2 LOCAL_RANK)" "0 1 0" "LOCAL_RANK per node"
expect_eq "$(v 0 LOCAL_WORLD_SIZE) $(v 2 LOCAL_WORLD_SIZE)" "2 1" "LOCAL_WORLD_SIZE per node"
expect_eq "$(v 0 WORLD_SIZE) $(v 2 WORLD_SIZE)" "3 3" "WORLD_SIZE"
expect_eq "$(v 0 GROUP_WORLD_SIZE) $(v 2 GROUP_WORLD_SIZE)" "2 2" "GROUP_WORLD_SIZE"
expect_eq "$(v 0 CROSS_RANK) $(v 1 CROSS_RANK) $(v 2 CROSS_RANK)" "0 0 1" "CROSS_RANK (DeepSpeed's) per node"
expect_eq "$(v 0 LOCAL_SIZE) $(v 2 LOCAL_SIZE)" "2 1" "LOCAL_SIZE (DeepSpeed's) per node"
expect_eq "$(v 0 CROSS_SIZE) $(v 2 CROSS_SIZE)" "2 2" "CROSS_SIZE (DeepSpeed's)"
expect_eq "$(v 0 DTRAIN_NNODES)" 2 "DTRAIN_NNODES"
expect_eq "$(v 0 MASTER_PORT)" "$(v 2 MASTER_PORT)" "one MASTER_PORT"
expect_eq "$(v 0 MASTER_ADDR)" "$(v 2 MASTER_ADDR)" "one MASTER_ADDR"
expect_eq "$(v 0 DTRAIN_STORE_TOKEN)" "$(v 2 DTRAIN_STORE_TOKEN)" "one store token"
expect_eq "$(v 0 TORCHELASTIC_RUN_ID)" "$(v 2 TORCHELASTIC_RUN_ID)" "one run id"
[ "$(v 0 MASTER_PORT)" != "$(v 0 DTRAIN_STORE_PORT)" ] && pass "MASTER_PORT is not the store port" || fail "MASTER_PORT = store port"
expect_grep "^\[localhost rank 1\] hello from 1$" "$T/out" "lines prefixed with host and rank"
expect_grep "^\[127.0.0.1 rank 2\] hello from 2$" "$T/out" "second node's lines"
expect_eq "$(grep -v '^==== dtrain run ' "$T/logs/rank_2.log")" "hello from 2" "per-rank log file on the launching host"

# A forwarded prefix that matches a worker identity variable of the launcher's (dtrain run
# inside another launcher's worker) forwards the others, never the identity: each worker
# keeps its own.
LOCAL_RANK=7 LOCAL_DATA=x "$DTRAIN" run --hosts localhost:1,127.0.0.1:1 --env-forward LOCAL_ -- sh -c 'echo "lr=$LOCAL_RANK data=$LOCAL_DATA"' >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "--env-forward LOCAL_ with LOCAL_RANK in the launcher's environment"
expect_eq "$(grep -c 'lr=0 data=x$' "$T/out")" 2 "forwarded prefix: identity variables stay each worker's own"

# Rank logs across nodes: every rank of a round gets its file, a silent one too, under a
# header per round (as a single node's per attempt).
"$DTRAIN" run --hosts localhost:1,127.0.0.1:1 --max-restarts 1 --log-dir "$T/logs2" -- sh -c \
  '[ "$RANK" = 0 ] && echo "r0 round $TORCHELASTIC_RESTART_COUNT"; [ "$RANK$TORCHELASTIC_RESTART_COUNT" = 00 ] && exit 3; exit 0' >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "rank logs across nodes: the restarted job succeeds"
expect_eq "$(grep -c '^==== dtrain run .* attempt [01] ' "$T/logs2/rank_1.log" 2>/dev/null)" 2 "rank logs across nodes: a silent rank's log, one header per round"
expect_eq "$(grep -v '^==== ' "$T/logs2/rank_1.log" 2>/dev/null | wc -l)" 0 "rank logs across nodes: nothing else in a silent rank's log"
expect_eq "$(sed 's/^==== dtrain run [0-9a-f]* attempt \([01]\) .*/H\1/' "$T/logs2/rank_0.log" | tr '\n' ' ')" "H0 r0 round 0 H1 r0 round 1 " "rank logs across nodes: each round's lines under its header"

# Dry run: the plan in hostfile order.
"$DTRAIN" run --dry-run --hosts "$HOSTS" -- true >"$T/plan" 2>&1
expect_eq "$?" 0 "dry run"
expect_grep "2 node\(s\), world size 3" "$T/plan" "plan header"
expect_grep "^127.0.0.1 +1 +0 +2 " "$T/plan" "plan row for node 1"

# A worker failing on node 1 stops node 0's workers; the summary names host and rank.
start=$(date +%s)
"$DTRAIN" run --hosts "$HOSTS" --shutdown-timeout 3 --summary-json "$T/fail.json" -- sh -c 'if [ "$RANK" = 2 ]; then sleep 0.5; echo "disk full" >&2; exit 3; fi; exec sleep 60' >"$T/out" 2>"$T/err"
rc=$?
took=$(( $(date +%s) - start ))
expect_eq "$rc" 3 "exit code of the failing worker"
[ "$took" -lt 15 ] && pass "torn down in ${took}s" || fail "teardown took ${took}s"
expect_grep "failed: rank 2 exited with code 3" "$T/err" "summary names the rank"
expect_grep "host: +127.0.0.1" "$T/err" "summary names the host"
expect_grep "\| disk full" "$T/err" "summary has the stderr tail"
# Every node's ranks are in the summary, not only the failing one (the agents that ended
# after the stop were taken for lost nodes and their exits dropped).
expect_grep "failed: rank 2 exited with code 3; 2 other worker\(s\) ended during teardown" "$T/err" "teardown count across nodes"
ranks_() { python3 -c "import json,sys; print([(r['rank'], r['host'], r['exit_code'], r['signal'], r['stopped_by_dtrain']) + (('lost',) if r['lost'] else ()) for r in json.load(open(sys.argv[1]))['ranks']])" "$1"; }
expect_eq "$(ranks_ "$T/fail.json")" "[(0, 'localhost', None, 'SIGTERM', True), (1, 'localhost', None, 'SIGTERM', True), (2, '127.0.0.1', 3, None, False)]" "worker failure: every rank in the summary"

# The grace period covers a worker's process group on every node: wrapper scripts (bash,
# dying of the SIGTERM at once) whose python saves a checkpoint on it. Their agents wait for
# the groups, and report the exits once they are gone: the teardown notice names them.
cat > "$T/save.py" <<'PY'
import os, signal, sys, time
d, rank = os.environ["D"], os.environ["RANK"]
def on(s, _):
    time.sleep(3); print(f"rank {rank} checkpoint done", flush=True); sys.exit(0)
signal.signal(signal.SIGTERM, on)
open(f"{d}/py.{rank}", "w").write(str(os.getpid()))
time.sleep(120)
PY
printf '#!/bin/bash\nset -e\npython3 %s "$@"\n' "$T/save.py" > "$T/train.sh"; chmod +x "$T/train.sh"
rm -f "$T"/py.*
D="$T" "$DTRAIN" run --hosts "$HOSTS" --shutdown-timeout 8 --summary-json "$T/wrap.json" -- bash -c \
  'if [ "$RANK" = 0 ]; then while [ ! -e "$D/py.1" ] || [ ! -e "$D/py.2" ]; do sleep 0.05; done; exit 3; fi; exec "$0"' "$T/train.sh" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
if wait_for "$T/py.1" "$T/py.2"; then
  start=$(date +%s%N)
  wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  expect_eq "$rc" 3 "wrapper scripts across nodes: the failing rank's exit code"
  expect_grep "^\[localhost rank 1\] rank 1 checkpoint done$" "$T/out" "wrapper scripts across nodes: rank 1's python saved"
  expect_grep "^\[127.0.0.1 rank 2\] rank 2 checkpoint done$" "$T/out" "wrapper scripts across nodes: rank 2's python saved"
  [ "$ms" -ge 2800 ] && [ "$ms" -lt 6500 ] && pass "wrapper scripts across nodes: waited for the saves, not the grace period (${ms} ms)" || fail "wrapper scripts across nodes: teardown took ${ms} ms (save 3 s, grace 8 s)"
  expect_grep "^dtrain: rank 0 \(localhost\) failed; waiting up to [0-9]+ s more for rank\(s\) 1 \(localhost\) and 2 \(127.0.0.1\) to exit" "$T/err" "wrapper scripts across nodes: the notice names the lingering ranks"
  expect_eq "$(ranks_ "$T/wrap.json")" "[(0, 'localhost', 3, None, False), (1, 'localhost', None, 'SIGTERM', True), (2, '127.0.0.1', None, 'SIGTERM', True)]" "wrapper scripts across nodes: the wrappers' exits, stopped by dtrain"
fi

# SIGTERM to the launcher: every node torn down, exit 143.
D="$T" "$DTRAIN" run --hosts "$HOSTS" --shutdown-timeout 3 -- sh -c 'echo $$ > "$D/pid.$RANK"; exec sleep 120' >/dev/null 2>&1 &
DTRAIN_PID=$!
wait_for "$T/pid.0" "$T/pid.1" "$T/pid.2"
kill -TERM "$DTRAIN_PID"; wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 143 "SIGTERM: exit 143"
for r in 0 1 2; do alive "$(cat "$T/pid.$r")" && fail "rank $r survived SIGTERM" || pass "rank $r stopped"; done

# Ctrl-C: the summary still lists every node's ranks, each stopped by dtrain.
rm -f "$T"/pid.*
D="$T" "$DTRAIN" run --hosts "$HOSTS" --shutdown-timeout 3 --summary-json "$T/int.json" -- sh -c 'echo $$ > "$D/pid.$RANK"; exec sleep 120' >/dev/null 2>&1 &
DTRAIN_PID=$!
wait_for "$T/pid.0" "$T/pid.1" "$T/pid.2"
kill -INT "$DTRAIN_PID"; wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 130 "SIGINT: exit 130"
expect_eq "$(ranks_ "$T/int.json")" "[(0, 'localhost', None, 'SIGINT', True), (1, 'localhost', None, 'SIGINT', True), (2, '127.0.0.1', None, 'SIGINT', True)]" "SIGINT: every rank in the summary, died of the SIGINT passed on, stopped by dtrain"

# The signal dtrain got is the one every worker on every node gets, as on one host (and as
# torchrun does): each agent passes it on ("stop SIGINT"), SIGKILL after the grace period as
# ever; said at once, naming the signal sent. A worker that exits 128 + it is stopped by dtrain.
cat > "$T/sig.py" <<'PY'
import os, signal, sys, time
d, rank = os.environ["D"], os.environ["RANK"]
def on(sig, _):
    open(f"{d}/got.{rank}", "w").write(signal.Signals(sig).name)
    sys.exit(128 + sig)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, on)
open(f"{d}/pid.{rank}", "w").write(str(os.getpid()))
time.sleep(120)
PY
for c in INT:130 HUP:129 TERM:143; do
  sig=${c%%:*}; want=${c##*:}
  rm -f "$T"/pid.* "$T"/got.*
  D="$T" "$DTRAIN" run --hosts "$HOSTS" --shutdown-timeout 3 --summary-json "$T/sig.json" -- python3 "$T/sig.py" >/dev/null 2>"$T/err" &
  DTRAIN_PID=$!
  if ! wait_for "$T/pid.0" "$T/pid.1" "$T/pid.2"; then
    fail "across nodes, SIG$sig: the workers did not start"
    kill -KILL "$DTRAIN_PID"; wait "$DTRAIN_PID"; DTRAIN_PID=  # (its guard takes the workers along)
    continue
  fi
  kill -"$sig" "$DTRAIN_PID"; wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  expect_eq "$rc" "$want" "across nodes, SIG$sig: exit $want"
  for r in 0 1 2; do expect_eq "$(cat "$T/got.$r" 2>/dev/null)" "SIG$sig" "across nodes, SIG$sig: rank $r (node $([ $r = 2 ] && echo 127.0.0.1 || echo localhost)) got SIG$sig"; done
  expect_grep "^dtrain: SIG$sig: stopping 2 nodes \(SIG$sig to the workers now, SIGKILL after 3 s\)$([ "$sig" = INT ] && echo '; Ctrl-C again to kill now')$" "$T/err" "across nodes, SIG$sig: the notice names the signal sent"
  expect_eq "$(ranks_ "$T/sig.json")" "[(0, 'localhost', $want, None, True), (1, 'localhost', $want, None, True), (2, '127.0.0.1', $want, None, True)]" "across nodes, SIG$sig: every rank exited $want, stopped by dtrain"
done

# A second Ctrl-C kills at once on every node, as it says (the agents used to give workers
# that ignore SIGTERM the 2 s grace of a lost launcher).
rm -f "$T"/pid.*
printf '%s\n' 'trap "" TERM INT HUP' 'echo $$ > "$D/pid.$RANK"' 'while true; do sleep 0.2; done' > "$T/ignore.sh"
D="$T" "$DTRAIN" run --hosts "$HOSTS" --summary-json "$T/int2.json" -- bash "$T/ignore.sh" >/dev/null 2>"$T/err" &
DTRAIN_PID=$!
wait_for "$T/pid.0" "$T/pid.1" "$T/pid.2"
kill -INT "$DTRAIN_PID"; sleep 0.5
start=$(date +%s%N); kill -INT "$DTRAIN_PID"; wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
ms=$(( ($(date +%s%N) - start) / 1000000 ))
expect_eq "$rc" 130 "second SIGINT: exit 130"
expect_grep "killing the workers now \(SIGKILL\)" "$T/err" "second SIGINT announced"
[ "$ms" -lt 1500 ] && pass "second SIGINT killed every node at once (${ms} ms)" || fail "second SIGINT took ${ms} ms"
expect_eq "$(ranks_ "$T/int2.json")" "[(0, 'localhost', None, 'SIGKILL', True), (1, 'localhost', None, 'SIGKILL', True), (2, '127.0.0.1', None, 'SIGKILL', True)]" "second SIGINT: every rank SIGKILLed"
for r in 0 1 2; do alive "$(cat "$T/pid.$r")" && { fail "rank $r survived"; kill -9 "$(cat "$T/pid.$r")"; } || pass "rank $r killed"; done

# A node really lost (its agent SIGKILLed): still a lost node; the other node's ranks are in
# the summary, and the lost node's rank too, marked lost (how it ended is unknown).
rm -f "$T"/pid.*
D="$T" "$DTRAIN" run --hosts "$HOSTS" --shutdown-timeout 3 --summary-json "$T/lost.json" -- sh -c 'echo $$ > "$D/pid.$RANK"; exec sleep 120' >/dev/null 2>"$T/err" &
DTRAIN_PID=$!
wait_for "$T/pid.0" "$T/pid.1" "$T/pid.2"
kill -9 "$(ps --ppid "$DTRAIN_PID" -o pid=,args= | awk '/--node 127.0.0.1 /{print $1}')"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 1 "lost node: exit 1"
expect_grep "failed: node 127.0.0.1 \(--hosts\) lost: its agent exited with 137" "$T/err" "lost node reported as lost"
expect_eq "$(ranks_ "$T/lost.json")" "[(0, 'localhost', None, 'SIGTERM', True), (1, 'localhost', None, 'SIGTERM', True), (2, '127.0.0.1', None, None, False, 'lost')]" "lost node: every rank in the summary, the lost one marked"
p=$(cat "$T/pid.2"); alive "$p" && kill -9 "$p"  # the lost agent's worker, if it outlived it

# A SIGTERM to one node's agent (a host shutting down): its workers stop, and the node is
# lost; the job used to wait for that node forever.
rm -f "$T"/pid.*
D="$T" "$DTRAIN" run --hosts "$HOSTS" --shutdown-timeout 3 --summary-json "$T/aterm.json" -- sh -c 'echo $$ > "$D/pid.$RANK"; exec sleep 60' >/dev/null 2>"$T/err" &
DTRAIN_PID=$!
wait_for "$T/pid.0" "$T/pid.1" "$T/pid.2"
start=$(date +%s)
kill -TERM "$(ps --ppid "$DTRAIN_PID" -o pid=,args= | awk '/--node 127.0.0.1 /{print $1}')"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 1 "agent SIGTERMed: the job fails (exit 1)"
[ $(( $(date +%s) - start )) -lt 15 ] && pass "agent SIGTERMed: no hang" || fail "agent SIGTERMed: took $(( $(date +%s) - start )) s"
expect_grep "node 127.0.0.1 \(--hosts\) lost: its agent was stopped by SIGTERM on that host" "$T/err" "agent SIGTERMed: said"
# Elastic: the job goes on without that node.
rm -f "$T"/pid.*
D="$T" "$DTRAIN" run --hosts "$HOSTS" --nnodes 1:2 --max-restarts 1 --summary-json "$T/aterm2.json" -- sh -c 'echo $$ > "$D/pid.$RANK.$TORCHELASTIC_RESTART_COUNT"; [ "$TORCHELASTIC_RESTART_COUNT" = 1 ] && exit 0; exec sleep 60' >/dev/null 2>"$T/err" &
DTRAIN_PID=$!
wait_for "$T/pid.0.0" "$T/pid.1.0" "$T/pid.2.0"
kill -TERM "$(ps --ppid "$DTRAIN_PID" -o pid=,args= | awk '/--node 127.0.0.1 /{print $1}')"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 0 "agent SIGTERMed, elastic: restarted without the node, succeeded"
expect_eq "$(python3 -c "import json; d=json.load(open('$T/aterm2.json')); print(d['restarts'], [e['kind'] for e in d['events']][:3])")" "1 ['node_lost', 'host_excluded', 'restart']" "agent SIGTERMed, elastic: one restart"

# One incident, one restart: a worker dies on one node as the other node is lost. The worker's
# failure and the node's loss used to spend a restart each (max_restarts 1 then failed).
rm -f "$T"/pid.*
D="$T" "$DTRAIN" run --hosts "$HOSTS" --nnodes 1:2 --max-restarts 1 --summary-json "$T/inc.json" -- sh -c 'echo $$ > "$D/pid.$RANK.$TORCHELASTIC_RESTART_COUNT"; [ "$TORCHELASTIC_RESTART_COUNT" = 1 ] && exit 0; exec sleep 60' >/dev/null 2>"$T/err" &
DTRAIN_PID=$!
wait_for "$T/pid.0.0" "$T/pid.1.0" "$T/pid.2.0"
kill -9 "$(cat "$T/pid.0.0")" "$(ps --ppid "$DTRAIN_PID" -o pid=,args= | awk '/--node 127.0.0.1 /{print $1}')"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 0 "worker failure and a lost node at once: restarted once, succeeded"
expect_eq "$(python3 -c "import json; d=json.load(open('$T/inc.json')); print(d['restarts'])")" 1 "worker failure and a lost node at once: one restart"
p=$(cat "$T/pid.2.0" 2>/dev/null); [ -n "$p" ] && alive "$p" && kill -9 "$p"

# SIGKILL of the launcher: agents and workers follow.
rm -f "$T"/pid.*
D="$T" "$DTRAIN" run --hosts "$HOSTS" -- sh -c 'echo $$ > "$D/pid.$RANK"; exec sleep 120' >/dev/null 2>&1 &
DTRAIN_PID=$!
wait_for "$T/pid.0" "$T/pid.1" "$T/pid.2"
kill -9 "$DTRAIN_PID"; wait "$DTRAIN_PID" 2>/dev/null; DTRAIN_PID=
for r in 0 1 2; do
  p=$(cat "$T/pid.$r")
  for _ in $(seq 50); do alive "$p" || break; sleep 0.1; done
  alive "$p" && { fail "rank $r (pid $p) outlived a SIGKILLed launcher"; kill -9 "$p"; } || pass "rank $r gone after SIGKILL"
done

# A worker failing while the others ignore SIGTERM: after 2 s the launcher says once which
# ranks on which nodes it still waits for, and for how long (the teardown used to be silent
# across nodes for up to shutdown_timeout_s).
printf '%s\n' 'if [ "$RANK" = 0 ]; then sleep 1; exit 3; fi' 'trap "" TERM' 'while true; do sleep 0.2; done' > "$T/ignore0.sh"
start=$(date +%s)
"$DTRAIN" run --hosts "$HOSTS" --shutdown-timeout 4 -- bash "$T/ignore0.sh" >"$T/out" 2>"$T/err"
rc=$?; took=$(( $(date +%s) - start ))
expect_eq "$rc" 3 "teardown notice: the failing worker's exit code"
expect_grep "^dtrain: rank 0 \(localhost\) failed; waiting up to [12] s more for rank\(s\) 1 \(localhost\) and 2 \(127.0.0.1\) to exit after SIGTERM, then SIGKILL \(shutdown_timeout_s, --shutdown-timeout\)$" "$T/err" "teardown notice names the ranks, their nodes and the time left"
expect_eq "$(grep -c "waiting up to" "$T/err")" 1 "teardown notice said once"
[ "$took" -lt 12 ] && pass "workers ignoring SIGTERM killed after the grace (${took}s)" || fail "teardown took ${took}s"

# The launcher stopped (SIGSTOP): its store stops answering. A pause shorter than the 5 s
# budget is survived; a longer one makes every agent give up within ~5 s and take its
# workers with it (the heartbeat used to block on the store client's 30 s timeouts).
rm -f "$T"/pid.*
D="$T" "$DTRAIN" run --hosts "$HOSTS" --shutdown-timeout 3 -- sh -c 'echo $$ > "$D/pid.$RANK"; exec sleep 120' >/dev/null 2>"$T/err" &
DTRAIN_PID=$!
wait_for "$T/pid.0" "$T/pid.1" "$T/pid.2"
# Every process below PID (agents, their guards, workers), breadth first.
descendants() {
  ps -e -o pid=,ppid= | awk -v root="$1" '{ kids[$2] = kids[$2] " " $1 }
    END { n = split(kids[root], q, " "); for (i = 1; i <= n; i++) { print q[i]; m = split(kids[q[i]], more, " "); for (j = 1; j <= m; j++) q[++n] = more[j] } }'
}
procs=$(descendants "$DTRAIN_PID")
kill -STOP "$DTRAIN_PID"; sleep 2.5; kill -CONT "$DTRAIN_PID"; sleep 1
left=0; for p in $procs; do alive "$p" && left=$((left + 1)); done
expect_eq "$left" "$(echo $procs | wc -w)" "a launcher paused 2.5 s: every agent and worker still there"
start=$(date +%s%N)
kill -STOP "$DTRAIN_PID"
for _ in $(seq 120); do
  left=0; for p in $procs; do alive "$p" && left=$((left + 1)); done
  [ "$left" = 0 ] && break; sleep 0.1
done
ms=$(( ($(date +%s%N) - start) / 1000000 ))
[ "$left" = 0 ] && [ "$ms" -le 8000 ] && [ "$ms" -ge 4000 ] && pass "store silent: agents, guards and workers gone in ${ms} ms" ||
  { fail "store silent: $left of $(echo $procs | wc -w) process(es) left after ${ms} ms"; ps -o pid,stat,args -p "$(echo $procs | tr ' ' ,)" >&2; }
# Resumed, the launcher fails the job, its nodes lost: their workers were stopped by their
# agents, not done (it used to read their ends as an orderly stop and exit 0).
kill -CONT "$DTRAIN_PID"; wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 1 "the job fails once its nodes gave up"
expect_grep "failed: node (localhost|127.0.0.1) \(--hosts\) lost: its agent exited with 1: the launcher's store at 127.0.0.1:[0-9]+ did not answer for 5 s; stopping this node's workers$" "$T/err" "the nodes' giving up is the job's error, with why"
for p in $procs; do alive "$p" && kill -9 "$p"; done

# Ctrl-C or SIGTERM during the pre-flight (a remote host whose ssh hangs: connect_timeout_s
# 20) ends it at once, 128 + signal, with the ssh checks killed (it used to run on to the
# check's deadline, then fail with exit 1).
for sig in INT TERM; do
  rm -f "$T/proxy.pid"
  printf '%s\n' "{\"command\": [\"true\"], \"ssh\": {\"connect_timeout_s\": 20, \"options\": [\"-F\", \"/dev/null\", \"-o\", \"ProxyCommand=sh -c 'echo \$\$ > $T/proxy.pid; exec sleep 30'\"]}}" > "$T/hang.json"
  "$DTRAIN" run "$T/hang.json" --hosts localhost:1,192.0.2.1:1 --summary-json "$T/hang_sum.json" >"$T/out" 2>"$T/err" &
  DTRAIN_PID=$!
  wait_for "$T/proxy.pid"; sleep 0.2
  start=$(date +%s%N); kill -"$sig" "$DTRAIN_PID"; wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  want=$([ "$sig" = INT ] && echo 130 || echo 143)
  expect_eq "$rc" "$want" "SIG$sig during the pre-flight: exit $want"
  [ "$ms" -lt 1500 ] && pass "SIG$sig during the pre-flight: stopped at once (${ms} ms)" || fail "SIG$sig during the pre-flight took ${ms} ms"
  expect_grep "^dtrain: SIG$sig: stopped during the pre-flight; killing the ssh check\(s\) of 1 host\(s\) not done yet \(192.0.2.1\); no agent or worker was started$" "$T/err" "SIG$sig during the pre-flight: said"
  expect_grep "^dtrain: stopped by SIG$sig; exit code $want$" "$T/err" "SIG$sig during the pre-flight: the verdict"
  expect_grep "\"stopped_by\": \"SIG$sig\"" "$T/hang_sum.json" "SIG$sig during the pre-flight: in the summary"
  p=$(cat "$T/proxy.pid"); alive "$p" && { fail "the ssh check's ProxyCommand outlived the stop"; kill -9 "$p"; } || pass "ssh check killed"
done

# A remote dtrain whose --version fails without a word: the pre-flight line ends at the code
# (it used to end in a dangling ": "). A fake ssh on PATH runs the remote command here.
mkdir -p "$T/fakebin"
printf '%s\n' '#!/bin/sh' 'for a; do last=$a; done' 'exec sh -c "$last"' > "$T/fakebin/ssh"
printf '%s\n' '#!/bin/sh' 'exit 3' > "$T/mute-dtrain"
chmod +x "$T/fakebin/ssh" "$T/mute-dtrain"
printf '%s\n' "{\"command\": [\"true\"], \"ssh\": {\"dtrain_path\": \"$T/mute-dtrain\"}}" > "$T/mute.json"
PATH="$T/fakebin:$PATH" "$DTRAIN" run "$T/mute.json" --hosts localhost:1,192.0.2.1:1 >"$T/out" 2>"$T/err"
expect_eq "$?" 1 "silent --version failure: pre-flight fails"
expect_grep "^  192.0.2.1 \(--hosts\): '$T/mute-dtrain --version' exited 3$" "$T/err" "silent --version failure: nothing after the code"

# The built-in trainer across 2 nodes x 1 worker ends bit-identical to 1 node x 2 workers.
cat > "$T/train.json" <<JSON
{"name": "mn-train", "trainer": {"model": {"layers": [32, 64, 4]},
  "data": {"type": "synthetic", "train_samples": 4096, "eval_samples": 512, "seed": 3},
  "batch_size": 64, "epochs": 2, "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9}, "log_every_steps": 1000}}
JSON
"$DTRAIN" run "$T/train.json" --hosts localhost:1,127.0.0.1:1 --summary-json "$T/mn.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "trainer on 2 nodes"
"$DTRAIN" run "$T/train.json" --nproc-per-node 2 --summary-json "$T/sn.json" >"$T/out1" 2>"$T/err1"
expect_eq "$?" 0 "trainer on 1 node"
h1=$(grep -o '"weights_sha256": *"[0-9a-f]*"' "$T/mn.json"); h2=$(grep -o '"weights_sha256": *"[0-9a-f]*"' "$T/sn.json")
[ -n "$h1" ] && expect_eq "$h1" "$h2" "2 nodes x 1 == 1 node x 2 (weights hash)" || fail "no trainer outcome in the multi-node summary: $(cat "$T/mn.json")"
expect_grep '"host": "127.0.0.1"' "$T/mn.json" "summary ranks name their host"
# File data across nodes: each host's agent parses its files once for its workers (the data
# image); the same weights as one node with every worker parsing for itself.
blobs_csv "$T/mn.csv" 600
cat > "$T/csvtrain.json" <<JSON
{"trainer": {"model": {"layers": [2, 16, 3]}, "data": {"type": "csv", "path": "$T/mn.csv"},
  "batch_size": 16, "epochs": 2, "optimizer": {"lr": 0.05, "momentum": 0.9}, "log_every_steps": 1000}}
JSON
"$DTRAIN" run "$T/csvtrain.json" --hosts localhost:1,127.0.0.1:1 >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "csv trainer on 2 nodes"
expect_grep "^\[localhost rank 0\] trainer: data mapped from this host's data image \([0-9]+ KiB\), shared by this host's workers$" "$T/out" "csv on 2 nodes: the agent's data image"
h1=$(sed -n 's/.*weights sha256 \([0-9a-f]*\).*/\1/p' "$T/out")
DTRAIN_DATA_SHARE=0 "$DTRAIN" run "$T/csvtrain.json" --nproc-per-node 2 >"$T/out1" 2>"$T/err1"
expect_eq "$?" 0 "csv trainer on 1 node, no image"
expect_grep "weights sha256 ${h1:-none}" "$T/out1" "csv: 2 nodes with images == 1 node parsing in each worker"
# The data file made unreadable (a directory now) before a restart: each agent's data image
# cannot be made again, said as the node's failure with the file and the reason (before: the
# agents died of std::terminate, exit 134, "lost").
cp "$T/mn.csv" "$T/live.csv"
sed -e "s|$T/mn.csv|$T/live.csv|" -e 's|"epochs": 2|"epochs": 4000|' -e "s|\"log_every_steps\": 1000}|\"log_every_steps\": 100000, \"checkpoint\": {\"dir\": \"$T/live-ckpt\", \"every_steps\": 20}}, \"max_restarts\": 1|" "$T/csvtrain.json" >"$T/live.json"
"$DTRAIN" run "$T/live.json" --hosts localhost:1,127.0.0.1:1 >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
for _ in $(seq 600); do ls "$T/live-ckpt" 2>/dev/null | grep -q "^ckpt-" && break; sleep 0.1; done
rm "$T/live.csv"; mkdir "$T/live.csv"
victim=$(pgrep -f "train .*$T" | tail -1)
[ -n "$victim" ] && kill -9 "$victim"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 1 "data file unreadable at a restart across nodes: exit 1"
expect_grep "^dtrain: job 'job' failed: node (localhost|127.0.0.1): the training data could not be read again for round 1: $T/live.csv:1: read error: Is a directory$" "$T/err" "data file unreadable at a restart: the node's failure, the file and why"
expect_no_grep "terminate called|exited with 134" "$T/err" "data file unreadable at a restart: no agent aborted"
expect_no_grep "node_lost" "$T/err" "data file unreadable at a restart: the node that said why is not called lost"
# A program missing on a node is the job's error, said once (exit 2), not exit 127 from
# every rank there and a restart budget spent on it.
"$DTRAIN" run --hosts "$HOSTS" --max-restarts 3 -- dtrain-no-such-prog x >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "a program missing on the nodes: exit 2"
expect_grep "failed: node (localhost|127.0.0.1): the command after --: cannot run \"dtrain-no-such-prog\" on this host: no such program on its PATH; check the name, or give its path$" "$T/err" "a program missing on the nodes: named, with the node"
expect_eq "$(grep -c "event restart" "$T/err")" 0 "a program missing on the nodes: no restart"
# With dtrain's stdout and stderr one file (2>&1), each node's workers keep their lines'
# order across the two streams (the agents are told to give each worker one pipe).
cat > "$T/order.py" <<'PY'
import sys
for i in range(150):
    print(f"out {i}", flush=True)
    print(f"err {i}", file=sys.stderr, flush=True)
PY
"$DTRAIN" run --hosts localhost:1,127.0.0.1:1 -- python3 "$T/order.py" >"$T/out" 2>&1
python3 - "$T/out" >"$T/check" <<'PY2'
import re, sys
bad = 0
for tag in ("[localhost rank 0]", "[127.0.0.1 rank 1]"):
    seq = [l.split("] ", 1)[1].strip() for l in open(sys.argv[1]) if l.startswith(tag) and re.search(r"(out|err) \d+$", l)]
    want = [f"{s} {i}" for i in range(150) for s in ("out", "err")]
    bad += sum(1 for a, b in zip(seq, want) if a != b) + abs(len(seq) - len(want))
print(bad)
PY2
expect_eq "$(cat "$T/check")" 0 "2>&1 across nodes: each rank's stdout and stderr lines in order"
# ... and a failure's summary shows the rank's last output lines, stdout's included (the
# agents' tails held stderr only, and merged output arrives as stdout: the tail was empty).
"$DTRAIN" run --hosts "$HOSTS" --shutdown-timeout 3 -- sh -c 'echo "said on stdout"; [ "$RANK" = 2 ] && { echo "said on stderr" >&2; exit 3; }; exec sleep 30' >"$T/mo" 2>&1
expect_eq "$?" 3 "2>&1 across nodes, failure: the worker's exit code"
expect_grep "^    last output lines:" "$T/mo" "2>&1 across nodes, failure: the output tail shown"
expect_grep "^      \| said on stdout$" "$T/mo" "2>&1 across nodes, failure: its stdout line in the tail"
# A program that passes the agents' check but cannot be exec'ed (a #! line that leads to
# itself) fails the job at once across nodes too: the agents report it, and no restart is
# spent on it.
printf '#!%s\n' "$T/loopinterp" > "$T/loopinterp"; chmod +x "$T/loopinterp"
"$DTRAIN" run --hosts localhost:1,127.0.0.1:1 --max-restarts 3 -- "$T/loopinterp" >"$T/out" 2>"$T/err"
expect_eq "$?" 126 "unstartable program across nodes: exit 126"
expect_grep "cause: +not restarted: rank [01]'s command '.*loopinterp' cannot be started on .*; fix the command after --, or PATH$" "$T/err" "unstartable program across nodes: not restarted, says why"
expect_eq "$(grep -c "event restart" "$T/err")" 0 "unstartable program across nodes: no restart"
# Each agent checks the #! interpreter too, before any worker starts.
printf '#!/nonexistent/interp\n' > "$T/badinterp"; chmod +x "$T/badinterp"
"$DTRAIN" run --hosts localhost:1,127.0.0.1:1 -- "$T/badinterp" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "a missing #! interpreter across nodes: exit 2"
expect_grep "node [^:]+: the command after --: cannot run \"$T/badinterp\" on this host: its interpreter /nonexistent/interp \(#! line\) does not exist" "$T/err" "a missing #! interpreter across nodes: named by the agent"
# An agent that refuses the run at startup (a checkpoint dir it cannot use) leaves no copy of
# the spec (which may carry secrets) in /tmp.
touch "$T/afile"
cat > "$T/badck.json" <<JSON
{"trainer": {"model": {"layers": [8, 4]}, "data": {"type": "synthetic", "train_samples": 256, "eval_samples": 0},
  "batch_size": 8, "checkpoint": {"dir": "$T/afile/sub"}}}
JSON
"$DTRAIN" run "$T/badck.json" --hosts localhost:1,127.0.0.1:1 --summary-json "$T/badck_sum.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "agent refuses an unusable checkpoint dir: exit 2"
rid=$(python3 -c "import json; print(json.load(open('$T/badck_sum.json'))['run_id'])")
left=$(ls "${TMPDIR:-/tmp}" | grep -- "-$rid-" || true)
expect_eq "$left" "" "agent refusal: no spec copy left in /tmp"
# SIGUSR1/SIGUSR2 to the launcher reach every worker on every node, through each agent
# (agent_protocol.h "signal"); the job goes on.
cat > "$T/usr.sh" <<'SH'
got=""
trap 'got="$got USR1"' USR1
trap 'got="$got USR2"' USR2
echo $$ > "$D/upid.$RANK"
while [ "$(echo $got | wc -w)" -lt 2 ]; do sleep 0.05; done
echo "got$got"
SH
rm -f "$T"/upid.*
D="$T" "$DTRAIN" run --hosts "$HOSTS" -- bash "$T/usr.sh" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
if wait_for "$T/upid.0" "$T/upid.1" "$T/upid.2"; then
  kill -USR1 "$DTRAIN_PID"; sleep 0.3; kill -USR2 "$DTRAIN_PID"
  wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  expect_eq "$rc" 0 "SIGUSR1/2 across nodes: the job goes on"
  expect_eq "$(grep -c 'rank [0-2]\] got USR1 USR2$' "$T/out")" 3 "every rank on both nodes got USR1 then USR2"
  expect_grep "^dtrain: SIGUSR1: passed on to the workers of 2 nodes$" "$T/err" "SIGUSR1 passed on, said"
fi
# Ctrl-C during the teardown after a failure with no restart left ends the job as that
# failure (exit code, summary), as on one node.
cat > "$T/slowstop.sh" <<'SH'
trap 'sleep 20; exit 0' TERM
if [ "$RANK" = 2 ]; then sleep 0.5; echo "boom" >&2; exit 3; fi
echo $$ > "$D/slow.$RANK"; sleep 30 & wait
SH
rm -f "$T"/slow.*
D="$T" "$DTRAIN" run --hosts "$HOSTS" --summary-json "$T/slow.json" -- bash "$T/slowstop.sh" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
wait_for "$T/slow.0" "$T/slow.1" && sleep 1.5 && kill -INT "$DTRAIN_PID"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 3 "multi-node, Ctrl-C in the final teardown: the failure's exit code"
expect_grep "^dtrain: SIGINT during the teardown after the failure: the workers still running were killed at once; exit code 3, the failure's$" "$T/err" "multi-node, Ctrl-C in the final teardown: said"
expect_eq "$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["status"], d["exit_code"], d["stopped_by"])' "$T/slow.json")" "failed 3 None" "multi-node, Ctrl-C in the final teardown: the summary"
# Across nodes as on one: a rank that exits saying its collective lost rank 0 is reported
# before rank 0's SIGKILL; the job blames rank 0 (exit 137), not the rank that noticed.
cat > "$T/lost.sh" <<'SH'
if [ "$RANK" = 1 ]; then sleep 0.5; echo "dtrain: error: allreduce on rank 1: lost rank 0: connection closed (the process exited or was killed)" >&2; exit 1; fi
if [ "$RANK" = 0 ]; then trap 'kill -9 $$' TERM; fi
sleep 30 & wait
SH
"$DTRAIN" run --hosts "$HOSTS" -- bash "$T/lost.sh" >"$T/out" 2>"$T/err"
expect_eq "$?" 137 "multi-node, collateral first: the exit code is the lost rank's (SIGKILL)"
expect_grep "job 'lost.sh' failed: rank 0 .*killed by SIGKILL" "$T/err" "multi-node, collateral first: the headline blames rank 0"
# A scheduler's stop across nodes (scancel, a time limit: every process of the job signalled,
# the workers and agents before dtrain): one stop, exit 143, no restart, no lost node. A
# worker's death by it, or an agent's stop by it, used to be a failure and a restart (or a
# lost node) announced before dtrain read its own SIGTERM.
for who in workers all; do
  rm -f "$T"/pid.*
  D="$T" "$DTRAIN" run --hosts "$HOSTS" --max-restarts 3 --shutdown-timeout 3 --summary-json "$T/sched.json" -- sh -c 'echo $$ > "$D/pid.$RANK"; exec sleep 60' >/dev/null 2>"$T/err" &
  DTRAIN_PID=$!
  wait_for "$T/pid.0" "$T/pid.1" "$T/pid.2"
  agents=""
  [ "$who" = all ] && agents=$(ps --ppid "$DTRAIN_PID" -o pid=,args= | awk '/ agent /{print $1}')
  kill -TERM $(cat "$T/pid.0" "$T/pid.1" "$T/pid.2") $agents
  sleep 0.1
  kill -TERM "$DTRAIN_PID"; wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  expect_eq "$rc" 143 "scheduler's stop across nodes ($who first): exit 143"
  expect_grep "had ended by a stop signal from outside dtrain just before dtrain got SIGTERM: one stop of the whole job" "$T/err" "scheduler's stop across nodes ($who first): said as one stop"
  grep -qE "event (restart|node_lost)" "$T/err" && fail "scheduler's stop across nodes ($who first): $(grep -E 'event' "$T/err")" || pass "scheduler's stop across nodes ($who first): no restart, no lost node"
  expect_eq "$(python3 -c "import json; d=json.load(open('$T/sched.json')); print(d['restarts'], d['stopped_by'], d['events'], all(r['stopped_by_dtrain'] for r in d['ranks']))")" "0 SIGTERM [] True" "scheduler's stop across nodes ($who first): the summary"
done
# An agent's records are checked like any peer's bytes (security audit): a round record whose
# numbers the job cannot have (3000 workers where the node has 1) made the launcher open a log
# per rank it named (20000 files, then "Too many open files"); a line of rank -7 made
# rank_-7.log. Now the node is cut off as lost, with the reason. (A fake ssh plays the agent.)
mkdir -p "$T/fakebin"
cat >"$T/fakebin/ssh" <<SH
#!/bin/bash
for a in "\$@"; do last="\$a"; done
case "\$last" in *--version*) exec "$DTRAIN" --version;; esac
read -r tok
printf 'N\t0\t1\t1\t0\t127.0.0.1\t1234\t0\t3000\n'
printf 'O\t-7\t0\thello\n'
sleep 5
SH
chmod +x "$T/fakebin/ssh"
cat >"$T/hostile.json" <<'JSON'
{"command": ["/bin/true"], "nodes": [{"host": "fakehost1", "address": "127.0.0.1"}], "rendezvous": {"addr": "127.0.0.1", "timeout_s": 5}}
JSON
PATH="$T/fakebin:$PATH" timeout 60 "$DTRAIN" run "$T/hostile.json" --log-dir "$T/hostile-logs" >/dev/null 2>"$T/err"
expect_eq "$?" 1 "an agent's impossible round record: the job fails"
expect_grep "node fakehost1 \(.*\) lost: its agent reported a round the job cannot have \(3000 workers from rank 0 of 1\)" "$T/err" "an agent's impossible round record: said"
expect_eq "$(find "$T/hostile-logs" -name 'rank_*.log' | wc -l)" 0 "an agent's impossible round record: no log opened for its ranks"
# Exit records are checked too (a fuzzer's fake agent: rank 999 failed a 1-rank job, 8000
# records for one rank took 1.3 GB), and a round that ends with a code but no failed worker
# (a record lost on the way) no longer holds the job for good: the node is lost within 5 s.
for fake in badexit noexit unnamed; do
  cat >"$T/fakebin/ssh" <<SH
#!/bin/bash
for a in "\$@"; do last="\$a"; done
case "\$last" in *--version*) exec "$DTRAIN" --version;; esac
read -r tok
printf 'N\t0\t1\t1\t0\t127.0.0.1\t1234\t0\t1\n'
if [ $fake = badexit ]; then
  for i in 1 2 3; do printf 'X\t999\t0\t1\t3\t0\t0\t0\tnow\tforged\t\n'; done
elif [ $fake = unnamed ]; then
  printf 'F\tspec\tthe data file is missing\n'
  exit 2  # (as an agent does after its refusal)
else
  printf 'D\t1\t0\n'
fi
sleep 30
SH
  start=$(date +%s)
  PATH="$T/fakebin:$PATH" timeout 60 "$DTRAIN" run "$T/hostile.json" --summary-json "$T/hostile.sum" >/dev/null 2>"$T/err"
  rc=$?
  expect_eq "$rc" $([ $fake = unnamed ] && echo 2 || echo 1) "fake agent ($fake): the job fails"
  [ $(( $(date +%s) - start )) -lt 30 ] && pass "fake agent ($fake): within the wait, not the agent's 30 s" || fail "fake agent ($fake): took $(( $(date +%s) - start )) s"
  if [ $fake = badexit ]; then
    expect_grep "node fakehost1 \(.*\) lost: its agent reported an exit the job cannot have \(rank 999, local rank 0, of its 1 workers from rank 0\)" "$T/err" "fake agent (badexit): said"
    expect_eq "$(python3 -c "import json; print([r['rank'] for r in json.load(open('$T/hostile.sum'))['ranks']])")" "[0]" "fake agent (badexit): no made-up rank in the summary"
  elif [ $fake = unnamed ]; then
    # (an agent's refusal that does not name its node, as another dtrain's might: named)
    expect_grep "node fakehost1: the data file is missing" "$T/err" "fake agent (unnamed): its refusal names the node"
  else
    expect_grep "node fakehost1 \(.*\) lost: its agent ended its round with code 1 but reported no failed worker" "$T/err" "fake agent (noexit): said"
  fi
done
# A worker's error message with a carriage return (CRLF text in an exception) cut its exit
# record on the way from the agent, and the job waited for it for good; a progress line's CR
# is kept as on one node.
timeout 60 "$DTRAIN" run --hosts localhost:1,127.0.0.1:1 --shutdown-timeout 3 -- sh -c 'if [ "$RANK" = 1 ]; then printf "step 1\rstep 2\n"; printf "{\"message\": \"x\\\\r\\\\ny\"}" > "$TORCHELASTIC_ERROR_FILE"; exit 3; fi; exec sleep 20' >"$T/out" 2>"$T/err"
expect_eq "$?" 3 "an error message with CR LF on a remote node: the job ends with the worker's code"
expect_grep '^    error: +x$' "$T/err" "an error message with CR LF: its first line"
expect_grep '^ {16}y$' "$T/err" "an error message with CR LF: its second line"
expect_grep '^\[127.0.0.1 rank 1\] step 2$' "$T/out" "a progress line's CR through the agent: as on one node"
# A console that takes nothing for a while (a stuck log collector): the launcher leaves the
# agents' output unread, each agent its workers' (backpressure), and a SIGTERM still reaches
# every worker at once (the agents' loops go on while their channel to the launcher is
# backlogged); the job ends, exit 143, once the reader reads again, with every line read in
# the console and the logs alike.
mkfifo "$T/stall"
( exec 3<"$T/stall"; sleep 7; date +%s.%N >"$T/resumed"; cat <&3 >"$T/stall.out" ) &
reader=$!
rm -f "$T"/termed.*
"$DTRAIN" run --hosts localhost:1,127.0.0.1:1 --shutdown-timeout 2 --log-dir "$T/logs9" -- sh -c \
  "trap 'date +%s.%N >$T/termed.\$RANK; exit 143' TERM; yes xxxxxxxx | head -c 16000000; while :; do sleep 0.1; done" \
  >"$T/stall" 2>"$T/stall.err" &
DTRAIN_PID=$!
sleep 3
date +%s.%N >"$T/killed"
kill -TERM "$DTRAIN_PID"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
date +%s.%N >"$T/ended"
wait "$reader"
expect_eq "$rc" 143 "stalled console across nodes: exit 143"
python3 - "$T" >"$T/check" <<'PY'
import os, sys
t = sys.argv[1]
at = lambda n: float(open(f"{t}/{n}").read()) if os.path.exists(f"{t}/{n}") else float("inf")
print("term-delays-ok", all(at(f"termed.{r}") - at("killed") < 2 for r in (0, 1)))
print("end-ok", at("ended") - at("resumed") < 6)
console = open(f"{t}/stall.out", "rb").read().split(b"\n")
for r, host in ((0, b"localhost"), (1, b"127.0.0.1")):
    n = sum(1 for l in console if l == b"[%s rank %d] xxxxxxxx" % (host, r))
    log = open(f"{t}/logs9/rank_{r}.log", "rb").read().split(b"\n")
    print(f"rank{r}", n > 100000, n == sum(1 for l in log if l == b"xxxxxxxx"))
PY
expect_eq "$(sed -n 1p "$T/check")" "term-delays-ok True" "stalled console across nodes: every worker gets SIGTERM at once"
expect_eq "$(sed -n 2p "$T/check")" "end-ok True" "stalled console across nodes: dtrain exits once the reader reads again"
expect_eq "$(sed -n 3,4p "$T/check" | tr '\n' ' ')" "rank0 True True rank1 True True " "stalled console across nodes: every line read in the console and the logs"
# A console that never drains across nodes (a log shipper that stopped reading, the pipe
# still open): the agents' last records wait on the launcher, which holds their pipes; the
# kill backstop waited for the console too, so dtrain ignored every signal for good. Now
# the agents are SIGKILLed one shutdown timeout after the usual deadline, and a second
# SIGTERM ends dtrain's own wait for its console. (review finding)
mkfifo "$T/never"
( exec 3<"$T/never"; sleep 60 ) & holder=$!
"$DTRAIN" run --hosts localhost:1,127.0.0.1:1 --shutdown-timeout 1 -- sh -c 'yes xxxxxxxx | head -c 16000000; exec sleep 60' \
  >"$T/never" 2>"$T/never.err" &
DTRAIN_PID=$!
sleep 3
kill -TERM "$DTRAIN_PID"
sleep 15
kill -TERM "$DTRAIN_PID" 2>/dev/null
for _ in $(seq 100); do alive "$DTRAIN_PID" || break; sleep 0.1; done
alive "$DTRAIN_PID" && { fail "never-draining console across nodes: dtrain still runs after two SIGTERMs"; kill -9 "$DTRAIN_PID"; } || pass "never-draining console across nodes: two SIGTERMs end dtrain"
wait "$DTRAIN_PID" 2>/dev/null; DTRAIN_PID=
kill "$holder" 2>/dev/null; wait "$holder" 2>/dev/null
# A line of 1.5 MB across hosts: the agent cuts it at 1 MiB, and its records (a piece, escaped,
# with a header) pass the launcher whole (before: each piece's record was cut again at the
# launcher's 64 KiB, and the bytes past the cut were dropped as a malformed record).
"$DTRAIN" run --hosts localhost:1,127.0.0.1:1 -- python3 -c 'print("y" * 1500000); print("after")' >"$T/out" 2>"$T/err"
expect_eq "$?:$(grep -o y "$T/out" | wc -l):$(grep -c ' after$' "$T/out")" "0:3000000:2" "a 1.5 MB line across hosts: every byte arrives"
# A node slow to start its agent (DTRAIN_TEST_JOIN_DELAY stages it): round 0's timeout names
# the node that did not join, not the one that saw it time out (before: "node localhost:
# rendezvous round 0 timed out ... (arrived: localhost)", the missing one never named), and
# the job ends then: the late agent, which runs no workers yet, is killed (it joined later and
# waited 30 s for a node 0 that was gone).
echo '{"command": ["true"], "rendezvous": {"timeout_s": 2}}' > "$T/slowjoin.json"
start=$(date +%s%N)
DTRAIN_TEST_JOIN_DELAY=127.0.0.1:5000 timeout -k 5 60 "$DTRAIN" run "$T/slowjoin.json" --hosts localhost:1,127.0.0.1:1 --summary-json "$T/slowjoin.sum" >"$T/out" 2>"$T/err"
rc=$?; ms=$(( ($(date +%s%N) - start) / 1000000 ))
expect_eq "$rc" 1 "a node slow to join: exit 1"
expect_grep "^dtrain: job 'job' failed: rendezvous round 0 timed out after 2 s: 1 of at least 2 node\(s\) joined \(arrived: localhost\); not joined: 127.0.0.1 \(as node localhost saw it\)$" "$T/err" "a node slow to join: named as not joined"
[ "$ms" -lt 4500 ] && pass "a node slow to join: the job ends at the timeout (${ms} ms)" || fail "a node slow to join: the job took ${ms} ms"
sleep 4
run_id=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["run_id"])' "$T/slowjoin.sum")
[ -n "$run_id" ] && pgrep -f "agent .*--run-id $run_id" >/dev/null && fail "a node slow to join: its agent left running" || pass "a node slow to join: no agent left"
# A console that takes nothing for longer than shutdown_timeout_s + 10 s while a node's
# workers stop for a restart (rank 0 prints 20 MB in its SIGTERM handler; the reader sleeps
# 14 s): that node's end waits in the unread pipe, so it is not lost for it (before: "its
# workers did not end within 11 s of their stop", the node killed and excluded).
cat > "$T/flood.sh" <<'SH'
[ "$TORCHELASTIC_RESTART_COUNT" != 0 ] && { echo "rank $RANK done"; exit 0; }
if [ "$RANK" = 1 ]; then sleep 1; exit 1; fi
trap 'head -c 20000000 /dev/zero | tr "\0" "x" | fold -w 100; exit 0' TERM
while :; do sleep 0.1; done
SH
timeout -k 5 90 "$DTRAIN" run --hosts localhost:1,127.0.0.1:1 --max-restarts 1 --shutdown-timeout 1 -- sh "$T/flood.sh" 2>"$T/err" | (sleep 14; cat >"$T/out")
expect_eq "${PIPESTATUS[0]}" 0 "a held console through a restart: exit 0"
expect_no_grep "node_lost|did not end within" "$T/err" "a held console through a restart: no node lost for it"
expect_eq "$(grep -c ' done$' "$T/out")" 2 "a held console through a restart: round 1 ran on both nodes"
# 80 ranks with a log directory under a soft limit of 64 open files: dtrain raises its own
# limit (a log and pipes per rank: it ran out near 1000 ranks at the usual 1024) and gives the
# workers the limit it found; at a hard limit of 64 the failure says the limit and the fix.
(ulimit -Sn 64; "$DTRAIN" run --hosts localhost:40,127.0.0.1:40 --log-dir "$T/many" -- sh -c 'ulimit -Sn' >"$T/out" 2>"$T/err")
expect_eq "$?:$(grep -c '] 64$' "$T/out")" "0:80" "80 ranks logged under a soft limit of 64 files: each worker gets 64 back"
(ulimit -n 64; "$DTRAIN" run --hosts localhost:40,127.0.0.1:40 --log-dir "$T/many2" -- true >"$T/out" 2>"$T/err")
expect_eq "$?" 1 "80 ranks logged under a hard limit of 64 files: exit 1"
expect_grep "Too many open files \(this process may have 64 open, ulimit -n; hard limit 64\): raise the limit \(nofile in /etc/security/limits.conf, LimitNOFILE for a service\) and start again$" "$T/err" "out of descriptors: the limit and the fix"
expect_no_grep "node_lost" "$T/err" "out of descriptors: no node called lost for it"
# A worker's error file with a 3 MB message, across hosts: the failure is the rank's, its
# message cut to its beginning (before: the agent's record outgrew the launcher's 2 MiB, was
# dropped, and the node was lost as one that "reported no failed worker").
"$DTRAIN" run --hosts localhost:1,127.0.0.1:1 -- python3 -c '
import json, os, sys
if os.environ["RANK"] == "1":
    json.dump({"message": {"message": "RuntimeError: state " + "s" * 3000000, "extraInfo": {"py_callstack": "Traceback", "timestamp": "0"}}}, open(os.environ["TORCHELASTIC_ERROR_FILE"], "w"))
    sys.exit(3)
' >"$T/out" 2>"$T/err"
expect_eq "$?" 3 "a 3 MB error message across hosts: the rank's exit code"
expect_grep "^dtrain: job '.*' failed: rank 1 exited with code 3 \(RuntimeError: state sss" "$T/err" "a 3 MB error message across hosts: the rank's failure, its message"
expect_no_grep "reported no failed worker|node_lost" "$T/err" "a 3 MB error message across hosts: no node lost for it"
# An agent killed while the job stops on a SIGTERM (its workers take 1 s to honour theirs):
# the node is said lost and its rank listed as lost in the summary (before: the rank was
# dropped from the summary, and nothing named the node).
cat > "$T/slowstop.sh" <<'SH'
trap 'sleep 1; exit 0' TERM
touch "$0.$RANK"; while :; do sleep 0.1; done
SH
rm -f "$T"/slowstop.sh.*
"$DTRAIN" run --hosts localhost:1,127.0.0.1:1 --summary-json "$T/ss.sum" -- sh "$T/slowstop.sh" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
for _ in $(seq 200); do [ -e "$T/slowstop.sh.0" ] && [ -e "$T/slowstop.sh.1" ] && break; sleep 0.05; done
agent=$(pgrep -f "^$DTRAIN agent .*--node 127\.0\.0\.1( |$)" | head -1)
kill -TERM "$DTRAIN_PID"; sleep 0.3; kill -9 "$agent"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 143 "an agent killed during a SIGTERM stop: exit 143"
expect_grep "event node_lost \(round 0\) host 127.0.0.1: node 127.0.0.1 \(--hosts\) lost while the job was stopping: its agent exited with 137" "$T/err" "an agent killed during a SIGTERM stop: said"
expect_eq "$(python3 -c 'import json,sys; print([(r["rank"], r["lost"]) for r in json.load(open(sys.argv[1]))["ranks"]])' "$T/ss.sum")" "[(0, False), (1, True)]" "an agent killed during a SIGTERM stop: its rank listed as lost"
# On a terminal, every node's workers get its size less the widest "[node rank N] " prefix.
script -qec "stty cols 150 rows 40; $DTRAIN run --hosts localhost:1,127.0.0.1:1 -- sh -c 'echo cols=\$COLUMNS lines=\$LINES'" /dev/null 2>&1 | tr -d '\r' >"$T/cols.out"
expect_eq "$(grep -c '^\[[a-z0-9.]* rank [01]\] cols=131 lines=40$' "$T/cols.out")" 2 "across hosts: COLUMNS less the widest prefix ([127.0.0.1 rank 1] ), LINES"
finish
