"""%ddp_export FILE.py --sbatch: a Slurm batch file beside the exported script.

Teaches: on an HPC cluster the ranks are Slurm tasks. The batch file asks
for the nodes, GPUs and time (``#SBATCH`` lines), and starts the ranks in one
of two ways:

- ``srun`` (the default): one task per GPU, so ``--ntasks-per-node`` equals
  ``--gpus-per-node``. Slurm starts every rank itself and each one reads its
  place from Slurm's variables (``ddplab.init_from_env``, launchers/schedulers.py).
  No other program sits between Slurm and the ranks: Slurm's accounting,
  signals, time limit and ``scancel`` reach each rank, and ``srun --label``
  prefixes each output line with its rank.
- ``torchrun``: one task per node, each a ``torchrun`` that starts that node's
  ranks and meets the other nodes' torchruns at a c10d rendezvous on the first
  node (its NodeAddr, a port from the job id). For scripts that need
  torchrun's own features (``--max-restarts``, its error files), or sites
  whose ``srun`` cannot start several tasks per node.

Either way the job fails fast and survives its time limit: ``srun
--kill-on-bad-exit=1`` ends every task when one fails (a hung rank would
otherwise hold the nodes until the limit); ``--signal=USR1@90`` warns the
ranks before the limit, ``--requeue`` and ``--open-mode=append`` let a
``ddplab.Resumable`` loop save, requeue and resume into the same output file,
where each attempt's first line marks it (launchers/requeue.py). The options are
checked against the notebook before anything is written: its world size
(``--other-world-size`` to differ on purpose) and its backend (no GPUs for a
notebook whose ranks ran on the CPU unless ``--on-gpus``).

Leaves out: ``--cpus-per-task`` and ``--mem`` (the site's defaults; the
threads per rank follow the CPUs the task may use), accounts and QOS,
containers (``srun --container-image``), job arrays (docs/hpc.md shows one), and module
loads: add them to the batch file by hand where your site asks for them.

References: Slurm's sbatch(1) and srun(1) manual pages (``--gpus-per-node``,
``--ntasks-per-node``, ``--label``, ``%x``/``%j`` in ``--output``, ``--signal``,
``--requeue``, ``--open-mode``, ``--kill-on-bad-exit``);
torch's elastic/run.html (``--rdzv-backend=c10d``).
"""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import NamedTuple

LAUNCHERS = ("srun", "torchrun")


class BatchOptions(NamedTuple):
    nodes: int = 1
    gpus_per_node: int = 1  # 0: a CPU job (gloo)
    ntasks_per_node: int | None = None  # ranks per node; with GPUs it must equal gpus_per_node
    time: str = "00:30:00"
    partition: str | None = None
    launcher: str = "srun"
    python: str = sys.executable  # the notebook's kernel's Python, which has torch and ddplab
    warn_s: int = 90  # SIGUSR1 this long before the time limit (ddplab.Resumable saves, requeues); 0: none


def check(opts: BatchOptions) -> BatchOptions:
    """``opts`` with ranks per node filled in; ValueError in words for what Slurm would refuse
    or what would leave GPUs idle."""
    if opts.launcher not in LAUNCHERS:
        raise ValueError(f"--launcher takes srun or torchrun, not {opts.launcher!r}")
    if opts.nodes < 1 or opts.gpus_per_node < 0:
        raise ValueError("--nodes takes 1 or more, --gpus-per-node 0 (a CPU job) or more")
    if not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}", opts.time):
        raise ValueError(f"--time {opts.time!r}: Slurm takes MINUTES, HH:MM:SS or D-HH:MM:SS")
    if opts.ntasks_per_node is not None and opts.ntasks_per_node < 1:
        raise ValueError(f"--ntasks-per-node {opts.ntasks_per_node}: it takes 1 or more (the ranks per node)")
    per_node = opts.ntasks_per_node or opts.gpus_per_node or 1
    if opts.gpus_per_node and per_node != opts.gpus_per_node:
        raise ValueError(f"--ntasks-per-node {per_node} with --gpus-per-node {opts.gpus_per_node}: "
                         "each rank takes one GPU, so give as many ranks as GPUs per node; for a CPU "
                         "job pass --gpus-per-node 0 (then --ntasks-per-node is the ranks per node)")
    if per_node < 1:
        raise ValueError("--ntasks-per-node takes 1 or more")
    if opts.warn_s < 0 or opts.warn_s > 65535:
        raise ValueError(f"--warn-s {opts.warn_s}: Slurm's --signal takes 0 to 65535 seconds before the limit")
    limit = seconds(opts.time)
    if opts.warn_s and limit and limit < opts.warn_s + 60:
        raise ValueError(
            f"--time {opts.time} ({limit} s) with --warn-s {opts.warn_s}: every attempt would be warned "
            f"{max(limit - opts.warn_s, 0)} s after it starts, save after a step and requeue, never getting "
            f"far. Give --time at least {opts.warn_s + 60} s (--warn-s plus a minute), or a smaller --warn-s "
            "(0: no warning).")
    return opts._replace(ntasks_per_node=per_node)


def seconds(time: str) -> int:
    """Slurm's --time in seconds (0: no limit). MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS,
    DAYS-HOURS, DAYS-HOURS:MINUTES or DAYS-HOURS:MINUTES:SECONDS, as sbatch(1) reads them."""
    days, _, rest = time.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        h, m, s = (parts + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + m) * 60 + s
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


MAGIC_OPTIONS = [  # %ddp_export's options for the batch file
    ("--sbatch", {"action": "store_true", "help": "also write FILE's .sbatch batch file for Slurm"}),
    ("--nodes", {"type": int, "default": 1}),
    ("--gpus-per-node", {"type": int, "default": None, "help": "default: the notebook's ranks; 0: CPU"}),
    ("--ntasks-per-node", {"type": int, "default": None, "help": "ranks per node of a CPU job"}),
    ("--time", {"default": "00:30:00"}),
    ("--partition", {"default": None}),
    ("--launcher", {"default": "srun", "choices": LAUNCHERS, "help": "one task per rank, or per node"}),
    ("--warn-s", {"type": int, "default": 90, "help": "SIGUSR1 this many s before the limit; 0: none"}),
    ("--other-world-size", {"action": "store_true", "help": "run at another number of ranks than the notebook"}),
    ("--on-gpus", {"action": "store_true", "help": "GPUs for a notebook that ran on the CPU (auto backend)"}),
]


def magic_options(fn):
    """Add MAGIC_OPTIONS to a magic's ``magic_arguments``."""
    from IPython.core.magic_arguments import argument

    for name, kwargs in reversed(MAGIC_OPTIONS):
        fn = argument(name, **kwargs)(fn)
    return fn


def from_magic(args, world_size: int, ran_on: str = "gloo", asked: str = "auto") -> BatchOptions | None:
    """The options of ``%ddp_export --sbatch`` (None without --sbatch). The defaults follow the
    notebook: one node with its ranks, one GPU each where they ran on GPUs (``ran_on`` nccl),
    none where they ran on the CPU (``--ntasks-per-node`` ranks per node). A UsageError says
    what Slurm would refuse, and refuses a job of another world size than the notebook's
    (``--other-world-size`` allows it) and GPUs for a notebook that ran on the CPU."""
    from IPython.core.error import UsageError

    if not args.sbatch:
        return None
    if args.nodes < 1:  # before anything divides by it
        raise UsageError("--nodes takes 1 or more, --gpus-per-node 0 (a CPU job) or more")
    on_gpus = ran_on == "nccl"
    if args.on_gpus and not on_gpus and not args.gpus_per_node:
        unsaid = "--gpus-per-node 0 asks for none" if args.gpus_per_node == 0 else "no --gpus-per-node says how many"
        raise UsageError(
            f"--on-gpus asks for GPU nodes, but {unsaid}: "
            f"add --gpus-per-node N, one GPU per rank (e.g. {_shape_for(world_size, 1, args.nodes)}), "
            "or drop --on-gpus for a CPU job.")
    gpus = (world_size if on_gpus else 0) if args.gpus_per_node is None else args.gpus_per_node
    if gpus and not on_gpus and not (args.on_gpus and asked == "auto"):
        raise UsageError(_cpu_notebook_gpus(gpus, asked))
    per_node = args.ntasks_per_node
    if per_node is None and not gpus:
        per_node = (world_size + args.nodes - 1) // args.nodes
    try:
        opts = check(BatchOptions(args.nodes, gpus, per_node, args.time, args.partition, args.launcher,
                                  warn_s=args.warn_s))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    ranks = opts.nodes * opts.ntasks_per_node
    if ranks != world_size and not args.other_world_size:
        raise UsageError(
            f"the job would have {ranks} ranks ({opts.nodes} node(s) x {opts.ntasks_per_node}), the notebook "
            f"had {world_size}: each rank's batches and the averages would differ, and so would every "
            f"number the script prints. Ask for {world_size} ranks (e.g. "
            f"{_shape_for(world_size, gpus, args.nodes)}), "
            "or add --other-world-size to run at another size on purpose.")
    return opts


def _shape_for(world_size: int, gpus: int, nodes: int = 1) -> str:
    """Options for ``world_size`` ranks: on the user's ``nodes`` where the ranks divide evenly."""
    nodes = nodes if nodes >= 1 and world_size % nodes == 0 else 1
    if gpus:
        return f"--nodes {nodes} --gpus-per-node {world_size // nodes}"
    return f"--nodes {nodes} --gpus-per-node 0 --ntasks-per-node {world_size // nodes}"


def _cpu_notebook_gpus(gpus: int, asked: str) -> str:
    text = (f"--gpus-per-node {gpus}: the notebook's ranks ran on the CPU (gloo), so the job would hold "
            f"{gpus} GPU(s) per node that the script does not use (and where the nodes have none, sbatch "
            "says 'Invalid generic resource'). Pass --gpus-per-node 0 for a CPU job (--ntasks-per-node "
            "then gives its ranks per node)")
    if asked == "auto":
        return text + ", or add --on-gpus to run the script on GPU nodes (its backend 'auto' then takes nccl)."
    return text + f"; the notebook asked for backend {asked!r}, which the script asks for too."


def hint(batch: Path, opts: BatchOptions) -> str:
    """One line for the learner: what the batch file runs and how to submit it."""
    return (f"Wrote {batch}: {opts.nodes} node(s) x {opts.ntasks_per_node} rank(s), started by "
            f"{opts.launcher}. Submit it from {batch.resolve().parent}: sbatch {batch.name}")


def batch_text(script: str, opts: BatchOptions) -> str:
    """The batch file that runs ``script`` (a file name in the submit folder) as ``opts`` say."""
    opts = check(opts)
    stem, n, per_node = Path(script).stem, opts.nodes, opts.ntasks_per_node
    what = f"{opts.gpus_per_node} GPU(s)" if opts.gpus_per_node else f"{per_node} CPU rank(s)"
    how = ("srun starts one task per rank; ddplab.init_from_env() reads its place from Slurm"
           if opts.launcher == "srun" else
           "srun starts one torchrun per node; each starts that node's ranks")
    tasks = per_node if opts.launcher == "srun" else 1
    lines = [
        "#!/bin/bash",
        f"# {stem}.sbatch: runs {script} (exported from a ddplab notebook) on {n} node(s) x {what},",
        f"# {n * per_node} ranks in all; {how}.",
        f"# Submit it from the folder that holds {script}:   sbatch {stem}.sbatch",
        "# Every line is explained in ddplab's docs/hpc.md.",
        f"#SBATCH --job-name={stem}",
        f"#SBATCH --nodes={n}",
        f"#SBATCH --ntasks-per-node={tasks}",
    ]
    if opts.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={opts.gpus_per_node}")
    lines.append(f"#SBATCH --time={opts.time}")
    if opts.partition:
        lines.append(f"#SBATCH --partition={opts.partition}")
    lines.append("#SBATCH --output=%x-%j.out")
    if opts.warn_s:
        lines += [
            f"# SIGUSR1 to every task {opts.warn_s} s before the time limit: a ddplab.Resumable loop then",
            "# saves a checkpoint and requeues the job, which resumes from it (docs/hpc.md).",
            f"#SBATCH --signal=USR1@{opts.warn_s}",
        ]
    lines += [
        "# A requeued job (preempted, a node lost, or the checkpoint above) appends to its output.",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "",
        "set -euo pipefail",
        'echo "=== job $SLURM_JOB_ID attempt $(( ${SLURM_RESTART_COUNT:-0} + 1 )) on $SLURM_JOB_NODELIST,' +
        ' started $(date -u +%FT%TZ)"',
        "# The Python that has torch and ddplab (the notebook's kernel's); PYTHON=... sbatch overrides it.",
        f"PYTHON=${{PYTHON:-{shlex.quote(opts.python)}}}",
        f'SCRIPT="$SLURM_SUBMIT_DIR/{script}"',
        "",
    ]
    if opts.launcher == "srun":
        lines += [
            "# One task per rank, Slurm's --label puts its rank in front of each line (\"0: ...\").",
            "# --kill-on-bad-exit=1: a task that fails ends the others, and the job, at once;",
            "# without it a hung rank holds every node until the time limit.",
            'srun --kill-on-bad-exit=1 --label "$PYTHON" "$SCRIPT"',
        ]
    else:
        lines += [
            "# torchrun's rendezvous lives on the first node: the address Slurm reaches it by",
            "# (NodeAddr), and a port from the job id, so two jobs on one node do not clash.",
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
            "head_addr=$(scontrol show node \"$head_node\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
            "port=$((20000 + SLURM_JOB_ID % 12000))",
            "# One torchrun per node; each starts this node's ranks and labels their lines.",
            "# A failed rank ends its torchrun, and --kill-on-bad-exit=1 then the other nodes'.",
            "# The agent ignores Slurm's SIGUSR1 (it would die of it); its ranks catch it.",
            "export TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank ${rank}] '",
            "srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c 'trap \"\" USR1; exec \"$@\"' torchrun \\",
            '    "$PYTHON" -m torch.distributed.run \\',
            f'    --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={per_node} \\',
            '    --rdzv-backend=c10d --rdzv-endpoint="$head_addr:$port" --rdzv-id="$SLURM_JOB_ID" \\',
            '    --tee=3 "$SCRIPT"',
        ]
    return "\n".join(lines) + "\n"


def write_batch(script_path, opts: BatchOptions) -> Path:
    """Write ``<stem>.sbatch`` beside ``script_path``; return its path."""
    script_path = Path(script_path)
    path = script_path.with_suffix(".sbatch")
    path.write_text(batch_text(script_path.name, opts))
    return path
