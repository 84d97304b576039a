"""%%ddp in a real Jupyter kernel: state persists, values travel, errors show the cell's
line, and the exported script prints under torchrun what the notebook printed.

One notebook is executed once (nbclient, the project's own interpreter as the
kernel) and each test reads the outputs of the cells it is about.
"""
from __future__ import annotations

import collections
import os
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

import ddplab

# `%load_ext ddplab` once ddplab/__init__.py re-exports load_ipython_extension.
EXT = "ddplab" if hasattr(ddplab, "load_ipython_extension") else "ddplab.notebook.magics"

CELLS = [
    # 0: the kernel must be this interpreter (the project's venv), not whatever python is on PATH
    f"import sys, torch\nassert sys.prefix == {sys.prefix!r}, sys.prefix\n%load_ext {EXT}",
    "%ddp_start 2 --timeout 30",
    "%ddp_start 2",
    # 3-6: state built across cells, plus pushed values; these are exported
    "%%ddp\nimport torch\nimport torch.distributed as dist\n"
    "w = torch.full((3,), float(rank + 1))\n"
    "print('rank', rank, 'of', world_size, 'local', local_rank, 'on', device)",
    "%%ddp\ndist.all_reduce(w)\nprint('sum', w.tolist())",
    "lr = 0.25\ntable = torch.arange(6.0).reshape(2, 3)\nbig = torch.linspace(0, 1, 1000)\n"
    "%ddp_push lr table big",
    "%%ddp\nw = w * lr\nprint('pushed', lr * 4, table.sum().item(), round(big.sum().item(), 3))\n"
    "print('scaled', w.tolist())",
    "back = %ddp_pull table\nws = %ddp_pull w\nranks = %ddp_pull rank\n"
    "assert all(torch.equal(b, table) for b in back) and ranks == [0, 1], (back, ranks)\n"
    "print('pulled', [t.tolist() for t in ws])",
    "%ddp_export exported.py",
    # 9-: after the export
    "%%ddp --ranks 0\nseen = rank\nprint('shown for rank', rank)",
    "%%ddp\nx = 1\nif rank == 1:\n    boom = {'a': 1}['missing on rank 1']",
    "%%ddp\nprint('kept', w.tolist())",
    "seen = %ddp_pull seen\nprint('seen', seen)",
    # 13: rank 0 waits in a barrier that rank 1 never reaches: the ranks are replaced
    "%%ddp\nif rank == 1:\n    raise RuntimeError('rank 1 gives up')\ndist.barrier()",
    "%%ddp\nprint('fresh', rank, local_rank, world_size, device, 'w' in globals())",
    "%ddp_export after.py",
    "%%ddp\nif rank == 0:\n    y = (",  # 16: does not compile; never sent to the ranks
    "%ddp_stop",
    "%ddp_stop",
]
RAISES = {10, 13, 16}
EXPORTED = (3, 4, 6)  # the %%ddp cells that exported.py holds


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("nb")
    nb = nbformat.v4.new_notebook()
    for i, src in enumerate(CELLS):
        cell = nbformat.v4.new_code_cell(src)
        if i in RAISES:
            cell.metadata["tags"] = ["raises-exception"]  # nbclient carries on after these
        nb.cells.append(cell)
    NotebookClient(nb, kernel_name="python3", timeout=120,
                   resources={"metadata": {"path": str(workdir)}}).execute()
    return nb, workdir


def stdout(nb, i: int) -> str:
    return "".join(o.get("text", "") for o in nb.cells[i].outputs
                   if o.output_type == "stream" and o.name == "stdout")


def by_rank(text: str) -> dict[int, list[str]]:
    """'[rank r] line' lines grouped by rank, in order (ranks interleave freely)."""
    lines = collections.defaultdict(list)
    for line in text.splitlines():
        if line.startswith("[rank "):
            head, _, rest = line.partition("] ")
            lines[int(head[len("[rank "):])].append(rest)
    return dict(lines)


def error(nb, i: int):
    return next(o for o in nb.cells[i].outputs if o.output_type == "error")


@pytest.mark.slow
def test_start_on_a_running_cluster_says_so_and_keeps_it(notebook):
    nb, _ = notebook
    first, again = stdout(nb, 1), stdout(nb, 2)
    assert "2 ranks ready (gloo" in first
    pids = first.split("pids ", 1)[1].split("]", 1)[0] + "]"
    assert "already running" in again and pids in again


@pytest.mark.slow
def test_state_persists_across_cells(notebook):
    nb, _ = notebook
    assert by_rank(stdout(nb, 3)) == {r: [f"rank {r} of 2 local {r} on cpu"] for r in (0, 1)}
    assert by_rank(stdout(nb, 4)) == {r: ["sum [3.0, 3.0, 3.0]"] for r in (0, 1)}
    assert by_rank(stdout(nb, 11)) == {r: ["kept [0.75, 0.75, 0.75]"] for r in (0, 1)}


@pytest.mark.slow
def test_push_pull_round_trip(notebook):
    nb, _ = notebook
    assert by_rank(stdout(nb, 6)) == {r: ["pushed 1.0 15.0 500.0", "scaled [0.75, 0.75, 0.75]"]
                                      for r in (0, 1)}
    assert "pulled [[0.75, 0.75, 0.75], [0.75, 0.75, 0.75]]" in stdout(nb, 7)  # asserts ran there too


@pytest.mark.slow
def test_ranks_option_filters_output_but_every_rank_runs(notebook):
    nb, _ = notebook
    assert by_rank(stdout(nb, 9)) == {0: ["shown for rank 0"]}
    assert "seen [0, 1]" in stdout(nb, 12)


@pytest.mark.slow
def test_an_error_shows_the_cells_own_line(notebook):
    nb, _ = notebook
    err = error(nb, 10)
    text = "\n".join(err.traceback)
    assert err.ename == "RankError" and "rank 1 raised KeyError" in err.evalue
    # Line 4 as the notebook's editor counts it, the %%ddp line being line 1.
    assert f'File "<ddp-cell-{nb.cells[10].execution_count}>", line 4' in text  # named after In[n]
    assert "boom = {'a': 1}['missing on rank 1']" in text
    assert "magics.py" not in text  # the kernel's own frames are not shown


@pytest.mark.slow
def test_replaced_ranks_start_a_fresh_namespace_and_recording(notebook):
    nb, workdir = notebook
    err = error(nb, 13)
    assert "rank 1 gives up" in err.evalue and "replaced" in err.evalue
    assert by_rank(stdout(nb, 14)) == {r: [f"fresh {r} {r} 2 cpu False"] for r in (0, 1)}
    after = (workdir / "after.py").read_text()
    assert "'fresh'" in after and "all_reduce" not in after  # only what the new ranks ran
    assert "No cluster is running." in stdout(nb, 18)


@pytest.mark.slow
def test_a_syntax_error_is_caught_in_the_kernel(notebook):
    nb, _ = notebook
    text = "".join(o.get("text", "") for o in nb.cells[16].outputs)
    assert "not sent to the ranks" in text and "line 3" in text and "SyntaxError" in text


@pytest.mark.slow
@pytest.mark.more
def test_export_runs_under_torchrun_with_the_notebooks_output(notebook):
    nb, workdir = notebook
    script = (workdir / "exported.py").read_text()
    assert "ddplab.init_from_env(" in script and "torchrun --nproc-per-node=2" in script
    assert (workdir / "exported.pushed.pt").exists()  # `big` is too large to write out as code
    env = dict(os.environ, TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[rank ${rank}] ")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "--tee=3", "exported.py"],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    notebook_lines = by_rank("".join(stdout(nb, i) for i in EXPORTED))
    assert by_rank(run.stdout) == notebook_lines
