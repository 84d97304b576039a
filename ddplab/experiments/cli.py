"""``python -m ddplab compare``: the measuring engine from a shell.

Prints a progress line per strategy and a table; writes the JSON layout in
DESIGN.md (``--json``), a Chrome trace for Perfetto (``--trace``) and a
standalone HTML page (``--html``).
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .runners import STRATEGIES

    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--strategies", default="none,manual,bucketed,ddp",
                   help=f"comma-separated subset of: {','.join(STRATEGIES)}")
    p.add_argument("--steps", type=int, default=10, help="measured steps after warm-up (>= 1)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--model", default="mlp", choices=["mlp", "convnet"])
    p.add_argument("--params", type=float, default=2e6, help="MLP parameter count (e.g. 2e7)")
    p.add_argument("--depth", type=int, default=4, help="MLP layers")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--bucket-cap-mb", type=float, default=2.0,
                   help="bucket cap for bucketed and ddp (default 2: torch's 25 would put the "
                        "default model's 8 MB of gradients in one bucket)")
    link = p.add_mutually_exclusive_group()
    link.add_argument("--link", help="simulated link preset: 1gbe, 10gbe, 100gb-ib, nvlink")
    link.add_argument("--bandwidth-gbps", type=float, help="simulated link bandwidth, Gbit/s")
    p.add_argument("--latency-us", type=float, help="simulated link latency, microseconds")
    p.add_argument("--straggler", help="RANK:FACTOR, e.g. 1:2.0 (rank 1 computes 2x slower)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--json", help="write metrics JSON here")
    p.add_argument("--trace", help="write Chrome-trace JSON here (open in Perfetto)")
    p.add_argument("--html", help="write a standalone HTML page here")


def run(args, parser) -> int:
    from ..cluster import Cluster
    from ..netsim import LinkModel
    from .compare import compare, parse_strategies

    try:
        names = parse_strategies(args.strategies)
    except ValueError as e:
        parser.error(str(e))
    link = None
    if args.link:
        link = LinkModel.preset(args.link)
    elif args.bandwidth_gbps is not None or args.latency_us is not None:
        if args.bandwidth_gbps is None:
            parser.error("--latency-us needs --bandwidth-gbps too (or use --link PRESET)")
        link = LinkModel(args.bandwidth_gbps, args.latency_us or 0.0, "custom link")
    print(f"ddplab compare: {args.world_size} ranks, strategies {', '.join(names)}, "
          f"{args.steps} measured steps after {args.warmup} warm-up"
          + (f", SIMULATED link {link.label}" if link else ""), flush=True)
    with Cluster(args.world_size, backend=args.backend) as cluster:
        result = compare(cluster, names, steps=args.steps, warmup=args.warmup, model=args.model,
                         n_params=args.params, depth=args.depth, batch_size=args.batch_size,
                         bucket_cap_mb=args.bucket_cap_mb, link=link, straggler=args.straggler,
                         progress=True)
    for name, m in result.metrics.items():
        print(f"  done: {name:12s} step {m['step_ms']:8.2f} ms", flush=True)
    print_table(result)
    if args.json:
        result.write_json(args.json)
        print(f"wrote {args.json}")
    if args.trace:
        from ..timeline import write_chrome_trace

        write_chrome_trace(args.trace, list(result.timelines.values()))
        print(f"wrote {args.trace} (open it at ui.perfetto.dev or chrome://tracing)")
    if args.html:
        write_html(args.html, result)
        print(f"wrote {args.html}")
    return 0


def print_table(result) -> None:
    cols = [("step_ms", "step ms", "{:.2f}"), ("exposed_comm_ms", "exposed ms", "{:.2f}"),
            ("overlap_pct", "overlap %", "{:.0f}"), ("saved_ms", "saved ms", "{:+.2f}"),
            ("comm_bytes_per_step", "MiB/step", None), ("n_buckets", "buckets", "{}")]
    head = f"{'strategy':12s}" + "".join(f"{c[1]:>12s}" for c in cols)
    lines = [head, "-" * len(head)]
    for name, m in result.metrics.items():
        row = f"{name:12s}"
        for key, _, fmt in cols:
            v = m.get(key)
            if key == "comm_bytes_per_step":
                row += f"{(v or 0) / 2**20:12.2f}"
            else:
                row += f"{'-' if v is None else fmt.format(v):>12s}"
        lines.append(row)
    notes = []
    if result.meta.get("simulated_link"):
        notes.append(f"SIMULATED link: {result.meta['simulated_link']['label']}")
    if result.meta.get("oversubscribed"):
        notes.append("OVERSUBSCRIBED: more ranks than usable CPUs")
    print("\n".join(lines + notes))


def write_html(path, result) -> None:
    try:
        from ..widgets.html import compare_page
    except ImportError:
        compare_page = None
    if compare_page is not None:
        compare_page(result, path)
        return
    import plotly.graph_objects as go

    fig = go.Figure([go.Bar(x=list(result.metrics), y=[m["step_ms"] for m in result.metrics.values()])])
    title = "step time (ms)" + (" - SIMULATED link" if result.meta.get("simulated_link") else "")
    fig.update_layout(title=title)
    fig.write_html(path, include_plotlyjs=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddplab compare")
    add_arguments(p)
    args = p.parse_args(argv)
    return run(args, p)


if __name__ == "__main__":
    sys.exit(main())
