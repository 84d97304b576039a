"""The layers of DESIGN.md, read from the import graph: nothing imports upward.

Every ``import`` in every ddplab module (at the top or inside a function) is
resolved to the ddplab module it names and given that module's layer; an
import of a higher layer fails the test, naming the file and line.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ddplab"

# Bottom to top. Peers share a number and may import each other.
LAYERS = [
    ("ddplab.clock", 0), ("ddplab.protocols", 0), ("ddplab.cluster", 0), ("ddplab.torchrun", 0),
    ("ddplab.labsetup", 0),
    ("ddplab.netsim", 1),
    ("ddplab.timeline", 2),
    ("ddplab.sync", 3), ("ddplab.strategies", 3),
    ("ddplab.experiments", 4),
    ("ddplab.widgets", 5),
    # the front doors: they may use everything below
    ("ddplab.cli", 6), ("ddplab.magics", 6), ("ddplab.export", 6), ("ddplab.doctor", 6),
    ("ddplab.checks", 6), ("ddplab.__main__", 6), ("ddplab", 6),
]


def layer_of(module: str) -> int:
    for prefix, level in LAYERS:  # the longest prefixes come before "ddplab"
        if module == prefix or module.startswith(prefix + "."):
            return level
    raise AssertionError(f"{module} has no layer: add it to LAYERS (and DESIGN.md)")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path):
    """(line, ddplab module) for every import in ``path``."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:  # "from . import comm" names a module
                sub = f"{target}.{a.name}"
                as_file = ROOT / Path(*sub.split("."))
                yield node.lineno, sub if (as_file.with_suffix(".py").exists() or as_file.is_dir()) else target


def upward_imports(files) -> list[str]:
    bad = []
    for path in files:
        me = module_name(path)
        for line, target in imported_modules(path):
            if target.split(".")[0] != "ddplab" or target == "ddplab":
                continue  # torch, stdlib; "ddplab" alone is the package (always loaded first)
            if layer_of(target) > layer_of(me):
                bad.append(f"{path.relative_to(ROOT)}:{line} {me} imports {target} (a higher layer)")
    return bad


def test_nothing_in_ddplab_imports_upward():
    assert upward_imports(sorted(PACKAGE.rglob("*.py"))) == []


def test_the_graph_reader_catches_an_upward_import(tmp_path, monkeypatch):
    # the checker itself must fail where the old code did (netsim imported sync)
    source = "def f():\n    from ..sync import comm\n    from ..timeline.clock import now\n"
    probe = tmp_path / "ddplab" / "netsim" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(source)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    for sub in ("sync", "timeline"):
        (tmp_path / "ddplab" / sub).mkdir()
    (tmp_path / "ddplab" / "sync" / "comm.py").write_text("")
    (tmp_path / "ddplab" / "timeline" / "clock.py").write_text("")
    found = upward_imports([probe])
    assert len(found) == 2 and "imports ddplab.sync.comm" in found[0]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_small(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= 320, f"{path.relative_to(ROOT)} has {lines} lines: split it (one idea per module)"
