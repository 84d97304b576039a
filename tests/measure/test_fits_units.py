"""FSDP's units with attention: what ddplab.FSDP gathers as one unit, what torch's fully_shard is
applied to (the registry's ``torch_fsdp2`` row), and what ``fits`` predicts, on a
TransformerEncoderLayer (2 gloo ranks).

``nn.MultiheadAttention`` hands ``out_proj.weight`` to ``F.multi_head_attention_forward``
without calling ``out_proj``: a unit of its own there is never gathered. So the attention is
ONE unit (in_proj and out_proj), fully_shard goes on the attention and not on ``out_proj``,
and fits counts the in_proj weights sharded, not replicated. Same tolerance rule as
tests/measure/test_fits.py: what a rank holds and hands the group equals the prediction (the
peak aside: printed, not asserted)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddplab.measure import fits
from ddplab.measure.memory import measure_on
from ddplab.sync.core.fsdp import unit_owners

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test


def attention_model():
    torch.manual_seed(0)  # width 8, 2 heads: every dim 0 divides by 2 (FSDP2 pads by rows)
    return nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), nn.Linear(8, 4))


def test_the_attention_is_one_unit_with_its_out_proj_and_fits_counts_it_so():
    owners = unit_owners(attention_model())
    assert owners["0.self_attn.out_proj"] is owners["0.self_attn"]
    assert owners["0.norm1"] is None and owners["0.linear1"] is not owners["0.self_attn"]
    unit_sizes, replicated = fits.units(attention_model())
    assert sorted(map(sum, unit_sizes)) == sorted([8 * 4 + 4, 16 * 8 + 16, 8 * 16 + 8,
                                                    3 * 8 * 8 + 3 * 8 + 8 * 8 + 8])
    assert replicated == [8, 8, 8, 8]  # the two LayerNorms
    calls = fits.predict_calls(attention_model(), 2, "fsdp")
    assert [op for op, _ in calls].count("all_gather") == 2 * 4  # four units, gathered twice


def _both_fsdps(steps=2):
    """The model under ddplab's FSDP and under the torch_fsdp2 row, ranks starting from
    different weights: their full weights after every Adam step, and fully_shard's modules."""
    from torch.distributed.fsdp import FSDPModule

    from ddplab.sync.core.fsdp import FSDP
    from ddplab.sync.registry import build_strategy

    rank = dist.get_rank()
    torch.manual_seed(rank)
    ours = FSDP(nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), nn.Linear(8, 4)))
    theirs = build_strategy("torch_fsdp2", attention_model()).model
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (ours, theirs)]
    worst = 0.0
    for step in range(steps):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        for m, o in zip((ours, theirs), opts):
            o.zero_grad()
            m(x).square().mean().backward()
            if m is ours:
                m.finish_gradient_synchronization()
            o.step()
        full = ours.full_parameters()
        worst = max(worst, max((full[n] - p.full_tensor()).abs().max().item()
                               for n, p in theirs.named_parameters()))
    return worst, sorted(n for n, m in theirs.named_modules() if isinstance(m, FSDPModule))


def test_torch_fsdp2_shards_the_units_ddplab_makes_and_trains_like_it(cluster2):
    model = attention_model()
    name = {id(m): n for n, m in model.named_modules()}
    units = {name[id(u)] for u in unit_owners(model).values() if u is not None}
    for worst, sharded in cluster2.run(_both_fsdps):
        assert sharded == sorted({"", *units}) == ["", "0.linear1", "0.linear2", "0.self_attn", "1"]
        assert worst <= 1e-5, worst


def test_what_a_rank_holds_and_sends_under_fsdp_with_attention_is_predicted(cluster2):
    example = torch.randn(16, 8)
    for m in measure_on(cluster2, ("fsdp", "torch_fsdp2"), make_model=attention_model):
        pred = fits.predict_memory(attention_model(), 2, example, "fsdp", rank=m["rank"])
        ring = sum(RING[op](2) * n for op, n in m["sent_by_op"].items())
        predicted = fits.ring_bytes(fits.predict_calls(attention_model(), 2, "fsdp"), 2)
        flags = 4 * 4  # ddplab's all-reduce of a flag per replicated parameter (4 LayerNorm's)
        # torch's root gathers and reduce-scatters the LayerNorms instead of all-reducing them:
        # the same ring bytes, without the flags
        assert ring == predicted - (m["row"] == "torch_fsdp2") * flags, (m, predicted)
        if m["row"] == "fsdp":  # ddplab's: held and handed the group exactly as predicted
            assert {f: m[f] for f in ("params", "grads", "optimizer_state")} == \
                {f: pred[f] for f in ("params", "grads", "optimizer_state")}
            assert m["sent_by_op"] == fits.predict_bytes(attention_model(), 2, "fsdp")
            # the peak is not held to 10 % here: fits' peak (four layers gathered, activations
            # from leaf modules' outputs) was fitted to Linear stacks; on this model it read 1.18
            print(f"peak predicted / measured {pred['peak'] / m['peak']:.2f}")
        else:  # torch's root shards the LayerNorms that ddplab replicates: fewer held bytes
            assert m["params"] == pred["params"] - 4 * 4 * 8 // 2


from ddplab.timeline.on_group import RING_FACTOR as RING  # noqa: E402
