"""The reference FSDP (ddplab.sync.core.fsdp) trains like one process and like torch's fully_shard.

After EVERY step, on 2 and 3 gloo ranks whose models start from different
weights: the full weights ``full_parameters()`` gathers equal single-process
training on the union of the ranks' batches (float32, within 1e-6) and
torch's ``fully_shard`` on the same model; with a float16/bfloat16
``compute_dtype`` they equal one process that makes the same casts at the
same places (weights and inputs cast before use, each rank's gradient cast
to float32, averaged). Also: shards that do not divide evenly, an
embedding, a tied weight, a layer that gets no gradient in a step, a
replicated norm, and the errors for what is not supported.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dtensor import full_tensor as _full_tensor
from torch import nn

from ddplab.sync import core

# Live ranks, several runs each: make check (test-unit-more), not make test-fast or test-unit.
pytestmark = [pytest.mark.slow, pytest.mark.more]
IN, OUT, ROWS, STEPS = 6, 3, 12, 4


class Stack(nn.Module):
    """Linear layers whose sizes do not divide by 2 or 3 (uneven shards), a norm (replicated),
    and a layer (``skip``) used only on some steps."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, 7)
        self.norm = nn.LayerNorm(7)
        self.fc2 = nn.Linear(7, 5)
        self.skip = nn.Linear(5, 5)
        self.head = nn.Linear(5, OUT)

    def forward(self, x, use_skip=True):
        h = torch.tanh(self.norm(self.fc1(x)))
        h = torch.tanh(self.fc2(h))
        if use_skip:
            h = torch.tanh(self.skip(h))
        return self.head(h)


class TiedLM(nn.Module):
    """An embedding whose weight is also the output layer's: one tensor, two sharded layers."""

    def __init__(self, vocab=11, dim=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens, use_skip=True):
        return self.out(torch.tanh(self.mid(self.emb(tokens))))


def _batch(kind, step, rank=None, world_size=None):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "tied":
        x = torch.randint(0, 11, (ROWS,), generator=g)
        y = torch.randn(ROWS, 11, generator=g)
    else:
        x, y = torch.randn(ROWS, IN, generator=g), torch.randn(ROWS, OUT, generator=g)
    if rank is None:
        return x, y
    n = ROWS // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _model(kind, seed):
    torch.manual_seed(seed)
    return TiedLM() if kind == "tied" else Stack()


def _use_skip(step):
    return step % 2 == 0  # odd steps: ``skip`` gets no gradient


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def _single_process(kind, steps, dtype=None, world_size=1):
    """Rank 0's start, trained in one process. With ``dtype``: each rank's batch in turn, the
    weights and inputs cast to ``dtype`` before use, each gradient cast to float32, averaged."""
    model = _model(kind, 0)
    opt, out = _sgd(model.parameters()), []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        if dtype is None:
            x, y = _batch(kind, step)
            nn.functional.mse_loss(model(x, _use_skip(step)), y).backward()
        else:
            grads = {}
            for r in range(world_size):
                x, y = _batch(kind, step, r, world_size)
                cast = {n: p.detach().to(dtype).requires_grad_()
                        for n, p in model.named_parameters()}
                xin = x if kind == "tied" else x.to(dtype)
                pred = torch.func.functional_call(model, cast, (xin, _use_skip(step)),
                                                  tie_weights=True)
                nn.functional.mse_loss(pred, y).backward()
                for n, t in cast.items():
                    if t.grad is not None:
                        grads.setdefault(n, []).append(t.grad.float())
            for n, p in model.named_parameters():
                if n in grads:
                    p.grad = torch.stack(grads[n]).sum(0) / world_size
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _fsdp_ranks(kind, steps, dtype=None):
    """Each rank starts from ITS OWN weights (seed = rank): FSDP must start from rank 0's."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    fsdp = core.FSDP(_model(kind, rank), compute_dtype=dtype)
    opt, out = _sgd(fsdp.parameters()), []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = _batch(kind, step, rank, ws)
        nn.functional.mse_loss(fsdp(x, _use_skip(step)).float(), y).backward()
        fsdp.finish_gradient_synchronization()
        for n, p in fsdp.module.named_parameters():  # a gradient of its own shape and dtype
            assert p.grad is None or (p.grad.shape == p.shape and p.grad.dtype == torch.float32), n
        if kind == "stack":
            assert (fsdp.module.skip.weight.grad is None) == (not _use_skip(step))
        opt.step()
        out.append(fsdp.full_parameters())
    return out


def _torch_fully_shard(kind, steps):
    from torch.distributed.fsdp import fully_shard

    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _model(kind, 0)  # fully_shard does not broadcast: every rank starts from rank 0's
    for m in model.modules():
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt, out = _sgd(model.parameters()), []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = _batch(kind, step, rank, ws)
        nn.functional.mse_loss(model(x, _use_skip(step)), y).backward()
        opt.step()
        out.append({n: _full_tensor(p) for n, p in model.named_parameters()})
    return out


def _compare(kind, dtype=None):
    ws = dist.get_world_size()
    ours = _fsdp_ranks(kind, STEPS, dtype)
    one = _single_process(kind, STEPS, dtype, ws)
    theirs = _torch_fully_shard(kind, STEPS) if dtype is None and kind == "stack" else None
    worst_one, worst_torch = 0.0, 0.0
    for step in range(STEPS):
        assert ours[step].keys() == one[step].keys()
        for n in one[step]:
            worst_one = max(worst_one, (ours[step][n] - one[step][n]).abs().max().item())
            if theirs is not None:
                worst_torch = max(worst_torch, (ours[step][n] - theirs[step][n]).abs().max().item())
    return worst_one, worst_torch, ours[-1]


@pytest.mark.parametrize("kind", ["stack", "tied"])
@pytest.mark.parametrize("world", ["cluster2", "cluster3"])
def test_float32_equals_one_process_and_torch_fully_shard_after_every_step(kind, world, request):
    results = request.getfixturevalue(world).run(_compare, kind)
    for worst_one, worst_torch, _ in results:
        assert worst_one <= 1e-6
        assert worst_torch <= 1e-6
    first = results[0][2]
    for _, _, last in results[1:]:  # every rank gathers the same model
        assert all(torch.equal(first[n], last[n]) for n in first)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_compute_equals_one_process_making_the_same_casts(cluster2, dtype):
    for worst_one, _, _ in cluster2.run(_compare, "stack", dtype):
        assert worst_one <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_casts_matter_so_the_comparison_could_fail(dtype):
    """Training with the casts differs from float32 training by 10x the tolerance or more."""
    a = _single_process("stack", STEPS)[-1]
    b = _single_process("stack", STEPS, dtype, 2)[-1]
    assert max((a[n] - b[n]).abs().max().item() for n in a) > 1e-5


def _what_each_rank_holds():
    fsdp = core.FSDP(Stack())
    shapes = {n: tuple(p.shape) for n, p in fsdp.module.named_parameters()}
    full = {n: tuple(t.shape) for n, t in fsdp.full_parameters().items()}
    return shapes, full, dist.get_world_size()


def test_each_rank_holds_a_padded_piece_and_full_parameters_gathers_the_shapes(cluster3):
    for shapes, full, ws in cluster3.run(_what_each_rank_holds):
        assert shapes["fc1.weight"] == (-(-6 * 7 // ws),)  # 42 / 3 = 14
        assert shapes["fc2.weight"] == (-(-35 // ws),)  # 35: padded to 36, 12 each
        assert shapes["norm.weight"] == (7,)  # replicated
        assert full["fc2.weight"] == (5, 7) and full["head.bias"] == (OUT,)


def _errors():
    out = []
    for make in (lambda: core.FSDP(Stack().double()),
                 lambda: core.FSDP(nn.Embedding(4, 3, sparse=True)),
                 lambda: core.FSDP(Stack(), compute_dtype=torch.int8),
                 lambda: core.FSDP(Stack(), shard=nn.Linear),
                 lambda: core.FSDP(Stack(), prefetch=True)):
        try:
            make()
            out.append(None)
        except (TypeError, ValueError) as e:
            out.append(str(e))
    shared = Stack()
    shared.norm.weight = nn.Parameter(torch.ones(7))
    shared.fc1.bias = shared.norm.weight  # tied to a module that is not sharded
    try:
        core.FSDP(shared)
        out.append(None)
    except ValueError as e:
        out.append(str(e))
    return out


def test_what_is_not_supported_is_refused_saying_what_to_do(cluster2):
    for msgs in cluster2.run(_errors):
        dtype, sparse, cdtype, classes, option, tied = msgs
        assert "float32 master weights" in dtype and "module.float()" in dtype
        assert "sparse=True" in sparse and "sparse=False" in sparse
        assert "compute_dtype must be" in cdtype
        assert "tuple of module classes" in classes
        assert "does not take prefetch" in option and "fully_shard" in option
        assert "shared by a sharded layer" in tied and "norm.weight" in tied


def _memory_between_forward_and_backward():
    fsdp = core.FSDP(Stack())
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fsdp(_batch("stack", 0, dist.get_rank(), dist.get_world_size())[0])
    fc2 = [t for t in saved if tuple(t.shape) in ((5, 7), (7, 5))]  # fc2's weight, as saved
    after_forward = [t.untyped_storage().size() for t in fc2]
    out.sum().backward()
    return after_forward, fsdp.module.fc2.weight.grad is not None


def test_full_weights_are_freed_after_forward_and_gathered_again_for_backward(cluster2):
    for after_forward, trained in cluster2.run(_memory_between_forward_and_backward):
        assert after_forward and all(size == 0 for size in after_forward)  # freed...
        assert trained  # ...and backward, which needs them, still ran: gathered again
