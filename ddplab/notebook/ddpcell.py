"""What a %%ddp cell is: compiled in the kernel, run on each rank, shown like a cell.

Teaches: a notebook cell is a small program whose last line, when it is an
expression, is also displayed. IPython does that by splitting the cell: every
statement but the last runs as a module, the last expression is evaluated
and handed to the display machinery (unless a ``;`` ends it). A ``%%ddp`` cell
does the same on every rank: ``compile_cell`` splits it in the kernel (so a
syntax error never reaches the ranks, and both halves keep the cell's line
numbers), ``run_cell`` runs both halves on a rank and turns the value into a
MIME bundle there (``text/plain``, ``text/html``, plotly's JSON, PNG ...). The
bundle is what travels: a value that cannot be pickled still shows as its
repr, and the kernel never needs the rank's classes.

``display(obj)`` on a rank (``IPython.display.display``, plotly's
``fig.show()``) formats the object on the rank the same way and sends it to
the kernel at once, through the rank's socket, so it appears in the running
cell labelled by rank (notebook/rankview.py draws it).

Leaves out, compared with IPython: ``Out``/``_`` history on the ranks,
display handles and ``clear_output`` on a rank (a rank's display is shown
once), widgets made on a rank (their comm lives in the kernel, not the rank).

References: IPython's ``InteractiveShell.run_ast_nodes`` (last-expression
split) and ``DisplayFormatter``; plotly.io renderers (``plotly_mimetype`` is
what plotly picks in a Jupyter kernel).
"""
from __future__ import annotations

import ast
import io
import os
import tokenize
import types

_formatter = None


# -- kernel side ---------------------------------------------------------------
def ends_with_semicolon(cell: str) -> bool:
    """True when the cell's last token is ``;`` (IPython then shows nothing)."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.ENDMARKER,
            tokenize.INDENT, tokenize.DEDENT}
    last = None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(cell).readline):
            if tok.type not in skip:
                last = tok
    except (tokenize.TokenError, SyntaxError):
        return False
    return last is not None and last.type == tokenize.OP and last.string == ";"


def compile_cell(cell: str, filename: str, first_line: int = 2):
    """``(body, last)`` code objects for ``cell``; ``last`` is None when the cell
    does not end in an expression or ends in ``;``. Raises SyntaxError.

    ``first_line`` is the line the cell's source starts on in the notebook's
    editor (2: below the ``%%ddp`` line)."""
    tree = ast.parse("\n" * (first_line - 1) + cell, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not ends_with_semicolon(cell):
        expr = ast.Expression(tree.body.pop().value)
        last = compile(expr, filename, "eval")
    return compile(tree, filename, "exec"), last


# -- rank side -----------------------------------------------------------------
def prepare() -> None:
    """Run once on each fresh rank: plotly figures become MIME bundles (as in a
    Jupyter kernel) instead of opening a browser, and ``IPython.display.display``
    sends what it is given to the kernel."""
    os.environ.setdefault("PLOTLY_RENDERER", "plotly_mimetype")
    try:
        import sys

        if "plotly.io" in sys.modules:  # imported before: set the renderer it picked
            sys.modules["plotly.io"].renderers.default = os.environ["PLOTLY_RENDERER"]
        import IPython.core.display_functions as functions
        import IPython.display as ipd
    except ImportError:
        return
    ipd.display = functions.display = display
    ipd.clear_output = functions.clear_output = _clear_output


def bundle(value) -> dict | None:
    """``{"data": {mime: ...}, "metadata": {...}}`` for a value, None for None."""
    global _formatter
    if value is None:
        return None
    data, metadata = {}, {}
    try:
        if _formatter is None:
            from IPython.core.formatters import DisplayFormatter

            _formatter = DisplayFormatter()
            # _ipython_display_ would display the object itself; we want its bundle
            _formatter.ipython_display_formatter.enabled = False
        data, metadata = _formatter.format(value)
    except Exception:  # no IPython here, or a broken _repr_*_: fall back to repr below
        pass
    if "text/plain" not in data:
        data["text/plain"] = _safe_repr(value)
    if set(data) == {"text/plain"}:
        png = _matplotlib_png(value)
        if png is not None:
            data["image/png"] = png
    return {"data": data, "metadata": metadata}


def _safe_repr(value) -> str:
    try:
        return repr(value)
    except Exception as exc:
        return f"<{type(value).__name__} object; repr() raised {type(exc).__name__}: {exc}>"


def _matplotlib_png(value):
    import sys

    figure = sys.modules.get("matplotlib.figure")
    if figure is None or not isinstance(value, figure.Figure):
        return None
    import base64

    buf = io.BytesIO()
    value.savefig(buf, format="png", bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def run_cell(body: types.CodeType, last, namespace: dict):
    """Run a compiled cell in this rank's namespace; the bundle of its last value."""
    __tracebackhide__ = True  # the kernel shows the cell's frames, not this one
    exec(body, namespace)
    if last is None:
        return None
    return bundle(eval(last, namespace))


def display(*objs, include=None, exclude=None, metadata=None, raw=False, **kwargs):
    """``IPython.display.display`` on a rank: each object goes to the kernel now."""
    from ddplab.cluster import worker

    for obj in objs:
        if raw:
            shown = {"data": dict(obj), "metadata": dict(metadata or {})}
        else:
            shown = bundle(obj)
            if shown is None:
                continue
            if metadata:
                shown["metadata"].update(metadata)
        if worker.channel is None or worker.job_id is None:  # not on a Cluster rank
            print(shown["data"].get("text/plain", ""))
            continue
        worker.flush_output()  # what the rank printed before comes first
        worker.channel.send(("display", worker.job_id, shown))


def _clear_output(wait=False):
    """A rank cannot clear the kernel's cell; its displays are shown once each."""


class RankNamespace:
    """Stands for ``ddplab.cluster.worker.namespace``: it becomes that dict when a
    rank unpickles it, so ``exec``, ``eval`` and ``dict.update`` can be sent as
    they are and no wrapper frame shows up in a cell's traceback."""

    def __reduce__(self):
        from ddplab.cluster import worker

        return getattr, (worker, "namespace")


RANK_NAMESPACE = RankNamespace()  # what %%ddp cells send for the rank's namespace
