# Multi-host test bed helpers for end-to-end tests (scripts/testbed/testbed.sh). Source
# after lib.sh:
#   source "$(dirname "$0")/lib.sh"; source "$(dirname "$0")/testbed_lib.sh"
#   testbed_up 3                 # hosts h1..h3; exits 77 (SKIP) where it cannot run
#   tb_ssh h2 hostname           # -> h2
#   tb_wait_no_pids h2 10 || fail "leftovers on h2"
# After testbed_up the variables of $TESTBED_DIR/env are exported: TESTBED_SSH_CONFIG,
# TESTBED_HOSTS="h1 h2 h3", TESTBED_ADDR_h1=10.213.0.11, TESTBED_GATEWAY=10.213.0.1,
# TESTBED_DOWN_HOST=hdown (an address where nothing answers), TESTBED_HOSTFILE, ...
# The test bed is torn down on exit, chained onto the EXIT trap set before testbed_up
# (lib.sh's cleanup); a test that sets its own EXIT trap later must call testbed_down in it.
# One test bed per machine: tests using it must not overlap (ctest RESOURCE_LOCK).
TESTBED_SH="$SRC/scripts/testbed/testbed.sh"
TESTBED_SKIP=77   # ctest: set_tests_properties(... SKIP_RETURN_CODE 77)

# Exits 77 with "SKIP: why" if this machine cannot host the test bed.
_tb_require() {
  local why="" t
  if [ "$(id -u)" -ne 0 ]; then
    why="test bed needs root (network namespaces, bridge, sshd)"
  else
    for t in ip ssh ssh-keygen unshare flock timeout; do
      command -v "$t" >/dev/null || { why="'$t' not installed (scripts/setup.sh)"; break; }
    done
    [ -z "$why" ] && [ ! -x /usr/sbin/sshd ] && why="/usr/sbin/sshd not installed (openssh-server)"
    # Network namespaces may be refused (container without CAP_SYS_ADMIN); probe without
    # leaving anything behind.
    [ -z "$why" ] && ! unshare --net true 2>/dev/null && why="cannot create network namespaces here"
    [ -z "$why" ] && ! ip netns list >/dev/null 2>&1 && why="'ip netns' does not work here"
    # Root in a user namespace passes the checks above but may not change this network
    # namespace's links; the test bed needs a bridge here.
    if [ -z "$why" ]; then
      if ip link add "dtbp-$$" type bridge 2>/dev/null; then
        ip link delete "dtbp-$$" 2>/dev/null
      else
        why="cannot create a bridge in this network namespace"
      fi
    fi
  fi
  [ -z "$why" ] && return 0
  echo "SKIP: $why"
  exit "$TESTBED_SKIP"
}

# Tears the test bed down (idempotent); runs on exit.
testbed_down() {
  "$TESTBED_SH" down >/dev/null 2>&1 || echo "warning: testbed.sh down failed" >&2
}

# testbed_up N: fresh test bed of N hosts (leftovers of a killed run are removed first).
testbed_up() {
  local n=${1:-3} prev
  _tb_require
  # Chain onto whatever EXIT trap is set (lib.sh's cleanup, or a test's own): `trap -p`
  # prints it quoted for re-use, e.g. "trap -- 'cleanup' EXIT". Registered before `up`
  # so that a failing or interrupted `up` is cleaned too; only once per test.
  if [ -z "${_TB_TRAP_SET:-}" ]; then
    prev=$(trap -p EXIT)
    if [ -n "$prev" ]; then
      eval "set -- $prev"   # -> trap -- CMD EXIT
      _TB_PREV_TRAP=$3
    else
      _TB_PREV_TRAP=:
    fi
    trap 'testbed_down; eval "$_TB_PREV_TRAP"' EXIT
    _TB_TRAP_SET=1
  fi
  if ! "$TESTBED_SH" up "$n" >"$T/testbed-up.log" 2>&1; then
    echo "FAIL: testbed.sh up $n failed:" >&2
    sed 's/^/    /' "$T/testbed-up.log" >&2
    exit 1
  fi
  # shellcheck source=/dev/null
  source /tmp/dtrain-testbed/env
}

# tb_ssh HOST CMD...: runs CMD on HOST (h1.., hdown) as root, through the test bed's config.
tb_ssh() {
  local host=$1; shift
  ssh -F "$TESTBED_SSH_CONFIG" "$host" "$@"
}

# tb_ns HOST: the network namespace of HOST (h2 -> dtb-h2).
tb_ns() {
  local v="TESTBED_NS_$1"
  [ -n "${!v:-}" ] || { echo "tb_ns: no test bed host '$1'" >&2; return 2; }
  echo "${!v}"
}

# tb_pids HOST: pids of every process in HOST's namespace except its sshd listener, one a
# line: sessions in progress and whatever they started, i.e. leftovers once a job is over.
tb_pids() {
  local ns listener
  ns=$(tb_ns "$1") || return 2
  listener=$(cat "$TESTBED_DIR/$1/sshd.pid" 2>/dev/null || echo none)
  ip netns pids "$ns" | grep -vx -- "$listener" | sort -n || true
}

# tb_wait_no_pids HOST SECONDS (may be fractional): waits until tb_pids HOST is empty; otherwise lists what is
# left (ps) on stderr and returns 1.
tb_wait_no_pids() {
  local host=$1 secs=$2 pids deadline
  # (%.0f: Debian's awk, mawk, prints %d of a number past 2^31 as 2147483647, so every wait
  # was 2.1 s at most, and an agent that took a little longer to go counted as left over)
  deadline=$(( $(date +%s%N) + $(awk -v s="$secs" 'BEGIN { printf "%.0f", s * 1e9 }') ))
  while :; do
    pids=$(tb_pids "$host") || return 2
    [ -z "$pids" ] && return 0
    [ "$(date +%s%N)" -ge "$deadline" ] && break
    sleep 0.1
  done
  echo "leftover processes on $host after ${secs} s:" >&2
  # shellcheck disable=SC2086
  ps -o pid,ppid,stat,etime,args -p "$(echo $pids | tr ' ' ,)" >&2 || true
  return 1
}
