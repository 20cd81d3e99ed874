# `dtrain store`: a served store driven from shell, exit codes a script can branch on, and
# workers of `dtrain run` meeting through the job's own store.
source "$(dirname "$0")/lib.sh"
"$DTRAIN" store serve --port 0 --token-file "$T/tok" >"$T/serve.out" 2>"$T/serve.err" &
SERVE=$!
trap 'kill $SERVE 2>/dev/null; cleanup' EXIT
wait_for "$T/tok"
for _ in $(seq 50); do grep -q "serving on" "$T/serve.out" && break; sleep 0.1; done
EP=$(sed -n 's/^dtrain store: serving on //p' "$T/serve.out")
[[ "$EP" =~ ^127\.0\.0\.1:[0-9]+$ ]] && pass "serve prints its endpoint ($EP)" || fail "no endpoint: $(cat "$T/serve.out" "$T/serve.err")"
expect_eq "$(stat -c %a "$T/tok")" 600 "token file created 0600"
S() { "$DTRAIN" store "$@" --endpoint "$EP" --token-file "$T/tok"; }
S set greeting "hello world"; expect_eq "$?" 0 "set"
expect_eq "$(S get greeting)" "hello world" "get"
expect_eq "$(S add n 5)" 5 "add"
expect_eq "$(S add n -2)" 3 "add negative"
S check greeting n; expect_eq "$?" 0 "check present"
S check greeting missing; expect_eq "$?" 1 "check missing -> 1"
S delete n; expect_eq "$?" 0 "delete"
S delete n; expect_eq "$?" 1 "delete absent -> 1"
start=$(date +%s%N)
S wait never --timeout 0.5 2>"$T/err"; expect_eq "$?" 3 "wait timeout -> 3"
ms=$(( ($(date +%s%N) - start) / 1000000 ))
[ "$ms" -ge 500 ] && [ "$ms" -lt 3000 ] && pass "timeout honoured (${ms} ms)" || fail "timeout took ${ms} ms"
expect_grep "store $EP: timed out after 0.5 s waiting for key 'never'" "$T/err" "timeout names endpoint and key"
( sleep 0.3; S set late 1 ) &
S wait late --timeout 10; expect_eq "$?" 0 "wait woken by a later set"
# A value whose reader went away was not delivered: exit 1, said (not death by SIGPIPE).
S get greeting 2>"$T/err" | true; expect_eq "${PIPESTATUS[0]}" 1 "get to a closed pipe -> 1"
expect_grep "^dtrain: error: cannot write to stdout: Broken pipe \(the value was not printed\)$" "$T/err" "get to a closed pipe: said"
S add piped 5 2>"$T/err" | true; expect_eq "${PIPESTATUS[0]}" 1 "add to a closed pipe -> 1"
expect_grep "^dtrain: error: cannot write to stdout: Broken pipe \(the add was done, the key is now 5, but that was not printed\)$" "$T/err" "add to a closed pipe: the add said as done"
echo wrong-token-0123456789 > "$T/bad"; chmod 600 "$T/bad"
"$DTRAIN" store get greeting --endpoint "$EP" --token-file "$T/bad" 2>"$T/err"; expect_eq "$?" 5 "wrong token -> 5"
expect_grep "authentication failed" "$T/err" "wrong token message"
# A token that can be guessed is refused before anything connects, with the way to make one.
printf 'a\n' >"$T/weak"; chmod 600 "$T/weak"
"$DTRAIN" store get greeting --endpoint "$EP" --token-file "$T/weak" 2>"$T/err"; expect_eq "$?" 2 "weak token file -> 2"
expect_grep "^dtrain: error: --token-file $T/weak: the token is 1 character; a token must have at least 16 \(a short one can be guessed\); write a new one: openssl rand -hex 32 > $T/weak$" "$T/err" "weak token file: the fix named"
"$DTRAIN" store serve --port 0 --token-file "$T/weak" 2>"$T/err"; expect_eq "$?" 2 "serve with a weak token file -> 2"
expect_grep "the token is 1 character" "$T/err" "serve: weak token named"
DTRAIN_STORE_TOKEN=x "$DTRAIN" store get greeting --endpoint "$EP" 2>"$T/err"; expect_eq "$?" 2 "weak DTRAIN_STORE_TOKEN -> 2"
expect_grep "^dtrain: error: DTRAIN_STORE_TOKEN: the token is 1 character; .*export DTRAIN_STORE_TOKEN=[$][(]openssl rand -hex 32[)]$" "$T/err" "weak DTRAIN_STORE_TOKEN: the fix named"
DTRAIN_STORE_TOKEN=x "$DTRAIN" store serve --port 0 2>"$T/err"; expect_eq "$?" 2 "serve with a weak DTRAIN_STORE_TOKEN -> 2"
# Something else listening at the endpoint (without the token) is refused as not the store:
# it cannot prove the token, whatever it answers (docs/store-protocol.md, version 2).
if command -v python3 >/dev/null; then
  python3 - "$T/fake.port" >"$T/fake.out" 2>&1 <<'PY' &
import os, socket, struct, sys
ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(4)
open(sys.argv[1] + ".tmp", "w").write(str(ls.getsockname()[1])); os.rename(sys.argv[1] + ".tmp", sys.argv[1])
c, _ = ls.accept()
body = b"\x85" + struct.pack(">HI", 2, 32) + os.urandom(32)
c.sendall(struct.pack(">I", len(body)) + body)   # CHALLENGE, version 2
c.recv(4096)                                      # AUTH: not checked, the token is unknown here
c.sendall(struct.pack(">I", 1) + b"\x80")         # "OK"
print("requests after the handshake:", len(c.recv(4096)))
PY
  FAKE=$!
  wait_for "$T/fake.port"
  "$DTRAIN" store get job/spec --endpoint "127.0.0.1:$(cat "$T/fake.port")" --token-file "$T/tok" 2>"$T/err"
  expect_eq "$?" 5 "a listener without the token -> 5"
  expect_grep "the server did not prove that it knows the job token, so it is not this job's store" "$T/err" "impostor named as not the store"
  wait $FAKE
  expect_grep "requests after the handshake: 0" "$T/fake.out" "no request sent to the impostor"
  # Another service at the endpoint (an HTTP server) is named as not a dtrain store, with what
  # it sent, exit 5 as for any listener that is not the store (not "frame of 1213486160 bytes").
  python3 - "$T/http.port" >/dev/null 2>&1 <<'PY' &
import os, socket, sys
ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(4)
open(sys.argv[1] + ".tmp", "w").write(str(ls.getsockname()[1])); os.rename(sys.argv[1] + ".tmp", sys.argv[1])
c, _ = ls.accept()
c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"); c.close()
PY
  HTTPD=$!
  wait_for "$T/http.port"
  HEP="127.0.0.1:$(cat "$T/http.port")"
  "$DTRAIN" store get k --endpoint "$HEP" --token-file "$T/tok" 2>"$T/err"; expect_eq "$?" 5 "an HTTP server at the endpoint -> 5"
  expect_grep "^dtrain: error: store $HEP did not answer as a dtrain store \(is this a dtrain store\? it sent \"HTTP/1.1 400 Bad Request" "$T/err" "HTTP server named as not a store"
  one_line_err() { expect_eq "$(wc -l <"$T/err")" 1 "$1: one line"; }
  one_line_err "HTTP server"
  wait $HTTPD
fi
chmod 644 "$T/bad"
"$DTRAIN" store get greeting --endpoint "$EP" --token-file "$T/bad" 2>"$T/err"; expect_eq "$?" 2 "token file readable by others -> 2"
expect_grep "chmod 600" "$T/err" "token file fix named"
"$DTRAIN" store get greeting --endpoint 127.0.0.1:1 --token-file "$T/tok" --connect-timeout 0.3 2>"$T/err"; expect_eq "$?" 4 "unreachable -> 4"
expect_grep "store 127.0.0.1:1: cannot connect" "$T/err" "unreachable message"
"$DTRAIN" store get greeting --endpoint nonsense --token-file "$T/tok" 2>"$T/err"; expect_eq "$?" 2 "bad endpoint -> 2"
# --connect-timeout 0 tries once: a live store answers, a dead port fails with its own cause.
expect_eq "$(S get greeting --connect-timeout 0)" "hello world" "--connect-timeout 0 connects to a live store"
"$DTRAIN" store get greeting --endpoint 127.0.0.1:1 --token-file "$T/tok" --connect-timeout 0 2>"$T/err"; expect_eq "$?" 4 "--connect-timeout 0, nothing listening -> 4"
expect_grep "^dtrain: error: store 127.0.0.1:1: cannot connect: Connection refused \(one attempt, no retries\)$" "$T/err" "--connect-timeout 0: the attempt's own error"
# A second colon is not part of a host name; IPv6 literals go in brackets (and still work).
"$DTRAIN" store get greeting --endpoint "$EP:99" --token-file "$T/tok" 2>"$T/err"; expect_eq "$?" 2 "endpoint with two ports -> 2"
expect_grep "^dtrain: error: --endpoint: expected HOST:PORT .*got \"$EP:99\"$" "$T/err" "two ports named as a bad --endpoint"
"$DTRAIN" store get greeting --endpoint "::1:${EP##*:}" --token-file "$T/tok" 2>"$T/err"; expect_eq "$?" 2 "unbracketed IPv6 -> 2"
expect_grep "brackets: \[::1\]:PORT" "$T/err" "unbracketed IPv6: brackets suggested"
"$DTRAIN" store get greeting --endpoint "[::1]:1" --token-file "$T/tok" --connect-timeout 0 2>"$T/err"; expect_eq "$?" 4 "bracketed IPv6 is taken (nothing there -> 4)"
expect_grep "store \\[::1\\]:1: cannot connect" "$T/err" "bracketed IPv6 host parsed"
# A name that does not exist is asked about again until --connect-timeout (it may appear: a
# pod's DNS entry), and then named as unresolved.
"$DTRAIN" store get greeting --endpoint no-such-host.invalid:1 --token-file "$T/tok" --connect-timeout 2 2>"$T/err"; expect_eq "$?" 4 "unknown host -> 4"
if grep -q "cannot resolve host 'no-such-host.invalid'" "$T/err"; then
  pass "unknown host named as unresolved"
else
  # No resolver answering here (EAI_AGAIN is temporary, so retried): nothing to check.
  pass "unknown host: resolver gave a temporary error ($(cat "$T/err")); not checked"
fi
# Without --endpoint the error names the environment variable it came from.
env -u DTRAIN_STORE_ADDR DTRAIN_STORE_PORT=abc "$DTRAIN" store get k --token-file "$T/tok" 2>"$T/err"; expect_eq "$?" 2 "DTRAIN_STORE_PORT=abc -> 2"
expect_grep "^dtrain: error: DTRAIN_STORE_PORT: expected a port from 1 to 65535, got \"abc\"; fix it, or pass --endpoint HOST:PORT$" "$T/err" "bad DTRAIN_STORE_PORT named"
grep -q -- "--endpoint:" "$T/err" && fail "env endpoint blamed on --endpoint" || pass "env endpoint not blamed on --endpoint"
env -u DTRAIN_STORE_ADDR DTRAIN_STORE_PORT=${EP##*:} "$DTRAIN" store get k --token-file "$T/tok" 2>"$T/err"; expect_eq "$?" 2 "DTRAIN_STORE_PORT without ADDR -> 2"
expect_grep "^dtrain: error: DTRAIN_STORE_ADDR: not set" "$T/err" "missing DTRAIN_STORE_ADDR named"
expect_eq "$(DTRAIN_STORE_ADDR=127.0.0.1 DTRAIN_STORE_PORT=${EP##*:} "$DTRAIN" store get greeting --token-file "$T/tok")" "hello world" "endpoint from DTRAIN_STORE_ADDR/PORT"
env -u DTRAIN_STORE_TOKEN "$DTRAIN" store get greeting --endpoint "$EP" 2>"$T/err"; expect_eq "$?" 2 "no token -> 2"

# Refused requests and bad arguments: exit 2 with exactly one line naming what is wrong.
one_line() { expect_eq "$(wc -l <"$1")" 1 "$2: one line"; expect_grep "^dtrain: error: " "$1" "$2: dtrain: error: prefix"; }
expect_eq "$(S add ov 9223372036854775807)" 9223372036854775807 "add up to INT64_MAX"
S add ov 1 >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "add past INT64_MAX refused -> 2"
expect_grep "add on key 'ov': 9223372036854775807 \+ 1 would overflow int64; the value is unchanged" "$T/err" "overflow message"
one_line "$T/err" "overflow"
expect_eq "$(cat "$T/out")" "" "overflow prints no value"
expect_eq "$(S get ov)" 9223372036854775807 "overflowing add left the value"
S delete ov; expect_eq "$(S add ov -9223372036854775808)" -9223372036854775808 "add down to INT64_MIN"
S add ov -1 2>"$T/err"; expect_eq "$?" 2 "add below INT64_MIN refused -> 2"
expect_grep "would overflow int64" "$T/err" "underflow message"
S add n 99999999999999999999 >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "delta beyond int64 -> 2"
expect_grep "^dtrain: error: delta: 99999999999999999999 is out of range; expected an integer from -9223372036854775808 to 9223372036854775807$" "$T/err" "delta out of range named"
one_line "$T/err" "delta out of range"
S check n; expect_eq "$?" 1 "refused delta created no key"
S add n 0x10 2>"$T/err"; expect_eq "$?" 2 "hex delta -> 2"
expect_grep "delta: expected an integer" "$T/err" "hex delta message"
S get greeting --timeout 1e999 2>"$T/err"; expect_eq "$?" 2 "--timeout beyond range -> 2"
expect_grep "^dtrain: error: --timeout: expected seconds from 0 to 31536000, got \"1e999\"$" "$T/err" "--timeout named"
S get greeting --timeout 99999999999999999999 2>"$T/err"; expect_eq "$?" 2 "huge --timeout -> 2"
S get greeting --timeout nan 2>"$T/err"; expect_eq "$?" 2 "--timeout nan -> 2"
S get greeting --connect-timeout -1 2>"$T/err"; expect_eq "$?" 2 "negative --connect-timeout -> 2"
expect_grep "^dtrain: error: --connect-timeout: expected seconds" "$T/err" "--connect-timeout named"
"$DTRAIN" store get greeting --endpoint "${EP}x" --token-file "$T/tok" 2>"$T/err"; expect_eq "$?" 2 "endpoint port with trailing text -> 2"
expect_grep "^dtrain: error: --endpoint: expected HOST:PORT" "$T/err" "endpoint port message"
"$DTRAIN" store serve --port 99999999999999999999 --token-file "$T/tok" 2>"$T/err"; expect_eq "$?" 2 "serve --port beyond range -> 2"
expect_grep "^dtrain: error: --port: 99999999999999999999 is out of range; expected an integer from 0 to 65535$" "$T/err" "serve --port named"

# add on a value that is not a number: one line, the key named, exit 2 (refused as given).
S add greeting 1 >"$T/out" 2>"$T/err"; expect_eq "$?" 2 "add on a non-integer -> 2"
expect_grep "add on key 'greeting': its value is not an integer" "$T/err" "non-integer names the key"
expect_eq "$(grep -o 'not an integer' "$T/err" | wc -l)" 1 "non-integer said once"
one_line "$T/err" "non-integer"
expect_eq "$(S get greeting)" "hello world" "refused add left the value"

# Keys and values starting with '-' after --.
SP() { "$DTRAIN" store "$1" --endpoint "$EP" --token-file "$T/tok" "${@:2}"; }
SP set -- -k -v 2>"$T/err"; expect_eq "$?" 0 "set -- -k -v"
expect_eq "$(SP get -- -k)" "-v" "get -- -k"
expect_eq "$(SP add -- -n -3)" -3 "add -- -n -3"
SP check -- -k -n; expect_eq "$?" 0 "check -- -k -n"
SP delete -- -k; expect_eq "$?" 0 "delete -- -k"
S set -k v 2>"$T/err"; expect_eq "$?" 2 "a '-' key without -- -> 2"
expect_grep "goes after the options and --, as in: dtrain store set \[options\] -- -k$" "$T/err" "'-' key: -- suggested"

# Token files: each problem named with the fix that fits it (never chmod for a directory).
for d in /tmp "$T"; do
  "$DTRAIN" store get greeting --endpoint "$EP" --token-file "$d" 2>"$T/err"; expect_eq "$?" 2 "token file $d (directory) -> 2"
  expect_grep "^dtrain: error: --token-file $d: is a directory; give the token file$" "$T/err" "directory $d named as such"
  grep -q chmod "$T/err" && fail "directory $d: chmod advised" || pass "directory $d: no chmod advice"
done
"$DTRAIN" store get greeting --endpoint "$EP" --token-file "$T/absent" 2>"$T/err"; expect_eq "$?" 2 "missing token file -> 2"
expect_grep "^dtrain: error: --token-file $T/absent: no such token file; check the path$" "$T/err" "missing token file message"
: >"$T/empty"; chmod 600 "$T/empty"
"$DTRAIN" store get greeting --endpoint "$EP" --token-file "$T/empty" 2>"$T/err"; expect_eq "$?" 2 "empty token file -> 2"
expect_grep "token file is empty" "$T/err" "empty token file message"
"$DTRAIN" store get greeting --endpoint "$EP" --token-file /dev/null 2>"$T/err"; expect_eq "$?" 2 "device as token file -> 2"
expect_grep "/dev/null: is not a regular file" "$T/err" "device named as such"
if [ "$(id -u)" != 0 ]; then  # root reads mode-000 files
  echo x >"$T/locked"; chmod 000 "$T/locked"
  "$DTRAIN" store get greeting --endpoint "$EP" --token-file "$T/locked" 2>"$T/err"; expect_eq "$?" 2 "unreadable token file -> 2"
  expect_grep "permission denied" "$T/err" "unreadable token file message"
fi
"$DTRAIN" store serve --port 0 --token-file /nonexist/tok 2>"$T/err"; expect_eq "$?" 2 "serve: token file in a missing directory -> 2"
expect_grep "^dtrain: error: --token-file /nonexist/tok: cannot create the token file: its directory does not exist; check the path$" "$T/err" "serve names the token path"
"$DTRAIN" store serve --port 0 --token-file "$T" 2>"$T/err"; expect_eq "$?" 2 "serve: token file is a directory -> 2"
expect_grep "is a directory; give the token file" "$T/err" "serve: directory named as such"

# A store that stops answering (SIGSTOPped: the kernel still takes connections) holds a
# client no longer than it asked: a get at its --timeout plus 5 s of grace (exit 3), the
# handshake at --connect-timeout (exit 4), each naming the endpoint.
"$DTRAIN" store serve --port 0 --token-file "$T/tok" >"$T/stop.out" 2>&1 &
STOPPED=$!
trap 'kill $SERVE 2>/dev/null; kill -CONT $STOPPED 2>/dev/null; kill $STOPPED 2>/dev/null; cleanup' EXIT
for _ in $(seq 50); do grep -q "serving on" "$T/stop.out" && break; sleep 0.1; done
SEP=$(sed -n 's/^dtrain store: serving on //p' "$T/stop.out")
SS() { "$DTRAIN" store "$@" --endpoint "$SEP" --token-file "$T/tok"; }
took_ms() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }
( start=$(date +%s%N); SS get nokey --timeout 1 --connect-timeout 1 2>"$T/err"; echo "$? $(took_ms $start)" >"$T/rc" ) &
GETTER=$!
sleep 0.5; kill -STOP $STOPPED  # while the get waits
wait $GETTER
read -r rc ms <"$T/rc"
expect_eq "$rc" 3 "get --timeout 1 on a store stopped while it waits -> 3"
[ "$ms" -ge 5500 ] && [ "$ms" -lt 9000 ] && pass "stopped store: get ended after its timeout and the grace (${ms} ms)" || fail "stopped store: get took ${ms} ms"
expect_grep "^dtrain: error: store $SEP: no reply within 6 s \(the 1 s wait and 5 s grace\): the server did not answer" "$T/err" "stopped store: the get's error names the endpoint"
start=$(date +%s%N)
SS set k v --connect-timeout 1 2>"$T/err"; expect_eq "$?" 4 "set --connect-timeout 1 on a stopped store -> 4"
ms=$(took_ms $start)
[ "$ms" -ge 900 ] && [ "$ms" -lt 3000 ] && pass "stopped store: handshake given up at --connect-timeout (${ms} ms)" || fail "stopped store: set took ${ms} ms"
expect_grep "^dtrain: error: store $SEP: the server accepted the connection but did not answer the handshake within 1 s" "$T/err" "stopped store: the handshake's error names the endpoint"
kill -CONT $STOPPED; kill -TERM $STOPPED; wait $STOPPED

kill -TERM $SERVE; wait $SERVE; expect_eq "$?" 0 "serve stops on SIGTERM with 0"

# Workers meet through the job's store, found from DTRAIN_STORE_* alone.
cat > "$T/w.sh" <<'SH'
"$DTRAIN" store add arrived 1 >/dev/null || exit 11
"$DTRAIN" store set "hello/$RANK" "from-$RANK" || exit 10
"$DTRAIN" store wait hello/0 hello/1 hello/2 --timeout 20 || exit 12
echo "rank $RANK sees $("$DTRAIN" store get hello/$(( (RANK + 1) % 3 ))) and $("$DTRAIN" store get arrived) arrivals"
SH
DTRAIN="$DTRAIN" "$DTRAIN" run --nproc-per-node 3 -- bash "$T/w.sh" >"$T/out" 2>"$T/err"
expect_eq "$?" 0 "workers used the job store"
expect_grep "^\[rank 0\] rank 0 sees from-1 and 3 arrivals$" "$T/out" "rank 0 read rank 1's key"
expect_grep "^\[rank 2\] rank 2 sees from-0 and 3 arrivals$" "$T/out" "rank 2 read rank 0's key"
finish
