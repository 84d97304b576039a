"""Same buckets as torch: the reference, the full BucketedDDP and torch's DDP lay them out alike.

Checked two ways for each case: against torch's own rule
(``dist._compute_bucket_assignment_by_size``, called as torch's constructor
and its rebuild call it), and against a live torch DDP's logging data
(``_get_ddp_logging_data()``: ``bucket_sizes`` at construction,
``rebuilt_bucket_sizes`` and ``rebuilt_per_bucket_param_indices`` after the
rebuild). Cases: 10 tensors of 0.6 MiB at 2 MiB (4, 4, 2); bucket_cap_mb
left at None (a 1 MiB first bucket) and given; alternating float32/float16
(one open bucket per dtype); find_unused_parameters (construction layout in
parameters() order, reversed, never rebuilt); the rebuild in gradient-ready
order; torch 2.13's bucket_cap_mb_list; find_unused_parameters with
static_graph (one bucket at construction, then rebuilt, the unused layer
last). The rule itself is fuzzed against torch's in tests/sync/test_bucket_rule_vs_torch.py.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddplab
from ddplab.sync import core
from ddplab.sync.layout import MB, Caps, assign_buckets, compute_bucket_assignment_by_size, initial_layout

N06 = int(0.6 * MB) // 4  # float32 elements in 0.6 MiB


def tensors(n=10, numel=N06):
    return [torch.zeros(numel) for _ in range(n)]


def alternating():
    # float32 of 40 bytes and float16 of 40 bytes: two of a dtype reach an 80-byte cap
    return [torch.zeros(10) if i % 2 == 0 else torch.zeros(20, dtype=torch.float16)
            for i in range(8)]


def torch_rebuilt(params, limits):
    """torch's rebuild when gradients arrive in reverse parameters() order."""
    order = list(reversed(range(len(params))))
    return dist._compute_bucket_assignment_by_size([params[i] for i in order], list(limits),
                                                   [False] * len(params), order)[0]


def torch_initial(params, limits):
    """torch's constructor: parameters() order, buckets reversed for the reducer."""
    return dist._compute_bucket_assignment_by_size(params, list(limits),
                                                   [False] * len(params))[0][::-1]


def test_a_tensor_is_added_then_the_bucket_closes_once_it_reaches_the_cap():
    ps = tensors()
    expected = [[9, 8, 7, 6], [5, 4, 3, 2], [1, 0]]  # 4, 4, 2 tensors: 2.4, 2.4, 1.2 MiB
    assert torch_rebuilt(ps, [2 * MB]) == expected
    assert core.compute_bucket_assignment_by_size(ps, 2) == expected
    assert assign_buckets(ps, 2) == expected


def test_the_small_first_bucket_comes_only_with_the_default_cap():
    ps = tensors()
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == MB  # torch 2.13's 1 MiB
    default = torch_rebuilt(ps, [MB, 25 * MB])
    assert default == [[9, 8], [7, 6, 5, 4, 3, 2, 1, 0]]
    assert core.compute_bucket_assignment_by_size(ps, None) == default
    assert assign_buckets(ps, None) == default
    assert assign_buckets(ps, 25) == [list(range(9, -1, -1))] == torch_rebuilt(ps, [25 * MB])
    assert assign_buckets(ps, 25, first_bucket_cap_mb=1) == default


def test_one_open_bucket_per_dtype():
    ps = alternating()
    assert dist._compute_bucket_assignment_by_size(ps, [80], [False] * 8)[0] == \
        compute_bucket_assignment_by_size(ps, (80,)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    rebuilt = torch_rebuilt(ps, [80])
    assert rebuilt == [[7, 5], [6, 4], [3, 1], [2, 0]]
    assert core.compute_bucket_assignment_by_size(ps, 80 / MB) == rebuilt
    assert assign_buckets(ps, 80 / MB) == rebuilt


def test_find_unused_parameters_keeps_the_construction_layout_reversed():
    ps = tensors()
    for cap, limits in ((2, [2 * MB]), (None, [MB, 25 * MB])):
        ours = initial_layout(ps, Caps.create(cap), find_unused_parameters=True,
                              static_graph=False)
        assert ours == torch_initial(ps, limits)
    # its small first bucket is the LAST one: the first layers
    assert initial_layout(ps, Caps.create(None), True, False) == [[2, 3, 4, 5, 6, 7, 8, 9],
                                                                 [0, 1]]
    # without find_unused_parameters (or with static_graph): one bucket until the rebuild
    assert initial_layout(ps, Caps.create(2), False, False) == [list(range(10))] == \
        torch_initial(ps, [sys.maxsize])
    assert initial_layout(ps, Caps.create(2), True, True) == [list(range(10))]


def test_bucket_cap_mb_list_gives_each_bucket_its_limit():
    ps = tensors()
    caps = Caps.create(None, [1, 2])
    assert initial_layout(ps, caps, False, False) == torch_initial(ps, [MB, 2 * MB])
    assert assign_buckets(ps, bucket_cap_mb_list=[1, 2]) == torch_rebuilt(ps, [MB, 2 * MB]) \
        == [[9, 8], [7, 6, 5, 4], [3, 2, 1, 0]]


# -- live: torch DDP's logging data against the wrappers ----------------------------------
class Stack(nn.Module):
    """Four 400x400 float32 layers (0.61 MiB weights); ``backwards`` declares them last-first."""

    def __init__(self, backwards=False, mixed=False, spare=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(400, 400) for _ in range(4))
        if mixed:
            self.layers[1].half(), self.layers[3].half()
        self.order = [3, 2, 1, 0] if backwards else [0, 1, 2, 3]
        if spare:  # declared last, never used: no gradient ever
            self.spare = nn.Linear(400, 400)

    def forward(self, x):
        for i in self.order:
            x = self.layers[i](x.to(self.layers[i].weight.dtype))
        return x.float()


def _bucket_sizes(buckets):
    return ", ".join(str(b["nbytes"]) for b in buckets)


def _layouts_on_rank(ddp_kw, backwards=False, mixed=False, spare=False):
    def model():
        torch.manual_seed(0)
        return Stack(backwards, mixed, spare)

    full_kw = {k: v for k, v in ddp_kw.items()}
    wrappers = {"ddp": nn.parallel.DistributedDataParallel(model(), **ddp_kw),
                "full": ddplab.BucketedDDP(model(), **full_kw)}
    core_ok = not (ddp_kw.get("find_unused_parameters") or ddp_kw.get("bucket_cap_mb_list")
                   or ddp_kw.get("static_graph"))
    if core_ok:
        wrappers["core"] = core.BucketedDDP(model(), bucket_cap_mb=ddp_kw.get("bucket_cap_mb"))
    names = [n for n, _ in model().named_parameters()]
    seen = {k: [] for k in wrappers}
    for _step in range(4):
        x = torch.randn(2, 400)
        for k, w in wrappers.items():
            w(x).sum().backward()
            if k == "full":
                seen[k].append([[names.index(n) for n in b["params"]] for b in w.bucket_layout])
            elif k == "core":
                seen[k].append(w.bucket_indices)
    return {"seen": seen, "log": wrappers["ddp"]._get_ddp_logging_data(), "names": names,
            "full_bytes": _bucket_sizes(wrappers["full"].bucket_layout)}


def _indices(text):
    return [[int(i) for i in b.split()] for b in text.split(",")]


@pytest.mark.parametrize("kw, backwards", [({}, False), ({"bucket_cap_mb": 2}, False),
                                           ({"bucket_cap_mb_list": [1, 2]}, False),
                                           ({"bucket_cap_mb": 1}, True)])
def test_rebuilt_layouts_equal_torch_ddps(cluster2, kw, backwards):
    r = cluster2.run(_layouts_on_rank, kw, backwards)[0]
    log, seen = r["log"], r["seen"]
    assert log["has_rebuilt_buckets"] == 1
    torch_rebuilt_layout = _indices(log["rebuilt_per_bucket_param_indices"])
    # the full reducer: torch's first layout at step 0, the rebuilt one from step 1 on
    assert seen["full"][1:] == [torch_rebuilt_layout] * 3
    assert r["full_bytes"] == log["rebuilt_bucket_sizes"]
    ready = [int(i) for i in log["prev_iteration_grad_ready_order_indices"].split(",")]
    if "bucket_cap_mb_list" not in kw:
        assert len(seen["full"][0]) == 1  # iteration 0: one bucket, as in torch's
        assert log["bucket_sizes"] == str(_one_bucket_bytes(backwards))  # logging data
    if "core" in seen:
        if ready == list(range(len(r["names"])))[::-1]:  # gradients in reverse declaration order
            assert seen["core"][0] == torch_rebuilt_layout
        else:  # the reference never rebuilds: reverse parameters() order, said in its docstring
            assert seen["core"][0] != torch_rebuilt_layout
            assert seen["core"][0] == core.compute_bucket_assignment_by_size(
                list(Stack(backwards).parameters()), kw.get("bucket_cap_mb"))


def test_find_unused_parameters_is_never_rebuilt_like_torch(cluster2):
    r = cluster2.run(_layouts_on_rank, {"bucket_cap_mb": 2, "find_unused_parameters": True})[0]
    log = r["log"]
    assert log["has_rebuilt_buckets"] == 0
    assert r["full_bytes"] == log["bucket_sizes"] == "1600, 2564800"
    assert r["seen"]["full"][0] == r["seen"]["full"][-1] == [[7], [0, 1, 2, 3, 4, 5, 6]]


def test_mixed_dtypes_rebuild_like_torch(cluster2):
    r = cluster2.run(_layouts_on_rank, {"bucket_cap_mb": 0.5}, False, True)[0]
    log = r["log"]
    assert len(r["seen"]["full"][0]) == 2  # iteration 0: one bucket per dtype
    # Both dtypes are still open when the walk ends (0.5 MiB: 2 x 0.61 MiB closes one bucket of
    # each): the buckets that closed in order, the open ones as a set (torch's hash map
    # order); ddplab's order for those matched torch's here too.
    theirs = _indices(log["rebuilt_per_bucket_param_indices"])
    ours = r["seen"]["full"][-1]
    assert ours[:-2] == theirs[:-2] and sorted(ours[-2:]) == sorted(theirs[-2:])
    assert ours == theirs
    assert r["seen"]["core"][0] == ours


def _one_bucket_bytes(backwards=False, mixed=False, spare=False):
    return sum(p.numel() * p.element_size() for p in Stack(backwards, mixed, spare).parameters())


def test_find_unused_parameters_with_static_graph_is_one_bucket_then_rebuilt_like_torch(cluster2):
    # static_graph=True brings back torch's one-bucket first iteration and the rebuild
    # ((static_graph_ || !find_unused_parameters_) && !has_rebuilt_bucket_); the spare layer
    # never gets a gradient, and the rebuild puts it after the ones that did.
    r = cluster2.run(_layouts_on_rank, {"bucket_cap_mb": 1, "find_unused_parameters": True,
                                        "static_graph": True}, False, False, True)[0]
    log = r["log"]
    assert log["bucket_sizes"] == str(_one_bucket_bytes(spare=True))  # construction: one bucket
    assert len(r["seen"]["full"][0]) == 1
    assert log["has_rebuilt_buckets"] == 1
    theirs = _indices(log["rebuilt_per_bucket_param_indices"])
    assert r["seen"]["full"][-1] == theirs
    assert r["full_bytes"] == log["rebuilt_bucket_sizes"]
    assert sorted([i for b in theirs for i in b][-2:]) == [8, 9], theirs  # the spare comes last
