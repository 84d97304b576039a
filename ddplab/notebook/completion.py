"""Tab completion and ``?`` in a %%ddp cell: names the ranks hold, asked of rank 0.

Teaches: the kernel and the ranks are different processes with different
namespaces. A model built in a %%ddp cell exists on every rank and nowhere
in the kernel, so the kernel's own completer cannot know it. Inside a %%ddp
cell, Tab therefore asks rank 0 (every rank ran the same cells, so its names
are everyone's), and Shift-Tab or ``name?`` asks rank 0 for the object's
type, signature and docstring. Nothing is copied into the kernel.

How: an IPython completion matcher (Matcher API v2) that only answers for
cells starting with ``%%ddp``; rank 0 runs the standard library's
``rlcompleter`` on its namespace (dotted names are looked up, properties are
not run). Inspection wraps the kernel's ``do_inspect`` for %%ddp cells.

Leaves out: completion inside strings and dict keys, and names that differ
between ranks (only rank 0 is asked); nothing is asked while a job runs.

References: IPython.core.completer (``context_matcher``, ``custom_matchers``);
ipykernel's ``do_inspect``; rlcompleter; inspect.
"""
from __future__ import annotations

import re

from ddplab.notebook import ddpcell

_DOTTED = re.compile(r"[A-Za-z_][\w.]*$")
LIMIT = 500


# -- rank side -----------------------------------------------------------------
def names_on_rank(token: str, namespace: dict) -> list[str]:
    """Completions of ``token`` ("mod", "model.we") in this rank's namespace."""
    import rlcompleter

    completer = rlcompleter.Completer(namespace)
    try:
        found = completer.attr_matches(token) if "." in token else completer.global_matches(token)
    except Exception:
        return []
    # rlcompleter adds "(" after callables and " " or ":" after keywords (readline habits)
    cleaned = {m[:-1] if m.endswith(("(", " ", ":")) else m for m in found}
    return sorted(cleaned)[:LIMIT]


def describe_on_rank(expr: str, namespace: dict, detail: int = 0) -> str | None:
    """Type, value, signature and docstring of ``expr`` on this rank (None: not defined)."""
    import inspect

    try:
        obj = eval(expr, namespace)  # a dotted name, checked in the kernel
    except Exception:
        return None
    text = "" if callable(obj) else repr(obj)
    lines = [f"Type:      {type(obj).__module__}.{type(obj).__qualname__}".replace("builtins.", "")]
    if text:
        lines.append(f"Value:     {text if len(text) <= 400 else text[:400] + ' ...'}")
    try:
        lines.append(f"Signature: {expr.rsplit('.', 1)[-1]}{inspect.signature(obj)}")
    except (TypeError, ValueError):
        pass
    doc = inspect.getdoc(obj)
    if doc:
        lines += ["Docstring:", doc]
    if detail:
        try:
            lines += ["Source:", inspect.getsource(obj)]
        except (OSError, TypeError):
            pass
    return "\n".join(lines) + f"\n(asked of rank {namespace.get('rank', 0)} of the %%ddp ranks)"


# -- kernel side ---------------------------------------------------------------
def _ask_rank0(magics, fn, *args):
    cluster = magics.cluster
    if cluster is None or cluster.running is not None or cluster.pids != magics.cluster_pids:
        return None
    try:
        return cluster.run_job(fn, (*args[:1], ddpcell.RANK_NAMESPACE, *args[1:]), ranks=[0], show_ranks=())[0]
    except Exception:
        return None


def _in_ddp_cell(full_text: str, cursor_line: int) -> bool:
    return full_text.lstrip().startswith("%%ddp") and cursor_line > 0


def make_matcher(magics):
    """The matcher to append to ``shell.Completer.custom_matchers``."""
    from IPython.core.completer import SimpleCompletion, context_matcher

    @context_matcher()
    def ddp_rank_names(context):
        if not _in_ddp_cell(context.full_text, context.cursor_line):
            return {"completions": [], "suppress": False}
        m = _DOTTED.search(context.text_until_cursor)
        token = m.group(0) if m else ""
        names = _ask_rank0(magics, names_on_rank, token) if token else None
        if not names:
            return {"completions": [], "suppress": False}
        return {"completions": [SimpleCompletion(n, type="ddp rank 0") for n in names],
                "matched_fragment": token, "suppress": True}

    return ddp_rank_names


def wrap_inspect(kernel, magics):
    """Make the kernel's inspect request (Shift-Tab) ask rank 0 inside %%ddp cells."""
    import inspect as _inspect

    from IPython.utils.tokenutil import token_at_cursor

    original = kernel.do_inspect

    async def do_inspect(code, cursor_pos, detail_level=0, omit_sections=()):
        line = code[:cursor_pos].count("\n")
        if _in_ddp_cell(code, line) and magics.cluster is not None:
            name = token_at_cursor(code, cursor_pos)
            text = _ask_rank0(magics, describe_on_rank, name, detail_level) if _DOTTED.fullmatch(name or "") else None
            if text is not None:
                return {"status": "ok", "found": True, "data": {"text/plain": text}, "metadata": {}}
        reply = original(code, cursor_pos, detail_level, omit_sections)
        return await reply if _inspect.isawaitable(reply) else reply

    do_inspect.original = original
    kernel.do_inspect = do_inspect
