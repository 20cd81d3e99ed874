# The multi-host test bed itself (scripts/testbed): real sshd per host, each host in its own
# network and UTS namespace, hosts reach each other and the launching machine, leftovers
# are visible, an unreachable host fails fast, and teardown leaves nothing behind.
# Exits 77 (skip) where the test bed cannot run (not root, no network namespaces).
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/testbed_lib.sh"

testbed_up 3
expect_eq "$TESTBED_HOSTS" "h1 h2 h3" "three hosts in the env file"

# Each host: a real ssh login, its own hostname and its own address on its own eth0.
for h in $TESTBED_HOSTS; do
  addr_var="TESTBED_ADDR_$h"
  addr=${!addr_var}
  out=$(tb_ssh "$h" 'hostname; ip -4 -o addr show; cat /proc/self/net/dev' 2>"$T/ssh.err")
  expect_eq "$?" 0 "ssh $h"
  expect_eq "$(sed -n 1p <<<"$out")" "$h" "hostname on $h"
  grep -q "inet $addr/24" <<<"$out" && pass "$h has $addr" || fail "$h lacks $addr: $out"
  n_addrs=$(grep -c ' inet ' <<<"$out")
  expect_eq "$n_addrs" 2 "$h sees only lo and its own address (own network namespace)"
  grep -q "eth0" <<<"$out" && ! grep -q "$TESTBED_BRIDGE" <<<"$out" \
    && pass "$h sees its own interfaces, not the root namespace's" \
    || fail "$h interfaces: $out"
done
[ "$(hostname)" != h1 ] && pass "root namespace keeps its hostname" || fail "root hostname became h1"

# Host to host: ssh from inside h1 to h2 (same filesystem, so the same config and key),
# and plain TCP from h3 to h1's sshd.
expect_eq "$(tb_ssh h1 ssh -F "$TESTBED_SSH_CONFIG" h2 hostname 2>&1)" h2 "ssh h1 -> h2"
banner=$(tb_ssh h3 "exec 3<>/dev/tcp/$TESTBED_ADDR_h1/22 && head -c 8 <&3" 2>&1)
expect_eq "$banner" "SSH-2.0-" "TCP h3 -> h1:22"

# Host to launching machine on any port, and the real dtrain on the hosts: a store served
# on the bridge address, written from h1 and read from h2 with the same binary.
"$DTRAIN" store serve --bind "$TESTBED_GATEWAY" --port 0 --token-file "$T/tok" \
  >"$T/serve.out" 2>"$T/serve.err" &
SERVE=$!
DTRAIN_PID=$SERVE   # lib.sh's cleanup kills it if the test dies early
wait_for "$T/tok"
for _ in $(seq 50); do grep -q "serving on" "$T/serve.out" && break; sleep 0.1; done
EP=$(sed -n 's/^dtrain store: serving on //p' "$T/serve.out")
[[ "$EP" == "$TESTBED_GATEWAY:"* ]] && pass "store on the gateway ($EP)" || fail "no endpoint: $(cat "$T/serve.out" "$T/serve.err")"
expect_eq "$(tb_ssh h1 "$DTRAIN" --version 2>&1)" "$("$DTRAIN" --version)" "dtrain runs on h1 by the same path"
tb_ssh h1 "$DTRAIN" store set from h1 --endpoint "$EP" --token-file "$T/tok"
expect_eq "$?" 0 "h1 -> store on the launching machine"
expect_eq "$(tb_ssh h2 "$DTRAIN" store get from --endpoint "$EP" --token-file "$T/tok" 2>&1)" h1 \
  "h2 reads what h1 wrote"
kill "$SERVE"; wait "$SERVE" 2>/dev/null; DTRAIN_PID=

# Leftovers: a detached process started over ssh shows in tb_pids; once killed, none.
tb_wait_no_pids h2 5 && pass "h2 starts empty" || fail "h2 not empty at start"
tb_ssh h2 'setsid nohup sleep 300 </dev/null >/dev/null 2>&1 & echo $!' >"$T/sleep.pid"
sp=$(cat "$T/sleep.pid")
tb_pids h2 | grep -qx "$sp" && pass "tb_pids h2 lists the detached sleep ($sp)" \
  || fail "tb_pids h2 lacks $sp: $(tb_pids h2 | tr '\n' ' ')"
tb_wait_no_pids h2 0.3 2>"$T/left.err"; expect_eq "$?" 1 "tb_wait_no_pids reports leftovers"
expect_grep "sleep 300" "$T/left.err" "leftover listing names the process"
tb_pids h1 | grep -qx "$sp" && fail "h2's sleep shows on h1" || pass "h1 does not see h2's process"
kill -9 "$sp"
tb_wait_no_pids h2 5 && pass "killed: h2 empty again" || fail "h2 not empty after kill"

# An unreachable host fails within ssh's ConnectTimeout (5 s), not after minutes.
start=$(date +%s%N)
tb_ssh "$TESTBED_DOWN_HOST" true 2>"$T/down.err"; rc=$?
ms=$(( ($(date +%s%N) - start) / 1000000 ))
expect_eq "$rc" 255 "ssh to $TESTBED_DOWN_HOST fails"
[ "$ms" -lt 8000 ] && pass "$TESTBED_DOWN_HOST fails in ${ms} ms" || fail "$TESTBED_DOWN_HOST took ${ms} ms"

# Teardown leaves nothing: no namespaces, no bridge or veths, no sshd, no state.
leftover_sleep=$(tb_ssh h3 'setsid nohup sleep 300 </dev/null >/dev/null 2>&1 & echo $!')
testbed_down
ip netns list | grep -q '^dtb-' && fail "namespaces left: $(ip netns list)" || pass "no dtb- namespaces"
ip link show dtb-br0 >/dev/null 2>&1 && fail "bridge dtb-br0 left" || pass "no bridge"
ip -o link show | grep -q ' dtb-' && fail "links left: $(ip -o link show | grep ' dtb-')" || pass "no dtb- links"
pgrep -f /tmp/dtrain-testbed/ >/dev/null && fail "testbed sshd left: $(pgrep -af /tmp/dtrain-testbed/)" || pass "no testbed sshd"
# A SIGKILLed process leaves its network namespace (so down's `ip netns pids` loop ends)
# a moment before it is a zombie: allow it that moment.
for _ in $(seq 20); do alive "$leftover_sleep" || break; sleep 0.1; done
alive "$leftover_sleep" && fail "process left on h3 survived down" || pass "down killed h3's leftover"
[ -e /tmp/dtrain-testbed ] && fail "state dir left" || pass "no state dir"
ip -4 route show | grep -q '10\.213\.0\.' && fail "route left: $(ip -4 route)" || pass "no test bed route"
finish
