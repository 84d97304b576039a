"""``python -m ddplab link``: your own link measured, on the machines and launcher you train with.

Teaches: a what-if needs the link you will train on, and under torchrun there is no ddplab
Cluster to measure it with; the launcher you already use can start the measurement instead:

    torchrun --nproc-per-node 2 -m ddplab link -o link.json
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
             --rdzv-id JOB -m ddplab link -o link.json          (on each of 2 machines)
    srun python -m ddplab link -o link.json                      (one task per GPU)

Every rank joins the group as a training script does (``ddplab.init_from_env``: gloo on CPUs,
NCCL where every rank has a GPU of its own), times all-reduces of a range of sizes and fits the
ring model (``ddplab.measure.link.measure_link``); rank 0 writes the JSON and prints the fit
beside what was measured. Then the ranks leave as a torchrun script ends
(``ddplab.launchers.torchrun.finish``: a barrier, the group destroyed, ``os._exit``). A rank
that fails says why in one line and exits at once with code 1, skipping that barrier: torchrun
then stops the other ranks (its default when a worker fails), and a collective they wait in
fails within ``--timeout`` seconds at most instead of hanging.

Leaves out: everything ``ddplab.measure.link`` leaves out; torchrun's restarts (a failed
measurement is not retried).
References: https://docs.pytorch.org/docs/stable/elastic/run.html (``-m``/``--module``, the
environment variables); ddplab.launchers.torchrun.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}


def parse_sizes(text: str) -> list:
    """``"4K,64K,1M"`` as bytes (K, M, G are powers of 1024)."""
    sizes = []
    for part in text.split(","):
        part = part.strip().upper().removesuffix("B").removesuffix("I")
        number, unit = (part[:-1], part[-1]) if part[-1:] in ("K", "M", "G") else (part, "")
        try:
            value = float(number) * UNITS[unit]
            whole = int(value)  # inf and nan raise here
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(
                f"{text!r}: give sizes in bytes separated by commas, e.g. 4K,64K,1M,16M") from None
        if whole != value:
            raise argparse.ArgumentTypeError(f"{part!r} is {value:g} bytes, not a whole number of bytes")
        sizes.append(whole)
    from ddplab.measure.link import check_sizes

    try:  # refused here, before any rank joins a group, not by every rank after it started
        return check_sizes(sizes)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def whole_number(least: int):
    """An argparse type: a whole number >= ``least``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {least}, got {text}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # no ddplab.measure import here: it imports torch (seconds), which --help and a bad
    # argument have no need to wait for; the default sizes are filled in by run()
    parser.add_argument("-o", "--out", default="link.json",
                        help="where rank 0 writes the measurement (default link.json)")
    parser.add_argument("--sizes", type=parse_sizes, default=None,
                        help="all-reduce sizes in bytes, comma-separated (K, M, G: KiB, MiB, GiB); "
                             "default 4K,16K,64K,256K,1M,4M,16M,64M")
    parser.add_argument("--repeats", type=whole_number(1), default=7,
                        help="timed all-reduces per size, the median kept (default 7)")
    parser.add_argument("--warmup", type=whole_number(0), default=2,
                        help="untimed all-reduces per size before timing (default 2)")
    parser.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                        help="auto (the default): nccl when every rank has a GPU of its own, else gloo")
    parser.add_argument("--timeout", type=positive_seconds, default=120.0,
                        help="seconds a collective may wait for a rank before the measurement fails "
                             "(default 120)")


def positive_seconds(text: str) -> float:
    """--timeout: seconds above 0 (0 would time every collective out at once, and gloo refuses
    a negative timeout with an internal error)."""
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a number of seconds more than 0, got {text}")
    return value


def refusal(out: Path):
    """One line saying why this process cannot measure, or None."""
    from ddplab.launchers.schedulers import adopt
    from ddplab.launchers.torchrun import REQUIRED

    adopt()  # srun's or mpirun's variables, read as torchrun's
    missing = [name for name in REQUIRED if not os.environ.get(name)]
    if missing:
        return (f"ddplab link: no process group to measure ({', '.join(missing)} not set): run it under "
                "torchrun, e.g. `torchrun --nproc-per-node 2 -m ddplab link -o link.json`, or srun; in a "
                "notebook, cluster.run(ddplab.measure.link.measure_link, out='link.json')")
    if os.environ["RANK"] == "0":  # found before the measurement, not after it, so nothing is lost
        from ddplab.measure.link import cannot_write

        why = cannot_write(out)
        if why:
            return f"ddplab link: {why} (-o)"
    return None


def report(m: dict, out) -> str:
    """What rank 0 prints: each size measured and fitted, the fit, the file."""
    fit = m["fit"]
    lines = [f"all-reduce on {m['world_size']} ranks ({m['backend']}, {m['device']}), median of "
             f"{m['repeats']} after {m['warmup']} warm-up:",
             f"{'bytes':>12} {'measured ms':>12} {'fitted ms':>10} {'off':>7}"]
    for n, t, f, r in zip(m["sizes_bytes"], m["seconds"], fit["predicted_seconds"], fit["relative_residuals"]):
        lines.append(f"{n:>12} {1e3 * t:>12.3f} {1e3 * f:>10.3f} {100 * r:>+6.1f}%")
    lines.append(f"fit: latency {fit['latency_us']:.1f} us per ring step, bandwidth "
                 f"{fit['bandwidth_bytes_per_s'] / 1e9:.3g} GB/s ({fit['bandwidth_gbps']:.3g} Gbit/s); "
                 f"at most {100 * fit['max_abs_relative_residual']:.0f}% off a measured time")
    for key in ("note", "warning"):
        if m.get(key):
            lines.append(f"{key}: {m[key]}")
    lines.append(f"wrote {out}: predict(recording, link={str(out)!r}) uses it")
    return "\n".join(lines)


def run(args) -> int:
    out = Path(args.out).expanduser()
    why = refusal(out)
    if why:
        raise SystemExit(why)  # one line, exit code 1, before torch is imported
    from ddplab.launchers.torchrun import finish, init_from_env
    from ddplab.measure.link import DEFAULT_SIZES, measure_link

    sizes = list(DEFAULT_SIZES) if args.sizes is None else args.sizes

    rank = os.environ["RANK"]
    try:
        init_from_env(backend=args.backend, timeout=args.timeout)
        m = measure_link(sizes_bytes=sizes, repeats=args.repeats, warmup=args.warmup,
                         out=out if rank == "0" else None)
        if rank == "0":
            print(report(m, out), flush=True)
    except Exception as e:  # noqa: BLE001 - said in one line; the launcher stops the other ranks
        print(f"ddplab link: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # no barrier: the others may wait in a collective this rank never joins
    finish(0, exit=True)
    return 0
