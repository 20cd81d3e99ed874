#!/usr/bin/env bash
# All-reduce (float32 sum, 2 ranks, this machine) side by side in one invocation:
# dtrain's TCP ring, gloo through torch.distributed, and OpenMPI's MPI_Allreduce over TCP
# (--mca btl tcp,self) and with its default shared-memory transport. Prints busbw (GB/s)
# and time (us) per size plus the loopback single-stream TCP bandwidth as the reference.
# Usage: bench/allreduce_peers.sh [iters] [warmup] [minbytes] [maxbytes]
# Needs scripts/build.sh, python3-torch, openmpi-bin and libopenmpi-dev.
set -euo pipefail
cd "$(dirname "$0")/.."
ITERS="${1:-10}"; WARMUP="${2:-3}"; LO="${3:-4096}"; HI="${4:-268435456}"
N=2
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
[ -x build/bin/dtrain ] || { echo "build first: scripts/build.sh" >&2; exit 2; }
command -v mpicc >/dev/null || { echo "needs libopenmpi-dev and openmpi-bin (apt-get install)" >&2; exit 2; }
mpicc -O2 -o "$OUT/mpi_allreduce" bench/mpi_allreduce.c
MPIRUN=(mpirun --allow-run-as-root --oversubscribe -np "$N" --bind-to none)

build/bin/loopback_tcp 2048 | tee "$OUT/loopback"
build/bin/dtrain bench allreduce --nproc-per-node "$N" -b "$LO" -e "$HI" -n "$ITERS" -w "$WARMUP" --json "$OUT/dtrain.json" >"$OUT/dtrain.txt"
OMP_NUM_THREADS=1 /usr/bin/python3 bench/gloo_allreduce.py "$N" "$LO" "$HI" "$ITERS" "$WARMUP" 2>/dev/null >"$OUT/gloo.txt"
"${MPIRUN[@]}" --mca btl tcp,self "$OUT/mpi_allreduce" "$LO" "$HI" "$ITERS" "$WARMUP" mpi-tcp 2>/dev/null >"$OUT/mpitcp.txt"
"${MPIRUN[@]}" "$OUT/mpi_allreduce" "$LO" "$HI" "$ITERS" "$WARMUP" mpi-sm 2>/dev/null >"$OUT/mpism.txt"

python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = {}
for r in json.load(open(f"{out}/dtrain.json"))["rows"]:
    rows.setdefault(r["bytes"], {})["dtrain"] = (r["time_us"], r["busbw_gbps"])
for name in ("gloo", "mpitcp", "mpism"):
    for line in open(f"{out}/{name}.txt"):
        p = line.split()
        if len(p) == 5:
            rows.setdefault(int(p[1]), {})[p[0]] = (float(p[2]), float(p[4]))
cols = ["dtrain", "gloo", "mpi-tcp", "mpi-sm"]
print(f"{'size(B)':>10} " + " ".join(f"{c + ' us':>12} {c + ' busbw':>12}" for c in cols) + f" {'dtrain/gloo':>11} {'dtrain/mpi-tcp':>14}")
for size in sorted(rows):
    r = rows[size]
    cells = []
    for c in cols:
        t, b = r.get(c, (float("nan"), float("nan")))
        cells.append(f"{t:>12.1f} {b:>12.3f}")
    d = r.get("dtrain", (0, 0))[1]
    g = r.get("gloo", (0, 1))[1] or 1
    m = r.get("mpi-tcp", (0, 1))[1] or 1
    print(f"{size:>10} " + " ".join(cells) + f" {d / g:>11.2f} {d / m:>14.2f}")
PY
