# Worker output: [rank N] prefixes, whole lines under concurrent writers, lines without a
# trailing newline, binary junk, per-rank log files, the console filter.
source "$(dirname "$0")/lib.sh"
cat > "$T/w.py" <<'PY'
import os, sys
r = os.environ["RANK"]
pad = "x" * 3000   # longer than PIPE_BUF, so the kernel would split it across reads
for i in range(2000):
    sys.stdout.write(f"{r}:{i}:{pad}:end\n")
    if i % 7 == 0:
        sys.stdout.flush()
sys.stdout.flush()
sys.stderr.write(f"err-from-{r}")   # no trailing newline
sys.stderr.flush()
os.write(1, b"\xff\xfe\x00junk\n")
PY
"$DTRAIN" run --nproc-per-node 4 --log-dir "$T/logs" -- python3 "$T/w.py" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "writers exit 0"
# Checked in Python: a regex like x{3000} makes grep crawl.
python3 - "$T" >"$T/check" <<'PY2'
import re, sys
t = sys.argv[1]
pad = "x" * 3000
out = open(f"{t}/out", "rb").read().split(b"\n")[:-1]
bad = 0
counts = {r: 0 for r in range(4)}
junk = 0
for line in out:
    m = re.fullmatch(rb"\[rank ([0-3])\] ([0-3]):([0-9]+):(x+):end", line)
    if m and m.group(1) == m.group(2) and len(m.group(4)) == 3000:
        counts[int(m.group(1))] += 1
    elif re.fullmatch(rb"\[rank [0-3]\] \xff\xfe\x00junk", line):
        junk += 1
    else:
        bad += 1
for r in range(4):
    print(f"rank{r}_lines {counts[r]}")
    log = open(f"{t}/logs/rank_{r}.log", "rb").read().split(b"\n")
    print(f"rank{r}_log_lines", sum(1 for l in log if re.fullmatch(rb"%d:[0-9]+:x{3000}:end" % r, l)))
print("bad", bad)
print("junk", junk)
PY2
v() { grep "^$1 " "$T/check" | cut -d' ' -f2; }
for r in 0 1 2 3; do
  expect_eq "$(v rank${r}_lines)" 2000 "rank $r: 2000 whole lines"
  expect_eq "$(v rank${r}_log_lines)" 2000 "rank $r log file has every line, unprefixed"
  expect_grep "^\[rank $r\] err-from-$r$" "$T/err" "rank $r unterminated stderr line"
done
expect_eq "$(v bad)" 0 "no split or interleaved lines"
expect_eq "$(v junk)" 4 "binary junk passed through"


# --local-ranks-filter: console shows only rank 1, files still get everything.
"$DTRAIN" run --nproc-per-node 3 --local-ranks-filter 1 --log-dir "$T/logs2" -- sh -c 'echo "hello $RANK"' >"$T/out" 2>"$T/err"
expect_eq "$(cat "$T/out")" "[rank 1] hello 1" "console filtered to rank 1"
expect_eq "$(grep -v '^==== dtrain run ' "$T/logs2/rank_2.log")" "hello 2" "filtered rank still logged"

# A second run into the same log_dir appends; each run and attempt begins with a header line.
"$DTRAIN" run --nproc-per-node 1 --max-restarts 1 --log-dir "$T/logs2" --summary-json "$T/s.json" -- \
  sh -c 'echo "try $TORCHELASTIC_RESTART_COUNT"; [ "$TORCHELASTIC_RESTART_COUNT" = 1 ]' >"$T/out" 2>&1
run2=$(python3 -c "import json; print(json.load(open('$T/s.json'))['run_id'])")
expect_grep "^==== dtrain run [0-9a-f]+ attempt 0 [0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]+Z ====$" "$T/logs2/rank_0.log" "header line"
expect_eq "$(sed -E 's/ [0-9]{4}-[0-9-]+T[0-9:.]+Z / T /; s/run [0-9a-f]+ /run X /' "$T/logs2/rank_0.log" | tr '\n' '|')" \
  "==== dtrain run X attempt 0 T ====|hello 0|==== dtrain run X attempt 0 T ====|try 0|==== dtrain run X attempt 1 T ====|try 1|" \
  "earlier run kept, one header per run and attempt"
expect_eq "$(grep -c "^==== dtrain run $run2 " "$T/logs2/rank_0.log")" 2 "headers name the run id of --summary-json"

# --no-prefix
"$DTRAIN" run --nproc-per-node 1 --no-prefix -- echo plain >"$T/out" 2>&1
expect_eq "$(cat "$T/out")" "plain" "--no-prefix"
# stdout and stderr to one file (2>&1, a terminal): each rank's lines in the order written,
# in the console and in its log; with them split, each file still gets its own stream.
cat > "$T/order.py" <<'PY'
import sys
for i in range(200):
    print(f"out {i}", flush=True)
    print(f"err {i}", file=sys.stderr, flush=True)
PY
order_bad() {  # lines of rank $2 in file $1 that are not out 0, err 0, out 1, ...
  python3 - "$1" "$2" <<'PY2'
import re, sys
seq = [m.group(1) for l in open(sys.argv[1]) for m in [re.search(r"((out|err) \d+)$", l)]
       if m and (l.startswith(f"[rank {sys.argv[2]}]") or not l.startswith("[rank"))]
want = [f"{s} {i}" for i in range(200) for s in ("out", "err")]
print(sum(1 for a, b in zip(seq, want) if a != b) + abs(len(seq) - len(want)))
PY2
}
"$DTRAIN" run --nproc-per-node 2 --log-dir "$T/logs3" -- python3 "$T/order.py" >"$T/out" 2>&1
expect_eq "$(order_bad "$T/out" 0)" 0 "2>&1: rank 0's stdout and stderr lines in order"
expect_eq "$(order_bad "$T/out" 1)" 0 "2>&1: rank 1's stdout and stderr lines in order"
expect_eq "$(order_bad "$T/logs3/rank_1.log" 1)" 0 "2>&1: rank log in order"
"$DTRAIN" run --nproc-per-node 1 -- python3 "$T/order.py" >"$T/out" 2>"$T/err"
expect_eq "$(grep -c '^\[rank 0\] out' "$T/out") $(grep -c '^\[rank 0\] err' "$T/err")" "200 200" "split: each stream to its own file"
# The failure summary's tail is then the last lines of both streams.
"$DTRAIN" run --nproc-per-node 1 -- sh -c 'echo said-on-stdout; echo said-on-stderr >&2; exit 2' >"$T/out" 2>&1
expect_grep "last output lines:" "$T/out" "2>&1: summary shows the last output lines"
expect_grep "^      \| said-on-stdout$" "$T/out" "2>&1: stdout line in the summary's tail"
# Unfinished lines. On a terminal, a rank's unfinished line ("loading...", a '\r' progress
# bar, on stderr too) is shown in place at once, and printed as one line once complete.
cat > "$T/partial.py" <<'PY'
import sys, time
print("loading model...", end="", flush=True); time.sleep(2); print(" done", flush=True)
time.sleep(0.3); print("next line", flush=True)
for i in range(5):
    sys.stderr.write(f"\rprogress {i*25}%"); sys.stderr.flush(); time.sleep(0.4)
sys.stderr.write("\n")
PY
cat > "$T/on_tty.py" <<'PY'
import os, pty, sys, time, select, re
dtrain, script = sys.argv[1], sys.argv[2]
pid, fd = pty.fork()
if pid == 0:
    os.execv(dtrain, [dtrain, "run", "--nproc-per-node", "1", "--", "python3", script])
t0 = time.time(); got = []
while True:
    r, _, _ = select.select([fd], [], [], 10)
    if not r: break
    try: b = os.read(fd, 4096)
    except OSError: break
    if not b: break
    got.append((time.time() - t0, b))
os.waitpid(pid, 0)
def first(pat):
    acc = b""
    for t, b in got:
        acc += b
        if re.search(pat, acc): return t
    return None
allb = b"".join(b for _, b in got)
lp, dn = first(rb"\x1b\[2K\[rank 0\] loading model\.\.\."), first(rb"done")
print("partial-shown-early", lp is not None and dn is not None and dn - lp > 1.0)
print("complete-line", b"[rank 0] loading model... done\r\n" in allb)
# A completed line is not drawn again as unfinished, nor are the lines after it.
print("drawn-once", allb.count(b"loading model... done") == 1 and allb.count(b"next line") == 1)
p50, fin = first(rb"\x1b\[2K\[rank 0\] progress 50%"), first(rb"\[rank 0\] progress 100%\r\n")
print("bar-live", p50 is not None and fin is not None and fin - p50 > 0.5)
print("escapes", b"\x1b[" in allb)
PY
python3 "$T/on_tty.py" "$DTRAIN" "$T/partial.py" >"$T/check"
expect_grep "^partial-shown-early True" "$T/check" "terminal: unfinished line shown before it completes"
expect_grep "^complete-line True" "$T/check" "terminal: completed line printed whole"
expect_grep "^drawn-once True" "$T/check" "terminal: a completed line and the next ones drawn once"
expect_grep "^bar-live True" "$T/check" "terminal: '\\r' progress bar shown as it goes"
# Two ranks drawing '\r' bars: the line drawn in place stays with the first until its bar is
# complete (it flickered between the two on every update), then goes to the other.
cat > "$T/bars.py" <<'PY'
import os, sys, time
r = int(os.environ["RANK"])
time.sleep(0.4 * r)
for i in range(12 + 4 * r):
    sys.stdout.write(f"\rbar{r} {i}"); sys.stdout.flush(); time.sleep(0.12)
print(flush=True)
PY
python3 - "$DTRAIN" "$T/bars.py" >"$T/check" <<'PY'
import os, pty, re, select, sys
dtrain, script = sys.argv[1], sys.argv[2]
pid, fd = pty.fork()
if pid == 0:
    os.execv(dtrain, [dtrain, "run", "--nproc-per-node", "2", "--", "python3", script])
out = b""
while True:
    r, _, _ = select.select([fd], [], [], 15)
    if not r: break
    try: b = os.read(fd, 4096)
    except OSError: break
    if not b: break
    out += b
os.waitpid(pid, 0)
# (draws in place: followed by the next draw, not by the end of a completed line)
owners = [int(m) for m in re.findall(rb"\x1b\[2K\[rank (\d)\] bar\d \d+(?=\r\x1b|$)", out)]
switches = sum(1 for a, b in zip(owners, owners[1:]) if a != b)
print("draws", len(owners) > 10, "switches", switches, "both-complete",
      b"[rank 0] bar0 11\r\n" in out and b"[rank 1] bar1 15\r\n" in out)
PY
expect_eq "$(cat "$T/check")" "draws True switches 1 both-complete True" "terminal: two ranks' bars do not take turns on the line drawn in place"
# TERM=dumb (an editor's shell buffer): a terminal that cannot redraw gets plain lines only.
TERM=dumb python3 "$T/on_tty.py" "$DTRAIN" "$T/partial.py" >"$T/check"
expect_grep "^partial-shown-early False" "$T/check" "TERM=dumb: no line drawn in place"
expect_grep "^escapes False" "$T/check" "TERM=dumb: no escape sequences"
# Off a terminal: an unfinished line idle for 1 s is written out; '\r' segments collapse to
# the last one.
"$DTRAIN" run --nproc-per-node 1 --log-dir "$T/logs4" -- python3 "$T/partial.py" >"$T/out" 2>&1 &
DTRAIN_PID=$!
# (the first thing written: the unfinished line, before the rest comes 2 s after it)
for _ in $(seq 40); do [ -s "$T/out" ] && break; sleep 0.1; done
expect_eq "$(cat "$T/out")" "[rank 0] loading model..." "file: unfinished line written out after 1 s idle"
wait "$DTRAIN_PID"; DTRAIN_PID=
expect_eq "$(cat "$T/out" | tr '\n' '|')" "[rank 0] loading model...|[rank 0]  done|[rank 0] next line|[rank 0] progress 100%|" "file: the rest follows; the bar is one line"
expect_eq "$(grep -v '^==== ' "$T/logs4/rank_0.log" | tr '\n' '|')" "loading model... done|next line|progress 100%|" "log: the rank's own file goes on with the rest on the same line"
# ... but a flushed piece that its newline ends alone, or that a '\r' draws over, is a line
# of its own there too (the next line was glued to it: a bar pausing made one log line).
"$DTRAIN" run --nproc-per-node 1 --log-dir "$T/logs4b" -- sh -c 'printf "loading..."; sleep 1.6; printf "\n"; echo next; printf "\r 10%%"; sleep 1.6; printf "\r 20%%"; sleep 1.6; printf "\r 30%%\n"' >"$T/out" 2>&1
expect_eq "$(grep -v '^==== ' "$T/logs4b/rank_0.log" | tr '\n' '|')" "loading...|next| 10%| 20%| 30%|" "log: a bare newline ends a flushed line; a bar pausing is one line per pause"
# Lines up to 1 MiB reach the console whole (a JSON record of 0.9 MB parsed as one; at 64 KiB
# it was cut, and the pieces of two ranks interleaved); a longer one is cut on the console,
# and stays whole in the rank's log. Stderr split off: a line of the other stream ends an
# unfinished one in the log first.
cat > "$T/big.py" <<'PY'
import json, os, sys, time
r = int(os.environ["RANK"])
print(json.dumps({"rank": r, "v": "a" * 900000}), flush=True)
print("b" * 1500000, flush=True)
print("half ", end="", flush=True); time.sleep(2.5)
print("err", file=sys.stderr, flush=True); time.sleep(0.2); print("rest", flush=True)
PY
"$DTRAIN" run --nproc-per-node 2 --log-dir "$T/logs_big" -- python3 "$T/big.py" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "long lines: the job succeeds"
expect_eq "$(python3 -c "
import json, sys
ok = 0
for l in open(sys.argv[1]):
    if l.startswith('[rank ') and '{' in l:
        d = json.loads(l.split('] ', 1)[1]); ok += d['v'] == 'a' * 900000
print(ok)" "$T/out")" 2 "long lines: a 0.9 MB JSON line of each rank reaches the console whole"
expect_eq "$(grep -c '^\[rank [01]\] bbbb' "$T/out") $(grep -o b "$T/out" | wc -l)" "4 3000000" "long lines: a 1.5 MB line cut once on the console, nothing lost"
expect_eq "$(awk 'length($0) == 1500000' "$T/logs_big/rank_1.log" | wc -l)" 1 "long lines: whole in the rank's log"
expect_eq "$(grep -v '^==== ' "$T/logs_big/rank_1.log" | grep -v '^[{b]' | tr '\n' '|')" "half |err|rest|" "log: a line of the other stream ends the unfinished one first"
# --log-dir keeps the error files ranks wrote (log_dir/<run id>/attempt_<n>/<rank>/error.json),
# and no empty directories for the ranks that wrote none, nor for a run without any.
"$DTRAIN" run --nproc-per-node 2 --log-dir "$T/logs5" -- true >"$T/out" 2>&1
expect_eq "$(cd "$T/logs5" && find . -mindepth 1 -type d | wc -l)" 0 "log dir: a run without error files leaves no directories"
"$DTRAIN" run --nproc-per-node 2 --log-dir "$T/logs6" -- sh -c '[ "$RANK" = 1 ] && { echo "{\"message\": {\"message\": \"boom\"}}" > "$TORCHELASTIC_ERROR_FILE"; exit 3; }; exit 0' >"$T/out" 2>&1
expect_eq "$?" 3 "log dir: the failing rank's exit code"
expect_eq "$(cd "$T/logs6" && find . -mindepth 1 | sed 's|^\./[0-9a-f]\{12\}|./RUN|' | sort | tr '\n' ' ')" "./.dtrain-logs.lock ./RUN ./RUN/attempt_0 ./RUN/attempt_0/1 ./RUN/attempt_0/1/error.json ./rank_0.log ./rank_1.log " "log dir: only the error file written is kept"
# A rank log that cannot be appended to (another user's, read-only) is refused before the
# launch, exit 2 (it failed the launch with exit 1). Needs another user: root runs as nobody,
# in a directory of its own outside $T (which only root may enter), also as its TMPDIR.
DT_ABS=$(realpath "$DTRAIN")
if [ "$(id -u)" = 0 ] && command -v setpriv >/dev/null && setpriv --reuid=65534 --regid=65534 --clear-groups "$DT_ABS" --version >/dev/null 2>&1; then
  RO=$(mktemp -d /tmp/dtrain-ro.XXXXXX) && chmod 1777 "$RO" && touch "$RO/rank_0.log" && chmod 444 "$RO/rank_0.log"
  (cd "$RO" && TMPDIR="$RO" setpriv --reuid=65534 --regid=65534 --clear-groups "$DT_ABS" run --log-dir "$RO" -- true) >"$T/out" 2>"$T/err"
  expect_eq "$?" 2 "read-only rank log: exit 2 before the launch"
  expect_grep "^dtrain: error: --log-dir: cannot append to $RO/rank_0.log: Permission denied" "$T/err" "read-only rank log: named"
  rm -rf "$RO"
else
  pass "read-only rank log: skipped (needs root and setpriv, and a binary 'nobody' can run)"
fi
# A rank log in the way as a directory: refused before the launch too (it was exit 1 from the
# launch, leaving empty error-file directories behind).
mkdir -p "$T/logs7/rank_1.log"
"$DTRAIN" run --nproc-per-node 2 --log-dir "$T/logs7" -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "rank log that is a directory: exit 2"
expect_grep "cannot append to .*/logs7/rank_1.log: it is a directory" "$T/err" "rank log that is a directory: named"
expect_eq "$(ls "$T/logs7")" "rank_1.log" "rank log that is a directory: nothing else made"
# A log dir on a full disk: the run goes on (the console has the output) and says once per
# rank that its log could not be written, instead of leaving empty logs without a word.
mkdir -p "$T/full"
if mount -t tmpfs -o size=16k tmpfs "$T/full" 2>/dev/null; then
  "$DTRAIN" run --nproc-per-node 2 --log-dir "$T/full/logs" -- sh -c 'head -c 30000 /dev/zero | tr "\0" x | fold -w 100; echo end' >"$T/out" 2>"$T/err"
  rc=$?
  umount "$T/full"
  expect_eq "$rc" 0 "full log dir: the job succeeds"
  expect_eq "$(grep -c '^\[rank [01]\] x*end$' "$T/out")" 2 "full log dir: the output reached the console"
  expect_eq "$(grep -c "^dtrain: warning: cannot write $T/full/logs/rank_[01].log: No space left on device; rank [01]'s output from here on is not in it" "$T/err")" 2 "full log dir: said once per rank"
else
  echo "skip: cannot mount a tmpfs (not root?)"
fi
# Closed stdin, stdout or stderr (a daemon's leftovers, `>&-`): dtrain's own descriptors took
# those numbers (the signal pipe), so its console lines were read back as signals: a newline
# was SIGUSR1, passed on to the worker, which died of it; "d" (100) threw from std::bitset.
"$DTRAIN" run --no-prefix --summary-json "$T/closed.json" -- sh -c 'echo; sleep 0.5; echo survived >&2' <&- >&- 2>"$T/err"
expect_eq "$?" 0 "stdin and stdout closed: the job succeeds"
expect_grep "^survived$" "$T/err" "stdin and stdout closed: the worker was not signalled"
"$DTRAIN" run --nproc-per-node 2 --summary-json "$T/closed2.json" -- true >&- 2>&-
expect_eq "$?" 0 "stdout and stderr closed: the job succeeds"
expect_eq "$(python3 -c "import json; print(json.load(open('$T/closed2.json'))['status'])")" succeeded "stdout and stderr closed: the summary"
# Runs at once on one log_dir (CI jobs of one spec): each rank_N.log held lines of every run,
# mixed. The one started while another holds the directory writes in log_dir/<run id>/.
cat >"$T/logjob.json" <<JSON
{"command": ["sh", "-c", "for i in 1 2 3 4 5; do echo line\$i run=\$DTRAIN_RUN_ID; sleep 0.3; done"], "nproc_per_node": 2, "log_dir": "$T/shared"}
JSON
"$DTRAIN" run "$T/logjob.json" >/dev/null 2>"$T/errA" & pa=$!
# (the second once the first holds the directory: started together, a loaded machine could
# start it after the first had ended)
for _ in $(seq 100); do [ -s "$T/shared/rank_0.log" ] && break; sleep 0.05; done
"$DTRAIN" run "$T/logjob.json" >/dev/null 2>"$T/errB" & pb=$!
wait $pa; ra=$?; wait $pb; rb=$?
expect_eq "$ra $rb" "0 0" "two runs on one log_dir: both succeed"
expect_eq "$(cat "$T/errA" "$T/errB" | grep -c "^dtrain: warning: log_dir (--log-dir) \"$T/shared\" is in use by another dtrain run (pid [0-9]* on .*); this run's logs go to $T/shared/[0-9a-f]*$")" 1 "two runs on one log_dir: the later one says where its logs go"
mixed=0; files=0
for f in $(find "$T/shared" -name 'rank_*.log'); do
  files=$((files + 1))
  [ "$(grep -o 'run=[0-9a-f]*' "$f" | sort -u | wc -l)" = 1 ] || mixed=1
  [ "$(grep -c '^line' "$f")" = 5 ] || mixed=1
done
expect_eq "$files $mixed" "4 0" "two runs on one log_dir: four rank logs, each with one run's five lines"
# One directory for both logs and checkpoints: its two locks are two files, not one job
# refusing itself.
cat >"$T/samedir.json" <<JSON
{"nproc_per_node": 2, "log_dir": "$T/both", "env": {"OMP_NUM_THREADS": "1"}, "trainer": {"model": {"layers": [4, 8, 3]},
 "data": {"type": "synthetic", "train_samples": 256, "eval_samples": 32}, "batch_size": 16, "max_steps": 4, "checkpoint": {"dir": "$T/both"}}}
JSON
"$DTRAIN" run "$T/samedir.json" >/dev/null 2>"$T/err"; expect_eq "$?" 0 "log_dir = checkpoint dir: runs"
grep -q "in use" "$T/err" && fail "log_dir = checkpoint dir: $(grep 'in use' "$T/err")" || pass "log_dir = checkpoint dir: no lock conflict with itself"
# A log_dir others can write in (security audit): a symbolic link at rank_0.log had this run
# append its output to the file the link named; a FIFO there hung dtrain in open() for good,
# SIGTERM and all; another user's world-writable directory (no sticky bit) was taken.
mkdir -p "$T/sl"; echo victim >"$T/victim"; ln -s "$T/victim" "$T/sl/rank_0.log"
"$DTRAIN" run --log-dir "$T/sl" -- echo hi >/dev/null 2>"$T/err"; expect_eq "$?" 2 "rank log that is a symlink: exit 2"
expect_grep "cannot append to $T/sl/rank_0.log: it is a symbolic link" "$T/err" "rank log that is a symlink: said"
expect_eq "$(cat "$T/victim")" victim "rank log that is a symlink: its target untouched"
rm "$T/sl/rank_0.log"; mkfifo "$T/sl/rank_0.log"
timeout 20 "$DTRAIN" run --log-dir "$T/sl" -- echo hi >/dev/null 2>"$T/err"; expect_eq "$?" 2 "rank log that is a FIFO: exit 2, no hang"
expect_grep "rank_0.log: it is not a regular file" "$T/err" "rank log that is a FIFO: said"
rm "$T/sl/rank_0.log"
if [ "$(id -u)" = 0 ]; then
  mkdir -p "$T/ww" && chmod 777 "$T/ww" && chown nobody "$T/ww"
  "$DTRAIN" run --log-dir "$T/ww" -- echo hi >/dev/null 2>"$T/err"; expect_eq "$?" 2 "another user's world-writable log_dir: exit 2"
  expect_grep "\"$T/ww\" belongs to another user and anyone may write in it" "$T/err" "another user's world-writable log_dir: said"
  chmod +t "$T/ww"
  "$DTRAIN" run --log-dir "$T/ww" -- echo hi >/dev/null 2>"$T/err"; expect_eq "$?" 0 "... with the sticky bit (as /tmp): taken"
fi
# metrics.svg is replaced, not written through a link; metrics.jsonl is not opened through one.
mkdir -p "$T/ml"; ln -s "$T/victim" "$T/ml/metrics.svg"
cat >"$T/ml.json" <<JSON
{"nproc_per_node": 1, "log_dir": "$T/ml", "trainer": {"model": {"layers": [4, 8, 3]},
 "data": {"type": "synthetic", "train_samples": 256, "eval_samples": 32}, "batch_size": 16, "max_steps": 4}}
JSON
"$DTRAIN" run "$T/ml.json" >/dev/null 2>"$T/err"; expect_eq "$?" 0 "metrics.svg that is a symlink: the job runs"
expect_eq "$(cat "$T/victim")" victim "metrics.svg that is a symlink: its target untouched"
[ -f "$T/ml/metrics.svg" ] && [ ! -L "$T/ml/metrics.svg" ] && pass "metrics.svg: a file of its own" || fail "metrics.svg: $(ls -l "$T/ml")"
# A stdout that cannot be written (a full disk; /dev/full here) where the output is the
# result (validate's resolved spec, --dry-run's plan, bench's table): one line naming stdout
# and the OS error, exit 1, not exit 0 for an answer no one saw. (dtrain run's workers' output
# is not its result: a job goes on without its console.)
for cmd in "validate" "run --dry-run"; do
  "$DTRAIN" $cmd --nproc-per-node 1 -- true >/dev/full 2>"$T/err"; expect_eq "$?" 1 "$cmd >/dev/full: exit 1"
  expect_grep "^dtrain: error: cannot write to stdout: No space left on device \(the (resolved spec|plan) was not printed whole\)$" "$T/err" "$cmd >/dev/full: said"
done
"$DTRAIN" bench allreduce -b 4K -e 4K -n 1 -w 0 >/dev/full 2>"$T/err"; expect_eq "$?" 1 "bench >/dev/full: exit 1"
expect_eq "$(cat "$T/err")" "dtrain: error: cannot write to stdout: No space left on device (the table was not printed whole)" "bench >/dev/full: said"
"$DTRAIN" validate --nproc-per-node 1 -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "validate to a file: exit 0"
# A console that takes nothing for a while (a stuck log collector, a slow `| tee`): dtrain's
# own loop goes on. A SIGTERM reached the worker only once the reader read again (dtrain
# was blocked writing a worker line), and timeout(1) could not stop the job. The worker is
# held meanwhile (dtrain stops reading its pipe at a few MiB: it never gets to print
# after-burst), and no line is lost once the reader reads again.
mkfifo "$T/stall"
( exec 3<"$T/stall"; sleep 6; date +%s.%N >"$T/resumed"; cat <&3 >"$T/stall.out" ) &
reader=$!
"$DTRAIN" run --nproc-per-node 1 --shutdown-timeout 2 --log-dir "$T/logs8" -- sh -c \
  "trap 'date +%s.%N >$T/termed; exit 143' TERM; yes xxxxxxxx | head -c 12000000; echo after-burst; while :; do sleep 0.1; done" \
  >"$T/stall" 2>"$T/stall.err" &
DTRAIN_PID=$!
sleep 2
date +%s.%N >"$T/killed"
kill -TERM "$DTRAIN_PID"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
date +%s.%N >"$T/ended"
wait "$reader"
expect_eq "$rc" 143 "stalled console: SIGTERM ends the job, exit 143"
python3 - "$T" >"$T/check" <<'PY'
import sys
t = sys.argv[1]
at = lambda n: float(open(f"{t}/{n}").read())
try:
    print("term-delay-ok", at("termed") - at("killed") < 2)
except FileNotFoundError:
    print("term-delay-ok no SIGTERM")
# (ended within --shutdown-timeout + a margin of the reader's resuming)
print("end-ok", at("ended") - at("resumed") < 4)
console = open(f"{t}/stall.out", "rb").read().split(b"\n")
log = open(f"{t}/logs8/rank_0.log", "rb").read().split(b"\n")
n = sum(1 for l in console if l == b"[rank 0] xxxxxxxx")
print("lines", n > 200000, n == sum(1 for l in log if l == b"xxxxxxxx"))
print("held", sum(1 for l in log if b"after-burst" in l))
PY
expect_eq "$(sed -n 1p "$T/check")" "term-delay-ok True" "stalled console: the worker gets SIGTERM at once"
expect_eq "$(sed -n 2p "$T/check")" "end-ok True" "stalled console: dtrain exits once the reader reads again"
expect_eq "$(sed -n 3p "$T/check")" "lines True True" "stalled console: every line read reaches the console and the log"
expect_eq "$(sed -n 4p "$T/check")" "held 0" "stalled console: the worker is held (backpressure), not read into memory"
# A worker held back that way is not hung: worker_timeout_s counts its silence from when
# dtrain reads from it again (it heartbeats between bursts of output that block it for
# longer than the timeout while the reader stalls).
cat > "$T/held.json" <<EOF
{"name": "held", "nproc_per_node": 1, "worker_timeout_s": 2,
 "command": ["sh", "-c", "for i in 1 2 3 4 5 6 7 8 9 10; do touch \"\$DTRAIN_WATCHDOG_FILE\"; yes xxxxxxxx | head -c 999999; done"]}
EOF
( exec 3<"$T/stall"; sleep 5; cat <&3 >"$T/stall.out" ) &
reader=$!
"$DTRAIN" run "$T/held.json" >"$T/stall" 2>"$T/stall.err"
expect_eq "$? $(grep -c '^\[rank 0\] xxxxxxxx$' "$T/stall.out")" "0 1111110" "stalled console: a worker held back is not killed as hung, and every line arrives"
wait "$reader"
# ... and a reader that never reads again: the job ends, dtrain waits for its console at the
# end (as any program's last write would), and a second stop signal ends that wait.
( exec 3<"$T/stall"; exec sleep 20 ) &
reader=$!
"$DTRAIN" run --nproc-per-node 1 --shutdown-timeout 2 --summary-json "$T/stall.json" -- sh -c 'yes | head -c 12000000' \
  >"$T/stall" 2>"$T/stall.err" &
DTRAIN_PID=$!
sleep 1
kill -TERM "$DTRAIN_PID"
sleep 1.5
expect_eq "$(python3 -c "import json; print(json.load(open('$T/stall.json'))['status'])")" failed "stalled console: the summary is written while dtrain waits for its console"
alive "$DTRAIN_PID" && pass "stalled console: dtrain waits for its console at the end" || fail "stalled console: dtrain did not wait for its console"
kill -TERM "$DTRAIN_PID"
t0=$(date +%s%N)
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc $(( ($(date +%s%N) - t0) / 1000000000 ))" "143 0" "stalled console: a second SIGTERM ends dtrain at once, exit 143"
kill "$reader" 2>/dev/null; wait "$reader" 2>/dev/null
# ... and with the workers holding out against the first Ctrl-C: dtrain's own lines on stderr
# (another file) reach it at once, not behind the stalled stdout, and the second Ctrl-C,
# which kills the workers "now", also ends dtrain's wait for its console (before: the stop
# notice sat behind stdout, and it took a third Ctrl-C).
( exec 3<"$T/stall"; exec sleep 20 ) &
reader=$!
"$DTRAIN" run --nproc-per-node 2 -- sh -c 'trap "" INT; while :; do echo xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx; done' \
  >"$T/stall" 2>"$T/stall.err" &
DTRAIN_PID=$!
sleep 1.5
kill -INT "$DTRAIN_PID"
sleep 0.5
expect_grep "^dtrain: SIGINT: stopping 2 workers \(SIGINT to the workers now, SIGKILL after 30 s\); Ctrl-C again to kill now$" "$T/stall.err" "stalled stdout: the stop notice reaches stderr at once"
kill -INT "$DTRAIN_PID"
t0=$(date +%s%N)
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
expect_eq "$rc" 130 "stalled stdout: the second Ctrl-C: exit 130"
[ "$ms" -lt 2500 ] && pass "stalled stdout: the second Ctrl-C ends dtrain at once (${ms} ms)" || fail "stalled stdout: the second Ctrl-C took ${ms} ms"
expect_grep "^dtrain: stopped by SIGINT; exit code 130$" "$T/stall.err" "stalled stdout: the verdict on stderr"
kill "$reader" 2>/dev/null; wait "$reader" 2>/dev/null
# ... and where stdout takes its output, a second Ctrl-C still leaves the summary written there
# (--summary-json -): only the wait for a console that takes nothing is cut short.
"$DTRAIN" run --nproc-per-node 1 --summary-json - -- sh -c 'trap "" INT; echo started; while :; do sleep 0.1; done' >"$T/twice.out" 2>"$T/twice.err" &
DTRAIN_PID=$!
for _ in $(seq 100); do grep -q started "$T/twice.out" && break; sleep 0.05; done
kill -INT "$DTRAIN_PID"; sleep 0.3; kill -INT "$DTRAIN_PID"
wait "$DTRAIN_PID"; rc=$?; DTRAIN_PID=
expect_eq "$rc:$(python3 -c 'import json,sys; t=open(sys.argv[1]).read(); print(json.loads(t[t.index("{"):])["stopped_by"])' "$T/twice.out")" "130:SIGINT" "two Ctrl-Cs: the summary still written to stdout"
# A non-blocking pipe as stdout and stderr (O_NONBLOCK left on a CI runner's pipe), read
# late: dtrain dropped most lines at EAGAIN, without a word, and exited 0.
cat > "$T/nonblock.py" <<'PY'
import fcntl, os, re, subprocess, sys, time
r, w = os.pipe()
fcntl.fcntl(w, fcntl.F_SETFL, fcntl.fcntl(w, fcntl.F_GETFL) | os.O_NONBLOCK)
worker = "for i in range(5000): print(f'line {i} ' + 'y' * 60, flush=True)"
p = subprocess.Popen([sys.argv[1], "run", "--nproc-per-node", "2", "--", "python3", "-c", worker], stdout=w, stderr=w)
os.close(w)
time.sleep(1.5)
data = b""
while True:
    b = os.read(r, 65536)
    if not b:
        break
    data += b
seen = {0: [], 1: []}
for l in data.split(b"\n"):
    m = re.fullmatch(rb"\[rank ([01])\] line (\d+) y{60}", l)
    if m:
        seen[int(m.group(1))].append(int(m.group(2)))
print(p.wait(), len(seen[0]) + len(seen[1]), all(seen[k] == list(range(5000)) for k in seen))
PY
expect_eq "$(python3 "$T/nonblock.py" "$DTRAIN")" "0 10000 True" "non-blocking stdout read late: every line, in order, exit 0"
# The log_dir's lock file is not opened through a symbolic link (it was, and truncated the
# link's target: a co-user of a group-writable directory could plant one; review finding).
mkdir -p "$T/ll"; echo precious >"$T/victim2"; ln -s "$T/victim2" "$T/ll/.dtrain-logs.lock"
"$DTRAIN" run --log-dir "$T/ll" -- echo hi >/dev/null 2>"$T/err"; expect_eq "$?" 0 "a symlinked log lock: the run goes on"
expect_eq "$(cat "$T/victim2")" precious "a symlinked log lock: its target untouched"
# On a terminal, workers (whose stdout is a pipe to dtrain) get its size in COLUMNS and LINES,
# less the "[rank N] " prefix: tqdm and rich took 80 columns. The spec's env wins; none when
# stdout is not a terminal.
script -qec "stty cols 150 rows 40; $DTRAIN run --nproc-per-node 2 -- sh -c 'echo cols=\$COLUMNS lines=\$LINES'" /dev/null 2>&1 | tr -d '\r' >"$T/cols.out"
expect_eq "$(grep -c '^\[rank [01]\] cols=141 lines=40$' "$T/cols.out")" 2 "a terminal's width, less the prefix, in COLUMNS; its height in LINES"
script -qec "stty cols 150 rows 40; $DTRAIN run --no-prefix --env COLUMNS=77 -- sh -c 'echo cols=\$COLUMNS lines=\$LINES'" /dev/null 2>&1 | tr -d '\r' >"$T/cols.out"
expect_grep "^cols=77 lines=40$" "$T/cols.out" "COLUMNS from the job's env wins"
"$DTRAIN" run -- sh -c 'echo "cols=${COLUMNS-unset}"' >"$T/cols.out" 2>/dev/null
expect_eq "$(cat "$T/cols.out")" "[rank 0] cols=unset" "no terminal: no COLUMNS"
# A worker that exits 0 leaving a process that writes on (a monitor started with '&'): its
# lines come through while the pipes are read, then dtrain says why it stops reading and ends
# (before: it read on for good, and even a SIGTERM did not end it). On one node and across
# nodes (each agent says it).
for hosts in "" "--hosts localhost:1,127.0.0.1:1"; do
  start=$(date +%s%N)
  timeout -k 5 30 "$DTRAIN" run --nproc-per-node 1 $hosts -- sh -c '(while :; do echo tick; sleep 0.1; done) & exit 0' >"$T/out" 2>"$T/err"
  rc=$?; ms=$(( ($(date +%s%N) - start) / 1000000 ))
  expect_eq "$rc" 0 "a writer left running ${hosts:-on one node}: exit 0"
  [ "$ms" -lt 6000 ] && pass "a writer left running ${hosts:-on one node}: ends in ${ms} ms" || fail "a writer left running ${hosts:-on one node}: took ${ms} ms"
  expect_grep "tick$" "$T/out" "a writer left running ${hosts:-on one node}: its lines came through meanwhile"
  expect_grep "rank [01] exited, but a process it left running still writes to its output; not read any more \(that process gets EPIPE or SIGPIPE\): redirect its output to keep it$" "$T/err" "a writer left running ${hosts:-on one node}: said"
done
finish
