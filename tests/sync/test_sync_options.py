"""torch DDP's options on BucketedDDP, each checked against torch DDP with the same option.

Every training test runs BucketedDDP and torch's DistributedDataParallel side
by side on every rank (2 gloo ranks, float64 unless a test needs float32),
both built with the same option, ranks starting from DIFFERENT weights, and
after every step compares gradients (which are None, and their values) and
parameters. float64 tolerance 1e-12, as in test_sync_equivalence.py.

- find_unused_parameters: a branch used on some iterations only, on one
  rank only, on alternating ranks, or only in a no_sync micro-step, and a
  layer used nowhere; without the option the clear error stays;
- static_graph: the unused set is learned in the first iteration (one
  used-map all-reduce in the whole run) and a changed graph is an error;
- gradient_as_bucket_view: every .grad lies inside its bucket's buffer,
  also after zero_grad(set_to_none=True);
- first_bucket_cap_mb: the layout of torch's bucket_cap_mb=None;
- register_comm_hook: torch's hook signature, once per bucket in index
  order; fp16/bf16 compression sends half the bytes and stays within
  16-bit precision of torch's own compression hooks.
"""
from __future__ import annotations

import _sync_helpers as H
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks

from ddplab.sync import MB, BucketedDDP, assign_buckets, comm, comm_hooks
from ddplab.sync.bucket import TORCH_DEFAULT_FIRST_BUCKET_MB

TOL = 1e-12
ONE_EACH = 1 / MB  # a 1-byte cap: every parameter in a bucket of its own


class Branchy(nn.Module):
    """A trunk and head always used, a branch used when asked, a layer never used.

    Declared so that, in reverse order, the never-used layer and the head
    come first: with find_unused_parameters the early buckets must not
    wait for gradients that will not come."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(H.IN, 8)
        self.branch = nn.Linear(8, H.OUT)
        self.head = nn.Linear(8, H.OUT)
        self.never = nn.Linear(8, 8)

    def forward(self, x, use_branch=True):
        h = torch.tanh(self.trunk(x))
        out = self.head(h)
        return out + self.branch(h) if use_branch else out


# Which ranks use the branch, by step, rank and micro-step.
PATTERNS = {
    "always": lambda step, rank, micro: True,
    "some_iterations": lambda step, rank, micro: step % 2 == 0,
    "one_rank": lambda step, rank, micro: rank == 1,
    "alternating_ranks": lambda step, rank, micro: (step + rank) % 2 == 0,
    "first_micro_step_only": lambda step, rank, micro: micro == 0,  # inside no_sync
}


def _make(kind, seed):
    torch.manual_seed(seed)
    if kind == "branchy":
        return Branchy().double()
    if kind == "mlp32":
        return H.MLP().float()
    return H.make_model(kind, seed)


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _grad_diff(a, b):
    """Largest difference of two gradient lists; inf when one is None and the other not."""
    worst = 0.0
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return float("inf")
        if x is not None:
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def _grads_inside_buckets(ddp) -> bool:
    for bucket in ddp.buckets:
        start = bucket.buffer.data_ptr()
        for p in bucket.params:
            if p.grad is None:
                continue
            inside = start <= p.grad.data_ptr() < start + bucket.nbytes
            storage = p.grad.untyped_storage().data_ptr()
            shared = storage == bucket.buffer.untyped_storage().data_ptr()
            if not (inside and shared):
                return False
    return True


def train_with_option(ours_kw, torch_kw, kind="branchy", pattern="always", steps=4,
                      micro_steps=1, cap_mb=ONE_EACH, set_to_none=True, hooks=None,
                      torch_cap="same"):
    """BucketedDDP(**ours_kw) and torch DDP(**torch_kw) trained side by side.

    ``hooks``: (ours, torch's) comm hook, each registered with state None
    (``None``: no hook on that side).
    Returns per step: gradient and parameter differences, whether every
    gradient was inside its bucket, and what went through the choke point.
    """
    rank, ws = dist.get_rank(), dist.get_world_size()
    ours_model, torch_model = _make(kind, 10 + rank), _make(kind, 10 + rank)
    ours = BucketedDDP(ours_model, bucket_cap_mb=cap_mb, **ours_kw)
    theirs = nn.parallel.DistributedDataParallel(
        torch_model, bucket_cap_mb=cap_mb if torch_cap == "same" else torch_cap, **torch_kw)
    for model, hook in zip((ours, theirs), hooks or ()):
        if hook is not None:
            model.register_comm_hook(None, hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, theirs)]
    use = PATTERNS[pattern]
    out = {"grad_diff": [], "param_diff": [], "views": [], "grad_bytes": [], "used_map_calls": [],
           "bucket_bytes": [], "grad_none": []}
    for step in range(steps):
        x, y = H.union_batch(step, 4 * ws * micro_steps)
        if kind == "mlp32":
            x, y = x.float(), y.float()
        kw = (lambda k: {"use_branch": use(step, rank, k)}) if kind == "branchy" else (lambda k: {})  # noqa: B023 (used in this step)
        with comm.counting() as c:
            for k in range(micro_steps):
                chunk = slice(k * 4 * ws, (k + 1) * 4 * ws)
                xl, yl = H.my_slice(x[chunk], rank, ws), H.my_slice(y[chunk], rank, ws)
                last = k == micro_steps - 1
                for model in (ours, theirs):
                    with (H._null() if last else model.no_sync()):
                        (nn.functional.mse_loss(model(xl, **kw(k)), yl) / micro_steps).backward()
        out["grad_diff"].append(_grad_diff(_grads(ours_model), _grads(torch_model)))
        out["grad_none"].append([p.grad is None for p in ours_model.parameters()])
        out["views"].append(_grads_inside_buckets(ours))
        out["grad_bytes"].append(c.grad_bytes)
        out["bucket_bytes"].append(dict(c.bucket_bytes))
        out["used_map_calls"].append(c.calls["used_map"])
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=set_to_none)
        out["param_diff"].append(H.max_diff(ours_model, torch_model))
    out["layout"] = ours.bucket_layout
    out["trainable_bytes"] = sum(p.numel() * p.element_size() for p in ours_model.parameters())
    return out


def check(results, tol=TOL):
    for rank, r in enumerate(results):
        assert max(r["grad_diff"]) < tol, f"rank {rank} grads differ from torch: {r['grad_diff']}"
        assert max(r["param_diff"]) < tol, f"rank {rank} differs from torch DDP: {r['param_diff']}"


# -- find_unused_parameters ---------------------------------------------------------
@pytest.mark.parametrize("cap_mb", [ONE_EACH, 25.0], ids=["bucket_per_param", "one_bucket"])
@pytest.mark.parametrize("pattern", ["some_iterations", "one_rank", "alternating_ranks"])
def test_find_unused_parameters_equals_torch_ddp_after_every_step(cluster2, pattern, cap_mb):
    opt = {"find_unused_parameters": True}
    results = cluster2.run(train_with_option, opt, opt, pattern=pattern, cap_mb=cap_mb)
    check(results)
    never = [i for i, (n, _) in enumerate(Branchy().named_parameters()) if n.startswith("never")]
    for r in results:  # used on no rank: .grad stays None, as in one process
        assert all(all(none[i] for i in never) for none in r["grad_none"])
        assert r["used_map_calls"] == [1] * 4  # one small all-reduce per step


def test_find_unused_parameters_counts_a_use_inside_no_sync(cluster2):
    # The branch runs only in the first micro-step (inside no_sync): its
    # accumulated gradient must still be averaged at the step that syncs.
    opt = {"find_unused_parameters": True}
    check(cluster2.run(train_with_option, opt, opt, pattern="first_micro_step_only",
                       micro_steps=2, steps=3))


def _without_the_option():
    torch.manual_seed(0)
    ddp = BucketedDDP(Branchy().double(), bucket_cap_mb=ONE_EACH)
    x, y = H.union_batch(0, 8)
    try:
        nn.functional.mse_loss(ddp(x, use_branch=False), y).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_without_find_unused_parameters_the_clear_error_stays(cluster2):
    for message in cluster2.run(_without_the_option):
        assert "branch.weight" in message and "never.weight" in message
        assert "got no gradient" in message and "find_unused_parameters=True" in message


# -- static_graph -------------------------------------------------------------------
@pytest.mark.parametrize("find_unused", [False, True])
def test_static_graph_learns_the_unused_set_once_and_equals_torch(cluster2, find_unused):
    opt = {"static_graph": True, "find_unused_parameters": find_unused}
    results = cluster2.run(train_with_option, opt, opt, pattern="one_rank")
    check(results)
    for r in results:  # the used map travels once, in the first iteration
        assert r["used_map_calls"] == [1, 0, 0, 0]


def _static_graph_changes():
    torch.manual_seed(0)
    ddp = BucketedDDP(Branchy().double(), bucket_cap_mb=ONE_EACH, static_graph=True)
    x, y = H.union_batch(0, 8)
    nn.functional.mse_loss(ddp(x, use_branch=False), y).backward()  # learned: branch unused
    try:
        nn.functional.mse_loss(ddp(x, use_branch=True), y).backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_static_graph_refuses_a_graph_that_changed(cluster2):
    for message in cluster2.run(_static_graph_changes):
        assert "static_graph" in message and "branch." in message and "changed" in message


# -- gradient_as_bucket_view ----------------------------------------------------------
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("case", ["two_buckets", "no_sync", "unused_on_one_rank"])
def test_gradient_as_bucket_view_grads_live_in_the_bucket_and_equal_torch(cluster2, case,
                                                                          set_to_none):
    opt = {"gradient_as_bucket_view": True}
    kw = {"cap_mb": 0.0005, "set_to_none": set_to_none}  # 524 B: a few buckets
    if case == "no_sync":
        kw.update(kind="mlp", micro_steps=3, steps=3)
    elif case == "unused_on_one_rank":  # None here, a view after the all-reduce
        opt["find_unused_parameters"] = True
        kw.update(pattern="one_rank")
    else:
        kw.update(kind="mlp")
    results = cluster2.run(train_with_option, opt, opt, **kw)
    check(results)
    for r in results:
        assert len(r["layout"]) > 1
        assert all(r["views"]), r["views"]  # after every step, fresh .grad or not


def _views_survive_zero_grad():
    torch.manual_seed(0)
    model = H.make_model("mlp", 0)
    model(H.union_batch(0, 4)[0]).sum().backward()  # .grad exists before wrapping
    ddp = BucketedDDP(model, bucket_cap_mb=0.0005, gradient_as_bucket_view=True)
    seen = [_grads_inside_buckets(ddp)]  # moved into the buckets at construction
    for set_to_none in (True, False, True):
        model.zero_grad(set_to_none=set_to_none)
        x, y = H.union_batch(1, 8)
        nn.functional.mse_loss(ddp(x), y).backward()
        seen.append(_grads_inside_buckets(ddp) and all(p.grad is not None
                                                        for p in model.parameters()))
    return seen


def test_gradients_return_to_the_bucket_after_zero_grad_set_to_none(cluster2):
    for seen in cluster2.run(_views_survive_zero_grad):
        assert seen == [True] * 4


# -- a small first bucket ---------------------------------------------------------------
def chain():
    # six float64 weights of 256 x 256 = exactly 0.5 MiB each
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(6)]).double()


def test_first_bucket_cap_applies_to_bucket_zero_only():
    params = list(chain().parameters())
    assert assign_buckets(params, 25) == [[5, 4, 3, 2, 1, 0]]
    assert assign_buckets(params, 25, first_bucket_cap_mb=1) == [[5, 4], [3, 2, 1, 0]]
    assert assign_buckets(params, 1, first_bucket_cap_mb=2) == [[5, 4, 3, 2], [1, 0]]


def test_torch_first_bucket_default_is_still_one_mib():
    # what torch's bucket_cap_mb=None uses for its first bucket (see bucket.py)
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == TORCH_DEFAULT_FIRST_BUCKET_MB * MB


def _layouts():
    rank, x = dist.get_rank(), torch.randn(4, 256, dtype=torch.float64)
    torch_layout = {}
    for cap in (None, 25):
        ddp = nn.parallel.DistributedDataParallel(chain(), bucket_cap_mb=cap)
        # Iteration 0 is one bucket, rebuilt before iteration 1; the logging
        # data shows the rebuilt layout from the third iteration on.
        for _ in range(3):
            ddp(x).sum().backward()
        torch_layout[cap] = ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    ours_layout, bytes_per_bucket = {}, {}
    for cap, first in ((None, None), (25.0, TORCH_DEFAULT_FIRST_BUCKET_MB), (25.0, None)):
        model = chain()
        ddp = BucketedDDP(model, bucket_cap_mb=cap, first_bucket_cap_mb=first)
        index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
        ddp(x + rank).sum().backward()  # iteration 0: one bucket, then the rebuild (as torch)
        with comm.counting() as c:
            ddp(x + rank).sum().backward()
        ours_layout[cap, first] = ", ".join(" ".join(str(index[n]) for n in b["params"])
                                            for b in ddp.bucket_layout)
        bytes_per_bucket[cap, first] = c.bucket_bytes
    return torch_layout, ours_layout, bytes_per_bucket


def test_first_bucket_cap_gives_torch_default_layout(cluster2):
    for torch_layout, ours_layout, bytes_per_bucket in cluster2.run(_layouts):
        default, first_1 = ours_layout[None, None], ours_layout[25.0, TORCH_DEFAULT_FIRST_BUCKET_MB]
        assert torch_layout[None] == default == first_1 == "5 4, 3 2 1 0"
        assert torch_layout[25] == ours_layout[25.0, None] == "5 4 3 2 1 0"
        assert bytes_per_bucket[None, None] == {0: MB, 1: 2 * MB}


def test_small_first_bucket_trains_like_torch_default(cluster2):
    check(cluster2.run(train_with_option, {"first_bucket_cap_mb": 0.0005}, {}, kind="mlp",
                       cap_mb=25.0, torch_cap=None))


# -- comm hooks ------------------------------------------------------------------------------
def _recording(inner):
    """A hook that notes what each call saw, then lets ``inner`` reduce."""
    calls = []

    def hook(state, bucket):
        params, grads = bucket.parameters(), bucket.gradients()
        calls.append({"index": bucket.index(), "is_last": bucket.is_last(),
                      "numel": bucket.buffer().numel(),
                      "shapes_match": [g.shape for g in grads] == [p.shape for p in params],
                      "sums_match": sum(p.numel() for p in params) == bucket.buffer().numel()})
        return inner(state, bucket)

    return hook, calls


def _hook_calls(steps=3):
    rank = dist.get_rank()
    ours_hook, ours_calls = _recording(comm_hooks.allreduce_hook)
    torch_hook, torch_calls = _recording(torch_hooks.allreduce_hook)
    rec = comm.ListRecorder()
    ours = BucketedDDP(_make("mlp", 10 + rank), bucket_cap_mb=ONE_EACH, recorder=rec)
    theirs = nn.parallel.DistributedDataParallel(_make("mlp", 10 + rank), bucket_cap_mb=ONE_EACH)
    ours.register_comm_hook(None, ours_hook)
    theirs.register_comm_hook(None, torch_hook)
    per_step = []
    for step in range(steps):
        x, y = H.union_batch(step, 8)
        rec.clear()
        for model, calls in ((ours, ours_calls), (theirs, torch_calls)):
            calls.clear()
            nn.functional.mse_loss(model(H.my_slice(x, rank, 2)), H.my_slice(y, rank, 2)).backward()
        launched = [i["bucket"] for _, i in rec.of("launch", kind="grad")]
        per_step.append((list(ours_calls), list(torch_calls),
                         _grad_diff(_grads(ours.module), _grads(theirs.module)), launched))
        for model in (ours, theirs):
            model.zero_grad()
    return per_step


def test_comm_hook_is_called_once_per_bucket_in_index_order_like_torch(cluster2):
    for per_step in cluster2.run(_hook_calls):
        for step, (ours, theirs, grad_diff, launched) in enumerate(per_step):
            n = 1 if step == 0 else 6  # iteration 0 is one bucket, then both rebuild
            assert [c["index"] for c in ours] == list(range(n))
            assert launched == list(range(n))  # the hook's all-reduces reached the recorder
            assert [c["is_last"] for c in ours] == [False] * (n - 1) + [True]
            assert all(c["shapes_match"] and c["sums_match"] for c in ours)
            if step > 0:
                assert [(c["index"], c["is_last"], c["numel"]) for c in theirs] == \
                       [(c["index"], c["is_last"], c["numel"]) for c in ours]
            assert grad_diff < TOL  # allreduce_hook = what happens without a hook


def test_allreduce_hook_equals_torch_ddp_without_a_hook(cluster2):
    check(cluster2.run(train_with_option, {}, {}, kind="mlp", cap_mb=0.0005,
                       hooks=(comm_hooks.allreduce_hook, None)))


def torch_bf16_hook(state, bucket):
    # torch DDP refuses a hook named bf16_compress_hook unless torch was built with
    # CUDA/HIP and NCCL >= 2.10 (the CPU wheel was not), although gloo reduces
    # bfloat16 on CPU: same function, other name.
    return torch_hooks.bf16_compress_hook(state, bucket)


# float32 parameters; the differences allowed after 4 SGD steps. Against
# torch's own hook the arithmetic is the same (cast, divide, sum of two
# 16-bit values, cast back): measured 0.0. Against no compression it is the
# 16-bit rounding: measured 3e-5 (fp16, 11 significant bits) and 5e-4
# (bf16, 8 bits) after 4 steps.
COMPRESSION = {
    "fp16": (comm_hooks.fp16_compress_hook, torch_hooks.fp16_compress_hook, 1e-6, 2e-4),
    "bf16": (comm_hooks.bf16_compress_hook, torch_bf16_hook, 1e-6, 2e-3),
}


@pytest.mark.parametrize("as_view", [False, True])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_compression_hooks_halve_the_bytes_and_match_torch_hooks(cluster2, dtype, as_view):
    ours_hook, torch_hook, tol_vs_torch_hook, tol_vs_fp32 = COMPRESSION[dtype]
    opt = {"gradient_as_bucket_view": as_view}
    compressed = cluster2.run(train_with_option, opt, opt, kind="mlp32", cap_mb=0.001,
                              hooks=(ours_hook, torch_hook))
    check(compressed, tol=tol_vs_torch_hook)
    uncompressed = cluster2.run(train_with_option, opt, {}, kind="mlp32", cap_mb=0.001,
                                hooks=(ours_hook, None))
    for r, plain in zip(compressed, uncompressed):
        # half of float32's bytes, per bucket, counted at the choke point
        assert r["grad_bytes"] == [r["trainable_bytes"] // 2] * 4
        # (from step 1: iteration 0 is one bucket, as in torch, then the rebuild)
        assert all(b == {x["index"]: x["nbytes"] // 2 for x in r["layout"]}
                   for b in r["bucket_bytes"][1:])
        # compression is real (not float32) and within 16-bit precision of it
        assert 0 < max(plain["param_diff"]) < tol_vs_fp32


# -- misuse says what to do ---------------------------------------------------------------------
def test_bad_first_bucket_cap_and_torchs_none_are_explained():
    with pytest.raises(ValueError, match="first_bucket_cap_mb must be a positive number"):
        BucketedDDP(H.MLP(), first_bucket_cap_mb=0)
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be a positive.*None for torch's"):
        BucketedDDP(H.MLP(), bucket_cap_mb=0)


def _hook_misuse():
    ddp = BucketedDDP(H.make_model("mlp", 0))
    messages = []
    ddp.register_comm_hook(None, lambda state, bucket: bucket.buffer())  # not a future
    for attempt in (lambda: ddp.register_comm_hook(None, comm_hooks.allreduce_hook),
                    lambda: ddp(H.union_batch(0, 8)[0]).sum().backward()):
        try:
            attempt()
        except (RuntimeError, TypeError) as e:
            messages.append(str(e))
    return messages


def test_comm_hook_misuse_is_named(cluster2):
    for twice, not_a_future in cluster2.run(_hook_misuse):
        assert "only be called once" in twice
        assert "must return a torch.futures.Future" in not_a_future
