# Shared helpers for end-to-end tests. Each test: bash TEST.sh /path/to/dtrain
set -uo pipefail
export LC_ALL=C
DTRAIN="$1"
SRC="${DTRAIN_SRC:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
T="$(mktemp -d /tmp/dtrain-e2e.XXXXXX)"
# What the test's processes leave in the temp dir (torch's pymp-* and torchelastic_* dirs, a
# killed job's dtrain-run-*) goes with it.
export TMPDIR="$T"
cleanup() { [ -n "${DTRAIN_PID:-}" ] && kill -9 "$DTRAIN_PID" 2>/dev/null; rm -rf "$T"; }
trap cleanup EXIT
FAILS=0
fail() { echo "FAIL: $*" >&2; FAILS=$((FAILS + 1)); }
pass() { echo "ok: $*"; }
expect_eq() { if [ "$1" == "$2" ]; then pass "$3"; else fail "$3: expected '$2', got '$1'"; fi; }
expect_grep() { if grep -qE -- "$1" "$2"; then pass "$3"; else fail "$3: /$1/ not in $2:"; sed 's/^/    /' "$2" >&2; fi; }
expect_no_grep() { if grep -qE -- "$1" "$2"; then fail "$3: /$1/ in $2:"; sed 's/^/    /' "$2" >&2; else pass "$3"; fi; }
# wait_for FILE... : up to 20 s for files to exist.
wait_for() {
  for _ in $(seq 200); do
    local all=1
    for f in "$@"; do [ -e "$f" ] || all=0; done
    [ $all = 1 ] && return 0
    sleep 0.1
  done
  fail "timed out waiting for $*"
  return 1
}
# A small csv data set: header a,b,label, then ROWS rows of three classes around (c, -c),
# the same rows for the same ROWS (seeded).
blobs_csv() {  # FILE ROWS
  python3 - "$1" "$2" <<'PY'
import random, sys
r = random.Random(5)
with open(sys.argv[1], 'w') as f:
    f.write('a,b,label\n')
    for _ in range(int(sys.argv[2])):
        c = r.randrange(3); f.write(f'{c + r.gauss(0, .4):.4f},{-c + r.gauss(0, .4):.4f},{c}\n')
PY
}
alive() { kill -0 "$1" 2>/dev/null && [ "$(ps -o stat= -p "$1" | cut -c1)" != Z ]; }
finish() {
  if [ "$FAILS" -ne 0 ]; then echo "$FAILS check(s) failed"; exit 1; fi
  echo "all checks passed"
}
# A cgroup the test made ($CG, under $base): use_cgroup removes it at exit (whatever is left
# in it, nothing normally, goes back to $base); in_cgroup CMD... runs CMD in it (a shell moves
# itself in, then becomes CMD).
remove_cgroup() {
  for _ in 1 2 3; do
    while read -r p; do echo "$p" >"$base/cgroup.procs" 2>/dev/null; done <"$CG/cgroup.procs"
    rmdir "$CG" 2>/dev/null && return
    sleep 0.2
  done
}
use_cgroup() { trap 'remove_cgroup; cleanup' EXIT; }
in_cgroup() { sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$CG" "$@"; }
