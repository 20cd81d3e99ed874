"""gloo all-reduce through torch.distributed, timed like `dtrain bench allreduce`: per size,
warm-up, then ITERS timed all-reduces (float32, sum), the slowest rank's mean time.
Usage: python3 bench/gloo_allreduce.py NPROC MINBYTES MAXBYTES ITERS WARMUP"""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world, port, lo, hi, iters, warmup):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # gloo connects its pairs and sizes its buffers at first use: done here, so that the first
    # size's warm-up does not carry it (its time came out up to 40x the next size's).
    for _ in range(20):
        dist.all_reduce(torch.ones(1024, dtype=torch.float32))
    dist.barrier()
    size = lo
    while size <= hi:
        t = torch.ones(size // 4, dtype=torch.float32)
        for _ in range(warmup):
            dist.all_reduce(t)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        us = torch.tensor([(time.perf_counter() - start) / iters * 1e6], dtype=torch.float64)
        dist.all_reduce(us, op=dist.ReduceOp.MAX)
        if rank == 0:
            algbw = size / us.item() / 1e3
            print(f"gloo {size} {us.item():.1f} {algbw:.3f} {algbw * 2 * (world - 1) / world:.3f}", flush=True)
        size *= 2
    dist.destroy_process_group()


if __name__ == "__main__":
    n, lo, hi, iters, warmup = (int(x) for x in sys.argv[1:6])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(n, port, lo, hi, iters, warmup), nprocs=n)
