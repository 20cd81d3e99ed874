# The built-in trainer and signals, through the real binary: SIGUSR1/SIGUSR2 to dtrain (which
# passes them on to every worker) write a checkpoint at the step the ranks agree on and the job
# goes on, ending with the weights of a run without them (inline and checkpoint.async);
# SIGTERM writes a final checkpoint and the workers exit 143 (stopped by dtrain), and the
# same spec resumes from it bit-identically; a rank SIGKILLed makes the other one stopped by
# dtrain (not a second failure) at once; a checkpoint directory that fills up is exit 2 with
# one line, never restarted.
source "$(dirname "$0")/lib.sh"
MNT=""
cleanup_mount() { [ -n "$MNT" ] && umount "$MNT" 2>/dev/null; MNT=""; }
trap 'cleanup_mount; cleanup' EXIT
# ~10 ms steps on 2 cores: a signal sent at step 20 lands well before the end (150 steps).
spec() {  # spec FILE CHECKPOINT-JSON
  cat > "$1" <<JSON
{"name": "sig", "nproc_per_node": 2, "restart_backoff_s": 0, "env": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [128, 1024, 512, 10]}, "data": {"train_samples": 32768, "eval_samples": 256, "seed": 1},
  "batch_size": 64, "epochs": 1, "max_steps": 150, "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9},
  "log_every_steps": 1000 $2}}
JSON
}
sha() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['trainer']['weights_sha256'])" "$1"; }
ranks() { python3 -c "import json,sys; print(' '.join('%s:%s:%s' % (r['rank'], r['exit_code'] if r['signal'] is None else r['signal'], 'stopped' if r['stopped_by_dtrain'] else 'failed') for r in json.load(open(sys.argv[1]))['ranks']))" "$1"; }
# start NAME SPEC [ARGS...]: dtrain run in the background; its ranks log their batches, so a
# test can wait until training is under way (wait_step N).
start() {
  local name="$1" file="$2"; shift 2
  rm -f "$T/$name".samples.*
  DTRAIN_DEBUG_SAMPLE_LOG="$T/$name.samples" "$DTRAIN" run "$file" --summary-json "$T/$name.sum" "$@" >"$T/$name.out" 2>"$T/$name.err" &
  DTRAIN_PID=$!
  CUR="$name"
}
wait_step() {  # wait_step N: until both ranks have begun step N (at most 20 s)
  for _ in $(seq 400); do
    [ "$(cat "$T/$CUR".samples.1.0 2>/dev/null | wc -l)" -ge "$1" ] && [ "$(cat "$T/$CUR".samples.0.0 2>/dev/null | wc -l)" -ge "$1" ] && return 0
    sleep 0.05
  done
  fail "$CUR: training did not reach step $1"; return 1
}
finish_run() { wait "$DTRAIN_PID"; RC=$?; DTRAIN_PID=; }

# The weights of a run without signals.
spec "$T/ref.json" ", \"checkpoint\": {\"dir\": \"$T/ck-ref\", \"every_steps\": 1000}"
"$DTRAIN" run "$T/ref.json" --summary-json "$T/ref.sum" >"$T/ref.out" 2>&1
expect_eq "$?" 0 "reference run"
REF=$(sha "$T/ref.sum")

# 1. SIGUSR1 (then SIGUSR2) mid-run: checkpoints at intermediate steps, the job goes on and
# its weights are the reference's. Inline and with checkpoint.async.
for async in false true; do
  spec "$T/u-$async.json" ", \"checkpoint\": {\"dir\": \"$T/ck-u-$async\", \"every_steps\": 1000, \"async\": $async}"
  start "u-$async" "$T/u-$async.json"
  wait_step 20 && kill -USR1 "$DTRAIN_PID" && sleep 0.1 && kill -USR2 "$DTRAIN_PID"
  finish_run
  expect_eq "$RC" 0 "SIGUSR1 (async $async): the job goes on and succeeds"
  expect_eq "$(sha "$T/u-$async.sum")" "$REF" "SIGUSR1 (async $async): the weights of a run without it"
  expect_eq "$(grep -c '^\[rank 0\] SIGUSR1: ' "$T/u-$async.out")" 1 "SIGUSR1 (async $async): one checkpoint for one signal (its copies reach the ranks apart)"
  step=$(sed -nE 's/^\[rank 0\] SIGUSR1: checkpoint at step ([0-9]+) (written|being written) to .*/\1/p' "$T/u-$async.out" | head -1)
  if [ -n "$step" ] && [ "$step" -ge 20 ] && [ "$step" -lt 150 ]; then pass "SIGUSR1 (async $async): checkpoint at step $step logged"; else fail "SIGUSR1 (async $async): no intermediate step logged"; sed 's/^/    /' "$T/u-$async.out" >&2; fi
  [ -n "$step" ] && [ -f "$T/ck-u-$async/$(printf 'ckpt-%010d.bin' "$step")" ] && pass "SIGUSR1 (async $async): its file exists" || fail "SIGUSR1 (async $async): no file for step $step: $(ls "$T/ck-u-$async")"
  expect_grep "^\[rank 0\] SIGUSR2: checkpoint at step [0-9]+ " "$T/u-$async.out" "SIGUSR2 (async $async): a checkpoint too"
  expect_eq "$(ls "$T/ck-u-$async" | grep -c '\.tmp$')" 0 "SIGUSR1 (async $async): no temporary file left"
done
# Without a checkpoint dir: said, and training goes on.
spec "$T/nodir.json" ""
start nodir "$T/nodir.json"
wait_step 20 && kill -USR1 "$DTRAIN_PID"
finish_run
expect_eq "$RC" 0 "SIGUSR1 without a checkpoint dir: the job goes on"
expect_grep "^\[rank 0\] SIGUSR1: no checkpoint at step [0-9]+: /trainer/checkpoint/dir is not set, so there is nowhere to write one; training goes on$" "$T/nodir.out" "SIGUSR1 without a checkpoint dir: says so"
expect_eq "$(sha "$T/nodir.sum")" "$REF" "SIGUSR1 without a checkpoint dir: the same weights"

# 2. SIGTERM mid-run: a final checkpoint of the step reached (newer than the last periodic
# one), every worker exits 143, stopped by dtrain; the same spec resumes from it and ends with
# the reference's weights.
spec "$T/t.json" ", \"checkpoint\": {\"dir\": \"$T/ck-t\", \"every_steps\": 16, \"async\": true}"
python3 -c "import json,sys; s=json.load(open(sys.argv[1])); s['log_dir']=sys.argv[2]; s['trainer']['log_every_steps']=8; json.dump(s, open(sys.argv[1], 'w'))" "$T/t.json" "$T/logs-t"
start t "$T/t.json"
wait_step 24 && kill -TERM "$DTRAIN_PID"
finish_run
expect_eq "$RC" 143 "SIGTERM: exit 143"
expect_eq "$(ranks "$T/t.sum")" "0:143:stopped 1:143:stopped" "SIGTERM: every worker exited 143, stopped by dtrain"
step=$(sed -nE 's/^\[rank 0\] SIGTERM: stopping at step ([0-9]+) of 150; final checkpoint written to .*/\1/p' "$T/t.out")
newest=$(ls "$T/ck-t" | sed -nE 's/^ckpt-0*([0-9]+)\.bin$/\1/p' | sort -n | tail -1)
if [ -n "$step" ] && [ "$step" -ge 24 ] && [ "$step" = "$newest" ] && [ "$step" -gt 16 ]; then pass "SIGTERM: final checkpoint at step $step, the newest"; else fail "SIGTERM: logged step '$step', newest checkpoint '$newest'"; sed 's/^/    /' "$T/t.out" >&2; fi
expect_eq "$(ls "$T/ck-t" | grep -c '\.tmp$')" 0 "SIGTERM: no temporary file left (checkpoint.async waited for)"
# The curve so far is drawn at the stop too: a stopped run may never be resumed.
[ -s "$T/logs-t/metrics.svg" ] && grep -qE '<polyline [^>]*points="[0-9]' "$T/logs-t/metrics.svg" && pass "SIGTERM: metrics.svg written at the stop" || fail "SIGTERM: no metrics.svg with a curve in $T/logs-t: $(ls "$T/logs-t" 2>&1)"
# metrics.jsonl has the row of the step it stopped at (not only the last multiple of
# log_every_steps before it).
expect_eq "$(python3 -c "import json,sys; print([json.loads(l)['step'] for l in open(sys.argv[1]) if '\"train\"' in l][-1])" "$T/logs-t/metrics.jsonl")" \
  "$step" "SIGTERM: metrics.jsonl's last train row is the stop step's"
# The summary says where it stopped and what the next run resumes from.
expect_eq "$(python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['trainer']; print(t['stopped'], t['steps'], t['checkpoint'], t['weights_sha256'], t['final_loss'])" "$T/t.sum")" \
  "True $step $(printf '%s/ckpt-%010d.bin' "$T/ck-t" "$step") None None" "SIGTERM: the summary's trainer: stopped, the step, the checkpoint"
"$DTRAIN" run "$T/t.json" --summary-json "$T/t2.sum" >"$T/t2.out" 2>&1
expect_eq "$?" 0 "SIGTERM: the same spec runs again"
expect_grep "^\[rank 0\] resuming from $T/ck-t/ckpt-0*$step\.bin: step $step," "$T/t2.out" "SIGTERM: it resumes from the final checkpoint"
expect_eq "$(sha "$T/t2.sum")" "$REF" "SIGTERM: resumed, the weights of a run never stopped"
expect_eq "$(python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['trainer']; print(t['stopped'], t['steps'], t['checkpoint'])" "$T/t2.sum")" \
  "False 150 $T/ck-t/ckpt-0000000150.bin" "a finished run: the summary names its final checkpoint"

# 3. A rank SIGKILLed: the other is stopped by dtrain's SIGTERM, not a failure of its own,
# and the job ends at once.
spec "$T/k.json" ", \"checkpoint\": {\"dir\": \"$T/ck-k\", \"every_steps\": 1000}"
t0=$(date +%s%N)
"$DTRAIN" run "$T/k.json" --max-restarts 0 --env DTRAIN_DEBUG_KILL_AT=1:10 --summary-json "$T/k.sum" >"$T/k.out" 2>"$T/k.err"
rc=$?; ms=$(( ($(date +%s%N) - t0) / 1000000 ))
expect_eq "$rc" 137 "rank 1 SIGKILLed: exit 137"
expect_eq "$(ranks "$T/k.sum")" "0:143:stopped 1:SIGKILL:failed" "rank 1 SIGKILLed: rank 0 stopped by dtrain (exit 143), not a second failure"
expect_grep "^dtrain: job 'sig' failed: rank 1 killed by SIGKILL; 1 other worker\(s\) ended during teardown$" "$T/k.err" "rank 1 SIGKILLed: one failure"
[ "$ms" -lt 8000 ] && pass "rank 1 SIGKILLed: over in ${ms} ms" || fail "rank 1 SIGKILLed: took ${ms} ms"

# Ctrl-\ (SIGQUIT): a stop like SIGTERM, with a final checkpoint, exit 131 (before: dtrain and
# its workers died of it at once, no checkpoint written).
spec "$T/q.json" ", \"checkpoint\": {\"dir\": \"$T/ck-q\", \"every_steps\": 1000}"
start q "$T/q.json"
wait_step 20 && kill -QUIT "$DTRAIN_PID"
finish_run
expect_eq "$RC" 131 "SIGQUIT: exit 131"
expect_eq "$(ranks "$T/q.sum")" "0:131:stopped 1:131:stopped" "SIGQUIT: every worker exited 131, stopped by dtrain"
expect_grep "^\[rank 0\] SIGQUIT: stopping at step [0-9]+ of 150; final checkpoint written to $T/ck-q/ckpt-" "$T/q.out" "SIGQUIT: a final checkpoint"
"$DTRAIN" run "$T/q.json" --summary-json "$T/q2.sum" >"$T/q2.out" 2>&1
expect_eq "$(sha "$T/q2.sum")" "$REF" "SIGQUIT: resumed, the weights of a run never stopped"
# A grace period of 2 s and a final checkpoint that takes longer: the worker gives up before
# the launcher's SIGKILL and says so (before: its own deadline was at least 2 s after the
# signal, it met the SIGKILL first, and nothing was said).
spec "$T/short.json" ", \"max_steps\": 100000, \"checkpoint\": {\"dir\": \"$T/ck-short\"}"
sed -i 's/"epochs": 1, "max_steps": 150, //' "$T/short.json"
DTRAIN_DEBUG_CHECKPOINT_DELAY_MS=2500 start short "$T/short.json" --shutdown-timeout 2
wait_step 5 && kill -TERM "$DTRAIN_PID"
finish_run
expect_eq "$RC" 143 "grace 2 s, a slow final checkpoint: exit 143"
# (which of the two it says depends on whether the ranks agreed on the final checkpoint within
# the 1 s: on a loaded machine they may not)
expect_grep "^\[rank 0\] dtrain train: SIGTERM: (the final checkpoint was not written within 1\.[0-9] s \(shutdown_timeout_s 2 s, less a margin\)|no final checkpoint: shutdown_timeout_s \(2 s\) left no time to agree on one and write it[^;]*); the newest complete checkpoint before it is kept" "$T/short.err" "grace 2 s: rank 0 says why there is no final checkpoint"
expect_no_grep "SIGKILL" "$T/short.sum" "grace 2 s: no worker needed the SIGKILL"
# 4. A checkpoint directory that fills up mid-run (a 64 KiB tmpfs: the first checkpoint, 33
# KB, fits; the second does not): exit 2 with one line naming the directory, the OS error
# and the fix; no restart; the first checkpoint intact.
mkdir -p "$T/full"
if mount -t tmpfs -o size=64k tmpfs "$T/full" 2>/dev/null; then
  MNT="$T/full"
  cat > "$T/full.json" <<JSON
{"name": "full", "nproc_per_node": 2, "restart_backoff_s": 0, "env": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [4, 512, 3]}, "data": {"train_samples": 512, "eval_samples": 64, "seed": 1},
  "batch_size": 16, "epochs": 2, "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9}, "log_every_steps": 1000,
  "checkpoint": {"dir": "$T/full/ck", "every_steps": 4}}}
JSON
  "$DTRAIN" run "$T/full.json" --max-restarts 2 --summary-json "$T/full.sum" >"$T/full.out" 2>"$T/full.err"
  expect_eq "$?" 2 "full checkpoint disk: exit 2"
  line="dtrain: error: trainer: /trainer/checkpoint/dir: cannot write the checkpoint of step 8 in $T/full/ck: No space left on device (cannot write $T/full/ck/ckpt-0000000008.bin.tmp); the checkpoints written there before are intact: free space on it (or make it writable again) and run the job again to resume from the newest, or set another /trainer/checkpoint/dir"
  expect_eq "$(grep -c '^\[rank [01]\] dtrain: error:' "$T/full.err")" 1 "full checkpoint disk: one error line"
  expect_eq "$(sed -n 's/^\[rank 0\] //p' "$T/full.err" | grep '^dtrain: error:')" "$line" "full checkpoint disk: names the directory, the OS error and the fix"
  expect_grep "cause: +not restarted: rank 0 stopped on an error no restart can fix" "$T/full.err" "full checkpoint disk: not restarted"
  expect_grep "^    error: +trainer: /trainer/checkpoint/dir: cannot write the checkpoint of step 8" "$T/full.err" "full checkpoint disk: the line is in the failure summary"
  expect_grep "^job 'full' failed: rank 0 exited with code 2 \(trainer: /trainer/checkpoint/dir: cannot write the checkpoint of step 8" \
    <(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['error'])" "$T/full.sum") "full checkpoint disk: the summary's error says why"
  expect_eq "$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['restarts'])" "$T/full.sum")" 0 "full checkpoint disk: no restart spent"
  expect_eq "$(ls "$T/full/ck")" "ckpt-0000000004.bin" "full checkpoint disk: the earlier checkpoint intact, nothing partial left"
  cleanup_mount
else
  echo "skip: full checkpoint disk (mount -t tmpfs not permitted here)"
fi
# A stop during the final evaluation (the training done, its last checkpoint durable) ends at
# once, as before, and now with the run's last words: rank 0 says where it stopped, the
# summary's trainer object says stopped with the steps and the checkpoint (it was null), and
# metrics.svg is drawn (none was).
cat > "$T/ev.json" <<JSON
{"name": "ev", "nproc_per_node": 2, "env": {"OMP_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [784, 256, 10]}, "data": {"train_samples": 2000, "eval_samples": 3000000, "seed": 1},
  "batch_size": 64, "epochs": 1, "log_every_steps": 5, "checkpoint": {"dir": "$T/ev-ck"}}}
JSON
"$DTRAIN" run "$T/ev.json" --log-dir "$T/ev-logs" --summary-json "$T/ev.sum" >"$T/ev.out" 2>"$T/ev.err" &
DTRAIN_PID=$!
for _ in $(seq 300); do grep -q 'step 15/15' "$T/ev.out" 2>/dev/null && break; sleep 0.1; done
sleep 1; kill -TERM "$DTRAIN_PID"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 143 "SIGTERM during the final evaluation: exit 143"
expect_grep "^\[rank 0\] SIGTERM: stopping during the final evaluation, the training done at step 15; its final checkpoint is $T/ev-ck/ckpt-0000000015.bin$" "$T/ev.out" "SIGTERM during the final evaluation: said"
expect_eq "$(python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['trainer']; print(t['stopped'], t['steps'], t['checkpoint'])" "$T/ev.sum")" \
  "True 15 $T/ev-ck/ckpt-0000000015.bin" "SIGTERM during the final evaluation: the summary says where it stopped"
[ -s "$T/ev-logs/metrics.svg" ] && pass "SIGTERM during the final evaluation: metrics.svg drawn" || fail "SIGTERM during the final evaluation: no metrics.svg"
# SIGUSR1 to dtrain run while the workers start, on one node and across nodes (a Slurm
# --signal landing on a round's start): each is a checkpoint request, never a worker killed
# by SIGUSR1's default action before its handler is in (the workers start with it blocked).
spec "$T/storm.json" ', "checkpoint": {"dir": "'"$T"'/storm-ck", "every_steps": 1000}'
for hosts in "" "--hosts localhost:1,127.0.0.1:1"; do
  rm -rf "$T/storm-ck"
  if [ -n "$hosts" ]; then "$DTRAIN" run "$T/storm.json" --nproc-per-node 1 $hosts --max-restarts 0 >"$T/storm.out" 2>"$T/storm.err" &
  else "$DTRAIN" run "$T/storm.json" --max-restarts 0 >"$T/storm.out" 2>"$T/storm.err" &
  fi
  DTRAIN_PID=$!
  # (from when dtrain has its handler: SigCgt's bit for SIGUSR1, 10)
  for _ in $(seq 1000); do (( 0x$(awk '/^SigCgt/ {print $2}' /proc/$DTRAIN_PID/status 2>/dev/null || echo 0) & 0x200 )) && break; sleep 0.001; done
  # (on until a checkpoint was taken: however slowly the workers start, some come after them)
  for i in $(seq 3000); do
    kill -USR1 "$DTRAIN_PID" 2>/dev/null || break
    [ $((i % 50)) = 0 ] && grep -q "SIGUSR1: checkpoint at step" "$T/storm.out" && break
    sleep 0.002
  done
  wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  expect_eq "$rc" 0 "SIGUSR1s while the workers start ${hosts:-on one node}: the job succeeds"
  expect_no_grep "killed by SIGUSR1" "$T/storm.err" "SIGUSR1s while the workers start ${hosts:-on one node}: no worker killed by it"
  expect_grep "SIGUSR1: checkpoint at step [0-9]+ written to" "$T/storm.out" "SIGUSR1s while the workers start ${hosts:-on one node}: taken as checkpoint requests"
done
finish
