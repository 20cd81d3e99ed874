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
# What exec cannot take (before: validate and --dry-run passed, then every worker failed
# 126 with "fix the command, PATH or cwd"): one argument or environment string over 128 KiB,
# or all of them over ARG_MAX; each named where it was given, exit 2, nothing started.
big=$(head -c 140000 /dev/zero | tr '\0' x)
printf '{"command": ["true"], "env": {"BIG": "%s"}}\n' "$big" > "$T/bigenv.json"
"$DTRAIN" validate "$T/bigenv.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a 140 KB env value: exit 2"
expect_grep "^dtrain: error: $T/bigenv.json: /env/BIG: the value of BIG is 140000 bytes, and Linux passes at most 131067 bytes in one environment string" "$T/err" "a 140 KB env value: named, with the limit"
"$DTRAIN" run "$T/bigenv.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a 140 KB env value: run refuses"
printf 'A=1\nBIG=%s\n' "$big" > "$T/big.env"
printf '{"command": ["true"], "env_file": "%s"}\n' "$T/big.env" > "$T/bigenvfile.json"
"$DTRAIN" validate "$T/bigenvfile.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a 140 KB env_file value: exit 2"
expect_grep "^dtrain: error: $T/big.env:2: the value of BIG is 140000 bytes" "$T/err" "a 140 KB env_file value: file and line"
# Text after a closed quote (a shell would join it) is said as that, not as an open quote.
printf 'A="a"b\n' >"$T/after.env"
printf '{"command": ["true"], "env_file": "%s"}\n' "$T/after.env" > "$T/after.json"
"$DTRAIN" validate "$T/after.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "env_file A=\"a\"b: exit 2"
expect_grep "^dtrain: error: $T/after.env:1: text after the closing quote in the value of A; quote the whole value" "$T/err" "env_file A=\"a\"b: said as it is"
# MASTER_PORT on the store's own port (rendezvous.port), from --env: refused before the launch.
printf '{"command": ["true"], "rendezvous": {"port": 29517}}\n' > "$T/mp.json"
"$DTRAIN" run "$T/mp.json" --env MASTER_PORT=29517 >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "--env MASTER_PORT=rendezvous.port: exit 2"
expect_grep "^dtrain: error: --env: MASTER_PORT=29517 is the job's store port \(/rendezvous/port\)" "$T/err" "--env MASTER_PORT=rendezvous.port: said"
printf '{"command": ["echo", "%s"]}\n' "$big" > "$T/bigarg.json"
"$DTRAIN" run --dry-run "$T/bigarg.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a 140 KB argument: exit 2"
expect_grep "^dtrain: error: $T/bigarg.json: /command/1: is 140000 bytes, and Linux passes at most 131071 bytes in one argument" "$T/err" "a 140 KB argument: named"
python3 - "$T/manyargs.json" <<'PY'
import json, sys
json.dump({"command": ["true"] + ["y" * 100000] * 40}, open(sys.argv[1], "w"))
PY
"$DTRAIN" validate "$T/manyargs.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "4 MB of arguments: exit 2"
expect_grep "^dtrain: error: $T/manyargs.json: /command and /env: the workers' command and environment come to about [0-9]+ KiB \(3906 KiB of them /command.*over the [0-9]+ KiB exec takes on this host" "$T/err" "4 MB of arguments: said, with the sizes"
# (the kernel's measure: a quarter of the stack limit, at most 6 MiB)
if (ulimit -s 65536) 2>/dev/null; then
  (ulimit -s 65536; "$DTRAIN" validate "$T/manyargs.json" >"$T/out" 2>"$T/err")
  expect_eq "$?" 0 "4 MB of arguments under a 64 MiB stack limit: accepted"
fi
# What the fuzzing review found passing validate and failing later, or said without its place.
# A name past what every worker's environment (DTRAIN_JOB_NAME) can take: every worker failed
# exec with 126 after validate passed.
python3 -c 'import json,sys; json.dump({"name": "x" * 131056, "command": ["true"]}, open(sys.argv[1], "w"))' "$T/longname.json"
"$DTRAIN" validate "$T/longname.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a 128 KiB job name: exit 2"
expect_eq "$(cat "$T/err")" "dtrain: error: $T/longname.json: /name: is 131056 bytes; a job name is at most 1024 (every worker gets it in DTRAIN_JOB_NAME, and every message says it): shorten it" "a 128 KiB job name: said, with its place"
# A value quoted whole in the error (100 KB for a number) is cut around its middle: one line
# a terminal and a CI log can show, with its place and what was expected (it was 100 KB).
python3 -c 'import json,sys; json.dump({"nproc_per_node": "x" * 100000, "command": ["true"]}, open(sys.argv[1], "w"))' "$T/bigval.json"
"$DTRAIN" validate "$T/bigval.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a 100 KB value: exit 2"
expect_grep "^dtrain: error: $T/bigval.json: /nproc_per_node: expected a worker count between 1 and 4096 or \"auto\", got the string \"x{159}\.\.\.\[99802 bytes\]\.\.\.x{39}\"$" "$T/err" \
  "a 100 KB value: cut around its middle, with its place"
[ "$(wc -c < "$T/err")" -lt 1024 ] && pass "a 100 KB value: the line is short" || fail "a 100 KB value: $(wc -c < "$T/err") bytes said"
# An IPv6 zone with ':' in it: the slot count of fe80::1%eth0:2 was dropped without a word.
printf 'fe80::1%%eth0:2\n' > "$T/zone.hosts"
"$DTRAIN" validate --hostfile "$T/zone.hosts" -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "an IPv6 zone with a colon: exit 2"
expect_grep "zone.hosts:1: \"fe80::1%eth0:2\": \"eth0:2\" after '%' is not an interface name \(a zone is eth0, ib0 or an index\); N workers on an IPv6 address are written \[fe80::1%eth0\]:N" "$T/err" "an IPv6 zone with a colon: the fix"
printf '[fe80::1%%eth0]:2\n' > "$T/zone.hosts"
"$DTRAIN" validate --hostfile "$T/zone.hosts" -- true >"$T/out" 2>"$T/err"
expect_grep "^  node 0: +fe80::1%eth0: 2 slots, ssh$" "$T/out" "[fe80::1%eth0]:2: two slots"
# A log_dir of the spec's that cannot be made: said as the spec's /log_dir (it said
# "log_dir (--log-dir)", a flag never given).
touch "$T/afile"
printf '{"command": ["true"], "log_dir": "%s/afile/x"}' "$T" > "$T/logdir.json"
"$DTRAIN" validate "$T/logdir.json" >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "a log_dir under a file: exit 2"
expect_grep "^dtrain: error: $T/logdir.json: /log_dir: \"$T/afile/x\" cannot be created: $T/afile is not a directory" "$T/err" "a log_dir under a file: the spec's field named"
"$DTRAIN" validate --log-dir "$T/afile/x" -- true >"$T/out" 2>"$T/err"
expect_grep "^dtrain: error: --log-dir: \"$T/afile/x\" cannot be created" "$T/err" "--log-dir under a file: the flag named"
# More hosts than a job may have nodes (max_nodes itself is refused past 4096).
python3 -c 'import sys; open(sys.argv[1], "w").write("".join("10.%d.%d.1\n" % (i // 250, i % 250) for i in range(4097)))' "$T/many.hosts"
"$DTRAIN" validate --hostfile "$T/many.hosts" -- true >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "4097 hosts: exit 2"
expect_grep "many.hosts: 4097 hosts, and a job runs on at most 4096 nodes" "$T/err" "4097 hosts: said"
finish
