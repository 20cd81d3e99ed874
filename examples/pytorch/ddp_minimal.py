"""The classic PyTorch DDP example, unmodified for any launcher: everything comes from the
torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK)."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")

    torch.manual_seed(0)
    model = nn.Linear(10, 10).to(device)
    ddp = DDP(model, device_ids=[local_rank] if use_cuda else None)
    opt = optim.SGD(ddp.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()

    torch.manual_seed(rank + 1)  # each rank sees different data
    for step in range(5):
        opt.zero_grad()
        out = ddp(torch.randn(20, 10, device=device))
        loss = loss_fn(out, torch.randn(20, 10, device=device))
        loss.backward()
        opt.step()

    # After DDP's gradient all-reduce every replica holds the same weights.
    w = model.weight.detach().clone()
    gathered = [torch.zeros_like(w) for _ in range(world)]
    dist.all_gather(gathered, w)
    same = all(torch.allclose(gathered[0], g) for g in gathered)
    print(f"rank {rank}/{world}: loss {loss.item():.4f} weights_in_sync={same}", flush=True)
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
