"""Prints the median table of two interleaved timing series, dtrain first, then the peer.
Usage: python3 bench/compare_medians.py "NS NS ..." "NS NS ..." [peer-name]  (nanoseconds)"""
import statistics
import sys

d = [int(x) / 1e6 for x in sys.argv[1].split()]
t = [int(x) / 1e6 for x in sys.argv[2].split()]
peer = sys.argv[3] if len(sys.argv) > 3 else "torchrun"
md, mt = statistics.median(d), statistics.median(t)
print(f"{'launcher':<10} {'runs':>5} {'median_ms':>10} {'min_ms':>8} {'max_ms':>8}")
print(f"{'dtrain':<10} {len(d):>5} {md:>10.1f} {min(d):>8.1f} {max(d):>8.1f}")
print(f"{peer:<10} {len(t):>5} {mt:>10.1f} {min(t):>8.1f} {max(t):>8.1f}")
print(f"ratio ({peer} / dtrain median): {mt / md:.1f}x")
