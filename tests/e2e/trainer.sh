# The built-in trainer through the real binary: the quickstart job trains 2 CPU workers to
# >= 95% held-out accuracy, replicas end bit-identical, and trainer specs are validated.
source "$(dirname "$0")/lib.sh"
cd "$SRC"
cat > "$T/tiny2.json" <<JSON
{"nproc_per_node": 2, "trainer": {"model": {"layers": [64, 256, 10]}, "data": {"train_samples": 7680, "eval_samples": 64},
 "batch_size": 64, "epochs": 1, "log_every_steps": 20}}
JSON
start=$(date +%s)
"$DTRAIN" run configs/quickstart.json --summary-json "$T/sum.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "quickstart exits 0"
python3 - "$T/sum.json" "$T/out" >"$T/check" <<'PY2'
import json, re, sys
d = json.load(open(sys.argv[1]))
out = open(sys.argv[2]).read()
sha = re.search(r"weights sha256 ([0-9a-f]{64})", out).group(1)
t = d["trainer"]
print(d["status"], d["exit_code"], d["restarts"], len(d["ranks"]), all(r["exit_code"] == 0 and r["signal"] is None for r in d["ranks"]),
      t["steps"], t["weights_sha256"] == sha, 0.95 <= t["eval_accuracy"] <= 1, t["samples_per_s"] > 0, t["final_loss"] > 0, d["wall_s"] > 0)
PY2
expect_eq "$(cat "$T/check")" "succeeded 0 0 2 True 702 True True True True True" "--summary-json for a trainer job"
took=$(( $(date +%s) - start ))
[ "$took" -lt 60 ] && pass "quickstart took ${took}s (< 60 s)" || fail "quickstart took ${took}s"
expect_grep "^\[rank 0\] epoch 1/3 step 100/702 loss [0-9.]+ acc [0-9.]+% [0-9]+ samples/s eta " "$T/out" "progress lines"
line=$(grep "trained:" "$T/out")
acc=$(sed -n 's/.*eval accuracy \([0-9.]*\)%.*/\1/p' <<<"$line")
python3 -c "import sys; sys.exit(0 if float('$acc') >= 95.0 else 1)" && pass "eval accuracy ${acc}% >= 95%" || fail "eval accuracy ${acc}%: $line"
[[ "$line" =~ weights\ sha256\ [0-9a-f]{64}$ ]] && pass "weights hash reported" || fail "no hash: $line"
if grep -q "\[rank 1\]" "$T/out"; then fail "rank 1 printed progress"; else pass "only rank 0 reports"; fi
if LC_ALL=C grep -q $'\x1b' "$T/out"; then fail "escape codes in non-terminal output"; else pass "plain lines when not a terminal"; fi
# On a terminal (a pty from script(1)): a live progress bar drawn in place, lines above it.
script -qfc "$DTRAIN run $T/tiny2.json" "$T/tty.txt" >/dev/null 2>&1 <<<"" || true
python3 - "$T/tty.txt" >"$T/check" <<'PY2'
import sys
d = open(sys.argv[1], "rb").read()
print(d.count(b"\r\x1b[2K") > 2, b"dtrain-status" not in d, b"[rank 0] epoch 1/1 [" in d, b"100% step 60/60" in d, b"trained: 60 steps" in d,
      d.rfind(b"step 60/60") < d.find(b"trained: 60 steps"))  # the bar is gone, not drawn again below the summary
PY2
expect_eq "$(cat "$T/check")" "True True True True True True" "progress bar on a terminal"
# Same seed, same data, same world size -> the same weights.
"$DTRAIN" run configs/quickstart.json --env DTRAIN_UNUSED=1 >"$T/out2" 2>&1
expect_eq "$(grep -o 'sha256 [0-9a-f]*' "$T/out2")" "$(grep -o 'sha256 [0-9a-f]*' "$T/out")" "training is deterministic"
# Batches loaded one step ahead on a thread (data.prefetch) or inline, gradients reduced
# during backward (overlap) or after it: the same weights; the start line says which ("auto"
# here: 2 workers with 1 BLAS thread each, on this node's cores).
for v in true false '"auto"'; do
  sed "s/\"eval_samples\": 64}/\"eval_samples\": 64, \"prefetch\": $v}, \"overlap\": $v/" "$T/tiny2.json" >"$T/pf.json"
  "$DTRAIN" run "$T/pf.json" --env OMP_NUM_THREADS=1 --env OPENBLAS_NUM_THREADS=1 >"$T/pf.$v.out" 2>&1
  expect_eq "$?" 0 "prefetch and overlap $v: exits 0"
done
line="^\[rank 0\] trainer: 2 workers, math on cpu \(OpenBLAS, 1 thread\), tcp communicator, batches"
expect_grep "$line prefetched, gradients reduced during backward$" "$T/pf.true.out" "prefetch and overlap true: said"
expect_grep "$line loaded inline, gradients reduced after backward$" "$T/pf.false.out" "prefetch and overlap false: said"
# (nproc counts the CPUs this process may use, unless OMP_NUM_THREADS/OMP_THREAD_LIMIT say otherwise)
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
auto=$([ "$cores" -gt 2 ] && echo "prefetched, gradients reduced during" || echo "loaded inline, gradients reduced after")
expect_grep "$line $auto backward$" "$T/pf.\"auto\".out" "prefetch and overlap auto: $auto with $cores cores"
expect_eq "$(grep -o 'sha256 [0-9a-f]*' "$T/pf.true.out")" "$(grep -o 'sha256 [0-9a-f]*' "$T/pf.false.out")" "prefetch and overlap do not change the weights"
# DTRAIN_TRACE_DIR: a Chrome trace per rank of 4 steps after the first, the training thread's
# forward, backward and optimizer step and, on the communicator's row, each bucket's
# all-reduce (two buckets here) with the time it was queued. Every all-reduce ends before the
# optimizer step uses its gradients; with overlap they are launched during backward, without
# it after. (When they start depends on a free core: on 2 vCPUs, often after backward.) A run
# shorter than a trace writes the steps it had.
for v in true false; do
  sed "s/\"eval_samples\": 64}/\"eval_samples\": 64}, \"overlap\": $v, \"bucket_mb\": 0.005/" "$T/tiny2.json" >"$T/tr.json"
  DTRAIN_TRACE_DIR="$T/trace.$v" "$DTRAIN" run "$T/tr.json" --env OMP_NUM_THREADS=1 --env OPENBLAS_NUM_THREADS=1 >"$T/tr.$v.out" 2>&1
  expect_eq "$?" 0 "traced, overlap $v: exits 0"
done
sed "s/\"epochs\": 1,/\"epochs\": 1, \"max_steps\": 3, \"bucket_mb\": 0.005,/" "$T/tiny2.json" >"$T/tr3.json"
DTRAIN_TRACE_DIR="$T/trace.short" "$DTRAIN" run "$T/tr3.json" >"$T/tr.short.out" 2>&1
expect_eq "$?" 0 "traced, 3 steps: exits 0"
python3 - "$T" >"$T/tcheck" <<'PY'
import collections, json, sys
def check(d, overlap, steps_expected):
    out = set()
    for r in range(2):
        ev = [e for e in json.load(open(f"{sys.argv[1]}/{d}/trace-rank{r}.json"))["traceEvents"] if e["ph"] == "X"]
        steps = sorted({e["args"]["step"] for e in ev})
        ok = steps == steps_expected
        launched_in_backward = ends_before_opt = 0
        for s in steps:
            by = collections.defaultdict(list)
            for e in ev:
                if e["args"]["step"] == s: by[e["name"]].append(e)
            one = all(len(by[n]) == 1 for n in ("forward", "backward", "optimizer", "all-reduce 0", "all-reduce 1"))
            ok = ok and one and all(e["tid"] == 1 for n in ("all-reduce 0", "all-reduce 1") for e in by[n])
            if not one: continue
            f, b, o = by["forward"][0], by["backward"][0], by["optimizer"][0]
            ok = ok and f["ts"] + f["dur"] <= b["ts"] + 1e-3 and b["ts"] + b["dur"] <= o["ts"] + 1e-3
            for n in ("all-reduce 0", "all-reduce 1"):
                a = by[n][0]
                ends_before_opt += a["ts"] + a["dur"] <= o["ts"] + 1e-3
                launched = a["ts"] - a["args"]["queued_us"]
                ok = ok and 0 <= a["args"]["queued_us"]
                launched_in_backward += launched < b["ts"] + b["dur"] - 1e-3
        ok = ok and ends_before_opt == 2 * len(steps)
        out.add(f"{ok} {'during' if launched_in_backward else 'after'}" if overlap is not None else str(ok))
    return " ".join(sorted(out))
print(check("trace.true", True, [1, 2, 3, 4]), "|", check("trace.false", False, [1, 2, 3, 4]), "|",
      check("trace.short", None, [1, 2]))
PY
expect_eq "$(cat "$T/tcheck")" "True during | True after | True" "DTRAIN_TRACE_DIR: forward, backward, all-reduce buckets and optimizer per step; overlap shown"
# Each batch computed by 3 threads (data.loader_threads), inline and one step ahead: said, and
# the same weights.
for v in true false; do
  sed "s/\"eval_samples\": 64}/\"eval_samples\": 64, \"prefetch\": $v, \"loader_threads\": 3}, \"overlap\": $v/" "$T/tiny2.json" >"$T/lt.json"
  "$DTRAIN" run "$T/lt.json" --env OMP_NUM_THREADS=1 --env OPENBLAS_NUM_THREADS=1 >"$T/lt.$v.out" 2>&1
  expect_eq "$?" 0 "loader threads 3, prefetch $v: exits 0"
  expect_eq "$(grep -o 'sha256 [0-9a-f]*' "$T/lt.$v.out")" "$(grep -o 'sha256 [0-9a-f]*' "$T/pf.false.out")" "loader threads 3, prefetch $v: the same weights"
done
expect_grep "$line prefetched by 3 threads, gradients reduced during backward$" "$T/lt.true.out" "loader threads 3: said (prefetched)"
expect_grep "$line loaded inline by 3 threads, gradients reduced after backward$" "$T/lt.false.out" "loader threads 3: said (inline)"
# validate prints the trainer's settings as the workers will use them.
"$DTRAIN" validate configs/quickstart.json >"$T/out" 2>&1
expect_grep "^trainer: +mlp 784-256-256-10, relu, cross_entropy$" "$T/out" "validate: the model"
expect_grep "^  data: +synthetic, 60000 train / 10000 eval samples, seed 1, prefetch auto, loader threads auto$" "$T/out" "validate: the data"
expect_grep "^  device: +auto, seed 0, bucket_mb 25, overlap auto, log every 100 steps$" "$T/out" "validate: device and overlap"
# dry run shows the trainer as each worker's command.
"$DTRAIN" run --dry-run configs/quickstart.json >"$T/out" 2>&1
expect_grep " train /.*/dtrain-run-[0-9a-f]+-[0-9a-f]+\.[0-9]+-[0-9]+-XXXXXX/spec\.json$" "$T/out" "dry run: workers run dtrain train on the run's spec snapshot"
# A worker of the trainer run by hand trains alone.
cat > "$T/tiny.json" <<JSON
{"trainer": {"model": {"layers": [16, 8, 3]}, "data": {"train_samples": 512, "eval_samples": 64},
 "batch_size": 16, "epochs": 1}}
JSON
"$DTRAIN" train "$T/tiny.json" >"$T/out" 2>&1
expect_eq "$?" 0 "dtrain train alone"
expect_grep "trained: 32 steps" "$T/out" "alone: 512/16 steps"
# Metrics: JSON lines while training, an SVG curve at the end, in the job's log directory.
"$DTRAIN" run "$T/tiny.json" --nproc-per-node 2 --log-dir "$T/logs" >"$T/out" 2>&1
expect_eq "$?" 0 "tiny job with a log dir"
python3 - "$T/logs/metrics.jsonl" >"$T/check" <<'PY2'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
train = [r for r in rows if r["type"] == "train"]
ev = [r for r in rows if r["type"] == "eval"]
print(len(train) > 0, train[-1]["step"], all(0 <= r["accuracy"] <= 1 and r["loss"] > 0 for r in train), len(ev), 0 <= ev[0]["accuracy"] <= 1)
PY2
expect_eq "$(cat "$T/check")" "True 16 True 1 True" "metrics.jsonl: train rows to the last step, one eval row"
expect_grep "^<svg .*</svg>|polyline" "$T/logs/metrics.svg" "metrics.svg has the curves"
# Runs and restarts that share a log directory stay apart: every row names its run and
# attempt, each attempt begins with a "start" row at the step it resumed from, and the SVG
# is the whole run's curve (attempt 0 up to the checkpoint, then attempt 1), once per step.
cat > "$T/restarts.json" <<JSON
{"nproc_per_node": 2, "max_restarts": 1, "restart_backoff_s": 0, "log_dir": "$T/logs",
 "trainer": {"model": {"layers": [16, 8, 3]}, "data": {"train_samples": 512, "eval_samples": 64},
  "batch_size": 16, "epochs": 1, "log_every_steps": 1, "checkpoint": {"dir": "$T/ck-restarts", "every_steps": 4}}}
JSON
DTRAIN_DEBUG_KILL_AT=1:10 "$DTRAIN" run "$T/restarts.json" --summary-json "$T/restarts.sum" >"$T/out" 2>&1
expect_eq "$?" 0 "a restarted run logging into the same directory"
python3 - "$T/logs/metrics.jsonl" "$T/restarts.sum" "$T/logs/metrics.svg" >"$T/check" <<'PY2'
import json, re, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
run = json.load(open(sys.argv[2]))["run_id"]
runs = []
for r in rows:
    if r["run_id"] not in runs: runs.append(r["run_id"])
mine = [r for r in rows if r["run_id"] == run]
starts = [(r["attempt"], r["step"], r["world_size"]) for r in mine if r["type"] == "start"]
a0 = [r["step"] for r in mine if r["type"] == "train" and r["attempt"] == 0]
a1 = [r["step"] for r in mine if r["type"] == "train" and r["attempt"] == 1]
svg = open(sys.argv[3]).read()
loss = re.findall(r'<polyline[^>]*points="([^"]*)"', svg)[0].split()
print(len(runs), runs[-1] == run, starts, a0 == list(range(1, 11)), a1 == list(range(9, 17)), len(loss))
PY2
expect_eq "$(cat "$T/check")" "2 True [(0, 0, 2), (1, 8, 2)] True True 16" \
  "metrics.jsonl: two runs apart, the restart's start row at its checkpoint, the SVG one point per step"
# kill -9 of a worker, then a restart from its checkpoint: the same weights as a run that
# was never interrupted.
mkspec() {  # file checkpoint-dir
  cat > "$1" <<JSON
{"nproc_per_node": 2, "env": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [784, 256, 256, 10]}, "data": {"train_samples": 60000, "eval_samples": 2000},
  "batch_size": 128, "epochs": 2, "optimizer": {"lr": 0.005, "momentum": 0.9}, "log_every_steps": 50,
  "checkpoint": {"dir": "$2", "every_steps": 40}}}
JSON
}
mkspec "$T/a.json" "$T/ckpt-a"; mkspec "$T/b.json" "$T/ckpt-b"
"$DTRAIN" run "$T/a.json" >"$T/a.out" 2>&1
expect_eq "$?" 0 "uninterrupted run"
ls "$T/ckpt-a" | grep -q "ckpt-0000000468.bin" && pass "final checkpoint written" || fail "no final checkpoint: $(ls "$T/ckpt-a")"
expect_eq "$(ls "$T/ckpt-a" | wc -l)" 3 "keeps the newest 3 checkpoints"
# Run again: the checkpoint completes the job, so nothing is trained and nothing is measured
# (no made-up zero loss or throughput), the weights are the same.
"$DTRAIN" run "$T/a.json" --summary-json "$T/again.json" >"$T/again.out" 2>&1
expect_eq "$?" 0 "re-run of a completed job"
expect_grep "^\[rank 0\] trained: 468 steps, all before this run \(its checkpoint completes the job; nothing left to train\), eval accuracy [0-9.]+%, weights sha256" "$T/again.out" "re-run says nothing was left to train"
expect_eq "$(grep -o 'sha256 [0-9a-f]*' "$T/again.out")" "$(grep -o 'sha256 [0-9a-f]*' "$T/a.out")" "re-run keeps the weights"
python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['trainer']; print(t['final_loss'], t['samples_per_s'], t['steps'])" "$T/again.json" >"$T/check"
expect_eq "$(cat "$T/check")" "None None 468" "re-run summary: loss and throughput null"
"$DTRAIN" run "$T/b.json" >"$T/b1.out" 2>&1 &
DTRAIN_PID=$!
for _ in $(seq 300); do ls "$T/ckpt-b" 2>/dev/null | grep -q "ckpt-000000016[0-9].bin" && break; sleep 0.1; done
victim=$(pgrep -P "$DTRAIN_PID" -f " train " | tail -1)  # a worker: the launcher's child
[ -n "$victim" ] && kill -9 "$victim"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
[ "$rc" -ne 0 ] && pass "interrupted run fails (rc $rc)" || fail "interrupted run exited 0"
"$DTRAIN" run "$T/b.json" >"$T/b2.out" 2>&1
expect_eq "$?" 0 "restarted run"
expect_grep "resuming from .*ckpt-b/ckpt-0000000[0-9]+.bin: step [1-9][0-9]+" "$T/b2.out" "resumed from a checkpoint"
expect_eq "$(grep -o 'sha256 [0-9a-f]*' "$T/b2.out")" "$(grep -o 'sha256 [0-9a-f]*' "$T/a.out")" "resumed weights bit-identical to the uninterrupted run"
# A damaged newest checkpoint is skipped with a warning.
newest=$(ls "$T/ckpt-b"/ckpt-*.bin | tail -1)
printf 'garbage' > "$newest"
"$DTRAIN" run "$T/b.json" >"$T/b3.out" 2>"$T/b3.err"
expect_eq "$?" 0 "run with a damaged newest checkpoint"
# On stderr: a script reading the job's stdout sees the workers' progress alone.
expect_grep "warning: checkpoint .* is (not a dtrain checkpoint or truncated|truncated|corrupt).*skipping it" "$T/b3.err" "damaged checkpoint skipped, on stderr"
grep -q "skipping it" "$T/b3.out" && fail "the damaged-checkpoint warning is on stdout" || pass "stdout has no warning"

# Relative paths mean what they mean where dtrain is started, whatever `cwd` says: data,
# checkpoints, rank logs and metrics all land beside the spec, nothing in the workers' cwd.
mkdir -p "$T/rel/wd"
python3 -c "
import random
random.seed(3)
with open('$T/rel/d.csv', 'w') as f:
    for i in range(300):
        x = [random.gauss(0, 1) for _ in range(4)]
        f.write(','.join('%.3f' % v for v in x) + ',%d\n' % int(x[0] > 0))
"
cat > "$T/rel/job.json" <<JSON
{"nproc_per_node": 2, "cwd": "wd", "log_dir": "logs", "env": {"OMP_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [4, 8, 2]}, "data": {"type": "csv", "path": "d.csv", "label_column": 4, "header": false},
  "batch_size": 16, "epochs": 1, "checkpoint": {"dir": "ck", "every_steps": 4}}}
JSON
DTRAIN_ABS=$(readlink -f "$DTRAIN")
(cd "$T/rel" && "$DTRAIN_ABS" run job.json --summary-json sum.json >"$T/out" 2>&1)
expect_eq "$?" 0 "relative cwd, data, log_dir and checkpoint dir"
( cd "$T/rel" && ls logs/rank_0.log logs/rank_1.log logs/metrics.jsonl && ls ck/ckpt-*.bin ) >/dev/null 2>"$T/err"
expect_eq "$(cat "$T/err")" "" "logs, metrics and checkpoints beside the spec"
expect_eq "$(ls -A "$T/rel/wd")" "" "nothing written in the workers' cwd"
run_id=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['run_id'])" "$T/rel/sum.json")
[ -n "$run_id" ] && ! ls -d "${TMPDIR:-/tmp}/dtrain-run-$run_id-"* >/dev/null 2>&1 && pass "the run's spec snapshot is removed" ||
  fail "spec snapshot of run '$run_id' left behind"

# Too few samples for one global batch is a clear error.
cat > "$T/few.json" <<JSON
{"nproc_per_node": 2, "trainer": {"model": {"layers": [16, 3]}, "data": {"train_samples": 10}, "batch_size": 16}}
JSON
"$DTRAIN" run "$T/few.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "too few samples: exit 2 before any worker starts"
expect_eq "$(cat "$T/err")" "dtrain: error: $T/few.json: /trainer/batch_size: the training set (10 samples) is smaller than one global batch (32 = batch_size 16 x 2 data-parallel workers); use more samples, a smaller batch or fewer workers" "too few samples explained in one line"
expect_eq "$(cat "$T/out")" "" "no worker started"
"$DTRAIN" validate "$T/few.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "validate refuses too few samples"
"$DTRAIN" validate "$T/few.json" --nproc-per-node 1 >"$T/out" 2>"$T/err"
expect_grep "smaller than one global batch \(16 = batch_size 16 x 1 " "$T/err" "the check follows --nproc-per-node"
finish
