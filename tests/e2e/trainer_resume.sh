# Resuming a trainer job at another world size, through the real binary: a job killed at 2
# workers and run again at 4 resumes from its checkpoint and its learning rate (metrics.jsonl's
# per-step "lr") goes on where the warmup_cosine schedule was, down to min_lr at the new last
# step, instead of jumping to where the new step count puts it; the steps before the kill
# train at the rates of a run never killed. metrics.svg at the end draws the whole training,
# the killed run's steps and the resumed run's, one point per step (the steps the resume
# replayed once, with their later values).
source "$(dirname "$0")/lib.sh"
# 2048 samples, 16 per worker: 64 steps at 2 workers (global batch 32); killed after 42
# steps (DTRAIN_DEBUG_KILL_AT counts from 0), the last checkpoint is step 40's; at 4 workers
# (64) the remaining 768 samples of the epoch are 12 steps: 52 in all.
spec() {  # spec FILE CHECKPOINT-DIR LOG-DIR
  cat > "$1" <<JSON
{"name": "resume", "nproc_per_node": 2, "restart_backoff_s": 0, "log_dir": "$3",
 "env": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [16, 8, 3]}, "data": {"train_samples": 2048, "eval_samples": 64, "seed": 1},
  "batch_size": 16, "epochs": 1, "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9},
  "lr_schedule": {"type": "warmup_cosine", "warmup_steps": 8, "min_lr": 0.001},
  "log_every_steps": 1, "checkpoint": {"dir": "$2", "every_steps": 8}}}
JSON
}
spec "$T/straight.json" "$T/ck-straight" "$T/logs-straight"
"$DTRAIN" run "$T/straight.json" >"$T/straight.out" 2>&1
expect_eq "$?" 0 "a run never killed"
spec "$T/r.json" "$T/ck" "$T/logs"
DTRAIN_DEBUG_KILL_AT=1:42 "$DTRAIN" run "$T/r.json" --max-restarts 0 >"$T/r1.out" 2>&1
expect_eq "$?" 137 "killed at 2 workers (no restart)"
"$DTRAIN" run "$T/r.json" --nproc-per-node 4 --summary-json "$T/r2.sum" >"$T/r2.out" 2>&1
expect_eq "$?" 0 "run again at 4 workers"
expect_grep "^\[rank 0\] resuming from $T/ck/ckpt-0000000040.bin: step 40, epoch 1, sample 1280 of the epoch \(written by 2 workers, now 4\)" "$T/r2.out" "resumed from step 40 at 4 workers"
python3 - "$T/logs/metrics.jsonl" "$T/logs-straight/metrics.jsonl" "$T/r2.sum" >"$T/check" <<'PY2'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
straight = {r["step"]: r["lr"] for r in map(json.loads, open(sys.argv[2])) if r["type"] == "train"}
second = json.load(open(sys.argv[3]))["run_id"]
starts = [(r["run_id"] == second, r["step"], r["world_size"]) for r in rows if r["type"] == "start"]
first = {r["step"]: r["lr"] for r in rows if r["type"] == "train" and r["run_id"] != second}
resumed = {r["step"]: r["lr"] for r in rows if r["type"] == "train" and r["run_id"] == second}
out = [str(starts == [(False, 0, 2), (True, 40, 4)]),
       str(sorted(first) == list(range(1, 43)) and sorted(resumed) == list(range(41, 53)))]
# Before the kill: the rates of the run never killed.
out.append(str(all(first[s] == straight[s] for s in first)))
# Across the resume: the step from 40 (2 workers) to 41 (4) is no larger than the next one at
# 4 workers, the rate goes down at every step after the warm-up and ends at about min_lr.
lr = [first[s] for s in range(1, 41)] + [resumed[s] for s in range(41, 53)]
jump, nextStep = lr[39] - lr[40], lr[40] - lr[41]
out.append("no jump" if 0 < jump <= 1.01 * nextStep else "jump %.6g then %.6g, %.6g" % (lr[39], lr[40], lr[41]))
out.append(str(all(b < a for a, b in zip(lr[8:], lr[9:]))))
# (min_lr is reached just after the last step: the last rate is above it by less than the
# last step's decrease)
out.append(str(0.001 < lr[-1] < 0.001 + (lr[-2] - lr[-1])))
print(" ".join(out))
PY2
expect_eq "$(cat "$T/check")" "True True True no jump True True" \
  "metrics.jsonl: both runs' rows; the rates of a run never killed before the kill, no jump at the resume, down to min_lr"
# metrics.svg: the whole training, steps 1..52 once each (the killed run's steps 41 and 42,
# replayed by the resume, drawn once), x increasing.
python3 - "$T/logs/metrics.svg" >"$T/check" <<'PY2'
import re, sys
svg = open(sys.argv[1]).read()
loss = [tuple(map(float, p.split(","))) for p in re.findall(r'<polyline[^>]*points="([^"]*)"', svg)[0].split()]
xs = [x for x, _ in loss]
print(len(loss), all(b > a for a, b in zip(xs, xs[1:])))
PY2
expect_eq "$(cat "$T/check")" "52 True" "metrics.svg: the whole training, one point per step"
# A training begun afresh in the same log directory (another checkpoint directory) is a curve
# of its own.
spec "$T/other.json" "$T/ck-other" "$T/logs"
"$DTRAIN" run "$T/other.json" >"$T/other.out" 2>&1
expect_eq "$?" 0 "another training in the same log directory"
expect_eq "$(python3 -c "import re,sys; print(len(re.findall(r'<polyline[^>]*points=\"([^\"]*)\"', open(sys.argv[1]).read())[0].split()))" "$T/logs/metrics.svg")" 64 \
  "metrics.svg: that training's own 64 steps"
finish
