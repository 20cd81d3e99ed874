# Pipeline parallelism through the real binary: 4 workers = 2 replicas x 2 stages train, the
# summary records the bubble fraction and per-stage timing, and a world size that is not a
# multiple of the stages is refused before the launch. Checkpoints of another layout (a
# pipeline's for a data-parallel job and the other way round) are refused on every path. A
# stage SIGKILLed in the middle of a step (its neighbours waiting on its activations or
# gradients) costs one elastic restart from the stage checkpoints, and the job ends
# bit-identical to an uninterrupted run.
source "$(dirname "$0")/lib.sh"
cd "$SRC"
cat > "$T/pipe.json" <<JSON
{"nproc_per_node": 4, "trainer": {"model": {"layers": [64, 128, 128, 10]}, "data": {"train_samples": 6400, "eval_samples": 256},
 "batch_size": 32, "epochs": 1, "max_steps": 60, "log_every_steps": 20, "device": "cpu",
 "parallel": {"pipeline_stages": 2, "micro_batches": 4, "schedule": "1f1b"}}}
JSON
DTRAIN_TRACE_DIR="$T/trace" "$DTRAIN" run "$T/pipe.json" --summary-json "$T/sum.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "2 x 2 pipeline job exits 0"
# The trace: per rank, 4 steps after the first, each with every micro-batch's forward and
# backward, the transfers of its position, and non-overlapping compute on one thread.
python3 - "$T/trace" >"$T/tcheck" <<'PY'
import collections, json, sys
out = []
for r in range(4):
    d = json.load(open(f"{sys.argv[1]}/trace-rank{r}.json"))
    ev = [e for e in d["traceEvents"] if e["ph"] == "X"]
    steps = sorted({e["args"]["step"] for e in ev})
    names = collections.Counter(e["name"] for e in ev)
    fb = all(names[f"F {m}"] == 4 and names[f"B {m}"] == 4 for m in range(4))
    comm = "send act, recv grad 0" in names if r % 2 == 0 else "send grad, recv act 0" in names
    comp = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e["cat"] == "compute")
    disjoint = all(a[1] <= b[0] + 1e-3 for a, b in zip(comp, comp[1:]))
    out.append(f"{steps == [1, 2, 3, 4]} {fb} {comm} {disjoint} {names['optimizer'] == 4}")
print(" ".join(sorted(set(out))))
PY
expect_eq "$(cat "$T/tcheck")" "True True True True True" "DTRAIN_TRACE_DIR: a Chrome trace per rank with every micro-batch and transfer"
expect_grep "trainer: 4 workers = 2 replicas x 2 pipeline stages" "$T/out" "layout reported"
# A trace directory nobody can write in is said at the start (exit 2, no restart), not after
# the training, whose result it used to take with it.
start=$(date +%s)
DTRAIN_TRACE_DIR=/proc/1 "$DTRAIN" run "$T/pipe.json" --max-restarts 2 >"$T/tout" 2>"$T/terr"
expect_eq "$?" 2 "DTRAIN_TRACE_DIR not writable: exit 2"
expect_grep "DTRAIN_TRACE_DIR: cannot write in \"/proc/1\": .*; give a directory this user can write in, or unset DTRAIN_TRACE_DIR" "$T/terr" "DTRAIN_TRACE_DIR not writable: named, with the fix"
expect_no_grep "step 20/60" "$T/tout" "DTRAIN_TRACE_DIR not writable: refused before training"
expect_no_grep "event restart" "$T/terr" "DTRAIN_TRACE_DIR not writable: no restart"
expect_grep "^\[rank 0\] epoch 1/1 step 20/60 loss [0-9.]+ acc [0-9.]+% [0-9]+ samples/s stage ms [0-9.]+/[0-9.]+ bubble [0-9.]+% eta " "$T/out" "progress lines with stage timing and bubble"
expect_grep "^\[rank 0\] pipeline: 2 stages, compute ms/step per stage [0-9.]+/[0-9.]+, bubble fraction 0\.[0-9]+" "$T/out" "pipeline summary line"
python3 - "$T/sum.json" "$T/out" >"$T/check" <<'PY2'
import json, re, sys
d = json.load(open(sys.argv[1]))
out = open(sys.argv[2]).read()
sha = re.search(r"weights sha256 ([0-9a-f]{64})", out).group(1)
t = d["trainer"]
print(d["status"], len(d["ranks"]), t["steps"], t["weights_sha256"] == sha, t["pipeline_stages"],
      0 < t["bubble_fraction"] < 1, len(t["stage_ms"]), t["eval_accuracy"] > 0.3)
PY2
expect_eq "$(cat "$T/check")" "succeeded 4 60 True 2 True 2 True" "--summary-json records the pipeline"
# A pipeline run that times nothing (its checkpoint completes the job) keeps the summary's
# shape: pipeline_stages, with bubble_fraction and stage_ms null, not left out.
cat > "$T/done.json" <<JSON
{"nproc_per_node": 2, "trainer": {"model": {"layers": [8, 16, 4]}, "data": {"train_samples": 256},
 "batch_size": 16, "max_steps": 4, "device": "cpu", "checkpoint": {"dir": "$T/done-ck"},
 "parallel": {"pipeline_stages": 2, "micro_batches": 2}}}
JSON
"$DTRAIN" run "$T/done.json" >"$T/dout" 2>&1; expect_eq "$?" 0 "small pipeline job with a checkpoint"
"$DTRAIN" run "$T/done.json" --summary-json "$T/done.sum" >"$T/dout" 2>&1; expect_eq "$?" 0 "its rerun: nothing left to train"
expect_eq "$(python3 -c 'import json,sys; t=json.load(open(sys.argv[1]))["trainer"]; print(t["steps"], t["pipeline_stages"], t["bubble_fraction"], t["stage_ms"], t["final_loss"])' "$T/done.sum")" "4 2 None None None" "a pipeline run that trained nothing: pipeline_stages 2, timing null"
# One step more: trained, but not timed (the first step of a run is left out of the timing,
# as of samples/s): its bubble and stage times are null, not 0 (a perfect pipeline), and no
# "pipeline:" line claims them.
sed 's/"max_steps": 4/"max_steps": 5/' "$T/done.json" >"$T/one.json"
"$DTRAIN" run "$T/one.json" --summary-json "$T/one.sum" >"$T/oout" 2>&1; expect_eq "$?" 0 "a resumed pipeline run of one step"
expect_eq "$(python3 -c 'import json,sys; t=json.load(open(sys.argv[1]))["trainer"]; print(t["steps"], t["bubble_fraction"], t["stage_ms"], t["final_loss"] is not None)' "$T/one.sum")" "5 None None True" "a pipeline run of one step: trained, timing null"
expect_no_grep "pipeline: 2 stages" "$T/oout" "a pipeline run of one step: no timing line"
# 3 workers cannot form 2-stage pipelines: refused before any worker starts (validate and
# run, a spec's nproc_per_node, the flag, hosts with fixed slots, every world size of an
# elastic range); where the world is only known to the workers, the trainer refuses it.
sed 's/"nproc_per_node": 4/"nproc_per_node": 3/' "$T/pipe.json" > "$T/pipe3.json"
fix3="a pipeline job runs D x 2 workers \(D data-parallel replicas of the pipeline\): set nproc_per_node to a multiple of 2 \(e.g. 4\), or set pipeline_stages to a divisor of 3"
for verb in run validate; do
  "$DTRAIN" $verb "$T/pipe3.json" >"$T/out3" 2>"$T/err3"
  expect_eq "$?" 2 "$verb: 3 workers for 2 stages: exit 2"
  expect_eq "$(wc -l <"$T/err3")" 1 "$verb: 3 workers for 2 stages: one line"
  expect_grep "^dtrain: error: $T/pipe3.json: /trainer/parallel/pipeline_stages: 2 stages do not divide the world size 3 \(nproc_per_node 3\); $fix3\$" "$T/err3" "$verb: names the field, the world size and the fix"
  expect_eq "$(cat "$T/out3")" "" "$verb: 3 workers for 2 stages: no worker started"
done
"$DTRAIN" run "$T/pipe.json" --nproc-per-node 3 --summary-json "$T/sum3.json" >"$T/out3" 2>"$T/err3"
expect_eq "$?" 2 "--nproc-per-node 3: exit 2"
expect_grep "/trainer/parallel/pipeline_stages: 2 stages do not divide the world size 3 \(--nproc-per-node 3\); .*set --nproc-per-node to a multiple of 2" "$T/err3" "--nproc-per-node 3: names the flag"
expect_eq "$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["exit_code"], d["ranks"])' "$T/sum3.json")" "2 []" "--nproc-per-node 3: the summary has no ranks"
"$DTRAIN" run "$T/pipe.json" --hosts localhost:1,127.0.0.1:2 >"$T/out3" 2>"$T/err3"
expect_eq "$?" 2 "hosts with 1 + 2 slots: exit 2"
expect_grep "^dtrain: error: $T/pipe.json: /trainer/parallel/pipeline_stages: 2 stages do not divide the world size 3 \(2 hosts with 1\+2 workers\); " "$T/err3" "hosts with 1 + 2 slots: named before any host starts"
expect_eq "$(cat "$T/out3")" "" "hosts with 1 + 2 slots: no worker started"
"$DTRAIN" validate "$T/pipe.json" --hosts localhost:2,127.0.0.1:1,127.0.0.2:1 --nnodes 2:3 >"$T/out3" 2>"$T/err3"
expect_eq "$?" 2 "elastic range 2..3 with a world of 3 in it: exit 2"
expect_grep "^dtrain: error: $T/pipe.json: /trainer/parallel/pipeline_stages: 2 stages do not divide every world size of the elastic range \(2..3 nodes\): 2 nodes: 3 workers; .*: give --nnodes 3:3, or give every host a multiple of 2 workers\$" "$T/err3" "elastic range: names the node count and world size that cannot work"
"$DTRAIN" validate "$T/pipe.json" --hosts localhost:2,127.0.0.1:2 --nnodes 1:2 >/dev/null 2>"$T/err3"
expect_eq "$?" 0 "elastic range whose every world size works"
# "auto" workers: validate says nothing of this machine's count (the job may run on 8 GPUs);
# run and --dry-run judge it here (3 stages: refused unless this machine's count is a multiple).
sed 's/"nproc_per_node": 4/"nproc_per_node": "auto"/; s/"pipeline_stages": 2/"pipeline_stages": 3/' "$T/pipe.json" > "$T/pipeauto.json"
"$DTRAIN" validate "$T/pipeauto.json" >"$T/out3" 2>"$T/err3"; expect_eq "$?" 0 "auto workers: validate does not judge by this machine"
printf '{"nproc_per_node": "auto", "command": ["true"]}' >"$T/auto.json"
here=$("$DTRAIN" validate "$T/auto.json" | sed -n 's/^nproc_per_node: *\([0-9]*\) (auto)$/\1/p')
"$DTRAIN" run --dry-run "$T/pipeauto.json" >"$T/out3" 2>"$T/err3"; rc=$?
if [ $((here % 3)) -ne 0 ]; then
  expect_eq "$rc" 2 "auto workers ($here here): --dry-run refuses 3 stages"
  expect_grep "3 stages do not divide the world size $here \(nproc_per_node \"auto\" = $here\)" "$T/err3" "auto workers: --dry-run names the count"
else
  expect_eq "$rc" 0 "auto workers ($here here): --dry-run accepts 3 stages"
fi
# Run by hand (one worker, alone) the trainer refuses it itself.
"$DTRAIN" train "$T/pipe3.json" >"$T/out3" 2>"$T/err3"
expect_eq "$?" 2 "dtrain train by hand, 2 stages alone: exit 2"
expect_grep "pipeline_stages 2 does not divide the world size 1" "$T/err3" "the worker-side check"

# Checkpoints of another layout (a pipeline's stage directories for a data-parallel job, and
# the other way round): refused with exit 2 before any worker starts, by dtrain run, across
# hosts by node 0's agent, by dtrain train run by hand, and by the trainer itself where
# nothing checked before (workers started as a command; every rank refuses: unit tests). Junk named like the
# other layout's checkpoints is no reason to refuse.
lay_spec() {  # lay_spec FILE DIR STAGES
  local par=""
  [ "$3" -gt 1 ] && par=", \"parallel\": {\"pipeline_stages\": $3, \"micro_batches\": 2}"
  cat > "$1" <<JSON
{"nproc_per_node": 2, "env": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [16, 32, 32, 4]}, "data": {"train_samples": 1024, "eval_samples": 64},
  "batch_size": 16, "epochs": 1, "max_steps": 10, "log_every_steps": 1000, "device": "cpu",
  "checkpoint": {"dir": "$2", "every_steps": 5}$par}}
JSON
}
L="$T/layout"; mkdir -p "$L"
lay_spec "$L/pp.json" "$L/ck-pp" 2
lay_spec "$L/dp.json" "$L/ck-pp" 1
"$DTRAIN" run "$L/pp.json" >"$L/out" 2>&1
expect_eq "$?" 0 "layout: the pipeline run"
toDp="$L/ck-pp/stage-0-of-2/ckpt-0000000010.bin \(step 10\) was written by a pipeline of 2 stages with layers per stage \[1, 2\], this job is data-parallel \(pipeline_stages 1\); checkpoints resume only in the layout that wrote them: use another /trainer/checkpoint/dir, or pipeline_stages 2 with stage_layers \[1, 2\] \(the layout they were written with\), or remove them \(the stage-\*-of-2/ directories and manifest.json in $L/ck-pp\)"
"$DTRAIN" run "$L/dp.json" --max-restarts 2 >"$L/out" 2>"$L/err"
expect_eq "$?" 2 "layout: data-parallel on a pipeline's checkpoints: exit 2"
expect_eq "$(wc -l <"$L/err")" 1 "layout: data-parallel on a pipeline's checkpoints: one line"
expect_grep "^dtrain: error: $L/dp.json: /trainer/parallel/pipeline_stages: $toDp\$" "$L/err" "layout: names the file, the field, both layouts and the fix"
expect_eq "$(cat "$L/out")" "" "layout: data-parallel on a pipeline's checkpoints: no worker started"
ls "$L/ck-pp"/ckpt-*.bin >/dev/null 2>&1 && fail "layout: data-parallel checkpoints written beside the pipeline's" || pass "layout: nothing written beside them"
"$DTRAIN" train "$L/dp.json" >"$L/out" 2>"$L/err"
expect_eq "$?" 2 "layout: dtrain train by hand: exit 2"
expect_grep "^dtrain: error: $L/dp.json: /trainer/parallel/pipeline_stages: $toDp\$" "$L/err" "layout: dtrain train by hand: the same line"
"$DTRAIN" run "$L/dp.json" --hosts localhost:1,127.0.0.1:1 --max-restarts 2 >"$L/out" 2>"$L/err"
expect_eq "$?" 2 "layout: across hosts: exit 2"
expect_grep "node localhost: $L/dp.json: /trainer/parallel/pipeline_stages: $L/ck-pp/stage-0-of-2/ckpt-0000000010.bin \(step 10\) was written by a pipeline of 2 stages" "$L/err" "layout: across hosts, node 0's agent refuses it"
if grep -q "event restart" "$L/err"; then fail "layout: across hosts: restarted"; else pass "layout: across hosts: no restart"; fi
"$DTRAIN" run --nproc-per-node 2 -- "$DTRAIN" train "$L/dp.json" >"$L/out" 2>&1
expect_eq "$?" 2 "layout: the trainer's own check (workers started as a command): exit 2"
# (every rank with rank 0's detail: whichever exits first makes the headline)
expect_grep "^\[rank 1\] .*trainer: /trainer/parallel/pipeline_stages: $toDp" "$L/out" "layout: rank 1 names the layouts too"
expect_grep "^dtrain: job .* failed: rank [01] exited with code 2 \(trainer: /trainer/parallel/pipeline_stages: $L/ck-pp/stage-0-of-2/ckpt-0000000010.bin \(step 10\) was written by a pipeline" "$L/out" "layout: the headline names the layouts"
ls "$L/ck-pp"/ckpt-*.bin >/dev/null 2>&1 && fail "layout: the trainer wrote beside the pipeline's checkpoints" || pass "layout: the trainer wrote nothing"
# The other way: the data-parallel trainer's checkpoints, then a pipeline job.
lay_spec "$L/dp2.json" "$L/ck-dp" 1
lay_spec "$L/pp2.json" "$L/ck-dp" 2
"$DTRAIN" run "$L/dp2.json" >"$L/out" 2>&1
expect_eq "$?" 0 "layout: the data-parallel run"
toPp="$L/ck-dp/ckpt-0000000010.bin \(step 10\) was written by the data-parallel trainer \(pipeline_stages 1\), this job is a pipeline of 2 stages with layers per stage \[1, 2\]; checkpoints resume only in the layout that wrote them: use another /trainer/checkpoint/dir, or pipeline_stages 1 \(the layout they were written with\), or remove them \(every ckpt-\*.bin in $L/ck-dp\)"
"$DTRAIN" run "$L/pp2.json" >"$L/out" 2>"$L/err"
expect_eq "$?" 2 "layout: a pipeline on data-parallel checkpoints: exit 2"
expect_eq "$(wc -l <"$L/err")" 1 "layout: a pipeline on data-parallel checkpoints: one line"
expect_grep "^dtrain: error: $L/pp2.json: /trainer/parallel/pipeline_stages: $toPp\$" "$L/err" "layout: a pipeline on data-parallel checkpoints: names both layouts"
expect_eq "$(cat "$L/out")" "" "layout: a pipeline on data-parallel checkpoints: no worker started"
[ -e "$L/ck-dp/stage-0-of-2" ] && fail "layout: stage checkpoints written beside the data-parallel ones" || pass "layout: no stage directory made"
"$DTRAIN" run --nproc-per-node 2 -- "$DTRAIN" train "$L/pp2.json" >"$L/out" 2>&1
expect_eq "$?" 2 "layout: the pipeline trainer's own check: exit 2"
expect_grep "^\[rank 1\] .*trainer: /trainer/parallel/pipeline_stages: $toPp" "$L/out" "layout: the pipeline's rank 1 names the layouts too"
# The same layout resumes, as before.
sed 's/"max_steps": 10/"max_steps": 15/' "$L/dp2.json" > "$L/dp3.json"
"$DTRAIN" run "$L/dp3.json" >"$L/out" 2>&1
expect_eq "$?" 0 "layout: the data-parallel job resumes its own"
expect_grep "resuming from $L/ck-dp/ckpt-0000000010.bin: step 10" "$L/out" "layout: resumed from step 10"
# Junk: a stage file that is no checkpoint, a damaged data-parallel one.
mkdir -p "$L/ck-junk/stage-0-of-2"
head -c 300 /dev/urandom > "$L/ck-junk/stage-0-of-2/ckpt-0000000005.bin"
lay_spec "$L/dpj.json" "$L/ck-junk" 1
"$DTRAIN" run "$L/dpj.json" >"$L/out" 2>"$L/err"
expect_eq "$?" 0 "layout: junk stage files do not refuse a data-parallel job"
python3 - "$L/ck-junk/ckpt-0000000010.bin" <<'PY'
import sys
b = bytearray(open(sys.argv[1], "rb").read()); b[100] ^= 0xFF; open(sys.argv[1], "wb").write(b)
PY
rm -f "$L/ck-junk"/ckpt-0000000005.bin
lay_spec "$L/ppj.json" "$L/ck-junk" 2
rm -rf "$L/ck-junk/stage-0-of-2"
"$DTRAIN" run "$L/ppj.json" >"$L/out" 2>"$L/err"
expect_eq "$?" 0 "layout: a damaged data-parallel checkpoint does not refuse a pipeline job"

# A stage dying mid-step. 2 replicas x 3 stages, 1F1B with 4 micro-batches, checkpoints
# every 5 steps; the reference run is uninterrupted.
ft_spec() {  # ft_spec DIR
  cat > "$1/job.json" <<JSON
{"nproc_per_node": 6, "max_restarts": 1, "restart_backoff_s": 0,
 "trainer": {"model": {"layers": [24, 48, 48, 32, 6]}, "data": {"train_samples": 4800, "eval_samples": 240, "seed": 3},
  "batch_size": 16, "epochs": 1, "max_steps": 40, "log_every_steps": 1000, "device": "cpu",
  "optimizer": {"type": "adamw", "lr": 0.01}, "grad_clip_norm": 1.0,
  "checkpoint": {"dir": "$1/ckpt", "every_steps": 5},
  "parallel": {"pipeline_stages": 3, "micro_batches": 4, "schedule": "1f1b"}}}
JSON
}
hash_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["trainer"]["weights_sha256"])' "$1"; }
mkdir -p "$T/ref"; ft_spec "$T/ref"
"$DTRAIN" run "$T/ref/job.json" --summary-json "$T/ref/sum.json" >"$T/ref/out" 2>&1
expect_eq "$?" 0 "uninterrupted 2 x 3 pipeline"
REF=$(hash_of "$T/ref/sum.json")
python3 - "$T/ref/ckpt" >"$T/mcheck" <<'PY'
import json, os, sys
m = json.load(open(os.path.join(sys.argv[1], "manifest.json")))
print(m["step"], m["stages"], m["stage_layers"], all(os.path.exists(os.path.join(sys.argv[1], f)) for f in m["files"]))
PY
expect_eq "$(cat "$T/mcheck")" "40 3 [1, 1, 2] True" "checkpoint manifest names the final step's stage files"
# rank 1 = stage 1 of replica 0 (a middle stage) during micro-batch 2 of step 12; rank 5 =
# the last stage of replica 1 during micro-batch 0 of step 23; rank 3 = the first stage of
# replica 1 as it starts step 31.
for kill in 1:12:2 5:23:0 3:31:1; do
  d="$T/k${kill//:/_}"; mkdir -p "$d"; ft_spec "$d"
  rank=${kill%%:*}
  DTRAIN_DEBUG_KILL_AT="$kill" "$DTRAIN" run "$d/job.json" --summary-json "$d/sum.json" >"$d/out" 2>&1
  expect_eq "$?" 0 "stage killed at $kill: the job completes"
  expect_grep "event restart \(round 1\) host .* rank $rank: rank $rank killed by SIGKILL; restart 1 of 1" "$d/out" "kill $kill: one restart, naming rank $rank"
  expect_grep "resuming from .*/stage-0-of-3/" "$d/out" "kill $kill: resumed from the stage checkpoints"
  expect_eq "$(hash_of "$d/sum.json")" "$REF" "kill $kill: weights bit-identical to the uninterrupted run"
done
# Stages one checkpoint apart, and the step they share damaged in one of them: every stage
# goes back until all have an intact step (before: "no step in common; remove them", whose
# fix deleted the good checkpoints).
R="$T/reconcile"; mkdir -p "$R"
lay_spec "$R/pp.json" "$R/ck" 2
sed -i 's/"max_steps": 10/"max_steps": 20/' "$R/pp.json"
"$DTRAIN" run "$R/pp.json" >"$R/out" 2>&1
expect_eq "$?" 0 "reconcile: the pipeline run (checkpoints at 10, 15, 20)"
rm "$R/ck/stage-1-of-2/ckpt-0000000020.bin"
printf 'X' | dd of="$R/ck/stage-0-of-2/ckpt-0000000015.bin" bs=1 seek=100 conv=notrunc 2>/dev/null
sed -i 's/"max_steps": 20/"max_steps": 25/' "$R/pp.json"
"$DTRAIN" run "$R/pp.json" >"$R/out" 2>&1
expect_eq "$?" 0 "reconcile: resumes"
expect_grep "the stage checkpoints in $R/ck end at different steps \(15 to 20\); resuming all stages from step 10" "$R/out" "reconcile: back to the newest step every stage holds intact"
expect_grep "resuming from $R/ck/stage-0-of-2/ckpt-0000000010.bin: step 10" "$R/out" "reconcile: from step 10"
# A run stopped while its first checkpoint was being written: stage 0 holds step 5, stage
# 1 only its temporary file. Every stage starts from step 0, as a fresh run would (before:
# every restart and rerun refused, "no step in common"), and ends with a fresh run's weights.
F="$T/firstckpt"; mkdir -p "$F"
lay_spec "$F/fresh.json" "$F/ck-fresh" 2
"$DTRAIN" run "$F/fresh.json" --summary-json "$F/fresh.sum" >"$F/out" 2>&1
expect_eq "$?" 0 "first checkpoint: the straight run"
lay_spec "$F/pp.json" "$F/ck" 2
sed -i 's/"max_steps": 10/"max_steps": 5/' "$F/pp.json"
"$DTRAIN" run "$F/pp.json" >"$F/out" 2>&1
expect_eq "$?" 0 "first checkpoint: a run to step 5"
mv "$F/ck/stage-1-of-2/ckpt-0000000005.bin" "$F/ck/stage-1-of-2/ckpt-0000000005.bin.tmp"
rm -f "$F/ck/manifest.json"
lay_spec "$F/pp.json" "$F/ck" 2
"$DTRAIN" run "$F/pp.json" --summary-json "$F/pp.sum" >"$F/out" 2>&1
expect_eq "$?" 0 "first checkpoint: a stage without one starts all over"
expect_grep "the stage checkpoints in $F/ck have no step in common \(stage 0 at step 5, stage 1 has none\): every stage starts from step 0" "$F/out" "first checkpoint: the warning names what each stage holds"
expect_no_grep "resuming from" "$F/out" "first checkpoint: nothing resumed"
expect_eq "$(hash_of "$F/pp.sum")" "$(hash_of "$F/fresh.sum")" "first checkpoint: a fresh run's weights"
# A stage's files lost after the manifest named them (the stage directory removed): refused
# before the launch, naming the manifest's step and the lost file (before: every stage
# started over from step 0 with a warning, the steps done thrown away).
L="$T/lost"; mkdir -p "$L"
lay_spec "$L/pp.json" "$L/ck" 2
sed -i 's/"max_steps": 10/"max_steps": 5/' "$L/pp.json"
"$DTRAIN" run "$L/pp.json" >"$L/out" 2>&1
expect_eq "$?" 0 "lost stage files: a run to step 5"
rm -rf "$L/ck/stage-1-of-2"
"$DTRAIN" run "$L/pp.json" >"$L/out" 2>&1
expect_eq "$?" 2 "lost stage files: refused"
expect_grep "^dtrain: error: $L/pp.json: /trainer/checkpoint/dir: $L/ck/manifest.json says every stage wrote step 5, but stage 1 holds no intact checkpoint now \($L/ck/stage-1-of-2/ckpt-0000000005.bin is missing\): restore it, or remove the stage-\*-of-2/ directories and manifest.json in $L/ck to start from step 0$" "$L/out" "lost stage files: the step, the file and the fix"
expect_no_grep "rank 0" "$L/out" "lost stage files: no worker started"
# Each stage holds steps, none of them in common: refused, naming what each holds.
rm -f "$R/ck/stage-0-of-2/ckpt-0000000015.bin" "$R/ck/stage-0-of-2/ckpt-0000000020.bin" "$R/ck/stage-1-of-2/ckpt-0000000025.bin"
"$DTRAIN" run "$R/pp.json" >"$R/out" 2>&1
expect_eq "$?" 2 "no common step: refused"
expect_grep "^dtrain: error: $R/pp.json: /trainer/checkpoint/dir: the stage checkpoints in $R/ck have no step in common \(stage 0 at step 25, stage 1 at step 20\); remove them" "$R/out" "no common step: refused before the launch, naming each stage's step"
expect_no_grep "rank 0" "$R/out" "no common step: no worker started"
DTRAIN_DEBUG_KILL_AT="1:x" "$DTRAIN" run "$T/ref/job.json" >"$T/badkill" 2>&1
expect_grep "DTRAIN_DEBUG_KILL_AT: expected RANK:STEP or RANK:STEP:MICRO" "$T/badkill" "malformed fault injection is named"
finish
