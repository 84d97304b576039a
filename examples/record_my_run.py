"""A training script of your own, with ONE line added: ddplab.record(...).

    torchrun --standalone --nproc-per-node 2 examples/record_my_run.py --out run
    python -m ddplab view run.json

Rank 0 writes run.json, run.trace.json (open it in https://ui.perfetto.dev) and run.html at
the end of the last step asked for (right after its optimizer step), here the loop's last one:
no other change to the loop. A loop that ends sooner: call rec.finish() on every rank after it,
before destroy_process_group() (rank 0 says so at exit if you forget).
gloo on CPU, nccl when every rank has a GPU of its own (one per process).
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddplab


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="run")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0)
    args = parser.parse_args()
    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    dist.init_process_group("nccl" if gpu else "gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10)).to(device)
    ddp = DDP(model, device_ids=[device.index] if gpu else None, bucket_cap_mb=args.bucket_cap_mb)
    # the added line (keep rec: call rec.finish() after the loop if it ends before the last step)
    rec = ddplab.record(ddp, steps=range(2, args.steps), out=args.out)  # noqa: F841
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _ in range(args.steps):
        x = torch.randn(64, 256, device=device)
        y = torch.randint(0, 10, (64,), device=device)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
