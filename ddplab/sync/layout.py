"""Which gradients travel together: torch's bucket assignment, its caps and its rebuild.

Teaches the rule torch's reducer uses (``compute_bucket_assignment_by_size``
in reducer.cpp) and when it applies it. The short version, without the
options, is ``ddplab.sync.core.bucketed``; this module adds what the full
``BucketedDDP`` needs to lay out its buckets exactly as torch's DDP does.

The rule. Tensors are taken in a given order. Each is ADDED to the open
bucket of its dtype and device (one flat buffer holds one of each, so
alternating float32/float16 tensors fill two buckets side by side), and
that bucket closes once its size REACHES its limit: buckets end a little
over the cap, never under it for want of one more tensor. Each dtype and
device walks its own list of limits (the first, then the next, the last
repeating). A sparse gradient gets a bucket of its own. Given no order
(the constructor's call) the buckets come out sorted by their smallest
index; given the gradient-ready order (the rebuild) they stay in the order
they closed, then the buckets still open, one per dtype and device.

What a reader may rely on, and what not. The buckets that closed, and the
sorted constructor layout, come in an order torch's code fixes. The buckets
still open at the end of a rebuild do not: torch's "add remaining buckets"
loop walks a ``std::unordered_map`` keyed by (dtype, device), so their order
is the hash map's. With libstdc++ (the Linux wheels) it came out as the
REVERSE of the order each key first appeared in every case
tests/sync/test_bucket_rule_vs_torch.py drew (the bucket of the first-declared
parameters first), which is the order taken here; that test compares those
buckets as a set and counts how often the order agreed.

The caps (torch/nn/parallel/distributed.py, ``_BucketCapacityConfig``):
``bucket_cap_mb`` in MiB (2**20 bytes); left at None it is 25 with a 1 MiB
FIRST bucket (``dist._DEFAULT_FIRST_BUCKET_BYTES``), while an explicit 25
has no small first bucket; ``bucket_cap_mb_list`` (torch 2.13) gives each
bucket its own limit, the last repeating. ``first_bucket_cap_mb`` is
ddplab's own spelling of the small first bucket, for any cap.

When (``initial_limits`` and ``Layout``):

- construction: torch assigns in ``parameters()`` order and REVERSES the
  list of buckets (backward fills the last layers' first). Without
  ``find_unused_parameters`` (or with ``static_graph``) and without
  ``bucket_cap_mb_list`` the limit is infinite: iteration 0 has ONE bucket
  per dtype and device;
- after the first synchronizing backward: the buckets are REBUILT once, by
  the rule above with the caps, over the parameters in the order their
  gradients became ready, rank 0's order broadcast to every rank. torch
  rebuilds at the next forward that records a graph; so does BucketedDDP;
- with ``find_unused_parameters=True`` (and no ``static_graph``) the
  construction layout, made with the caps, is kept for good: never rebuilt.
  Its small first bucket is then the LAST bucket (the first layers).

``assign_buckets`` is the layout the rebuild gives when gradients arrive in
reverse ``parameters()`` order, as they do in a plain stack of layers: what
``ddplab.sync.core.bucketed`` uses and the graders expect.

Leaves out, compared with torch: a promise about the order of the buckets
still open at the end of a rebuild when there are several dtypes (above),
``DDP_SET_LAST_BUCKET_CAP``.

References: torch/csrc/distributed/c10d/reducer.cpp
(``compute_bucket_assignment_by_size``, ``rebuild_buckets``,
``sync_bucket_indices``); torch/nn/parallel/distributed.py
(``_BucketCapacityConfig``, ``_ddp_init_helper``).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import sys

MB = 2 ** 20  # bucket_cap_mb is in MiB, as in torch
DEFAULT_BUCKET_CAP_MB = 25.0  # torch's when bucket_cap_mb is None
# torch's first bucket when bucket_cap_mb is left at None
# (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES on 2.13; a test pins it).
TORCH_DEFAULT_FIRST_BUCKET_MB = 1.0
NO_LIMIT = sys.maxsize  # torch's limit for the one-bucket first iteration


def check_bucket_cap(bucket_cap_mb, name: str = "bucket_cap_mb") -> float:
    """A cap in MiB as a float, or a ValueError that says what to pass."""
    ok = (isinstance(bucket_cap_mb, numbers.Real) and not isinstance(bucket_cap_mb, bool)
          and not math.isnan(bucket_cap_mb) and bucket_cap_mb > 0)
    if not ok:
        raise ValueError(
            f"{name} must be a positive number of megabytes (MB = 2**20 bytes), got "
            f"{bucket_cap_mb!r}. Pass e.g. 25.0, None for torch's default (25 with a 1 MB first "
            "bucket), a small value such as 0.001 for many small buckets, or float('inf') for "
            "one bucket holding every gradient.")
    return float(bucket_cap_mb)


def _nbytes(mb: float) -> int:
    return NO_LIMIT if math.isinf(mb) else int(mb * MB)


@dataclasses.dataclass(frozen=True)
class Caps:
    """Bucket limits in bytes: ``limits`` for the rebuild (and a find_unused layout)."""

    limits: tuple
    per_bucket: bool = False  # from bucket_cap_mb_list: also used at construction

    @classmethod
    def create(cls, bucket_cap_mb=None, bucket_cap_mb_list=None, first_bucket_cap_mb=None):
        if bucket_cap_mb_list:
            return cls(tuple(_nbytes(check_bucket_cap(c, "bucket_cap_mb_list entries"))
                             for c in bucket_cap_mb_list), per_bucket=True)
        default = bucket_cap_mb is None
        cap = _nbytes(DEFAULT_BUCKET_CAP_MB if default else check_bucket_cap(bucket_cap_mb))
        if first_bucket_cap_mb is not None:
            first = _nbytes(check_bucket_cap(first_bucket_cap_mb, "first_bucket_cap_mb"))
        else:
            first = _nbytes(TORCH_DEFAULT_FIRST_BUCKET_MB) if default else cap
        return cls((first, cap) if first != cap else (cap,))

    def initial_limits(self, find_unused_parameters: bool, static_graph: bool) -> tuple:
        """torch's limits at construction (``compute_bucket_size_limits``)."""
        if self.per_bucket or (find_unused_parameters and not static_graph):
            return self.limits
        return (NO_LIMIT,)


def compute_bucket_assignment_by_size(params, limits, sparse=frozenset(), order=None) -> list:
    """torch's rule (module docstring): lists of indices into ``params``.

    ``order``: the indices in the order to take them (gradient-ready order);
    None takes ``parameters()`` order and sorts buckets by smallest index.
    """
    taken = range(len(params)) if order is None else order
    result, open_buckets = [], {}  # (dtype, device) -> [indices, bytes, which limit]
    for i in taken:
        p = params[i]
        if i in sparse:
            result.append([i])
            continue
        key = (p.dtype, p.device)
        bucket = open_buckets.setdefault(key, [[], 0, 0])
        bucket[0].append(i)
        bucket[1] += p.numel() * p.element_size()
        if bucket[1] >= limits[bucket[2]]:  # added first, closed once it reaches the limit
            result.append(bucket[0])
            open_buckets[key] = [[], 0, min(bucket[2] + 1, len(limits) - 1)]
    # The buckets still open. torch walks its hash map here: the map's order, which was the
    # reverse of first appearance in every case the differential test drew (see above).
    result += [b[0] for b in reversed(open_buckets.values()) if b[0]]
    if order is None:
        result.sort(key=min)
    return result


def assign_buckets(params, bucket_cap_mb=None, first_bucket_cap_mb=None, *, sparse=frozenset(),
                   bucket_cap_mb_list=None) -> list:
    """The rebuilt layout when gradients arrive in reverse ``params`` order (a plain stack
    of layers): buckets of indices into ``params``, bucket 0 first to fill."""
    caps = Caps.create(bucket_cap_mb, bucket_cap_mb_list, first_bucket_cap_mb)
    return compute_bucket_assignment_by_size(params, caps.limits, sparse,
                                             order=list(reversed(range(len(params)))))


def initial_layout(params, caps: Caps, find_unused_parameters: bool, static_graph: bool,
                   sparse=frozenset()) -> list:
    """torch's layout at construction: assigned in ``parameters()`` order, then reversed."""
    limits = caps.initial_limits(find_unused_parameters, static_graph)
    return compute_bucket_assignment_by_size(params, limits, sparse)[::-1]


def rebuilds(find_unused_parameters: bool, static_graph: bool) -> bool:
    """Whether torch rebuilds after the first iteration (``should_rebuild_buckets``)."""
    return static_graph or not find_unused_parameters


def rebuilt_layout(params, caps: Caps, ready_order, sparse=frozenset()) -> list:
    """The rebuild: the caps over the parameters in gradient-ready order (rank 0's).
    Parameters that never got a gradient (unused under static_graph) come last."""
    seen = set(ready_order)
    order = list(ready_order) + [i for i in range(len(params)) if i not in seen]
    return compute_bucket_assignment_by_size(params, caps.limits, sparse, order=order)
