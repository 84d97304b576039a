"""The layers of docs/architecture.md, read from the import graph: nothing imports upward.

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

# Every module, bottom to top. Peers share a level and may import each other. A module that is
# not listed has no layer and fails the test: add it here, at the level it belongs to.
MODULES = {
    0: {"ddplab.contracts": ["", "clock", "protocols"],
        "ddplab.cluster": ["", "answers", "backend", "cluster", "diagnosis", "errors", "generations",
                           "gpu_facts", "gpu_locks", "gpus", "launchers", "lifecycle", "observed", "observed_work",
                           "output",
                           "process", "progress", "rendezvous", "resources", "results", "status",
                           "subset", "torchrun", "worker", "wrapped"]},
    1: {"ddplab.netsim": ["", "costmodel", "link", "simulated"]},
    2: {"ddplab.timeline": ["", "clock", "cuda_events", "metrics", "on_group", "op_bytes", "recorder", "records",
                           "trace"]},
    3: {"ddplab.sync": ["", "_common", "bucket", "bucketed", "comm", "comm_hooks", "ddp_trace",
                        "layout", "links", "manual", "overlap", "registry", "sharded_rows", "sparse", "unused", "yours",
                        "unused_policy"],
        "ddplab.sync.core": ["", "average", "bucketed", "fsdp", "overlap", "sharded_optimizer"]},
    4: {"ddplab.measure": ["", "compare", "fits", "models", "profile", "recording", "recording_end", "recording_layout", "report", "runners", "spec",
                           "memory",
                           "sweep", "transformer", "whatif", "workload"]},
    5: {"ddplab.lessons": ["", "checkpoints", "claims", "common", "compression", "data",
                           "firstgroup", "hangs", "pipeline", "reducer_map", "ring", "sharding", "training",
                           "yourmodel"]},
    6: {"ddplab.widgets": ["", "compare", "demo", "gantt", "html", "live", "panel", "scaling",
                           "sweep", "memory"]},
    7: {"ddplab.checks": ["", "compression", "data", "firstgroup", "fsdp", "graders", "hangs", "mistakes", "on_rank",
                          "pipeline", "reducer_map", "ring", "sharding", "watch", "workload", "yourmodel"]},
    # the front doors: they may use everything below
    8: {"ddplab.notebook": ["", "completion", "ddpcell", "export", "magics", "rankview", "sbatch"],
        "ddplab.course": ["", "accounts", "classroom", "classroom_readme", "exercises", "handouts", "hubconfig",
                          "proxy_guard", "safety", "slurmhub",
                          "labsetup", "seats"],
        "ddplab.cli": ["", "compare", "doctor", "view"],
        "ddplab": ["", "__main__", "_moved"]},
}
LAYERS = {f"{pkg}.{m}" if m else pkg: level
          for level, packages in MODULES.items() for pkg, mods in packages.items() for m in mods}


def layer_of(module: str) -> int:
    if module in LAYERS:
        return LAYERS[module]
    raise AssertionError(f"{module} has no layer: add it to MODULES in tests/test_layers.py "
                         "(and to docs/architecture.md)")


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


def modules_without_a_layer(package: Path) -> list[str]:
    return [module_name(p) for p in sorted(package.rglob("*.py")) if module_name(p) not in LAYERS]


def test_every_module_has_a_layer():
    missing = modules_without_a_layer(PACKAGE)
    assert missing == [], f"modules with no layer (add them to MODULES): {missing}"


def test_a_module_without_a_layer_fails(tmp_path, monkeypatch):
    with pytest.raises(AssertionError, match="has no layer"):
        layer_of("ddplab.sync.brand_new")
    with pytest.raises(AssertionError, match="has no layer"):
        layer_of("ddplab.newtop")
    # A new file in a copy of the package: the listing test names it, nothing catches it.
    for known in ("ddplab/__init__.py", "ddplab/sync/__init__.py", "ddplab/sync/comm.py"):
        (tmp_path / known).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / known).write_text("")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert modules_without_a_layer(tmp_path / "ddplab") == []
    (tmp_path / "ddplab" / "sync" / "brand_new.py").write_text("from . import comm\n")
    (tmp_path / "ddplab" / "newtop.py").write_text("")
    assert modules_without_a_layer(tmp_path / "ddplab") == ["ddplab.newtop", "ddplab.sync.brand_new"]
    with pytest.raises(AssertionError, match="ddplab.sync.brand_new has no layer"):
        upward_imports([tmp_path / "ddplab" / "sync" / "brand_new.py"])


def test_no_module_imports_private_names_of_another():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_name(path)
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if not target.startswith("ddplab") or target == me:
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {target}.{a.name}")
    assert bad == [], bad


def test_the_graph_reader_catches_an_upward_import(tmp_path, monkeypatch):
    # the checker itself must fail where the old code did (netsim imported sync)
    source = "def f():\n    from ..sync import comm\n    from ..timeline.clock import now\n"
    probe = tmp_path / "ddplab" / "netsim" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(source)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(LAYERS, "ddplab.netsim.probe", LAYERS["ddplab.netsim"])
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
