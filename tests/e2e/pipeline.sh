# Pipeline parallelism through the real binary: 4 workers = 2 replicas x 2 stages train, the
# summary records the bubble fraction and per-stage timing, and a world size that is not a
# multiple of the stages is refused.
source "$(dirname "$0")/lib.sh"
cd "$SRC"
cat > "$T/pipe.json" <<JSON
{"nproc_per_node": 4, "trainer": {"model": {"layers": [64, 128, 128, 10]}, "data": {"train_samples": 6400, "eval_samples": 256},
 "batch_size": 32, "epochs": 1, "max_steps": 60, "log_every_steps": 20, "device": "cpu",
 "parallel": {"pipeline_stages": 2, "micro_batches": 4, "schedule": "1f1b"}}}
JSON
"$DTRAIN" run "$T/pipe.json" --summary-json "$T/sum.json" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "2 x 2 pipeline job exits 0"
expect_grep "trainer: 4 workers = 2 replicas x 2 pipeline stages" "$T/out" "layout reported"
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
# 3 workers cannot form 2-stage pipelines.
sed 's/"nproc_per_node": 4/"nproc_per_node": 3/' "$T/pipe.json" > "$T/pipe3.json"
"$DTRAIN" run "$T/pipe3.json" >"$T/out3" 2>&1
[ "$?" -ne 0 ] && pass "3 workers for 2 stages fails" || fail "3 workers for 2 stages succeeded"
expect_grep "pipeline_stages 2 does not divide the world size 3" "$T/out3" "world size message"
finish
