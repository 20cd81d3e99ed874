# dtrain killed with SIGKILL leaves no worker alive.
source "$(dirname "$0")/lib.sh"
D="$T" "$DTRAIN" run --nproc-per-node 3 -- sh -c 'echo $$ > "$D/pid.$RANK"; exec sleep 120' >/dev/null 2>&1 &
DTRAIN_PID=$!
wait_for "$T/pid.0" "$T/pid.1" "$T/pid.2"
kill -9 "$DTRAIN_PID"; wait "$DTRAIN_PID" 2>/dev/null
DTRAIN_PID=
sleep 0.5
for r in 0 1 2; do
  p=$(cat "$T/pid.$r")
  # Up to 10 s: on a machine loaded 5x over its cores a killed process may wait that long for a CPU.
  for _ in $(seq 100); do alive "$p" || break; sleep 0.1; done
  alive "$p" && { fail "rank $r (pid $p) outlived dtrain"; kill -9 "$p"; } || pass "rank $r gone"
done
finish
