"""A user's own training script, as the issue wrote it, with the ONE added ddplab line.

    torchrun --standalone --nproc-per-node=2 tests/_your_script.py OUT [options]

Run by tests/measure/test_recording_endings.py under torchrun, once per way a run can end: the loop
running to the last step asked for, ending sooner, ending later, the process group destroyed
first, a rank raising. Only the options below differ from a plain script.
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddplab

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--steps", type=int, default=8, help="how many steps the loop runs")
ap.add_argument("--finish", action="store_true", help="call rec.finish() after the loop")
ap.add_argument("--finish-on", type=int, default=None, help="...on this rank only (a mistake)")
ap.add_argument("--no-destroy", action="store_true", help="exit without destroy_process_group")
ap.add_argument("--destroy-first", action="store_true", help="destroy the group, then finish")
ap.add_argument("--raise-at", default=None, help="RANK:STEP:WHERE (forward or after_backward)")
args = ap.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Flatten(),
                            torch.nn.Linear(64 * 16, 512), torch.nn.GELU(), torch.nn.Linear(512, 1000))
ddp = DDP(model, bucket_cap_mb=0.25)
rec = ddplab.record(ddp, steps=range(2, 8), out=args.out)  # <- the one added line
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
raise_rank, raise_step, where = (args.raise_at.split(":") if args.raise_at else (None, None, None))
g = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    x = torch.randint(0, 1000, (32, 16), generator=g)
    y = torch.randint(0, 1000, (32,), generator=g)
    if where == "forward" and rank == int(raise_rank) and step == int(raise_step):
        raise RuntimeError(f"a planted error on rank {rank} at step {step}")
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    if where == "after_backward" and rank == int(raise_rank) and step == int(raise_step):
        raise RuntimeError(f"a planted error on rank {rank} at step {step}")
    opt.step()
    opt.zero_grad()
if args.destroy_first:
    dist.destroy_process_group()
if args.finish or args.destroy_first:
    rec.finish()
if args.finish_on is not None:
    if rank == args.finish_on:
        rec.finish(timeout=2)
    else:
        time.sleep(8)  # never calls finish(): rank 0 must not wait for it until the group's timeout
if not (args.no_destroy or args.destroy_first):
    dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
