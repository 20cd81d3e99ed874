#!/usr/bin/env bash
# Point to point (2 ranks, this machine, ping-pong: rank 0 sends, rank 1 receives and sends
# the same size back; time = half the round trip, busbw = algbw = bytes / time) side by side
# in one invocation: dtrain (`dtrain bench sendrecv`: "dtrain" over its same-host shared-memory
# channels, "dtrain-tcp" over its TCP mesh with DTRAIN_COMM_SHM=0), gloo through torch.distributed send/recv, and OpenMPI's
# MPI_Send/MPI_Recv over TCP (--mca btl tcp,self) and with its default transports (shared
# memory on one host). Every implementation runs ROUNDS times, interleaved (the machine is
# noisy); per size the median time is kept. Prints one nccl-tests style table per
# implementation, then a comparison table (time and busbw, with dtrain/other ratios).
# Usage: bench/sendrecv_peers.sh [iters] [warmup] [minbytes] [maxbytes] [rounds]
# DTRAIN=path/to/dtrain compares another build (default build/bin/dtrain).
# Needs scripts/build.sh, python3-torch, and scripts/setup.sh --bench (OpenMPI).
set -euo pipefail
cd "$(dirname "$0")/.."
ITERS="${1:-100}"; WARMUP="${2:-10}"; LO="${3:-8}"; HI="${4:-67108864}"; ROUNDS="${5:-3}"
DTRAIN="${DTRAIN:-build/bin/dtrain}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
[ -x "$DTRAIN" ] || { echo "build first: scripts/build.sh" >&2; exit 2; }
command -v mpicc >/dev/null || { echo "needs libopenmpi-dev and openmpi-bin: scripts/setup.sh --bench" >&2; exit 2; }
mpicc -O2 -o "$OUT/mpi_sendrecv" bench/mpi_sendrecv.c
MPIRUN=(mpirun --allow-run-as-root --oversubscribe -np 2 --bind-to none)

for r in $(seq "$ROUNDS"); do
  echo "round $r/$ROUNDS" >&2
  "$DTRAIN" bench sendrecv --nproc-per-node 2 -b "$LO" -e "$HI" -n "$ITERS" -w "$WARMUP" -d int32 \
    --json "$OUT/dtrain.$r.json" >/dev/null
  DTRAIN_COMM_SHM=0 "$DTRAIN" bench sendrecv --nproc-per-node 2 -b "$LO" -e "$HI" -n "$ITERS" -w "$WARMUP" -d int32 \
    --json "$OUT/dtrain-tcp.$r.json" >/dev/null
  OMP_NUM_THREADS=1 /usr/bin/python3 bench/gloo_sendrecv.py "$LO" "$HI" "$ITERS" "$WARMUP" 2>/dev/null >"$OUT/gloo.$r.txt"
  "${MPIRUN[@]}" --mca btl tcp,self "$OUT/mpi_sendrecv" "$LO" "$HI" "$ITERS" "$WARMUP" mpi-tcp 2>/dev/null >"$OUT/mpi-tcp.$r.txt"
  "${MPIRUN[@]}" "$OUT/mpi_sendrecv" "$LO" "$HI" "$ITERS" "$WARMUP" mpi-sm 2>/dev/null >"$OUT/mpi-sm.$r.txt"
done

python3 - "$OUT" "$ROUNDS" "$ITERS" "$WARMUP" <<'PY'
import json, statistics, sys
out, rounds, iters, warmup = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
impls = ["dtrain", "dtrain-tcp", "gloo", "mpi-tcp", "mpi-sm"]
times = {i: {} for i in impls}   # impl -> size -> [time_us per round]
wrong = {i: {} for i in impls}
for r in range(1, rounds + 1):
    for impl, transport in (("dtrain", "shm"), ("dtrain-tcp", "tcp")):
        d = json.load(open(f"{out}/{impl}.{r}.json"))
        if d.get("collective") != "sendrecv" or d.get("transport") != transport:
            sys.exit(f"{impl}: JSON is for {d.get('collective')} over {d.get('transport')}, expected sendrecv over {transport}")
        for row in d["rows"]:
            times[impl].setdefault(row["bytes"], []).append(row["time_us"])
            wrong[impl][row["bytes"]] = wrong[impl].get(row["bytes"], 0) + row["wrong"]
    for impl in impls[2:]:
        for line in open(f"{out}/{impl}.{r}.txt"):
            p = line.split()
            if len(p) == 6 and p[0] == impl:
                times[impl].setdefault(int(p[1]), []).append(float(p[2]))
                wrong[impl][int(p[1])] = wrong[impl].get(int(p[1]), 0) + int(p[5])
med = {i: {s: statistics.median(v) for s, v in times[i].items()} for i in impls}
bw = {i: {s: s / t / 1e3 for s, t in med[i].items()} for i in impls}
for impl in impls:
    print(f"# {impl}: send/recv ping-pong, 2 ranks, median of {rounds} rounds of {iters} round trips after {warmup} warm-up")
    print(f"# {'size':>10} {'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}")
    print(f"# {'(B)':>10} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>7}")
    for s in sorted(med[impl]):
        print(f"  {s:>10} {med[impl][s]:>10.2f} {bw[impl][s]:>8.3f} {bw[impl][s]:>8.3f} {wrong[impl].get(s, '-'):>7}")
    print("#")
sizes = sorted(set().union(*[set(med[i]) for i in impls]))
others = impls[1:]
print("# one-way time in us (median per size); ratios are the other's time / dtrain's (>1: dtrain faster)")
print(f"{'size(B)':>10} " + " ".join(f"{c:>9}" for c in impls) + " " + " ".join(f"{'/' + o:>9}" for o in others))
for s in sizes:
    d = med["dtrain"].get(s)
    cells = [f"{med[c].get(s, float('nan')):>9.2f}" for c in impls]
    rs = [f"{med[o][s] / d:>9.2f}" if d and med[o].get(s) else f"{'-':>9}" for o in others]
    print(f"{s:>10} " + " ".join(cells) + " " + " ".join(rs))
print("# busbw (= algbw) in GB/s")
print(f"{'size(B)':>10} " + " ".join(f"{c:>9}" for c in impls))
for s in sizes:
    print(f"{s:>10} " + " ".join(f"{bw[c].get(s, float('nan')):>9.3f}" for c in impls))
total_wrong = sum(v for i in impls for v in wrong[i].values())
print(f"# wrong payload elements, all implementations and rounds: {total_wrong}")
PY
