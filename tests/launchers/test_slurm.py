"""A lab's cells, exported with %ddp_export --sbatch, run as jobs of a real Slurm.

The Slurm is tests/_slurm.py's: munged, slurmctld and two emulated nodes n1
and n2, both on 127.0.0.1 (names that do not resolve: the master address must
come from their NodeAddr). One notebook runs in a real kernel on a local
2-rank Cluster: lab 01's %%ddp cells as the lab has them, a cell that trains
with ``ddplab.average_gradients`` (float64, the same start on every rank,
each rank its own batches), and one that records torch DDP with
``ddplab.record``. It exports them twice, as a batch file whose srun starts
one task per rank, and as one whose srun starts one torchrun per node. Each
batch file runs under ``sbatch`` on 2 nodes x 1 task (gloo on CPU), and every
rank must print what that rank printed and showed in the notebook.

Runs under ``make test-slurm`` (DDPLAB_SLURM_TEST=1). Where Slurm cannot be
installed or started the tests skip saying why, and fail in CI (CI set).
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not os.environ.get("DDPLAB_SLURM_TEST"), reason="runs under make test-slurm (DDPLAB_SLURM_TEST=1)")]

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "labs" / "01-when-is-the-sync.ipynb"

TRAIN = """%%ddp
import torch, ddplab
torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
for step in range(3):
    x = torch.randn(32, 8, generator=data, dtype=torch.float64)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    ddplab.average_gradients(model)
    opt.step()
    print("step", step, "loss", repr(loss.item()))
print("weights", [repr(p.sum().item()) for p in model.parameters()])
"""
RECORD = """%%ddp
import torch, ddplab
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(1)
net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                          torch.nn.ReLU(), torch.nn.Linear(256, 10))
ddp = DDP(net, bucket_cap_mb=0.25)
ddplab.record(ddp, steps=range(1, 5), out="run")  # rank 0 writes run.json, run.trace.json, run.html
sgd = torch.optim.SGD(ddp.parameters(), lr=0.01)
batches = torch.Generator().manual_seed(200 + rank)
for _ in range(6):
    x = torch.randn(16, 64, generator=batches)
    torch.nn.functional.cross_entropy(ddp(x), torch.randint(0, 10, (16,), generator=batches)).backward()
    sgd.step()
    sgd.zero_grad()
print("recorded", sum(p.numel() for p in net.parameters()))
"""
CPU_JOB = "--sbatch --nodes 2 --gpus-per-node 0 --ntasks-per-node 1 --time 10"


def lab_cells() -> list[str]:
    """Lab 01's %%ddp cells, as the lab has them."""
    nb = nbformat.read(LAB, as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith("%%ddp")]
    assert len(cells) >= 2, "lab 01 no longer has the %%ddp cells this test exports"
    return cells


@pytest.fixture(scope="module")
def slurm():
    from _slurm import Slurm, SlurmUnavailable

    cluster = Slurm()
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        cluster.stop()
        why = f"a real Slurm could not be started here: {exc}"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    yield cluster
    strays = cluster.stop()
    assert strays == [], f"processes of the test's Slurm outlived its daemons: {strays}"


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    """The notebook run on a local 2-rank Cluster; exports to srun/ and torchrun/."""
    work = tmp_path_factory.mktemp("slurm-nb")
    (work / "srun").mkdir()
    (work / "torchrun").mkdir()
    sources = ["%load_ext ddplab\n%ddp_start 2", *lab_cells(), TRAIN, RECORD,
               f"%ddp_export {work}/srun/lab.py {CPU_JOB}",
               f"%ddp_export {work}/torchrun/lab.py {CPU_JOB} --launcher torchrun",
               "%ddp_stop"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    NotebookClient(nb, kernel_name="python3", timeout=180,
                   resources={"metadata": {"path": str(work)}}).execute()
    return nb, work


def shown_by_rank(nb, world_size: int = 2) -> dict[int, list[str]]:
    """What each rank printed and showed in the notebook's %%ddp cells, in order."""
    lines: dict[int, list[str]] = {r: [] for r in range(world_size)}
    for cell in nb.cells:
        if not cell.source.startswith("%%ddp"):
            continue
        for out in cell.outputs:
            text = out.get("text", "") if out.output_type == "stream" else out.get("data", {}).get("text/plain", "")
            if out.output_type == "stream" and out.name != "stdout":
                continue
            for line in text.splitlines():
                label, _, rest = line.partition("] ")
                ranks = range(world_size) if label == "[all ranks" else [int(label[len("[rank "):])]
                for r in ranks:
                    lines[r].append(rest)
    return lines


def submit(slurm, folder: Path) -> tuple[str, str]:
    """sbatch lab.sbatch from ``folder``, wait for the job; (its id, its output file's text)."""
    done = slurm.run(["sbatch", "--wait", "--parsable", "lab.sbatch"], cwd=folder, timeout=300, check=False)
    job = done.stdout.strip().split(";")[0]
    outputs = list(folder.glob(f"lab-{job}.out"))
    text = outputs[0].read_text() if outputs else "(no output file)"
    assert done.returncode == 0, f"sbatch --wait: {done.returncode}\n{done.stderr}\n{text[-4000:]}\n{slurm.logs()}"
    return job, text


def nodes_of(slurm, job: str) -> str:
    shown = slurm.run(["scontrol", "show", "job", job]).stdout
    return re.search(r"\bNodeList=(\S+)", shown).group(1)


def test_names_n1_n2_do_not_resolve_so_the_master_must_come_from_nodeaddr():
    for name in ("n1", "n2"):
        with pytest.raises(OSError):
            socket.getaddrinfo(name, None)


def test_sbatch_with_srun_gives_the_numbers_the_notebook_gave(slurm, notebook):
    nb, work = notebook
    job, text = submit(slurm, work / "srun")
    assert nodes_of(slurm, job) == "n[1-2]"  # one task on each emulated node
    ran: dict[int, list[str]] = {0: [], 1: []}
    for line in text.splitlines():  # srun --label: "0: text"
        m = re.match(r"^\s*(\d+): (.*)$", line)
        assert m, f"a line srun did not label: {line!r}\n{text[-3000:]}"
        ran[int(m.group(1))].append(m.group(2))
    expected = shown_by_rank(nb)
    assert any(line.startswith("weights ") for line in expected[0])  # the training cell printed
    assert expected[0] != expected[1]  # per-rank losses differ: each rank had its own batches
    assert ran == expected


def test_sbatch_with_one_torchrun_per_node_gives_the_same_numbers(slurm, notebook):
    nb, work = notebook
    job, text = submit(slurm, work / "torchrun")
    assert nodes_of(slurm, job) == "n[1-2]"
    ran: dict[int, list[str]] = {0: [], 1: []}
    for line in text.splitlines():  # torchrun --tee=3 with "[rank N] " in front
        if line.startswith("[rank "):
            head, _, rest = line.partition("] ")
            ran[int(head[len("[rank "):])].append(rest)
    assert ran == shown_by_rank(nb), text[-4000:]


def test_ddplab_record_in_the_job_writes_its_timeline(slurm, notebook):
    from ddplab.measure.recording import load_run

    _, work = notebook
    folder = work / "srun"
    if not (folder / "run.json").exists():  # when this test runs alone
        submit(slurm, folder)
    for suffix in (".json", ".trace.json", ".html"):
        assert (folder / f"run{suffix}").is_file(), suffix
    job_run, notebook_run = load_run(folder / "run.json"), load_run(work / "run.json")
    assert job_run.world_size == 2 and sorted({b.rank for b in job_run.buckets}) == [0, 1]
    last = max(it.iteration for it in job_run.iterations)
    assert [b.nbytes for b in job_run.buckets_of(1, last)] == job_run.meta["logged_bucket_sizes"]
    assert len(job_run.buckets_of(0, last)) > 1  # 0.25 MB buckets: several of them
    # the job's torch DDP formed the buckets the notebook's did
    assert job_run.meta["logged_bucket_sizes"] == notebook_run.meta["logged_bucket_sizes"]
    trace = json.loads((folder / "run.trace.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])


def test_the_mistakes_are_refused_in_words_inside_a_real_job(slurm, tmp_path):
    """The batch script running the training itself, and `srun -n 1` without torchrun, in a
    2-node job: both stop at once with the error, not at a rendezvous that never completes."""
    join = f"{sys.executable} -c 'import ddplab; ddplab.init_from_env()'"
    done = slurm.run(["sbatch", "--wait", "--nodes=2", "--ntasks-per-node=1", "-o", "mistakes.out",
                      "--wrap", f"{join}; srun --nodes=1 --ntasks=1 {join}; exit 0"],
                     cwd=tmp_path, timeout=300)
    text = (tmp_path / "mistakes.out").read_text()
    assert done.returncode == 0, text
    assert "this is the batch script's own process, not a task" in text, text
    assert "this job step has one task, but the job has 2 nodes" in text, text
