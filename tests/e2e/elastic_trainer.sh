# Fault injection on the built-in trainer (4 workers, checkpoints every 4 steps): a worker
# SIGKILLed at a seeded random step costs exactly one restart, the job resumes from the newest
# checkpoint and ends bit-identical to an uninterrupted run, and the samples it trained on
# (debug sample log) are exactly the uninterrupted run's: none skipped, none seen twice.
# Then SIGKILL during checkpoint writes, many times: a resume never loads a torn file.
source "$(dirname "$0")/lib.sh"
spec() {  # spec DIR EXTRA-TOP-LEVEL-KEYS EXTRA-CHECKPOINT-KEYS
  cat > "$1/job.json" <<JSON
{"name": "ft", "nproc_per_node": 4, "max_restarts": 1, "restart_backoff_s": 0, "worker_timeout_s": 30 ${2:-},
 "trainer": {"model": {"layers": [16, 32, 4]}, "data": {"type": "synthetic", "train_samples": 2560, "eval_samples": 256, "seed": 5},
  "batch_size": 16, "epochs": 2, "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9}, "log_every_steps": 1000,
  "checkpoint": {"dir": "$1/ckpt", "every_steps": 4 ${3:-}}}}
JSON
}
hash_of() { grep -o '"weights_sha256": *"[0-9a-f]*"' "$1" | grep -o '[0-9a-f]\{64\}'; }

mkdir -p "$T/ref"; spec "$T/ref"
DTRAIN_DEBUG_SAMPLE_LOG="$T/ref/samples" "$DTRAIN" run "$T/ref/job.json" --summary-json "$T/ref/sum.json" >"$T/ref/out" 2>&1
expect_eq "$?" 0 "uninterrupted run"
REF=$(hash_of "$T/ref/sum.json")
[ -n "$REF" ] || fail "no weights hash in the reference summary"

trial() {  # trial NAME RANK STEP [EXTRA-CHECKPOINT-KEYS]
  local trial="$1" rank="$2" step="$3" d="$T/t$1"
  mkdir -p "$d"; spec "$d" "" "${4:-}"
  DTRAIN_DEBUG_KILL_AT="$rank:$step" DTRAIN_DEBUG_SAMPLE_LOG="$d/samples" \
    "$DTRAIN" run "$d/job.json" --summary-json "$d/sum.json" >"$d/out" 2>&1
  expect_eq "$?" 0 "trial $trial (rank $rank killed at step $step): the job completes"
  expect_grep "event restart \(round 1\) host .* rank $rank: rank $rank killed by SIGKILL; restart 1 of 1" "$d/out" "trial $trial: one restart, naming the rank"
  expect_eq "$(hash_of "$d/sum.json")" "$REF" "trial $trial: final weights equal the uninterrupted run's"
  # Samples: what attempt 0 trained on before the checkpoint the resume started from, plus
  # everything attempt 1 trained on, is exactly the uninterrupted run's multiset.
  python3 - "$T/ref/samples" "$d/samples" <<'PY' && pass "trial $trial: every sample once, none skipped" || fail "trial $trial: sample accounting differs"
import collections, glob, sys
ref_prefix, prefix = sys.argv[1], sys.argv[2]
def load(pattern):
    out = []
    for f in glob.glob(pattern):
        for line in open(f):
            w = line.split()
            out.append((int(w[0]), int(w[1]), [int(x) for x in w[2:]]))
    return out
ref = collections.Counter((e, s) for _, e, ss in load(ref_prefix + ".*.0") for s in ss)
second = load(prefix + ".*.1")
resume = min(step for step, _, _ in second)
first = [(e, s) for step, e, ss in load(prefix + ".*.0") if step < resume for s in ss]
got = collections.Counter(first) + collections.Counter((e, s) for _, e, ss in second for s in ss)
if got != ref or max(got.values()) != 1:
    print(f"resume at step {resume}: {sum(got.values())} samples vs {sum(ref.values())} expected", file=sys.stderr)
    sys.exit(1)
PY
}
RANDOM=20261202  # seeded: the same steps and ranks on every run of this test
for t in 1 2 3; do
  step=$(( 2 + RANDOM % 75 )); rank=$(( RANDOM % 4 ))  # 80 steps in all
  trial "$t" "$rank" "$step"
done
# checkpoint.async: rank 0, the writer, killed as step 9 begins, with step 8's checkpoint half
# written (each write of its bytes slowed by 100 ms; the step-4 one was waited for at step 8):
# the resume is from step 4, the torn file is never loaded nor left behind, the end the same.
DTRAIN_DEBUG_CHECKPOINT_DELAY_MS=100 trial async 0 9 ', "async": true'
expect_grep "resuming from $T/tasync/ckpt/ckpt-0000000004.bin" "$T/tasync/out" "async: resumed from the last complete checkpoint, not the one in flight"
[ -z "$(find "$T/tasync/ckpt" -name '*.tmp')" ] && pass "async: no temporary file left at the end" || fail "async: $(ls "$T/tasync/ckpt")"

# SIGKILL while checkpoints are being written (every step), 8 times at random moments; each
# time the next run resumes from an intact checkpoint, and the end is bit-identical.
d="$T/torn"; mkdir -p "$d"; spec "$d"
sed -i 's/"every_steps": 4/"every_steps": 1/; s/"nproc_per_node": 4/"nproc_per_node": 1/' "$d/job.json"
cp "$d/job.json" "$d/ref.json"; sed -i "s|$d/ckpt|$d/refckpt|" "$d/ref.json"
"$DTRAIN" run "$d/ref.json" --summary-json "$d/ref.sum" >/dev/null 2>&1
for i in $(seq 8); do
  "$DTRAIN" run "$d/job.json" >/dev/null 2>&1 &
  DTRAIN_PID=$!
  sleep "0.$(( 2 + RANDOM % 7 ))"
  kill -9 "$DTRAIN_PID" 2>/dev/null; wait "$DTRAIN_PID" 2>/dev/null; DTRAIN_PID=
done
"$DTRAIN" run "$d/job.json" --summary-json "$d/sum.json" >"$d/out" 2>&1
expect_eq "$?" 0 "resume after 8 kills during checkpoint writes"
expect_eq "$(hash_of "$d/sum.json")" "$(hash_of "$d/ref.sum")" "bit-identical to the uninterrupted run"
# A trainer that can restart without a checkpoint dir would start over at each restart: said.
printf '{"max_restarts": 2, "trainer": {"model": {"layers": [4, 3]}, "max_steps": 2}}\n' > "$T/nock.json"
"$DTRAIN" validate "$T/nock.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "restartable trainer without a checkpoint dir: valid"
expect_grep "^dtrain: warning: $T/nock.json: /trainer/checkpoint/dir is not set, so every restart \(max_restarts 2\) starts the training over from step 0" "$T/err" "restartable trainer without a checkpoint dir: warned"
"$DTRAIN" validate --hosts localhost:1,127.0.0.1:1 --nnodes 1:2 "$T/nock.json" >"$T/out" 2>"$T/err"
expect_grep "max_restarts 2, and a node joining or lost between min_nodes 1 and max_nodes 2\) starts the training over" "$T/err" "elastic trainer without a checkpoint dir: the node range named"
# The first hostfile node lost: the node that runs rank 0 from then on takes the checkpoint
# directory's lock (before: none held it, and a second job on the directory was let in, the
# two removing each other's temporary files).
cat > "$T/lk.json" <<JSON
{"name": "lk", "max_restarts": 2, "min_nodes": 1, "restart_backoff_s": 0.5, "shutdown_timeout_s": 5,
 "env": {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [16, 64, 4]}, "data": {"type": "synthetic", "train_samples": 4096, "eval_samples": 128},
  "batch_size": 16, "epochs": 2000, "log_every_steps": 64, "checkpoint": {"dir": "$T/lk-ck", "every_steps": 64}}}
JSON
timeout -k 5 120 "$DTRAIN" run "$T/lk.json" --hosts localhost:1,127.0.0.1:1 >"$T/lk.out" 2>"$T/lk.err" &
DTRAIN_PID=$!
for _ in $(seq 300); do grep -q "step 640/" "$T/lk.out" 2>/dev/null && break; sleep 0.1; done
kill -9 "$(pgrep -f "^$DTRAIN agent .*--node localhost( |$)" | head -1)"
for _ in $(seq 300); do grep -q "^\[127.0.0.1 rank 0\] resuming" "$T/lk.out" 2>/dev/null && break; sleep 0.1; done
"$DTRAIN" run "$T/lk.json" --nproc-per-node 1 >"$T/lk2.out" 2>&1; rc=$?
# ... and the first host, tried again, joins (its agent no longer waits for the lock at its
# start, which the other node held for this very job: it took it at its round's start).
for _ in $(seq 300); do grep -q "event node_joined .* host localhost" "$T/lk.err" 2>/dev/null && break; sleep 0.1; done
expect_grep "event node_joined .* host localhost" "$T/lk.err" "first node lost: it comes back and joins"
expect_no_grep "did not come back" "$T/lk.err" "first node lost: its return is not refused for the lock"
kill -INT "$DTRAIN_PID"; wait "$DTRAIN_PID"; DTRAIN_PID=
expect_eq "$rc" 2 "first node lost: a second job on the checkpoint directory is refused"
expect_grep "/trainer/checkpoint/dir: \"$T/lk-ck\" is in use by another dtrain job" "$T/lk2.out" "first node lost: the new rank 0's node holds the lock"
finish
