"""Grader for lab 09: predict torch DDP's buckets from the parameters' sizes and the cap.

``check_bucket_assignment(cluster, fn)`` calls
``fn(params, bucket_cap_mb, ready_order=...)`` in the kernel (``params``: a
model's parameters in ``module.parameters()`` order; ``bucket_cap_mb``: a
number, or None for DDP's default; ``ready_order``: indices into ``params``
in the order their gradients became ready, rank 0's, read from torch DDP's
logging data) and compares the buckets it returns (lists of indices into
``params``, bucket 0 first) with the buckets torch's C++ reducer really used
after its rebuild, read on the live ranks from ``_get_ddp_logging_data()``.

The rule being predicted (torch 2.13, ``compute_bucket_assignment_by_size``
called by ``Reducer::rebuild_buckets``): walk the parameters in the order
their gradients became ready (reverse declaration order for a model that
uses its layers in order; another order for one that does not: a case here
declares its layers in another order than it uses them); keep one open
bucket per (dtype, device); ADD the parameter, then close the bucket once
its bytes reach the limit. The limits are ``[1 MiB, 25 MiB]`` when
``bucket_cap_mb`` is left at its default (the first limit for a dtype's
first bucket, the last one after), else the cap alone. Buckets still open
at the end follow, one per dtype. What is compared in order and what is
not: the buckets that closed during the walk, and the indices inside every
bucket, IN ORDER; the buckets still open at the end AS A SET, because torch
appends those by walking a hash map keyed by dtype and device (reducer.cpp,
"Add remaining buckets"), whose order its code does not choose. Cases end
with one, two and three dtypes open.

Each case is built so that every classic slip gives a different layout, and
a wrong answer is matched against those slips to name the mistake: closing a
bucket BEFORE it would exceed the cap, walking in declaration order,
forgetting the 1 MiB first bucket (or using it with an explicit cap), one
bucket across dtypes, a new bucket at every change of dtype, MB = 10**6
bytes, elements counted instead of bytes, or ``ready_order`` ignored
(``params`` walked from the end whatever order the gradients came in).

Leaves out: sparse gradients (a bucket each), several devices, unused
parameters (``find_unused_parameters=True`` without ``static_graph`` keeps
the first layout: the reducer never rebuilds), ``bucket_cap_mb_list``.
References: torch/nn/parallel/distributed.py (``_BucketCapacityConfig``),
torch/include/torch/csrc/distributed/c10d/reducer.hpp
(``kDefaultFirstBucketBytes``, ``should_rebuild_buckets``), reducer.cpp
(``compute_bucket_assignment_by_size``).
"""
from __future__ import annotations

import traceback

from ddplab.checks import graders
from ddplab.checks.mistakes import EXPLAIN, NOT_IMPLEMENTED, RAISED, CheckFailed
from ddplab.cluster.errors import RankError

MIB = 2 ** 20
FIRST_BUCKET_MB, DEFAULT_CAP_MB = 1, 25

CLOSE_BEFORE = "a bucket closed before it exceeded the cap"
DECLARATION_ORDER = "parameters walked in declaration order"
READY_ORDER_IGNORED = "ready_order ignored: params walked from the end"
NO_FIRST_BUCKET = "the 1 MiB first bucket forgotten"
FIRST_BUCKET_ALWAYS = "a 1 MiB first bucket with an explicit cap"
DTYPES_MIXED = "one bucket holding several dtypes"
SPLIT_ON_DTYPE = "a new bucket at every change of dtype"
DECIMAL_MB = "MB taken as 10**6 bytes"
ELEMENTS = "elements counted instead of bytes"
NOT_BUCKETS = "not a list of buckets of parameter indices"
NO_READY_ORDER = "the function takes no ready_order"
WRONG_LAYOUT = "differs from torch's reducer"

EXPLAIN.update({
    CLOSE_BEFORE: "torch ADDS the parameter to the open bucket, then closes the bucket once its "
                  "size has reached the limit: a bucket ends just over the cap, not under it.",
    DECLARATION_ORDER: "buckets follow the order gradients become ready, and backward produces "
                       "the last layer's gradients first: walk ready_order (params from the end, "
                       "for a model that uses its layers in the order it declares them).",
    READY_ORDER_IGNORED: "params from the end is the ready order only when a model uses its "
                         "layers in the order it declares them: walk ready_order, which is "
                         "the order the gradients really came in.",
    NO_FIRST_BUCKET: "with bucket_cap_mb left at its default (None), the first bucket of each "
                     "dtype closes at 1 MiB, the others at 25 MiB, so that the last gradients "
                     "of backward do not wait in a big bucket.",
    FIRST_BUCKET_ALWAYS: "the small first bucket applies only when bucket_cap_mb is left at its "
                         "default; an explicit cap is used for every bucket.",
    DTYPES_MIXED: "a bucket is one flat tensor, so it holds one dtype: torch keeps one open "
                  "bucket per dtype (and device).",
    SPLIT_ON_DTYPE: "a parameter of another dtype does not close the open bucket: torch keeps "
                    "one open bucket PER dtype side by side, each filling up on its own.",
    DECIMAL_MB: "bucket_cap_mb is in MiB: 1 MB here is 2**20 = 1,048,576 bytes.",
    ELEMENTS: "the cap is in bytes: count p.numel() * p.element_size(), not p.numel().",
    NOT_BUCKETS: "return a list of buckets, bucket 0 first, each a list of indices into params.",
    NO_READY_ORDER: "define it as my_bucket_assignment(params, bucket_cap_mb=None, "
                    "ready_order=None): the check passes the order gradients became ready.",
    WRONG_LAYOUT: "compare your walk with the rule in the lab's section 3, one parameter at a "
                  "time (the buckets still open at the end may come in any order).",
})
graders.TITLES.setdefault("bucket_assignment", "bucket assignment vs torch's reducer")

# (in_features, out_features, dtype name) per Linear layer in declaration order, and
# bucket_cap_mb; a third entry, when there, is the order forward uses the layers in.
CASES = [
    ([(256, 256, "float32")] * 7, None),
    ([(512, 512, "float32")] * 5, 2.0),
    ([(500, 500, "float32")] * 5, 2.0),
    ([(256, 256, "float32")] * 6, 1.0),
    ([(300, 300, "float32"), (300, 300, "float64"), (300, 300, "float32"),
      (300, 300, "float64")], 1.0),
    ([(300, 300, "float64"), (300, 300, "float32"), (300, 300, "float64"),
      (300, 300, "float32"), (300, 300, "float32")], None),
    # Linear(1023, 256) is exactly 1 MiB with its bias: torch closes the bucket there (>=).
    ([(256, 1023, "float32"), (1023, 256, "float32")], 1.0),
    # Linear(1014, 256) is 0.991 MiB: under a 1 MiB cap, over a cap taken as 1000 KiB.
    ([(256, 1014, "float32"), (1014, 256, "float32")], 1.0),
    # One bucket closes, then float32 and float16 are both still open at the end.
    ([(300, 300, "float32"), (300, 300, "float64"), (300, 300, "float32"),
      (300, 300, "float64"), (300, 200, "float16")], None),
    # Three dtypes, all still open at the end.
    ([(300, 300, "float32"), (300, 300, "float64"), (300, 200, "float16")], 2.0),
    # Declared in one order, used 2, 0, 3, 1: the ready order is not params reversed.
    ([(512, 300, "float32"), (256, 16, "float32"), (64, 512, "float32"), (300, 256, "float32")],
     0.5, [2, 0, 3, 1]),
]


def case_model(layers, seed: int = 0, use=None):
    """A chain of Linear layers, each in its own dtype, used in declaration order or ``use``."""
    import torch
    from torch import nn

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(
                nn.Linear(i, o).to(getattr(torch, dt)) for i, o, dt in layers)
            self.use = list(range(len(layers))) if use is None else list(use)

        def forward(self, x):
            for k in self.use:
                layer = self.layers[k]
                x = torch.tanh(layer(x.to(layer.weight.dtype)))
            return x

    torch.manual_seed(seed)
    return Chain()


def _walk(params, bucket_cap_mb, order=None, *, reverse=True, use_ready=True,
          close_before=False, first=None, per_dtype=True, split_on_change=False, mib=MIB,
          count_bytes=True) -> tuple:
    """(buckets closed during the walk, buckets still open at the end)."""
    default = bucket_cap_mb is None
    cap = int((DEFAULT_CAP_MB if default else bucket_cap_mb) * mib)  # bytes, as torch truncates
    limits = [FIRST_BUCKET_MB * mib, cap] if (default if first is None else first) else [cap]
    if not reverse:
        order = range(len(params))
    elif order is None or not use_ready:
        order = range(len(params) - 1, -1, -1)
    open_: dict = {}  # key -> [indices, bytes, which limit]
    out = []
    for i in order:
        p = params[i]
        key = (p.dtype, p.device) if per_dtype else None
        if split_on_change and open_ and key not in open_:
            out += [b[0] for b in open_.values() if b[0]]  # close what is open: a new dtype
            nxt = max(b[2] for b in open_.values())
            open_ = {key: [[], 0, nxt]}
        b = open_.setdefault(key, [[], 0, 0])
        size = p.numel() * (p.element_size() if count_bytes else 1)
        limit = limits[b[2]]
        if close_before and b[0] and b[1] + size > limit:
            out.append(b[0])
            b[0], b[1], b[2] = [], 0, min(b[2] + 1, len(limits) - 1)
            limit = limits[b[2]]
        b[0].append(i)
        b[1] += size
        if not close_before and b[1] >= limit:
            out.append(b[0])
            b[0], b[1], b[2] = [], 0, min(b[2] + 1, len(limits) - 1)
    # torch takes the open ones from a hash map: any order (compared as a set).
    return out, [b[0] for b in reversed(open_.values()) if b[0]]


def layout(params, bucket_cap_mb, order=None, **slip) -> list:
    """torch's rule walking ``order`` (None: params from the end); each keyword of
    ``_walk`` left at its default, or one classic slip."""
    closed, still_open = _walk(params, bucket_cap_mb, order, **slip)
    return closed + still_open


def same_buckets(mine, want, n_open: int) -> bool:
    """Equal with the last ``n_open`` buckets (the ones still open at the end) as a set."""
    cut = len(want) - n_open
    return (len(mine) == len(want) and mine[:cut] == want[:cut]
            and sorted(mine[cut:]) == sorted(want[cut:]))


def _as_rule(params, cap, order, **slip) -> tuple:
    closed, still_open = _walk(params, cap, order, **slip)
    return closed + still_open, len(still_open)


SLIPS = {
    CLOSE_BEFORE: dict(close_before=True),
    DECLARATION_ORDER: dict(reverse=False),
    READY_ORDER_IGNORED: dict(use_ready=False),
    NO_FIRST_BUCKET: dict(first=False),
    FIRST_BUCKET_ALWAYS: dict(first=True),
    DTYPES_MIXED: dict(per_dtype=False),
    SPLIT_ON_DTYPE: dict(split_on_change=True),
    DECIMAL_MB: dict(mib=10 ** 6),
    ELEMENTS: dict(count_bytes=False),
}


def rebuilt_buckets_on_rank(cases, steps: int = 3) -> list:
    """For each case, torch DDP's buckets after its rebuild (lists of parameter indices)
    and the gradient-ready order it was rebuilt from (rank 0's, broadcast by torch)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.pg.backend import device

    out = []
    g = torch.Generator().manual_seed(dist.get_rank())
    for layers, cap, *use in cases:
        use = use[0] if use else None
        model = case_model(layers, use=use).to(device())
        ddp = DDP(model) if cap is None else DDP(model, bucket_cap_mb=cap)
        first = layers[use[0] if use else 0]
        for _ in range(steps):  # iteration 0 records the ready order, the rebuild follows
            x = torch.randn(4, first[0], generator=g).to(device())
            ddp(x).float().square().mean().backward()
        data = ddp._get_ddp_logging_data()
        spec = data.get("rebuilt_per_bucket_param_indices", "")
        buckets = [[int(i) for i in chunk.split()] for chunk in spec.split(",") if chunk.strip()]
        # The order the rebuild used: the ready order of the first iteration, which with these
        # models is every iteration's (the logging data keeps the last one).
        ready = [int(i) for i in data.get("prev_iteration_grad_ready_order_indices", "").split(",")]
        out.append((buckets, ready))
    return out


def expected_ready_order(case) -> list:
    """The ready order backward gives a case's model: the layers used last come first, each
    layer's bias before its weight (checked against torch's logging data by the tests)."""
    layers, _, *use = case
    use = use[0] if use else range(len(layers))
    return [i for k in reversed(list(use)) for i in (2 * k + 1, 2 * k)]


def _as_buckets(value):
    try:
        return [[int(i) for i in b] for b in value]
    except (TypeError, ValueError):
        return None


def _call(fn, params, cap, ready, where):
    try:
        got = fn(params, cap, ready_order=list(ready))
    except NotImplementedError:
        raise CheckFailed(NOT_IMPLEMENTED, f"{getattr(fn, '__name__', 'your function')} "
                                           "raised NotImplementedError") from None
    except TypeError as err:
        if "ready_order" in str(err):
            raise CheckFailed(NO_READY_ORDER, f"{where}: {err}") from None
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        raise CheckFailed(RAISED, f"{where}: {last}") from None
    except Exception as err:  # a learner's bug is a verdict, not a grader crash
        last = traceback.format_exception_only(type(err), err)[-1].strip()
        raise CheckFailed(RAISED, f"{where}: {last}") from None
    mine = _as_buckets(got)
    if mine is None:
        raise CheckFailed(NOT_BUCKETS, f"{where}: got {got!r}")
    return mine


def judge(fn, live: list) -> None:
    """Raise ``CheckFailed`` naming the mistake if ``fn`` differs from ``live`` (torch's buckets
    for each of ``CASES``, from ``rebuilt_buckets_on_rank``); return quietly if it matches."""
    rows = []  # (params, cap, ready order, torch's buckets, yours, buckets open at the end, where)
    for (layers, cap, *use), (want, ready) in zip(CASES, live):
        params = list(case_model(layers, use=use[0] if use else None).parameters())
        rule, n_open = _as_rule(params, cap, ready)
        if not same_buckets(rule, want, n_open):  # torch changed its rule: do not blame the learner
            raise RuntimeError(f"torch's reducer no longer follows the rule this grader knows: "
                               f"{want} for {layers}, cap {cap}; please report it")
        sizes = ", ".join(f"{str(p.dtype)[6:]} {p.numel() * p.element_size():,} B" for p in params)
        where = f"bucket_cap_mb={cap}, ready_order={ready}, params [{sizes}]"
        rows.append((params, cap, ready, want, _call(fn, params, cap, ready, where), n_open, where))
    wrong = [r for r in rows if not same_buckets(r[4], r[3], r[5])]
    if not wrong:
        return
    params, cap, ready, want, mine, n_open, where = wrong[0]
    detail = f"{where}\n  yours:   {mine}\n  torch's: {want}"
    if n_open > 1:
        detail += f"\n  (the last {n_open} buckets were still open at the end: any order)"
    # The slip that explains every case, else the first one that explains this case.
    for pool in (rows, wrong[:1]):
        for mistake, switches in SLIPS.items():
            if all(same_buckets(r[4], *_as_rule(r[0], r[1], r[2], **switches)) for r in pool):
                raise CheckFailed(mistake, detail)
    raise CheckFailed(WRONG_LAYOUT, detail)


def check_bucket_assignment(cluster, fn) -> list:
    """Grade ``fn(params, bucket_cap_mb)`` against torch's rebuilt buckets on the live ranks."""
    graders.passed["bucket_assignment"] = False
    print(f"building torch DDP for {len(CASES)} models on the ranks...", flush=True)
    try:
        live = cluster.run(rebuilt_buckets_on_rank, CASES)[0]
    except RankError as err:  # torch DDP itself failed: not the learner's doing
        raise RuntimeError(f"torch DDP could not run the grader's models: {err}") from None
    judge(fn, live)
    graders.passed["bucket_assignment"] = True
    print(f"your bucket assignment matches torch's reducer on {len(CASES)} models "
          f"(default cap, explicit caps, two and three dtypes open at the end, layers used in "
          f"another order than declared), read live from {cluster.world_size} ranks.")
    return live
