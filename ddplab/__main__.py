"""Command line: ``python -m ddplab doctor``, ``compare``, ``view``, ``link`` and ``classroom``."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Only the chosen command's own arguments are built: `compare`'s and `link`'s import torch (a
    # few seconds), which `classroom`, `view` and a plain --help have no need to wait for.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="python -m ddplab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="torch version, backends, GPUs, usable CPUs, what backend='auto' picks")
    doc.add_argument("--world-size", type=int, action="append",
                     help="world size(s) to show the 'auto' choice for (repeatable)")
    cmp = sub.add_parser("compare", help="every strategy side by side in one run (JSON, trace, HTML)")
    if chosen == "compare":
        from ddplab.cli.compare import add_arguments

        add_arguments(cmp)
    see = sub.add_parser("view", help="saved runs (ddplab.record's run.json) side by side, as a page")
    if chosen == "view":
        from ddplab.cli import view

        view.add_arguments(see)
    lnk = sub.add_parser("link", help="your link measured under torchrun: all-reduce times and the ring "
                                      "model fitted to them, as the JSON the what-if takes (link=)",
                         description="Your own link measured, under the launcher you train with: "
                                     "`torchrun --nproc-per-node 2 -m ddplab link -o link.json`; then "
                                     "ddplab.measure.whatif.predict(recording, link='link.json'). "
                                     "See docs/recording.md.")
    if chosen == "link":
        from ddplab.cli import link

        link.add_arguments(lnk)
    what = "a JupyterHub + nbgrader set-up for a class: learners' servers on this machine or as Slurm jobs"
    room = sub.add_parser("classroom", help=what, description=(
        f"{what}. --spawner local (the default) or systemd runs every learner's JupyterLab on this server; "
        "--spawner slurm submits each one as a Slurm job on the cluster's nodes (docs/hpc.md)."))
    if chosen == "classroom":
        from ddplab.course import classroom

        classroom.add_arguments(room)
    args = parser.parse_args(argv)
    if args.command == "classroom":
        return classroom.run(args, room)
    if args.command == "view":
        return view.run(args)
    if args.command == "link":
        return link.run(args)
    if args.command == "compare":
        from ddplab.cli.compare import run

        return run(args, cmp)
    if args.command == "doctor":
        from ddplab.cli.doctor import main as doctor

        sizes = args.world_size or [1, 2, 4, 8]
        bad = [ws for ws in sizes if ws < 1]
        if bad:
            parser.error(f"--world-size must be a positive integer, got {bad[0]}")
        return doctor(tuple(sizes))
    return 2


if __name__ == "__main__":
    sys.exit(main())
