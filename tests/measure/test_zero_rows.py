"""compare()'s ZeRO-1 rows: ``zero1`` (ddplab.ShardedOptimizer) and ``torch_zero`` (torch's
ZeroRedundancyOptimizer) train like DDP, and send DDP's all-reduce plus one broadcast of
the parameters per step, counted at the observing group."""
from __future__ import annotations

import pytest

from ddplab.measure.compare import compare

pytestmark = pytest.mark.more  # make check runs it (make test-unit-more), not make test


def test_zero_rows_send_ddps_bytes_plus_the_parameters_and_agree(cluster2):
    r = compare(cluster2, strategies=("ddp", "zero1", "torch_zero"), steps=3, warmup=1,
                record=False)
    m = r.metrics
    mem = m["zero1"]["memory_per_rank"]
    param_bytes = mem[0]["params"]
    assert param_bytes > 0 and m["ddp"]["comm_bytes_per_step"] > 0
    for row in ("zero1", "torch_zero"):
        assert m[row]["ranks_agree"]
        # every rank hands the group each parameter once (sending it, or receiving it)
        assert m[row]["comm_bytes_per_step"] == m["ddp"]["comm_bytes_per_step"] + param_bytes
        assert m[row]["step_ms"] > 0
    for row in ("ddp", "zero1", "torch_zero"):
        held = m[row]["memory_per_rank"]
        assert len(held) == 2 and all(h["params"] == param_bytes for h in held)
        assert all(h["optimizer_state"] == 0 for h in held)  # plain SGD keeps no state


def _traffic(names):
    from ddplab.lessons.sharding import traffic_on_rank

    return {name: traffic_on_rank(name) for name in names}


def test_zero2_row_sends_ddps_ring_bytes_and_holds_what_fits_predicts(cluster2):
    """The registry's ``zero2`` (ZeroTwo over SGD, no DDP) in compare and at the group: it
    trains like DDP, its ring bytes per step equal DDP's and fits' prediction, and what each
    rank holds (parameters whole, gradients and its float32 copy a 1/2 slice) is predicted."""
    import torch

    from ddplab.lessons.sharding import stack
    from ddplab.measure import fits
    from ddplab.measure.spec import RunSpec
    from ddplab.measure.workload import build_model, make_batch

    r = compare(cluster2, strategies=("ddp", "zero2"), steps=3, warmup=1, record=False)
    m, spec = r.metrics, RunSpec()
    assert m["zero2"]["ranks_agree"] and m["zero2"]["step_ms"] > 0
    model = build_model(spec.model, spec.seed, spec.model_kwargs)
    example = make_batch(spec.model, None, spec.batch_size, 0, 0)[0]
    assert m["zero2"]["comm_bytes_per_step"] == sum(fits.predict_bytes(model, 2, "zero2").values())
    for rank, held in enumerate(m["zero2"]["memory_per_rank"]):
        pred = fits.predict_memory(model, 2, example, "zero2", torch.optim.SGD, rank=rank)
        assert held == {f: pred[f] for f in ("params", "grads", "optimizer_state")}, (held, pred)
        assert 2 * held["grads"] == m["ddp"]["memory_per_rank"][rank]["grads"]
    # ring bytes, counted at the group during one step (the optimizer's step included)
    per_rank = cluster2.run(_traffic, ("ddp", "zero1", "zero2"))
    predicted = fits.ring_bytes(fits.predict_calls(stack(), 2, "zero2"), 2)
    for t in per_rank:
        assert {c[:2] for c in t["zero2"]["calls"]} == {("reduce_scatter_tensor", "step"),
                                                       ("all_gather_into_tensor", "step")}
        assert t["zero2"]["ring_bytes"] == t["ddp"]["ring_bytes"] == predicted
        assert t["zero1"]["ring_bytes"] == 1.5 * t["ddp"]["ring_bytes"]
