# The built-in trainer at its edges: a long final evaluation under the watchdog, what the
# summary says without a held-out set and for regression, a run that diverges, a job too big
# for memory.
source "$(dirname "$0")/lib.sh"
jq_() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print($2)" "$1"; }

# The final evaluation (~2 s here) is longer than worker_timeout_s (1 s): it is work, not a
# hang (the workers touched the watchdog only at each step; the job was killed as hung).
cat >"$T/wd.json" <<'JSON'
{"nproc_per_node": 2, "worker_timeout_s": 1, "env": {"OMP_NUM_THREADS": "1"}, "trainer": {"model": {"layers": [784, 64, 10]},
 "data": {"type": "synthetic", "train_samples": 2000, "eval_samples": 300000}, "batch_size": 64, "epochs": 1}}
JSON
"$DTRAIN" run "$T/wd.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "a final evaluation longer than worker_timeout_s is not a hang"
expect_grep "eval accuracy [0-9.]+%" "$T/out" "the evaluation finished"

# No held-out set: no accuracy of 0%, null in the summary.
cat >"$T/noeval.json" <<'JSON'
{"nproc_per_node": 2, "env": {"OMP_NUM_THREADS": "1"}, "trainer": {"model": {"layers": [4, 16, 3]},
 "data": {"type": "synthetic", "train_samples": 2000, "eval_samples": 0}, "batch_size": 32, "epochs": 1}}
JSON
"$DTRAIN" run "$T/noeval.json" --summary-json "$T/s1.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "no held-out set: exit 0"
expect_grep "trained: 31 steps, final loss [0-9.]+, no held-out set to evaluate," "$T/out" "no held-out set: said so"
expect_eq "$(jq_ "$T/s1.json" "(d['trainer']['eval_accuracy'], d['trainer']['eval_loss'])")" "(None, None)" "no held-out set: null in the summary"

# Regression (mse): accuracy means nothing (argmax of one output always matches); the
# held-out loss is reported instead, and metrics rows carry no accuracy.
cat >"$T/mse.json" <<'JSON'
{"nproc_per_node": 2, "env": {"OMP_NUM_THREADS": "1"}, "trainer": {"model": {"layers": [4, 16, 1], "loss": "mse"},
 "data": {"type": "synthetic", "train_samples": 2000, "eval_samples": 500}, "batch_size": 32, "epochs": 1, "log_every_steps": 10,
 "optimizer": {"lr": 0.01}}}
JSON
"$DTRAIN" run "$T/mse.json" --log-dir "$T/mse-logs" --summary-json "$T/s2.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "mse: exit 0"
expect_grep "trained: 31 steps, final loss [0-9.]+, eval loss [0-9.e-]+," "$T/out" "mse: the held-out loss reported"
grep -q " acc " "$T/out" && fail "mse: an accuracy printed: $(grep ' acc ' "$T/out")" || pass "mse: no accuracy printed"
expect_eq "$(jq_ "$T/s2.json" "(d['trainer']['eval_accuracy'], d['trainer']['eval_loss'] > 0)")" "(None, True)" "mse: summary has eval_loss, no accuracy"
expect_eq "$(python3 -c "import json; rows=[json.loads(l) for l in open('$T/mse-logs/metrics.jsonl')]; print(sorted({str(r.get('accuracy')) for r in rows if r.get('type') in ('train', 'eval')}))")" "['None']" "mse: metrics rows carry no accuracy"
grep -q "accuracy" "$T/mse-logs/metrics.svg" && fail "mse: metrics.svg draws an accuracy" || pass "mse: metrics.svg draws the loss only"
# Throughput not measured yet (the first step is left out of the rate): null in metrics.jsonl
# and "-" on the console, as the summary's null, not 0.
sed 's/"log_every_steps": 10/"log_every_steps": 1/' "$T/mse.json" >"$T/mse1.json"
"$DTRAIN" run "$T/mse1.json" --log-dir "$T/mse1-logs" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "log every step: exit 0"
expect_eq "$(python3 -c "import json; rows=[json.loads(l) for l in open('$T/mse1-logs/metrics.jsonl') if '\"train\"' in l]; print(rows[0]['step'], rows[0]['samples_per_s'], rows[1]['samples_per_s'] > 0)")" "1 None True" "untimed first step: null samples_per_s in metrics.jsonl"
expect_grep "^\[rank 0\] epoch 1/1 step 1/31 loss [0-9.]+ - samples/s eta \?$" "$T/out" "untimed first step: '- samples/s' on the console"

# Diverged (lr far too high): the trainer stops with the reason and the fix, exit 2, and
# writes no checkpoint of NaN weights (the next run must resume from a sane one).
cat >"$T/div.json" <<JSON
{"nproc_per_node": 2, "max_restarts": 2, "env": {"OMP_NUM_THREADS": "1"}, "trainer": {"model": {"layers": [4, 16, 3]},
 "data": {"type": "synthetic", "train_samples": 20000, "eval_samples": 100}, "batch_size": 32, "epochs": 1,
 "optimizer": {"lr": 100000}, "log_every_steps": 1, "checkpoint": {"dir": "$T/ck", "every_steps": 1}}}
JSON
"$DTRAIN" run "$T/div.json" --summary-json "$T/s3.json" --log-dir "$T/div-logs" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "diverged: exit 2"
# The curve up to the divergence is drawn for a run that failed too.
[ -s "$T/div-logs/metrics.svg" ] && grep -qE '<polyline [^>]*points="[0-9]' "$T/div-logs/metrics.svg" && pass "diverged: metrics.svg drawn" || fail "diverged: no metrics.svg with a curve: $(ls "$T/div-logs" 2>&1)"
expect_grep "training diverged at step [0-9]+: the (loss is not finite \(NaN or infinite gradients\)|weights are not finite); lower /trainer/optimizer/lr \(now 100000\) or set /trainer/grad_clip_norm" "$T/err" "diverged: the reason and the fix"
expect_eq "$(jq_ "$T/s3.json" "d['restarts']")" 0 "diverged: not restarted (it would diverge again)"
grep -q "lost rank" "$T/err" && fail "diverged: a rank failed on a lost peer: $(grep 'lost rank' "$T/err")" || pass "diverged: every rank stops by itself at the same step (none on a lost peer)"
python3 - "$T/ck" <<'PY' && pass "diverged: every checkpoint written holds finite weights" || fail "diverged: a checkpoint holds NaN weights"
import math, os, struct, sys
d = sys.argv[1]
names = sorted(n for n in os.listdir(d) if n.endswith(".bin"))
if not names: sys.exit(1)  # (the steps before it diverged were checkpointed)
for name in names:
    b = open(os.path.join(d, name), "rb").read()
    # magic (8), payload size, hash, step, epoch, cursor, world, n params, params...
    n = struct.unpack_from("<Q", b, 8 + 8 * 6)[0]
    vals = struct.unpack_from(f"<{n}f", b, 8 + 8 * 7)
    if not all(math.isfinite(v) for v in vals): sys.exit(1)
PY
# The pipeline trainer too: every stage stops at the same step, not restarted.
cat >"$T/pdiv.json" <<JSON
{"nproc_per_node": 2, "max_restarts": 2, "env": {"OMP_NUM_THREADS": "1"}, "trainer": {"model": {"layers": [4, 16, 16, 3], "activation": "gelu"},
 "data": {"type": "synthetic", "train_samples": 20000, "eval_samples": 100}, "batch_size": 32, "epochs": 1,
 "optimizer": {"lr": 100000}, "parallel": {"pipeline_stages": 2, "micro_batches": 2}, "checkpoint": {"dir": "$T/pck", "every_steps": 1}}}
JSON
"$DTRAIN" run "$T/pdiv.json" --summary-json "$T/s4.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "pipeline diverged: exit 2"
grep -q "lost rank" "$T/err" && fail "pipeline diverged: a rank failed on a lost peer: $(grep 'lost rank' "$T/err")" || pass "pipeline diverged: every stage stops by itself (none on a lost peer)"
expect_eq "$(jq_ "$T/s4.json" "d['restarts']")" 0 "pipeline diverged: not restarted"
# A job this machine cannot hold: refused with the numbers before any worker starts (it was a
# worker's std::bad_alloc, exit 1), naming the field that needs the memory: the model...
cat >"$T/huge.json" <<'JSON'
{"nproc_per_node": 2, "trainer": {"model": {"layers": [1048576, 1048576, 10]}, "data": {"type": "synthetic", "train_samples": 1000}, "batch_size": 8}}
JSON
"$DTRAIN" run "$T/huge.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a model larger than memory: exit 2"
expect_grep "^dtrain: error: $T/huge.json: /trainer/model/layers: this job needs about [0-9.]+ GiB of memory on this host \(2 workers, the largest \(rank 0\) [0-9.]+ GiB: weights, gradients, optimizer state and their host copies [0-9.]+ GiB\), more than the [0-9.]+ [MG]iB available (\(MemAvailable\)|under the memory limit of [0-9.]+ [MG]iB of this process.s cgroup \([^)]*\)); use smaller layers \(now 1048576-1048576-10: 1099523.2 M parameters, 4096.0 GiB per copy\), fewer workers per host \(nproc_per_node 2\), or pipeline stages" "$T/err" "a model larger than memory: the numbers and the fix"
# ... or the batch: activations were not counted at all (validate said OK for a job that
# needed 76 GiB per worker).
cat >"$T/hugebatch.json" <<'JSON'
{"nproc_per_node": 2, "trainer": {"model": {"layers": [65536, 16, 10]}, "data": {"type": "synthetic", "train_samples": 2100000},
 "batch_size": 1048576}}
JSON
# (validate warns: it may run on another machine than the job's; run refuses)
"$DTRAIN" validate "$T/hugebatch.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "a batch larger than memory: validate warns, exit 0"
expect_grep "^  memory: +about [0-9.]+ GiB on this host \(2 workers\), [0-9.]+ [MG]iB available: more than this host has$" "$T/out" "a batch larger than memory: validate's memory line says so"
expect_grep "^dtrain: warning: $T/hugebatch.json: /trainer/batch_size: this job needs about [0-9.]+ GiB of memory on this host \(2 workers, the largest \(rank 0\) [0-9.]+ GiB: activations and batch buffers [0-9.]+ GiB\), more than the [0-9.]+ [MG]iB available (\(MemAvailable\)|under the memory limit of [0-9.]+ [MG]iB of this process.s cgroup \([^)]*\)); use a smaller batch_size \(now 1048576\) or fewer workers per host \(nproc_per_node 2\) \(run refuses it on a host like this one\)$" "$T/err" "a batch larger than memory: validate names batch_size, the numbers and the fix"
"$DTRAIN" run "$T/hugebatch.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a batch larger than memory: run exits 2"
expect_grep "/trainer/batch_size: this job needs about" "$T/err" "a batch larger than memory: run says it before the launch"
grep -q "^\[rank" "$T/err" && fail "a batch larger than memory: a worker started" || pass "a batch larger than memory: no worker started"
"$DTRAIN" train "$T/hugebatch.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a batch larger than memory: dtrain train by hand exits 2"
expect_grep "^dtrain: error: $T/hugebatch.json: /trainer/batch_size: this job needs about" "$T/err" "dtrain train by hand: the same check"
# validate says what a job that fits needs.
"$DTRAIN" validate "$T/noeval.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "validate: a small job is OK"
expect_grep "^  memory: +about [0-9]+ MiB on this host \(2 workers\), [0-9.]+ [MG]iB available$" "$T/out" "validate: the job's estimated memory"

# Memory that runs out inside a worker anyway (other processes took it, or a limit: ulimit -v
# here, which fails the big allocations at once) is one line naming what was being allocated
# and the field to change, exit 2 and no restart (every attempt would run out at the same
# place), never a bare "std::bad_alloc". (DTRAIN_MEMORY_CHECK=0: the launcher's own check,
# which depends on the memory this machine has free, says and does not refuse; the CPU, as a
# GPU's memory is not what ulimit -v limits.)
export DTRAIN_MEMORY_CHECK=0
cat >"$T/oom_model.json" <<'JSON'
{"nproc_per_node": 1, "max_restarts": 2, "env": {"OMP_NUM_THREADS": "1"}, "trainer": {"device": "cpu", "model": {"layers": [1024, 10000, 10000, 10]},
 "data": {"type": "synthetic", "train_samples": 1000}, "batch_size": 8}}
JSON
(ulimit -v 700000; "$DTRAIN" run "$T/oom_model.json" --summary-json "$T/s5.json" >"$T/out" 2>"$T/err"); expect_eq "$?" 2 "out of memory for the model: exit 2"
expect_grep "^\[rank 0\] dtrain: error: trainer: rank 0 ran out of memory allocating the model's weights, gradients and optimizer state \(std::bad_alloc\): this worker needs about 2.1 GiB \(weights, gradients, optimizer state and their host copies 2.1 GiB\), its address space is limited to 684 MiB \(ulimit -v\), [0-9.]+ [MG]iB available on this host; /trainer/model/layers: use smaller layers \(now 1024-10000-10000-10: 110.4 M parameters, 421 MiB per copy\), or pipeline stages" "$T/err" "out of memory for the model: what, the numbers and the fix"
expect_eq "$(jq_ "$T/s5.json" "(d['restarts'], d['exit_code'], 'ran out of memory allocating the model' in d['error'])")" "(0, 2, True)" "out of memory for the model: not restarted, the summary says why"
cat >"$T/oom_batch.json" <<'JSON'
{"nproc_per_node": 1, "max_restarts": 2, "env": {"OMP_NUM_THREADS": "1"}, "trainer": {"device": "cpu", "model": {"layers": [4096, 16, 10]},
 "data": {"type": "synthetic", "train_samples": 40000, "eval_samples": 10}, "batch_size": 32768}}
JSON
(ulimit -v 700000; "$DTRAIN" run "$T/oom_batch.json" >"$T/out" 2>"$T/err"); expect_eq "$?" 2 "out of memory for the batch: exit 2"
expect_grep "^\[rank 0\] dtrain: error: trainer: rank 0 ran out of memory allocating the activations and buffers of a batch of 32768 samples \(std::bad_alloc\): this worker needs about [0-9.]+ GiB \(activations and batch buffers [0-9.]+ GiB\), its address space is limited to 684 MiB \(ulimit -v\), .*; /trainer/batch_size: use a smaller batch_size \(now 32768\)$" "$T/err" "out of memory for the batch: names batch_size"
# The pipeline trainer: the first stage holds the inputs.
cat >"$T/oom_pipe.json" <<'JSON'
{"nproc_per_node": 2, "env": {"OMP_NUM_THREADS": "1"}, "trainer": {"device": "cpu", "model": {"layers": [4096, 16, 16, 10]},
 "data": {"type": "synthetic", "train_samples": 40000, "eval_samples": 10}, "batch_size": 32768, "parallel": {"pipeline_stages": 2}}}
JSON
(ulimit -v 700000; "$DTRAIN" run "$T/oom_pipe.json" >"$T/out" 2>"$T/err"); expect_eq "$?" 2 "pipeline out of memory: exit 2"
expect_grep "^\[rank 0\] dtrain: error: trainer: rank 0 ran out of memory allocating the activations and buffers of a batch of 32768 samples \(micro-batches of 16384\) \(std::bad_alloc\): .*; /trainer/batch_size: use a smaller batch_size \(now 32768\) or fewer workers per host \(nproc_per_node 2\)$" "$T/err" "pipeline out of memory: names batch_size"
grep -q "error: std::bad_alloc" "$T/err" && fail "a bare std::bad_alloc: $(grep bad_alloc "$T/err")" || pass "no bare std::bad_alloc"
unset DTRAIN_MEMORY_CHECK
finish
