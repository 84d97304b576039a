"""Coalesced all-gathers and reduce-scatters through the observing group on gloo, which has
no ``*_coalesced`` of them: ``DTensor.full_tensor()`` of a ``fully_shard`` parameter makes one
(ddplab.pg.group issues them one by one there)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test


def _full_tensors():
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from ddplab.pg.group import observing_group

    torch.manual_seed(0)  # the same model on every rank: the full weights are known here
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    want = [p.detach().clone() for p in model.parameters()]
    for m in model:
        fully_shard(m)
    fully_shard(model)
    got = [p.full_tensor() for p in model.parameters()]
    out = [torch.equal(g, w) for g, w in zip(got, want)]
    return {"equal": out, "observed": observing_group() is not None,
            "backend": dist.get_backend(), "local_rows": [p.to_local().shape[0] for p in model.parameters()]}


def test_full_tensor_of_a_fully_shard_parameter_on_two_gloo_ranks(cluster2):
    for r in cluster2.run(_full_tensors):
        assert r["observed"] and r["backend"] == "ddplab_gloo"  # the observing group, on gloo
        assert r["equal"] == [True] * 4
    assert [r["local_rows"] for r in cluster2.run(_full_tensors)] == [[2, 2, 1, 1], [1, 1, 1, 1]]
