"""Showing what the ranks return and display, labelled by rank, in the running cell.

Teaches: N ranks produce N answers, and most of the time they should be the
same (that is what data parallelism promises for weights after a step); when
they differ, the difference is the lesson. So a value that every rank agrees
on is shown once, "all ranks", and differing values one block per rank,
rank 0 first.

Each block is one Jupyter output with two forms: HTML (a collapsible
``<details>`` section per rank, rank 0 open; with more than ``OPEN_UP_TO``
ranks the others start closed so many ranks stay readable) and plain text
(``[rank r] value``), which is what nbval, ``jupyter nbconvert --to script``
and a terminal read. Objects whose richest form is not HTML, text or an image
(a plotly figure's JSON, say) are shown as they are, after a one-line label.

Leaves out: side-by-side columns per rank, diffs between ranks' values.

References: Jupyter's display_data message (a MIME bundle: the front end
shows the richest form it can); HTML's ``<details>``/``<summary>``.
"""
from __future__ import annotations

import html

OPEN_UP_TO = 4  # up to this many ranks, every rank's section starts open
SIMPLE = {"text/plain", "text/html", "image/png", "image/jpeg", "image/svg+xml"}
STYLE = "margin:0.1em 0; font-family:var(--jp-code-font-family, monospace)"


def _publish(data: dict, metadata: dict | None = None) -> None:
    from IPython.display import display

    display(data, raw=True, metadata=metadata or {})


def _inner_html(data: dict) -> str:
    if "text/html" in data:
        return data["text/html"]
    for mime in ("image/png", "image/jpeg"):
        if mime in data:
            return f'<img src="data:{mime};base64,{data[mime]}"/>'
    if "image/svg+xml" in data:
        return data["image/svg+xml"]
    return f"<pre style='margin:0'>{html.escape(data.get('text/plain', ''))}</pre>"


def _plain(label: str, text: str) -> str:
    text = text.rstrip("\n")
    return f"[{label}] {text}" if "\n" not in text else f"[{label}]\n{text}"


def _section(label: str, data: dict, is_open: bool) -> str:
    return (f"<details{' open' if is_open else ''} style='{STYLE}'>"
            f"<summary><b>{html.escape(label)}</b></summary>{_inner_html(data)}</details>")


def _label(rank) -> str:
    return "all ranks" if rank is None else f"rank {rank}"


def show_blocks(blocks: list[tuple], world_size: int) -> None:
    """Show ``[(rank or None for all ranks, bundle), ...]`` as labelled blocks:
    simple bundles together in one output, others each after a label."""
    simple = [(r, b) for r, b in blocks if set(b["data"]) <= SIMPLE]
    if simple:
        texts = [_plain(_label(r), b["data"].get("text/plain", "")) for r, b in simple]
        sections = [_section(_label(r), b["data"], r in (None, 0) or world_size <= OPEN_UP_TO)
                    for r, b in simple]
        _publish({"text/plain": "\n".join(texts), "text/html": "".join(sections)})
    for r, b in blocks:
        if set(b["data"]) <= SIMPLE:
            continue
        _publish({"text/plain": f"[{_label(r)}]",
                  "text/html": f"<div style='{STYLE}'><b>{_label(r)}</b></div>"})
        _publish(b["data"], b.get("metadata"))


def show_values(values: list, world_size: int) -> None:
    """Each rank's last-expression bundle (None: nothing to show for that rank)."""
    shown = [(r, b) for r, b in enumerate(values) if b is not None]
    if not shown:
        return
    first = shown[0][1]["data"]
    if len(shown) == world_size > 1 and all(b["data"] == first for _, b in shown):
        show_blocks([(None, shown[0][1])], world_size)
    else:
        show_blocks(shown, world_size)


def show_display(rank: int, payload: dict, world_size: int, shown_ranks=None) -> None:
    """A display object made on ``rank`` during a job (``display(obj)`` there)."""
    if shown_ranks is not None and rank not in shown_ranks:
        return
    try:
        from IPython import get_ipython
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:  # a script: print the text form
        print(_plain(_label(rank), payload["data"].get("text/plain", "")))
        return
    show_blocks([(rank, payload)], world_size)
