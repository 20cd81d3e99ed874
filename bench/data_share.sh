#!/usr/bin/env bash
# The data image (docs/trainer.md, "Data"): a local trainer job on an MNIST-sized idx data set,
# the workers mapping the launcher's parse (default) against each parsing the files itself
# (DTRAIN_DATA_SHARE=0), interleaved, ROUNDS times each. Per run: the job's wall time (dtrain
# run to exit; a short job, so start-up dominates), the time until rank 0's progress line of
# step 10 (the data open, 10 steps trained), and the job's peak memory: the peak usage of a
# memory cgroup made for each run (cgroup v1 memory.max_usage_in_bytes or v2 memory.peak, as
# root; the data files are read into the page cache outside it first), else the host's
# MemTotal - MemAvailable sampled every 5 ms, less its value before.
# Prints the medians and the ratios, off/on.
# Usage: bench/data_share.sh [images] [workers] [rounds]   (defaults 120000 4 5)
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-120000}"; W="${2:-4}"; ROUNDS="${3:-5}"
[ -x build/bin/dtrain ] || { echo "build first: scripts/build.sh" >&2; exit 2; }
T="$(mktemp -d)"; trap 'rm -rf "$T"' EXIT
python3 - "$T" "$N" <<'PY'
import os, struct, sys
t, n = sys.argv[1], int(sys.argv[2])
rnd = os.urandom
with open(f"{t}/img", "wb") as f, open(f"{t}/lbl", "wb") as g:
    f.write(struct.pack(">IIII", 0x803, n, 28, 28)); g.write(struct.pack(">II", 0x801, n))
    left = n
    while left:
        k = min(left, 10000)
        f.write(rnd(784 * k)); g.write(bytes(b % 10 for b in rnd(k)))
        left -= k
PY
cat > "$T/job.json" <<JSON
{"nproc_per_node": $W, "env": {"OMP_NUM_THREADS": "1"},
 "trainer": {"model": {"layers": [784, 64, 10]}, "device": "cpu",
  "data": {"type": "idx", "path": "$T/img", "labels_path": "$T/lbl"},
  "batch_size": 64, "max_steps": 20, "log_every_steps": 10, "optimizer": {"lr": 0.01}}}
JSON
python3 - "$T" "$ROUNDS" <<'PY'
import os, statistics, subprocess, sys, threading, time
t, rounds = sys.argv[1], int(sys.argv[2])
def used():
    m = {}
    for line in open("/proc/meminfo"):
        k, v = line.split(":"); m[k] = int(v.split()[0]) * 1024
    return m["MemTotal"] - m["MemAvailable"]
V1 = "/sys/fs/cgroup/memory"
def make_cgroup():
    for root, peakfile in ((V1, "memory.max_usage_in_bytes"), ("/sys/fs/cgroup", "memory.peak")):
        d = f"{root}/dtrain_bench_data_{os.getpid()}"
        try:
            os.mkdir(d)
        except OSError:
            continue
        if os.path.exists(f"{d}/{peakfile}") and os.path.exists(f"{d}/cgroup.procs"):
            return d, peakfile
        os.rmdir(d)
    return None, None
for f in ("img", "lbl"):  # (page cache charged outside the runs' cgroups)
    with open(f"{t}/{f}", "rb") as fh:
        while fh.read(1 << 24): pass
def run(share):
    env = dict(os.environ, DTRAIN_DATA_SHARE="1" if share else "0")
    cg, peakfile = make_cgroup()
    base = used(); peak = [base]; stop = threading.Event()
    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], used()); time.sleep(0.005)
    th = threading.Thread(target=sample); th.start()
    start = time.monotonic(); first = None
    cmd = ["build/bin/dtrain", "run", f"{t}/job.json"]
    if cg: cmd = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh"] + cmd
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    for line in p.stdout:
        out.append(line)
        if first is None and line.startswith("[rank 0]") and " step 10/" in line:
            first = time.monotonic() - start
    rc = p.wait(); wall = time.monotonic() - start
    stop.set(); th.join()
    mib = (peak[0] - base) / 2**20
    if cg:
        mib = int(open(f"{cg}/{peakfile}").read()) / 2**20
        for _ in range(100):
            try:
                os.rmdir(cg); break
            except OSError:
                time.sleep(0.05)
    if rc != 0: sys.exit("dtrain run failed:\n" + "".join(out))
    if share != any("data image" in l for l in out): sys.exit("unexpected data line:\n" + "".join(out))
    return wall, first, mib
def make_cgroup_probe():
    d, _ = make_cgroup()
    if d: os.rmdir(d)
    return d is not None
res = {True: [], False: []}
for r in range(rounds):
    for share in (True, False):
        res[share].append(run(share))
print(f"# {rounds} rounds, interleaved; medians; peak memory from {'a memory cgroup per run' if make_cgroup_probe() else 'MemAvailable'}")
print(f"# {'mode':<22} {'wall (s)':>9} {'step 10 (s)':>14} {'peak MiB':>14}")
med = {}
for share in (True, False):
    cols = [statistics.median(x[i] for x in res[share]) for i in range(3)]
    med[share] = cols
    print(f"  {'image (default)' if share else 'DTRAIN_DATA_SHARE=0':<22} {cols[0]:>9.2f} {cols[1]:>14.2f} {cols[2]:>14.0f}")
print(f"  {'ratio off/on':<22} {med[False][0]/med[True][0]:>9.2f} {med[False][1]/med[True][1]:>14.2f} {med[False][2]/med[True][2]:>14.2f}")
PY
