"""Step time of ddplab's reducers against torch DDP on one GPU, as ratios (medians), with an A/A.

    python benchmarks/gpu_step_time.py                  # one GPU: world size 1 over raw NCCL
    python benchmarks/gpu_step_time.py --json out.json
    python benchmarks/gpu_step_time.py --device cpu --small   # the same code on gloo (tests)

Two models, those of the first GPU run (docs/gpu-check.md): a transformer of
12 ``nn.TransformerEncoderLayer`` (d_model 1024, feed-forward 4096): 151M
parameters in 144 tensors; and an MLP of 200 ``Linear(512, 512)``: 53M
parameters in 400 tensors (many small tensors: the per-tensor host cost).
Each strategy (``bucketed``, ``manual_flat``, ``manual``, ``overlap``, torch
``ddp`` and ``ddp`` again as the A/A control) is built through the strategy
registry around the same weights, and the strategies are timed in
interleaved rounds (every round times each once, in a rotated order), so
drift hits them alike. A step is forward, backward, the strategy's
synchronization and an SGD step, timed with ``torch.cuda.synchronize``
around it. Printed: each strategy's median step time over the rounds
divided by torch DDP's, per model.

The group is a raw ``init_process_group`` (nccl on CUDA, gloo on CPU) at
world size 1, not a ddplab Cluster: what is timed is the hook and bucket
machinery against torch's C++ reducer (at world size 1 NCCL's all-reduce
has no peer to wait for). Leaves out: several GPUs (a real transfer between
ranks: ``tools/gpu_check_multi.py``), mixed precision, and memory.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STRATEGIES = ("bucketed", "manual_flat", "manual", "overlap", "ddp", "ddp_aa")


def models(small: bool):
    """name -> (build(), batch(device) -> input, loss(output))."""
    import torch
    from torch import nn

    d, ff, layers, width, depth = (64, 128, 2, 32, 8) if small else (1024, 4096, 12, 512, 200)

    def transformer():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.TransformerEncoderLayer(d, 16 if not small else 4, ff, dropout=0.0,
                                                          batch_first=True) for _ in range(layers)])

    def mlp():
        torch.manual_seed(0)
        blocks = []
        for _ in range(depth):
            blocks += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*blocks)

    seq, batch = (16, 4) if small else (128, 8)
    return {
        "transformer": (transformer, lambda dev: torch.randn(batch, seq, d, device=dev)),
        "mlp": (mlp, lambda dev: torch.randn(64 if not small else 8, width, device=dev)),
    }


def build(name: str, module, device):
    from ddplab.sync.registry import build_strategy

    strategy = "ddp" if name == "ddp_aa" else name
    options = {"device_ids": [device.index]} if strategy == "ddp" and device.type == "cuda" else {}
    return build_strategy(strategy, module, **options)


def time_steps(built, make_input, device, steps: int) -> float:
    """Median seconds of ``steps`` training steps (after one warm-up step)."""
    import torch

    model = built.model
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = make_input(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(steps + 1):
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        if built.after_backward is not None:
            built.after_backward()
        opt.step()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(device_name: str, small: bool, rounds: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = tempfile.NamedTemporaryFile(prefix="ddplab-bench-", delete=False)
    store.close()
    os.unlink(store.name)  # a FileStore on a fresh private path: no port, no other user
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{store.name}", rank=0, world_size=1)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "backend": dist.get_backend(), "world_size": 1,
           "rounds": rounds, "steps": steps, "models": {}}
    try:
        for model_name, (make, make_input) in models(small).items():
            template = make()
            n_params = sum(p.numel() for p in template.parameters())
            n_tensors = sum(1 for _ in template.parameters())
            built = {}
            for name in STRATEGIES:
                module = make().to(device)
                module.load_state_dict(template.state_dict())
                built[name] = build(name, module, device)
            seconds = {name: [] for name in STRATEGIES}
            for r in range(rounds):
                order = STRATEGIES[r % len(STRATEGIES):] + STRATEGIES[:r % len(STRATEGIES)]
                for name in order:
                    seconds[name].append(time_steps(built[name], make_input, device, steps))
            medians = {name: statistics.median(v) for name, v in seconds.items()}
            out["models"][model_name] = {
                "params": n_params, "tensors": n_tensors,
                "step_ms": {k: round(v * 1e3, 3) for k, v in medians.items()},
                "ratio_to_ddp": {k: round(v / medians["ddp"], 3) for k, v in medians.items()},
            }
            del built
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return out


def table(result: dict) -> str:
    names = [s for s in STRATEGIES if s != "ddp"]
    lines = [f"world size 1 over {result['backend']} on {result['device']}, torch {result['torch']}: "
             f"median step time / torch DDP's ({result['rounds']} rounds of {result['steps']} steps; "
             "ddp_aa is torch DDP again, the A/A)",
             "| model | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for model, row in result["models"].items():
        label = f"{model}, {row['params'] / 1e6:.0f}M params, {row['tensors']} tensors"
        lines.append(f"| {label} | " + " | ".join(f"{row['ratio_to_ddp'][n]:.3f}" for n in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:N (default cuda:0) or cpu")
    ap.add_argument("--small", action="store_true", help="tiny models (a quick test of this script)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("gpu_step_time: no CUDA device here (torch " + torch.__version__ + "); "
                  "run it on a GPU machine, or pass --device cpu", file=sys.stderr)
            return 2
    result = run(args.device, args.small, args.rounds, args.steps)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
