# Collectives through real processes: dtrain bench (verified results, table, JSON, flags;
# sendrecv's ping-pong too),
# and ranks that lose a peer to SIGKILL or SIGSTOP fail within the timeout, every one naming
# it (and so does the job's first failure in the store), over
# the same-host shared-memory transport (the default here) and over TCP (DTRAIN_COMM_SHM=0);
# no shared-memory segment is left in /dev/shm, even after a SIGKILL (also in the middle of
# the set-up).
source "$(dirname "$0")/lib.sh"
WORKER="$(dirname "$DTRAIN")/comm_worker"

"$DTRAIN" bench allreduce --nproc-per-node 3 -b 1K -e 1M -f 4 -n 3 -w 1 --json "$T/ar.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "bench allreduce exits 0"
expect_grep "^# +size +count +type +redop +time +algbw +busbw +#wrong$" "$T/out" "nccl-tests header"
expect_grep "^ +1048576 +262144 +float +sum +[0-9.]+ +[0-9.]+ +[0-9.]+ +0$" "$T/out" "1 MiB row verified"
expect_grep "^# Out of bounds values : 0 OK$" "$T/out" "footer"
expect_grep "^# transport: shm$" "$T/out" "same host: shared-memory transport"
grep -q "^# 1 rank" "$T/out" && fail "3 ranks: no 1-rank note" || pass "3 ranks: no 1-rank note"
"$DTRAIN" bench allreduce --nproc-per-node 1 -b 1K -e 4K -n 1 -w 0 >"$T/out1" 2>"$T/err"
expect_eq "$?" 0 "bench allreduce 1 rank exits 0"
expect_grep "^# 1 rank: nothing moves between ranks; busbw is 0 by definition" "$T/out1" "1 rank: said that it measures no bandwidth"
"$DTRAIN" bench broadcast --nproc-per-node 1 -b 1K -e 4K -n 1 -w 0 >"$T/out1" 2>"$T/err"
expect_eq "$(awk '!/^#/ && NF >= 8 {print $7}' "$T/out1" | sort -u | tr '\n' ' ')" "0.000 " "1 rank, broadcast too: busbw 0 in every row"
python3 - "$T/ar.json" >"$T/check" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
n = d["ranks"]
ok = all(abs(r["busbw_gbps"] - r["algbw_gbps"] * 2 * (n - 1) / n) < 1e-5 + 1e-4 * r["busbw_gbps"] for r in d["rows"])
print(len(d["rows"]), n, ok, sum(r["wrong"] for r in d["rows"]))
PY
expect_eq "$(cat "$T/check")" "6 3 True 0" "JSON rows, busbw = algbw*2(n-1)/n, no wrong values"
expect_grep '"transport": "shm"' "$T/ar.json" "JSON names the transport"
DTRAIN_COMM_SHM=0 "$DTRAIN" bench allreduce --nproc-per-node 2 -b 1K -e 256K -f 16 -n 2 -w 0 >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "bench with DTRAIN_COMM_SHM=0 exits 0"
expect_grep "^# transport: tcp$" "$T/out" "DTRAIN_COMM_SHM=0: TCP transport"
DTRAIN_COMM_SHM=maybe "$DTRAIN" bench allreduce --nproc-per-node 2 -b 1K -e 1K -n 1 -w 0 >"$T/out" 2>"$T/err"
[ "$?" -ne 0 ] && pass "bad DTRAIN_COMM_SHM fails" || fail "DTRAIN_COMM_SHM=maybe accepted"
DTRAIN_COMM_CHECK=maybe "$DTRAIN" bench allreduce --nproc-per-node 2 -b 1K -e 1K -n 1 -w 0 >"$T/out" 2>"$T/err"
expect_eq "$?:$(cat "$T/err")" "2:dtrain: error: DTRAIN_COMM_CHECK=\"maybe\": expected 0 or 1 (also off/on, false/true, no/yes)" "bad DTRAIN_COMM_CHECK: refused before the ranks start"
DTRAIN_COMM_CHECK=maybe "$DTRAIN" run --nproc-per-node 2 -- sh -c "touch $T/check-ran" >"$T/out" 2>"$T/err"
expect_eq "$?:$(cat "$T/err")" "2:dtrain: error: DTRAIN_COMM_CHECK=\"maybe\": expected 0 or 1 (also off/on, false/true, no/yes)" "bad DTRAIN_COMM_CHECK: run refuses it before the launch"
[ -e "$T/check-ran" ] && fail "bad DTRAIN_COMM_CHECK: a worker ran" || pass "bad DTRAIN_COMM_CHECK: no worker ran"
"$DTRAIN" run --env DTRAIN_COMM_CHECK=x --nproc-per-node 1 -- true 2>"$T/err"; expect_eq "$?" 2 "--env DTRAIN_COMM_CHECK=x exits 2"
# avg over 3 ranks divides by 3: checked to the type's rounding, not bit for bit.
for spec in "broadcast -d int64" "allgather -d half" "allreduce -d bfloat16 -o max" "allreduce -d int32 -o avg" \
            "allreduce -o avg" "allreduce -d half -o avg"; do
  "$DTRAIN" bench $spec --nproc-per-node 3 -b 2K -e 64K -f 8 -n 2 -w 0 >"$T/out" 2>"$T/err"
  expect_eq "$?" 0 "bench $spec verified"
done
# Rows are printed as they are measured (nccl-tests style): a sweep interrupted by Ctrl-C
# keeps the rows it finished. Bad flags are refused before any rank starts.
# --json keeps them too (rewritten after each row, "complete": false), for SIGINT and SIGTERM.
partial_json() {  # JSON TABLE LABEL: the JSON's rows are the table's (the last one may be cut short)
  python3 - "$1" "$2" >"$T/check" <<'PY'
import json, re, sys
d = json.load(open(sys.argv[1]))
table = [int(l.split()[0]) for l in open(sys.argv[2]) if re.match(r"^ +[0-9]+ ", l)]
rows = [r["bytes"] for r in d["rows"]]
print(d["complete"], len(rows) > 0 and rows == table[:len(rows)] and len(table) - len(rows) <= 1)
PY
  expect_eq "$(cat "$T/check")" "False True" "$3: --json holds the rows measured, marked incomplete"
  [ -e "$1.tmp" ] && fail "$3: temporary JSON left" || pass "$3: no temporary JSON left"
}
# --json /dev/stdout or - (a pipe, a terminal): one document at the end, not one per row,
# and the table on stderr, so that stdout parses as JSON (before: the table, then the JSON).
for j in /dev/stdout -; do
  "$DTRAIN" bench allreduce --nproc-per-node 2 -b 4K -e 64K -n 2 -w 1 --json $j >"$T/stdout.txt" 2>"$T/err"
  expect_eq "$?" 0 "--json $j: exit 0"
  expect_eq "$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["collective"], len(d["rows"]), d["complete"])' "$T/stdout.txt" 2>&1)" "allreduce 5 True" "--json $j: stdout is one JSON document"
  expect_grep "^ +65536 +16384 +float +sum " "$T/err" "--json $j: the table on stderr"
done
# Across hosts rank 0 checks the path on its host before the ranks meet: someone's file is
# not replaced, a missing directory is exit 2 at once (before: both only checked for local
# ranks; across hosts the file was overwritten, or the sweep ran and then failed).
echo precious >"$T/notjson.txt"
timeout 60 "$DTRAIN" bench allreduce --hosts localhost:2 -b 4 -e 8 -n 1 --json "$T/notjson.txt" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "--hosts, --json someone's file: exit 2"
expect_eq "$(cat "$T/notjson.txt")" "precious" "--hosts, --json someone's file: left as it was"
expect_grep "--json: \"$T/notjson.txt\" exists and is not a dtrain bench --json file" "$T/err" "--hosts, --json someone's file: said"
expect_no_grep "bytes" "$T/out" "--hosts, --json someone's file: no sweep"
timeout 60 "$DTRAIN" bench allreduce --hosts localhost:2 -b 4 -e 8 -n 1 --json /nonexistent-dir/x.json >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "--hosts, --json in a missing directory: exit 2"
expect_grep "directory /nonexistent-dir does not exist" "$T/err" "--hosts, --json in a missing directory: said"
timeout --preserve-status -s INT 4 "$DTRAIN" bench allreduce -b 4K -e 1G -n 1 -w 0 --json "$T/int.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 130 "interrupted sweep exits 130"
expect_grep "^ +4096 +1024 +float +sum " "$T/out" "interrupted sweep kept its first rows"
partial_json "$T/int.json" "$T/out" "SIGINT"
timeout --preserve-status -s TERM 4 "$DTRAIN" bench allreduce -b 4K -e 1G -n 1 -w 0 --json "$T/term.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 143 "sweep stopped by SIGTERM exits 143"
partial_json "$T/term.json" "$T/out" "SIGTERM"
"$DTRAIN" bench allreduce -b 1K -e 4K -n 1 -w 0 --json "$T/full.json" >"$T/out" 2>"$T/err"
expect_grep '"complete": true' "$T/full.json" "a finished sweep's JSON is complete"
# An empty --json (an unset variable) is refused, not taken as "no JSON".
"$DTRAIN" bench allreduce -e 4K --json "" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "bench --json \"\" exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: --json: the value is empty (an unset variable?); give a value or leave the option out" "bench --json \"\" explained"
# --backend nccl needs a CUDA build and a GPU: refused before any rank starts (no table).
if "$DTRAIN" --version | grep -q "CPU build" || [ ! -e /dev/nvidia0 ] || [ "${CUDA_VISIBLE_DEVICES-x}" = "" ]; then
  "$DTRAIN" bench allreduce -e 4K --backend nccl >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "--backend nccl without CUDA or GPU exits 2"
  expect_eq "$(wc -l <"$T/err")" 1 "--backend nccl without CUDA or GPU: one line"
  expect_grep "^dtrain: error: --backend: nccl needs a (CUDA build|GPU)" "$T/err" "--backend nccl: the need named"
  expect_eq "$(cat "$T/out")" "" "--backend nccl: no rank started"
fi
# A wrong result is counted, shown and fails the run (exit 1): one rank alters one value of
# each size's result (DTRAIN_DEBUG_BENCH_CORRUPT, fault injection for tests).
for c in allreduce broadcast allgather; do
  DTRAIN_DEBUG_BENCH_CORRUPT=1 "$DTRAIN" bench $c --nproc-per-node 3 -b 4K -e 16K -n 1 -w 0 --json "$T/wrong.json" >"$T/out" 2>"$T/err"
  expect_eq "$?" 1 "bench $c with a wrong value: exit 1"
  expect_eq "$(grep -cE '^ +[0-9]+ .* 1$' "$T/out")" 3 "bench $c with a wrong value: #wrong 1 on each of the 3 rows"
  expect_grep "^# Out of bounds values : 3 FAILED" "$T/out" "bench $c with a wrong value: the footer says FAILED"
  expect_grep '"wrong": 1' "$T/wrong.json" "bench $c with a wrong value: in the JSON too"
done
# ... whatever the type and reduction: a bfloat16 avg over 3 ranks is checked to its
# rounding, which an altered low byte stayed within (the injection proved nothing there).
for dt in bfloat16 float16 int32 float64; do
  DTRAIN_DEBUG_BENCH_CORRUPT=1 "$DTRAIN" bench allreduce --nproc-per-node 3 -b 8 -e 2048 -f 16 -n 1 -w 0 -d $dt -o avg >"$T/out" 2>"$T/err"
  expect_eq "$?" 1 "bench allreduce -d $dt -o avg with a wrong value: exit 1"
done
# -o is allreduce's: refused, not ignored, elsewhere.
for c in broadcast allgather sendrecv; do
  "$DTRAIN" bench $c -o max -e 4K >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "bench $c -o max exits 2"
  expect_eq "$(cat "$T/err")" "dtrain: error: -o/--op: bench $c has no reduction; -o applies to bench allreduce only, leave it out" "bench $c -o: explained"
done
for bad in "--backend foo" "--timeout 0" "--json /nonexistent-dir/x.json" "-f 4000000"; do
  "$DTRAIN" bench allreduce $bad >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "bench $bad exits 2"
  expect_eq "$(wc -l <"$T/err")" 1 "bench $bad: one line"
done
# Point to point: 2-rank ping-pong down to 8 bytes, payloads verified both ways, over the
# per-pair shared-memory channels by default and over the sockets with DTRAIN_COMM_SHM=0.
for transport in shm tcp; do
  shm=1; [ "$transport" = tcp ] && shm=0
  DTRAIN_COMM_SHM=$shm "$DTRAIN" bench sendrecv -b 8 -e 1M -f 8 -n 20 -w 2 --json "$T/sr.json" >"$T/out" 2>"$T/err"
  expect_eq "$?" 0 "bench sendrecv ($transport) exits 0"
  expect_grep "^# dtrain bench sendrecv: 2 ranks, backend tcp" "$T/out" "sendrecv title"
  expect_grep "^# transport: $transport$" "$T/out" "send/recv go over $transport"
  expect_grep "^# +size +count +type +redop +time +algbw +busbw +#wrong$" "$T/out" "sendrecv nccl-tests header"
  expect_grep "^ +8 +2 +float +none +[0-9.]+ +[0-9.]+ +[0-9.]+ +0$" "$T/out" "8-byte row verified ($transport)"
  expect_grep "^ +262144 +65536 +float +none +[0-9.]+ +[0-9.]+ +[0-9.]+ +0$" "$T/out" "256 KiB row verified ($transport)"
  expect_grep "^# Out of bounds values : 0 OK$" "$T/out" "sendrecv footer"
  python3 - "$T/sr.json" >"$T/check" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
rows = d["rows"]
ok = all(abs(r["busbw_gbps"] - r["algbw_gbps"]) < 1e-9 and r["time_us"] > 0 and
         abs(r["algbw_gbps"] - r["bytes"] / r["time_us"] / 1e3) < 1e-5 + 1e-3 * r["algbw_gbps"] for r in rows)
print(d["collective"], d["ranks"], d["transport"], d["redop"], [r["bytes"] for r in rows], ok, sum(r["wrong"] for r in rows))
PY
  expect_eq "$(cat "$T/check")" "sendrecv 2 $transport none [8, 64, 512, 4096, 32768, 262144] True 0" \
    "sendrecv JSON ($transport): sizes, busbw = algbw = bytes/time, no wrong values"
done
"$DTRAIN" bench sendrecv --nproc-per-node 3 -n 1 2>"$T/err"; expect_eq "$?" 2 "sendrecv with 3 ranks exits 2"
expect_grep "^dtrain: error: --nproc-per-node: bench sendrecv is a 2-rank ping-pong, got 3; use --nproc-per-node 2$" "$T/err" "sendrecv names the flag"
# The resolved rank count is what counts, not the flag's text ("02" and "auto" on 2 CPUs
# were refused), and hosts' slots too (before: the workers started, then failed).
"$DTRAIN" bench sendrecv --nproc-per-node 02 -b 8 -e 8 -n 1 -w 0 >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "sendrecv --nproc-per-node 02 runs"
timeout 60 "$DTRAIN" bench sendrecv --hosts localhost:3 -b 8 -e 8 -n 1 >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "sendrecv on hosts with 3 slots exits 2"
expect_grep "^dtrain: error: --hosts: bench sendrecv is a 2-rank ping-pong, and these hosts have 3 slots in all; give 2" "$T/err" "sendrecv on hosts with 3 slots: said before the launch"
"$DTRAIN" bench sendrecv -b 0 -e 8 2>"$T/err"; expect_eq "$?" 2 "sendrecv -b 0 exits 2"
# Sizes below one element of the type measure nothing: -b 3 -e 3 was an empty table, "OK",
# exit 0, and a JSON "complete" with no rows naming another transport than the table.
"$DTRAIN" bench allreduce -b 3 -e 3 --json "$T/b3.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "-b 3 -e 3 (float) exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: -b/--minbytes: 3 is less than one float (4 bytes), the smallest size measured; give 4 or more" "-b 3: the minimum named"
[ -e "$T/b3.json" ] && fail "-b 3 -e 3: a JSON written" || pass "-b 3 -e 3: nothing run"
"$DTRAIN" bench allreduce -b 8 -e 4 -d double >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "-b 8 -e 4 exits 2"
"$DTRAIN" bench allreduce -b 4 -e 4 -d double >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "-b 4 -e 4 (double) exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: -b/--minbytes: 4 is less than one double (8 bytes), the smallest size measured; give 8 or more" "-b 4 (double): the minimum named"
"$DTRAIN" bench allreduce -b 8 -e 7 -f 2 -d double 2>"$T/err" >/dev/null; expect_eq "$?" 2 "-e below -b exits 2"
"$DTRAIN" bench allreduce -b 2 -e 2 -d half -n 1 -w 0 --json "$T/b2.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "-b 2 -e 2 (half): one element, measured"
expect_eq "$(python3 -c "import json; d=json.load(open('$T/b2.json')); print(len(d['rows']), d['transport'])")" "1 $(sed -n 's/^# transport: //p' "$T/out")" "-b 2 -e 2: one row, the JSON's transport the table's"
"$DTRAIN" bench allreduce -b 1X 2>"$T/err"; expect_eq "$?" 2 "bad size exits 2"
expect_grep "expected a size like 4096, 4K" "$T/err" "bad size message"
"$DTRAIN" bench allreduce -d complex 2>"$T/err"; expect_eq "$?" 2 "bad type exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: -d/--datatype: unknown data type \"complex\"; use float, double, int32, int64, bfloat16 or half" "bad type: the flag named"
"$DTRAIN" bench allreduce -o prod 2>"$T/err"; expect_eq "$?" 2 "bad reduction exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: -o/--op: unknown reduction \"prod\"; use sum, avg, min or max" "bad reduction: the flag named"
"$DTRAIN" bench allreduce --nproc-per-node 2 -b 4k -e 8k -n 1 -w 0 >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "sizes in lower case (4k, as nccl-tests)"
expect_grep "^ +8192 +2048 +float +sum " "$T/out" "-e 8k: 8192 bytes"
# Counts: one line naming the flag and its range (CLI11's "Could not convert", or a negative
# -f shown as 18446744073709551614, said neither).
for bad in "-f|-2|-f/--stepfactor|2 and 1048576" "-f|1.5|-f/--stepfactor|2 and 1048576" "-n|0|-n/--iters|1 and 1000000000" "-w|abc|-w/--warmup_iters|0 and 1000000000"; do
  IFS='|' read -r flag v name range <<< "$bad"
  "$DTRAIN" bench allreduce "$flag" "$v" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "bench $flag $v exits 2"
  expect_eq "$(cat "$T/err")" "dtrain: error: $name: expected an integer between $range, got \"$v\"" "bench $flag $v: one line, the flag and its range"
done
# A size the machine cannot hold is refused up front (it was a worker's std::bad_alloc, exit 1).
"$DTRAIN" bench allreduce -b 4K -e 1048576G >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "bench -e beyond memory exits 2"
expect_grep "^dtrain: error: -e/--maxbytes: the largest size \(1125899906842624 bytes\) needs about .* per rank .* for the 2 rank\(s\) on this host, more than its [0-9.]+ GiB of memory; lower -e$" "$T/err" "bench -e beyond memory: one line naming -e"
expect_eq "$(cat "$T/out")" "" "bench -e beyond memory: no rank started"

# Lost peers, with a standalone store and hand-made worker environments.
"$DTRAIN" store serve --port 0 --token-file "$T/tok" >"$T/serve.out" 2>&1 &
SERVE=$!
trap 'kill $SERVE 2>/dev/null; pkill -CONT -f "$WORKER" 2>/dev/null; pkill -9 -f "$WORKER" 2>/dev/null; cleanup' EXIT
for _ in $(seq 50); do grep -q "serving on" "$T/serve.out" && break; sleep 0.1; done
EP=$(sed -n 's/^dtrain store: serving on //p' "$T/serve.out")
export DTRAIN_STORE_ADDR=${EP%:*} DTRAIN_STORE_PORT=${EP##*:} DTRAIN_STORE_TOKEN=$(cat "$T/tok") WORLD_SIZE=3
shm_segments() { ls /dev/shm 2>/dev/null | grep '^dtrain-' | sort; }
lost_case() {  # signal victim transport [op]
  local sig=$1 victim=$2 transport=$3 op=${4:-allreduce} pids=()
  export DTRAIN_RUN_ID="lost-$sig-$transport-$op"
  [ "$transport" = shm ] && export DTRAIN_COMM_SHM=1 || export DTRAIN_COMM_SHM=0
  shm_segments >"$T/shm.before"
  for r in 0 1 2; do
    RANK=$r "$WORKER" 3 "$T/stop" "$op" >"$T/w$r.out" 2>"$T/w$r.err" &
    pids+=($!)
  done
  for r in 0 1 2; do
    for _ in $(seq 100); do grep -q ready "$T/w$r.out" 2>/dev/null && break; sleep 0.1; done
    expect_grep "^ready $transport$" "$T/w$r.out" "$transport: rank $r runs over $transport"
  done
  start=$(date +%s%N)
  kill -"$sig" "${pids[$victim]}"
  for r in 0 1 2; do
    [ "$r" = "$victim" ] && continue
    wait "${pids[$r]}"; rc=$?
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    expect_eq "$rc" 3 "SIG$sig/$transport/$op: rank $r fails its collective"
    [ "$ms" -lt 8000 ] && pass "SIG$sig/$transport/$op: rank $r failed within the timeout (${ms} ms)" || fail "SIG$sig/$transport/$op: rank $r took ${ms} ms"
    # Every rank names the victim, also a rank that waited on a healthy peer waiting on it
    # (each one's own words, before any "[first failure in this job: ...]").
    expect_grep "^[a-z_]* on rank $r: lost rank $victim: " "$T/w$r.err" "SIG$sig/$transport/$op: rank $r names rank $victim"
  done
  "$DTRAIN" store get --timeout 5 "$DTRAIN_RUN_ID/0/0/comm/default/failure" >"$T/first" 2>&1
  expect_grep "^[a-z_]* on rank [0-9]: lost rank $victim: " "$T/first" "SIG$sig/$transport/$op: the job's first failure names rank $victim"
  kill -CONT "${pids[$victim]}" 2>/dev/null; kill -9 "${pids[$victim]}" 2>/dev/null; wait "${pids[$victim]}" 2>/dev/null
  shm_segments >"$T/shm.after"
  expect_eq "$(comm -13 "$T/shm.before" "$T/shm.after" | tr '\n' ' ')" "" "SIG$sig/$transport/$op: nothing left in /dev/shm"
}
lost_case KILL 1 shm
lost_case STOP 2 shm
# Over shared memory, a broadcast's other ranks wait on the root, which waits for the stopped
# rank to read: they named the root.
lost_case STOP 2 shm broadcast
lost_case KILL 1 tcp
# In the ring, rank 1 waits on rank 0, which waits on the stopped rank 2: rank 1 named rank 0.
lost_case STOP 2 tcp

# Rank 0 SIGKILLed while its communicator is set up, after it made the shared-memory segment
# and before every rank reported it mapped (no handler runs): nothing is left in /dev/shm (a
# named segment was, 6 MB for good). Rank 1 is played by hand through the store, so that rank
# 0 stays in that window: a listener takes its connection, rank 1's offer and host identity
# (a copy of rank 0's) are set, and its "mapped" report never comes.
python3 -c 'import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(4)
print(s.getsockname()[1], flush=True)
conns = []
while True: conns.append(s.accept())' >"$T/listen.port" &
LISTEN=$!
for _ in $(seq 50); do [ -s "$T/listen.port" ] && break; sleep 0.1; done
export DTRAIN_RUN_ID=setup-kill DTRAIN_COMM_SHM=1
ns="$DTRAIN_RUN_ID/0/0/comm/default"
shm_segments >"$T/shm.before"
WORLD_SIZE=2 RANK=0 "$WORKER" 30 "$T/stop" >"$T/k0.out" 2>"$T/k0.err" &
K0=$!
"$DTRAIN" store set "$ns/backend/1" tcp
"$DTRAIN" store set "$ns/addr/1" "$(printf '127.0.0.1\t%s' "$(cat "$T/listen.port")")"
"$DTRAIN" store set "$ns/shm/host/1" "$("$DTRAIN" store get --timeout 20 "$ns/shm/host/0")"
"$DTRAIN" store get --timeout 20 "$ns/shm/name" >"$T/shm.name" 2>&1
expect_grep "^/proc/$K0/fd/[0-9]+$" "$T/shm.name" "set-up: rank 0 publishes its segment as its descriptor, not a name"
kill -0 "$K0" 2>/dev/null && pass "set-up: rank 0 waits for rank 1's report" || fail "set-up: rank 0 ended: $(cat "$T/k0.err")"
kill -9 "$K0"; wait "$K0" 2>/dev/null
kill "$LISTEN"; wait "$LISTEN" 2>/dev/null
shm_segments >"$T/shm.after"
expect_eq "$(comm -13 "$T/shm.before" "$T/shm.after" | tr '\n' ' ')" "" "set-up: rank 0 SIGKILLed in the middle leaves nothing in /dev/shm"
unset DTRAIN_COMM_SHM
# DTRAIN_COMM_CHECK=1 through dtrain run: a trainer whose ranks agree trains as without it,
# to the same weights, every collective checked.
cat > "$T/chk.json" <<JSON
{"nproc_per_node": 2, "env": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [16, 32, 4]}, "data": {"train_samples": 512, "eval_samples": 64},
  "batch_size": 16, "epochs": 1, "log_every_steps": 1000, "device": "cpu"}}
JSON
"$DTRAIN" run "$T/chk.json" --summary-json "$T/chk0.sum" >"$T/out" 2>&1; expect_eq "$?" 0 "a trainer run"
"$DTRAIN" run "$T/chk.json" --env DTRAIN_COMM_CHECK=1 --summary-json "$T/chk1.sum" >"$T/out" 2>&1
expect_eq "$?" 0 "a trainer run with DTRAIN_COMM_CHECK=1"
w() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['trainer']['weights_sha256'])" "$1"; }
expect_eq "$(w "$T/chk1.sum")" "$(w "$T/chk0.sum")" "DTRAIN_COMM_CHECK=1: the same weights"
# dtrain bench with a rank SIGSTOPped: the job's headline says why rank 0 failed (the bench
# worker leaves its error file, as the trainer does; before: "exited with code 1" alone).
timeout 60 "$DTRAIN" bench allreduce --nproc-per-node 3 --timeout 2 -b 1M -e 1M -n 1000000 -w 1 >"$T/bs.out" 2>"$T/bs.err" &
BP=$!
# (the launcher is timeout's child; its 3 workers, once the table has begun)
KIDS=()
for _ in $(seq 300); do
  DP=$(pgrep -P "$BP" -x dtrain | head -1)
  [ -n "$DP" ] && KIDS=($(pgrep -P "$DP" -x dtrain))
  [ "${#KIDS[@]}" -ge 3 ] && grep -q "bytes" "$T/bs.out" 2>/dev/null && break
  sleep 0.1
done
[ "${#KIDS[@]}" -ge 3 ] || { fail "bench with a stopped rank: its 3 workers not found: $(cat "$T/bs.err")"; KIDS=(0 0); }
[ "${KIDS[1]}" != 0 ] && kill -STOP "${KIDS[1]}"
wait "$BP"; rc=$?
[ "${KIDS[1]}" != 0 ] && kill -CONT "${KIDS[1]}" 2>/dev/null
expect_eq "$rc" 1 "bench with a stopped rank: exit 1"
expect_grep "^dtrain: job 'bench-allreduce' failed: rank [02] exited with code 1 \(allreduce on rank [02]: lost rank 1: not done within the 2 s per-operation timeout" "$T/bs.err" "bench with a stopped rank: the headline says why"
finish
