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
import time
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


ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED"}


def job_state(slurm, job: str) -> str:
    shown = slurm.run(["scontrol", "show", "job", "-o", job], check=False).stdout
    m = re.search(r"\bJobState=(\S+)", shown)
    return m.group(1) if m else "UNKNOWN"


def wait_for(slurm, job: str, timeout: float = 300.0, every: float = 0.2,
             settle_s: float = 0.0) -> tuple[str, float]:
    """Poll until the job has ended: (its state, time.time() when seen). sbatch --wait polls
    every 30 s or so (a 12 s job took 42 s); this costs the job's run time plus ``every``.
    ``settle_s``: an ended state counts once it has held that long (a job that requeues itself
    was seen FAILED for a moment on a loaded machine, between its first attempt and PENDING)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(slurm, job)
        if state in ENDED:
            seen = time.time()
            held = time.monotonic() + settle_s
            while time.monotonic() < held and job_state(slurm, job) == state:
                time.sleep(every)
            if job_state(slurm, job) == state:
                return state, seen
            continue
        time.sleep(every)
    raise AssertionError(f"job {job} had not ended after {timeout:.0f} s ({job_state(slurm, job)})\n"
                         + slurm.logs())


def sbatch(slurm, folder: Path, *args: str, env: dict | None = None) -> str:
    done = slurm.run(["sbatch", "--parsable", *args], cwd=folder, env=env or {})
    return done.stdout.strip().split(";")[0]


def submit(slurm, folder: Path) -> tuple[str, str]:
    """sbatch lab.sbatch from ``folder``, wait for the job; (its id, its output file's text)."""
    job = sbatch(slurm, folder, "lab.sbatch")
    state, _ = wait_for(slurm, job)
    outputs = list(folder.glob(f"lab-{job}.out"))
    text = outputs[0].read_text() if outputs else "(no output file)"
    assert state == "COMPLETED", f"job {job}: {state}\n{text[-4000:]}\n{slurm.logs()}"
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
        if line.startswith("=== job "):  # the batch file's mark of each attempt
            continue
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
    # each rank's job, node and host, in the JSON and on the page
    ranks = job_run.meta["ranks"]
    host = socket.gethostname()
    job = ranks[0]["job"]
    assert job.isdigit() and ranks == [{"rank": 0, "job": job, "node": "n1", "host": host},
                                       {"rank": 1, "job": job, "node": "n2", "host": host}]
    assert (f"ran as job {job}: rank 0 on node n1 (host {host}); rank 1 on node n2 (host {host})."
            in (folder / "run.html").read_text())


def test_the_mistakes_are_refused_in_words_inside_a_real_job(slurm, tmp_path):
    """The batch script running the training itself, and `srun -n 1` without torchrun, in a
    2-node job: both stop at once with the error, not at a rendezvous that never completes."""
    join = f"{sys.executable} -c 'import ddplab; ddplab.init_from_env()'"
    job = sbatch(slurm, tmp_path, "--nodes=2", "--ntasks-per-node=1", "-o", "mistakes.out",
                 "--wrap", f"{join}; srun --nodes=1 --ntasks=1 {join}; exit 0")
    state, _ = wait_for(slurm, job)
    text = (tmp_path / "mistakes.out").read_text()
    assert state == "COMPLETED", text
    assert "this is the batch script's own process, not a task" in text, text
    assert "this job step has one task, but the job has 2 nodes" in text, text


HANG_S = 10  # the planted hang's collective timeout: short, so the test is
HUNG = f"""
import time, torch, torch.distributed as dist, ddplab
env = ddplab.init_from_env(timeout={HANG_S})
t = torch.ones(3)
dist.all_reduce(t)
dist.broadcast(t, 0)
if env.rank == 1:
    time.sleep(600)  # the hung rank: it never reaches the next all-reduce
print("waiting from", repr(time.time()), flush=True)
dist.all_reduce(t)
"""


def batch_file(folder: Path, script: str, text: str, **opts) -> Path:
    from ddplab.notebook.sbatch import BatchOptions, write_batch

    (folder / script).write_text(text)
    return write_batch(folder / script, BatchOptions(nodes=2, gpus_per_node=0, ntasks_per_node=1, **opts))


def test_a_hung_rank_ends_the_whole_job_within_the_collective_timeout(slurm, tmp_path):
    """Rank 1 sleeps where rank 0 all-reduces: rank 0's collective times out, its error names
    rank 1, its node and the collective it never joined, and the job ends then, not at its
    3-minute limit: srun --kill-on-bad-exit=1 around the ranks, and around the torchruns
    (both jobs run at once)."""
    jobs = {}
    for launcher in ("srun", "torchrun"):
        folder = tmp_path / launcher
        folder.mkdir()
        batch_file(folder, "hung.py", HUNG, time="3", launcher=launcher)
        jobs[launcher] = (folder, sbatch(slurm, folder, "hung.sbatch"))
    for launcher, (folder, job) in jobs.items():
        state, ended = wait_for(slurm, job)
        text = (folder / f"hung-{job}.out").read_text()
        assert state == "FAILED", text
        # "0: " from srun --label, "[rank 0] " from torchrun's prefix
        waiting = float(re.search(r"^(?:0: |\[rank 0\] )waiting from (\S+)$", text, re.M).group(1))
        assert ended - waiting < HANG_S + 15, (f"{launcher}: the job ended {ended - waiting:.1f} s after rank 0 "
                                               f"began to wait\n{text[-3000:]}")
        assert "rank 0 timed out in all_reduce (its collective #3)" in text, text
        assert re.search(r"rank 1 \(node n[12], host .*\) never joined it: its last was #2 broadcast", text), text


RESUME = """
import os, time, torch, ddplab
import ddplab.launchers.torchrun
from torch.nn.parallel import DistributedDataParallel as DDP
env = ddplab.init_from_env(timeout=60)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
model = DDP(net)
opt = torch.optim.Adam(model.parameters(), lr=0.05)  # its moments must come back too
run = ddplab.Resumable(model, opt)  # loads the job's checkpoint when there is one
for step in run.steps(12):
    batches = torch.Generator().manual_seed(1000 * step + env.rank)  # the batch follows the step
    x = torch.randn(4, 6, generator=batches, dtype=torch.float64)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin()).backward()
    opt.step()
    print("step", step, flush=True)
    time.sleep(float(os.environ.get("STEP_S", "0")))
if env.rank == 0:
    torch.save([p.detach() for p in net.parameters()], f"weights-{os.environ['SLURM_JOB_ID']}.pt")
ddplab.launchers.torchrun.finish()
"""


def signal_once_running(slurm, job: str, out: Path, deadline: float) -> None:
    """Send SIGUSR1 once rank 0 printed step 1; let the requeued job start at once."""
    while not (out.exists() and re.search(r"^(?:0: |\[rank 0\] )step 1$", out.read_text(), re.M)):
        assert time.monotonic() < deadline and job_state(slurm, job) not in ENDED, slurm.logs()
        time.sleep(0.2)
    slurm.run(["scancel", "--signal=USR1", job])
    while "Restarts=1" not in slurm.run(["scontrol", "show", "job", "-o", job]).stdout:
        assert time.monotonic() < deadline and job_state(slurm, job) not in ENDED, out.read_text()
        time.sleep(0.2)
    # Slurm may hold a requeued job back (Reason=BeginTime, up to 2 minutes here): once it is
    # pending again (not while its first attempt is still being ended), let it start now
    while (state := job_state(slurm, job)) not in ("PENDING", "RUNNING", *ENDED):
        assert time.monotonic() < deadline, out.read_text()
        time.sleep(0.2)
    if state == "PENDING":
        slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])


def test_a_signalled_job_saves_requeues_and_resumes_to_the_uninterrupted_weights(slurm, tmp_path):
    """SIGUSR1 (what --signal=USR1@90 sends before the limit) to a running job: the ranks agree
    on a step, rank 0 saves, the job requeues itself and its second attempt resumes there; its
    weights equal those of the same job run without a break, bit for bit, and its output keeps
    both attempts, each marked. (The torchrun form, whose agents ignore the signal while their
    ranks catch it, was run by hand: one more job here costs about a minute.)"""
    import torch

    batch_file(tmp_path, "resume.py", RESUME, time="5")
    straight = sbatch(slurm, tmp_path, "resume.sbatch")
    cut = sbatch(slurm, tmp_path, "resume.sbatch", env={"STEP_S": "0.4"})
    out = tmp_path / f"resume-{cut}.out"
    signal_once_running(slurm, cut, out, time.monotonic() + 150)
    state, _ = wait_for(slurm, cut, settle_s=15)
    assert state == "COMPLETED", (out.read_text() + "\n" + slurm.run(["scontrol", "show", "job", cut],
                                                                   check=False).stdout + slurm.logs(300))
    assert wait_for(slurm, straight)[0] == "COMPLETED", (tmp_path / f"resume-{straight}.out").read_text()

    text = out.read_text()
    assert f"=== job {cut} attempt 1 on n[1-2]" in text and f"=== job {cut} attempt 2 on n[1-2]" in text, text
    saved = int(re.search(r"^0: ddplab: saved \S+ at step (\d+)$", text, re.M).group(1))
    assert 2 <= saved < 12, text
    first, second = text.split(f"=== job {cut} attempt 2")
    assert f"0: ddplab: attempt 2: resumed from {tmp_path}/resume-{cut}.ckpt.pt at step {saved}" in second
    assert re.findall(r"^0: step (\d+)$", second, re.M) == [str(s) for s in range(saved, 12)], second
    assert re.findall(r"^0: step (\d+)$", first, re.M) == [str(s) for s in range(saved)], first
    a = torch.load(tmp_path / f"weights-{straight}.pt")
    b = torch.load(tmp_path / f"weights-{cut}.pt")
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_srun_starting_two_torchruns_per_node_is_refused_and_ends_the_job(slurm, tmp_path):
    """2 tasks per node, each a torchrun: the workers that start refuse in words naming
    srun --ntasks-per-node=1, and --kill-on-bad-exit ends the agents still waiting."""
    (tmp_path / "join.py").write_text("import ddplab\nddplab.init_from_env()\nprint('joined')\n")
    torchrun = (f"{sys.executable} -m torch.distributed.run --nnodes=2 --nproc-per-node=1 "
                "--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:$((20000 + SLURM_JOB_ID % 12000)) "
                "--rdzv-id=$SLURM_JOB_ID join.py")
    job = sbatch(slurm, tmp_path, "--nodes=2", "--ntasks-per-node=2", "--time=3", "-o", "two.out",
                 "--wrap", f"srun --kill-on-bad-exit=1 {torchrun}")
    state, _ = wait_for(slurm, job)
    text = (tmp_path / "two.out").read_text()
    assert state == "FAILED" and "joined" not in text, text
    assert "srun started 2 tasks on this node and each runs torchrun" in text, text


def test_a_taken_port_is_said_at_start_up_with_what_to_set(slurm, tmp_path):
    """Something listens on the port ddplab derives from the job id: rank 0 says which port,
    on which host, and to export MASTER_PORT; the job ends then (--kill-on-bad-exit)."""
    batch_file(tmp_path, "join.py", "import ddplab\nddplab.init_from_env()\nprint('joined', flush=True)\n",
               time="3")
    job = sbatch(slurm, tmp_path, "--hold", "join.sbatch")
    port = 20000 + int(job) % 12000
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("", port))
        taken.listen()
        slurm.run(["scontrol", "release", job])
        state, _ = wait_for(slurm, job)
    text = (tmp_path / f"join-{job}.out").read_text()
    assert state == "FAILED" and "joined" not in text, text
    assert (f"rank 0 cannot listen on port {port} on {socket.gethostname()}: the port ddplab derived "
            "from the job id (20000 + SLURM_JOB_ID % 12000) is taken there") in text, text
    assert "export MASTER_PORT=<free port>" in text, text
