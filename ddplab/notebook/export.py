"""%ddp_export: the notebook's %%ddp cells, in order, as a script for torchrun (or srun).

Teaches: a %%ddp cell already is data-parallel code in the torchrun sense:
every rank runs the same source and finds ``rank``, ``local_rank``,
``world_size`` and ``device`` defined. So the script is the cells one after
another, below one ``ddplab.init_from_env()`` call that defines those names,
and it prints what the cells printed (torchrun can label lines by rank).

A ``Recording`` keeps what ran on the ranks since they last started: cells
that finished on every rank, values ``%ddp_push`` sent, and cells that raised
(left out, with a comment). When the ranks are replaced their state is gone,
and so is the recording: the script reproduces what the ranks hold now.

Pushed values become code where that is exact (literals; small tensors as
``torch.tensor([...])``). Other values torch can save and load with
``weights_only=True`` (big tensors, dicts and lists of them) go to one file
beside the script. Anything else (a model object, a function) is marked in
the script by a ``raise`` that says what to write there.

A cell's last expression, which the notebook showed for each rank, is
printed by the script (unless ``;`` ended it, or it is None), and a cell run
with ``--on 0`` becomes ``if rank in (0,):``.

``--sbatch`` adds a Slurm batch file that runs the script (notebook/sbatch.py).

Leaves out: kernel-side cells (only what ran on the ranks is exported), rich
display (the script prints the plain-text form), and ``__name__``, which is
"__ddp__" on a Cluster rank and "__main__" here.

References: torchrun (torch.distributed.run) and its
TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE; torch.load(weights_only=True).
"""
from __future__ import annotations

import ast
import io
import os
from pathlib import Path
from typing import NamedTuple

INLINE_NUMEL = 64  # tensors up to this size are written out as code
INLINE_CHARS = 4000  # longer literals go to the side file, keeping the script readable


class Cell(NamedTuple):
    filename: str  # "<ddp-cell-7>", as in the notebook's tracebacks
    source: str
    magic_line: str  # the %%ddp options, e.g. "--ranks 0"


class LeftOut(NamedTuple):
    filename: str
    why: str  # the first line of the error it raised


class Push(NamedTuple):
    name: str
    how: str  # "code", "saved" (in the side file) or "marked" (no source form)
    detail: str  # the code, the side file's key, or a description of the value
    value: object = None  # the snapshot saved in the side file


class Recording:
    """What ran on a Cluster's ranks since they last started, in order."""

    def __init__(self, world_size: int, backend: str = "auto", timeout: float = 60.0, ran_on: str = "gloo"):
        self.world_size = world_size
        self.backend = backend  # as the learner asked for it ("auto" stays "auto" on servers)
        self.timeout = timeout
        self.ran_on = ran_on  # what the ranks took: gloo (CPU) or nccl
        self.entries: list[Cell | LeftOut | Push] = []

    def add_cell(self, filename: str, source: str, magic_line: str = "") -> None:
        self.entries.append(Cell(filename, source, magic_line))

    def add_left_out(self, filename: str, why: str) -> None:
        self.entries.append(LeftOut(filename, why))

    def add_push(self, name: str, value) -> None:
        """Snapshot ``value`` now: the kernel's object may change after the push."""
        self.entries.append(_freeze(name, value, key=f"{name}#{len(self.entries)}"))

    def count(self, kind) -> int:
        return sum(isinstance(e, kind) for e in self.entries)


def _freeze(name: str, value, key: str) -> Push:
    text = _as_code(value)
    if text is not None:
        return Push(name, "code", text)
    copy = _weights_only_copy(value)
    if copy is not None:
        return Push(name, "saved", key, copy)
    kind = type(value)
    return Push(name, "marked", f"a {kind.__module__}.{kind.__qualname__}".replace("builtins.", ""))


def _as_code(value) -> str | None:
    """Source text that rebuilds ``value`` exactly, or None."""
    if type(value).__module__.startswith("torch"):
        return _tensor_as_code(value)
    try:
        text = repr(value)
        if len(text) > INLINE_CHARS:
            return None
        back = ast.literal_eval(text)
        if type(back) is type(value) and back == value:
            return text
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    return None


def _tensor_as_code(value) -> str | None:
    import torch

    if not (isinstance(value, torch.Tensor) and value.layout == torch.strided
            and value.numel() <= INLINE_NUMEL and not value.is_quantized):
        return None
    grad = ", requires_grad=True" if value.requires_grad else ""
    text = f"torch.tensor({value.tolist()!r}, dtype={value.dtype}{grad})"
    try:  # only keep it if it really round-trips (nan, inf and odd dtypes do not)
        back = eval(text, {"torch": torch})  # noqa: S307 - our own text
        if back.dtype == value.dtype and torch.equal(back, value.detach().cpu()):
            return text
    except Exception:
        pass
    return None


def _weights_only_copy(value):
    """A copy of ``value`` through torch.save/torch.load(weights_only=True), or None."""
    try:
        import torch

        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)
    except Exception:
        return None


def _header(name: str, rec: Recording, side: str | None) -> str:
    n = rec.world_size
    lines = [
        f'r"""{name}: the %%ddp cells of a ddplab notebook, exported by %ddp_export.',
        "",
        "Every rank runs this whole file, as every rank ran each cell. The notebook",
        f"had {n} rank(s); run it the same way with",
        f"    torchrun --nproc-per-node={n} {name}",
        "and to label output lines by rank as the notebook did:",
        "    TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank ${rank}] ' \\",
        f"        torchrun --tee 3 --nproc-per-node={n} {name}",
        "On 2 machines with 4 GPUs each, run on each machine:",
        "    torchrun --nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d \\",
        f"        --rdzv-endpoint=HOST:PORT --rdzv-id=JOB {name}",
        "(HOST: an address of one machine that the other can reach; PORT: free there.)",
        "torchrun gives local rank i GPU i whoever holds it: on a shared server name free",
        f"GPUs first, e.g. CUDA_VISIBLE_DEVICES=2,3 torchrun --nproc-per-node={n} {name}",
        "(python -m ddplab doctor lists who uses which GPU).",
        f"Under Slurm, one task per rank: srun python {name} (init_from_env reads Slurm's",
        "variables); %ddp_export FILE.py --sbatch writes a batch file for it.",
    ]
    if side:
        lines += [f"Pushed values are in {side} beside this file: copy it along."]
    return "\n".join(lines + ['"""'])


def _script_source(cell: Cell) -> str:
    """The cell as script code: its last value printed, --on ranks as an ``if``."""
    from ddplab.notebook.ddpcell import ends_with_semicolon

    source = cell.source.rstrip("\n")
    tree = ast.parse(source)
    last = tree.body[-1] if tree.body else None
    if (isinstance(last, ast.Expr) and not ends_with_semicolon(source)
            and not (isinstance(last.value, ast.Call) and getattr(last.value.func, "id", "") == "print")):
        lines = source.split("\n")
        expr = ast.get_source_segment(source, last.value)
        lines[last.lineno - 1:last.end_lineno] = [
            f"_ddp_value = ({expr})",
            "if _ddp_value is not None:  # the notebook showed this value for each rank",
            "    print(_ddp_value)"]
        source = "\n".join(lines)
    on = cell.magic_line.split("--on", 1)[1].split()[0] if "--on" in cell.magic_line else None
    if on is not None:
        ranks = tuple(int(r) for r in on.split(",") if r.strip())
        inside = _string_continuations(source)
        source = f"if rank in {ranks!r}:  # %%ddp --on {on}\n" + "\n".join(
            line if not line.strip() or n in inside else "    " + line
            for n, line in enumerate(source.split("\n"), 1))
    return source


def _string_continuations(source: str) -> set[int]:
    """Lines (1-based) inside a multi-line string: indenting them would change the string."""
    import tokenize

    inside = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        strings = (tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING))  # 3.12 f-strings
        if tok.type in strings and tok.end[0] > tok.start[0]:
            inside.update(range(tok.start[0] + 1, tok.end[0] + 1))
    return inside


def script_text(rec: Recording, name: str = "train.py", side: str | None = None) -> tuple[str, dict]:
    """The script for ``rec`` and the values for its side file ``side`` ({} if none)."""
    pushes = [e for e in rec.entries if isinstance(e, Push)]
    saved = {p.detail: p.value for p in pushes if p.how == "saved"}
    side = side if saved else None
    out = [_header(name, rec, side), "import sys", "", "import ddplab", "import ddplab.launchers.torchrun"]
    if saved:
        out.append("import os")
    if saved or any(p.how == "code" and p.detail.startswith("torch.") for p in pushes):
        out.append("import torch")
    out += [
        "",
        "# Join the group torchrun started; backend and collective timeout as in the notebook.",
        f"_ddp_env = ddplab.init_from_env(backend={rec.backend!r}, timeout={rec.timeout!r})",
        "# The names every %%ddp cell found defined on its rank:",
        "rank, local_rank, world_size, device = (_ddp_env.rank, _ddp_env.local_rank,",
        "                                        _ddp_env.world_size, _ddp_env.device)",
        f"if world_size != {rec.world_size} and rank == 0:  # the numbers then differ from the notebook's",
        f"    print(f'ddplab: this run has {{world_size}} ranks, the notebook had {rec.world_size}: its batches, "
        "averages and printed numbers differ from the notebook\\'s', file=sys.stderr)",
    ]
    if saved:
        out += [f"_ddp_pushed = torch.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "
                f"{side!r}), weights_only=True)"]
    for entry in rec.entries:
        out.append("")
        if isinstance(entry, Cell):
            options = f" {entry.magic_line}" if entry.magic_line else ""
            out += [f"# %%ddp{options}  ({entry.filename})", _script_source(entry)]
        elif isinstance(entry, LeftOut):
            out.append(f"# {entry.filename} is left out: in the notebook, {entry.why}")
        elif entry.how == "code":
            out += [f"# %ddp_push {entry.name}", f"{entry.name} = {entry.detail}"]
        elif entry.how == "saved":
            out += [f"# %ddp_push {entry.name} (saved in {side})",
                    f"{entry.name} = _ddp_pushed[{entry.detail!r}]"]
        else:  # fail loudly on the server rather than run on with a missing value
            why = f"{entry.name} was pushed from the notebook ({entry.detail}): write code that builds it here"
            out += [f"# %ddp_push {entry.name}: {entry.detail} has no source form.",
                    f"raise NotImplementedError({why!r})"]
    out += ["", "# Leave the group and exit without gloo's teardown abort.", "ddplab.launchers.torchrun.finish()", ""]
    return "\n".join(out), saved


def write_script(path, rec: Recording) -> list[Path]:
    """Write ``rec`` as a torchrun script at ``path`` (and its side file); return the paths."""
    import torch

    path = Path(path)
    side = f"{path.stem}.pushed.pt"
    text, saved = script_text(rec, path.name, side)
    compile(text, str(path), "exec")  # a broken script must fail here, not on a server
    path.write_text(text)
    written = [path]
    if saved:
        torch.save(saved, path.with_name(side))
        written.append(path.with_name(side))
    return written


def export_hint(path, rec: Recording) -> str:
    """What was written and the command to run it; then each cell left out, and why."""
    left = [e for e in rec.entries if isinstance(e, LeftOut)]
    text = (f"Wrote {os.fspath(path)}: {rec.count(Cell)} cell(s), {rec.count(Push)} push(es)"
            + (f", {len(left)} failed cell(s) left out" if left else "")
            + f". Run it with: torchrun --nproc-per-node={rec.world_size} {Path(path).name}")
    for entry in left:  # the script lacks what these cells would have done: say so where it is seen
        text += (f"\nLeft out: {entry.filename} raised in the notebook ({entry.why}); the script runs "
                 "without it. Fix the cell and run it again before exporting if the rest needs it.")
    return text


def nothing_to_export(rec: Recording | None) -> str | None:
    """Why there is no script to write (None: there is one)."""
    if rec is None or not rec.entries:
        return "nothing to export: no %%ddp cell has run since the ranks started"
    if rec.count(Cell) == 0:
        left = [e for e in rec.entries if isinstance(e, LeftOut)]
        return ("nothing to export: every %%ddp cell since the ranks started raised, so none is in "
                "the recording" + "".join(f"\n  {e.filename}: {e.why}" for e in left)
                + "\nFix them, run them again, then export.")
    return None
