"""%%ddp cells feel like ordinary cells, in a real Jupyter kernel: each rank's last
value, `;`, tracebacks on the cell's lines, tqdm as one updating line per rank, a
plotly figure from rank 1, %ddp_status, and `--on 0` refusing a collective at once.

One notebook runs once through nbclient (the saved outputs are what a learner's
notebook keeps); every kernel message is recorded too, to see updates in place
and to time cells.
"""
from __future__ import annotations

import collections
import datetime
import pickle
import sys
import threading
import time

import nbformat
import pytest
from nbclient import NotebookClient

import ddplab
from ddplab.cluster import progress
from ddplab.notebook import ddpcell

CELLS = [
    f"import sys\nassert sys.prefix == {sys.prefix!r}, sys.prefix\n%load_ext ddplab",
    "%ddp_start 2 --timeout 30",
    # 2: values that differ between ranks: one block per rank, rank 0 first
    "%%ddp\nimport time, threading\nimport torch, torch.distributed as dist\n"
    "w = torch.full((2,), float(rank + 1))\nw.sum()",
    "%%ddp\nworld_size * 21",  # 3: the same on every rank: shown once
    "%%ddp\nworld_size * 21;",  # 4: suppressed
    "%%ddp\nlock = threading.Lock()\nlock",  # 5: cannot be pickled: its repr comes back
    "%%ddp\na = 1\nb = {'x': 1}\nb[f'rank {rank}']",  # 6: the last expression raises, line 4
    # 7: a tqdm bar on each rank
    "%%ddp\nfrom tqdm import tqdm\nfor _ in tqdm(range(20), mininterval=0):\n    time.sleep(0.05)",
    # 8: a figure and an HTML object made on the ranks, shown from rank 1 / rank 0
    "%%ddp\nimport plotly.graph_objects as go\nfrom IPython.display import HTML, display\n"
    "fig = go.Figure(go.Bar(x=['a', 'b', 'c'], y=[10 * rank + 1, 10 * rank + 2, 10 * rank + 3]))\n"
    "if rank == 1:\n    fig.show()\nif rank == 0:\n    display(HTML('<b>made on rank 0</b>'))\nprint('after', rank)",
    "%ddp_status",  # 9
    # 10: inspection on rank 0 only; a collective there fails at once (timeout is 30 s)
    "%%ddp --on 0\nprint('only', rank)\ndist.all_reduce(w)",
    "%%ddp --on 1\nw",  # 11: rank 1's value only
    "%%ddp\ndist.all_reduce(w)\nw",  # 12: the ranks and their group are intact
    # 13-15: a torch DDP model: its forward on rank 0 only is refused unless no backward can follow
    "%%ddp\nddp_model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))",
    "%%ddp --on 0\nddp_model(torch.ones(1, 2)).sum()",
    "%%ddp --on 0\nwith torch.no_grad():\n    out = ddp_model(torch.ones(1, 2))\nout.shape",
]
RAISES = {6, 10, 14}


class RecordingClient(NotebookClient):
    """Keeps every message each cell received, as well as the saved outputs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.messages = collections.defaultdict(list)

    def process_message(self, msg, cell, cell_index):
        self.messages[cell_index].append(msg)
        return super().process_message(msg, cell, cell_index)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cells")
    nb = nbformat.v4.new_notebook()
    for i, src in enumerate(CELLS):
        cell = nbformat.v4.new_code_cell(src)
        if i in RAISES:
            cell.metadata["tags"] = ["raises-exception"]
        nb.cells.append(cell)
    client = RecordingClient(nb, kernel_name="python3", timeout=120,
                             resources={"metadata": {"path": str(workdir)}})
    client.execute()
    return nb, client.messages


def outputs(nb, i, kind=None):
    return [o for o in nb.cells[i].outputs if kind is None or o.output_type == kind]


def plain(nb, i) -> list[str]:
    return [o.data["text/plain"] for o in outputs(nb, i, "display_data")]


@pytest.mark.slow
def test_each_ranks_last_value_is_shown_rank_0_first(run):
    nb, _ = run
    (out,) = outputs(nb, 2)
    assert out.output_type == "display_data"
    assert out.data["text/plain"] == "[rank 0] tensor(2.)\n[rank 1] tensor(4.)"
    html = out.data["text/html"]
    assert html.index("rank 0") < html.index("rank 1") and html.count("<details open") == 2


@pytest.mark.slow
def test_a_value_every_rank_agrees_on_is_shown_once(run):
    nb, _ = run
    assert plain(nb, 3) == ["[all ranks] 42"]


@pytest.mark.slow
def test_a_trailing_semicolon_suppresses_the_value(run):
    nb, _ = run
    assert outputs(nb, 4) == []


@pytest.mark.slow
def test_a_value_that_cannot_be_pickled_comes_back_as_its_repr(run):
    nb, _ = run
    with pytest.raises(TypeError):
        pickle.dumps(threading.Lock())
    (text,) = plain(nb, 5)
    assert text.startswith("[all ranks] <unlocked _thread.lock object") or (
        text.count("_thread.lock object") == 2 and "[rank 1]" in text)


@pytest.mark.slow
def test_an_error_in_the_last_expression_shows_the_cells_line(run):
    nb, _ = run
    (err,) = outputs(nb, 6, "error")
    text = "\n".join(err.traceback)
    assert f'File "<ddp-cell-{nb.cells[6].execution_count}>", line 4' in text
    assert "b[f'rank {rank}']" in text and "KeyError" in err.evalue
    assert "ddpcell.py" not in text and "run_cell" not in text  # the rank-side helper is hidden


@pytest.mark.slow
def test_tqdm_is_one_line_per_rank_updated_in_place(run):
    nb, messages = run
    saved = sorted(plain(nb, 7))  # in the order the ranks' bars first appeared
    assert len(saved) == 2, saved  # one line per rank, nothing else
    for r, line in enumerate(saved):
        assert line.startswith(f"[rank {r}] 100%|") and line.endswith("]") and "20/20" in line
        assert "\r" not in line and "\n" not in line
    assert not outputs(nb, 7, "stream")  # no stream of partial bars
    ids = {m["content"]["transient"]["display_id"]: m["content"]["data"]["text/plain"][:8]
           for m in messages[7] if m["msg_type"] == "display_data"}
    updates = collections.Counter(m["content"]["transient"]["display_id"]
                                  for m in messages[7] if m["msg_type"] == "update_display_data")
    assert sorted(ids.values()) == ["[rank 0]", "[rank 1]"]
    assert all(updates[d] >= 3 for d in ids), updates  # it moved while the loop ran


@pytest.mark.slow
def test_a_plotly_figure_and_html_made_on_ranks_appear_labelled(run):
    nb, _ = run
    outs = outputs(nb, 8)
    kinds = [("plotly" if "application/vnd.plotly.v1+json" in o.get("data", {}) else
              o.get("data", {}).get("text/plain", o.get("text", "")).strip()) for o in outs]
    fig_at = kinds.index("plotly")
    assert kinds[fig_at - 1] == "[rank 1]"  # its label right above it
    assert kinds.count("plotly") == 1  # rank 0 did not show its figure
    figure = outs[fig_at].data["application/vnd.plotly.v1+json"]
    assert figure["data"][0]["y"] == [11, 12, 13]  # rank 1's bars
    assert "[rank 0] <IPython.core.display.HTML object>" in kinds
    html = next(o.data["text/html"] for o in outs if "text/html" in o.get("data", {})
                and "made on rank 0" in o.data["text/html"])
    assert "<summary><b>rank 0</b></summary>" in html
    streams = "".join(o.text for o in outs if o.output_type == "stream")
    assert "[rank 0] after 0" in streams and "[rank 1] after 1" in streams


@pytest.mark.slow
def test_ddp_status_shows_each_rank(run):
    nb, _ = run
    # a start slower than 5 s prints progress lines first: the pids are on the "ready" line
    started = "".join(o.text for o in outputs(nb, 1, "stream"))
    pids = started.split("pids ", 1)[1].split("]", 1)[0].strip("[").split(", ")
    (out,) = outputs(nb, 9, "execute_result")
    text = out.data["text/plain"]
    assert "backend gloo" in text and "collective timeout 30 s" in text and "generation 0" in text
    rows = [line.split() for line in text.splitlines()[2:]]
    assert [row[:5] for row in rows] == [[str(r), pids[r], "yes", "cpu", row[4]] for r, row in enumerate(rows)]
    assert all(float(row[4]) > 50 for row in rows)  # host MiB: a rank holding torch
    assert all(row[-1] == "idle" for row in rows)
    assert "<table>" in out.data["text/html"]


def _seconds(messages) -> float:
    stamps = [m["header"]["date"] for m in messages]
    stamps = [datetime.datetime.fromisoformat(s) if isinstance(s, str) else s for s in stamps]
    return (max(stamps) - min(stamps)).total_seconds()


@pytest.mark.slow
def test_a_collective_on_some_ranks_fails_at_once_and_keeps_the_ranks(run):
    nb, messages = run
    (err,) = outputs(nb, 10, "error")
    assert "rank(s) [1] are not taking part" in err.evalue and "dist.all_reduce()" in err.evalue
    assert f'File "<ddp-cell-{nb.cells[10].execution_count}>", line 3' in "\n".join(err.traceback)
    assert "rank 1: not taking part" in err.evalue and "kept" in err.evalue
    assert _seconds(messages[10]) < 5  # not the 30 s collective timeout
    assert "".join(o.text for o in outputs(nb, 10, "stream")) == "[rank 0] only 0\n"
    assert plain(nb, 11) == ["[rank 1] tensor([2., 2.])"]
    assert plain(nb, 12) == ["[all ranks] tensor([3., 3.])"]  # same group, same state


# -- without a kernel ------------------------------------------------------------------------------
@pytest.mark.parametrize("cell, quiet", [
    ("x", False), ("x;", True), ("x;  # comment\n\n", True), ("x = 1;", True), ("f(';')", False),
    ("for i in y:\n    i;\nx", False), ("s = '''\n;'''", False),
])
def test_semicolon_at_the_end_is_what_ipython_means(cell, quiet):
    assert ddpcell.ends_with_semicolon(cell) is quiet


def test_compile_cell_splits_off_the_last_expression_with_the_cells_lines():
    body, last = ddpcell.compile_cell("a = 1\n\na + 1", "<t>")
    ns = {}
    assert ddpcell.run_cell(body, last, ns)["data"]["text/plain"] == "2"
    body, last = ddpcell.compile_cell("a = 1\n\na / 0", "<t>")
    with pytest.raises(ZeroDivisionError) as info:
        ddpcell.run_cell(body, last, ns)
    assert info.traceback[-1].lineno + 1 == 4  # line 4 as the editor counts, line 1 being %%ddp
    assert ddpcell.compile_cell("a = 1\na;", "<t>")[1] is None
    assert ddpcell.compile_cell("if a:\n    a", "<t>")[1] is None


def test_a_progress_line_shows_what_a_terminal_shows():
    assert progress.visible("\r 10%\r 20%") == " 20%"
    assert progress.visible("\r 20%\r") == " 20%"
    assert progress.visible("plain") == "plain"


@pytest.mark.slow
def test_cluster_status_sees_a_running_job_from_another_thread():
    with ddplab.Cluster(2, timeout=30) as cluster:
        done = threading.Event()
        worker = threading.Thread(target=lambda: (cluster.run(time.sleep, 2.0), done.set()))
        worker.start()
        deadline = time.monotonic() + 10
        seen = None
        while time.monotonic() < deadline and not done.is_set():
            st = cluster.status()
            if all(r["job"].startswith("running job") for r in st.ranks):
                seen = st
                break
            time.sleep(0.05)
        worker.join()
        assert seen is not None, "status never showed the job running"
        assert "(sleep)" in seen.ranks[0]["job"]
        after = cluster.status()
        assert [r["job"] for r in after.ranks] == ["idle", "idle"]
        assert [r["pid"] for r in after.ranks] == cluster.pids and after.generation == 0
        assert all(r["device"] == "cpu" and r["host_mib"] > 50 for r in after.ranks)
    assert "shut down" in repr(cluster.status())


@pytest.mark.slow
def test_run_job_on_some_ranks_returns_none_for_the_others():
    with ddplab.Cluster(2, timeout=30) as cluster:
        assert cluster.run_job(lambda: "here", ranks=[1]) == [None, "here"]
        with pytest.raises(ValueError, match="do not exist"):
            cluster.run_job(lambda: 1, ranks=[2])


@pytest.mark.slow
@pytest.mark.more
def test_tab_and_inspect_in_a_ddp_cell_ask_rank_0_and_put_nothing_in_the_kernel():
    from _kernel import execute, running_kernel

    with running_kernel() as (_, kc):
        assert execute(kc, "%load_ext ddplab\n%ddp_start 2")["status"] == "ok"
        cell = ("%%ddp\nimport torch\nmodel = torch.nn.Linear(2, 2)\n"
                "def shard_rows(x, parts):\n    '''Split x into `parts` row blocks, one per rank.'''\n"
                "    return x.chunk(parts)\nsecret_of_the_ranks = 7")
        assert execute(kc, cell)["status"] == "ok"

        def complete(code):
            return kc.complete(code, len(code), reply=True, timeout=30)["content"]

        got = complete("%%ddp\nsecret_of")
        assert got["matches"] == ["secret_of_the_ranks"]
        assert got["cursor_start"] == len("%%ddp\n")
        assert "model.weight" in complete("%%ddp\nx = 1\nmodel.we")["matches"]
        assert "secret_of_the_ranks" not in complete("secret_of")["matches"]  # not a %%ddp cell
        code = "%%ddp\nshard_rows(w, 2)"
        info = kc.inspect(code, len("%%ddp\nshard_ro"), reply=True, timeout=30)["content"]
        assert info["found"] and "Split x into `parts` row blocks" in info["data"]["text/plain"]
        assert "shard_rows(x, parts)" in info["data"]["text/plain"]
        reply = kc.execute_interactive("%%ddp\nshard_rows?", timeout=30)["content"]
        pages = [p["data"]["text/plain"] for p in reply.get("payload", []) if p.get("source") == "page"]
        assert pages and "one per rank" in pages[0]
        # nothing was defined in the learner's kernel
        check = execute(kc, "print(sorted(n for n in ('model', 'shard_rows', 'secret_of_the_ranks') "
                            "if n in globals()))")
        assert check["stdout"].strip() == "[]"
        execute(kc, "%ddp_stop")


def test_export_prints_a_cells_last_value_and_keeps_on_cells_to_their_ranks(capsys):
    from ddplab.notebook.export import Cell, _script_source

    cell = Cell("<ddp-cell-3>", 'doc = """\n  kept as is\n"""\nif doc:\n    n = 2\nn * rank', "--on 1")
    code = _script_source(cell)
    for rank in (0, 1):
        ns = {"rank": rank}
        exec(code, ns)
        assert ("doc" in ns) is (rank == 1)
        if rank == 1:
            assert ns["doc"] == "\n  kept as is\n"  # not indented by the `if rank in (1,):`
    assert capsys.readouterr().out == "2\n"  # rank 1's value, as the notebook showed it
    assert _script_source(Cell("<c>", "x = 1\nx;", "")) == "x = 1\nx;"  # `;`: nothing shown
    assert _script_source(Cell("<c>", "print(1)", "")) == "print(1)"


def test_a_progress_bar_outside_jupyter_prints_only_its_final_line(capsys):
    from ddplab.cluster.output import RankOutput

    out = RankOutput()
    for chunk in (b"\r  0%|          | 0/3", b"\r 33%|###", b"       | 1/3\r 67%|######    | 2/3",
                  b"\r100%|##########| 3/3\n", b"done\n"):
        out.add(1, "stderr", chunk)
    out.show(final=True)
    assert capsys.readouterr().err == "[rank 1] 100%|##########| 3/3\n[rank 1] done\n"


def test_many_ranks_fold_behind_rank_0_and_agreeing_figures_show_once(monkeypatch):
    from ddplab.notebook import rankview

    shown = []
    monkeypatch.setattr(rankview, "_publish", lambda data, metadata=None: shown.append(data))
    rankview.show_values([{"data": {"text/plain": str(r)}, "metadata": {}} for r in range(8)], 8)
    (block,) = shown
    assert block["text/plain"].splitlines() == [f"[rank {r}] {r}" for r in range(8)]
    assert block["text/html"].count("<details open") == 1  # rank 0 open, ranks 1-7 folded
    assert block["text/html"].count("<details") == 8
    shown.clear()
    figure = {"data": {"application/vnd.plotly.v1+json": {"data": []}, "text/plain": "Figure"}, "metadata": {}}
    rankview.show_values([figure, figure], 2)
    assert [d.get("text/plain") for d in shown] == ["[all ranks]", "Figure"]


@pytest.mark.slow
def test_a_ddp_forward_on_some_ranks_is_refused_unless_no_backward_can_follow(run):
    nb, messages = run
    (err,) = outputs(nb, 14, "error")
    assert "DistributedDataParallel forward with gradients on" in err.evalue
    assert "rank(s) [1], which are not taking part" in err.evalue
    assert _seconds(messages[14]) < 5
    assert plain(nb, 15) == ["[rank 0] torch.Size([1, 2])"]
