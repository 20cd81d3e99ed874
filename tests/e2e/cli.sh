# The command line: dry-run plan, validate, ad-hoc mode, flags, usage errors.
source "$(dirname "$0")/lib.sh"
"$DTRAIN" --help >"$T/out" 2>&1; expect_eq "$?" 0 "--help exits 0"
expect_grep "run" "$T/out" "help lists run"
"$DTRAIN" --version >"$T/out" 2>&1; expect_eq "$?" 0 "--version exits 0"
expect_grep "^dtrain [0-9]+\.[0-9]+\.[0-9]+ \((CPU|CUDA/NCCL) build, store protocol [0-9]+\)$" "$T/out" "version line (release, build, store protocol)"
"$DTRAIN" run --bogus-flag x.json >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "unknown flag exits 2"
expect_grep "^dtrain: error: .*bogus" "$T/err" "unknown flag named"
"$DTRAIN" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "no subcommand exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: a command is missing; the commands are run, validate, store, bench, train; see dtrain --help" "no subcommand: the commands listed"
"$DTRAIN" store >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "store alone exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: store: a command is missing; the commands are serve, set, get, add, wait, check, delete; see dtrain store --help" "store alone: its commands listed"
"$DTRAIN" bench >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "bench alone exits 2"
expect_grep "^dtrain: error: bench: a command is missing; the commands are allreduce, broadcast, allgather, sendrecv; see dtrain bench --help$" "$T/err" "bench alone: its commands listed"
"$DTRAIN" run >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "nothing to run exits 2"
expect_grep "nothing to run" "$T/err" "nothing to run message"
"$DTRAIN" run "$SRC/configs/env_dump.json" -- true 2>"$T/err"; expect_eq "$?" 2 "spec and command exits 2"
"$DTRAIN" run --nproc-per-node -3 -- true 2>"$T/err"; expect_eq "$?" 2 "bad --nproc-per-node exits 2"
expect_grep "^dtrain: error: --nproc-per-node: expected a worker count between 1 and 4096 or \"auto\", got \"-3\"$" "$T/err" "bad --nproc-per-node message"
"$DTRAIN" run --nproc-per-node 5000 -- true 2>"$T/err"; expect_eq "$?" 2 "--nproc-per-node 5000 exits 2"
expect_grep "^dtrain: error: --nproc-per-node: expected a worker count between 1 and 4096 or \"auto\", got \"5000\"$" "$T/err" "--nproc-per-node range stated"
env -u NOEQUALS "$DTRAIN" run --env NOEQUALS --nproc-per-node 1 -- true 2>"$T/err"; expect_eq "$?" 2 "--env NAME unset exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: --env: NOEQUALS is not set in dtrain's environment, so there is no value to pass on; set it before dtrain run (export NOEQUALS=...), or give --env NOEQUALS=VALUE" "--env NAME unset: named, with the fix"
"$DTRAIN" run --env =x --nproc-per-node 1 -- true 2>"$T/err"; expect_eq "$?" 2 "--env =x exits 2"
expect_grep "--env: expected KEY=VALUE \(or a NAME, for dtrain's own value of it\), got \"=x\"" "$T/err" "bad --env message"
# --env NAME (mpirun's -x NAME): the launcher's value, to local and remote workers alike.
FROM_LAUNCHER="a b=c" "$DTRAIN" run --env FROM_LAUNCHER --nproc-per-node 1 -- sh -c 'echo "got=$FROM_LAUNCHER"' >"$T/out" 2>"$T/err"
expect_eq "$(cat "$T/out")" "[rank 0] got=a b=c" "--env NAME: the launcher's value"
FROM_LAUNCHER=v1 "$DTRAIN" validate --hosts gpu-a:2,gpu-b:2 --env FROM_LAUNCHER -- true >"$T/out" 2>"$T/err"
expect_grep "^env: +FROM_LAUNCHER=v1$" "$T/out" "--env NAME: in the job's env (what remote workers get)"
"$DTRAIN" run --help >"$T/out" 2>&1
expect_grep "or NAME alone for dtrain's own value of NAME" "$T/out" "--help: --env NAME explained"
"$DTRAIN" run --env 1A=x --nproc-per-node 1 -- true 2>"$T/err"; expect_eq "$?" 2 "--env 1A=x exits 2"
expect_grep "^dtrain: error: --env: bad variable name \"1A\"; names are letters, digits and '_', not starting with a digit$" "$T/err" "--env name rule"
"$DTRAIN" run --max-restarts x --nproc-per-node 1 -- true 2>"$T/err"; expect_eq "$?" 2 "bad --max-restarts exits 2"
"$DTRAIN" run --max-restarts 99999999999 --nproc-per-node 1 -- true 2>"$T/err"; expect_eq "$?" 2 "huge --max-restarts exits 2"
expect_grep "^dtrain: error: --max-restarts: expected an integer between 0 and 1000000, got \"99999999999\"$" "$T/err" "--max-restarts range stated"
"$DTRAIN" run --local-ranks-filter 5 --nproc-per-node 2 -- true 2>"$T/err"; expect_eq "$?" 2 "filter out of range exits 2"

# Dry run: the plan table, nothing started.
"$DTRAIN" run --dry-run --nproc-per-node 3 -- sh -c "touch $T/ran" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "dry run exits 0"
[ -e "$T/ran" ] && fail "dry run ran the command" || pass "dry run ran nothing"
expect_grep "^host +node_rank +local_rank +global_rank +device +command$" "$T/out" "plan header"
expect_grep "^$(hostname) +0 +2 +2 +(cpu|cuda:[0-9]+) +sh -c 'touch " "$T/out" "plan row for rank 2"
expect_eq "$(grep -c "^$(hostname) " "$T/out")" 3 "3 plan rows"

# Spec file with overrides; validate prints the resolved spec.
"$DTRAIN" validate "$SRC/configs/env_dump.json" --nproc-per-node 5 --env A=B >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "validate exits 0"
expect_grep "env_dump.json: OK" "$T/out" "validate OK"
expect_grep "^nproc_per_node: +5$" "$T/out" "override applied"
expect_grep "^env: +A=B$" "$T/out" "--env shown"
# ... but not a credential's value (validate's output lands in CI logs; security audit).
"$DTRAIN" validate "$SRC/configs/env_dump.json" --env HF_TOKEN=hf_secret_abc --env WANDB_API_KEY=k123 >"$T/out" 2>"$T/err"
expect_grep "^env: +HF_TOKEN=\(hidden: 13 characters\)$" "$T/out" "validate hides a token's value"
expect_grep "^env: +WANDB_API_KEY=\(hidden: 4 characters\)$" "$T/out" "validate hides an API key's value"
grep -q "hf_secret_abc\|k123" "$T/out" "$T/err" && fail "validate printed a secret" || pass "no secret value printed"
# ... nor a value in a credential's format under an innocuous name, nor a URL's password
# (the rest of the URL is shown).
"$DTRAIN" validate "$SRC/configs/env_dump.json" --env HUB=hf_abcdefghijklmnopqrstuvwx --env GH=ghp_0123456789abcdefghij0123 \
  --env AWS_ID=AKIAIOSFODNN7EXAMPLE --env TRACKING=https://alice:s3cr3t-pw@mlflow.example.com:5000/api \
  --env DATA=/data/imagenet --env SHA=0123456789abcdef0123456789abcdef >"$T/out" 2>"$T/err"
expect_grep "^env: +HUB=\(hidden: 27 characters, a credential's format\)$" "$T/out" "validate hides a Hugging Face token under any name"
expect_grep "^env: +GH=\(hidden: 28 characters, a credential's format\)$" "$T/out" "validate hides a GitHub token under any name"
expect_grep "^env: +AWS_ID=\(hidden: 20 characters, a credential's format\)$" "$T/out" "validate hides an AWS access key id"
expect_grep "^env: +TRACKING=https://alice:\(hidden\)@mlflow.example.com:5000/api$" "$T/out" "validate hides a URL's password, shows the rest"
expect_grep "^env: +DATA=/data/imagenet$" "$T/out" "a path is shown"
expect_grep "^env: +SHA=0123456789abcdef0123456789abcdef$" "$T/out" "a hash is shown (nothing hidden by entropy alone)"
grep -q "s3cr3t\|hf_abc\|ghp_0123\|AKIAIOSF" "$T/out" "$T/err" && fail "validate printed a secret value" || pass "no credential-format value printed"
# Credentials given as arguments are hidden the same way; the rest of the command is shown.
touch "$T/train.py"; cd "$T"
"$DTRAIN" validate -- python3 train.py --token=ghp_abcdefghijklmnopqrstuvwxyz https://a:pw@db.example.com/x \
  --api-key s3cr3t --key-file /keys/k hf_abcdefghijklmnopqrstuvwxyz0123 --lr 0.1 >"$T/out" 2>"$T/err"
expect_eq "$(grep '^command:' "$T/out")" "command:            python3 train.py --token=(hidden: 30 characters) https://a:(hidden)@db.example.com/x --api-key (hidden: 6 characters) --key-file /keys/k (hidden: 33 characters, a credential's format) --lr 0.1" \
  "validate hides credentials in the command's arguments, shows the rest"
# ... and so does the --dry-run plan (also a pre-launch check whose output lands in CI logs).
"$DTRAIN" run --dry-run -- python3 train.py --token=ghp_abcdefghijklmnopqrstuvwxyz https://a:pw@db.example.com/x \
  --api-key s3cr3t --lr 0.1 >"$T/out" 2>"$T/err"
expect_grep " python3 train.py --token=\(hidden: 30 characters\) https://a:\(hidden\)@db.example.com/x --api-key \(hidden: 6 characters\) --lr 0.1$" "$T/out" "the --dry-run plan hides credentials in the command"
grep -q "s3cr3t\|ghp_abc\|a:pw@" "$T/out" "$T/err" && fail "--dry-run printed a secret" || pass "--dry-run printed no secret"
cd - >/dev/null
# python's script missing: said before any worker starts (each would exit 2, "can't open
# file"), by run, --dry-run and validate, naming the spec's field.
"$DTRAIN" run -- python3 -u "$T/none.py" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "python3's script missing: exit 2"
expect_eq "$(cat "$T/err")" "dtrain: error: the command after --: python3's script \"$T/none.py\" does not exist; check the path" "python3's script missing: named"
printf '{"command": ["python3", "-W", "ignore", "none.py"], "cwd": "%s"}' "$T" >"$T/nopy.json"
"$DTRAIN" validate "$T/nopy.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a spec's python3 script missing: validate exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: $T/nopy.json: /command/3: python3's script \"none.py\" does not exist (relative to $T); check the path" "a spec's python3 script missing: the field and the directory"
"$DTRAIN" run -- python3 -c 'print(6 * 7)' >"$T/out" 2>"$T/err"; expect_eq "$(cat "$T/out")" "[rank 0] 42" "python3 -c: no script looked for"
printf '#!/bin/sh\necho "args: $*"\n' >"$T/python_wrapper.sh"; chmod +x "$T/python_wrapper.sh"
"$DTRAIN" run -- "$T/python_wrapper.sh" train >"$T/out" 2>"$T/err"; expect_eq "$(cat "$T/out")" "[rank 0] args: train" "a program named python*: its first word is no script"
"$DTRAIN" run <(echo '{"command": ["true"]}') -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a spec as <(...) and a command: exit 2"
expect_grep "^dtrain: error: give either a job spec file \(/dev/fd/[0-9]+\) or a command after --, not both$" "$T/err" "a spec as <(...) and a command: not called a stray word"
"$DTRAIN" validate --nproc-per-node auto "$SRC/configs/env_dump.json" >"$T/out"
expect_grep "^nproc_per_node: +[0-9]+ \(auto\)$" "$T/out" "auto resolved"
# auto without GPUs = usable CPU cores (CUDA_VISIBLE_DEVICES hides any).
CUDA_VISIBLE_DEVICES= "$DTRAIN" validate --nproc-per-node auto "$SRC/configs/env_dump.json" >"$T/out"
expect_grep "^nproc_per_node: +$(nproc) \(auto\)$" "$T/out" "auto = CPU cores without visible GPUs"

# A rendezvous port already in use: exit 2 naming the field and the fix.
python3 -c "
import socket, subprocess, json, sys
s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); port = s.getsockname()[1]
open('$T/busy.json', 'w').write(json.dumps({'command': ['true'], 'rendezvous': {'port': port}}))
r = subprocess.run(['$DTRAIN', 'run', '$T/busy.json'], capture_output=True, text=True)
print(r.returncode, 'Address already in use; choose a free port, or 0 for any' in r.stderr and '/rendezvous/port' in r.stderr)" >"$T/check"
expect_eq "$(cat "$T/check")" "2 True" "busy rendezvous port refused with the fix"

# OpenBLAS (and its thread pool) is loaded only by CPU trainer workers, on their first GEMM:
# not by the launcher, agents or `dtrain --version` (the multi-node pre-flight).
n=$(LD_DEBUG=libs "$DTRAIN" --version 2>&1 | grep -c 'openblas')
expect_eq "$n" 0 "dtrain --version does not load OpenBLAS"
# Every example config validates.
for c in "$SRC"/configs/*.json; do
  (cd "$SRC" && "$DTRAIN" validate "$c" >/dev/null 2>"$T/err") && pass "$(basename "$c") validates" || fail "$(basename "$c"): $(cat "$T/err")"
done
# Ad-hoc mode passes the worker's own flags through untouched.
"$DTRAIN" run --nproc-per-node 1 -- sh -c 'echo "$@"' sh --lr 0.1 --help >"$T/out" 2>&1
expect_eq "$(cat "$T/out")" "[rank 0] --lr 0.1 --help" "worker flags after -- untouched"

# torchrun habits and typos get the fix, exit 2, and nothing runs.
echo 'print("ran")' > "$T/train.py"
"$DTRAIN" run --nproc-per-node 2 "$T/train.py" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a script as the spec exits 2"
expect_grep "invalid JSON.*job specs are JSON files: to run a program, put its command after --, e.g. dtrain run --nproc-per-node 2 -- python3 $T/train.py$" "$T/err" "a script as the spec: how to run it"
# Only a .py gets python3 in the fix; another script gets the ./ it needs (not on PATH).
printf '#!/bin/sh\nenv\n' > "$T/env.sh"; chmod +x "$T/env.sh"
(cd "$T" && "$DTRAIN" run ./env.sh >"$T/out" 2>"$T/err"); expect_eq "$?" 2 "a shell script as the spec exits 2"
expect_grep "job specs are JSON files: to run a program, put its command after --, e.g. dtrain run --nproc-per-node 2 -- ./env.sh$" "$T/err" "a shell script as the spec: -- ./env.sh, no python3"
(cd "$T" && "$DTRAIN" run env.sh >"$T/out" 2>"$T/err")
expect_grep "e.g. dtrain run --nproc-per-node 2 -- ./env.sh$" "$T/err" "a script named without ./: the fix has it"
(cd "$T" && "$DTRAIN" run env.sh x >"$T/out" 2>"$T/err")
expect_eq "$(cat "$T/err")" "dtrain: error: run: unexpected arguments \"env.sh x\"; to run a program, put its command after --: dtrain run [options] -- ./env.sh x" "a script without --: the same fix"
"$DTRAIN" run --nproc-per-node 1 python3 "$T/train.py" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a command without -- exits 2"
expect_grep "^dtrain: error: run: unexpected arguments \"python3 $T/train.py\"; to run a program, put its command after --: dtrain run \[options\] -- python3 $T/train.py$" "$T/err" "a command without --: the fix, in order"
expect_eq "$(cat "$T/out")" "" "nothing ran"
# torchrun's `torchrun train.py x`: the fix already has the python3 dtrain would ask for next.
"$DTRAIN" run --nproc_per_node=2 "$T/train.py" x >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a script without -- exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: run: unexpected arguments \"$T/train.py x\"; to run a program, put its command after --: dtrain run [options] -- python3 $T/train.py x" "a script without --: the fix runs it with python3"
# The script's own option right after it (before: "unknown option --lr; see dtrain run --help").
"$DTRAIN" run --nproc_per_node 2 "$T/train.py" --lr 0.1 >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a script and its option without -- exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: run: unexpected arguments \"$T/train.py --lr 0.1\"; to run a program, put its command after --: dtrain run [options] -- python3 $T/train.py --lr 0.1" "a script and its option without --: the fix keeps the option"
# torchrun's options that dtrain does not take: what to do instead, never the value taken
# for a spec ("unexpected arguments \"29501 --master_port\"" before).
"$DTRAIN" run --nproc_per_node 2 --master_port 29501 -- python3 "$T/train.py" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "torchrun's --master_port exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: run: --master_port is a torchrun option; dtrain picks a free port itself; to fix the port workers see, use --env MASTER_PORT=N" "--master_port: what to do instead"
"$DTRAIN" run --master_addr=10.0.0.1 -- python3 "$T/train.py" >"$T/out" 2>"$T/err"
expect_eq "$(cat "$T/err")" "dtrain: error: run: --master_addr is a torchrun option; dtrain sets MASTER_ADDR itself (127.0.0.1 on one node, else node 0's address); to give workers another address, use --env MASTER_ADDR=ADDR (or rendezvous.master_addr in a multi-node spec)" "--master_addr: the address's equivalent, not the port's"
"$DTRAIN" run --local_addr 10.0.0.1 -- python3 "$T/train.py" >"$T/out" 2>"$T/err"
expect_grep "^dtrain: error: run: --local_addr is a torchrun option; .*address=IP on its hostfile line$" "$T/err" "--local_addr: how to give a node's address"
for f in "--standalone" "--node_rank 1" "--rdzv-endpoint h1:29400" "-m pkg.mod" "--tee 3" "--no_python"; do
  "$DTRAIN" run $f -- python3 "$T/train.py" >"$T/out" 2>"$T/err"
  expect_eq "$?" 2 "torchrun's $f exits 2"
  expect_grep "^dtrain: error: run: ${f%% *} is a torchrun option; " "$T/err" "torchrun's $f: named, with what to do"
done
"$DTRAIN" run --nproc-per-node 1 python3 "$T/train.py" --epochs 3 -t 4 >"$T/out" 2>"$T/err"
expect_grep "^dtrain: error: run: unexpected arguments \"python3 $T/train.py --epochs 3 -t 4\"; to run a program, put its command after --" "$T/err" "a command without -- keeps its own options (not taken for dtrain's)"
"$DTRAIN" run --frob 3 -- python3 "$T/train.py" >"$T/out" 2>"$T/err"
expect_eq "$(cat "$T/err")" "dtrain: error: run: unknown option --frob; see dtrain run --help" "an unknown option with a value: the option, not its value"
# mpirun's, horovodrun's and the DeepSpeed launcher's options: the dtrain equivalent, exit 2,
# under run and validate alike (-hostfile was read by CLI11 as -h: help, exit 0).
while IFS='|' read -r f launcher fix; do
  for verb in run validate; do
    "$DTRAIN" $verb $f -- true >"$T/out" 2>"$T/err"; rc=$?
    expect_eq "$rc" 2 "$verb $f exits 2"
    expect_grep "^dtrain: error: $verb: ${f%% *} is $launcher.*; .*$fix" "$T/err" "$verb $f: the dtrain equivalent"
    expect_eq "$(wc -l < "$T/err")" 1 "$verb $f: one line"
  done
done <<'EOF_FLAGS'
-np 4|an mpirun/horovodrun option \(the total number of processes\)|--nproc-per-node N on one host
--np 4|an mpirun/horovodrun option|--hosts h1:2,h2:2 or slots=N in a --hostfile
-n 4|an mpirun/horovodrun option|--nproc-per-node N
--num-proc 4|an mpirun/horovodrun option|--nproc-per-node N
--nproc 4|an mpirun/horovodrun option|--nproc-per-node N
-H h1:2,h2:2|an mpirun/horovodrun option|--hosts h1:2,h2:2
-host h1,h2|an mpirun/horovodrun option|--hosts h1:2,h2:2
-x NCCL_DEBUG|an mpirun option|--env KEY=VALUE, or --env NAME
-hostfile hosts|an mpirun option|dtrain's is --hostfile FILE
--output-filename out|an mpirun option|--log-dir DIR
--tag-output|an mpirun option|--no-prefix turns that off
--num_gpus 2|a DeepSpeed launcher option|--nproc-per-node N
--num-gpus 2|a DeepSpeed launcher option|--nproc-per-node N
--num_nodes 2|a DeepSpeed launcher option|--nnodes MIN:MAX
--include localhost:1,3|a DeepSpeed launcher option|gpus=0,1 on its hostfile line
--exclude h2|a DeepSpeed launcher option|list only the hosts to use
EOF_FLAGS
"$DTRAIN" run --np 2 -- true >"$T/out" 2>"$T/err"
grep -q "did you mean" "$T/err" && fail "--np: a did-you-mean instead of the equivalent: $(cat "$T/err")" || pass "--np: no misleading did-you-mean"
"$DTRAIN" runn "$SRC/configs/env_dump.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "misspelt command exits 2"
expect_grep "^dtrain: error: dtrain: unknown command \"runn\" \(did you mean \"run\"\?\); the commands are run, validate, store, bench, train$" "$T/err" "misspelt command: did you mean"
"$DTRAIN" store frob >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "misspelt store verb exits 2"
expect_grep "dtrain store: unknown command \"frob\"; the commands are serve, set, get, add" "$T/err" "store verbs listed"
"$DTRAIN" --verison >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "misspelt --version exits 2"
expect_grep "unknown option --verison \(did you mean --version\?\)" "$T/err" "did you mean --version"
# --env takes one value: the spec after it stays the spec.
"$DTRAIN" run --env A=1 "$SRC/configs/env_dump.json" --dry-run >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "--env before the spec"
# Outputs are checked before anything starts.
"$DTRAIN" run --nproc-per-node 1 --summary-json "$T/no/such/dir/s.json" -- touch "$T/ran2" >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "--summary-json in a missing directory exits 2"
expect_grep "^dtrain: error: --summary-json: .*directory .*/no/such/dir does not exist" "$T/err" "--summary-json: missing directory named"
[ -e "$T/ran2" ] && fail "the job ran before its summary path was checked" || pass "nothing ran"
"$DTRAIN" run --nproc-per-node 1 --summary-json "$T/s.json" -- true 2>"$T/err"; expect_eq "$?" 0 "--summary-json, first run"
"$DTRAIN" run --nproc-per-node 1 --summary-json "$T/s.json" -- true 2>"$T/err"; expect_eq "$?" 0 "--summary-json replaces an existing summary"
"$DTRAIN" run --nproc-per-node 1 --summary-json "$T" -- true 2>"$T/err"; expect_eq "$?" 2 "--summary-json a directory exits 2"
expect_grep "is a directory; give a file path" "$T/err" "--summary-json directory message"
"$DTRAIN" run --nproc-per-node 1 --log-dir /etc/passwd/x -- true 2>"$T/err"; expect_eq "$?" 2 "--log-dir under a file exits 2"
expect_grep "^dtrain: error: --log-dir: \"/etc/passwd/x\" cannot be created: /etc/passwd is not a directory" "$T/err" "--log-dir under a file explained"
"$DTRAIN" validate "$SRC/configs/env_dump.json" --log-dir /etc/passwd/x 2>"$T/err"; expect_eq "$?" 2 "validate checks the log dir"
# CLI11's own words ("1 required TEXT missing", "At Most 1 required but received 2") are
# said with the option and the fix.
"$DTRAIN" run --nproc_per_node= -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "--nproc_per_node= exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: --nproc-per-node: the value is empty (an unset variable?); give a value or leave the option out" "--nproc_per_node=: the value is empty"
"$DTRAIN" run --max-restarts >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "--max-restarts without a value exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: --max-restarts: no value given; give one (--max-restarts VALUE or --max-restarts=VALUE), or leave the option out" "an option without a value: named, with the fix"
"$DTRAIN" run --nproc_per_node 2 --nproc-per-node 3 -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "an option given twice exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: --nproc-per-node: given 2 times (as --nproc_per_node and --nproc-per-node, one option); it takes one value: give it once" "an option given twice: named, with the fix"
# An empty value (an unset shell variable) is not "option not given".
for opt in --summary-json --hosts --log-dir; do
  "$DTRAIN" run --nproc-per-node 1 "$opt" "" -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "$opt \"\" exits 2"
  expect_grep "^dtrain: error: $opt: the value is empty" "$T/err" "$opt \"\" explained"
done
# A directory is not a program, and is said to be one (not "no such file").
"$DTRAIN" run -- /etc 2>"$T/err"; expect_eq "$?" 2 "run -- /etc exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: the command after --: cannot run \"/etc\": it is a directory, not a program; give the program's path" "a directory named as such"
# Values from flags are blamed on the flag, not on the JSON path they set.
"$DTRAIN" run --local-ranks-filter 5 -- true 2>"$T/err"; expect_eq "$?" 2 "--local-ranks-filter 5 exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: --local-ranks-filter: local rank 5 does not exist with nproc_per_node 1; use ranks 0..0" "--local-ranks-filter named"
"$DTRAIN" run --nnodes 3 --hosts localhost,127.0.0.1 --dry-run -- true 2>"$T/err"; expect_eq "$?" 2 "--nnodes above the hosts exits 2"
expect_grep "^dtrain: error: --nnodes: 3 node\(s\) asked for but 2 host\(s\) given; .* or lower --nnodes$" "$T/err" "--nnodes named (above the hosts)"
"$DTRAIN" run --nnodes 1 --hosts localhost,127.0.0.1 --dry-run -- true 2>"$T/err"; expect_eq "$?" 2 "--nnodes below the hosts exits 2"
expect_grep "^dtrain: error: --nnodes: 1 node\(s\) at most, but 2 host\(s\) given, .* or raise --nnodes to 2$" "$T/err" "--nnodes named (below the hosts)"
"$DTRAIN" validate "$SRC/tests/spec/bad/console_ranks_contradiction.json" --local-ranks-filter 0 >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "--local-ranks-filter replaces the spec's console_ranks"
# A job from the command line alone forwards what a spec file does (env_forward's default
# lives in one place), and --env-forward adds to it.
"$DTRAIN" validate --hosts gpu-a:2,gpu-b:2 -- "$T/env.sh" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "validate --hosts ... -- CMD"
expect_grep "^env_forward: +NCCL_ GLOO_ OMP_ OPENBLAS_ MKL_ PYTHON TORCH_ HF_ WANDB_$" "$T/out" "a command-line job forwards the default prefixes"
echo '{"command": ["true"]}' > "$T/plain.json"
"$DTRAIN" validate "$T/plain.json" --hosts gpu-a:2,gpu-b:2 >"$T/out2" 2>"$T/err"
expect_eq "$(grep '^env_forward:' "$T/out2")" "$(grep '^env_forward:' "$T/out")" "the same default as a spec file's"
"$DTRAIN" validate --hosts gpu-a:2,gpu-b:2 --env-forward MY_APP_ --env-forward NCCL_ -- "$T/env.sh" >"$T/out" 2>"$T/err"
expect_grep "^env_forward: +NCCL_ GLOO_ OMP_ OPENBLAS_ MKL_ PYTHON TORCH_ HF_ WANDB_ MY_APP_$" "$T/out" "--env-forward adds a prefix, once"
"$DTRAIN" validate --hosts gpu-a:2 --env-forward 1X -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "--env-forward 1X exits 2"
expect_grep "^dtrain: error: --env-forward: bad variable-name prefix \"1X\"" "$T/err" "--env-forward: bad prefix named"

# Worker identity variables are dtrain's: a job setting one is refused, naming where.
"$DTRAIN" run --env RANK=0 --nproc-per-node 2 -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "--env RANK=0 exits 2"
expect_grep "^dtrain: error: --env: RANK is set by dtrain for every worker \(each worker's global rank, from the job's layout\)" "$T/err" "--env RANK=0: refused, naming --env"
printf 'A=1\nexport WORLD_SIZE=8\n' > "$T/vars.env"
echo "{\"command\": [\"true\"], \"env_file\": \"$T/vars.env\"}" > "$T/envfile.json"
"$DTRAIN" run "$T/envfile.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "env_file WORLD_SIZE exits 2"
expect_grep "^dtrain: error: $T/vars.env:2: WORLD_SIZE is set by dtrain for every worker" "$T/err" "env_file: refused, naming file:line"
# MASTER_PORT/MASTER_ADDR may be chosen (torchrun's --master_port hint says how): one warning line.
"$DTRAIN" run --env MASTER_PORT=29517 --nproc-per-node 1 -- sh -c 'echo "port=$MASTER_PORT"' >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "--env MASTER_PORT runs"
expect_eq "$(cat "$T/out")" "[rank 0] port=29517" "--env MASTER_PORT reaches the worker"
expect_eq "$(grep -c '^dtrain: warning: --env: MASTER_PORT=29517 replaces the free port dtrain picks' "$T/err")" 1 "--env MASTER_PORT: one warning line"
# ... but it must be a port: an integer 1..65535, checked where it is given (it failed in
# every worker, after the launch), by validate too.
for bad in 99999 0 notaport " 80" 8O; do
  "$DTRAIN" run --env "MASTER_PORT=$bad" --nproc-per-node 1 -- touch "$T/ran-port" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "--env MASTER_PORT=$bad: exit 2"
  expect_eq "$(cat "$T/err")" "dtrain: error: --env: MASTER_PORT=\"$bad\": expected a port, an integer between 1 and 65535; give one, or leave MASTER_PORT out to get a free port picked by dtrain" "--env MASTER_PORT=$bad: named, with the fix"
  "$DTRAIN" validate --env "MASTER_PORT=$bad" -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "validate --env MASTER_PORT=$bad: exit 2"
done
[ -e "$T/ran-port" ] && fail "a bad MASTER_PORT ran" || pass "a bad MASTER_PORT ran nothing"
echo '{"command": ["true"], "env": {"MASTER_PORT": "notaport"}}' > "$T/port.json"
"$DTRAIN" validate "$T/port.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "spec env MASTER_PORT=notaport: exit 2"
expect_grep "^dtrain: error: $T/port.json: /env/MASTER_PORT: MASTER_PORT=\"notaport\": expected a port" "$T/err" "spec env MASTER_PORT: the field named"
printf 'MASTER_PORT=65536\n' > "$T/port.env"
echo "{\"command\": [\"true\"], \"env_file\": \"$T/port.env\"}" > "$T/portenv.json"
"$DTRAIN" validate "$T/portenv.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "env_file MASTER_PORT=65536: exit 2"
expect_grep "^dtrain: error: $T/port.env:1: MASTER_PORT=\"65536\": expected a port" "$T/err" "env_file MASTER_PORT: file:line named"
"$DTRAIN" validate --env MASTER_PORT=65535 -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "--env MASTER_PORT=65535 is a port"

# --nproc-per-node against a host's own slots: refused, not silently ignored.
"$DTRAIN" run --hosts localhost:2 --nproc-per-node 1 --dry-run -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "--hosts localhost:2 --nproc-per-node 1 exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: --nproc-per-node 1: host \"localhost\" (--hosts) has 2 slots, not 1; drop --nproc-per-node or the host's slots (hosts without slots run --nproc-per-node workers)" "--nproc-per-node vs slots: host, slots and flag named"
echo "localhost slots=2" > "$T/hosts"
"$DTRAIN" run --hostfile "$T/hosts" --nproc-per-node 1 --dry-run -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "--hostfile slots=2 --nproc-per-node 1 exits 2"
expect_grep "^dtrain: error: --nproc-per-node 1: host \"localhost\" \($T/hosts:1\) has 2 slots, not 1" "$T/err" "--nproc-per-node vs a hostfile line"
"$DTRAIN" run --hostfile "$T/hosts" --nproc-per-node 2 --dry-run -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "--nproc-per-node agreeing with slots"
echo "{\"command\": [\"true\"], \"nproc_per_node\": 1, \"hostfile\": \"$T/hosts\"}" > "$T/hf.json"
"$DTRAIN" run "$T/hf.json" --dry-run >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "a spec's nproc_per_node is the default for hosts without slots"
expect_eq "$(grep -c ' true$' "$T/out")" 2 "a spec's nproc_per_node + slots=2: 2 workers"
# gpus= without slots: one worker per GPU listed (DeepSpeed's --include localhost:1,3).
echo "localhost gpus=1,3" > "$T/hosts"
"$DTRAIN" run --hostfile "$T/hosts" --dry-run -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "gpus=1,3 without slots"
expect_eq "$(grep -c ' true$' "$T/out")" 2 "gpus=1,3 without slots: 2 workers"
expect_grep "^localhost +0 +1 +1 +cuda:3 +true$" "$T/out" "gpus=1,3: the second worker on GPU 3"
echo "localhost slots=4 gpus=1,3" > "$T/hosts"
"$DTRAIN" run --hostfile "$T/hosts" --dry-run -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "slots above the GPUs listed runs"
expect_grep "^dtrain: warning: $T/hosts:1: host \"localhost\" runs 4 workers on 2 GPUs \(gpus=1,3\): they share GPUs" "$T/err" "slots above the GPUs listed: a warning"
# A number is no host name: DeepSpeed's --include syntax, refused at once (it was an ssh to
# 0.0.0.2 that timed out after 10 s).
start=$(date +%s)
"$DTRAIN" run --hosts localhost:1,2 -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "--hosts localhost:1,2 exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: --hosts: \"2\" is not a host name; DeepSpeed's --include localhost:1,2 (GPUs 1,2) is the hostfile line \"localhost gpus=1,2\" (--hostfile FILE); in --hosts, host:N means N workers" "--hosts localhost:1,2: the fix"
[ $(( $(date +%s) - start )) -lt 5 ] && pass "--hosts localhost:1,2: refused at once" || fail "--hosts localhost:1,2 took $(( $(date +%s) - start )) s"
printf 'localhost\n2\n' > "$T/hosts"
"$DTRAIN" run --hostfile "$T/hosts" -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a numeric hostfile host exits 2"
expect_grep "^dtrain: error: --hostfile: $T/hosts:2: \"2\" is not a host name; DeepSpeed's --include host:1,2" "$T/err" "a numeric hostfile host: file:line and the fix"
# OpenMPI's max_slots=N: taken; dtrain runs exactly slots, so slots above it are refused.
echo "localhost slots=2 max_slots=4" > "$T/hosts"
"$DTRAIN" run --hostfile "$T/hosts" --dry-run -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "max_slots=4 with slots=2"
expect_eq "$(grep -c ' true$' "$T/out")" 2 "max_slots: exactly slots workers"
echo "localhost slots=4 max_slots=2" > "$T/hosts"
"$DTRAIN" run --hostfile "$T/hosts" --dry-run -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "slots above max_slots exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: --hostfile: $T/hosts:1: slots=4 is more than max_slots=2 for host \"localhost\"; dtrain runs exactly slots workers and never oversubscribes: give max_slots >= slots, or leave max_slots out" "slots above max_slots: the line and the fix"

# The temp dir (workers' error files, a trainer job's spec snapshot and result): a TMPDIR
# that does not exist or is not a directory is refused by run and bench in one line naming it,
# exit 2, nothing started (it was exit 1, "filesystem error: temp_directory_path"); validate
# and --dry-run, which write no temp file, say it and exit 0 alike.
printf '{"name": "tiny", "nproc_per_node": 1, "trainer": {"model": {"layers": [8, 4, 2]}, "data": {"train_samples": 64, "eval_samples": 16}, "batch_size": 16, "epochs": 1}}' >"$T/tiny.json"
msg="TMPDIR=$T/no-tmp: the directory does not exist; create it, or unset TMPDIR"
TMPDIR="$T/no-tmp" "$DTRAIN" run --nproc-per-node 1 -- touch "$T/ran-tmp" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "TMPDIR missing: a command job exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: $msg" "TMPDIR missing: named, with the fix"
[ -e "$T/ran-tmp" ] && fail "TMPDIR missing: the job ran" || pass "TMPDIR missing: nothing started"
TMPDIR="$T/no-tmp" "$DTRAIN" run "$T/tiny.json" --summary-json "$T/tmp-sum.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "TMPDIR missing: a trainer job exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: $msg" "TMPDIR missing (trainer): named"
expect_eq "$(python3 -c "import json; d=json.load(open('$T/tmp-sum.json')); print(d['status'], d['exit_code'], d['error'])")" "failed 2 $msg" "TMPDIR missing: the summary says so"
TMPDIR="$T/no-tmp" "$DTRAIN" bench allreduce -b 4K -e 4K -n 1 -w 0 >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "TMPDIR missing: bench exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: $msg" "TMPDIR missing (bench): named"
for cmd in "validate" "run --dry-run"; do
  TMPDIR="$T/no-tmp" "$DTRAIN" $cmd "$T/tiny.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "TMPDIR missing: $cmd exits 0"
  expect_eq "$(cat "$T/err")" "dtrain: warning: $msg (run refuses it: the job's temporary files go there)" "TMPDIR missing: $cmd says it"
done
touch "$T/tmp-file"
TMPDIR="$T/tmp-file" "$DTRAIN" run --nproc-per-node 1 -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "TMPDIR a file: exit 2"
expect_eq "$(cat "$T/err")" "dtrain: error: TMPDIR=$T/tmp-file: not a directory; point TMPDIR at a directory, or unset it" "TMPDIR a file: named"
# A relative TMPDIR is made absolute: workers starting in the spec's cwd get paths that lead
# somewhere (their spec snapshot, TORCHELASTIC_ERROR_FILE).
mkdir -p "$T/rel/reltmp"
sed 's/"nproc_per_node": 1,/"nproc_per_node": 1, "cwd": "\/",/' "$T/tiny.json" >"$T/rel/cwd.json"
(cd "$T/rel" && TMPDIR=reltmp "$DTRAIN" run cwd.json >"$T/out" 2>"$T/err"); expect_eq "$?" 0 "relative TMPDIR, spec cwd /: the trainer runs"
expect_grep "^\[rank 0\] trained: 4 steps" "$T/out" "relative TMPDIR: trained"
(cd "$T/rel" && TMPDIR=reltmp "$DTRAIN" run --nproc-per-node 1 -- sh -c 'echo "$TORCHELASTIC_ERROR_FILE"' >"$T/out" 2>"$T/err")
expect_grep "^\[rank 0\] $T/rel/reltmp/dtrain-[^/]+/attempt_0/0/error.json$" "$T/out" "relative TMPDIR: TORCHELASTIC_ERROR_FILE absolute"

# A wall-clock limit is timeout(1)'s: exit 124, the workers stopped cleanly (SIGTERM first).
timeout 2 "$DTRAIN" run --nproc-per-node 2 -- sh -c 'trap "echo stopped cleanly; exit 0" TERM; sleep 60 & wait' >"$T/out" 2>"$T/err"
expect_eq "$?" 124 "timeout 2 dtrain run: exit 124"
expect_eq "$(grep -c 'stopped cleanly$' "$T/out")" 2 "timeout: every worker got SIGTERM"

# The usage line names the program.
"$DTRAIN" --help >"$T/out" 2>&1
expect_grep "^Usage: dtrain \[OPTIONS\] SUBCOMMAND" "$T/out" "--help: usage names dtrain"
# Words no command takes are listed in the order given (CLI11 alone reversed them).
"$DTRAIN" validate "$SRC/configs/env_dump.json" a b c >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "validate with extra words exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: validate: unexpected arguments a b c; see dtrain validate --help" "extra words in the user's order"
# validate checks an ad hoc command as run --dry-run takes it (python3 was taken for the spec).
"$DTRAIN" validate --nproc-per-node 2 -- python3 "$T/train.py" --lr 0.1 >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "validate -- CMD exits 0"
expect_grep "^the command after --: OK$" "$T/out" "validate -- CMD: OK"
expect_grep "^command: +python3 $T/train.py --lr 0.1$" "$T/out" "validate -- CMD: the command, untouched"
expect_grep "^nproc_per_node: +2$" "$T/out" "validate -- CMD: flags applied"
"$DTRAIN" validate -- "$T/train.py" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "validate -- a script alone exits 2"
expect_grep "^dtrain: error: the command after --: cannot run .*: run python3 " "$T/err" "validate -- CMD: the program checked"
"$DTRAIN" validate >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "validate with nothing exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: nothing to validate; give a job spec (dtrain validate job.json) or a command (dtrain validate -- python3 train.py)" "validate with nothing: what to give"
# A spec then a command: the spec runs its own command; moving both after -- would run the
# spec file as a program.
cp "$SRC/configs/env_dump.json" "$T/job.json"
"$DTRAIN" run "$T/job.json" python3 x.py >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "spec and command without -- exits 2"
expect_eq "$(cat "$T/err")" "dtrain: error: run: unexpected arguments \"python3 x.py\" after the job spec $T/job.json: a spec and a command cannot both be given; run the spec (dtrain run $T/job.json) or the command (dtrain run [options] -- python3 x.py)" "spec + command: the spec is not put into the command"
cp "$SRC/configs/env_dump.json" "$T/jobspec"  # a spec without .json: parsed to tell
"$DTRAIN" run "$T/jobspec" python3 x.py >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "spec without .json and command exits 2"
expect_grep "a spec and a command cannot both be given" "$T/err" "a spec is recognised by its content too"
# A misspelt option of store, bench or train: named, with the closest of the command's own.
"$DTRAIN" store get --tmeout 3 --endpoint 127.0.0.1:1 k >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "store get --tmeout: exit 2"
expect_eq "$(cat "$T/err")" "dtrain: error: store get: unknown option --tmeout (did you mean --timeout?); see dtrain store get --help" "store get --tmeout: did you mean"
"$DTRAIN" bench allreduce --nproc-per-nod 2 >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "bench --nproc-per-nod: exit 2"
expect_eq "$(cat "$T/err")" "dtrain: error: bench allreduce: unknown option --nproc-per-nod (did you mean --nproc-per-node?); see dtrain bench allreduce --help" "bench --nproc-per-nod: did you mean"
# One of its own options after "--" (which ends them): said so, not "did you mean" the same flag.
"$DTRAIN" store set --endpoint 127.0.0.1:1 -- -k v --timeout 3 >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "store set -- ... --timeout: exit 2"
expect_eq "$(cat "$T/err")" "dtrain: error: store set: --timeout comes after \"--\", which ends the options (what follows is taken as arguments); put --timeout before \"--\"" "store set -- ... --timeout: put it before --"
"$DTRAIN" train --foo x >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "train --foo: exit 2"
expect_eq "$(cat "$T/err")" "dtrain: error: train: unknown option --foo; see dtrain train --help" "train --foo: named"
# dtrain train by hand with a DTRAIN_STORE_ADDR left in the shell: that variable is named (it
# was "RANK is not set; run this under 'dtrain run'").
DTRAIN_STORE_ADDR=127.0.0.1 "$DTRAIN" train "$SRC/configs/quickstart.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "train with a stale DTRAIN_STORE_ADDR: exit 2"
expect_grep "RANK is not set, but DTRAIN_STORE_ADDR is, as for a worker of 'dtrain run': unset DTRAIN_STORE_ADDR \(left over from another run\?\) to train alone" "$T/err" "train with a stale DTRAIN_STORE_ADDR: named, with the fix"
# --env NAME twice with different values: the last, said (the values unsaid: secrets).
"$DTRAIN" validate --env SECRET_A=one --env SECRET_A=two --env B=1 --env B=1 -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "--env twice: exit 0"
expect_eq "$(cat "$T/err")" "dtrain: warning: --env SECRET_A is given twice, with different values; the last one is used" "--env twice: one warning, no values"
# --dry-run writes no summary (nothing runs), and says so.
"$DTRAIN" run --dry-run --summary-json "$T/dry.json" -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "--dry-run --summary-json: exit 0"
[ -e "$T/dry.json" ] && fail "--dry-run wrote a summary" || pass "--dry-run wrote no summary"
expect_eq "$(cat "$T/err")" "dtrain: warning: --summary-json $T/dry.json: not written by --dry-run (nothing runs)" "--dry-run --summary-json: said"
# A GPU spec on a host without GPUs: validate checks the spec alone (it may run on a login
# node), --dry-run refuses it as run would, instead of a plan on the CPU.
if ! nvidia-smi -L >/dev/null 2>&1; then
  "$DTRAIN" validate "$SRC/configs/quickstart_gpu.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "GPU spec: validate checks the spec alone"
  "$DTRAIN" run --dry-run "$SRC/configs/quickstart_gpu.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "GPU spec without GPUs: --dry-run exits 2"
  expect_grep '/trainer/device: "cuda" but (no GPU is visible here|this dtrain is a CPU build)' "$T/err" "GPU spec without GPUs: --dry-run says why"
fi
# The error line is one line whatever it quotes (a command word or a path with a newline, an
# ESC); a flag that took the spec for its value says so; seconds are decimal (no hex).
printf '{"command": ["a\\nb\\u001b[0m"]}' > "$T/nl.json"
"$DTRAIN" validate "$T/nl.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a command word with a newline: exit 2"
expect_eq "$(wc -l < "$T/err")" 1 "a command word with a newline: one line"
expect_grep 'cannot run "a\\nb\\x1b\[0m"' "$T/err" "a command word with a newline: shown escaped"
"$DTRAIN" validate "$T/no
such.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a spec path with a newline: exit 2"
expect_eq "$(wc -l < "$T/err")" 1 "a spec path with a newline: one line"
"$DTRAIN" validate --nproc-per-node "$T/nl.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "--nproc-per-node without its value: exit 2"
expect_grep "nothing to validate: --nproc-per-node took \".*nl.json\" for its value; give --nproc-per-node a value" "$T/err" "--nproc-per-node without its value: said"
"$DTRAIN" validate --shutdown-timeout 0x10 "$SRC/configs/quickstart.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "--shutdown-timeout 0x10: exit 2"
expect_grep '^dtrain: error: --shutdown-timeout: expected seconds, got "0x10"$' "$T/err" "--shutdown-timeout 0x10: said"
# CLI11's own words, said with the command, what the option takes and its help.
"$DTRAIN" bench allreduce --timeout x >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "bench --timeout x: exit 2"
expect_eq "$(cat "$T/err")" 'dtrain: error: bench allreduce: --timeout: expected a number, got "x"; see dtrain bench allreduce --help' "bench --timeout x: the option and what it takes"
"$DTRAIN" store get >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "store get without a key: exit 2"
expect_eq "$(cat "$T/err")" "dtrain: error: store get: the KEY argument is missing; see dtrain store get --help" "store get without a key: the argument and the command's help"
# --hosts and --hostfile replace the spec's hostfile, which is then not read: a spec naming a
# cluster's hostfile that is not on this machine runs here with --hosts.
printf '{"command": ["true"], "hostfile": "%s/cluster-hosts"}\n' "$T" >"$T/cluster.json"
"$DTRAIN" run "$T/cluster.json" --hosts localhost:1,127.0.0.1:1 >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "a spec's missing hostfile, --hosts given: the job runs"
"$DTRAIN" validate "$T/cluster.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a spec's missing hostfile, no --hosts: exit 2"
expect_grep "cluster.json: /hostfile: hostfile \".*cluster-hosts\" does not exist" "$T/err" "a spec's missing hostfile, no --hosts: named"
# A stray word before -- (a second variable after --env's one) is named, with the fix.
"$DTRAIN" run --env A=1 B=2 -- sh -c 'echo $A' >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "--env A=1 B=2: exit 2"
expect_eq "$(cat "$T/err")" 'dtrain: error: "B=2" before -- was taken for a job spec; --env takes one KEY=VALUE, so give it once per variable: --env B=2' "--env A=1 B=2: the word named, with the fix"
"$DTRAIN" validate stray -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a stray word before --: exit 2"
expect_grep '^dtrain: error: unexpected word "stray" before --: it is no job spec' "$T/err" "a stray word before --: named"
# validate's result to a reader that went away: exit 1, said (not death by SIGPIPE, 141).
"$DTRAIN" validate "$SRC/configs/quickstart.json" 2>"$T/err" | true; expect_eq "${PIPESTATUS[0]}" 1 "validate to a closed pipe: exit 1"
expect_grep "^dtrain: error: cannot write to stdout: Broken pipe" "$T/err" "validate to a closed pipe: said"
# bench --json: "-" is stdout, and a file that is not a bench's JSON is not replaced.
(cd "$T" && "$DTRAIN" bench allreduce -b 4K -e 4K -n 1 -w 0 --json - >"$T/bj.out" 2>"$T/err"); expect_eq "$?" 0 "bench --json -: exit 0"
expect_eq "$(tail -1 "$T/bj.out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["collective"])')" allreduce "bench --json -: the JSON on stdout"
[ ! -e "$T/-" ] && pass "bench --json -: no file named -" || fail "bench --json -: made a file named -"
# (a bench's JSON reformatted is still one)
python3 -c 'import json,sys; json.dump(json.loads(open(sys.argv[1]).read().splitlines()[-1]), open(sys.argv[2], "w"), indent=2)' "$T/bj.out" "$T/bj-pretty.json"
"$DTRAIN" bench allreduce -b 4K -e 4K -n 1 -w 0 --json "$T/bj-pretty.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "bench --json over a reformatted bench JSON: replaced"
echo 'keep me' >"$T/notes.txt"
"$DTRAIN" bench allreduce -b 4K -e 4K -n 1 -w 0 --json "$T/notes.txt" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "bench --json over another file: exit 2"
expect_eq "$(cat "$T/notes.txt")" "keep me" "bench --json over another file: kept"
for b in localhost ""; do
  DTRAIN_STORE_TOKEN=0123456789abcdef0123 timeout 10 "$DTRAIN" store serve --bind "$b" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "store serve --bind '$b': exit 2"
  expect_grep "^dtrain: error: --bind: .* is not an IP address; give one: 127.0.0.1 \(this host only\), 0.0.0.0" "$T/err" "store serve --bind '$b': the flag and the fix"
done
finish
