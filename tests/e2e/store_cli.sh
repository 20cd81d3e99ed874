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
echo wrong > "$T/bad"; chmod 600 "$T/bad"
"$DTRAIN" store get greeting --endpoint "$EP" --token-file "$T/bad" 2>"$T/err"; expect_eq "$?" 5 "wrong token -> 5"
expect_grep "authentication failed" "$T/err" "wrong token message"
chmod 644 "$T/bad"
"$DTRAIN" store get greeting --endpoint "$EP" --token-file "$T/bad" 2>"$T/err"; expect_eq "$?" 2 "token file readable by others -> 2"
expect_grep "chmod 600" "$T/err" "token file fix named"
"$DTRAIN" store get greeting --endpoint 127.0.0.1:1 --token-file "$T/tok" --connect-timeout 0.3 2>"$T/err"; expect_eq "$?" 4 "unreachable -> 4"
expect_grep "store 127.0.0.1:1: cannot connect" "$T/err" "unreachable message"
"$DTRAIN" store get greeting --endpoint nonsense --token-file "$T/tok" 2>"$T/err"; expect_eq "$?" 2 "bad endpoint -> 2"
env -u DTRAIN_STORE_TOKEN "$DTRAIN" store get greeting --endpoint "$EP" 2>"$T/err"; expect_eq "$?" 2 "no token -> 2"
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
