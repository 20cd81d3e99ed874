# The same checkpoint with PyTorch: torch.save of weights + momentum to a temporary file,
# fsync, rename, fsync of the directory (the durability dtrain's write has), and torch.load.
# Usage: python3 bench/checkpoint_torch.py DIR PARAMS[,PARAMS...] [reps]
import os
import shutil
import statistics
import sys
import time

import torch

d, sizes = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
for n in sizes:
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    i = torch.arange(n)
    state = {"params": (i % 977).float() * 1e-3, "momentum": (i % 991).float() * -1e-4,
             "step": 0, "epoch": 0, "cursor": 0}
    save, load = [], []
    for r in range(reps):
        state["step"] = r + 1
        path = os.path.join(d, f"ckpt-{r + 1:010d}.pt")
        t0 = time.perf_counter()
        with open(path + ".tmp", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(path + ".tmp", path)
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dfd)
        os.close(dfd)
        if r >= 2:
            os.remove(os.path.join(d, f"ckpt-{r - 1:010d}.pt"))
        t1 = time.perf_counter()
        back = torch.load(path)
        t2 = time.perf_counter()
        assert back["params"].numel() == n
        save.append((t1 - t0) * 1e3)
        load.append((t2 - t1) * 1e3)
    print(f"{'torch':<8} {n:10d} {2 * n * 4:12d} {statistics.median(save):9.1f} {statistics.median(load):9.1f}", flush=True)
shutil.rmtree(d, ignore_errors=True)
