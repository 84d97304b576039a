"""Inside torch's reducer: where each step of DistributedDataParallel lives in the INSTALLED torch.

Teaches the path one training step takes through torch's DDP, and which
ddplab piece mirrors each step: the reference reducer
``ddplab.sync.core.bucketed`` (same names, plain torch.distributed calls)
where it has the step, else the full ``ddplab.sync.BucketedDDP``:

- Python, in ``torch/nn/parallel/distributed.py``: the constructor assigns
  buckets and builds a C++ ``Reducer``; ``forward`` calls ``_pre_forward``
  (``prepare_for_forward``, a bucket rebuild after the first iteration) and
  ``_post_forward`` (``prepare_for_backward``);
- C++, declared in ``torch/include/torch/csrc/distributed/c10d/reducer.hpp``
  (the wheel ships this header): ``autograd_hook`` runs as each gradient is
  accumulated, ``mark_variable_ready`` copies it into its bucket,
  ``mark_bucket_ready`` launches buckets in index order, ``finalize_backward``
  (queued by ``mark_variable_ready`` once the last bucket is launched) waits
  for them at the end of backward, ``rebuild_buckets`` re-lays them in
  the order gradients became ready. ``reducer.cpp`` is NOT in the wheel:
  ``cpp_url()`` links it at the installed version's release tag.

Everything is found at run time (``inspect`` for Python, a text search of
the header), so ``locate()`` raises ``LookupError`` naming the step when a
torch release renames something, instead of teaching names that are gone.

``rebuild_on_rank()`` watches it live on a model whose parameters are
declared in another order than they are used: gradient-ready order, the
one-bucket first iteration, the rebuilt layout from DDP's logging data,
and beside it the full BucketedDDP's layout at every iteration (one
bucket, then rebuilt the same way) and the reference's (reverse
declaration order from the start: it leaves the rebuild out).

Leaves out: the C++ bodies themselves (read them at ``cpp_url()``), the
static-graph, unused-parameter and join paths, the logger and the CUDA side.
(With ``find_unused_parameters=True`` and no ``static_graph`` torch never
rebuilds: its first layout, made with the caps, stays; ``ddplab.sync.layout``
says more.)
References: torch/nn/parallel/distributed.py; torch/csrc/distributed/c10d/
reducer.hpp and reducer.cpp; torch's "DDP internal design" notes.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import pathlib
import re

REPO = "https://github.com/pytorch/pytorch"


@dataclasses.dataclass(frozen=True)
class Step:
    step: str        # what happens, in a few words
    python: str      # attribute path in torch.nn.parallel.distributed ("" when C++ only)
    needle: str      # a name that must appear there (a call, or the declaration in the header)
    ddplab: str      # the dotted ddplab name that mirrors it ("" when ddplab leaves it out)
    why: str         # one sentence, in this project's words


STEPS = (
    Step("assign parameters to buckets", "DistributedDataParallel._ddp_init_helper",
         "_compute_bucket_assignment_by_size",
         "ddplab.sync.core.bucketed.compute_bucket_assignment_by_size",
         "torch assigns in parameters() order and reverses the list of buckets (backward fills "
         "the last layers' first); a tensor is added to its dtype's open bucket, which closes "
         "once it reaches the limit. Iteration 0 has one bucket per dtype unless "
         "find_unused_parameters=True without static_graph, or bucket_cap_mb_list. The "
         "reference walks reversed parameters() order: the rebuilt layout of a plain stack"),
    Step("broadcast rank 0's weights", "DistributedDataParallel.__init__", "_sync_module_states",
         "ddplab.sync.core.bucketed.BucketedDDP._sync_module_states", "every rank starts from the same model"),
    Step("build the C++ reducer", "DistributedDataParallel._ddp_init_helper", "dist.Reducer", "",
         "ddplab keeps its state in the Python wrapper; torch in a C++ object"),
    Step("forward: before the module", "DistributedDataParallel.forward", "_pre_forward",
         "ddplab.sync.core.bucketed.BucketedDDP.forward",
         "buffers are broadcast, the backward to come is armed (or not, inside no_sync)"),
    Step("prepare_for_forward", "DistributedDataParallel._pre_forward", "prepare_for_forward",
         "ddplab.sync.core.bucketed.BucketedDDP.forward", "counts iterations, resets per-step state"),
    Step("rebuild buckets in grad-ready order", "DistributedDataParallel._pre_forward",
         "_rebuild_buckets", "ddplab.sync.bucketed.BucketedDDP._rebuild_buckets",
         "once, at the first grad-enabled forward after the first synchronizing backward, in "
         "the order gradients arrived then (rank 0's); not with find_unused_parameters=True "
         "unless static_graph=True. The full BucketedDDP does the same; the reference keeps "
         "reverse parameter order"),
    Step("prepare_for_backward", "DistributedDataParallel._post_forward", "prepare_for_backward",
         "ddplab.sync.bucketed.BucketedDDP.forward",
         "expected buckets reset; with find_unused_parameters the graph is searched from the outputs"),
    Step("autograd hook per parameter", "", "autograd_hook", "ddplab.sync.core.bucketed.BucketedDDP.autograd_hook",
         "runs once a parameter's gradient is accumulated (ddplab: a post-accumulate-grad hook)"),
    Step("mark_variable_ready", "", "mark_variable_ready", "ddplab.sync.core.bucketed.BucketedDDP.mark_variable_ready",
         "the gradient is copied into its bucket slot, divided by the world size (torch skips "
         "the division when a comm hook is registered; the full BucketedDDP only marks the slot "
         "and copies the whole bucket when it is full: fewer calls from Python)"),
    Step("mark_bucket_ready: launch in index order", "", "mark_bucket_ready",
         "ddplab.sync.core.bucketed.BucketedDDP.mark_bucket_ready",
         "a full bucket waits for every lower-index bucket, then all-reduces"),
    Step("comm hook or all-reduce", "", "run_comm_hook", "ddplab.sync.comm_hooks.run_hook",
         "a registered hook replaces the bucket's all-reduce and must return a future"),
    Step("finalize_backward", "", "finalize_backward", "ddplab.sync.core.bucketed.BucketedDDP.finalize_backward",
         "queued on the autograd engine by mark_variable_ready once the last bucket is "
         "launched, runs when backward's compute ends: waits on every bucket and writes the "
         "averages into param.grad. A parameter without a gradient: never queued, backward "
         "returns, the next forward raises"),
)


def installed_version() -> str:
    """torch's release number without a local suffix: '2.13.0+cpu' -> '2.13.0'."""
    import torch

    return torch.__version__.split("+")[0]


def cpp_url(line: int | None = None) -> str:
    """reducer.cpp at the installed version's release tag (the wheel ships no .cpp)."""
    url = f"{REPO}/blob/v{installed_version()}/torch/csrc/distributed/c10d/reducer.cpp"
    return url + (f"#L{line}" if line else "")


def header_path() -> pathlib.Path:
    import torch

    path = (pathlib.Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed"
            / "c10d" / "reducer.hpp")
    if not path.exists():
        raise LookupError(f"{path} is missing: this torch build ships no C++ headers; read "
                          f"{REPO}/blob/v{installed_version()}/torch/csrc/distributed/c10d/"
                          "reducer.hpp instead")
    return path


def header_lines(name: str) -> list:
    """``[(line_number, text)]`` of reducer.hpp lines that declare ``name(``."""
    pattern = re.compile(rf"\b{re.escape(name)}\s*\(")
    lines = header_path().read_text().splitlines()
    return [(i + 1, text.strip()) for i, text in enumerate(lines)
            if pattern.search(text) and not text.strip().startswith("//")]


def python_lines(path: str, needle: str) -> dict:
    """Where ``needle`` appears in ``torch.nn.parallel.distributed.<path>``'s source."""
    import torch.nn.parallel.distributed as distributed

    obj = distributed
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise LookupError(f"torch {installed_version()} has no torch.nn.parallel.distributed."
                              f"{path}: torch renamed this step; update ddplab's reducer map")
    source, first = inspect.getsourcelines(obj)
    hits = [(first + i, line.strip()) for i, line in enumerate(source)
            if needle in line and not line.strip().startswith("#")]
    if not hits:
        raise LookupError(f"torch {installed_version()}: {path} no longer mentions {needle!r}")
    return {"file": inspect.getsourcefile(obj), "def_line": first, "hits": hits}


def resolve(dotted: str):
    """The ddplab object named by ``dotted`` (module path, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise LookupError(f"no module in {dotted!r}")


def locate() -> list:
    """One row per ``STEPS`` entry, found in the installed torch; ``LookupError`` if any is gone."""
    rows = []
    for s in STEPS:
        row = dataclasses.asdict(s)
        if s.python:
            row["where"] = python_lines(s.python, s.needle)
        else:
            lines = header_lines(s.needle)
            if not lines:
                raise LookupError(f"torch {installed_version()}: {header_path()} declares no "
                                  f"{s.needle}(...): torch renamed this step")
            row["where"] = {"file": str(header_path()), "hits": lines,
                            "cpp": cpp_url() + f" (search '{s.needle}')"}
        if s.ddplab:
            row["ddplab_source"] = inspect.getsourcelines(resolve(s.ddplab))[1]
        rows.append(row)
    return rows


def print_map(rows=None) -> None:
    rows = locate() if rows is None else rows
    for r in rows:
        hit = r["where"]["hits"][0]
        where = pathlib.Path(r["where"]["file"]).name
        print(f"{r['step']}\n  torch : {where}:{hit[0]}  {hit[1][:90]}")
        print(f"  ddplab: {r['ddplab'] or '(left out)'}\n          {r['why']}")


def _declared_out_of_order():
    """Layers declared c, b, a but used a -> b -> c: parameter order is not gradient order."""
    import torch
    from torch import nn

    class OutOfOrder(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = nn.Linear(32, 4)   # used last, declared first
            self.b = nn.Linear(32, 32)
            self.a = nn.Linear(8, 32)   # used first, declared last

        def forward(self, x):
            return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))

    return OutOfOrder()


def rebuild_on_rank(steps: int = 3, bucket_cap_mb: float = 0.004) -> dict:
    """Train torch DDP a few steps on this rank; what its reducer did, seen from outside.

    ``ready_order``: parameter names in the order their gradients were accumulated
    (iteration 0); ``launch_sizes``: per iteration, bucket sizes (elements) in launch
    order, seen at the observing process group (torch's C++ reducer hands it each bucket;
    no comm hook); ``core_launch_sizes`` and ``full_launch_sizes``: the same for ddplab's
    reference and full BucketedDDP, seen the same way; ``rebuilt``: buckets after the
    rebuild, as names, from ``_get_ddp_logging_data()``; ``initial``: the reference
    reducer's layout (reverse parameter order, kept: it does not rebuild); ``full``: the full
    BucketedDDP's layout after each iteration, trained beside torch's (one bucket, then
    torch's rebuild).
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.pg.backend import device
    from ddplab.pg.group import ObserverBase, observe
    from ddplab.sync import BucketedDDP, core

    class AllReduces(ObserverBase):  # what the group was handed: sizes, in launch order
        def __init__(self):
            self.sizes = []

        def launched(self, op, tensors, group, peer):
            if op == "all_reduce":
                self.sizes.append(sum(t.numel() for t in tensors))

    torch.manual_seed(0)
    model = _declared_out_of_order().to(device())
    names = [n for n, _ in model.named_parameters()]
    if dist.get_rank() == 0:  # the first DDP in a process imports torch._dynamo: seconds
        print("building torch DDP and training", steps, "steps...", flush=True)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    order: list = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: order.append(n))
    ours = BucketedDDP(_declared_out_of_order().to(device()), bucket_cap_mb=bucket_cap_mb)
    reference = core.BucketedDDP(_declared_out_of_order().to(device()), bucket_cap_mb=bucket_cap_mb)
    full = []
    launched = {"ddp": [], "full": [], "core": []}
    g = torch.Generator().manual_seed(dist.get_rank())
    ready = []
    for _ in range(steps):
        order.clear()
        x = torch.randn(16, 8, generator=g).to(device())
        for name, model_ in (("ddp", ddp), ("full", ours), ("core", reference)):
            with observe(AllReduces()) as seen:
                model_(x).square().mean().backward()
            launched[name].append(seen.sizes)
        ready.append(list(order))
        full.append([b["params"] for b in ours.bucket_layout])  # read before the next forward
    data = ddp._get_ddp_logging_data()
    spec = data.get("rebuilt_per_bucket_param_indices", "")
    rebuilt = [[names[int(i)] for i in chunk.split()] for chunk in spec.split(",") if chunk]
    params = list(model.parameters())
    initial = [[names[i] for i in b]
               for b in core.compute_bucket_assignment_by_size(params, bucket_cap_mb)]
    return {"names": names, "ready_order": ready, "launch_sizes": launched["ddp"],
            "full_launch_sizes": launched["full"], "core_launch_sizes": launched["core"],
            "rebuilt": rebuilt, "initial": initial, "full": full,
            "logging": {k: data[k] for k in sorted(data) if "bucket" in k}}
