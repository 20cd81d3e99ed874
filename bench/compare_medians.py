"""Prints the median table of interleaved timing series, dtrain first, then its peers, and
each peer's median over dtrain's.
Usage: python3 bench/compare_medians.py "NS NS ..." "NS NS ..." [peer-name]  (nanoseconds)
       python3 bench/compare_medians.py --named NAME "NS ..." NAME "NS ..." ...  (first = dtrain)"""
import statistics
import sys

args = sys.argv[1:]
if args and args[0] == "--named":
    series = [(args[i], args[i + 1]) for i in range(1, len(args) - 1, 2)]
else:
    series = [("dtrain", args[0]), (args[2] if len(args) > 2 else "torchrun", args[1])]
rows = [(name, [int(x) / 1e6 for x in ns.split()]) for name, ns in series]
width = max(10, max(len(name) for name, _ in rows))
print(f"{'launcher':<{width}} {'runs':>5} {'median_ms':>10} {'min_ms':>8} {'max_ms':>8}")
for name, v in rows:
    print(f"{name:<{width}} {len(v):>5} {statistics.median(v):>10.1f} {min(v):>8.1f} {max(v):>8.1f}")
base_name, base = rows[0]
for name, v in rows[1:]:
    print(f"ratio ({name} / {base_name} median): {statistics.median(v) / statistics.median(base):.1f}x")
