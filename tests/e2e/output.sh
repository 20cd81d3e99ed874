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
for r in 0 1 2 3; do
  n=$(grep -caE "^\[rank $r\] $r:[0-9]+:x{3000}:end$" "$T/out")
  expect_eq "$n" 2000 "rank $r: 2000 whole lines"
  expect_grep "^\[rank $r\] err-from-$r$" "$T/err" "rank $r unterminated stderr line"
  n=$(grep -caE "^$r:[0-9]+:x{3000}:end$" "$T/logs/rank_$r.log")
  expect_eq "$n" 2000 "rank $r log file has every line, unprefixed"
done
bad=$(grep -cavE '^\[rank [0-3]\] ([0-3]:[0-9]+:x{3000}:end|.*junk)$' "$T/out")
expect_eq "$bad" 0 "no split or interleaved lines"
expect_eq "$(grep -ca junk "$T/out")" 4 "binary junk passed through"

# --local-ranks-filter: console shows only rank 1, files still get everything.
"$DTRAIN" run --nproc-per-node 3 --local-ranks-filter 1 --log-dir "$T/logs2" -- sh -c 'echo "hello $RANK"' >"$T/out" 2>"$T/err"
expect_eq "$(cat "$T/out")" "[rank 1] hello 1" "console filtered to rank 1"
expect_eq "$(cat "$T/logs2/rank_2.log")" "hello 2" "filtered rank still logged"

# --no-prefix
"$DTRAIN" run --nproc-per-node 1 --no-prefix -- echo plain >"$T/out" 2>&1
expect_eq "$(cat "$T/out")" "plain" "--no-prefix"
finish
