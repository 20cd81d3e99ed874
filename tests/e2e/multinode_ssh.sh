# Multi-node over real ssh: 3 network-namespace hosts with their own sshd (scripts/testbed),
# 2 slots each. The launcher runs in the root namespace and reaches them through ssh; the
# hosts share this machine's filesystem, so the same dtrain binary path works everywhere.
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/testbed_lib.sh"
testbed_up 3
cat > "$T/hosts" <<EOF2
# OpenMPI, Horovod and user@host forms
h1 slots=2
h2:2
root@h3 slots=2   # trailing comment
EOF2
job() {  # job NAME COMMAND-JSON [EXTRA-KEYS]
  cat > "$T/$1.json" <<JSON
{"name": "$1", "command": $2, "hostfile": "$T/hosts", "shutdown_timeout_s": 3,
 "ssh": {"options": ["-F", "$TESTBED_SSH_CONFIG"], "connect_timeout_s": 5}${3:-}}
JSON
}
v() { grep -E "^$2=" "$T/env.$1" | head -1 | cut -d= -f2-; }

# 1. The torchrun environment on every rank of every host.
printf '# env file\nexport FROM_FILE="file value"\nBOTH=file\n' > "$T/vars.env"
job env '["sh", "-c", "env > '"$T"'/env.$RANK; echo host=$(hostname)"]' ', "env_file": "'"$T"'/vars.env", "env": {"BOTH": "spec"}'
NCCL_DEBUG=INFO MY_PRIVATE_VAR=1 timeout 60 "$DTRAIN" run "$T/env.json" --log-dir "$T/logs" --env FROM_CLI=x >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "6 workers on 3 hosts exit 0"
for r in 0 1 2 3 4 5; do
  [ -f "$T/env.$r" ] || { fail "rank $r did not run"; continue; }
  node=$((r / 2))
  expect_eq "$(v $r GROUP_RANK)/$(v $r LOCAL_RANK)/$(v $r WORLD_SIZE)/$(v $r LOCAL_WORLD_SIZE)/$(v $r GROUP_WORLD_SIZE)" \
    "$node/$((r % 2))/6/2/3" "rank $r: GROUP_RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE/GROUP_WORLD_SIZE"
  expect_eq "$(v $r MASTER_ADDR)" "$TESTBED_ADDR_h1" "rank $r MASTER_ADDR is node 0's address"
  expect_eq "$(v $r MASTER_PORT)" "$(v 0 MASTER_PORT)" "rank $r MASTER_PORT"
  expect_eq "$(v $r DTRAIN_STORE_ADDR)" "$TESTBED_GATEWAY" "rank $r reaches the store at the launcher's address"
done
# Environment reaches remote workers only explicitly: forwarded prefixes, env_file, env, --env.
expect_eq "$(v 5 NCCL_DEBUG)" INFO "NCCL_* forwarded to remote workers"
expect_eq "$(v 5 MY_PRIVATE_VAR)" "" "other launcher variables are not forwarded"
expect_eq "$(v 5 FROM_FILE)" "file value" "env_file reaches remote workers"
expect_eq "$(v 5 BOTH)" spec "spec env wins over env_file"
expect_eq "$(v 5 FROM_CLI)" x "--env reaches remote workers"
expect_eq "$(v 3 PWD)" "$(pwd)" "remote workers start in the launcher's directory"
for h in 1 2 3; do
  expect_grep "^\[h$h rank $(( (h - 1) * 2 + 1 ))\] host=h$h$" "$T/out" "h$h's workers ran on h$h, lines prefixed with host and rank"
done
expect_eq "$(grep -v '^==== dtrain run ' "$T/logs/rank_5.log")" "host=h3" "remote rank's log file on the launching host"
# The job secret travels on ssh's stdin, never in a command line on any host.
tok=$(v 0 DTRAIN_STORE_TOKEN)
[ ${#tok} -eq 64 ] && pass "token reached remote workers" || fail "no token on rank 0"

# 2. The built-in trainer across hosts: identical weights everywhere (checked by the trainer),
#    and the same weights as 6 local workers.
cat > "$T/train.json" <<JSON
{"name": "mn-train", "hostfile": "$T/hosts", "ssh": {"options": ["-F", "$TESTBED_SSH_CONFIG"]},
 "trainer": {"model": {"layers": [32, 64, 4]}, "data": {"type": "synthetic", "train_samples": 3072, "eval_samples": 512, "seed": 3},
  "batch_size": 32, "epochs": 1, "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9}, "log_every_steps": 1000}}
JSON
timeout 120 "$DTRAIN" run "$T/train.json" --summary-json "$T/mn.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "trainer on 3 hosts"
timeout 120 "$DTRAIN" run "$T/train.json" --hosts localhost:6 --env DTRAIN_COMM_SHM=0 --summary-json "$T/sn.json" >"$T/out1" 2>"$T/err1"
expect_eq "$?" 0 "trainer on 1 host x 6"
h1=$(grep -o '"weights_sha256": *"[0-9a-f]*"' "$T/mn.json"); h2=$(grep -o '"weights_sha256": *"[0-9a-f]*"' "$T/sn.json")
[ -n "$h1" ] && expect_eq "$h1" "$h2" "3 hosts x 2 == 1 host x 6 (weights hash)" || fail "no trainer outcome: $(cat "$T/mn.json" "$T/err")"

# 2b. Pipeline parallelism across hosts: 2 replicas x 3 stages on 3 hosts x 2 slots, so
#     pipelines {0,1,2} and {3,4,5} cross hosts (activations over the network) and every
#     stage group spans two hosts; the same weights as on one host.
cat > "$T/pipe.json" <<JSON
{"name": "mn-pipe", "hostfile": "$T/hosts", "ssh": {"options": ["-F", "$TESTBED_SSH_CONFIG"]},
 "trainer": {"model": {"layers": [32, 64, 48, 4]}, "data": {"type": "synthetic", "train_samples": 3072, "eval_samples": 256, "seed": 3},
  "batch_size": 16, "epochs": 1, "max_steps": 40, "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9},
  "log_every_steps": 1000, "device": "cpu", "parallel": {"pipeline_stages": 3, "micro_batches": 4, "schedule": "1f1b"}}}
JSON
timeout 120 "$DTRAIN" run "$T/pipe.json" --summary-json "$T/mp.json" >"$T/outp" 2>"$T/errp"
expect_eq "$?" 0 "pipeline 2 x 3 across 3 hosts"
expect_grep "trainer: 6 workers = 2 replicas x 3 pipeline stages" "$T/outp" "pipeline layout across hosts"
timeout 120 "$DTRAIN" run "$T/pipe.json" --hosts localhost:6 --summary-json "$T/sp.json" >"$T/outp1" 2>"$T/errp1"
expect_eq "$?" 0 "pipeline 2 x 3 on one host"
p1=$(grep -o '"weights_sha256": *"[0-9a-f]*"' "$T/mp.json"); p2=$(grep -o '"weights_sha256": *"[0-9a-f]*"' "$T/sp.json")
[ -n "$p1" ] && expect_eq "$p1" "$p2" "pipeline across hosts == on one host (weights hash)" || fail "no pipeline outcome: $(cat "$T/errp")"

# 2c. File data across hosts: each host's agent parses the files once for its workers (the
#     data image); DTRAIN_DATA_SHARE=0 where dtrain run starts reaches the agents over ssh
#     (their environment is sshd's, not the launcher's): every worker parses for itself, with
#     the same weights.
blobs_csv "$T/mn.csv" 600
cat > "$T/csv.json" <<JSON
{"name": "mn-csv", "hostfile": "$T/hosts", "ssh": {"options": ["-F", "$TESTBED_SSH_CONFIG"]},
 "trainer": {"model": {"layers": [2, 16, 3]}, "data": {"type": "csv", "path": "$T/mn.csv"},
  "batch_size": 16, "epochs": 1, "optimizer": {"lr": 0.05, "momentum": 0.9}, "log_every_steps": 1000}}
JSON
timeout 120 "$DTRAIN" run "$T/csv.json" >"$T/outc" 2>"$T/errc"
expect_eq "$?" 0 "csv trainer on 3 hosts"
expect_grep "^\[h1 rank 0\] trainer: data mapped from this host's data image" "$T/outc" "csv on 3 hosts: h1's agent made a data image"
DTRAIN_DATA_SHARE=0 timeout 120 "$DTRAIN" run "$T/csv.json" >"$T/outc0" 2>"$T/errc0"
expect_eq "$?" 0 "csv trainer on 3 hosts, DTRAIN_DATA_SHARE=0"
grep -q "data image" "$T/outc0" "$T/errc0" && fail "DTRAIN_DATA_SHARE=0 did not reach the agents: $(grep "data image" "$T/outc0")" ||
  pass "DTRAIN_DATA_SHARE=0 reaches the agents over ssh: no data image"
c1=$(sed -n 's/.*weights sha256 \([0-9a-f]*\).*/\1/p' "$T/outc"); c0=$(sed -n 's/.*weights sha256 \([0-9a-f]*\).*/\1/p' "$T/outc0")
[ -n "$c1" ] && expect_eq "$c1" "$c0" "csv on 3 hosts: the same weights with and without the images" || fail "no weights line: $(tail -3 "$T/outc")"
DTRAIN_DATA_SHARE=maybe "$DTRAIN" run "$T/csv.json" >/dev/null 2>"$T/errc2"
expect_eq "$?" 2 "a bad DTRAIN_DATA_SHARE with a hostfile: exit 2"
expect_grep "DTRAIN_DATA_SHARE" "$T/errc2" "a bad DTRAIN_DATA_SHARE with a hostfile: named"

# 2d. A trainer job a host cannot hold is refused by its agent before the rendezvous (exit 2,
#     naming the node, the field and the fix), as the launcher refuses a local one, instead
#     of its workers' allocation failures after the launch. DTRAIN_MEMORY_CHECK=0 where dtrain
#     run starts reaches the agents: the workers start (and fail on their own check).
cat > "$T/huge.json" <<JSON
{"name": "mn-huge", "hostfile": "$T/hosts", "ssh": {"options": ["-F", "$TESTBED_SSH_CONFIG"]},
 "trainer": {"model": {"layers": [784, 4096, 10]}, "data": {"type": "synthetic", "train_samples": 2000000, "eval_samples": 100},
  "batch_size": 1048576, "epochs": 1}}
JSON
timeout 60 "$DTRAIN" run "$T/huge.json" >"$T/outh" 2>"$T/errh"
expect_eq "$?" 2 "a job larger than a host's memory: exit 2"
expect_grep "^dtrain: job 'mn-huge' failed: node h[123]: $T/huge.json: /trainer/batch_size: this job needs about [0-9.]+ GiB of memory on this host \(2 workers, the largest \(rank [0-9]\) [0-9.]+ GiB: activations and batch buffers [0-9.]+ GiB\), more than the [0-9.]+ [MG]iB available .*; use a smaller batch_size \(now 1048576\) or fewer workers per host \(nproc_per_node 2\)$" \
  "$T/errh" "a job larger than a host's memory: the node, the numbers and the fix"
expect_no_grep "rank [0-9]" "$T/outh" "a job larger than a host's memory: no worker started"
DTRAIN_MEMORY_CHECK=0 timeout 60 "$DTRAIN" run "$T/huge.json" >"$T/outh0" 2>"$T/errh0"
expect_eq "$?" 2 "DTRAIN_MEMORY_CHECK=0: the workers' own check fails"
expect_grep "smaller than one global batch" "$T/errh0" "DTRAIN_MEMORY_CHECK=0 reaches the agents over ssh: the workers started"

# 3. A worker failing on h2 tears down h1 and h3.
job fail '["sh", "-c", "echo $$ > '"$T"'/pid.$RANK; if [ $RANK = 2 ]; then sleep 1; echo \"cuda oom\" >&2; exit 5; fi; exec sleep 120"]'
start=$(date +%s)
timeout 60 "$DTRAIN" run "$T/fail.json" >"$T/out" 2>"$T/err"
rc=$?; took=$(( $(date +%s) - start ))
expect_eq "$rc" 5 "exit code of the failing remote worker"
[ "$took" -lt 20 ] && pass "all hosts torn down in ${took}s" || fail "teardown took ${took}s"
expect_grep "failed: rank 2 exited with code 5" "$T/err" "summary names the rank"
expect_grep "host: +h2" "$T/err" "summary names the host"
expect_grep "\| cuda oom" "$T/err" "summary has the remote stderr tail"
for h in h1 h2 h3; do tb_wait_no_pids $h 10 && pass "nothing left on $h" || fail "leftovers on $h"; done

# 4. SIGKILL of the launcher: every host is empty within 10 s.
rm -f "$T"/pid.*
job sleep '["sh", "-c", "echo $$ > '"$T"'/pid.$RANK; exec sleep 120"]'
"$DTRAIN" run "$T/sleep.json" >/dev/null 2>&1 &
DTRAIN_PID=$!
wait_for "$T/pid.0" "$T/pid.1" "$T/pid.2" "$T/pid.3" "$T/pid.4" "$T/pid.5"
kill -9 "$DTRAIN_PID"; wait "$DTRAIN_PID" 2>/dev/null; DTRAIN_PID=
for h in h1 h2 h3; do tb_wait_no_pids $h 10 && pass "$h empty 10 s after the launcher's SIGKILL" || fail "orphans on $h"; done

# 5. Ctrl-C on the launcher tears every host down (exit 130).
rm -f "$T"/pid.*
"$DTRAIN" run "$T/sleep.json" >/dev/null 2>&1 &
DTRAIN_PID=$!
wait_for "$T/pid.0" "$T/pid.5"
# The job secret travels on ssh's stdin: no command line on this machine (all test bed hosts
# share its process table) carries it.
tok=$(tr '\0' '\n' < /proc/"$(cat "$T/pid.5")"/environ | grep '^DTRAIN_STORE_TOKEN=' | cut -d= -f2)
[ ${#tok} -eq 64 ] && pass "remote worker has the token" || fail "no token in rank 5's environment"
if ps -eo args | grep -v grep | grep -qF "$tok"; then fail "the token is visible in a command line"; else pass "token in no command line"; fi
kill -INT "$DTRAIN_PID"; wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 130 "SIGINT: exit 130"

# 5b. Ctrl-C while a host's agent still reads its data files (h3's copy is a FIFO that never
#     delivers a row, bound over the file in h3's mount namespace): the agent ends with the
#     launcher, rather than staying behind, blocked in its parse, after the job has gone.
cp "$T/mn.csv" "$T/st.csv"; mkfifo "$T/st.fifo"
sed "s|$T/mn.csv|$T/st.csv|" "$T/csv.json" > "$T/st.json"
h3sshd=$(cat "$TESTBED_DIR/h3/sshd.pid")
nsenter -t "$h3sshd" -m mount --bind "$T/st.fifo" "$T/st.csv" || fail "cannot bind the FIFO over h3's data file"
"$DTRAIN" run "$T/st.json" >"$T/st.out" 2>"$T/st.err" &
DTRAIN_PID=$!
for _ in $(seq 100); do tb_pids h3 | xargs -r ps -o args= -p 2>/dev/null | grep -q "^$DTRAIN agent" && break; sleep 0.1; done
sleep 1  # (its agent is in its parse now, waiting for rows)
kill -INT "$DTRAIN_PID"; wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 130 "Ctrl-C during h3's parse: exit 130"
tb_wait_no_pids h3 5 && pass "Ctrl-C during h3's parse: nothing left on h3" || fail "Ctrl-C during h3's parse: h3's agent stayed"
nsenter -t "$h3sshd" -m umount "$T/st.csv" || fail "cannot unbind h3's FIFO"

# A dropped ssh connection (its client killed): that node's agent kills its workers (stdin
# EOF), the launcher reports the node lost and tears the other hosts down.
rm -f "$T"/pid.*
"$DTRAIN" run "$T/sleep.json" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
wait_for "$T/pid.0" "$T/pid.1" "$T/pid.2" "$T/pid.3" "$T/pid.4" "$T/pid.5"
sshpid=$(pgrep -P "$DTRAIN_PID" -f "ssh .* h2 exec")
[ -n "$sshpid" ] && kill -9 "$sshpid"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 1 "lost node: exit 1"
expect_grep "node h2 \($T/hosts:3\) lost: its agent \(ssh\) exited with 137" "$T/err" "the lost node is named"
for h in h1 h2 h3; do tb_wait_no_pids $h 10 && pass "$h empty after h2's connection dropped" || fail "leftovers on $h after a dropped connection"; done
for h in h1 h2 h3; do tb_wait_no_pids $h 10 && pass "$h empty after SIGINT" || fail "leftovers on $h after SIGINT"; done

# 6. Real PyTorch DDP (gloo) across hosts, unmodified: 3 hosts x 1 worker.
if /usr/bin/python3 -c "import torch" 2>/dev/null; then
  job ddp '["/usr/bin/python3", "'"$SRC"'/examples/pytorch/ddp_minimal.py"]' ', "env": {"OMP_NUM_THREADS": "1"}'
  # gloo picks its interface by name; every test bed host calls its NIC eth0.
  timeout 150 "$DTRAIN" run "$T/ddp.json" --hosts h1:1,h2:1,h3:1 --env GLOO_SOCKET_IFNAME=eth0 >"$T/out" 2>"$T/err"
  expect_eq "$?" 0 "PyTorch DDP across 3 hosts exits 0"
  for h in 1 2 3; do
    r=$((h - 1))
    expect_grep "^\[h$h rank $r\] rank $r/3: loss [0-9.]+ weights_in_sync=True$" "$T/out" "torch rank $r on h$h trained in sync"
  done
else
  fail "python3-torch is not installed (scripts/setup.sh installs it)"
fi

# 7. dtrain bench across hosts: verified all-reduce between h1 and h2 over TCP.
timeout 60 "$DTRAIN" bench allreduce --hosts h1:1,h2:1 --ssh-option=-F --ssh-option="$TESTBED_SSH_CONFIG" -b 4K -e 1M -f 16 -n 3 -w 1 >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "bench allreduce across 2 hosts"
expect_grep "^# transport: tcp$" "$T/out" "across hosts the transport is TCP"
expect_grep "^ +1048576 +262144 +float +sum .* 0$" "$T/out" "1 MiB row verified"
expect_grep "Out of bounds values : 0 OK" "$T/out" "no wrong values"

# 8. Pre-flight: an unreachable host fails the job before anything starts, within the timeout.
printf 'h1 slots=1\n%s slots=1\n' "$TESTBED_DOWN_HOST" > "$T/hosts"
job pre '["sh", "-c", "touch '"$T"'/started.$RANK"]'
sed -i 's/"connect_timeout_s": 5/"connect_timeout_s": 2/' "$T/pre.json"
start=$(date +%s)
timeout 60 "$DTRAIN" run "$T/pre.json" >"$T/out" 2>"$T/err"
rc=$?; took=$(( $(date +%s) - start ))
expect_eq "$rc" 1 "pre-flight failure exits 1"
[ "$took" -le 10 ] && pass "pre-flight answered in ${took}s" || fail "pre-flight took ${took}s"
expect_grep "pre-flight failed for 1 of 2 remote host\(s\)" "$T/err" "pre-flight summary"
expect_grep "^  $TESTBED_DOWN_HOST \($T/hosts:2\): " "$T/err" "the unreachable host is named with its hostfile line"
ls "$T"/started.* >/dev/null 2>&1 && fail "workers started despite a failed pre-flight" || pass "nothing started"

# 9. Pre-flight: a different dtrain on a host is refused.
printf '#!/bin/sh\necho "dtrain 0.0.1 (CPU build)"\n' > "$T/old-dtrain"; chmod +x "$T/old-dtrain"
printf 'h1 slots=1\nh2 slots=1\n' > "$T/hosts"
job ver '["true"]' ''
sed -i "s|\"connect_timeout_s\": 5|\"connect_timeout_s\": 5, \"dtrain_path\": \"$T/old-dtrain\"|" "$T/ver.json"
timeout 60 "$DTRAIN" run "$T/ver.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 1 "version mismatch exits 1"
expect_grep "version mismatch: \"dtrain 0.0.1 \(CPU build\)\" there" "$T/err" "version mismatch named"
finish
