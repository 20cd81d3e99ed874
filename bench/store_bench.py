"""PyTorch's TCPStore (its C++ server and client, through the Python binding users call),
driven the same way as bench/store_bench.cc: N client processes, M set+get pairs each.
Usage: python3 bench/store_bench.py CLIENTS PAIRS"""
import multiprocessing as mp
import socket
import sys
import time
from datetime import timedelta

import torch.distributed as dist


def client(port, c, pairs, out):
    s = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    s.add("ready", 1)
    s.wait(["go"])
    value = b"v" * 64
    lat = []
    for i in range(pairs):
        key = f"c{c}/{i % 100}"
        a = time.perf_counter()
        s.set(key, value)
        b = time.perf_counter()
        s.get(key)
        e = time.perf_counter()
        lat.append((b - a) * 1e6)
        lat.append((e - b) * 1e6)
    out.put(lat)


def main():
    clients = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    # Fork the clients before the server thread exists (as store_bench.cc does); they retry
    # connecting until it listens.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=client, args=(port, c, pairs, out)) for c in range(clients)]
    for p in procs:
        p.start()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    while master.add("ready", 0) < clients:
        time.sleep(0.001)
    start = time.perf_counter()
    master.set("go", "1")
    lat = []
    for _ in procs:
        lat.extend(out.get())
    wall = time.perf_counter() - start
    for p in procs:
        p.join()
    lat.sort()
    print(f"{'torch':<8} {clients:>7} {pairs:>7} {len(lat) / wall:>12.0f} {lat[len(lat) // 2]:>8.1f} {lat[len(lat) * 99 // 100]:>8.1f}")


if __name__ == "__main__":
    main()
