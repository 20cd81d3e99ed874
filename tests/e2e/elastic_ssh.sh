# Elastic multi-node on the netns test bed (3 hosts x 2 slots, min_nodes 2): a node's agent
# killed, and a node cut off the network: the job goes on with 2 nodes, the host comes back
# after its cooldown and the world grows again, without spending another restart.
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/testbed_lib.sh"
testbed_up 3
jq_() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }
printf 'h1 slots=2\nh2 slots=2\nh3 slots=2\n' > "$T/hosts"
# Round 0 and 1 workers wait (to be interrupted); from round 2 on they finish.
cat > "$T/job.json" <<JSON
{"name": "elastic", "hostfile": "$T/hosts", "min_nodes": 2, "max_restarts": 3, "restart_backoff_s": 1,
 "shutdown_timeout_s": 2, "rendezvous": {"heartbeat_timeout_s": 3},
 "ssh": {"options": ["-F", "$TESTBED_SSH_CONFIG"], "connect_timeout_s": 3},
 "command": ["sh", "-c", "echo \$DTRAIN_ROUND \$WORLD_SIZE \$RANK >> $T/\$0/rounds.\$(hostname); echo \$\$ > $T/\$0/pid.\$DTRAIN_ROUND.\$RANK; if [ \$DTRAIN_ROUND -ge 2 ]; then sleep 1; else sleep 60; fi", "sh"]}
JSON

run_case() {  # run_case NAME: starts the job with its files under $T/NAME
  mkdir -p "$T/$1"
  sed "s|\"sh\"]}|\"$1\"]}|" "$T/job.json" > "$T/$1/job.json"
  "$DTRAIN" run "$T/$1/job.json" --summary-json "$T/$1/summary.json" >"$T/$1/out" 2>"$T/$1/err" &
  DTRAIN_PID=$!
  wait_for $(for r in 0 1 2 3 4 5; do echo "$T/$1/pid.0.$r"; done)
}
check_case() {  # check_case NAME HOST
  local d="$T/$1"
  wait "$DTRAIN_PID"; local rc=$?; DTRAIN_PID=
  expect_eq "$rc" 0 "$1: the job completes"
  expect_eq "$(jq_ "$d/summary.json" "d['restarts']")" 1 "$1: one restart spent (the join spent none)"
  expect_eq "$(jq_ "$d/summary.json" "[e['kind'] for e in d['events'] if e['host'] in ('$2', None)][:3]")" \
    "['node_lost', 'host_excluded', 'restart']" "$1: events name the lost host"
  expect_grep "event node_joined \(round 2\) host $2: $2 \($T/hosts:[0-9]\) is back" "$d/err" "$1: $2 joined round 2"
  expect_eq "$(awk '{print $1 ":" $2}' "$d/rounds.h1" | sort -u | tr '\n' ' ')" "0:6 1:4 2:6 " "$1: h1 saw world 6, then 4, then 6"
  expect_eq "$(awk '{print $1}' "$d/rounds.$2" | sort -u | tr '\n' ' ')" "0 2 " "$1: $2 sat out round 1"
  expect_eq "$(jq_ "$d/summary.json" "len(d['ranks'])")" 6 "$1: the final round had 6 ranks"
}

# 1. The agent on h3 is killed (SIGKILL): its workers die with it.
run_case agentkill
pkill -9 -f "^$DTRAIN agent .*--node h3 " || fail "no agent process for h3"
check_case agentkill h3

# 2. h2 is cut off the network: it misses its heartbeats and is dropped; once it is back it
#    rejoins.
run_case netcut
ip link set dtb-v2 down
cut=$(date +%s%N)
# h2's agent stops hearing the store: it gives up after 5 s and takes its guard and workers
# with it (it used to block ~30 s on the store's timeouts). What is left there then is only
# sshd's side of the dead session.
for _ in $(seq 100); do
  left=""
  for p in $(tb_pids h2); do ps -o args= -p "$p" 2>/dev/null | grep -q '^sshd' || left="$left $p"; done
  [ -z "$left" ] && break; sleep 0.1
done
ms=$(( ($(date +%s%N) - cut) / 1000000 ))
[ -z "$left" ] && [ "$ms" -le 8500 ] && pass "netcut: h2's agent, guard and workers gone ${ms} ms after the cut" ||
  { fail "netcut: on h2 after ${ms} ms:"; ps -o pid,ppid,stat,etime,args -p "$(echo $left $(tb_pids h2) | tr ' ' ,)" >&2; }
wait_for $(for r in 0 1 2 3; do echo "$T/netcut/pid.1.$r"; done)
ip link set dtb-v2 up
check_case netcut h2
grep -q "no heartbeat" "$T/netcut/err" && pass "netcut: lost for a silent heartbeat" || fail "netcut: no heartbeat reason: $(cat "$T/netcut/err")"

# 3. Below min_nodes: the survivor waits rendezvous.timeout_s for the lost host, then the job
#    fails clearly.
printf 'h1 slots=1\nh2 slots=1\n' > "$T/hosts2"
cat > "$T/min.json" <<JSON
{"name": "min", "hostfile": "$T/hosts2", "max_restarts": 2, "restart_backoff_s": 1, "shutdown_timeout_s": 1,
 "rendezvous": {"heartbeat_timeout_s": 2, "timeout_s": 5}, "command": ["sh", "-c", "echo \$\$ > $T/min.\$RANK; sleep 60"],
 "ssh": {"options": ["-F", "$TESTBED_SSH_CONFIG"], "connect_timeout_s": 2}}
JSON
"$DTRAIN" run "$T/min.json" --summary-json "$T/min.sum" >"$T/min.out" 2>"$T/min.err" &
DTRAIN_PID=$!
wait_for "$T/min.0" "$T/min.1"
start=$(date +%s)
ip link set dtb-v2 down
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=; took=$(( $(date +%s) - start ))
ip link set dtb-v2 up
expect_eq "$rc" 1 "below min_nodes: the job fails"
[ "$took" -le 25 ] && pass "failed after the wait (${took}s)" || fail "took ${took}s"
expect_grep "only 1 node\(s\) left, min_nodes is 2; waited 5 s \(rendezvous.timeout_s\)" "$T/min.err" "says why"
expect_eq "$(jq_ "$T/min.sum" "[e['kind'] for e in d['events']][:3]")" "['node_lost', 'host_excluded', 'restart']" "min: events"

# 4. An elastic job starts without a host that cannot be reached (enough are left), retries
#    it in the background, and completes; a non-elastic job would refuse to start.
printf 'h1 slots=1\n%s slots=1\nh2 slots=1\n' "$TESTBED_DOWN_HOST" > "$T/hosts3"
cat > "$T/down.json" <<JSON
{"name": "down", "hostfile": "$T/hosts3", "min_nodes": 2, "command": ["sh", "-c", "echo world \$WORLD_SIZE; sleep 2"],
 "ssh": {"options": ["-F", "$TESTBED_SSH_CONFIG"], "connect_timeout_s": 2}}
JSON
timeout 60 "$DTRAIN" run "$T/down.json" >"$T/down.out" 2>"$T/down.err"
expect_eq "$?" 0 "unreachable host, min_nodes 2: the job runs on the others"
expect_grep "pre-flight: 1 host\(s\) unreachable; starting with 2 \(min_nodes 2\)" "$T/down.err" "the start without it is said"
expect_grep "event host_excluded \(round 0\) host $TESTBED_DOWN_HOST" "$T/down.err" "host_excluded event"
expect_grep "^\[h2 rank 1\] world 2$" "$T/down.out" "world of 2"

# 5. A host coming back that cannot run the job's workers (its data files are not there: a
#    fresh replacement host) did not come back, like a host that does not answer: the job
#    goes on without it, and tries it again later. It does not end a job that runs well on
#    the others. (h3's sshd gets an empty tmpfs over the data directory once the job runs:
#    its first agent read the files, the one coming back finds none.)
mkdir -p "$T/rj/data"
blobs_csv "$T/rj/data/rj.csv" 300
printf 'h1 slots=1\nh2 slots=1\nh3 slots=1\n' > "$T/rj/hosts"
cat > "$T/rj/job.json" <<JSON
{"name": "rejoin", "hostfile": "$T/rj/hosts", "min_nodes": 2, "max_restarts": 3, "restart_backoff_s": 1,
 "shutdown_timeout_s": 2, "rendezvous": {"heartbeat_timeout_s": 3},
 "ssh": {"options": ["-F", "$TESTBED_SSH_CONFIG"], "connect_timeout_s": 3},
 "trainer": {"model": {"layers": [2, 16, 3]}, "data": {"type": "csv", "path": "$T/rj/data/rj.csv"},
  "batch_size": 16, "epochs": 1000000, "optimizer": {"lr": 0.05}, "log_every_steps": 1000000}}
JSON
"$DTRAIN" run "$T/rj/job.json" >"$T/rj/out" 2>"$T/rj/err" &
DTRAIN_PID=$!
for _ in $(seq 200); do grep -q "trainer: data mapped" "$T/rj/out" && break; sleep 0.1; done
expect_grep "^\[h1 rank 0\] trainer: data mapped" "$T/rj/out" "rejoin: the job runs on 3 hosts"
h3sshd=$(cat "$TESTBED_DIR/h3/sshd.pid")
nsenter -t "$h3sshd" -m mount -t tmpfs dtrain-e2e-empty "$T/rj/data" || fail "rejoin: cannot mount over h3's data"
pkill -9 -f "^$DTRAIN agent .*--node h3 " || fail "rejoin: no agent process for h3"
for _ in $(seq 200); do grep -q "host_excluded.*did not come back" "$T/rj/err" && break; sleep 0.1; done
expect_grep "event host_excluded \(round 1\) host h3: h3 \($T/rj/hosts:3\) did not come back: its agent \(ssh\) exited with 2: node h3: .*rj\.csv" \
  "$T/rj/err" "rejoin: h3 without its data did not come back, saying why"
sleep 1
alive "$DTRAIN_PID" && pass "rejoin: the job goes on without h3" || fail "rejoin: the job ended: $(tail -5 "$T/rj/err")"
# (the job's own failure line; the workers' stop messages may say a peer "failed")
expect_no_grep "^dtrain: job .* failed" "$T/rj/err" "rejoin: no failure"
kill -INT "$DTRAIN_PID"; wait "$DTRAIN_PID"; DTRAIN_PID=
nsenter -t "$h3sshd" -m umount "$T/rj/data" || fail "rejoin: cannot unmount h3's tmpfs"
finish
