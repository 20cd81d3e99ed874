# --summary-json as CI scripts read it: written for every run, early failures included;
# through symlinks, into pipes and /dev/stdout; never at the cost of the job's exit code.
source "$(dirname "$0")/lib.sh"
jq_() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print($2)" "$1"; }

# An early failure (the program cannot run) still writes the file, replacing an earlier
# run's: status failed, exit code 2, the error line, no ranks.
"$DTRAIN" run --summary-json "$T/s.json" -- true 2>"$T/err"; expect_eq "$?" 0 "first run succeeds"
expect_eq "$(jq_ "$T/s.json" "(d['status'], d['error'])")" "('succeeded', None)" "success: no error"
"$DTRAIN" run --summary-json "$T/s.json" -- "$T/no-such-program" 2>"$T/err"; expect_eq "$?" 2 "program missing: exit 2"
expect_eq "$(jq_ "$T/s.json" "(d['status'], d['exit_code'], d['ranks'])")" "('failed', 2, [])" "program missing: a failed summary replaces the earlier one"
expect_eq "$(jq_ "$T/s.json" "d['error'] == open('$T/err').read().strip().removeprefix('dtrain: error: ')")" "True" "program missing: the error line in the summary"
printf '{"command": ["true"], "nproc_per_node": 0}' >"$T/bad.json"
"$DTRAIN" run "$T/bad.json" --summary-json "$T/s.json" 2>"$T/err"; expect_eq "$?" 2 "bad spec: exit 2"
# (the job's name, "job" when the spec gives none, once the spec's JSON is read)
expect_eq "$(jq_ "$T/s.json" "(d['status'], d['exit_code'], d['job'], '/nproc_per_node' in d['error'])")" "('failed', 2, 'job', True)" "bad spec: summary written, names the field"
printf '{"name": "named", "command": ["true"], "nproc_per_nod": 1}' >"$T/typo.json"
"$DTRAIN" run "$T/typo.json" --summary-json "$T/s.json" 2>"$T/err"; expect_eq "$?" 2 "unknown key: exit 2"
expect_eq "$(jq_ "$T/s.json" "(d['status'], d['job'])")" "('failed', 'named')" "unknown key: the job still named"
printf '{"name": "named", "command": ["true"], "nproc_per_node": 1, "nproc_per_node": 2}' >"$T/dup.json"
"$DTRAIN" run "$T/dup.json" --summary-json "$T/s.json" 2>"$T/err"; expect_eq "$?" 2 "a key given twice: exit 2"
expect_eq "$(jq_ "$T/s.json" "(d['status'], d['job'], 'given twice' in d['error'])")" "('failed', 'named', True)" "a key given twice: the job still named"
printf '{"name": "a", "command": ["true"], "name": "b"}' >"$T/dup.json"
"$DTRAIN" run "$T/dup.json" --summary-json "$T/s.json" 2>"$T/err"; expect_eq "$?" 2 "a name given twice: exit 2"
expect_eq "$(jq_ "$T/s.json" "(d['status'], d['job'], 'key \"name\" is given twice' in d['error'])")" "('failed', None, True)" "a name given twice: no job named"
printf '{"command": ["true"], ' >"$T/badjson.json"
"$DTRAIN" run "$T/badjson.json" --summary-json "$T/s.json" 2>"$T/err"; expect_eq "$?" 2 "invalid JSON: exit 2"
expect_eq "$(jq_ "$T/s.json" "(d['status'], d['job'])")" "('failed', None)" "invalid JSON: no job name"

# A run refused on its command line (an unknown flag, a bad value, a torchrun option) too,
# whether the flag comes before or after --summary-json.
"$DTRAIN" run --summary-json "$T/s.json" -- true 2>"$T/err"; expect_eq "$?" 0 "cli: a first run succeeds"
"$DTRAIN" run --bogus --summary-json "$T/s.json" -- true 2>"$T/err"; expect_eq "$?" 2 "cli: unknown flag: exit 2"
expect_eq "$(jq_ "$T/s.json" "(d['status'], d['exit_code'], d['run_id'], d['error'] == open('$T/err').read().strip().removeprefix('dtrain: error: '))")" "('failed', 2, None, True)" "cli: unknown flag before --summary-json: a failed summary with the error"
"$DTRAIN" run --summary-json "$T/s.json" -- true 2>"$T/err"
"$DTRAIN" run --summary-json="$T/s.json" --nproc-per-node x -- true 2>"$T/err"; expect_eq "$?" 2 "cli: bad value: exit 2"
expect_eq "$(jq_ "$T/s.json" "(d['status'], 'nproc-per-node' in d['error'])")" "('failed', True)" "cli: bad value after --summary-json=: a failed summary"
"$DTRAIN" run --summary-json "$T/s.json" -- true 2>"$T/err"
"$DTRAIN" run --summary-json "$T/s.json" --master_port 29500 -- true 2>"$T/err"; expect_eq "$?" 2 "cli: torchrun option: exit 2"
expect_eq "$(jq_ "$T/s.json" "(d['status'], 'torchrun option' in d['error'])")" "('failed', True)" "cli: torchrun option: a failed summary"

# A worker failure: the headline is the summary's error.
"$DTRAIN" run --summary-json "$T/s.json" -- sh -c 'exit 3' 2>"$T/err"; expect_eq "$?" 3 "worker failure: its exit code"
expect_eq "$(jq_ "$T/s.json" "d['error']")" "job 'sh' failed: rank 0 exited with code 3" "worker failure: headline in the summary"

# A symlink: its target gets the summary, the link stays a link.
echo '{"status": "failed", "exit_code": 1}' >"$T/real.json"; ln -s real.json "$T/link.json"  # (an earlier summary)
"$DTRAIN" run --summary-json "$T/link.json" -- true 2>"$T/err"; expect_eq "$?" 0 "symlink: exit 0"
[ -L "$T/link.json" ] && pass "symlink: still a link" || fail "symlink: replaced by a file"
expect_eq "$(jq_ "$T/real.json" "d['status']")" "succeeded" "symlink: the target holds the summary"

# A pipe and /dev/stdout: written in place.
"$DTRAIN" run --summary-json >(cat >"$T/piped.json") -- true 2>"$T/err"; expect_eq "$?" 0 "pipe: exit 0"
for _ in $(seq 50); do [ -s "$T/piped.json" ] && python3 -c "import json; json.load(open('$T/piped.json'))" 2>/dev/null && break; sleep 0.1; done
expect_eq "$(jq_ "$T/piped.json" "d['status']")" "succeeded" "pipe: the summary came through"
# /dev/stdout redirected to a file holding the workers' output (and an earlier line): the
# summary follows that output; reopening the file would have truncated the log.
echo "earlier line" >"$T/stdout.log"
"$DTRAIN" run --summary-json /dev/stdout -- echo hello >>"$T/stdout.log" 2>"$T/err"; expect_eq "$?" 0 "/dev/stdout: exit 0"
expect_eq "$(head -2 "$T/stdout.log" | tr '\n' '|')" "earlier line|[rank 0] hello|" "/dev/stdout: the log and the workers' output kept"
tail -n +3 "$T/stdout.log" >"$T/stdout.json"
expect_eq "$(jq_ "$T/stdout.json" "d['status']")" "succeeded" "/dev/stdout: the summary after the output"
# "-" is stdout (before: a file named "-" in the working directory).
(cd "$T" && "$DTRAIN" run --summary-json - -- echo hi >"$T/dash.log" 2>"$T/err"); expect_eq "$?" 0 "--summary-json -: exit 0"
tail -n +2 "$T/dash.log" >"$T/dash.json"
expect_eq "$(jq_ "$T/dash.json" "d['status']")" "succeeded" "--summary-json -: the summary on stdout"
[ ! -e "$T/-" ] && pass "--summary-json -: no file named -" || fail "--summary-json -: made a file named -"
[ -L /dev/stdout ] || [ -c /dev/stdout ] && pass "/dev/stdout untouched" || fail "/dev/stdout was replaced"
ls "$T" | grep -q '\.tmp' && fail "temporary files left: $(ls "$T")" || pass "no temporary files left"

# The summary never replaces a file that is not one: the job spec given as the summary (or
# the spec taken for the summary's value) is refused before anything is written, and kept.
printf '{"command": ["true"]}\n' >"$T/keep.json"
for words in "$T/keep.json --summary-json $T/keep.json" "--summary-json $T/keep.json" "$T/keep.json --summary-json $T/keep.json --bogus"; do
  "$DTRAIN" run $words >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "summary over the spec ($words): exit 2"
  expect_eq "$(cat "$T/keep.json")" '{"command": ["true"]}' "summary over the spec ($words): the spec kept"
done
"$DTRAIN" run "$T/keep.json" --summary-json "$T/keep.json" >"$T/out" 2>"$T/err"
expect_eq "$(cat "$T/err")" "dtrain: error: --summary-json: \"$T/keep.json\" exists and is not a dtrain run summary, which would replace it; give another path, or remove the file first" "summary over the spec: said, with the fix"
: >"$T/empty.json"
"$DTRAIN" run "$T/keep.json" --summary-json "$T/empty.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "an empty file (mktemp's) takes the summary"
"$DTRAIN" run "$T/keep.json" --summary-json "$T/empty.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "an earlier summary is replaced"
expect_eq "$(jq_ "$T/empty.json" "d['status']")" "succeeded" "an earlier summary is replaced: this run's"
# A run refused before any worker, its --summary-json - appended to a log that holds other
# lines: the summary is written there, in place (the guard is for files it would replace).
echo "earlier line" >"$T/ci.log"
"$DTRAIN" run --summary-json - "$T/nonexistent.json" >>"$T/ci.log" 2>/dev/null; expect_eq "$?" 2 "refused run, --summary-json - appended to a log: exit 2"
expect_eq "$(tail -n +2 "$T/ci.log" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["status"], d["exit_code"])')" "failed 2" "refused run, --summary-json - appended to a log: the summary written"
# A reader of --summary-json - that went away: the job's exit code stands (not SIGPIPE's 141),
# and the lost summary is said; a job that succeeded then exits 1.
"$DTRAIN" run --summary-json - -- sh -c 'yes | head -100000; exit 3' 2>"$T/err" | head -1 >/dev/null; expect_eq "${PIPESTATUS[0]}" 3 "--summary-json - to a closed pipe: the job's exit code"
"$DTRAIN" run --summary-json - -- sleep 0.3 2>"$T/err" | true; expect_eq "${PIPESTATUS[0]}" 1 "--summary-json - to a closed pipe, job succeeded: exit 1"
expect_grep "^dtrain: error: --summary-json: cannot write /dev/stdout: Broken pipe" "$T/err" "--summary-json - to a closed pipe: said"
# A name that is not UTF-8 (the job is named after the script) and a summary that cannot be
# written: the job's exit code and failure block stand.
printf 'exit 3\n' >"$T/$(printf '\xfe').sh"
"$DTRAIN" run --summary-json "$T/u.json" -- sh "$T/$(printf '\xfe').sh" 2>"$T/err"; expect_eq "$?" 3 "non-UTF-8 job name: the worker's exit code"
expect_eq "$(jq_ "$T/u.json" "d['job']")" "$(printf '\xef\xbf\xbd').sh" "non-UTF-8 job name: replaced by U+FFFD in the summary"
mkdir "$T/vanish"
"$DTRAIN" run --summary-json "$T/vanish/s.json" -- sh -c "rm -rf '$T/vanish'; exit 4" 2>"$T/err"; expect_eq "$?" 4 "summary directory removed during the run: the worker's exit code"
expect_grep "^dtrain: job 'sh' failed: rank 0 exited with code 4" "$T/err" "summary directory removed: the failure still reported"
expect_grep "^dtrain: error: --summary-json: cannot create .*vanish/s.json.tmp" "$T/err" "summary directory removed: said"
"$DTRAIN" run --summary-json "$T/vanish2/s.json" -- true 2>"$T/err"; expect_eq "$?" 2 "summary in a missing directory: exit 2 before the run"
# A multi-node pre-flight failure (ssh cannot reach a host) writes the summary too.
printf '{"command": ["true"], "nodes": [{"host": "localhost"}, {"host": "unreachable-host"}], "ssh": {"options": ["-o", "ProxyCommand=false"]}}' >"$T/pf.json"
"$DTRAIN" run "$T/pf.json" --summary-json "$T/pf_sum.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 1 "pre-flight failure: exit 1"
expect_eq "$(jq_ "$T/pf_sum.json" "(d['status'], d['exit_code'], d['error'].startswith('pre-flight failed for 1 of 1 remote host(s)'), chr(13) in d['error'], chr(10) in d['error'], 'remote host(s): unreachable-host' in d['error'])")" "('failed', 1, True, False, False, True)" "pre-flight failure: the summary says so"
# The same through run's --ssh-option (an ad hoc command across hosts has no spec for it).
"$DTRAIN" run --hosts localhost:1,unreachable-host:1 --ssh-option=-o --ssh-option=ProxyCommand=false --summary-json "$T/pf2.json" -- true >"$T/out" 2>"$T/err"
expect_eq "$?" 1 "--ssh-option reaches ssh: the ProxyCommand fails the pre-flight"
expect_grep "unreachable-host \(--hosts\): ssh failed" "$T/err" "--ssh-option: the host named"
# (ssh ends its messages in CRLF: its CR showed on the console as \x0d)
# (ssh says "Connection closed by UNKNOWN port 65535", or, when the proxy's end comes first,
# "banner exchange: Connection to UNKNOWN port 65535: Broken pipe")
expect_grep "ssh failed: (Connection closed by|banner exchange: Connection to) UNKNOWN port 65535(: Broken pipe)?$" "$T/err" "--ssh-option: ssh's message without its CR"
# A summary path where nothing can be created (/proc) is refused before the job, not after it.
"$DTRAIN" run --summary-json /proc/dtrain-summary.json -- touch "$T/ran-proc" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "summary in /proc: exit 2 before the run"
[ -e "$T/ran-proc" ] && fail "summary in /proc: the job ran" || pass "summary in /proc: nothing ran"
# An earlier run's summary does not outlive this run's start: while the job runs (and when
# dtrain is SIGKILLed) the file says "running", not the earlier outcome.
"$DTRAIN" run --nproc-per-node 1 --summary-json "$T/stale.json" -- true >/dev/null 2>&1
expect_eq "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["status"])' "$T/stale.json")" "succeeded" "stale: the first run succeeded"
"$DTRAIN" run --nproc-per-node 1 --summary-json "$T/stale.json" -- sh -c "touch $T/started; sleep 30" >/dev/null 2>&1 &
DTRAIN_PID=$!
wait_for "$T/started"
kill -9 "$DTRAIN_PID"; wait "$DTRAIN_PID" 2>/dev/null; DTRAIN_PID=
expect_eq "$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["status"], d["exit_code"], d["run_id"] is not None)' "$T/stale.json")" "running None True" "stale: a SIGKILLed run's file says running, not the earlier success"
# A stop signal before any worker starts (here while dtrain waits for its spec on a FIFO, as
# it would read a large data file) ends the run with its own summary, never with the earlier
# run's left in place: the file says "running" from the start (the path checked first), and
# the signal, held until the step ends, gives status failed, exit 128 + the signal, the job's
# name, and nothing started.
for sig in TERM INT HUP; do
  "$DTRAIN" run --nproc-per-node 1 --summary-json "$T/pre.json" -- true >/dev/null 2>&1
  expect_eq "$(jq_ "$T/pre.json" "d['status']")" "succeeded" "stop before the launch ($sig): an earlier run succeeded"
  rm -f "$T/fifo.json"; mkfifo "$T/fifo.json"
  "$DTRAIN" run "$T/fifo.json" --summary-json "$T/pre.json" >"$T/out" 2>"$T/err" &
  DTRAIN_PID=$!
  for _ in $(seq 100); do grep -q '"running"' "$T/pre.json" && break; sleep 0.05; done
  expect_eq "$(jq_ "$T/pre.json" "(d['status'], d['run_id'] is not None)")" "('running', True)" "stop before the launch ($sig): running before the spec is read"
  kill -$sig "$DTRAIN_PID"; sleep 0.2
  # (the spec arrives after the signal; a dtrain the signal killed has no reader left)
  timeout 5 sh -c "echo '{\"name\": \"fifojob\", \"command\": [\"touch\", \"$T/ran-$sig\"]}' >'$T/fifo.json'"
  wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
  code=$((128 + $(kill -l $sig)))
  expect_eq "$rc" "$code" "stop before the launch ($sig): exit 128 + the signal"
  expect_eq "$(jq_ "$T/pre.json" "(d['status'], d['exit_code'], d['stopped_by'], d['job'], d['error'], d['ranks'])")" \
    "('failed', $code, 'SIG$sig', 'fifojob', 'stopped by SIG$sig before any worker started', [])" "stop before the launch ($sig): the summary says so"
  expect_grep "^dtrain: stopped by SIG$sig before any worker started; exit code $code$" "$T/err" "stop before the launch ($sig): said"
  [ -e "$T/ran-$sig" ] && fail "stop before the launch ($sig): the worker ran" || pass "stop before the launch ($sig): nothing started"
done

# The job's name is in the summary as soon as the spec is read: errors found after it (a
# program that cannot run, a data file missing) name the job.
printf '{"name": "x", "command": ["nosuchprog_zz"]}' >"$T/bad2.json"
"$DTRAIN" run "$T/bad2.json" --summary-json "$T/s.json" 2>"$T/err"; expect_eq "$?" 2 "program missing (spec): exit 2"
expect_eq "$(jq_ "$T/s.json" "(d['status'], d['job'])")" "('failed', 'x')" "program missing (spec): the job named"
printf '{"name": "nodata", "trainer": {"model": {"layers": [4, 2]}, "data": {"type": "csv", "path": "%s"}}}' "$T/missing.csv" >"$T/nodata.json"
"$DTRAIN" run "$T/nodata.json" --summary-json "$T/s.json" 2>"$T/err"; expect_eq "$?" 2 "data file missing: exit 2"
expect_eq "$(jq_ "$T/s.json" "(d['status'], d['job'])")" "('failed', 'nodata')" "data file missing: the job named"
"$DTRAIN" run --summary-json "$T/s.json" -- "$T/no-such-program" 2>"$T/err"
expect_eq "$(jq_ "$T/s.json" "d['job']")" "no-such-program" "program missing (command): the job named"

# A working directory longer than PATH_MAX: a relative --summary-json is checked as it is
# written (relative), so it is taken and written; a path no call can take is refused with
# the OS's reason, and nothing is written there.
mkdir -p "$T/long"
(
  cd "$T/long" || exit 1
  d=$(printf 'd%.0s' $(seq 200))
  for _ in $(seq 22); do mkdir "$d" && cd "$d" || exit 1; done
  "$DTRAIN" run --nproc-per-node 1 --summary-json s.json -- true >/dev/null 2>"$T/err"; echo "rc=$?" >"$T/long.rc"
  cp s.json "$T/long.json"  # (python, through a pyenv shim, cannot start in such a directory)
  "$DTRAIN" run --nproc-per-node 1 --summary-json "$PWD/s2.json" -- touch "$T/ran-long" >/dev/null 2>"$T/err2"; echo "rc=$?" >>"$T/long.rc"
  [ -e s2.json ] && echo written >>"$T/long.rc"
  cp "$T/err2" "$T/long.err2"
)
expect_eq "$(cat "$T/long.rc")" "$(printf 'rc=0\nrc=2')" "cwd longer than PATH_MAX: a relative summary taken, an absolute one refused (and not written)"
expect_eq "$(jq_ "$T/long.json" "d['status']")" "succeeded" "cwd longer than PATH_MAX: the relative summary written"
expect_grep "^dtrain: error: --summary-json: .*: cannot use directory .*: File name too long; give another path$" "$T/long.err2" "cwd longer than PATH_MAX: the absolute path refused with the OS's reason"
[ -e "$T/ran-long" ] && fail "cwd longer than PATH_MAX: the job ran" || pass "cwd longer than PATH_MAX: nothing ran"
finish
