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

# What the workers started goes too: a wrapper script's child (a shell running python, a
# DataLoader's processes) is not reached by the worker's own death signal; dtrain's guard
# process kills each worker's whole process group when dtrain dies. Single node, and
# across (local) nodes, where each node's agent dies with dtrain.
for hosts in "" "--hosts localhost:1,127.0.0.1:1"; do
  rm -f "$T"/gpid.*
  D="$T" "$DTRAIN" run --nproc-per-node 2 $hosts -- sh -c 'sleep 120 & echo $! > "$D/gpid.$RANK"; wait' >/dev/null 2>&1 &
  DTRAIN_PID=$!
  wait_for "$T/gpid.0" "$T/gpid.1"
  kill -9 "$DTRAIN_PID"; wait "$DTRAIN_PID" 2>/dev/null
  DTRAIN_PID=
  for r in 0 1; do
    p=$(cat "$T/gpid.$r")
    for _ in $(seq 100); do alive "$p" || break; sleep 0.1; done
    alive "$p" && { fail "${hosts:-local}: rank $r's child (pid $p) outlived dtrain"; kill -9 "$p"; } || pass "${hosts:-local}: rank $r's child gone"
  done
done
finish
