"""Buckets, bytes and overlap: what the choke point and the recorder can prove.

- buckets are filled in reverse parameter order, each closed once it reaches
  the cap (torch's rule; tests/sync/test_sync_layout.py checks it against torch),
  and launched strictly in index order;
- the payload sent per step is the size of the trainable parameters, not of
  the batch, and every byte passes through torch.distributed.all_reduce as
  looked up at call time;
- overlap is real: with a slow first layer, the first bucket's all-reduce
  leaves while backward is still running (and average_gradients' only after).
"""
from __future__ import annotations

import math

import _sync_helpers as H
import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddplab.sync import MB, BucketedDDP, ListRecorder, OverlapDDP, assign_buckets, average_gradients, comm

MLP_NAMES = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]
# float64 bytes of those, in parameters() order
MLP_BYTES = [768, 128, 2048, 128, 384, 24]


def mlp_params():
    return list(H.make_model("mlp", 0).parameters())


# -- assignment: no ranks needed ------------------------------------------------
@pytest.mark.parametrize("cap_bytes, expected", [
    (25 * MB, [[5, 4, 3, 2, 1, 0]]),  # everything in one bucket
    (math.inf, [[5, 4, 3, 2, 1, 0]]),  # no cap at all
    (2600, [[5, 4, 3, 2, 1], [0]]),  # 2,584 B, then fc1.bias makes 2,712: closed
    (1, [[5], [4], [3], [2], [1], [0]]),  # each parameter alone
])
def test_buckets_fill_in_reverse_parameter_order(cap_bytes, expected):
    assert assign_buckets(mlp_params(), cap_bytes / MB) == expected


def test_a_bucket_closes_once_it_reaches_the_cap_not_before():
    # 24 + 384 = 408 B goes over a 400-byte cap: fc3.weight is added, THEN the bucket
    # closes, as torch does (a bucket never stays under the cap for want of a tensor).
    assert assign_buckets(mlp_params(), 400 / MB)[0] == [5, 4]


def test_a_parameter_larger_than_the_cap_closes_the_bucket_it_joins():
    # fc2.weight (2,048 B) and fc1.weight (768 B) are both over a 600-byte cap.
    assert assign_buckets(mlp_params(), 600 / MB) == [[5, 4, 3, 2], [1, 0]]


def test_each_dtype_has_its_own_open_bucket():
    params = [torch.zeros(4, dtype=torch.float32), torch.zeros(4, dtype=torch.float64),
              torch.zeros(4, dtype=torch.float64)]
    # Both buckets are still open at the end, so their order is torch's hash map's (see
    # ddplab/sync/layout.py): compared as a set, each dtype in its own bucket.
    assert sorted(assign_buckets(params, 25)) == [[0], [2, 1]]


# -- on ranks -----------------------------------------------------------------
class DeclaredBackwards(nn.Module):
    """Declares its last layer first, so reverse parameters() order is NOT the
    order backward makes gradients ready: the case index-order launching is for."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(16, H.OUT)
        self.early = nn.Linear(H.IN, 16)

    def forward(self, x):
        return self.late(torch.tanh(self.early(x)))


def _one_step_layout(cap_mb, model_kind, **options):
    torch.manual_seed(0)
    model = DeclaredBackwards().double() if model_kind == "declared_backwards" else \
        H.make_model(model_kind, 0)
    rec = ListRecorder()
    ddp = BucketedDDP(model, bucket_cap_mb=cap_mb, recorder=rec, **options)
    x, y = H.union_batch(0, 8)
    nn.functional.mse_loss(ddp(x), y).backward()  # iteration 0: one bucket, as in torch
    rec.clear()
    with comm.counting() as c:
        nn.functional.mse_loss(ddp(x), y).backward()
    ready_before_first_launch = sorted({i["bucket"] for t, i in rec.of("grad_ready")
                                        if t < rec.first("launch")})
    return {"layout": ddp.bucket_layout, "bucket_bytes": c.bucket_bytes,
            "launch_order": c.launch_order, "ready_before_first_launch": ready_before_first_launch,
            "names": [n for n, _ in model.named_parameters()]}


@pytest.mark.parametrize("cap_bytes, n_buckets", [(25 * MB, 1), (2600, 2), (1, 6)])
def test_bucket_count_order_and_bytes_on_the_wire(cluster2, cap_bytes, n_buckets):
    for r in cluster2.run(_one_step_layout, cap_bytes / MB, "mlp"):
        layout = r["layout"]
        assert len(layout) == n_buckets
        assert [n for b in layout for n in b["params"]] == MLP_NAMES[::-1]
        assert {b["index"]: b["nbytes"] for b in layout} == r["bucket_bytes"]
        assert sum(b["nbytes"] for b in layout) == sum(MLP_BYTES)
        assert r["launch_order"] == list(range(n_buckets))


def test_buckets_launch_in_index_order_even_when_later_ones_are_ready_first(cluster2):
    # find_unused_parameters keeps the construction layout (parameters() order,
    # reversed) for good, as torch does: the rebuild would follow the ready order.
    for r in cluster2.run(_one_step_layout, 1 / MB, "declared_backwards",
                          find_unused_parameters=True):
        assert [b["params"] for b in r["layout"]] == [
            ["early.bias"], ["early.weight"], ["late.bias"], ["late.weight"]]
        # late.* (buckets 2, 3) were ready first and had to wait for 0 and 1
        assert set(r["ready_before_first_launch"]) >= {2, 3}
        assert r["launch_order"] == [0, 1, 2, 3]


def _bytes_per_step(strategy, rows):
    model = H.make_model("frozen_tied", 0)
    wrapped, after_backward = H.wrap(strategy, model)
    x, y = H.union_batch(0, rows)
    nn.functional.mse_loss(wrapped(x), y).backward()  # iteration 0 (bucketed: one bucket)
    after_backward()
    with comm.counting() as c:
        nn.functional.mse_loss(wrapped(x), y).backward()
        after_backward()
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return c.grad_bytes, c.grad_calls, trainable


@pytest.mark.parametrize("strategy, calls", [
    ("manual", 7), ("manual_flat", 1), ("overlap", 7), ("bucketed", 1), (f"bucketed:{1 / MB}", 7)])
def test_bytes_per_step_are_the_trainable_parameters_whatever_the_batch(cluster2, strategy,
                                                                        calls):
    # frozen_tied: 9 parameter names, 8 tensors (the tied weight is one),
    # 7 trainable (frozen.weight is not): 7 all-reduces one at a time.
    small = cluster2.run(_bytes_per_step, strategy, 4)
    large = cluster2.run(_bytes_per_step, strategy, 64)
    for (b_small, n_small, trainable), (b_large, n_large, _) in zip(small, large):
        assert b_small == b_large == trainable
        assert n_small == n_large == calls


def _count_torch_calls():
    # Patch torch.distributed.all_reduce itself: the choke point looks it up
    # at call time, so every gradient byte must show up here too.
    real, seen = dist.all_reduce, []

    def spy(tensor, *args, **kwargs):
        seen.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    out = {}
    dist.all_reduce = spy
    try:
        for strategy in ("manual", "manual_flat", "overlap", "bucketed"):
            model = H.make_model("mlp", 0)
            wrapped, after_backward = H.wrap(strategy, model)
            x, y = H.union_batch(0, 8)
            seen.clear()
            with comm.counting() as c:
                nn.functional.mse_loss(wrapped(x), y).backward()
                after_backward()
            # every kind (overlap adds its launch-order check), and the gradients alone
            out[strategy] = (sum(seen), len(seen), sum(c.bytes.values()),
                             sum(c.calls.values()), c.grad_bytes)
    finally:
        dist.all_reduce = real
    return out


def test_every_gradient_byte_goes_through_torch_all_reduce_via_the_choke_point(cluster2):
    for out in cluster2.run(_count_torch_calls):
        for strategy, (torch_bytes, torch_calls, counted_bytes, counted_calls,
                       grad_bytes) in out.items():
            assert (torch_bytes, torch_calls) == (counted_bytes, counted_calls), strategy
            assert grad_bytes == sum(MLP_BYTES)


SLOW_S = 0.3


def _when_do_all_reduces_start(strategy):
    torch.manual_seed(0)
    model = H.SlowFirstLayer(SLOW_S).double()
    rec = ListRecorder()
    x, y = H.union_batch(0, 8)
    if strategy == "manual":
        nn.functional.mse_loss(model(x), y).backward()
        backward_end = comm.now()
        average_gradients(model, recorder=rec)
    else:
        # 2,584 B: fc3 and fc2 (2,584 B) reach it in bucket 0, fc1 in bucket 1
        wrapped = (OverlapDDP(model, recorder=rec) if strategy == "overlap"
                   else BucketedDDP(model, bucket_cap_mb=2584 / MB, recorder=rec))
        nn.functional.mse_loss(wrapped(x), y).backward()  # iteration 0, then the rebuild
        rec.clear()
        nn.functional.mse_loss(wrapped(x), y).backward()
        backward_end = rec.first("wait_start")  # the queued end-of-backward callback
    launches = {i["bucket"]: t for t, i in rec.of("launch")}
    return {"backward_end": backward_end, "launches": launches,
            "params": {i["bucket"]: i["params"] for _, i in rec.of("launch")}}


@pytest.mark.parametrize("strategy", ["bucketed", "overlap"])
def test_overlap_is_real_first_bucket_leaves_while_backward_still_runs(cluster2, strategy):
    for r in cluster2.run(_when_do_all_reduces_start, strategy):
        first = min(r["launches"].values())
        # backward still had the slow layer (SLOW_S seconds) ahead of it
        assert r["backward_end"] - first > 0.6 * SLOW_S, r
        if strategy == "bucketed":
            assert r["params"][0] == ("fc3.bias", "fc3.weight", "fc2.bias", "fc2.weight")
            assert r["launches"][0] < r["launches"][1]


def test_by_hand_every_all_reduce_starts_after_backward(cluster2):
    for r in cluster2.run(_when_do_all_reduces_start, "manual"):
        assert min(r["launches"].values()) >= r["backward_end"]


def _finish_twice():
    model = H.make_model("mlp", 0)
    ddp = BucketedDDP(model, bucket_cap_mb=3000 / MB)
    x, y = H.union_batch(0, 8)
    nn.functional.mse_loss(ddp(x), y).backward()
    before = [p.grad.clone() for p in model.parameters()]
    with comm.counting() as c:
        ddp.finish_gradient_synchronization()
        ddp.finish_gradient_synchronization()
    same = all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
    return same, c.grad_calls


def test_the_wait_runs_by_itself_and_finishing_again_does_nothing(cluster2):
    for same, calls in cluster2.run(_finish_twice):
        assert same and calls == 0
