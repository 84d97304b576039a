"""What every grader trains: a small float64 net with the awkward parts, its data, and the references.

Teaches what a fair test of a gradient synchronization needs (CS336's DDP
tests use the same ingredients):

- float64, so "equal" can mean equal to ~1e-12, and a factor of 2 is never
  lost in rounding;
- a different batch on every rank and every step (seeded by rank and step),
  so a rank that skips the all-reduce has visibly different gradients;
- different initial weights on every rank (seeded by rank), so a wrapper
  that forgets the initial broadcast from rank 0 trains different models;
- a TIED weight (the output layer reuses the embedding) and a FROZEN layer,
  the two cases a naive "for every parameter" loop gets wrong;
- a parameter of the net itself (``scale``): ``parameters()`` lists a
  module's own parameters before its children's, so ``scale`` comes first
  and lands in the LAST bucket, yet its gradient is ready before the tied
  embedding's (bucket 2). A bucketed reducer that launches "whatever is
  full" sends bucket 3 before bucket 2, and the grader sees it.

``references(...)`` builds what the learner is compared with, in ONE place:
one process training on the union of every rank's data, and torch's own
DistributedDataParallel (drawn from the observing process group, for the
timeline beside the learner's). Leaves out: buffers (BatchNorm), uneven batches.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddplab.sync import comm

VOCAB, DIM, HIDDEN, BATCH = 16, 8, 12, 8
SEED = 100  # rank r starts from SEED + r; one process starts from rank 0's weights
LR = 0.1
# Bucket cap for the bucketed exercise: with the rule (reverse parameter order,
# close before going over) the buckets hold 116, 96, 128 and 8 elements:
# distinct sizes, so each launch names its bucket.
BUCKET_CAP_MB = 1000 / 2 ** 20


class GradedNet(nn.Module):
    """embedding (tied with head) -> x scale -> frozen linear -> up -> down -> head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, listed once
        self.scale = nn.Parameter(torch.ones(DIM))  # listed first by parameters()

    def forward(self, idx):
        x = self.embed(idx) * self.scale
        x = torch.tanh(self.frozen(x))
        x = torch.tanh(self.up(x))
        return self.head(self.down(x))


def graded_model(seed: int) -> GradedNet:
    torch.manual_seed(seed)
    return GradedNet().double()


def loss_fn(logits, targets):
    """The loss every exercise uses: the mean over the batch (so ranks must divide)."""
    return F.cross_entropy(logits, targets)


def micro_batches(rank: int, step: int, n_micro: int = 1) -> list:
    """This rank's data for one step: ``n_micro`` pairs (tokens, targets)."""
    out = []
    for m in range(n_micro):
        g = torch.Generator().manual_seed(10_000 * step + 100 * m + rank)
        out.append((torch.randint(0, VOCAB, (BATCH,), generator=g),
                    torch.randint(0, VOCAB, (BATCH,), generator=g)))
    return out


def union(step: int, world_size: int, n_micro: int = 1):
    """Every rank's every micro-batch of one step, as one batch."""
    pairs = [b for r in range(world_size) for b in micro_batches(r, step, n_micro)]
    return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])


def trainable(model: nn.Module) -> list:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def grads_at(model: nn.Module, x, y) -> dict:
    """Gradients of the mean loss on (x, y) at ``model``'s current weights, on a copy."""
    twin = graded_model(SEED)
    twin.load_state_dict(model.state_dict())
    loss_fn(twin(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in trainable(twin)}


def one_process(steps: int, world_size: int, n_micro: int = 1) -> list:
    """Parameters after each step of one process training on every rank's data."""
    model = graded_model(SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(steps):
        x, y = union(step, world_size, n_micro)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        out.append(flat_params(model))
    return out


# float64 on the CPU on purpose, also on NCCL ranks: it is the exact reference, not a timing.
@comm.cpu_gradients_on_purpose()
def references(steps: int, n_micro: int = 1, group=None, recorder=None) -> dict:
    """Run on every rank: ``{"one_process": [...], "torch_ddp": [...]}``, parameters after each step.

    torch DDP trains from per-rank initial weights (it broadcasts rank 0's),
    with ``no_sync`` for all but the last micro-batch; ``recorder`` (a
    ``ddplab.timeline.recorder.Recorder``) receives its traced timeline.
    """
    import torch.distributed as dist

    from ddplab.sync.registry import build_strategy

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # torch DDP as every other part of ddplab builds it: through the registry
    # (traced when a recorder is given), with torch's default 25 MB buckets.
    built = build_strategy("ddp", graded_model(SEED + rank), process_group=group,
                           recorder=recorder)
    ddp, tracer = built.model, built.tracer
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    out = []
    for step in range(steps):
        batches = micro_batches(rank, step, n_micro)
        if recorder is not None:
            recorder.begin_iteration(step)
        opt.zero_grad()
        with tracer.watching():  # its buckets, as the process group is handed them
            for m, (x, y) in enumerate(batches):
                quiet = ddp.no_sync() if m < n_micro - 1 else _nothing()
                with quiet:
                    loss = _stamped(recorder, "forward", lambda: loss_fn(ddp(x), y) / n_micro)  # noqa: B023 (called at once)
                    _stamped(recorder, "backward", loss.backward)
        end = tracer.end_iteration()
        if recorder is not None:
            # DDP waits for its buckets inside backward: its last grad-ready hook
            # marks where compute ended and the wait began (as compare() draws it).
            recorder.split_phase("backward", end["backward_compute_end"], "wait")
        _stamped(recorder, "step", opt.step)
        out.append(flat_params(ddp.module))
    if recorder is not None:
        recorder.end_iteration()
        for it in recorder.timeline.iterations:  # torch's one-bucket and rebuild iterations
            it.flags |= tracer.iteration_flags().get(it.iteration, set())
    return {"one_process": one_process(steps, world, n_micro), "torch_ddp": out}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _stamped(recorder, phase, fn):
    if recorder is None:
        return fn()
    with recorder.phase(phase):
        return fn()
