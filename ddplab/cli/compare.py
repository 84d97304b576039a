"""``python -m ddplab compare``: the measuring engine from a shell.

Sits at the top of the package, beside the magics, export and doctor: it
drives ddplab.measure and writes ddplab.widgets' HTML page.

Prints a progress line per strategy and a table; writes the JSON layout in
docs/design.md (``--json``), a Chrome trace for Perfetto (``--trace``) and a
standalone HTML page (``--html``). ``--strategy FILE.py:NAME`` (repeatable)
adds a strategy defined in a file (see ddplab.sync.registry); ``--model
FILE.py:make_model`` with ``--batch FILE.py:make_batch`` (and ``--loss``) runs
your own model (see ddplab.measure.workload).
"""
from __future__ import annotations

import argparse
import sys

# RunSpec's defaults, said here so that --help and a bad argument need no torch (importing
# ddplab.measure imports it: seconds); tests/measure/test_compare.py checks they are RunSpec's
DEFAULTS = {"world_size": 2, "strategies": "none,manual,bucketed,ddp", "steps": 10, "warmup": 3,
            "model": "mlp", "params": 2e6, "depth": 4, "batch_size": 32, "bucket_cap_mb": 2.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--world-size", type=int, default=d["world_size"])
    p.add_argument("--strategies", default=d["strategies"],
                   help="comma-separated strategy names (default %(default)s; an unknown name is "
                        "answered with the list of them)")
    p.add_argument("--strategy", action="append", default=[], metavar="FILE.py:NAME",
                   help="also run a strategy defined in a file (or module:NAME); repeatable")
    p.add_argument("--steps", type=int, default=d["steps"], help="measured steps after warm-up (>= 1)")
    p.add_argument("--warmup", type=int, default=d["warmup"])
    p.add_argument("--model", default=d["model"], metavar="NAME|FILE.py:FUNC",
                   help="mlp, convnet, transformer, or your own model() function in a file")
    p.add_argument("--batch", metavar="FILE.py:FUNC",
                   help="your batch(batch_size, rank, step) -> (inputs, target); needed with "
                        "your own --model")
    p.add_argument("--loss", metavar="FILE.py:FUNC",
                   help="your loss(output, target) -> scalar (default: cross-entropy)")
    p.add_argument("--params", type=float, default=d["params"], help="MLP parameter count (e.g. 2e7)")
    p.add_argument("--depth", type=int, default=d["depth"], help="MLP layers")
    p.add_argument("--batch-size", type=int, default=d["batch_size"])
    p.add_argument("--bucket-cap-mb", type=float, default=d["bucket_cap_mb"],
                   help="bucket cap for bucketed and ddp (default 2: torch's 25 would put the "
                        "default model's 8 MB of gradients in one bucket)")
    link = p.add_mutually_exclusive_group()
    link.add_argument("--link", metavar="PRESET|FILE.json",
                      help="simulated link: a preset (1gbe, 10gbe, 100gb-ib, nvlink) or a link file "
                           "written by `python -m ddplab link -o FILE.json` (your own link, measured)")
    link.add_argument("--bandwidth-gbps", type=float, help="simulated link bandwidth, Gbit/s")
    p.add_argument("--latency-us", type=float, help="simulated link latency, microseconds")
    p.add_argument("--straggler", help="RANK:FACTOR, e.g. 1:2.0 (rank 1 computes 2x slower)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--json", help="write metrics JSON here")
    p.add_argument("--trace", help="write Chrome-trace JSON here (open in Perfetto)")
    p.add_argument("--html", help="write a standalone HTML page here")


def spec_from_args(args, parser):
    """The RunSpec the arguments describe; a bad value ends in parser.error, never on the ranks."""
    from ddplab.measure.spec import RunSpec
    from ddplab.netsim import LinkModel
    from ddplab.sync.registry import load_strategy

    try:
        link = None
        if args.link:
            link = link_from_arg(args.link)
        elif args.bandwidth_gbps is not None or args.latency_us is not None:
            if args.bandwidth_gbps is None:
                parser.error("--latency-us needs --bandwidth-gbps too (or use --link PRESET)")
            link = LinkModel(args.bandwidth_gbps, args.latency_us or 0.0, "custom link")
        names = [s.strip() for s in args.strategies.split(",") if s.strip()]
        names += [load_strategy(s) for s in args.strategy]
        from ddplab.measure.spec import MODELS
        from ddplab.measure.workload import load_callable

        model = args.model if args.model in MODELS else load_callable(args.model, "model")
        batch = load_callable(args.batch, "batch") if args.batch else None
        loss = load_callable(args.loss, "loss") if args.loss else None
        return RunSpec(names, args.steps, args.warmup, model, args.params, args.depth,
                       args.batch_size, args.bucket_cap_mb, link, args.straggler, args.world_size,
                       progress=True, batch=batch, loss=loss)
    except (ValueError, TypeError, ImportError, OSError) as e:
        parser.error(str(e))


def link_from_arg(text: str):
    """--link: a link file (read by the loader the what-if uses, which refuses a file edited by
    hand) when it names one, else a preset."""
    import os

    from ddplab.measure.link import is_link_file, load_link
    from ddplab.netsim import LinkModel

    if is_link_file(text) or os.sep in text or "/" in text:
        return load_link(text)[0]
    return LinkModel.preset(text)


def run(args, parser) -> int:
    from ddplab.cluster import Cluster
    from ddplab.measure.compare import compare
    from ddplab.measure.report import print_table

    spec = spec_from_args(args, parser)
    print(f"ddplab compare: {spec.world_size} ranks, strategies {', '.join(spec.strategies)}, "
          f"{spec.steps} measured steps after {spec.warmup} warm-up"
          + (f", SIMULATED link {spec.link.label}" if spec.link else ""), flush=True)
    with Cluster(spec.world_size, backend=args.backend) as cluster:
        result = compare(cluster, spec=spec)
    for name, m in result.metrics.items():
        print(f"  done: {name:12s} step {m['step_ms']:8.2f} ms", flush=True)
    print_table(result)
    if args.json:
        result.write_json(args.json)
        print(f"wrote {args.json}")
    if args.trace:
        from ddplab.timeline import write_chrome_trace

        write_chrome_trace(args.trace, list(result.timelines.values()))
        print(f"wrote {args.trace} (open it at ui.perfetto.dev or chrome://tracing)")
    if args.html:
        from ddplab.widgets.html import compare_page

        compare_page(result, args.html)
        print(f"wrote {args.html}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddplab compare")
    add_arguments(p)
    return run(p.parse_args(argv), p)


if __name__ == "__main__":
    sys.exit(main())
