"""The bucket rule, differentially: ddplab's three copies against torch's own C++ assignment.

torch 2.13 exposes the function its reducer calls, ``compute_bucket_assignment_by_size``
in reducer.cpp, as ``torch.distributed._compute_bucket_assignment_by_size``. Thousands of
random parameter lists (one to three dtypes, sizes drawn around the limits, some expecting
sparse gradients) go through it and through:

- ``ddplab.sync.layout``, the full layout: the constructor's call (no order: buckets sorted
  by smallest index) and the rebuild's (a random gradient-ready order);
- ``ddplab.sync.core.bucketed.compute_bucket_assignment_by_size``, the reference (the
  rebuild for gradients in reverse ``parameters()`` order);
- ``ddplab.checks.reducer_map.layout``, the rule lab 09 grades against (any ready order).

Limits: the default cap (a 1 MiB first bucket, then 25 MiB), explicit caps (one limit) and
``bucket_cap_mb_list`` (a list, the last repeating), turned into bytes by ddplab's ``Caps``
and checked against torch's own constants.

Which comparisons are in order and which as sets:
- IN ORDER: the constructor's layout (torch sorts it by smallest index); the rebuild's
  buckets that closed during the walk and the sparse ones (torch appends them as it goes);
  the indices inside every bucket (the order they were added).
- AS A SET: the buckets still open when the walk ends, at the end of a rebuild. torch
  appends those by walking a ``std::unordered_map`` keyed by (dtype, device), so their
  order is the hash map's, which torch's code does not choose. ddplab emits them in the
  reverse of the order each dtype first appeared; the test counts how often that matched
  torch's order and says so (``-s`` prints it) without asserting it.

The sizes are expanded one-element tensors: ``numel()`` and ``element_size()`` are all the
rule reads, and they cost no memory however large.
"""
from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist

from ddplab.checks import reducer_map as lab09
from ddplab.sync import layout
from ddplab.sync.core import bucketed as reference

MB = 2 ** 20
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
CASES = 2000


def _caps(rng):
    """(bucket_cap_mb, bucket_cap_mb_list) as a user would pass them."""
    kind = rng.choice(["default", "default", "explicit", "explicit", "list"])
    if kind == "default":
        return None, None
    if kind == "explicit":
        return rng.choice([0.001, 0.004, 0.01, 0.5, 1.0, 2.0, 25.0, rng.uniform(0.001, 3)]), None
    return None, [rng.choice([0.001, 0.002, 0.01, 0.5, 1.0, 2.0]) for _ in range(rng.randint(1, 3))]


def _params(rng, limits):
    """A random parameter list whose sizes sit around the limits in use."""
    dtypes = rng.sample(DTYPES, rng.choice([1, 1, 2, 2, 3]))
    out = []
    for _ in range(rng.randint(1, 24)):
        dtype = rng.choice(dtypes)
        item = torch.empty((), dtype=dtype).element_size()
        limit = rng.choice(limits)
        nbytes = rng.choice([limit, limit - item, limit + item, limit // 2, limit // 3,
                             limit // 7 + item, item, rng.randint(item, 2 * limit)])
        out.append(torch.empty(1, dtype=dtype).expand(max(1, nbytes // item)))
    return out


def _open_at_end(params, order, limits, sparse):
    """How many buckets are still open when the walk ends (one per dtype at most)."""
    state = {}  # dtype -> [bytes, which limit]
    for i in order:
        if i in sparse:
            continue
        s = state.setdefault(params[i].dtype, [0, 0])
        s[0] += params[i].numel() * params[i].element_size()
        if s[0] >= limits[s[1]]:
            s[0], s[1] = 0, min(s[1] + 1, len(limits) - 1)
    return sum(1 for b, _ in state.values() if b)


def _torch(params, limits, sparse, order=None):
    flags = [i in sparse for i in range(len(params))]
    if order is None:
        return [list(b) for b in dist._compute_bucket_assignment_by_size(params, limits, flags)[0]]
    return [list(b) for b in dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], limits, flags, list(order))[0]]


def _same_rebuild(ours, theirs, n_open):
    """Closed buckets in order, the ones still open as a set; True when the open ones'
    order agreed too."""
    cut = len(theirs) - n_open
    assert ours[:cut] == theirs[:cut]
    assert sorted(ours[cut:]) == sorted(theirs[cut:])
    assert len(ours) == len(theirs)
    return ours[cut:] == theirs[cut:]


def test_ddplabs_bucket_rules_equal_torchs_cpp_assignment_on_random_parameter_lists(capsys):
    assert layout.Caps.create(None).limits == (dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * MB)
    rng = random.Random(20261126)
    t0 = time.perf_counter()
    seen = {"tails": 0, "tails_in_order": 0, "default": 0, "explicit": 0, "list": 0, "sparse": 0}
    for _ in range(CASES):
        cap, cap_list = _caps(rng)
        caps = layout.Caps.create(cap, cap_list)
        limits = list(caps.limits)
        if cap_list is None:  # torch's limits: int(bucket_cap_mb * 1024 * 1024), as distributed.py
            assert limits == ([dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * MB] if cap is None
                              else [int(cap * 1024 * 1024)])
        seen["list" if cap_list else "default" if cap is None else "explicit"] += 1
        params = _params(rng, limits)
        n = len(params)
        sparse = frozenset(i for i in range(n) if rng.random() < 0.1) \
            if rng.random() < 0.2 else frozenset()
        seen["sparse"] += bool(sparse)

        # The constructor's call: parameters() order, buckets sorted. Deterministic: in order.
        assert layout.compute_bucket_assignment_by_size(params, limits, sparse) \
            == _torch(params, limits, sparse)

        # The rebuild's call, in a random ready order, and in reverse parameters() order.
        ready = list(range(n))
        rng.shuffle(ready)
        backwards = list(reversed(range(n)))
        for order in (ready, backwards):
            theirs = _torch(params, limits, sparse, order)
            n_open = _open_at_end(params, order, limits, sparse)
            agreed = _same_rebuild(layout.compute_bucket_assignment_by_size(
                params, limits, sparse, order=order), theirs, n_open)
            seen["tails"] += n_open > 1
            seen["tails_in_order"] += n_open > 1 and agreed
            if not sparse and cap_list is None:  # lab 09's rule: a cap, no sparse gradients
                _same_rebuild(lab09.layout(params, cap, order=order), theirs, n_open)
        theirs = _torch(params, limits, sparse, backwards)
        n_open = _open_at_end(params, backwards, limits, sparse)
        _same_rebuild(layout.assign_buckets(params, cap, sparse=sparse,
                                            bucket_cap_mb_list=cap_list), theirs, n_open)
        if not sparse and cap_list is None:  # the reference takes a cap, no list, no sparse
            _same_rebuild(reference.compute_bucket_assignment_by_size(params, cap), theirs, n_open)
        # The layout a find_unused_parameters run keeps: construction with the caps, reversed.
        assert layout.initial_layout(params, caps, True, False, sparse) \
            == _torch(params, limits, sparse)[::-1]
    elapsed = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\n{CASES} parameter lists ({seen['default']} default cap, {seen['explicit']} "
              f"explicit, {seen['list']} bucket_cap_mb_list, {seen['sparse']} with sparse) in "
              f"{elapsed:.1f} s; {seen['tails']} rebuilds ended with two or more dtypes open, "
              f"their order matched torch's hash map in {seen['tails_in_order']}")
    # The draw must reach the cases the comparison is about.
    assert min(seen["default"], seen["explicit"], seen["list"]) >= CASES // 8
    assert seen["tails"] >= 200 and seen["sparse"] >= 100


def test_lab10s_transformer_is_two_buckets_at_the_default_cap_and_one_at_an_explicit_25():
    """Lab 10's claim, by torch's own rule (reverse parameters() order, as its backward gives):
    the default cap (None) makes a 1 MiB first bucket, so two; only bucket_cap_mb=25 gives one."""
    from ddplab.measure.models import build

    params = [p for p in build("transformer").parameters() if p.requires_grad]
    backwards = list(reversed(range(len(params))))
    sizes = {}
    for cap in (None, 25):
        limits = list(layout.Caps.create(cap).limits)
        buckets = _torch(params, limits, frozenset(), backwards)
        assert layout.assign_buckets(params, cap) == buckets
        sizes[cap] = [sum(params[i].numel() * params[i].element_size() for i in b) for b in buckets]
    assert sizes[None] == [1_056_768, 2_411_520] and sizes[25] == [3_468_288]
