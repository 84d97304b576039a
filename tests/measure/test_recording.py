"""ddplab.record on a real torch DDP model at 2 gloo ranks: the recorded buckets equal torch's
own logging data under every option the issue names, training is unchanged by recording, and a
hook registered after the call is wrapped while one registered before is not (and says so)."""
import json
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CASES = ["plain", "no_sync", "find_unused_parameters", "static_graph", "autocast", "fp16_hook",
         "powersgd_hook", "hook_before"]


def train_recorded(case, out=None):
    """On every rank: two identical DDP replicas from the same (rank-dependent, then broadcast)
    weights, one recorded and one not, trained on the same batches; returns what rank 0 saw."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddplab
    from ddplab.measure.recording import logged_buckets

    rank = dist.get_rank()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 256)
            self.b = torch.nn.Linear(256, 256)
            self.c = torch.nn.Linear(256, 8)
            self.unused = torch.nn.Linear(8, 8)  # never used when find_unused_parameters is asked

        def forward(self, x):
            y = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
            return y if case == "find_unused_parameters" else y + 0 * self.unused(y).sum()

    # PowerSGD on gloo gets ONE bucket: its future callbacks issue further all-reduces
    # (powerSGD_hook.py, unpack_uncompressed_tensors_and_allreduce_ps), and with two buckets
    # those ran on gloo's worker threads in a different order on each rank here, with or
    # without ddplab (measured with plain torch: "Received data size doesn't match" or a hang).
    cap = 25 if case == "powersgd_hook" else 0.1

    def replica():
        torch.manual_seed(rank)  # different weights on each rank: DDP broadcasts rank 0's
        return DDP(Net(), bucket_cap_mb=cap, find_unused_parameters=case == "find_unused_parameters",
                   static_graph=case == "static_graph")

    plain, recorded = replica(), replica()
    if case == "hook_before":
        recorded.register_comm_hook(None, default_hooks.fp16_compress_hook)
        plain.register_comm_hook(None, default_hooks.fp16_compress_hook)
    rec = ddplab.record(recorded, steps=range(1, 6), out=out if rank == 0 else None)
    hooks = {"fp16_hook": (None, default_hooks.fp16_compress_hook),
             "powersgd_hook": "powersgd"}
    if case in hooks:
        for model in (plain, recorded):
            if case == "powersgd_hook":
                state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                    start_powerSGD_iter=2, random_seed=0,
                                                    # the "unused" layer's gradient is all zeros:
                                                    # without an epsilon its orthogonalization is 0/0
                                                    orthogonalization_epsilon=1e-8)
                model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            else:
                model.register_comm_hook(*hooks[case])
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, recorded)]
    g = torch.Generator().manual_seed(100 + rank)
    worst = 0.0
    for _ in range(7):
        x = torch.randn(16, 64, generator=g)
        for model, opt in zip((plain, recorded), opts):
            if case == "no_sync":  # gradient accumulation: a no_sync micro-step, then the synced one
                with model.no_sync():
                    model(x.flip(0)).square().mean().backward()
            if case == "autocast":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x).float().square().mean()
            else:
                loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        worst = max(worst, max((p - q).abs().max().item() for p, q in
                               zip(plain.parameters(), recorded.parameters())))
    tl = rec.timeline  # finished by itself at the optimizer step of step 5
    rec.wait()  # its files are written off the training step
    replicas = [None, None]
    dist.all_gather_object(replicas, [p.detach().clone() for p in recorded.parameters()])
    agree = max((a - b).abs().max().item() for a, b in zip(*replicas))
    return {"timeline": None if tl is None else tl.to_dict(), "logged": logged_buckets(plain),
            "worst": worst, "agree": agree,
            "hooks": [m._get_ddp_logging_data().get("comm_hook") for m in (plain, recorded)]}


def last_synced_layout(tl, rank):
    from ddplab.timeline import Timeline

    tl = Timeline.from_dict(tl)
    synced = [it.iteration for it in tl.iterations if it.rank == rank and "no_sync" not in it.flags]
    return tl, [b.nbytes for b in tl.buckets_of(rank, max(synced))]


@pytest.mark.parametrize("case", CASES)
def test_recorded_buckets_equal_torchs_logging_data(cluster2, case):
    r0, r1 = cluster2.run(train_recorded, case)
    assert r1["timeline"] is None  # rank 0 gathers
    assert r0["agree"] == 0.0 and r1["agree"] == 0.0  # the replicas agree after training
    assert r0["worst"] <= 1e-6, "recording changed training"
    tl, _ = last_synced_layout(r0["timeline"], 0)
    assert sorted({it.rank for it in tl.iterations}) == [0, 1]
    assert [it.iteration for it in tl.iterations if it.rank == 0] == [1, 2, 3, 4, 5]
    for rank in (0, 1):
        _, sizes = last_synced_layout(r0["timeline"], rank)
        assert sizes == r0["logged"], (rank, sizes, r0["logged"])
    # steps are optimizer steps: an accumulation's no_sync micro-step is a phase of its step
    # and a step before torch rebuilt its buckets is flagged: static_graph rebuilds after step 1
    flagged = {it.iteration: it.flags for it in tl.iterations if it.flags and it.rank == 0}
    assert flagged == ({1: {"ddp_one_bucket"}} if case == "static_graph" else {})
    assert all(("no_sync" in it.phases) == (case == "no_sync") for it in tl.iterations)
    assert tl.meta["micro_steps"] == {str(i): 2 if case == "no_sync" else 1 for i in range(1, 6)}
    # per-parameter ready times: every trainable parameter once per recorded backward
    n_trainable = 6 if case == "find_unused_parameters" else 8
    per_it = {}
    for g in tl.grads:
        if g.rank == 0:
            per_it.setdefault(g.iteration, []).append(g.param)
    assert {i: len(v) for i, v in per_it.items()} == {i: n_trainable for i in range(1, 6)}
    last = [b for b in tl.buckets if b.rank == 0 and b.iteration == 5]
    # a hook registered before the call is measured too
    assert "comm_not_measured" not in tl.meta
    for b in last:  # ready, then launched, then done: in that order
        assert b.grads_ready <= b.launch <= b.comm_end, b
    if case in ("fp16_hook", "powersgd_hook", "hook_before"):
        assert tl.meta["comm_hook"] in ("fp16_compress_hook", "powerSGD_hook")
    # bytes: what each bucket held, and what went on the wire, both said and labelled
    assert set(tl.meta["bucket_bytes"]) == {"nbytes", "wire_nbytes"}
    for b in (b for b in tl.buckets if "no_sync" not in tl.iteration(b.rank, b.iteration).flags):
        if case in ("fp16_hook", "hook_before"):  # fp16_compress_hook: the float32 bucket as fp16
            assert b.wire_nbytes * 2 == b.nbytes, b
        elif case == "powersgd_hook":  # its own call's all-reduce only (P and Q come in callbacks)
            assert 0 < b.wire_nbytes, b
        else:
            assert b.wire_nbytes == b.nbytes, b
    if case == "powersgd_hook":  # compressing from its step 2 on: the 1-D tensors, a lower bound
        assert tl.buckets_of(0, 5)[0].wire_nbytes < tl.buckets_of(0, 5)[0].nbytes
    # after finish() the hook slot is as it was: yours, or none, in DDP's own logging data
    plain_hook, recorded_hook = r0["hooks"]
    assert recorded_hook == plain_hook and plain_hook != "RunRecorder._dispatch", r0["hooks"]


def test_the_three_files_and_the_viewer(cluster2, tmp_path):
    from ddplab.measure.recording import load_run

    out = tmp_path / "run"
    r0, _ = cluster2.run(train_recorded, "plain", str(out))
    assert r0["timeline"] is not None
    tl = load_run(out.with_suffix(".json"))
    assert [b.nbytes for b in tl.buckets_of(0, 5)] == r0["logged"]
    trace = json.loads(out.with_suffix(".trace.json").read_text())
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert len(slices) > 0
    html = out.with_suffix(".html").read_text()
    assert "plotly" in html.lower()


@pytest.mark.slow
@pytest.mark.more  # make check: a torchrun of its own
def test_a_torchrun_script_with_the_one_call_writes_three_files_and_view_draws_two(tmp_path):
    import os
    import subprocess
    import sys

    from ddplab.measure.recording import load_run

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, CUDA_VISIBLE_DEVICES="")
    for name, cap in (("small", "0.25"), ("big", "25")):
        out = tmp_path / name
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", "2", os.path.join(root, "examples", "record_my_run.py"),
                               "--out", str(out), "--bucket-cap-mb", cap],
                              env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        for suffix in (".json", ".trace.json", ".html"):
            assert out.with_suffix(suffix).is_file(), suffix
        tl = load_run(out.with_suffix(".json"))
        assert tl.world_size == 2 and sorted({b.rank for b in tl.buckets}) == [0, 1]
        last = max(it.iteration for it in tl.iterations)
        assert [b.nbytes for b in tl.buckets_of(1, last)] == tl.meta["logged_bucket_sizes"]
    assert len(load_run(tmp_path / "small.json").buckets_of(0, 9)) > 1  # a small cap: several
    assert len(load_run(tmp_path / "big.json").buckets_of(0, 9)) == 1
    page = tmp_path / "both.html"
    done = subprocess.run([sys.executable, "-m", "ddplab", "view", str(tmp_path / "small.json"),
                           str(tmp_path / "big.json"), "--html", str(page)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    html = page.read_text()
    assert "small" in html and "big" in html
    missing = subprocess.run([sys.executable, "-m", "ddplab", "view", str(tmp_path / "none.json")],
                             env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "no such run" in missing.stderr


def test_lab_10_measures_the_link_when_the_recording_cannot_teach_it(cluster2, capsys):
    """Lab 10's what-if cell, run as written, with the recording's link refused (as on a busy
    machine, where ~1 MB buckets can time as if larger ones were faster): it says so, times
    all-reduces on the ranks, and picks a cap from the link fitted to them."""
    import nbformat

    from ddplab.lessons import yourmodel
    from ddplab.measure import whatif
    from ddplab.timeline import Timeline

    link = yourmodel.link_of_this_machine(cluster2)
    assert 0 < link.bandwidth_gbps < float("inf") and link.latency_us >= 0
    run = Timeline.from_dict(cluster2.run(yourmodel.record_on_rank, "transformer", None, None, 1, 5)[0])

    class Refusing:  # whatif, except that the recording's own link is refused
        def __getattr__(self, name):
            return getattr(whatif, name)

        @staticmethod
        def choose_cap(recording, caps_mb, link=None, **kw):
            if link is None:
                raise ValueError("the recording's all-reduce times do not grow with size")
            return whatif.choose_cap(recording, caps_mb=caps_mb, link=link, **kw)

    class Figure:
        def show(self):
            pass

    lab = nbformat.read("labs/10-your-model.ipynb", as_version=4)
    cell = next(c.source for c in lab.cells if c.id == "cell-11")
    scope = {"run": run, "whatif": Refusing(), "yourmodel": yourmodel, "cluster": cluster2,
             "timeline_figure": lambda *a, **k: Figure()}
    exec(cell, scope)
    said = capsys.readouterr().out
    assert "refused your recording's link" in said and "On this machine:" in said
    assert scope["here"]["best"] in scope["CAPS"]
    best = scope["here"]["predictions"][scope["here"]["best"]]
    assert best.meta["whatif"]["link"]["label"] == link.label  # predicted on a measured link


def train_past_the_recording(out):
    """On every rank: steps 1-3 of an 8-step loop recorded; rank 0 notes when each step of its
    loop starts. Steps 4-7 all-reduce on the training's group while the recorder gathers."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.measure.recording import logged_buckets, record
    from ddplab.timeline.clock import now

    rank = dist.get_rank()
    torch.manual_seed(rank)  # different weights on each rank: DDP broadcasts rank 0's
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                  torch.nn.ReLU(), torch.nn.Linear(256, 8)), bucket_cap_mb=0.1)
    rec = record(ddp, steps=range(1, 4), out=out if rank == 0 else None)  # no page: seconds saved
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    starts = []
    for _ in range(8):
        starts.append(now())
        ddp(torch.randn(16, 64, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    rec.wait()
    replicas = [None, None]
    dist.all_gather_object(replicas, [p.detach() for p in ddp.parameters()])
    return {"timeline": None if rec.timeline is None else rec.timeline.to_dict(), "starts": starts,
            "logged_now": logged_buckets(ddp),  # the reducer finish() rebuilt, rebuilt again by torch
            "agree": max((a - b).abs().max().item() for a, b in zip(*replicas))}


@pytest.mark.more  # a Cluster job: about 5 s here
def test_the_gathering_runs_after_the_last_recorded_step_while_training_goes_on(cluster2, tmp_path):
    from ddplab.measure.recording import load_run
    from ddplab.timeline import Timeline

    out = tmp_path / "run"
    r0, r1 = cluster2.run(train_past_the_recording, str(out))
    assert r1["timeline"] is None
    assert r0["agree"] == 0.0 and r1["agree"] == 0.0  # the gathering never met training's all-reduces
    tl = Timeline.from_dict(r0["timeline"])
    start, end = tl.meta["gathered"]
    assert tl.iteration(0, 3).end <= start  # the last recorded step ended before the gathering began,
    assert r0["starts"][4] < end  # and the next step began before it was over: not inside step 3
    saved = load_run(out.with_suffix(".json"))
    assert saved.to_dict() == json.loads(json.dumps(r0["timeline"]))  # the file is the gathered run
    assert [it.iteration for it in saved.iterations if it.rank == 1] == [1, 2, 3]
    for rank in (0, 1):
        assert [b.nbytes for b in saved.buckets_of(rank, 3)] == saved.meta["logged_bucket_sizes"]
    assert saved.meta["logged_bucket_sizes"] == r0["logged_now"] and len(r0["logged_now"]) > 1


def meet_alone_then_together(timeout):
    """Rank 0 makes the recorder's group while rank 1 does not; then both make one."""
    import torch.distributed as dist

    from ddplab.measure.recording_gather import SideGroup

    said = None
    if dist.get_rank() == 0:
        try:
            SideGroup(dist.group.WORLD, timeout)
        except RuntimeError as e:
            said = str(e)
    dist.barrier()
    if dist.get_rank() == 0:
        # rank 1 comes first, while the store still holds the address rank 0 posted for the
        # failed meeting (its port closed since): it must not be read as this meeting's
        time.sleep(0.5)
    side = SideGroup(dist.group.WORLD, timeout)  # the count at the store is whole again
    parts = side.all_gather_object(dist.get_rank())
    # the gathering's first barrier passed: the meeting's key of spoiled tries leaves the store
    from torch.distributed.distributed_c10d import _get_default_store

    from ddplab.measure.recording_gather import gather

    store = _get_default_store()
    held = store.check([side._spoiled])
    gather({"rank": dist.get_rank()}, side, timeout)
    dist.barrier()
    return said, parts, (held, store.check([side._spoiled]))


@pytest.mark.more  # a Cluster job: about 4 s here
def test_record_on_one_rank_only_says_so_and_the_next_record_still_meets(cluster2):
    (said, parts, keys), (none, _, _) = cluster2.run(meet_alone_then_together, 2.0)
    assert none is None and parts == [0, 1]
    assert keys == (True, False)  # the spoiled count was there for the meeting, and went after it
    assert said.startswith("ddplab.record() on rank 0: the other ranks did not call ddplab.record() "
                           "within 2 s")
    assert said.endswith("call it on every rank, at the same point of your script")
