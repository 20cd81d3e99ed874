# Every spec in tests/spec/bad/ is refused with exit 2 and one line naming the file, the JSON
# path and the problem (the .expected file holds a fragment of that line).
source "$(dirname "$0")/lib.sh"
n=0
for spec in "$SRC"/tests/spec/bad/*.json; do
  exp="${spec%.json}.expected"
  name=$(basename "$spec" .json)
  "$DTRAIN" validate "$spec" >"$T/out" 2>"$T/err"; rc=$?
  expect_eq "$rc" 2 "$name: exit 2"
  expect_eq "$(wc -l < "$T/err")" 1 "$name: one line"
  grep -qF -- "dtrain: error: $spec" "$T/err" && pass "$name: names the file" || fail "$name: file not named: $(cat "$T/err")"
  grep -qF -- "$(cat "$exp")" "$T/err" && pass "$name: message" || fail "$name: expected '$(cat "$exp")' in: $(cat "$T/err")"
  # run refuses the same way and starts nothing.
  "$DTRAIN" run "$spec" >"$T/out" 2>"$T/err2"; rc=$?
  expect_eq "$rc" 2 "$name: run exits 2"
  n=$((n + 1))
done
[ "$n" -ge 20 ] && pass "$n bad specs checked" || fail "only $n bad specs"

# Files that cannot be read.
"$DTRAIN" validate "$T/nope.json" 2>"$T/err"; expect_eq "$?" 2 "missing file exit 2"
expect_grep "nope.json: cannot open job spec: no such file; check the path" "$T/err" "missing file message"
"$DTRAIN" validate "$T" 2>"$T/err"; expect_eq "$?" 2 "directory exit 2"
expect_grep "is a directory" "$T/err" "directory message"
# Not a file at all: an endless device is refused after a bounded read (not by exhausting
# memory), and a pipe, as from bash's <(...), is read to its end.
timeout 20 "$DTRAIN" validate /dev/zero 2>"$T/err"; expect_eq "$?" 2 "/dev/zero as a spec: exit 2"
expect_grep "^dtrain: error: /dev/zero: too large for a job spec \(more than the 16 MiB limit\)" "$T/err" "/dev/zero message"
timeout 20 "$DTRAIN" run --hostfile /dev/zero -- true 2>"$T/err"; expect_eq "$?" 2 "--hostfile /dev/zero: exit 2"
expect_grep "/dev/zero: too large for a hostfile \(more than the 16 MiB limit\); give a hostfile" "$T/err" "--hostfile /dev/zero message"
# Nested thousands deep (a 2 MB file): refused at once; each level kept its path, so time and
# memory grew with the square of the depth (depth 100000: 70 s and 10 GB).
python3 -c "d = 1000000; print('{\"command\": [\"true\"], \"x\": ' + '[' * d + ']' * d + '}')" >"$T/deep.json"
timeout 20 "$DTRAIN" validate "$T/deep.json" 2>"$T/err"; expect_eq "$?" 2 "a spec nested a million deep: exit 2"
expect_grep "^dtrain: error: $T/deep.json:1:90: invalid JSON: nested more than 64 levels deep" "$T/err" "a spec nested a million deep: said, with the place"
"$DTRAIN" validate <(cat "$SRC/configs/quickstart.json") >"$T/out" 2>"$T/err"; expect_eq "$?" 0 "a spec from <(...) validates"
expect_grep "trainer" "$T/out" "the piped spec was read whole"
"$DTRAIN" run --hostfile <(echo "localhost slots=2") --dry-run -- true >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "a hostfile from <(...) is read"
expect_eq "$(grep -c " true$" "$T/out")" 2 "2 ranks from the piped hostfile"
finish
