#!/usr/bin/env bash
# A multi-host test bed on one machine: N network namespaces dtb-h1..dtb-hN, each a "host"
# with its own address, hostname (UTS namespace) and a real OpenSSH sshd, joined by the
# bridge dtb-br0 in the root namespace. For dtrain's multi-node tests; needs root.
#
#   testbed.sh up N     tear down leftovers, then create hosts h1..hN (prints the env file)
#   testbed.sh down     kill everything in the namespaces, remove them, the bridge, the state
#   testbed.sh status   list the hosts and whether each sshd answers (exit 0 = all answer)
#
# Addresses (private to the test bed, 10.213.0.0/24): the bridge (root namespace side) is
# 10.213.0.1, host i is 10.213.0.(10+i), and "hdown" (10.213.0.250) is an address on the
# subnet where nothing listens. State (keys, configs, pids, logs, ssh_config, env) lives in
# /tmp/dtrain-testbed; see README.md next to this script.
set -euo pipefail
export LC_ALL=C

# Fixed on purpose: `down` must find what an earlier (possibly killed) run left, and it
# deletes this directory, so it is not taken from the environment.
DIR=/tmp/dtrain-testbed
LOCK=/tmp/dtrain-testbed.lock   # outside DIR, which `down` deletes
NS_PREFIX=dtb-h
VETH_PREFIX=dtb-v                # root-side end of host i's veth: dtb-v<i>
BRIDGE=dtb-br0
NET=10.213.0
GATEWAY=$NET.1
DOWN_ADDR=$NET.250
SSHD=/usr/sbin/sshd               # sshd re-executes itself, so it needs an absolute path
MAX_HOSTS=200                     # keeps host addresses (.11 .. .210) clear of .250

log() { echo "testbed: $*" >&2; }
die() { log "error: $*"; exit 1; }

need_root_tools() {
  [ "$(id -u)" -eq 0 ] || die "must run as root (network namespaces, bridge, sshd)"
  local t
  for t in ip ssh ssh-keygen unshare flock timeout; do
    command -v "$t" >/dev/null || die "'$t' not found (scripts/setup.sh installs it)"
  done
  [ -x "$SSHD" ] || die "$SSHD not found (apt-get install openssh-server)"
}

# Serialises up/down/status of concurrent callers: they share one set of names. Only held
# while this script runs; the fd is closed for the daemons we start (see start_sshd), else
# they would hold the lock for their whole life.
take_lock() {
  exec 9>"$LOCK"
  flock -w 120 9 || die "another testbed.sh has held $LOCK for 120 s"
}

# Namespaces of ours, also those of an earlier run with a different N.
our_namespaces() {
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${NS_PREFIX}[0-9]+\$" || true
}

# Root-side veth ends of ours (normally gone with their namespace, but a half-made up may
# leave one behind).
our_veths() {
  ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' \
    | grep -E "^${VETH_PREFIX}[0-9]+\$" || true
}

# Bridged traffic between the hosts passes through iptables/ip6tables/arptables when
# br_netfilter is loaded (bridge-nf-call-* = 1), where a firewall (Docker's FORWARD DROP,
# say) may drop it. The per-bridge nf_call_* options cannot override the global switch, so
# the global one is turned off while the test bed is up and restored by `down`.
BRNF_KEYS="bridge-nf-call-iptables bridge-nf-call-ip6tables bridge-nf-call-arptables"
disable_bridge_nf() {
  local k f
  for k in $BRNF_KEYS; do
    f=/proc/sys/net/bridge/$k
    [ -w "$f" ] || continue   # br_netfilter not loaded: bridged traffic is not filtered
    echo "$k $(cat "$f")" >>"$DIR/bridge-nf.saved"
    echo 0 >"$f" || log "warning: could not set $k=0; bridged traffic may be filtered"
  done
}
restore_bridge_nf() {
  local saved=$DIR/bridge-nf.saved k v
  [ -f "$saved" ] || return 0
  while read -r k v; do
    [ -w "/proc/sys/net/bridge/$k" ] && echo "$v" >"/proc/sys/net/bridge/$k" || true
  done <"$saved"
}

# Kill every process in a namespace, wait until none is left (kill -9 is asynchronous),
# then delete it. Never fails: `down` must always get to the end.
kill_namespace() {
  local ns=$1 pids i
  for i in $(seq 50); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$pids" ] && break
    # shellcheck disable=SC2086
    kill -9 $pids 2>/dev/null || true
    sleep 0.1
  done
  [ -z "$pids" ] || log "warning: processes still in $ns: $pids"
  ip netns delete "$ns" 2>/dev/null || true
}

do_down() {
  local ns v
  for ns in $(our_namespaces); do kill_namespace "$ns"; done
  # A listener whose namespace name was deleted by hand (`ip netns delete`) is not listed
  # above but still runs; its pid file finds it, its command line (our config) confirms.
  if [ -d "$DIR" ]; then
    local pf p
    for pf in "$DIR"/h*/sshd.pid; do
      [ -f "$pf" ] || continue
      p=$(cat "$pf" 2>/dev/null || true)
      if [[ "$p" =~ ^[0-9]+$ ]] && grep -qF "$DIR/" "/proc/$p/cmdline" 2>/dev/null; then
        kill -9 "$p" 2>/dev/null || true
      fi
    done
  fi
  for v in $(our_veths); do ip link delete "$v" 2>/dev/null || true; done
  ip link delete "$BRIDGE" 2>/dev/null || true
  restore_bridge_nf
  rm -rf "$DIR"
}

write_sshd_config() {
  local i=$1 addr=$2 hd=$DIR/h$1
  cat >"$hd/sshd_config" <<CFG
# Test bed host h$i; generated by scripts/testbed/testbed.sh. Self-contained: nothing is
# read from /etc/ssh, so the machine's own sshd settings do not leak in.
ListenAddress $addr
Port 22
HostKey $hd/ssh_host_ed25519_key
PidFile $hd/sshd.pid
AuthorizedKeysFile $DIR/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# The state dir lives in /tmp (sticky, world-writable); StrictModes would refuse it.
StrictModes no
# dtrain opens several sessions per host at once (pre-flight, agents, workers).
MaxStartups 100
MaxSessions 100
UseDNS no
PrintMotd no
PrintLastLog no
X11Forwarding no
AcceptEnv LANG LC_*
Subsystem sftp /usr/lib/openssh/sftp-server
LogLevel INFO
CFG
  # OpenSSH >= 9.8 throttles addresses that fail auth or drop connections; tests do both
  # on purpose, from one address. Older sshd rejects the keyword, so add it only if known.
  cp "$hd/sshd_config" "$hd/sshd_config.probe"
  echo "PerSourcePenalties no" >>"$hd/sshd_config.probe"
  if "$SSHD" -t -f "$hd/sshd_config.probe" 2>/dev/null; then
    mv "$hd/sshd_config.probe" "$hd/sshd_config"
  else
    rm -f "$hd/sshd_config.probe"
  fi
  "$SSHD" -t -f "$hd/sshd_config" || die "h$i: sshd rejects $hd/sshd_config"
}

# sshd runs its sessions' commands through root's shell, and bash then reads ~/.bashrc.
# A developer's bashrc can be slow and serialising (pyenv init: ~2 s a session, and a
# 60 s lock wait with 20 sessions at once), which would make multi-node tests slow and
# flaky; CI's root has a stock one. So the hosts get a stock, empty bashrc, bind-mounted
# over root's own in the host's private mount namespace (made by `ip netns exec`; the
# machine itself is unaffected). TESTBED_KEEP_BASHRC=1 keeps root's own.
bashrc_target() {
  local home
  [ "${TESTBED_KEEP_BASHRC:-0}" = 1 ] && return 0
  home=$(getent passwd root | cut -d: -f6)
  [ -f "$home/.bashrc" ] && echo "$home/.bashrc"
  return 0
}

# sshd in the host's network namespace and in a UTS namespace of its own, so `hostname`
# there prints h<i>. sshd daemonises (stdio to /dev/null, so callers capturing our output
# do not hang) and writes its pid file; its sessions inherit all three namespaces.
start_sshd() {
  local i=$1 hd=$DIR/h$1 rc
  rc=$(bashrc_target)
  [ -z "$rc" ] || echo "# dtrain test bed: root's bashrc on the hosts (see testbed.sh)" >"$DIR/bashrc"
  # shellcheck disable=SC2016  # $1.. expand in the inner sh
  ip netns exec "${NS_PREFIX}$i" unshare --uts sh -c '
      hostname "$1" || exit 1
      if [ -n "$5" ]; then mount --bind "$6" "$5" || exit 1; fi
      exec "$2" -f "$3" -E "$4"' \
    sh "h$i" "$SSHD" "$hd/sshd_config" "$hd/sshd.log" "$rc" "$DIR/bashrc" 9>&- </dev/null \
    || die "h$i: sshd did not start (see $hd/sshd.log)"
}

add_host() {
  local i=$1 ns=${NS_PREFIX}$1 addr=$NET.$((10 + $1)) hd=$DIR/h$1
  mkdir -p "$hd"
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  # The host's end is called eth0, like a real machine's NIC.
  ip link add "${VETH_PREFIX}$i" type veth peer name eth0 netns "$ns"
  ip link set "${VETH_PREFIX}$i" master "$BRIDGE" up
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" route add default via "$GATEWAY"
  ssh-keygen -q -t ed25519 -N '' -C "h$i.dtrain-testbed" -f "$hd/ssh_host_ed25519_key"
  write_sshd_config "$i" "$addr"
  echo "h$i,$addr $(cut -d' ' -f1,2 "$hd/ssh_host_ed25519_key.pub")" >>"$DIR/known_hosts"
}

ssh_client_block() {
  cat <<BLK
  User root
  IdentityFile $DIR/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $DIR/known_hosts
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  CheckHostIP no
  BatchMode yes
  ConnectTimeout 5
  ControlMaster no
  LogLevel ERROR
BLK
}

write_client_files() {
  local n=$1 i hosts=""
  {
    echo "# dtrain test bed: ssh -F $DIR/ssh_config h1 ..."
    for i in $(seq "$n"); do
      echo "Host h$i"
      echo "  HostName $NET.$((10 + i))"
      ssh_client_block
    done
    echo "# An address on the test bed's subnet where nothing answers: for pre-flight failures."
    echo "Host hdown"
    echo "  HostName $DOWN_ADDR"
    ssh_client_block
    echo "# The hosts by address, for tools given addresses rather than names."
    echo "Host $NET.*"
    ssh_client_block
  } >"$DIR/ssh_config"
  for i in $(seq "$n"); do hosts="$hosts h$i"; echo "h$i"; done >"$DIR/hostfile"
  hosts=${hosts# }
  {
    echo "# dtrain test bed, $n host(s); generated by scripts/testbed/testbed.sh"
    echo "export TESTBED_DIR=$DIR"
    echo "export TESTBED_SSH_CONFIG=$DIR/ssh_config"
    echo "export TESTBED_KEY=$DIR/id_ed25519"
    echo "export TESTBED_KNOWN_HOSTS=$DIR/known_hosts"
    echo "export TESTBED_HOSTFILE=$DIR/hostfile"
    echo "export TESTBED_N=$n"
    echo "export TESTBED_HOSTS=\"$hosts\""
    echo "export TESTBED_GATEWAY=$GATEWAY"
    echo "export TESTBED_BRIDGE=$BRIDGE"
    for i in $(seq "$n"); do
      echo "export TESTBED_ADDR_h$i=$NET.$((10 + i))"
      echo "export TESTBED_NS_h$i=${NS_PREFIX}$i"
    done
    echo "export TESTBED_DOWN_HOST=hdown"
    echo "export TESTBED_ADDR_hdown=$DOWN_ADDR"
  } >"$DIR/env"
}

# Up to 10 s for sshd to accept a real login (key, host key, shell), not just the port.
wait_ssh() {
  local h=$1 i
  for i in $(seq 50); do
    timeout 5 ssh -F "$DIR/ssh_config" "$h" true </dev/null 2>/dev/null && return 0
    sleep 0.2
  done
  timeout 5 ssh -F "$DIR/ssh_config" "$h" true </dev/null || true
  die "$h: no ssh login after 10 s (log: $DIR/$h/sshd.log)"
}

do_up() {
  local n=$1 i
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$MAX_HOSTS" ] \
    || die "up: N must be 1..$MAX_HOSTS, got '$n'"
  do_down
  # Refuse to shadow a real network of this machine that uses the same subnet.
  if [ -n "$(ip -4 route show "$NET.0/24" 2>/dev/null)" ] \
     || ip -4 -o addr show | grep -q " $NET\."; then
    die "$NET.0/24 is already in use on this machine: $(ip -4 -o addr show | grep " $NET\." || ip -4 route show "$NET.0/24")"
  fi
  mkdir -p "$DIR"
  chmod 700 "$DIR"
  mkdir -p /run/sshd   # privilege separation directory; normally made by the init script
  chmod 755 /run/sshd
  ssh-keygen -q -t ed25519 -N '' -C root@dtrain-testbed -f "$DIR/id_ed25519"
  cp "$DIR/id_ed25519.pub" "$DIR/authorized_keys"
  : >"$DIR/known_hosts"

  ip link add "$BRIDGE" type bridge stp_state 0
  ip addr add "$GATEWAY/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  disable_bridge_nf
  for i in $(seq "$n"); do add_host "$i"; done
  write_client_files "$n"
  for i in $(seq "$n"); do start_sshd "$i"; done
  for i in $(seq "$n"); do wait_ssh "h$i"; done
  log "up: $n host(s); env: $DIR/env, ssh config: $DIR/ssh_config"
  echo "$DIR/env"
}

do_status() {
  local nss ns h addr pid state rc=0
  nss=$(our_namespaces | sort -V)
  if [ -z "$nss" ]; then echo "testbed: down"; return 1; fi
  printf '%-6s %-14s %-8s %s\n' HOST ADDRESS SSHD STATE
  for ns in $nss; do
    h=h${ns#"$NS_PREFIX"}
    addr=$NET.$((10 + ${ns#"$NS_PREFIX"}))
    pid=$(cat "$DIR/$h/sshd.pid" 2>/dev/null || echo -)
    if [ -f "$DIR/ssh_config" ] \
       && timeout 8 ssh -F "$DIR/ssh_config" "$h" true </dev/null 2>/dev/null; then
      state=answers
    else
      state="NOT ANSWERING"; rc=1
    fi
    printf '%-6s %-14s %-8s %s\n' "$h" "$addr" "$pid" "$state"
  done
  return "$rc"
}

usage() { sed -n '5,8s/^# \{0,1\}//p' "$0" >&2; exit 2; }

cmd=${1:-}
case "$cmd" in
  up)     [ $# -eq 2 ] || usage; need_root_tools; take_lock; do_up "$2" ;;
  down)   need_root_tools; take_lock; do_down; log "down" ;;
  status) need_root_tools; take_lock; do_status ;;
  *)      usage ;;
esac
