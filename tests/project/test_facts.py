"""docs/facts.md covers every markdown cell of every lab and every glossary and question-map row,
and each claim's source is real: a line of a file the installed torch wheel ships (with the
text found there), a v2.13.0 URL of torch's repository with a line number, a lab cell that
checks it (a code cell that exists), or a test that exists. Budget: a few seconds, no ranks.
"""
import functools
import json
import pathlib
import re
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
FACTS = ROOT / "docs" / "facts.md"
TORCH = pathlib.Path(torch.__file__).resolve().parent  # .../site-packages/torch
NO_CLAIM = "(no claim"

WHEEL = re.compile(r"`(torch/[^`#\s]+)#L(\d+)`\s*«([^»]+)»")
URL = re.compile(r"https://github\.com/pytorch/pytorch/blob/([^/\s]+)/([^#\s)]+)#L(\d+)")
CELL = re.compile(r"\bcheck (\d\d|tour):([\w-]+)")
TEST = re.compile(r"\btest (tests/[\w/]+\.py)::(\w+)")


def _table_rows(lines):
    """The body rows of the markdown tables in ``lines``: lists of stripped cells."""
    rows = []
    for line in lines:
        if not line.startswith("|") or re.match(r"^\|\s*-", line):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows.append(cells)
    return rows


def _sections(text):
    """{heading: [lines]} for the level-2 and level-3 headings of ``text``."""
    out, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^#{2,3} (.+)$", line)
        if m:
            current = m.group(1).strip()
            out[current] = []
        elif current:
            out[current].append(line)
    return out


def facts_rows():
    """(section, where, claim, sources) for every row of docs/facts.md (header rows dropped)."""
    rows = []
    for section, lines in _sections(FACTS.read_text()).items():
        for cells in _table_rows(lines):
            if len(cells) != 3 or cells[0] in ("cell", "row", "file", "where"):
                continue
            rows.append((section, *cells))
    return rows


@functools.lru_cache(maxsize=None)
def _cells(path):
    """[(cell id, cell type)] of a notebook (plain JSON: nbformat's validation is slow)."""
    return [(c["id"], c["cell_type"]) for c in json.loads(pathlib.Path(path).read_text())["cells"]]


def _notebook(key):
    name = "tour.ipynb" if key == "tour" else next(p.name for p in (ROOT / "labs").glob(f"{key}-*.ipynb"))
    return _cells(str(ROOT / "labs" / name))


def _readme_first_column(heading_re):
    """First-column texts of the tables under the level-2 heading matching ``heading_re``."""
    text = (ROOT / "labs" / "README.md").read_text()
    keep, lines = False, []
    for line in text.splitlines():
        if line.startswith("## "):
            keep = bool(re.match(heading_re, line[3:]))
        elif keep:
            lines.append(line)
    return [cells[0] for cells in _table_rows(lines)
            if cells[0] not in ("term", "question, in our words", "claim, in our words")]


def test_every_markdown_cell_of_every_lab_has_its_rows():
    listed = {(s, w) for s, w, _, _ in facts_rows()}
    for path in sorted((ROOT / "labs").glob("*.ipynb")):
        for cell_id, kind in _cells(str(path)):
            if kind == "markdown":
                assert (f"labs/{path.name}", cell_id) in listed, f"docs/facts.md: no row for {path.name} {cell_id}"


def test_every_glossary_and_question_map_row_has_its_row():
    listed = {(s, w) for s, w, _, _ in facts_rows()}
    for term in _readme_first_column(r"Glossary"):
        assert ("labs/README.md glossary", term) in listed, f"docs/facts.md: no row for the glossary's {term!r}"
    for claim in _readme_first_column(r"Question map"):
        assert ("labs/README.md question map", claim) in listed, \
            f"docs/facts.md: no row for the question map's {claim!r}"


def test_lab_rows_name_cells_that_exist():
    for section, where, _, _ in facts_rows():
        if section.startswith("labs/") and section.endswith(".ipynb"):
            ids = {cell_id for cell_id, _ in _cells(str(ROOT / section))}
            assert where in ids, f"docs/facts.md: {section} has no cell {where}"


def test_every_claim_has_a_source_that_is_real():
    rows = facts_rows()
    assert len(rows) > 150
    for section, where, claim, sources in rows:
        label = f"docs/facts.md, {section} / {where}: "
        if claim.startswith(NO_CLAIM):
            assert sources == "-", label + "a row without a claim has no source"
            continue
        found = 0
        for path, line, text in WHEEL.findall(sources):
            f = TORCH.parent / path
            assert f.is_file(), label + f"{path} is not in the installed torch wheel"
            lines = f.read_text(errors="replace").splitlines()
            near = "\n".join(lines[max(0, int(line) - 3):int(line) + 2])
            assert text.strip() in near, label + f"{path}#L{line} does not show {text!r}"
            found += 1
        for tag, path, _line in URL.findall(sources):
            assert tag == "v2.13.0", label + f"{path} must be read at v2.13.0, not {tag}"
            assert not (TORCH.parent / path).is_file(), label + f"{path} ships in the wheel: cite it there"
            found += 1
        for key, cell_id in CELL.findall(sources):
            cells = dict(_notebook(key))
            assert cells.get(cell_id) == "code", \
                label + f"no code cell {cell_id} in lab {key}"
            found += 1
        for path, name in TEST.findall(sources):
            assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), \
                label + f"no {name} in {path}"
            found += 1
        assert found, label + f"no source: {sources!r}"


@pytest.mark.parametrize("bad", ["`torch/nn/parallel/distributed.py#L1` «no such text»",
                                 "https://github.com/pytorch/pytorch/blob/main/x.cpp#L3",
                                 "check 06:no-such-cell", "see the docs"])
def test_a_wrong_source_fails(tmp_path, monkeypatch, bad):
    fake = tmp_path / "facts.md"
    fake.write_text("### labs/README.md glossary\n\n| row | claim | source or check |\n|---|---|---|\n"
                    f"| rank | a claim | {bad} |\n" + "| x | y | check 00:cell-04 |\n" * 151)
    monkeypatch.setattr(sys.modules[__name__], "FACTS", fake)
    with pytest.raises(AssertionError):
        test_every_claim_has_a_source_that_is_real()
