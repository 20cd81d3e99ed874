# The trainer's checkpoint directory through the real binary: made and tried before any
# worker starts (exit 2 when it cannot be written, or holds another config's checkpoints,
# naming what changed: the model, the data files), a trainer worker's exit 2 is not
# restarted (one node and across nodes) while a command's is, pruning counts only real
# checkpoints, and resuming a finished job says so.
source "$(dirname "$0")/lib.sh"
SYNTHETIC='{"train_samples": 512, "eval_samples": 64, "seed": 1}'
spec() {  # spec FILE CHECKPOINT-DIR [LAYERS] [DATA]
  local layers="${3:-[4, 16, 3]}" data="${4:-$SYNTHETIC}"
  cat > "$1" <<JSON
{"name": "ck", "nproc_per_node": 2, "restart_backoff_s": 0, "env": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": $layers}, "data": $data,
  "batch_size": 16, "epochs": 2, "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9}, "log_every_steps": 1000,
  "checkpoint": {"dir": "$2", "every_steps": 4}}}
JSON
}
one_line() {  # one_line ERRFILE LABEL: exactly one line of stderr
  expect_eq "$(wc -l <"$1")" 1 "$2: one line"
}

# 1. A directory that cannot be written is refused before the launch, not at the first save.
echo "a,b" > "$T/file.csv"
spec "$T/under.json" "$T/file.csv/sub"
"$DTRAIN" run "$T/under.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "checkpoint dir under a regular file: exit 2"
expect_eq "$(cat "$T/err")" "dtrain: error: $T/under.json: /trainer/checkpoint/dir: \"$T/file.csv/sub\" cannot be created: $T/file.csv is not a directory; give a path in a directory" "under a regular file: names the spec, the pointer and the fix"
expect_eq "$(cat "$T/out")" "" "under a regular file: no worker started"
"$DTRAIN" validate "$T/under.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "validate refuses it too"
spec "$T/proc.json" "/proc/dtrain-ckdir-$$"
"$DTRAIN" run "$T/proc.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "checkpoint dir in /proc: exit 2"
one_line "$T/err" "checkpoint dir in /proc"
expect_grep "^dtrain: error: $T/proc.json: /trainer/checkpoint/dir: .*/proc/dtrain-ckdir-$$.*; give a " "$T/err" "checkpoint dir in /proc: names the spec and the pointer"
"$DTRAIN" train "$T/proc.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "dtrain train by hand: exit 2"
expect_grep "^dtrain: error: $T/proc.json: /trainer/checkpoint/dir: " "$T/err" "dtrain train by hand: names the spec and the pointer"
if [ "$(id -u)" != 0 ]; then
  mkdir -p "$T/ro"; chmod 555 "$T/ro"
  spec "$T/ro.json" "$T/ro/ck"
  "$DTRAIN" run "$T/ro.json" >"$T/out" 2>"$T/err"
  expect_eq "$?" 2 "read-only parent: exit 2"
fi
# validate creates nothing; run creates it (mkdir -p).
spec "$T/deep.json" "$T/deep/a/b"
"$DTRAIN" validate "$T/deep.json" >/dev/null 2>&1
expect_eq "$?" 0 "validate of a creatable checkpoint dir"
[ -e "$T/deep" ] && fail "validate created the checkpoint dir" || pass "validate creates nothing"
# Across nodes the first node's agent checks it on its host.
"$DTRAIN" run "$T/under.json" --hosts localhost:1,127.0.0.1:1 --max-restarts 2 >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "multi-node: exit 2"
expect_grep "node localhost: $T/under.json: /trainer/checkpoint/dir: cannot create \"$T/file.csv/sub\": $T/file.csv is not a directory; give a directory" "$T/err" "multi-node: node 0's agent names the spec and the pointer"
if grep -q "event restart" "$T/err"; then fail "multi-node: restarted"; else pass "multi-node: no restart"; fi

# 2a. Another config's checkpoint: one line before any worker starts, naming what changed.
spec "$T/a.json" "$T/ck-a"
"$DTRAIN" run "$T/deep.json" >"$T/deep.out" 2>&1  # (also: run creates the nested dir)
expect_eq "$?" 0 "a run with a nested checkpoint dir"
ls "$T/deep/a/b"/ckpt-*.bin >/dev/null 2>&1 && pass "run created it" || fail "no checkpoints in $T/deep/a/b"
"$DTRAIN" run "$T/a.json" >"$T/a.out" 2>&1
expect_eq "$?" 0 "first run"
spec "$T/lay.json" "$T/ck-a" "[4, 8, 8, 3]"
start=$(date +%s)
"$DTRAIN" run "$T/lay.json" --max-restarts 3 >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "changed layers: exit 2"
one_line "$T/err" "changed layers"
expect_grep "^dtrain: error: $T/lay.json: /trainer/checkpoint/dir: the newest checkpoint $T/ck-a/ckpt-0000000032.bin \(step 32\) was written by a different trainer config: the model changed \(checkpoint: mlp 4-16-3, relu, cross_entropy; this spec: mlp 4-8-8-3, relu, cross_entropy\); use another /trainer/checkpoint/dir, or remove all the checkpoints in $T/ck-a \(every ckpt-\*.bin" "$T/err" "changed layers: says what changed and to remove all of them"
expect_eq "$(cat "$T/out")" "" "changed layers: no worker started"
took=$(( $(date +%s) - start ))
[ "$took" -lt 5 ] && pass "changed layers: refused at once (${took}s)" || fail "changed layers took ${took}s"

# 3. Data files are part of the config: another file (or the same file moved) is refused.
python3 -c "
import random
random.seed(3)
with open('$T/d1.csv', 'w') as f:
    f.write('a,b,c,d,label\n')
    for i in range(400):
        x = [random.gauss(0, 1) for _ in range(4)]
        f.write(','.join('%.3f' % v for v in x) + ',%d\n' % (int(x[0] > 0) + int(x[1] > 0)))
"
cp "$T/d1.csv" "$T/d2.csv"
spec "$T/c1.json" "$T/ck-c" "[4, 16, 3]" "{\"type\": \"csv\", \"path\": \"$T/d1.csv\"}"
spec "$T/c2.json" "$T/ck-c" "[4, 16, 3]" "{\"type\": \"csv\", \"path\": \"$T/d2.csv\"}"
"$DTRAIN" run "$T/c1.json" >"$T/c1.out" 2>&1
expect_eq "$?" 0 "csv run"
"$DTRAIN" run "$T/c2.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "another data file: exit 2"
expect_grep "^dtrain: error: $T/c2.json: /trainer/checkpoint/dir: .* the data changed \(checkpoint: csv $T/d1.csv, label column label, header, seed 1; this spec: csv $T/d2.csv, label column label, header, seed 1\); use another" "$T/err" "another data file: says the data changed"
"$DTRAIN" run "$T/c1.json" >"$T/out" 2>&1
expect_eq "$?" 0 "the same data file resumes"

# 5. Resuming a finished job says it is finished, not "epoch 3" of 2.
expect_grep "^\[rank 0\] resuming from $T/ck-c/ckpt-0000000022.bin: step 22, which completes the job \(2 epochs\); nothing left to train" "$T/out" "resume of a finished job says so"
if grep -q "epoch 3" "$T/out"; then fail "resume line says epoch 3"; else pass "no epoch 3 of 2"; fi

# 3b. The training set's rows are kept in the checkpoint: adding /trainer/data/eval_path (the
# whole file trains, not its first 90%) or rows added to the file change each epoch's order
# mid-run, which repeated and skipped samples; refused, saying which, by every worker.
spec "$T/e1.json" "$T/ck-e" "[4, 16, 3]" "{\"type\": \"csv\", \"path\": \"$T/d1.csv\"}"
sed 's/"epochs": 2/"epochs": 2, "max_steps": 5/' "$T/e1.json" > "$T/e1-short.json"
"$DTRAIN" run "$T/e1-short.json" >"$T/out" 2>&1
expect_eq "$?" 0 "csv run, stopped at step 5"
spec "$T/e2.json" "$T/ck-e" "[4, 16, 3]" "{\"type\": \"csv\", \"path\": \"$T/d1.csv\", \"eval_path\": \"$T/d2.csv\"}"
"$DTRAIN" run "$T/e2.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "eval_path added on resume: exit 2"
expect_grep "trainer: /trainer/data: the training set has 400 rows, and $T/ck-e/ckpt-0000000005.bin was written when it had 360: $T/d1.csv changed, or /trainer/data/eval_path was added \(with it the whole file trains\); " "$T/err" "eval_path added on resume: names both row counts and the cause"
if grep -q "event restart" "$T/err"; then fail "eval_path added on resume: restarted"; else pass "eval_path added on resume: no restart"; fi
head -n 391 "$T/d1.csv" > "$T/d1-less.csv" && cp "$T/d1.csv" "$T/d1-full.csv" && cp "$T/d1-less.csv" "$T/d1.csv"
"$DTRAIN" run "$T/e1.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "rows removed from the data file: exit 2"
expect_grep "the training set has 351 rows, and $T/ck-e/ckpt-0000000005.bin was written when it had 360: $T/d1.csv changed, or /trainer/data/eval_path was removed" "$T/err" "rows removed from the data file: said"
cp "$T/d1-full.csv" "$T/d1.csv"
"$DTRAIN" run "$T/e1.json" >"$T/out" 2>&1
expect_eq "$?" 0 "the data as it was resumes"
expect_grep "^\[rank 0\] resuming from $T/ck-e/ckpt-0000000005.bin: step 5" "$T/out" "the data as it was: resumed from step 5"

# 2b. A trainer worker's exit 2 (input it refuses) is not restarted, on one node and across
# nodes; a command's exit 2 is. (A malformed fault-injection variable: every worker's
# SpecError, which the launcher's checks cannot see.)
spec "$T/b.json" "$T/ck-b"
"$DTRAIN" run "$T/b.json" --max-restarts 3 --env DTRAIN_DEBUG_KILL_AT=x --summary-json "$T/b.sum" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "trainer worker exit 2: the job exits 2"
expect_grep "cause: +not restarted: rank [01] stopped on an error no restart can fix \(exit 2: .*\); every attempt would fail the same way" "$T/err" "trainer worker exit 2: not restarted, says why"
if grep -q "event restart" "$T/err"; then fail "trainer worker exit 2 restarted"; else pass "trainer worker exit 2: no restart"; fi
expect_eq "$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['restarts'])" "$T/b.sum")" 0 "trainer worker exit 2: no restart spent"
# The worker's reason (its error file, as @record leaves one) in the headline, the summary's
# error and the report's error line; not repeated as the stderr tail.
expect_grep "^job 'ck' failed: rank [01] exited with code 2 \\(DTRAIN_DEBUG_KILL_AT: expected RANK:STEP or RANK:STEP:MICRO, got \"x\"\\)" \
  <(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['error'])" "$T/b.sum") "trainer worker exit 2: the summary's error says why"
expect_grep "^    error: +DTRAIN_DEBUG_KILL_AT: expected" "$T/err" "trainer worker exit 2: the report's error line"
if grep -q "last stderr lines" "$T/err"; then fail "trainer worker exit 2: the error repeated as the stderr tail"; else pass "trainer worker exit 2: said once"; fi
"$DTRAIN" run "$T/b.json" --hosts localhost:1,127.0.0.1:1 --max-restarts 3 --env DTRAIN_DEBUG_KILL_AT=x >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "multi-node trainer worker exit 2: the job exits 2"
expect_grep "cause: +not restarted: rank [01] on [^ ]+ stopped on an error no restart can fix \(exit 2" "$T/err" "multi-node trainer worker exit 2: not restarted"
if grep -q "event restart" "$T/err"; then fail "multi-node trainer worker exit 2 restarted"; else pass "multi-node: no restart"; fi
"$DTRAIN" run --nproc-per-node 1 --max-restarts 1 --shutdown-timeout 3 -- sh -c 'exit 2' >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "a command's exit 2"
expect_grep "event restart .*exited with code 2; restart 1 of 1" "$T/err" "a command's exit 2 is restarted"

# 4. Junk named like checkpoints is neither counted nor deleted: the real ones stay.
mkdir -p "$T/ck-j"
for n in 9997 9998 9999; do head -c 100 /dev/urandom > "$T/ck-j/ckpt-000000$n.bin"; done
spec "$T/j.json" "$T/ck-j"
"$DTRAIN" run "$T/j.json" >"$T/out" 2>&1
expect_eq "$?" 0 "a run beside junk checkpoints"
expect_eq "$(cd "$T/ck-j" && ls | tr '\n' ' ')" "ckpt-0000000024.bin ckpt-0000000028.bin ckpt-0000000032.bin ckpt-0000009997.bin ckpt-0000009998.bin ckpt-0000009999.bin " "the newest 3 real checkpoints kept, junk left alone"
expect_eq "$(grep -c 'is named like a checkpoint but is not a dtrain checkpoint' "$T/out")" 3 "one warning per junk file"
# One job per checkpoint directory: a second job on a directory another job is using is
# refused at once (exit 2, one line naming the holder); once the first job is gone, the
# directory is free again.
spec "$T/busy.json" "$T/ck-busy"
sed 's/"epochs": 2/"epochs": 100000/' "$T/busy.json" > "$T/busy-long.json"
"$DTRAIN" run --log-dir "$T/busy-logs" "$T/busy-long.json" >"$T/busy1.out" 2>&1 &
DTRAIN_PID=$!
for _ in $(seq 200); do ls "$T/ck-busy"/ckpt-*.bin >/dev/null 2>&1 && break; sleep 0.05; done
"$DTRAIN" run "$T/busy.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "a busy checkpoint dir: exit 2"
one_line "$T/err" "a busy checkpoint dir"
expect_grep "^dtrain: error: $T/busy.json: /trainer/checkpoint/dir: \"$T/ck-busy\" is in use by another dtrain job \(pid $DTRAIN_PID on " "$T/err" "a busy checkpoint dir: names the holder"
# ... also when its log_dir was busy too: the log directory it made for itself beside the
# busy one is not left behind, empty, by the refusal.
"$DTRAIN" run --log-dir "$T/busy-logs" "$T/busy.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "a busy checkpoint dir and log_dir: exit 2"
expect_grep "this run's logs go to $T/busy-logs/[0-9a-f]*$" "$T/err" "a busy log_dir: the run said where its logs would go"
own="$(sed -n "s/.*this run's logs go to //p" "$T/err")"
[ -n "$own" ] && [ ! -e "$own" ] && pass "a refused run leaves no log directory of its own behind" || fail "a refused run left $own behind"
kill -TERM "$DTRAIN_PID"; wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 143 "a busy checkpoint dir: the first job ran on until stopped"
"$DTRAIN" run "$T/busy.json" >"$T/out" 2>&1
expect_eq "$?" 0 "a busy checkpoint dir: free again once that job ended"
# The lock file removed while the job runs (it outlives the jobs that held it, and looks
# stale): a second job gets in and resumes from the first one's files; the first stops at its
# next checkpoint, which it does not write, exit 2 and no restart (before: both wrote and
# pruned the directory, and one died saying "free space on it").
spec "$T/lk.json" "$T/ck-lk"
sed 's/"epochs": 2/"epochs": 100000/; s/"restart_backoff_s": 0/"restart_backoff_s": 0, "max_restarts": 3/' "$T/lk.json" > "$T/lk-long.json"
timeout 120 "$DTRAIN" run "$T/lk-long.json" >"$T/lk1.out" 2>"$T/lk1.err" &
DTRAIN_PID=$!
for _ in $(seq 200); do ls "$T/ck-lk"/ckpt-*.bin >/dev/null 2>&1 && break; sleep 0.05; done
rm "$T/ck-lk/.dtrain.lock"
"$DTRAIN" run "$T/lk.json" >"$T/lk2.out" 2>&1
expect_eq "$?" 0 "lock file removed: a second job gets in"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 2 "lock file removed: the first job stops, exit 2"
expect_grep "trainer: /trainer/checkpoint/dir: $T/ck-lk/.dtrain.lock was removed or replaced while this job ran, so another job may be writing in $T/ck-lk now" "$T/lk1.err" "lock file removed: the first job says why"
expect_no_grep "event restart" "$T/lk1.err" "lock file removed: not restarted"
# The directory removed while the job runs: the writer ends the job (exit 2, no restart), it
# does not make the directory again (which bypassed the lock: a second job then took it,
# resumed from the first's files, and each pruned the other's checkpoints).
spec "$T/gone.json" "$T/ck-gone"
sed 's/"epochs": 2/"epochs": 100000/; s/"restart_backoff_s": 0/"restart_backoff_s": 0, "max_restarts": 3/' "$T/gone.json" > "$T/gone-long.json"
"$DTRAIN" run "$T/gone-long.json" >"$T/gone.out" 2>"$T/gone.err" &
DTRAIN_PID=$!
for _ in $(seq 200); do ls "$T/ck-gone"/ckpt-*.bin >/dev/null 2>&1 && break; sleep 0.05; done
# (moved away in one step, then removed: rm -rf races the writer's new files and may fail)
mv "$T/ck-gone" "$T/ck-gone.old" && rm -rf "$T/ck-gone.old"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 2 "checkpoint dir removed mid-run: exit 2"
expect_grep "trainer: /trainer/checkpoint/dir: $T/ck-gone was removed while this job ran; " "$T/gone.err" "checkpoint dir removed mid-run: said"
if grep -q "event restart" "$T/gone.err"; then fail "checkpoint dir removed mid-run: restarted"; else pass "checkpoint dir removed mid-run: no restart"; fi
[ -e "$T/ck-gone" ] && fail "the removed checkpoint dir was made again" || pass "the removed checkpoint dir stays removed"
# Replaced by a file: said as removed, not as "another directory".
"$DTRAIN" run "$T/gone-long.json" >"$T/gone.out" 2>"$T/gone.err" &
DTRAIN_PID=$!
for _ in $(seq 200); do ls "$T/ck-gone"/ckpt-*.bin >/dev/null 2>&1 && break; sleep 0.05; done
# (swapped in one step, as below: a move and a write leave a moment without it)
echo junk > "$T/ck-file"
python3 -c 'import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True)
sys.exit(libc.renameat2(-100, sys.argv[1].encode(), -100, sys.argv[2].encode(), 2) != 0)' "$T/ck-file" "$T/ck-gone" ||
  fail "renameat2 RENAME_EXCHANGE"
rm -rf "$T/ck-file"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 2 "checkpoint dir replaced by a file mid-run: exit 2"
expect_grep "trainer: /trainer/checkpoint/dir: $T/ck-gone was removed while this job ran \(something that is not a directory has its name now\); " "$T/gone.err" "checkpoint dir replaced by a file mid-run: said as removed"
rm -f "$T/ck-gone"
# Removed and made again (by a second job, or by hand): another directory, said as such.
"$DTRAIN" run "$T/gone-long.json" >"$T/gone.out" 2>"$T/gone.err" &
DTRAIN_PID=$!
for _ in $(seq 200); do ls "$T/ck-gone"/ckpt-*.bin >/dev/null 2>&1 && break; sleep 0.05; done
# (swapped in one step, renameat2 RENAME_EXCHANGE: a removal and a mkdir leave a moment
# without it, which the writer may see as "removed")
mkdir "$T/ck-new"
python3 -c 'import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True)
sys.exit(libc.renameat2(-100, sys.argv[1].encode(), -100, sys.argv[2].encode(), 2) != 0)' "$T/ck-new" "$T/ck-gone" ||
  fail "renameat2 RENAME_EXCHANGE"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 2 "checkpoint dir replaced mid-run: exit 2"
expect_grep "trainer: /trainer/checkpoint/dir: $T/ck-gone is another directory than when this job started \(moved away, and another put in its place\)" "$T/gone.err" "checkpoint dir replaced mid-run: said"
expect_eq "$(ls "$T/ck-gone" | wc -l)" 0 "nothing written into the new directory"
# Removed, and a worker fails before the next save (no periodic saves here): the launcher does
# not restart the workers, who would make the directory again without the job's lock.
sed 's/"every_steps": 4/"every_steps": 0/; s/"log_every_steps": 1000/"log_every_steps": 1000000/' "$T/gone-long.json" > "$T/gone-nosave.json"
"$DTRAIN" run "$T/gone-nosave.json" >"$T/gone.out" 2>"$T/gone.err" &
DTRAIN_PID=$!
for _ in $(seq 200); do grep -q "trainer:" "$T/gone.out" 2>/dev/null && break; sleep 0.05; done
mv "$T/ck-gone" "$T/ck-gone.old" && rm -rf "$T/ck-gone.old"
sleep 0.2
pkill -KILL -P "$DTRAIN_PID" -f "dtrain train"  # (this job's workers: the launcher's children)
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 137 "checkpoint dir removed, then a worker killed: the job ends as that failure"
expect_grep "cause: +not restarted: /trainer/checkpoint/dir $T/ck-gone was removed while the job ran; " "$T/gone.err" "checkpoint dir removed, then a worker killed: not restarted, says why"
if grep -q "event restart" "$T/gone.err"; then fail "checkpoint dir removed, then a worker killed: restarted"; else pass "checkpoint dir removed, then a worker killed: no restart"; fi
[ -e "$T/ck-gone" ] && fail "the removed checkpoint dir was made again by a restart" || pass "no restart made the removed checkpoint dir again"
# An existing directory on a read-only mount: "cannot be written" (not "cannot be created").
mkdir -p "$T/romnt"
if mount -t tmpfs -o ro,size=64k tmpfs "$T/romnt" 2>/dev/null; then
  spec "$T/ro2.json" "$T/romnt"
  "$DTRAIN" run "$T/ro2.json" >"$T/out" 2>"$T/err"; rc=$?
  umount "$T/romnt"
  expect_eq "$rc" 2 "read-only checkpoint dir: exit 2"
  expect_grep "^dtrain: error: $T/ro2.json: /trainer/checkpoint/dir: \"$T/romnt\" cannot be written: $T/romnt: Read-only file system; " "$T/err" "read-only checkpoint dir: said as it is"
else
  echo "skip: cannot mount a tmpfs (not root?)"
fi
finish
