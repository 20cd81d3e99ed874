#!/usr/bin/env bash
# All-reduce (float32 sum, 2 ranks, this machine) side by side in one invocation:
# dtrain over its same-host shared-memory transport (the default) and over TCP
# (DTRAIN_COMM_SHM=0), gloo through torch.distributed, and OpenMPI's MPI_Allreduce over TCP
# (--mca btl tcp,self) and with its default shared-memory transport. Every implementation
# runs ROUNDS times, interleaved (the machine is noisy); per size the median time is kept.
# Prints one nccl-tests style table per implementation (median time, algbw, busbw, #wrong
# where the implementation checks; "-" where it does not), then a comparison table with
# busbw ratios, and the loopback single-stream TCP bandwidth as the reference.
# Usage: bench/allreduce_peers.sh [iters] [warmup] [minbytes] [maxbytes] [rounds]
# DTRAIN=path/to/dtrain compares another build (default build/bin/dtrain).
# Needs scripts/build.sh, python3-torch, and scripts/setup.sh --bench (OpenMPI).
set -euo pipefail
cd "$(dirname "$0")/.."
ITERS="${1:-10}"; WARMUP="${2:-3}"; LO="${3:-4096}"; HI="${4:-268435456}"; ROUNDS="${5:-3}"
N=2
DTRAIN="${DTRAIN:-build/bin/dtrain}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
[ -x "$DTRAIN" ] || { echo "build first: scripts/build.sh" >&2; exit 2; }
command -v mpicc >/dev/null || { echo "needs libopenmpi-dev and openmpi-bin: scripts/setup.sh --bench" >&2; exit 2; }
mpicc -O2 -o "$OUT/mpi_allreduce" bench/mpi_allreduce.c
MPIRUN=(mpirun --allow-run-as-root --oversubscribe -np "$N" --bind-to none)

build/bin/loopback_tcp 2048 | tee "$OUT/loopback"
for r in $(seq "$ROUNDS"); do
  echo "round $r/$ROUNDS" >&2
  DTRAIN_COMM_SHM=1 "$DTRAIN" bench allreduce --nproc-per-node "$N" -b "$LO" -e "$HI" -n "$ITERS" -w "$WARMUP" \
    --json "$OUT/dtrain-shm.$r.json" >/dev/null
  DTRAIN_COMM_SHM=0 "$DTRAIN" bench allreduce --nproc-per-node "$N" -b "$LO" -e "$HI" -n "$ITERS" -w "$WARMUP" \
    --json "$OUT/dtrain-tcp.$r.json" >/dev/null
  OMP_NUM_THREADS=1 /usr/bin/python3 bench/gloo_allreduce.py "$N" "$LO" "$HI" "$ITERS" "$WARMUP" 2>/dev/null >"$OUT/gloo.$r.txt"
  "${MPIRUN[@]}" --mca btl tcp,self "$OUT/mpi_allreduce" "$LO" "$HI" "$ITERS" "$WARMUP" mpi-tcp 2>/dev/null >"$OUT/mpi-tcp.$r.txt"
  "${MPIRUN[@]}" "$OUT/mpi_allreduce" "$LO" "$HI" "$ITERS" "$WARMUP" mpi-sm 2>/dev/null >"$OUT/mpi-sm.$r.txt"
done

python3 - "$OUT" "$ROUNDS" "$N" "$ITERS" "$WARMUP" <<'PY'
import json, statistics, sys
out, rounds, n, iters, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
impls = ["dtrain-shm", "dtrain-tcp", "gloo", "mpi-tcp", "mpi-sm"]
times = {i: {} for i in impls}   # impl -> size -> [time_us per round]
wrong = {i: {} for i in impls}
for r in range(1, rounds + 1):
    for impl in ("dtrain-shm", "dtrain-tcp"):
        d = json.load(open(f"{out}/{impl}.{r}.json"))
        expect = "shm" if impl == "dtrain-shm" else "tcp"
        if d.get("transport") != expect:
            sys.exit(f"{impl}: ran over {d.get('transport')}, expected {expect}")
        for row in d["rows"]:
            times[impl].setdefault(row["bytes"], []).append(row["time_us"])
            wrong[impl][row["bytes"]] = wrong[impl].get(row["bytes"], 0) + row["wrong"]
    for impl in ("gloo", "mpi-tcp", "mpi-sm"):
        for line in open(f"{out}/{impl}.{r}.txt"):
            p = line.split()
            if len(p) == 5:
                times[impl].setdefault(int(p[1]), []).append(float(p[2]))
factor = 2 * (n - 1) / n
med = {i: {s: statistics.median(v) for s, v in times[i].items()} for i in impls}
busbw = {i: {s: s / t / 1e3 * factor for s, t in med[i].items()} for i in impls}
for impl in impls:
    print(f"# {impl}: all-reduce, {n} ranks, median of {rounds} rounds of {iters} iterations after {warmup} warm-up")
    print(f"# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}")
    print(f"# {'(B)':>10} {'(elements)':>12} {'':>8} {'':>6} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>7}")
    for s in sorted(med[impl]):
        t = med[impl][s]
        w = wrong[impl].get(s, "-")
        print(f"  {s:>10} {s // 4:>12} {'float':>8} {'sum':>6} {t:>10.1f} {s / t / 1e3:>8.3f} {busbw[impl][s]:>8.3f} {w:>7}")
    print("#")
cols = impls
ratios = [("shm/gloo", "gloo"), ("shm/mpi-tcp", "mpi-tcp"), ("shm/mpi-sm", "mpi-sm"), ("shm/tcp", "dtrain-tcp")]
print("# busbw in GB/s (median time per size); ratios are dtrain-shm busbw / the other's")
print(f"{'size(B)':>10} " + " ".join(f"{c:>11}" for c in cols) + " " + " ".join(f"{r:>11}" for r, _ in ratios))
for s in sorted(set().union(*[set(med[i]) for i in impls])):
    cells = [f"{busbw[c].get(s, float('nan')):>11.3f}" for c in cols]
    d = busbw["dtrain-shm"].get(s, float("nan"))
    rs = [f"{d / busbw[o][s]:>11.2f}" if busbw[o].get(s) else f"{'-':>11}" for _, o in ratios]
    print(f"{s:>10} " + " ".join(cells) + " " + " ".join(rs))
print("# median time in us per size")
print(f"{'size(B)':>10} " + " ".join(f"{c:>11}" for c in cols))
for s in sorted(set().union(*[set(med[i]) for i in impls])):
    print(f"{s:>10} " + " ".join(f"{med[c].get(s, float('nan')):>11.1f}" for c in cols))
PY
