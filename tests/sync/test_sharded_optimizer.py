"""ShardedOptimizer (ddplab.sync.core.sharded_optimizer) trains exactly like the unsharded
optimizer, after every step, on 2 and 3 gloo ranks that start from different weights.

Each rank trains torch DDP with a ShardedOptimizer on its slice of the batch; beside it, in
the same process, one model with the plain optimizer trains on the whole batch, and a third
copy under torch's ZeroRedundancyOptimizer. Float64: "equal" is within 1e-12 of one process
(the gradient average adds in another order) and bit for bit with torch's ZeRO and between
the replicas.
"""
from __future__ import annotations

import _sync_helpers as H
import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddplab
from ddplab.sync.core import ShardedOptimizer

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test

OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
}


class Uneven(nn.Module):
    """One big weight and small ones: on 2 and 3 ranks the shares cannot be equal."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(H.IN, 40)
        self.small = nn.Linear(40, 5)
        self.head = nn.Linear(5, H.OUT)

    def forward(self, x):
        return self.head(torch.tanh(self.small(torch.tanh(self.big(x)))))


class SometimesIdle(H.MLP):
    """``side`` gets a gradient only on even steps (a branch the forward skips)."""

    def __init__(self):
        super().__init__()
        self.side = nn.Linear(H.OUT, H.OUT)
        self.use_side = True

    def forward(self, x):
        out = super().forward(x)
        return self.side(out) if self.use_side else out


MODELS = {"mlp": H.MLP, "uneven": Uneven, "tied": H.FrozenTied, "idle": SometimesIdle}


def _model(kind, seed):
    torch.manual_seed(seed)
    return MODELS[kind]().double()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(kind, opt_name, steps=4, groups=False):
    """After every step: (max |sharded - one process|, sharded == torch ZeRO bit for bit,
    replicas equal bit for bit); and each rank's share of the state."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    rank, ws = dist.get_rank(), dist.get_world_size()
    cls, kw = OPTIMIZERS[opt_name]
    ours = nn.parallel.DistributedDataParallel(_model(kind, 10 + rank), find_unused_parameters=(
        kind == "idle"))  # different starts: DDP broadcasts rank 0's
    zero = nn.parallel.DistributedDataParallel(_model(kind, 10 + rank),
                                               find_unused_parameters=(kind == "idle"))
    ref = _model(kind, 10)

    def params(m):
        ps = [p for p in m.parameters() if p.requires_grad]
        if not groups:
            return ps
        return [{"params": ps[:2], "lr": kw["lr"] / 2}, {"params": ps[2:]}]

    opt = ShardedOptimizer(params(ours.module), cls, **kw)
    zopt = ZeroRedundancyOptimizer(params(zero.module), cls, **kw)
    ref_opt = cls(params(ref), **kw)
    out = []
    for step in range(steps):
        idle = kind == "idle" and step % 2 == 1
        for m in (ours.module, zero.module, ref):
            if kind == "idle":
                m.use_side = not idle
        x, y = H.union_batch(step, 4 * ws)
        xl, yl = H.my_slice(x, rank, ws), H.my_slice(y, rank, ws)
        for model, o in ((ours, opt), (zero, zopt)):
            o.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(xl), yl).backward()
            o.step()
        ref_opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        mine = _flat(ours.module)
        every = [torch.empty_like(mine) for _ in range(ws)]
        dist.all_gather(every, mine)
        out.append({"vs_one_process": (mine - _flat(ref)).abs().max().item(),
                    "equals_torch_zero": torch.equal(mine, _flat(zero.module)),
                    "replicas_equal": all(torch.equal(e, every[0]) for e in every)})
    share = {
        "owned": sorted(i for i, p in enumerate(ours.module.parameters()) if p in opt.state),
        "owner": [opt.owner.get(p) for p in ours.module.parameters()],
        "torch_owner": [next((r for r, g in enumerate(zopt._partition_parameters())
                              for grp in g for q in grp["params"] if q is p), None)
                        for p in zero.module.parameters()],
        "ref_state_keys": len(ref_opt.state), "state_keys": len(opt.state)}
    return out, share


# make test: every optimizer, and a parameter that gets no gradient in a step; the uneven
# shares, tied weights, param groups and 3 ranks run in make check
# (tests/sync/test_sharded_optimizer_more.py)
CASES = [("mlp", o) for o in OPTIMIZERS] + [("idle", "adam")]


@pytest.mark.parametrize("kind,opt_name", CASES)
def test_sharded_optimizer_equals_one_process_after_every_step_on_2_ranks(cluster2, kind,
                                                                        opt_name):
    _check(cluster2.run(_train, kind, opt_name), 2)


def _check(results, ws):
    for steps, share in results:
        for i, s in enumerate(steps):
            assert s["vs_one_process"] < 1e-12, f"step {i}: {s}"
            assert s["equals_torch_zero"] and s["replicas_equal"], f"step {i}: {s}"
        # the same partition as torch's: largest first, to the smallest share
        assert share["owner"] == share["torch_owner"]
    # each rank holds the state of its own parameters, and together they hold all of it
    assert sum(share["state_keys"] for _, share in results) == results[0][1]["ref_state_keys"]
    for r, (_, share) in enumerate(results):
        assert share["owned"] == [i for i, o in enumerate(share["owner"]) if o == r]
    assert all(share["owned"] for _, share in results), "a rank got no parameters"
    assert len(results) == ws


def _partition(sizes, ws_check):
    params = [torch.zeros(n) for n in sizes]
    opt = ShardedOptimizer(params, torch.optim.SGD, lr=0.1)
    assert opt.world_size == ws_check
    return [opt.owner[p] for p in params], opt._sizes


def test_shares_are_balanced_by_size_largest_first(cluster2):
    owners, sizes = cluster2.run(_partition, [10, 70, 30, 25, 5], 2)[0]
    # 70 -> 0; 30 -> 1; 25 -> 1 (55); 10 -> 1 (65); 5 -> 1 (70): 70 and 70
    assert owners == [1, 0, 1, 1, 1] and sizes == [70, 70]


def _add_group():
    torch.manual_seed(0)
    a, b = torch.randn(8, requires_grad=True), torch.randn(3, requires_grad=True)
    opt = ShardedOptimizer([a], torch.optim.Adam, lr=0.1)
    opt.add_param_group({"params": [b], "lr": 0.5})
    ref_a, ref_b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ref = torch.optim.Adam([ref_a], lr=0.1)
    ref.add_param_group({"params": [ref_b], "lr": 0.5})
    for _ in range(3):
        for o, (x, y) in ((opt, (a, b)), (ref, (ref_a, ref_b))):
            o.zero_grad()
            ((x ** 2).sum() + (y ** 3).sum()).backward()
            o.step()
    return torch.equal(a, ref_a) and torch.equal(b, ref_b), opt.owner[b], len(opt.state)


def test_add_param_group_shards_the_new_group_too(cluster2):
    (eq0, owner0, n0), (eq1, owner1, n1) = cluster2.run(_add_group)
    assert eq0 and eq1 and owner0 == owner1 == 1  # b went to the rank with the smaller share
    assert (n0, n1) == (1, 1)


def _state_dict_round_trip():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(5, 4).double()
    ref = nn.Linear(5, 4).double()
    ref.load_state_dict(model.state_dict())
    opt = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    for o, m in ((opt, model), (ref_opt, ref)):
        m(torch.ones(2, 5, dtype=torch.float64)).sum().backward()
        o.step()
    try:
        opt.state_dict()
        before = "no error"
    except RuntimeError as e:
        before = str(e)
    opt.consolidate_state_dict(to=1)
    whole = opt.state_dict() if rank == 1 else None
    same = None
    if rank == 1:
        theirs = ref_opt.state_dict()
        same = (whole["param_groups"] == theirs["param_groups"] and
                whole["state"].keys() == theirs["state"].keys() and
                all(torch.equal(whole["state"][i][k], theirs["state"][i][k])
                    for i in theirs["state"] for k in theirs["state"][i]))
    # a fresh sharded optimizer loads the unsharded one's state dict and keeps its share
    fresh = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=0.5)
    fresh.load_state_dict(ref_opt.state_dict())
    kept = sorted(i for i, p in enumerate(model.parameters()) if p in fresh.state)
    return before, same, kept, fresh.param_groups[0]["lr"], fresh.optim.param_groups[0]["lr"]


def test_state_dict_is_consolidated_on_one_rank_and_loads_back_as_shares(cluster2):
    (b0, same0, kept0, lr0, local0), (b1, same1, kept1, lr1, _) = cluster2.run(
        _state_dict_round_trip)
    assert "consolidate_state_dict" in b0 and "consolidate_state_dict" in b1
    assert same0 is None and same1 is True  # rank 1 has the whole, as Adam itself saves it
    assert kept0 == [0] and kept1 == [1]  # weight (20) to rank 0, bias (4) to rank 1
    assert lr0 == lr1 == local0 == 0.1  # the saved learning rate, on our groups and the local one


def _mismatch():
    n = 3 if dist.get_rank() == 0 else 4
    ShardedOptimizer([torch.zeros(n)], torch.optim.SGD, lr=0.1)


def test_ranks_given_different_parameters_get_an_error_not_a_hang(cluster2):
    with pytest.raises(ddplab.RankError, match="same parameters in the same order"):
        cluster2.run(_mismatch)
    assert cluster2.run(lambda: 1) == [1, 1]


def _refused(kwargs, cls):
    try:
        ShardedOptimizer([torch.zeros(3)], cls, **kwargs)
    except (TypeError, NotImplementedError) as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("kwargs,cls,error,words", [
    ({"lr": 0.1, "overlap_with_ddp": True}, torch.optim.SGD, "NotImplementedError",
     "ZeroRedundancyOptimizer"),
    ({"lr": 0.1, "parameters_as_bucket_view": True}, torch.optim.SGD, "NotImplementedError",
     "ZeroRedundancyOptimizer"),
    ({"lr": 0.1}, "adam", "TypeError", "optimizer class such as torch.optim.Adam"),
])
def test_what_is_not_supported_is_refused_in_words(cluster2, kwargs, cls, error, words):
    for got in cluster2.run(_refused, kwargs, cls):
        assert got is not None and got[0] == error and words in got[1]


def test_without_a_process_group_it_says_to_start_one():
    with pytest.raises(RuntimeError, match="start one first"):
        ShardedOptimizer([torch.zeros(3)], torch.optim.SGD, lr=0.1)
