"""PyTorch DDP (gloo) training the same MLP as the dtrain trainer benchmark:
784-1024-1024-10, ReLU, SGD momentum 0.9, batch 128 per worker, synthetic data in memory.
Prints samples/s after warm-up. Usage: python3 bench/torch_ddp_mlp.py NPROC STEPS WARMUP [SAVE_EVERY DIR]
With SAVE_EVERY, rank 0 saves the model and optimizer state every SAVE_EVERY steps as a PyTorch
user does (torch.save), as durably as dtrain's checkpoints: a temporary file, fsync, rename,
fsync of the directory; the others wait for it in the next step's all-reduce."""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def model():
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def save(m, opt, step, d):
    path = os.path.join(d, f"ckpt-{step:010d}.pt")
    with open(path + ".tmp", "wb") as f:
        torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "step": step}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(path + ".tmp", path)
    fd = os.open(d, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    old = sorted(x for x in os.listdir(d) if x.endswith(".pt"))[:-3]  # keep 3, as dtrain does
    for x in old:
        os.remove(os.path.join(d, x))


def run(rank, world, port, steps, warmup, out, save_every=0, d=""):
    torch.manual_seed(0)
    m = model()
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        m = nn.parallel.DistributedDataParallel(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.005, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    xs = torch.randn(16, 128, 784, generator=g)
    ys = torch.randint(0, 10, (16, 128), generator=g)
    for i in range(steps + warmup):
        if i == warmup:
            start = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(m(xs[i % 16]), ys[i % 16])
        loss.backward()
        opt.step()
        if save_every and rank == 0 and (i + 1) % save_every == 0:
            save(m, opt, i + 1, d)
    rate = steps * 128 * world / (time.perf_counter() - start)
    if rank == 0:
        out.put(rate)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    n, steps, warmup = (int(x) for x in sys.argv[1:4])
    save_every, d = (int(sys.argv[4]), sys.argv[5]) if len(sys.argv) > 5 else (0, "")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, n, port, steps, warmup, q, save_every, d)) for r in range(n)]
    for p in procs:
        p.start()
    rate = q.get()
    for p in procs:
        p.join()
    print(f"{rate:.0f}")
