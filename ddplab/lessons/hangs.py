"""When DDP hangs or breaks: each failure made on purpose, the message it gives, and its remedy.

Teaches, one function per question (lab 06):
- ``skip_collective_on_rank``: a rank that skips a collective leaves the
  others waiting in it; nothing fails until a timeout (the Cluster's
  ``timeout=``; torch's default is 30 minutes on gloo, 10 on NCCL);
- ``mismatched_collective_on_rank``: ranks calling different collectives.
  Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch wraps the process group so
  that every collective first compares a fingerprint (op type, shapes,
  dtypes) across ranks, and the error names both collectives;
- ``unused_branch_on_rank``: a parameter that forward did not use leaves
  its bucket unlaunched, so torch's reducer never queues
  ``finalize_backward``: backward RETURNS, gradients not averaged, and the
  NEXT forward raises "Expected to have finished reduction in the prior
  iteration"; ``find_unused_parameters=True`` and ``static_graph=True`` fix
  it, and ``static_graph`` refuses a graph whose unused set changes;
- ``detection_cost_on_rank``: what those two options cost per step, as
  ratios to plain DDP, measured interleaved (the same rep of each in turn);
- ``nccl_env_aliases``: today's ``TORCH_NCCL_*`` names and the older names
  the installed torch still accepts, read from the headers torch ships;
- ``straggler_no_sync_on_rank``: a straggler on a simulated link, with every
  micro-batch synchronized against ``no_sync`` accumulation.

Functions ending in ``_on_rank`` run on every rank (``cluster.run``).
Leaves out: NCCL's watchdog and flight recorder (GPU only; the names are
listed, not exercised), ``monitored_barrier``, and torch's ``Join`` for uneven
inputs (lab 06 shows it in a cell).
References: torch/nn/parallel/distributed.py (find_unused_parameters,
static_graph, no_sync); torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp
(the DETAIL fingerprint check) and ProcessGroupNCCL.hpp (the environment
variables); https://pytorch.org/docs/stable/distributed.html#debugging-torch-distributed-applications
"""
from __future__ import annotations

import contextlib
import pathlib
import re
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from ddplab.sync import comm


def skip_collective_on_rank(skip_rank: int = 1):
    """Every rank but ``skip_rank`` all-reduces a logged loss; ``skip_rank`` returns at once."""
    import torch.distributed as dist

    loss = torch.tensor([1.0 + dist.get_rank()])
    if dist.get_rank() != skip_rank:
        dist.all_reduce(loss)  # waits for skip_rank, which never comes
    return loss.item()


def mismatched_collective_on_rank():
    """Rank 0 all-reduces while every other rank broadcasts: the same number of calls, different ops."""
    import torch.distributed as dist

    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)
    return t.tolist()


class TwoHeads(nn.Module):
    """A trunk and two heads; ``aux`` joins the loss only when ``use_aux`` is true."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk, self.main, self.aux = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x, use_aux: bool = False):
        h = torch.tanh(self.trunk(x))
        return self.main(h) + self.aux(h) if use_aux else self.main(h)


OPTIONS = {"plain": {}, "find_unused_parameters": {"find_unused_parameters": True},
           "static_graph": {"static_graph": True}}


def unused_branch_on_rank(option: str = "plain", aux_every_other_step: bool = False, steps: int = 3):
    """Train TwoHeads under torch DDP with ``option``; "ok" or the first error, its step and
    where it was raised (``"forward"`` or ``"backward"``).

    ``aux_every_other_step=False``: ``aux`` is never used (the same set every step);
    ``True``: it is used on odd steps only (the graph changes between steps).
    ``grads``: per finished backward, ``trunk.weight.grad``'s sum on this rank (averaged over
    ranks when DDP synchronized, this rank's own when it did not).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if option not in OPTIONS:
        raise ValueError(f"option must be one of {', '.join(OPTIONS)}, got {option!r}")
    model = DDP(TwoHeads(), **OPTIONS[option])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    grads = []
    for step in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        opt.zero_grad()
        where = "forward"
        try:
            loss = F.mse_loss(model(x, use_aux=aux_every_other_step and step % 2 == 1), y)
            where = "backward"
            loss.backward()
        except RuntimeError as err:  # DDP raises the same on every rank, so nothing hangs
            return {"ok": False, "step": step, "where": where, "grads": grads,
                    "error": str(err).split("\n")[0]}
        grads.append(float(model.module.trunk.weight.grad.sum()))
        opt.step()
    return {"ok": True, "step": steps, "where": "", "grads": grads, "error": ""}


def _deep(seed=0, depth=48, width=64):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def detection_cost_on_rank(reps: int = 20, depth: int = 24, width: int = 64) -> dict:
    """Step time of find_unused_parameters and static_graph over plain DDP (every parameter used).

    One model per option, the same start; each rep runs one step of each in turn, so the
    machine's load hits all three alike. Returns the median over reps of each option's
    step time divided by plain DDP's in the same rep, and plain DDP's median step (ms).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    # find_unused_parameters with nothing unused: torch warns once, from C++, that the
    # flag costs a traversal of the autograd graph every iteration. That is the cost measured.
    models = {name: DDP(_deep(0, depth, width), **kw) for name, kw in OPTIONS.items()}
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in models.items()}
    g = torch.Generator().manual_seed(dist.get_rank())
    times = {name: [] for name in models}
    for rep in range(reps + 2):  # the first two reps build and rebuild DDP's buckets
        x = torch.randn(32, width, generator=g)
        for name, model in models.items():
            t0 = time.perf_counter()
            opts[name].zero_grad()
            model(x).pow(2).mean().backward()
            opts[name].step()
            if rep >= 2:
                times[name].append(time.perf_counter() - t0)
    ratios = {name: statistics.median(t / p for t, p in zip(times[name], times["plain"]))
              for name in models if name != "plain"}
    return {"ratio": ratios, "plain_ms": 1000 * statistics.median(times["plain"]),
            "n_params": sum(1 for _ in models["plain"].parameters())}


def nccl_env_aliases() -> dict:
    """``{today's name: [older names still accepted]}`` for every TORCH_NCCL_* setting.

    Read from ProcessGroupNCCL.hpp in the installed wheel, where each setting is a
    list of names, the current one first (torch warns when an older one is used).
    Empty when the wheel ships no such header (then see ``lessons.torch_env_names``).
    """
    header = (pathlib.Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed"
              / "c10d" / "ProcessGroupNCCL.hpp")
    if not header.exists():
        return {}
    text = header.read_text(errors="ignore")
    out = {}
    for name, body in re.findall(r"std::vector<std::string>\s+(TORCH_NCCL_\w+)\s*=\s*\{([^}]*)\}", text):
        names = re.findall(r'"(\w+)"', body)
        out[name] = [n for n in names if n != name]
    return out


# On the CPU on purpose, also on NCCL ranks: the simulated link decides what is timed.
@comm.cpu_gradients_on_purpose()
def straggler_no_sync_on_rank(use_no_sync: bool, pattern: str = "alternating", micro_batches: int = 4,
                              delay_s: float = 0.06, link: str = "1gbe", steps: int = 4,
                              n_params: float = 2.5e5) -> dict:
    """Median optimizer-step time (ms) with a straggler, torch DDP over a SIMULATED link.
    The median of ``steps`` timed steps (4: on a busy machine one slow step moves a median of
    two, enough to hide the 60 ms a late micro-batch costs).

    Each micro-batch one rank sleeps ``delay_s`` before its backward: rank
    ``k % world_size`` at micro-batch k ("alternating": every rank is late in turn),
    or always the last rank ("constant"). ``use_no_sync``: only the last micro-batch
    all-reduces. Sleeping, not computing, so the straggler steals no core.
    """
    import torch.distributed as dist

    from ddplab.netsim import LinkModel
    from ddplab.netsim.simulated import SimulatedLink
    from ddplab.sync.registry import build_strategy

    if pattern not in ("alternating", "constant"):
        raise ValueError(f"pattern must be 'alternating' or 'constant', got {pattern!r}")
    rank, world = dist.get_rank(), dist.get_world_size()
    width = max(8, int((n_params / 2) ** 0.5))
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
    # torch's own DDP: the link sits on the process group, under its C++ reducer
    model = build_strategy("ddp", module).model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, width)
    times = []
    with SimulatedLink(LinkModel.parse(link), world) as simulated, comm.using_link(simulated):
        for step in range(steps + 2):  # two warm-up steps: DDP's one bucket, then its rebuild
            dist.barrier()
            t0 = time.perf_counter()
            for k in range(micro_batches):
                late = k % world if pattern == "alternating" else world - 1
                quiet = model.no_sync() if use_no_sync and k < micro_batches - 1 else contextlib.nullcontext()
                with quiet:
                    loss = model(x).pow(2).mean() / micro_batches
                    if rank == late:
                        time.sleep(delay_s)
                    loss.backward()
            opt.step()
            opt.zero_grad()
            if step >= 2:
                times.append(time.perf_counter() - t0)
    return {"step_ms": 1000 * statistics.median(times), "link": LinkModel.parse(link).describe()}


def straggler_no_sync(cluster, micro_batches: int = 4, delay_s: float = 0.06, link: str = "1gbe") -> dict:
    """{pattern: {"every micro-batch": ms, "no_sync": ms}}, the slowest rank's step (simulated link)."""
    out = {}
    for pattern in ("alternating", "constant"):
        out[pattern] = {}
        for label, quiet in (("every micro-batch", False), ("no_sync", True)):
            per_rank = cluster.run(straggler_no_sync_on_rank, quiet, pattern, micro_batches, delay_s, link)
            out[pattern][label] = max(r["step_ms"] for r in per_rank)
    return out


def join_on_rank(counts) -> dict:
    """torch's own remedy for uneven inputs: every rank trains on ALL its batches under ``join()``.

    A rank that runs out of batches "joins": it keeps answering the others'
    all-reduces with zeros until every rank is done, so nothing hangs and no
    sample is dropped (the price: the late steps average over fewer ranks' data).
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    steps = 0
    with model.join():
        for _ in range(counts[rank]):
            opt.zero_grad()
            model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
            opt.step()
            steps += 1
    return {"steps": steps, "weight": model.module.weight.detach().clone()}
