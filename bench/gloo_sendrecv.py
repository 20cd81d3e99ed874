"""gloo send/recv ping-pong through torch.distributed, timed like `dtrain bench sendrecv`:
per size, warm-up, then ITERS round trips (rank 0 sends, rank 1 receives and sends the same
size back); time is half of rank 0's mean round trip. Verifies the last payload each way.
Usage: python3 bench/gloo_sendrecv.py MINBYTES MAXBYTES ITERS WARMUP
Prints "gloo size time_us algbw busbw wrong" per size."""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def pattern(rank, size):
    return ((torch.arange(size, dtype=torch.int64) * 7 + rank * 31) & 0xFF).to(torch.uint8)


def run(rank, port, lo, hi, iters, warmup):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peer = 1 - rank
    size = lo
    while size <= hi:
        out, inp = pattern(rank, size), torch.zeros(size, dtype=torch.uint8)

        def once():
            if rank == 0:
                dist.send(out, peer)
                dist.recv(inp, peer)
            else:
                dist.recv(inp, peer)
                dist.send(out, peer)

        for _ in range(warmup):
            once()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            once()
        us = (time.perf_counter() - start) / iters / 2 * 1e6
        wrong = torch.tensor([int((inp != pattern(peer, size)).sum())], dtype=torch.int64)
        dist.all_reduce(wrong)
        if rank == 0:
            algbw = size / us / 1e3
            print(f"gloo {size} {us:.2f} {algbw:.3f} {algbw:.3f} {wrong.item()}", flush=True)
        size *= 2
    dist.destroy_process_group()


if __name__ == "__main__":
    lo, hi, iters, warmup = (int(x) for x in sys.argv[1:5])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(port, lo, hi, iters, warmup), nprocs=2)
