"""What each strategy costs per gradient tensor, on the host, at world size 1.

    .venv/bin/python benchmarks/per_tensor.py                  # CPU (and GPU when CUDA is present)
    .venv/bin/python benchmarks/per_tensor.py --against main   # + BucketedDDP as on git ref main
    .venv/bin/python benchmarks/per_tensor.py --runs 9 --steps 40

At world size 1 an all-reduce has nobody to talk to, so what a strategy
adds to a training step is its machinery: hooks, bookkeeping, copies into
and out of buckets. Spread over the model's gradient tensors that is a
per-tensor host cost, measured here against two references:

- ``floor``: the bare model with an EMPTY post-accumulate-grad hook on every
  parameter: what autograd charges to call a Python hook at all, the least
  any hook-based strategy can cost;
- ``ddp``: torch's DistributedDataParallel (its reducer is C++).

Models (the two the per-tensor work was judged on): a 12-layer transformer encoder, 144 tensors
(1024 wide on GPU; 64 wide on CPU by default, ``--width``, so that a step
on 2 shared cores is short enough for the machinery to show), and a
200-layer MLP, 400 tensors, 32 wide on CPU (512 on GPU).

Method: one rank (``ddplab.Cluster(1, threads=1)`` on CPU, nccl on one GPU
when CUDA is present). Every strategy is built through the registry on its
own copy of the model. A RUN gives each strategy ``--steps`` timed steps
(forward, backward, sync, SGD step, zero_grad) after warm-up, in a rotated
order; a strategy's time in a run is its median step. Per-tensor costs and
ratios are computed within each run and the median over ``--runs`` runs
(>= 5) is printed, with the load average before and after: other jobs on
the machine hit every strategy of a run alike.

``--against REF`` extracts ``ddplab/`` at git REF into a temporary package
and adds ITS BucketedDDP as ``bucketed@REF``, interleaved in the same runs:
the "before" of an optimisation measured on the same machine in the same
process. Figures: docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ddplab  # noqa: E402
from ddplab.sync.registry import Strategy  # noqa: E402

# (label, registry name, options)
STRATEGIES = [("none", "none", {}), ("floor", None, {}), ("ddp", "ddp", {}),
              ("bucketed", "bucketed", {}),
              ("ddp+view", "ddp", {"gradient_as_bucket_view": True}),
              ("bucketed+view", "bucketed", {"gradient_as_bucket_view": True}),
              ("overlap", "overlap", {}), ("manual", "manual", {}),
              ("manual_flat", "manual_flat", {})]


def _floor(module):
    """an empty post-accumulate-grad hook per parameter, no synchronization"""
    for p in module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(_empty_hook)
    return module


def _empty_hook(param):
    pass


FLOOR = Strategy("floor", _floor, description=_floor.__doc__, shape="none")


def _model(kind, width):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "mlp":  # 200 x (weight, bias) = 400 tensors
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(200)])
    layer = nn.TransformerEncoderLayer(width, nhead=max(1, width // 64), dim_feedforward=4 * width,
                                       dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=12, enable_nested_tensor=False)  # 144 tensors


def _before_strategy(ref_pkg):
    """``bucketed`` as the package extracted from a git ref builds it."""
    def build(module, bucket_cap_mb=25.0, process_group=None, **options):
        import importlib
        sys.path.insert(0, str(Path(ref_pkg).parent))
        old = importlib.import_module(Path(ref_pkg).name)
        return old.BucketedDDP(module, bucket_cap_mb=bucket_cap_mb, process_group=process_group,
                               **options)
    return Strategy("bucketed_before", build, shape="buckets")


def _time_runs(model_kind, width, strategies, runs, steps, warmup, ref_pkg, clock="cpu"):
    """On the rank: {label: [median step seconds per run]} and the tensor count."""
    import copy

    import torch
    from torch import nn

    from ddplab.sync.registry import build_strategy

    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    base = _model(model_kind, width)
    n_tensors = sum(1 for p in base.parameters() if p.requires_grad)
    g = torch.Generator().manual_seed(0)
    shape = (32, width) if model_kind == "mlp" else (8, 16, width)
    x, y = torch.randn(shape, generator=g).to(dev), torch.randn(shape, generator=g).to(dev)
    setups = {}
    for label, name, opts in strategies:
        if name is None:
            name = FLOOR
        elif label.startswith("bucketed@"):
            name = _before_strategy(ref_pkg)
        if dev.type == "cuda" and label.startswith("ddp"):
            opts = dict(opts, device_ids=[dev.index])
        built = build_strategy(name, copy.deepcopy(base).to(dev), bucket_cap_mb=25.0, **opts)
        setups[label] = (built.model, built.after_backward,
                         torch.optim.SGD(built.model.parameters(), lr=1e-4))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    # CPU time of the whole process (every thread, gloo's included): on a loaded
    # machine the time spent waiting for a core is not the strategy's cost.
    timer = time.process_time if clock == "cpu" else time.perf_counter

    def step(net, after, opt):
        nn.functional.mse_loss(net(x), y).backward()
        if after is not None:
            after()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for net, after, opt in setups.values():  # warm-up: torch DDP rebuilds its buckets
        for _ in range(warmup):
            step(net, after, opt)
    sync()
    times = {label: [] for label in setups}
    order = list(setups)
    for r in range(runs):
        ts = {label: [] for label in setups}
        for i in range(steps):  # one step each, in a rotated order: a burst of load hits all
            k = (r * steps + i) % len(order)
            for label in order[k:] + order[:k]:
                net, after, opt = setups[label]
                sync()
                t0 = timer()
                step(net, after, opt)
                sync()
                ts[label].append(timer() - t0)
        for label, xs in ts.items():
            times[label].append(_low(xs))
    return {"times": times, "n_tensors": n_tensors, "device": str(dev)}


def _low(xs):
    """A run's figure for one strategy: the mean of its fastest quarter of steps. Other
    jobs only ever ADD time (a step that shared its core, lost its cache); the fastest
    steps are the cost itself, and a quarter of them averages out the clock's grain."""
    xs = sorted(xs)[: max(1, len(xs) // 4)]
    return sum(xs) / len(xs)


def _extract(ref, into):
    """``ddplab/`` at git ``ref`` as package ``ddplab_<ref>`` under ``into``; None if git cannot."""
    name = "ddplab_" + "".join(c if c.isalnum() else "_" for c in ref)
    dest = Path(into) / name
    try:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "ddplab"],
                             check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"--against {ref}: git could not extract it ({e}); no 'before' column")
        return None
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    (Path(into) / "ddplab").rename(dest)
    return str(dest)


def _report(model_kind, width, res, runs):
    times, n = res["times"], res["n_tensors"]
    print(f"\n{model_kind}, width {width}, {n} gradient tensors, {res['device']}: "
          f"median over {runs} runs")
    print(f"{'strategy':<16} {'step ms':>8} {'x ddp':>6} {'us/tensor over floor':>21} "
          f"{'us/tensor over ddp':>19}")
    rows = {}
    for label, ts in times.items():
        per_run = list(zip(ts, times["floor"], times["ddp"]))
        step = statistics.median(ts) * 1e3
        ratio = statistics.median(t / d for t, _, d in per_run)
        over_floor = statistics.median((t - f) / n * 1e6 for t, f, _ in per_run)
        over_ddp = statistics.median((t - d) / n * 1e6 for t, _, d in per_run)
        spread = [round((t - d) / n * 1e6, 2) for t, _, d in per_run]
        rows[label] = (step, ratio, over_floor, over_ddp)
        print(f"{label:<16} {step:8.3f} {ratio:6.3f} {over_floor:21.2f} {over_ddp:19.2f}"
              + (f"   runs: {spread}" if label.startswith("bucketed") else ""))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,transformer")
    ap.add_argument("--width", type=int, default=None,
                    help="transformer width (default 64 on CPU, 1024 on GPU)")
    ap.add_argument("--mlp-width", type=int, default=None, help="default 32 on CPU, 512 on GPU")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per strategy per run")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--against", default=None, metavar="REF",
                    help="also time BucketedDDP as on this git ref (the 'before')")
    ap.add_argument("--clock", choices=["cpu", "wall"], default=None,
                    help="cpu: process CPU time (default on CPU: immune to waiting for a busy "
                         "core); wall: perf_counter (default on GPU, where the host waits for it)")
    ap.add_argument("--device", choices=["cpu", "gpu", "both"], default="both",
                    help="gpu/both: also on one GPU when CUDA is present (skipped otherwise)")
    a = ap.parse_args(argv)
    if a.runs < 5:
        ap.error("--runs must be at least 5 (medians of fewer runs are noise on a shared machine)")
    import torch

    strategies = list(STRATEGIES)
    tmp = tempfile.TemporaryDirectory()
    ref_pkg = _extract(a.against, tmp.name) if a.against else None
    if ref_pkg:
        strategies.insert(4, (f"bucketed@{a.against}", "bucketed", {}))
    devices = [] if a.device == "gpu" else ["cpu"]
    if a.device in ("gpu", "both"):
        if torch.cuda.is_available():
            devices.append("gpu")
        else:
            print(f"GPU: skipped (no CUDA device visible to this torch {torch.__version__})")
    for device in devices:
        gpu = device == "gpu"
        cluster = ddplab.Cluster(1, backend="nccl", gpus=[0]) if gpu else \
            ddplab.Cluster(1, backend="gloo", threads=1)
        with cluster as c:
            print(f"\n== {device}: world size 1 ({c.backend}), {c.threads_per_rank} thread(s); "
                  f"load average {os.getloadavg()[0]:.2f} at start")
            for kind in a.models.split(","):
                width = (a.mlp_width or (512 if gpu else 32)) if kind == "mlp" else \
                    (a.width or (1024 if gpu else 64))
                clock = a.clock or ("wall" if gpu else "cpu")
                res = c.run(_time_runs, kind, width, strategies, a.runs, a.steps, a.warmup,
                            ref_pkg, clock)[0]
                res["device"] += f", {clock} clock"
                _report(kind, width, res, a.runs)
                print(f"load average {os.getloadavg()[0]:.2f}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
