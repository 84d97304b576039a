"""The rooms and layers of docs/architecture.md, read from the import graph.

Every ``import`` in every ddplab module (at the top or inside a function) is
resolved to the ddplab module it names and given that module's layer. The tests
fail, naming the file and line, on an import of a higher layer (``import ddplab``
itself is the front door, the top layer), on a module without a layer, on an
import circle, on another module's private name imported or reached as an
attribute, and on a module over the code-line cap.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ddplab"
HERE = "tests/project/test_layers.py"

# Every module, bottom to top. Modules of one level may import each other, but never in a circle
# (test_no_import_cycles). A module that is not listed has no layer and fails the test: add it
# here, at the level it belongs to.
MODULES = {
    # the bottom rooms: the clock and contracts, the observing process group, where ranks run
    0: {"ddplab.contracts": ["", "clock", "pristine", "protocols"],
        "ddplab.pg": ["", "backend", "group", "inner", "p2p_blocks", "p2p_watch", "works"],
        "ddplab.placement": ["", "gpu_facts", "gpu_locks", "gpus", "resources"]},
    1: {"ddplab.netsim": ["", "costmodel", "link", "simulated"]},
    2: {"ddplab.timeline": ["", "clock", "cuda_events", "metrics", "on_group", "op_bytes", "recorder", "records",
                           "trace"]},
    3: {"ddplab.sync": ["", "bucket", "bucketed", "comm", "comm_hooks", "ddp_trace", "fsdp_overlap", "layout", "links",
                        "manual", "overlap", "registry", "sparse", "sparse_gather", "unused", "unused_policy",
                        "wrapper_duties", "your_code"],
        "ddplab.sync.core": ["", "average", "bucketed", "fsdp", "overlap", "sharded_optimizer", "zero2"]},
    # the rank processes and their Cluster, and joining a group someone else started: nothing
    # below this level starts ranks
    4: {"ddplab.cluster": ["", "answers", "cluster", "diagnosis", "errors", "generations", "lifecycle", "output",
                           "process", "progress", "rendezvous", "results", "status", "subset", "worker"],
        "ddplab.launchers": ["", "jobstore", "requeue", "schedulers", "stragglers", "torchrun"]},
    5: {"ddplab.measure": ["", "compare", "fits", "link", "memory", "memory_vs_ranks", "models", "profile",
                           "recording", "recording_end", "recording_fsdp", "recording_gather", "recording_hooks",
                           "recording_layout", "report", "runners", "spec", "sweep", "transformer", "whatif",
                           "workload"]},
    6: {"ddplab.lessons": ["", "checkpoints", "claims", "common", "compression", "data", "firstgroup", "hangs",
                           "fsdp_overlap", "pipeline", "reducer_map", "ring", "sharding", "training", "yourmodel"]},
    7: {"ddplab.widgets": ["", "compare", "demo", "gantt", "html", "live", "memory", "panel", "scaling", "sweep"]},
    8: {"ddplab.checks": ["", "compression", "data", "firstgroup", "fsdp", "fsdp_hooks", "graders", "hangs",
                          "mistakes", "on_rank", "pipeline", "reducer_map", "ring", "sharding", "watch", "workload",
                          "yourmodel"]},
    # the front doors: they may use everything below
    9: {"ddplab.notebook": ["", "completion", "ddpcell", "export", "magics", "rankview", "sbatch"],
        "ddplab.course": ["", "accounts", "capacity", "classroom", "classroom_readme", "exchange_guard", "exercises",
                          "gradebox", "gpu_nodes", "handouts", "hubconfig", "labsetup", "limits", "logins",
                          "private_tmp", "proxy_guard", "safety", "seats", "slurmhub", "teardown"],
        "ddplab.cli": ["", "compare", "doctor", "link", "view"],
        "ddplab": ["", "__main__", "integrations"]},  # `import ddplab` / `from ddplab import X`: the front door
}
LAYERS = {f"{pkg}.{m}" if m else pkg: level
          for level, packages in MODULES.items() for pkg, mods in packages.items() for m in mods}


def layer_of(module: str) -> int:
    if module in LAYERS:
        return LAYERS[module]
    raise AssertionError(f"{module} has no layer: add it to MODULES in tests/project/test_layers.py "
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
    """Every import of a higher layer, and every module without a layer, as findings (all of them,
    not only the first)."""
    bad = []
    for path in files:
        me = module_name(path)
        if me not in LAYERS:
            bad.append(f"{path.relative_to(ROOT)}: {me} has no layer: add it to MODULES in {HERE}")
            continue
        for line, target in imported_modules(path):
            if target.split(".")[0] != "ddplab" or me == "ddplab" or target == me:
                continue  # torch, stdlib; the package's own __init__ is the front door
            if target not in LAYERS:
                bad.append(f"{path.relative_to(ROOT)}:{line} {me} imports {target}, which has no layer")
            elif LAYERS[target] > LAYERS[me]:
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
    assert upward_imports([tmp_path / "ddplab" / "sync" / "brand_new.py"]) == [
        f"ddplab/sync/brand_new.py: ddplab.sync.brand_new has no layer: add it to MODULES in {HERE}"]


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
    monkeypatch.setitem(LAYERS, "ddplab.sync.comm", LAYERS["ddplab.sync"])
    monkeypatch.setitem(LAYERS, "ddplab.timeline.clock", LAYERS["ddplab.timeline"])
    for sub in ("sync", "timeline"):
        (tmp_path / "ddplab" / sub).mkdir()
    (tmp_path / "ddplab" / "sync" / "comm.py").write_text("")
    (tmp_path / "ddplab" / "timeline" / "clock.py").write_text("")
    found = upward_imports([probe])
    assert len(found) == 2 and "imports ddplab.sync.comm" in found[0]


CODE_LINES_CAP = 400  # a whole idea stays whole; a module above it holds two


def code_lines(source: str) -> int:
    """Lines of code: not blank, not a comment alone, not inside a docstring (a module's,
    class's or function's docstring teaches; it is not what makes a module hard to hold)."""
    tree = ast.parse(source)
    doc_lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for n, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and n not in doc_lines)


def test_code_lines_leave_out_docstrings_comments_and_blank_lines():
    source = '"""Module.\n\nTeaches a lot.\n"""\nimport os\n\n# why\n\ndef f():\n    """Doc."""\n    return os.sep\n'
    assert code_lines(source) == 3


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_one_idea(path):
    n = code_lines(path.read_text(encoding="utf-8"))
    assert n <= CODE_LINES_CAP, (f"{path.relative_to(ROOT)} has {n} lines of code (cap {CODE_LINES_CAP}, "
                                 "docstrings and comments not counted): it holds two ideas, split it")


WHERE_IMPORTED: dict = {}  # (importer, imported) -> "file:line", for the cycle test's message


def import_graph(files) -> dict[str, set[str]]:
    """Module -> the ddplab (or tools) modules it imports, at the top or inside a function."""
    graph = {}
    for path in files:
        me = module_name(path)
        graph[me] = set()
        for line, t in imported_modules(path):
            # a tool imports its neighbours by their bare names (tools/ is on its sys.path)
            if me.startswith("tools.") and (path.parent / f"{t}.py").exists():
                t = f"tools.{t}"
            if t.split(".")[0] in ("ddplab", "tools") and t not in (me, "ddplab"):
                graph[me].add(t)
                WHERE_IMPORTED.setdefault((me, t), f"{path.relative_to(ROOT)}:{line}")
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected sets of two or more modules (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "tools").glob("*.py"))
    graph = import_graph(files)
    found = cycles(graph)
    edges = [f"{WHERE_IMPORTED[(a, b)]} {a} imports {b}"
             for circle in found for a in circle for b in sorted(graph[a]) if b in circle]
    assert found == [], "modules that import each other (move the name they share down a room):\n" + "\n".join(edges)


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def private_attributes_reached(path: Path) -> list[str]:
    """``module._name`` where ``module`` is another ddplab module bound by an import."""
    me = module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("ddplab") and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{target}.{a.name}"
                as_file = ROOT / Path(*sub.split("."))
                if target.startswith("ddplab") and (as_file.with_suffix(".py").exists() or as_file.is_dir()):
                    aliases[a.asname or a.name] = sub
        if isinstance(node, ast.Import) and any(a.name.startswith("ddplab") and not a.asname for a in node.names):
            aliases["ddplab"] = "ddplab"  # `import ddplab.checks.graders` binds the name ddplab

    def module_of(expr):
        """The ddplab module an expression names (``graders``, ``ddplab.checks.graders``,
        ``checks.graders``), or None."""
        if isinstance(expr, ast.Name):
            return aliases.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = module_of(expr.value)
            if base is None:
                return None
            sub = ROOT / Path(*f"{base}.{expr.attr}".split("."))
            return f"{base}.{expr.attr}" if sub.with_suffix(".py").exists() or sub.is_dir() else None
        return None

    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = module_of(node.value)
            if owner is not None and owner != me:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} reaches {owner}.{node.attr}")
    return bad


def test_no_module_reaches_private_names_of_another_as_attributes():
    bad = [b for path in sorted(PACKAGE.rglob("*.py")) for b in private_attributes_reached(path)]
    assert bad == [], bad


def test_the_attribute_check_catches_a_private_name(tmp_path, monkeypatch):
    for known in ("ddplab/__init__.py", "ddplab/checks/__init__.py", "ddplab/checks/graders.py"):
        (tmp_path / known).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / known).write_text("")
    probe = tmp_path / "ddplab" / "checks" / "ring.py"
    probe.write_text("from ddplab.checks import graders\n\ndef f():\n    return graders._secret\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert private_attributes_reached(probe) == ["ddplab/checks/ring.py:4 reaches ddplab.checks.graders._secret"]
    for source in ("import ddplab.checks.graders\n\n\nddplab.checks.graders._secret\n",
                   "from ddplab import checks\n\n\nchecks.graders._secret\n",
                   "import ddplab.checks.graders as g\n\n\ng._secret\n"):
        probe.write_text(source)
        assert private_attributes_reached(probe) == ["ddplab/checks/ring.py:4 reaches ddplab.checks.graders._secret"]


def test_no_public_name_is_hidden_by_a_room_of_the_same_name():
    # `import ddplab.launch.x` would set the attribute ddplab.launch to the subpackage, hiding the
    # function ddplab.launch: a room may never take the name of a public function
    import types

    import ddplab

    hidden = [name for name in ddplab.__all__ if isinstance(getattr(ddplab, name), types.ModuleType)]
    assert hidden == [], f"public names that are modules, not what the docs promise: {hidden}"
