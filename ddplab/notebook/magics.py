"""IPython magics: write data-parallel code in cells, on live ranks, then take it to torchrun.

Teaches: data-parallel code is one program that every rank runs. A ``%%ddp``
cell is that program, grown a cell at a time: its source runs on EVERY rank,
in a namespace per rank that persists across cells (build a model in one
cell, register hooks in the next, train in a third), with ``rank``,
``local_rank``, ``world_size`` and ``device`` defined as under torchrun.
``%ddp_export`` then writes the cells as a script for ``torchrun``.

A cell behaves like an ordinary cell, once per rank: its last expression is
shown for each rank (once, "all ranks", when they agree; ``;`` suppresses
it), ``display(obj)`` and plotly's ``fig.show()`` on a rank appear in the
cell labelled by rank, a tqdm bar is one line per rank updating in place,
Tab completes the ranks' names and ``name?`` shows their docstrings (rank 0
is asked).

    %load_ext ddplab
    %ddp_start 2 [--backend gloo|nccl|auto] [--timeout S]
    %%ddp [--timeout S] [--ranks 0,1]      (--ranks filters the output shown only)
    %%ddp --on 0                           runs on rank 0 only (no collectives there)
    %ddp_push NAME [NAME ...]              kernel -> every rank
    %ddp_pull NAME                         every rank -> kernel: a list by rank
    %ddp_status                            pids, devices, memory, jobs
    %ddp_stop
    %ddp_export FILE.py [--sbatch --nodes N --gpus-per-node G --time T --partition P
                        --launcher srun|torchrun --warn-s S --other-world-size --on-gpus]

How a cell runs: the kernel compiles it (a syntax error never reaches the
ranks) under a file name like ``<ddp-cell-7>`` that it also puts in its own
``linecache``, and each rank runs ``exec(code, namespace)``. A rank's
traceback is rebuilt in the kernel from that linecache, so it shows the
cell's own lines, numbered as the notebook's editor numbers them.

Leaves out, compared with ipyparallel's %%px: engines on other machines and
non-blocking cells. ``--on`` is %%px's ``--targets`` for inspection only: a
collective there raises at once (the other ranks are not taking part).

References: IPython's Magics API; ipyparallel's %%px (and its
``_render_traceback_`` for remote errors); torchrun. The pieces: notebook/ddpcell.py
(split and run a cell), notebook/rankview.py (per-rank blocks), notebook/completion.py (Tab and
``?``), cluster/progress.py (tqdm lines), cluster/status.py, cluster/subset.py.
"""
from __future__ import annotations

import linecache
import os
import re
import traceback

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ddplab.cluster import Cluster, RankError
from ddplab.notebook import completion, ddpcell, export, rankview, sbatch
from ddplab.notebook.ddpcell import RANK_NAMESPACE


def _rank_list(text: str) -> set[int]:
    try:
        ranks = {int(r) for r in text.split(",") if r.strip()}
    except ValueError:
        ranks = set()
    if not ranks:
        raise UsageError(f"--ranks and --on take rank numbers separated by commas, e.g. 0 or 0,1; got {text!r}")
    return ranks


_INSPECT = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(\?\??)\s*$")  # a cell that is just `name?` or `name??`


def _show_message_only(exc: RankError) -> None:
    # IPython draws an exception with _render_traceback_ from that alone (as it
    # does for ipyparallel's remote errors): the rank tracebacks in the message
    # are what matters, not the kernel frames of the magic and the Cluster.
    exc._render_traceback_ = lambda: [f"{type(exc).__name__}: {exc}"]


@magics_class
class DDPMagics(Magics):
    """The ``%ddp_*`` magics; one Cluster per kernel, in ``self.cluster``."""

    def __init__(self, shell):
        super().__init__(shell)
        self.cluster: Cluster | None = None
        self.recording: export.Recording | None = None
        self.cluster_pids: list[int] = []  # the ranks the recording and the names belong to
        self._backend = "auto"
        self._filenames: set[str] = set()
        self._shown_ranks = None  # the running cell's --ranks

    # -- lifecycle -------------------------------------------------------------
    @magic_arguments()
    @argument("world_size", type=int, help="number of ranks")
    @argument("--backend", default="auto", help="auto (nccl with one GPU per rank, else gloo), gloo or nccl")
    @argument("--timeout", type=float, default=60.0,
              help="seconds a collective may stall before it fails (not a limit on the cell)")
    @line_magic
    def ddp_start(self, line):
        """Start N ranks that keep their state across %%ddp cells."""
        args = parse_argstring(self.ddp_start, line)
        if self.cluster is not None:
            print(f"A cluster is already running: {self.cluster!r}. It is kept, with "
                  "everything its ranks hold; run %ddp_stop first to start a different one.")
            return
        try:
            self.cluster = Cluster(args.world_size, backend=args.backend, timeout=args.timeout)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        self._backend = args.backend
        self._prepare_ranks()
        c = self.cluster
        print(f"{c.world_size} ranks ready ({c.backend}, pids {c.pids}) in {c.start_seconds:.1f} s. "
              "%%ddp cells run on every rank, with rank, local_rank, world_size and device defined.")

    @line_magic
    def ddp_stop(self, line=""):
        """Stop the ranks. The recording stays for %ddp_export until the next %ddp_start."""
        if self.cluster is None:
            print("No cluster is running.")
            return
        cluster, self.cluster = self.cluster, None
        cluster.shutdown()
        print(f"Stopped {cluster.world_size} ranks.")

    def _need_cluster(self) -> Cluster:
        if self.cluster is None:
            raise UsageError("no ranks are running: start them with %ddp_start 2")
        return self.cluster

    def _prepare_ranks(self) -> None:
        """Fresh ranks (first start, or replaced after a failure): define the
        names cells rely on and start a new recording, since state is gone."""
        from ddplab.launchers import torchrun

        cluster = self.cluster
        cluster.run(torchrun.publish_names, RANK_NAMESPACE)
        cluster.run(ddpcell.prepare)
        cluster.on_display = self._show_display
        self.cluster_pids = cluster.pids
        self.recording = export.Recording(cluster.world_size, self._backend, cluster.timeout, cluster.backend)

    def _show_display(self, rank: int, payload: dict) -> None:
        rankview.show_display(rank, payload, self.cluster.world_size, self._shown_ranks)

    def _run(self, fn, args, job_timeout=None, show_ranks=None, ranks=None) -> list:
        cluster = self._need_cluster()
        # ensure_ready replaces ranks that died while idle now, so that the names
        # cells rely on are defined on the new ones before the cell runs.
        if cluster.ensure_ready() != self.cluster_pids:  # replaced after a failure, or just now
            self._prepare_ranks()
        self._shown_ranks = show_ranks
        try:
            return cluster.run_job(fn, args, job_timeout=job_timeout, show_ranks=show_ranks, ranks=ranks)
        except RankError as exc:
            _show_message_only(exc)
            raise

    # -- cells -----------------------------------------------------------------
    @magic_arguments()
    @argument("--timeout", type=float, default=None, help="wall-clock limit for this cell, in seconds")
    @argument("--ranks", type=_rank_list, default=None, help="show only these ranks' output, e.g. 0 or 0,2")
    @argument("--on", type=_rank_list, default=None,
              help="run on these ranks only, e.g. 0 (for inspection: collectives raise there)")
    @cell_magic
    def ddp(self, line, cell):
        """Run the cell on every rank (or the --on ranks), in each rank's persistent
        namespace; show each rank's last expression like a cell's Out."""
        args = parse_argstring(self.ddp, line)
        cluster = self._need_cluster()
        for option in ("ranks", "on"):
            chosen = getattr(args, option)
            if chosen is not None and not chosen <= set(range(cluster.world_size)):
                raise UsageError(f"--{option} {sorted(chosen)}: ranks are 0..{cluster.world_size - 1}")
        asked = _INSPECT.match(cell)
        if asked:
            return self._inspect(asked.group(1), len(asked.group(2)) - 1, args.on)
        if args.timeout is not None and not args.timeout > 0:
            raise UsageError("--timeout takes a positive number of seconds")
        filename = self._new_filename()
        magic_line = f"%%ddp {line}".rstrip()
        # Keep the %%ddp line in front so line numbers match the notebook's editor.
        shown = magic_line + "\n" + cell
        linecache.cache[filename] = (len(shown), None, shown.splitlines(True), filename)
        try:
            body, last = ddpcell.compile_cell(cell, filename)
        except SyntaxError as exc:
            # Raised as is, IPython would list this magic's frames above the cell's line.
            raise UsageError("this cell was not sent to the ranks:\n"
                             + "".join(traceback.format_exception_only(exc)).rstrip()) from None
        try:
            values = self._run(ddpcell.run_cell, (body, last, RANK_NAMESPACE), args.timeout, args.ranks,
                               ranks=args.on)
        except RankError as exc:
            if self.cluster.pids == self.cluster_pids:  # ranks kept: note the gap in the recording
                self.recording.add_left_out(filename, str(exc).splitlines()[0])
            raise
        if cell.strip():
            self.recording.add_cell(filename, cell, line.strip())
        if args.ranks is not None:
            values = [v if r in args.ranks else None for r, v in enumerate(values)]
        if args.on is not None:  # ranks that did not run the cell have no value to agree on
            rankview.show_blocks([(r, values[r]) for r in sorted(args.on) if values[r] is not None],
                                 cluster.world_size)
            return
        rankview.show_values(values, cluster.world_size)

    def _inspect(self, expr: str, detail: int, on) -> None:
        """``name?`` (detail 0) or ``name??`` (1, with source) in a %%ddp cell: asked of one rank."""
        from IPython.core import page

        rank = min(on) if on else 0
        text = self._run(completion.describe_on_rank, (expr, RANK_NAMESPACE, detail), ranks=[rank],
                         show_ranks=())[rank]
        if text is None:
            print(f"{expr} is not defined on rank {rank}.")
            return
        page.page(text)

    @line_magic
    def ddp_status(self, line=""):
        """Each rank's pid, device, memory and job; the backend, timeout and generation."""
        return self._need_cluster().status()

    def _new_filename(self) -> str:
        # Named after the cell's In[n] so a learner can find it (IPython has already
        # counted the running cell, hence - 1); a name is never reused, since old
        # tracebacks still point at it: a second %%ddp from one cell gets a suffix.
        base = f"ddp-cell-{max(self.shell.execution_count - 1, 0)}"
        name, k = f"<{base}>", 1
        while name in self._filenames:
            k += 1
            name = f"<{base}.{k}>"
        self._filenames.add(name)
        return name

    # -- moving values ---------------------------------------------------------
    @line_magic
    def ddp_push(self, line):
        """Send kernel variables to every rank: ``%ddp_push lr model_config``."""
        names = line.split()
        if not names:
            raise UsageError("usage: %ddp_push NAME [NAME ...] (variables of this notebook)")
        for name in names:
            if not name.isidentifier():
                raise UsageError(f"%ddp_push takes variable names, got {name!r}")
            if name not in self.shell.user_ns:
                raise UsageError(f"{name!r} is not defined in the notebook; define it, then %ddp_push {name}")
        values = {name: self.shell.user_ns[name] for name in names}
        self._run(dict.update, (RANK_NAMESPACE, values))
        for name, value in values.items():
            self.recording.add_push(name, value)

    @line_magic
    def ddp_pull(self, line):
        """Fetch a name (or any expression) from every rank: a list indexed by rank."""
        expr = line.strip()
        if not expr:
            raise UsageError("usage: %ddp_pull NAME (returns [value on rank 0, value on rank 1, ...])")
        try:
            code = compile(expr, "<ddp_pull>", "eval")
        except SyntaxError as exc:
            raise UsageError(f"%ddp_pull {expr}: {exc.msg}") from None
        return self._run(eval, (code, RANK_NAMESPACE))

    @magic_arguments()
    @argument("file", nargs="?", default="", help="the script to write, e.g. train.py")
    @sbatch.magic_options
    @line_magic
    def ddp_export(self, line):
        """Write this session's %%ddp cells as a torchrun script: ``%ddp_export train.py``;
        ``--sbatch --nodes 2 --gpus-per-node 4`` adds train.sbatch for Slurm (docs/hpc.md)."""
        args = parse_argstring(self.ddp_export, line)
        path = os.path.expanduser(args.file)
        if not path.endswith(".py"):
            raise UsageError("usage: %ddp_export FILE.py [--sbatch --nodes N --gpus-per-node G ...]")
        why = export.nothing_to_export(self.recording)  # no script, and no batch file, for zero cells
        if why:
            raise UsageError(why)
        rec = self.recording  # the job's shape is checked against the notebook's, before any file
        opts = sbatch.from_magic(args, rec.world_size, rec.ran_on, rec.backend)  # None without --sbatch
        export.write_script(path, self.recording)
        print(export.export_hint(path, self.recording))
        if opts is not None:
            print(sbatch.hint(sbatch.write_batch(path, opts), opts))


def load_ipython_extension(ipython) -> None:
    """``%load_ext ddplab``: the magics, Tab completion and Shift-Tab inside %%ddp cells."""
    magics = DDPMagics(ipython)
    ipython.register_magics(magics)
    ipython.Completer.custom_matchers.append(completion.make_matcher(magics))
    kernel = getattr(ipython, "kernel", None)
    if kernel is not None:
        completion.wrap_inspect(kernel, magics)


def unload_ipython_extension(ipython) -> None:
    magics = ipython.magics_manager.registry.get("DDPMagics")
    if magics is not None and magics.cluster is not None:
        magics.ddp_stop()
    ipython.Completer.custom_matchers[:] = [m for m in ipython.Completer.custom_matchers
                                            if getattr(m, "__name__", "") != "ddp_rank_names"]
    kernel = getattr(ipython, "kernel", None)
    if kernel is not None and hasattr(kernel.do_inspect, "original"):
        kernel.do_inspect = kernel.do_inspect.original


__all__ = ["DDPMagics", "load_ipython_extension", "unload_ipython_extension", "RANK_NAMESPACE"]
