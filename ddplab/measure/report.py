"""A compare() result as a plain-text table (the CLI's and the notebooks' printout).

Teaches nothing new: it prints the metrics (ddplab.timeline.metrics) and the
run's labels (simulated link, oversubscribed, bucket cap, how torch DDP was
timed) exactly as compare() decided them; it computes nothing.
"""
from __future__ import annotations

COLUMNS = (("step_ms", "step ms", "{:.2f}"), ("exposed_comm_ms", "exposed ms", "{:.2f}"),
           ("overlap_pct", "overlap %", "{:.0f}"), ("saved_ms", "saved ms", "{:+.2f}"),
           ("comm_bytes_per_step", "MiB/step", "{:.2f}"), ("n_buckets", "buckets", "{}"))


def table(result) -> str:
    head = f"{'strategy':12s}" + "".join(f"{c[1]:>12s}" for c in COLUMNS)
    lines = [head, "-" * len(head)]
    for name, m in result.metrics.items():
        row = f"{name:12s}"
        for key, _, fmt in COLUMNS:
            v = m.get(key)
            if key == "comm_bytes_per_step" and v is not None:
                v = v / 2**20
            row += f"{'-' if v is None else fmt.format(v):>12s}"
        lines.append(row)
    labels = result.meta.get("labels") or {}
    if labels.get("simulated_link"):
        lines.append(f"SIMULATED link: {labels['simulated_link']['label']}")
    if labels.get("oversubscribed"):
        lines.append("OVERSUBSCRIBED: more ranks than usable CPUs")
    if labels.get("straggler"):
        lines.append("straggler: rank {} slowed x{:g}".format(*labels["straggler"]))
    if labels.get("bucket_cap_note"):
        lines.append(labels["bucket_cap_note"])
    # sharded strategies (FSDP) communicate but get no exposed figure (timeline.metrics)
    sharded = [n for n, m in result.metrics.items()
               if m.get("n_buckets") and m.get("exposed_comm_ms") is None]
    if sharded:
        lines.append(f"{', '.join(sharded)}: all-gathers in the forward too: the "
                     "exposed/overlap figure (comm after backward) would mislead, none is given; "
                     "MiB/step is the payload handed to the group")
    drawn = [n for n, m in result.metrics.items() if m.get("comm_path") == "observing process group"]
    if drawn:
        lines.append(f"drawn from the observing process group: {', '.join(drawn)}")
    return "\n".join(lines)


def print_table(result) -> None:
    print(table(result))
