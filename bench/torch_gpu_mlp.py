"""PyTorch on one GPU training the same MLP as dtrain's GPU trainer benchmark (bench/trainer_gpu.sh):
784-1024-1024-10, ReLU, SGD momentum 0.9, softmax cross-entropy, plain fp32 (torch's default: no
TF32, as dtrain's cuBLAS calls), 16 batches of synthetic data already on the GPU (the most
favourable case for torch: no input pipeline at all). Prints samples/s after warm-up, timed
between two cuda.synchronize() calls. Usage: python3 bench/torch_gpu_mlp.py BATCH STEPS WARMUP"""
import sys
import time

import torch
import torch.nn as nn


def main():
    batch, steps, warmup = (int(x) for x in sys.argv[1:4])
    dev = torch.device("cuda:0")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=0.005, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    xs = torch.randn(16, batch, 784, device=dev)
    ys = torch.randint(0, 10, (16, batch), device=dev)
    for i in range(steps + warmup):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(m(xs[i % 16]), ys[i % 16])
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    print(f"{steps * batch / (time.perf_counter() - start):.0f}")


if __name__ == "__main__":
    main()
