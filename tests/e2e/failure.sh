# A failing worker stops the others and its exit code, stderr and error file reach the user.
source "$(dirname "$0")/lib.sh"
DTRAIN_ABS=$(readlink -f "$DTRAIN")
cat > "$T/w.sh" <<'SH'
echo $$ > "$D/pid.$RANK"
if [ "$RANK" = 1 ]; then sleep 0.5; echo "about to fail" >&2; printf 'last words' >&2; exit 3; fi
exec sleep 60
SH
start=$(date +%s)
D="$T" "$DTRAIN" run --nproc-per-node 3 --shutdown-timeout 5 -- bash "$T/w.sh" >"$T/out" 2>"$T/err"
rc=$?
took=$(( $(date +%s) - start ))
expect_eq "$rc" 3 "exit code is the failing worker's"
[ "$took" -lt 10 ] && pass "others stopped promptly (${took}s)" || fail "took ${took}s"
expect_grep "job 'w.sh' failed: rank 1 exited with code 3" "$T/err" "summary headline names the script (bash w.sh)"
expect_grep "rank: +1 \(local rank 1\)" "$T/err" "summary rank"
expect_grep "pid: +$(cat "$T/pid.1")" "$T/err" "summary pid"
expect_grep "host: +$(hostname)" "$T/err" "summary host"
expect_grep "time: +[0-9]{4}-[0-9]{2}-[0-9]{2}T" "$T/err" "summary time"
expect_grep "\| about to fail" "$T/err" "stderr tail"
expect_grep "\| last words$" "$T/err" "unterminated last line in tail"
expect_grep "2 other worker\(s\) ended during teardown" "$T/err" "others counted as stopped"
for r in 0 2; do alive "$(cat "$T/pid.$r")" && fail "rank $r still alive" || pass "rank $r stopped"; done

# A worker killed by a signal: named signal in the summary, 128+n exit code.
"$DTRAIN" run --nproc-per-node 2 -- sh -c '[ "$RANK" = 0 ] && kill -SEGV $$; sleep 30' >"$T/out" 2>"$T/err"
expect_eq "$?" 139 "SIGSEGV gives 139"
expect_grep "rank 0 killed by SIGSEGV" "$T/err" "signal named"
expect_grep "exit: +SIGSEGV" "$T/err" "exit line names signal"

# TORCHELASTIC_ERROR_FILE written by the worker (PyTorch @record format) shows in the summary.
cat > "$T/err.py" <<'PY'
import json, os, sys
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
    json.dump({"message": {"message": "ValueError: learning rate must be positive",
                           "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  File \"train.py\", line 7\nValueError: learning rate must be positive", "timestamp": "0"}}}, f)
# What Python would print to stderr as well: the summary says it once.
print("loading data", file=sys.stderr)
print("Traceback (most recent call last):\n  File \"train.py\", line 7\nValueError: learning rate must be positive", file=sys.stderr)
sys.exit(1)
PY
"$DTRAIN" run --nproc-per-node 1 -- python3 "$T/err.py" >"$T/out" 2>"$T/err"
expect_eq "$?" 1 "error-file worker exit code"
expect_grep "error: +ValueError: learning rate must be positive" "$T/err" "error file message"
expect_grep "File \"train.py\", line 7" "$T/err" "error file traceback"
expect_eq "$(grep -c "ValueError: learning rate must be positive" "$T/err")" 4 "the traceback once in the summary (the live line, the headline, error:, traceback:; not again in the tail)"
expect_grep "^dtrain: job 'err.py' failed: rank 0 exited with code 1 \(ValueError: learning rate must be positive\)$" "$T/err" "the headline says why"
expect_grep "^      \| loading data$" "$T/err" "the tail keeps what the traceback does not say"

# An @record error file with a message of several lines, an escape sequence and a last line
# past the tail's 2000-byte cut (what torch writes for bigerr.py): the message's lines are
# indented under "error:", the ESC is shown as \x1b, and the tail drops all of Python's
# traceback, its outer frames (above @record's wrapper) included.
cat > "$T/rec.sh" <<'SH'
y=$(head -c 2500 /dev/zero | tr '\0' y)
msg="RuntimeError: line one\\nline two \\u001b[31mred\\u001b[0m\\n$y"
tb="Traceback (most recent call last):\\n  File \\\"/x/errors/__init__.py\\\", line 346, in wrapper\\n    return f(*args, **kwargs)\\n           ^^^^^^^^^^^^^^^^^^\\n  File \\\"/x/train.py\\\", line 6, in main\\n    raise RuntimeError(msg)\\n$msg\\n"
printf '{"message": {"message": "%s", "extraInfo": {"py_callstack": "%s", "timestamp": "1"}}}' "$msg" "$tb" > "$TORCHELASTIC_ERROR_FILE"
printf 'Traceback (most recent call last):\n  File "/x/dl.py", line 3, in fetch\n    urlopen(u)\nConnectionError: download failed, will retry\n' >&2
echo "loading data" >&2
printf 'Traceback (most recent call last):\n  File "/x/train.py", line 7, in <module>\n    main()\n  File "/x/errors/__init__.py", line 346, in wrapper\n    return f(*args, **kwargs)\n           ^^^^^^^^^^^^^^^^^^\n  File "/x/train.py", line 6, in main\n    raise RuntimeError(msg)\nRuntimeError: line one\nline two \033[31mred\033[0m\n%s\n' "$y" >&2
exit 1
SH
"$DTRAIN" run -- sh "$T/rec.sh" >"$T/out" 2>"$T/err"
expect_eq "$?" 1 "@record error file: exit 1"
sed -n '/^  first failure:/,$p' "$T/err" > "$T/summary"
expect_grep "^    error:      RuntimeError: line one$" "$T/summary" "@record message: its first line"
expect_grep "^                line two \\\\x1b\[31mred\\\\x1b\[0m$" "$T/summary" "@record message: a later line indented, its ESC visible"
expect_grep "^                y{2500}$" "$T/summary" "@record message: its last line indented"
expect_eq "$(grep -c "$(printf '\033')" "$T/summary")" 0 "no raw ESC in the summary"
expect_eq "$(grep -c '^      | ' "$T/summary")" 5 "the tail less the whole traceback (outer frames and the cut last line too)"
expect_grep "^      \| loading data$" "$T/summary" "the tail keeps the worker's own line"
expect_eq "$(grep '^      | ' "$T/summary" | head -4 | tr -d '\n')" "      | Traceback (most recent call last):      |   File \"/x/dl.py\", line 3, in fetch      |     urlopen(u)      | ConnectionError: download failed, will retry" "the tail keeps a traceback the script printed itself (a handled exception), header and frames"

# The headline shows a message's control characters and stray bytes as the summary does
# (before: ESC as a space in the headline, \x1b below it; a byte that is no UTF-8 raw).
cat > "$T/esc.sh" <<'SH'
printf '{"message": {"message": "RuntimeError: bad \xff byte \\u001b[1mbold", "extraInfo": {"py_callstack": "", "timestamp": "1"}}}' > "$TORCHELASTIC_ERROR_FILE"
printf '{"message": {"message": "RuntimeError: a \\u001b[1mbold\\tword", "extraInfo": {"py_callstack": "", "timestamp": "1"}}}' > "$TORCHELASTIC_ERROR_FILE.ok"
[ -n "$GOOD" ] && mv "$TORCHELASTIC_ERROR_FILE.ok" "$TORCHELASTIC_ERROR_FILE"
exit 1
SH
GOOD=1 "$DTRAIN" run -- sh "$T/esc.sh" >"$T/out" 2>"$T/err"
expect_grep '^dtrain: job .* failed: rank 0 exited with code 1 \(RuntimeError: a \\x1b\[1mbold word\)$' "$T/err" "headline: ESC as \\x1b, a tab as a space"
expect_grep '^    error:      RuntimeError: a \\x1b\[1mbold	word$' "$T/err" "summary: ESC as \\x1b, the tab kept"
"$DTRAIN" run -- sh "$T/esc.sh" >"$T/out" 2>"$T/err"
expect_eq "$(grep -c "$(printf '\377')" "$T/err")" 0 "a byte that is no UTF-8 never reaches the console raw"
expect_grep '^dtrain: job .* failed: rank 0 exited with code 1 \(.*bad \\xff byte' "$T/err" "headline: the byte as \\xff"
# A program that does not exist is refused before any worker starts (exit 2, with the fix;
# torchrun's habit of naming the script alone gets its python3).
"$DTRAIN" run --nproc-per-node 2 -- /nonexistent/prog >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "missing program: exit 2"
expect_eq "$(cat "$T/err")" 'dtrain: error: the command after --: cannot run "/nonexistent/prog": no such file; check the path' "missing program: one line"
expect_eq "$(cat "$T/out")" "" "missing program: no worker started"
printf 'print(1)\n' > "$T/ddp.py"
(cd "$T" && "$DTRAIN_ABS" run -- ddp.py) >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "a script named alone: exit 2"
expect_grep "^dtrain: error: the command after --: cannot run \"ddp.py\": it is a Python script in .*, and dtrain runs the command as given \(it adds no python, unlike torchrun\): run python3 ddp.py$" "$T/err" "a script named alone: the fix"
# Executable, but without a #! line: exec would hand it to /bin/sh ("Syntax error").
chmod +x "$T/ddp.py"
(cd "$T" && "$DTRAIN_ABS" run -- ./ddp.py) >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "an executable .py without #!: exit 2"
expect_eq "$(cat "$T/err")" 'dtrain: error: the command after --: cannot run "./ddp.py": it is a Python file without a #! line, which the system would run with /bin/sh; give python3 as the command'"'"'s first word (python3 ddp.py), or make #!/usr/bin/env python3 its first line' "an executable .py without #!: one line, the fix"
printf '#!/usr/bin/env python3\nprint(1)\n' > "$T/ddp.py"
(cd "$T" && "$DTRAIN_ABS" run -- ./ddp.py) >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "an executable .py with #!: runs"
printf '{"command": ["pyhton3", "x.py"]}' > "$T/typo.json"
"$DTRAIN" run "$T/typo.json" --max-restarts 3 >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "a misspelt program in a spec: exit 2, no restarts spent"
expect_eq "$(cat "$T/err")" "dtrain: error: $T/typo.json: /command/0: cannot run \"pyhton3\": no such program on PATH; check the name, or give its path" "misspelt program: names the JSON path"
# `python` where only python3 is installed: the name it most likely means.
mkdir -p "$T/p3bin"; ln -s /bin/true "$T/p3bin/python3"
"$DTRAIN" run --env "PATH=$T/p3bin" -- python train.py >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "python missing, python3 there: exit 2"
expect_eq "$(cat "$T/err")" "dtrain: error: the command after --: cannot run \"python\": no such program on PATH (did you mean python3?); check the name, or give its path" "python missing, python3 there: did you mean python3"
# A bare program name is looked up on the workers' PATH (a venv's bin in the spec's env),
# by the check and by the exec alike (execvpe searched dtrain's own PATH).
mkdir -p "$T/venv/bin"; printf '#!/bin/sh\necho "from the venv"\n' > "$T/venv/bin/venvprog"; chmod +x "$T/venv/bin/venvprog"
"$DTRAIN" run --env "PATH=$T/venv/bin:/usr/bin:/bin" -- venvprog >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "a program on the workers' PATH runs"
expect_eq "$(cat "$T/out")" "[rank 0] from the venv" "a program on the workers' PATH: its output"
"$DTRAIN" run --env "PATH=/nonexistent" -- sh -c true >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "a program missing from the workers' PATH is refused, though on dtrain's"
# A script whose #! interpreter does not exist: the interpreter is named, not the script
# (exec's ENOENT read "cannot run './bad.sh': No such file or directory"), before the launch.
printf '#!/nonexistent/interp\necho hi\n' > "$T/badinterp"; chmod +x "$T/badinterp"
(cd "$T" && "$DTRAIN_ABS" run --nproc-per-node 1 -- ./badinterp) >"$T/out" 2>"$T/err"
expect_eq "$?" 2 "a missing #! interpreter: exit 2"
expect_eq "$(cat "$T/err")" "dtrain: error: the command after --: cannot run \"./badinterp\": its interpreter /nonexistent/interp (#! line) does not exist; fix its #! line, or give an interpreter that exists as the command's first word" "a missing #! interpreter named"
printf '#!/usr/bin/env sh\r\necho hi\r\n' > "$T/crlf"; chmod +x "$T/crlf"
"$DTRAIN" run -- "$T/crlf" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a #! line with Windows line endings: exit 2"
expect_grep "its #! line runs sh\\\\r through /usr/bin/env, and there is no sh\\\\r on PATH \(the #! line ends in \\\\r: the file has Windows line endings; convert it" "$T/err" "a #! line with Windows line endings: said so"

# --summary-json for a failed command job.
"$DTRAIN" run --nproc-per-node 2 --summary-json "$T/sum.json" -- sh -c '[ "$RANK" = 1 ] && kill -KILL $$; sleep 30' >"$T/out" 2>"$T/err"
expect_eq "$?" 137 "SIGKILLed worker gives 137"
python3 -c "
import json; d = json.load(open('$T/sum.json'))
r = {x['rank']: x for x in d['ranks']}
print(d['status'], d['exit_code'], r[1]['signal'], r[1]['exit_code'], r[0]['stopped_by_dtrain'], d['trainer'])" >"$T/check"
expect_eq "$(cat "$T/check")" "failed 137 SIGKILL None True None" "--summary-json for a failed job"

# Both ranks fail on their own (exit 3), rank 1 a moment after dtrain began its teardown
# (it ignores the SIGTERM): both are failures, neither was stopped by dtrain.
"$DTRAIN" run --nproc-per-node 2 --summary-json "$T/sum2.json" -- sh -c 'trap "" TERM; sleep 0.3; [ "$RANK" = 1 ] && sleep 0.5; exit 3' >"$T/out" 2>"$T/err"
expect_eq "$?" 3 "both exit 3: the job exits 3"
python3 -c "
import json; d = json.load(open('$T/sum2.json'))
print(*[(x['rank'], x['exit_code'], x['stopped_by_dtrain']) for x in sorted(d['ranks'], key=lambda x: x['rank'])])" >"$T/check"
expect_eq "$(cat "$T/check")" "(0, 3, False) (1, 3, False)" "own failures are not credited to dtrain's teardown"
expect_grep "^  2 workers failed in all: ranks 0 \(code 3\), 1 \(code 3, during the teardown, after its SIGTERM\); use --log-dir DIR to keep every rank's output in DIR/rank_N.log$" "$T/err" "summary counts both failures (the second as ending during the teardown), and names no log that is not there"
"$DTRAIN" run --nproc-per-node 2 --log-dir "$T/ld" -- sh -c 'trap "" TERM; sleep 0.3; [ "$RANK" = 1 ] && sleep 0.3; exit 3' >"$T/out" 2>"$T/err"
expect_grep "^  2 workers failed in all: ranks 0 \(code 3\), 1 \(code 3, during the teardown, after its SIGTERM\); every rank's output is in $T/ld/rank_N.log$" "$T/err" "with --log-dir: where the others' output is"

# All workers succeed -> 0, no summary.
"$DTRAIN" run --nproc-per-node 2 -- true >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "all exit 0"
if grep -q failed "$T/err"; then fail "summary on success"; else pass "no summary on success"; fi
# A teardown that waits on a worker ignoring SIGTERM says what it waits for (it looked like
# a hang for shutdown_timeout_s).
"$DTRAIN" run --nproc-per-node 2 --shutdown-timeout 4 -- sh -c 'if [ "$RANK" = 0 ]; then sleep 0.3; exit 3; fi; trap "" TERM; sleep 30' >"$T/out" 2>"$T/err"
expect_eq "$?" 3 "slow teardown: the failing rank's code"
expect_grep "^dtrain: rank 0 failed; waiting up to [0-2] s more for rank\(s\) 1 to exit after SIGTERM, then SIGKILL \(shutdown_timeout_s, --shutdown-timeout\)$" "$T/err" "slow teardown: says what it waits for"
# A stopped (SIGSTOPped) worker is continued at teardown, so its SIGTERM handler runs at
# once instead of the job waiting out the whole grace period.
cat > "$T/stopme.sh" <<'SH'
echo $$ > "$D/stopme.$RANK"
if [ "$RANK" = 0 ]; then sleep 1; exit 3; fi
trap 'echo got-term; exit 0' TERM
while :; do sleep 0.1; done
SH
start=$(date +%s)
( for _ in $(seq 50); do [ -s "$T/stopme.1" ] && break; sleep 0.05; done; kill -STOP "$(cat "$T/stopme.1")" ) &
D="$T" "$DTRAIN" run --nproc-per-node 2 --shutdown-timeout 20 -- bash "$T/stopme.sh" >"$T/out" 2>"$T/err"
took=$(( $(date +%s) - start )); wait
expect_grep "^\[rank 1\] got-term$" "$T/out" "stopped worker: its SIGTERM handler ran"
[ "$took" -lt 10 ] && pass "stopped worker: no wait for the grace period (${took}s)" || fail "stopped worker: took ${took}s"
# The exit reaped first is not always the first failure: rank 1 exits 1 saying its collective
# lost rank 0 (dtrain's communicator's words) before rank 0's SIGKILL is reaped (here: rank 0
# kills itself as the teardown's SIGTERM arrives). The job, its exit code and the restart
# event blame rank 0, the rank that died, not the rank that noticed.
cat > "$T/lost.sh" <<'SH'
if [ "$RANK" = 1 ]; then sleep 0.3; echo "dtrain: error: allreduce on rank 1: lost rank 0: connection closed (the process exited or was killed)" >&2; exit 1; fi
trap 'kill -9 $$' TERM
sleep 30 & wait
SH
"$DTRAIN" run --nproc-per-node 2 --max-restarts 1 -- bash "$T/lost.sh" >"$T/out" 2>"$T/err"
expect_eq "$?" 137 "collateral first: the exit code is the lost rank's (SIGKILL)"
expect_grep "event restart \(round 1\) host .* rank 0: rank 0 killed by SIGKILL; restart 1 of 1" "$T/err" "collateral first: the restart blames the rank that died"
expect_grep "job 'lost.sh' failed: rank 0 killed by SIGKILL" "$T/err" "collateral first: so does the headline"
# Ctrl-C during the teardown after a failure with no restart left: the job had failed
# already; the signal only stops the remaining workers at once. It ends as that failure
# (exit code, headline, summary), and says what the signal did.
cat > "$T/slowstop.sh" <<'SH'
trap 'sleep 20; exit 0' TERM
if [ "$RANK" = 1 ]; then sleep 0.3; echo "boom" >&2; exit 3; fi
echo $$ > "$D/slow.pid"; sleep 30 & wait
SH
rm -f "$T/slow.pid"
D="$T" "$DTRAIN" run --nproc-per-node 2 --summary-json "$T/slow.json" -- bash "$T/slowstop.sh" >"$T/out" 2>"$T/err" &
DTRAIN_PID=$!
wait_for "$T/slow.pid" && sleep 1 && kill -INT "$DTRAIN_PID"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc" 3 "Ctrl-C in the final teardown: the failure's exit code"
expect_grep "^dtrain: job 'slowstop.sh' failed: rank 1 exited with code 3" "$T/err" "Ctrl-C in the final teardown: the failure's headline"
expect_grep "^dtrain: SIGINT during the teardown after the failure: the workers still running were killed at once; exit code 3, the failure's$" "$T/err" "Ctrl-C in the final teardown: said"
if grep -q "stopped by" "$T/err"; then fail "Ctrl-C in the final teardown: said 'stopped by'"; else pass "Ctrl-C in the final teardown: not 'stopped by'"; fi
expect_eq "$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["status"], d["exit_code"], d["stopped_by"])' "$T/slow.json")" "failed 3 None" "Ctrl-C in the final teardown: the summary"
# A module missing for the `python3` found on the workers' PATH (a pyenv or venv shim first,
# without torch; torchrun runs its own interpreter): the summary names that interpreter.
mkdir -p "$T/fakebin"
printf '#!/bin/sh\necho "ModuleNotFoundError: No module named '"'"'torch'"'"'" >&2\nexit 1\n' > "$T/fakebin/python3"
chmod +x "$T/fakebin/python3"
touch "$T/train.py"; cd "$T"
PATH="$T/fakebin:$PATH" "$DTRAIN" run -- python3 train.py >"$T/out" 2>&1
expect_eq "$?" 1 "a module missing: exit 1"
expect_grep "^    hint:       python3 on the workers' PATH is $T/fakebin/python3, which has no module 'torch'; if another interpreter has it, give its path" "$T/out" "a module missing: the interpreter that ran is named"
"$DTRAIN" run -- "$T/fakebin/python3" train.py >"$T/out" 2>&1
expect_no_grep "hint:" "$T/out" "an interpreter given by its path: no hint"
cd - >/dev/null
finish
