"""ddplab.record on a model torch's ``fully_shard`` (FSDP2) was applied to, at 2 gloo ranks: the
recorded all-gathers and reduce-scatters are the ones FSDP issues (counted here by wrapping
torch.distributed's functions, and from the model's structure), their bytes are the units' padded
flat parameters (computed here from the model), training is bitwise unchanged, a validation
forward is not a step, what the recorder patches is put back after finish() and after a step
raises, and the files are written and drawn beside a DDP run of the same model."""
import math

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.more, pytest.mark.timeout(300)]

AG, RS = "all_gather_into_tensor", "reduce_scatter_tensor"


def _net(fail=None):
    """Two fully_shard-able blocks and a head that stays in the root; odd sizes, so FSDP pads.
    ``fail``: a dict whose "forward" or "backward" key, when true, makes block b raise there."""
    import torch

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            if fail and fail.get("backward"):
                raise RuntimeError("planted backward error")
            return g

    class Block(torch.nn.Module):
        def __init__(self, n_in, n_out):
            super().__init__()
            self.lin = torch.nn.Linear(n_in, n_out)

        def forward(self, x):
            if fail and fail.get("forward"):
                raise RuntimeError("planted forward error")
            return Boom.apply(torch.relu(self.lin(x)))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Block(12, 33), Block(33, 17)
            self.head = torch.nn.Linear(17, 5)

        def forward(self, x):
            return self.head(self.b(self.a(x)))

    torch.manual_seed(0)
    return Net()


def _sharded(fail=None):
    from torch.distributed.fsdp import fully_shard

    net = _net(fail)
    fully_shard(net.a)
    fully_shard(net.b)
    fully_shard(net)
    return net


def _padded_bytes(world):
    """Each unit's flat padded parameters, from the model: every parameter's dim 0 padded to a
    multiple of the world size (fully_shard's even chunks), float32."""
    net = _net()
    own = {"a": net.a.parameters(), "b": net.b.parameters(), "(root)": net.head.parameters()}
    return {unit: sum(math.ceil(p.shape[0] / world) * world * p[0].numel() * p.element_size() for p in ps)
            for unit, ps in own.items()}


def train_fsdp(steps=5, out=None):
    """On every rank: a recorded and an unrecorded fully_shard replica trained on the same batches;
    in step 1 block b's forward all-gather made before the step's first forward (``unshard``: not in
    the step, listed in the meta), a validation forward (no_grad) before step 2's, and in step 3 block
    a's backward all-gather made
    early and asynchronous (``unshard(async_op=True)``: its end comes from the work's future, and
    FSDP's own pre-backward unshard is then a no-op). torch.distributed's all-gather and reduce-scatter
    functions are wrapped here while the recorded replica runs, counting what FSDP issues."""
    import torch
    import torch.distributed as dist

    import ddplab

    rank, world = dist.get_rank(), dist.get_world_size()
    plain, recorded = _sharded(), _sharded()
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, recorded)]
    rec = ddplab.record(recorded, steps=range(1, 4), out=out if rank == 0 else None)
    seen, counting = {}, [None]  # step -> [(op, bytes)] of the recorded replica's calls
    real = dist.all_gather_single, dist.reduce_scatter_single

    def all_gather_single(output_tensor, input_tensor, *args, **kwargs):
        if counting[0] is not None:
            seen.setdefault(counting[0], []).append((AG, output_tensor.numel() * output_tensor.element_size()))
            if kwargs.get("async_op"):
                seen.setdefault("async", []).append(counting[0])
        return real[0](output_tensor, input_tensor, *args, **kwargs)

    def reduce_scatter_single(output, input, *args, **kwargs):
        if counting[0] is not None:
            seen.setdefault(counting[0], []).append((RS, input.numel() * input.element_size()))
        return real[1](output, input, *args, **kwargs)

    g = torch.Generator().manual_seed(100 + rank)
    dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
    try:
        for step in range(steps):
            x = torch.randn(8, 12, generator=g)
            for model, opt in zip((plain, recorded), opts):
                counting[0] = step if model is recorded else None
                if step == 1:  # block b's forward all-gather asked for before the step's forward
                    counting[0] = "before" if model is recorded else None
                    model.b.unshard(async_op=True)
                    counting[0] = step if model is recorded else None
                if step == 2:
                    with torch.no_grad():  # validation: not a step
                        counting[0] = "eval" if model is recorded else None
                        model(x)
                        counting[0] = step if model is recorded else None
                loss = model(x).square().mean()
                if step == 3:  # block a's backward all-gather asked for early, asynchronously (public API)
                    model.a.unshard(async_op=True)
                loss.backward()
                opt.step()
                opt.zero_grad()
            counting[0] = None
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = real
    tl = rec.timeline  # finished by itself at step 3's optimizer step
    paths = rec.wait()
    same = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(plain.parameters(), recorded.parameters()))
    return {"timeline": None if tl is None else tl.to_dict(), "seen": seen, "same": same, "paths": paths,
            "padded": _padded_bytes(world)}


def test_recorded_collectives_are_fsdps_per_step_and_unit_with_the_units_padded_bytes(cluster2):
    from ddplab.timeline import Timeline

    r0, r1 = cluster2.run(train_fsdp)
    assert r1["timeline"] is None  # rank 0 gathers
    assert r0["same"] and r1["same"], "recording changed training (the shards differ bitwise)"
    tl = Timeline.from_dict(r0["timeline"])
    assert tl.strategy == "fully_shard" and tl.world_size == 2
    padded = r0["padded"]
    assert sorted(u["unit"] for u in tl.meta["fsdp_units"]) == sorted(padded)
    # steps are optimizer steps: steps 1-3 recorded on both ranks, the validation forward in none
    assert sorted((it.rank, it.iteration) for it in tl.iterations) == [(r, i) for r in (0, 1) for i in (1, 2, 3)]
    (eval_step, eval_start, eval_end, eval_gathers), = tl.meta["forwards_without_backward"]
    assert eval_step == 2 and eval_gathers == len(r0["seen"]["eval"]) == len(padded)
    assert eval_end <= tl.iteration(0, 2).start  # before step 2's first forward with gradients
    assert r0["seen"]["async"] == r1["seen"]["async"] == ["before", 3]  # the asynchronous all-gathers
    # the one made before step 1's forward: listed, not drawn in the step
    assert [c[:3] for c in tl.meta["collectives_outside_steps"]] == [[1, AG, "b"]]
    assert tl.meta["collectives_outside_steps"][0][3] <= tl.iteration(0, 1).start
    for rank, r in ((0, r0), (1, r1)):
        for step in (1, 2, 3):
            calls = tl.buckets_of(rank, step)
            # (a) what FSDP issued, as torch.distributed saw it, call by call
            assert [(b.params[0], b.nbytes) for b in calls] == [tuple(c) for c in r["seen"][step]], (rank, step)
            # (a) from the model's structure: every unit all-gathers before its forward, the blocks
            # (resharded after forward; the root is not) again before their backward, and every unit
            # reduce-scatters once. After a no_grad forward the root is still unsharded (it only
            # reshards after backward), so step 2's forward does not gather it.
            per_unit = {}
            for b in calls:
                per_unit.setdefault((b.params[2], b.params[0], b.params[1]), []).append(b)
            expected = {("a", AG, "forward"): 1, ("b", AG, "forward"): 1, ("a", AG, "backward"): 1,
                        ("b", AG, "backward"): 1, ("a", RS, "backward"): 1, ("b", RS, "backward"): 1,
                        ("(root)", RS, "backward"): 1, ("(root)", AG, "forward"): 1}
            if step == 2:
                del expected[("(root)", AG, "forward")]
            if step == 1:  # gathered before the step began: b's own pre-forward unshard is then a no-op
                del expected[("b", AG, "forward")]
            assert {k: len(v) for k, v in per_unit.items()} == expected, (rank, step)
            # (b) bytes: the unit's padded flat parameters
            assert all(b.nbytes == padded[b.params[2]] for b in calls), (rank, step)
            # stamps: launched before done; forward's all-gathers inside forward, the rest after it
            it = tl.iteration(rank, step)
            fwd, bwd = it.phases["forward"], it.phases["backward"]
            assert fwd[1] <= bwd[0] + 1e-9 and it.sources["backward"] == "derived"
            for b in calls:
                assert b.comm_end is not None and b.launch <= b.comm_end, b
                inside = fwd if b.params[1] == "forward" else bwd
                assert inside[0] - 1e-6 <= b.launch and b.comm_end <= inside[1] + 1e-6, (b, inside)


def fsdp_state_after(ending):
    """Record, end as ``ending`` says, and report whether what was patched is back: each FSDP
    group's comm objects (the very ones before record()), the root's forward hooks and torch's
    global optimizer-step hooks. Then one more step must train as it did."""
    import torch
    from torch.optim import optimizer as optim_module

    import ddplab
    from ddplab.measure.recording_fsdp import param_groups

    fail = {}
    model = _sharded(fail)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def snapshot():
        return ([(id(g._all_gather_comm), id(g._reduce_scatter_comm)) for g in param_groups(model)],
                len(model._forward_pre_hooks), len(model._forward_hooks),
                len(optim_module._global_optimizer_pre_hooks), len(optim_module._global_optimizer_post_hooks))

    def step():
        model(torch.ones(4, 12)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    before = snapshot()
    rec = ddplab.record(model, steps=range(0, 2))
    during = snapshot()
    raised, finish_says, at_once = None, None, None
    if ending == "finished by itself":
        step()
        step()
    elif ending == "finish() after a shorter loop":
        step()
        rec.finish()
    else:  # an exception inside step 1: in a block's forward, or in its backward
        step()
        fail[ending] = True
        try:
            step()
        except RuntimeError as e:
            raised = str(e)
        at_once = snapshot()  # before anything else runs
        fail[ending] = False
        model.reset_iter_state()  # torch's recovery after a failed forward or backward (FSDPModule)
        try:
            rec.finish()
        except RuntimeError as e:
            finish_says = str(e)
        with pytest.raises(RuntimeError, match="nothing will be written"):
            rec.wait()
    after = snapshot()
    step()  # trains again, through FSDP's own comms
    return {"before": before, "during": during, "after": after, "raised": raised, "finish_says": finish_says,
            "at_once": at_once,
            "failed": getattr(rec, "failed", None), "finished": rec.finished}


@pytest.mark.parametrize("ending", ["finished by itself", "finish() after a shorter loop", "forward", "backward"])
def test_what_was_patched_is_put_back_after_finish_and_after_a_step_raises(cluster2, ending):
    for r in cluster2.run(fsdp_state_after, ending):
        assert r["during"] != r["before"]  # the recorder did patch something
        assert r["after"] == r["before"], r
        assert r["finished"]
        if ending in ("forward", "backward"):
            assert r["raised"] == f"planted {ending} error"
            # a forward's error is seen by the root's always_call hook: put back at once; a
            # backward's when its end never came (here at finish(), else the next forward or step)
            assert (r["at_once"] == r["before"]) == (ending == "forward"), r
            assert r["failed"] and r["finish_says"] == r["failed"] and "stopped at step 1" in r["failed"]
        else:
            assert r["raised"] is None and r["failed"] is None


def record_ddp(out):
    """The same model under DistributedDataParallel, recorded for 3 steps (steps 1-3)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddplab

    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = ddplab.record(model, steps=range(1, 4), out=out if dist.get_rank() == 0 else None)
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        model(torch.randn(8, 12, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return rec.wait()


def test_the_three_files_and_a_page_beside_a_ddp_run_of_the_same_model(cluster2, tmp_path):
    import json

    import ddplab
    from ddplab.measure.recording import load_run

    fsdp, ddp = tmp_path / "fsdp", tmp_path / "ddp"
    r0, _ = cluster2.run(train_fsdp, 4, str(fsdp))
    assert set(r0["paths"]) == {"json", "trace", "html"}
    for suffix in (".json", ".trace.json", ".html"):
        assert fsdp.with_suffix(suffix).is_file(), suffix
    tl = load_run(fsdp.with_suffix(".json"))
    trace = json.loads(fsdp.with_suffix(".trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {AG, RS} <= tracks and "communication" not in tracks  # no empty row: each op has its own
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "communication"]
    assert len(slices) == len(tl.buckets)
    cluster2.run(record_ddp, str(ddp))
    page = tmp_path / "both.html"
    figures = ddplab.view(str(ddp.with_suffix(".json")), str(fsdp.with_suffix(".json")), out=str(page))
    html = page.read_text()
    assert "ddp (torch DDP)" in html and "fsdp (torch fully_shard)" in html
    side_by_side = figures[0]
    rows = {y for trace in side_by_side.data for y in trace.y}
    # DDP's all-reduces on one comm row per rank; FSDP's collectives on rows of their own
    assert {"rank 0 comm", "rank 1 comm", "rank 0 all-gather", "rank 0 reduce-scatter",
            "rank 1 all-gather", "rank 1 reduce-scatter"} <= rows
    # the bytes figure beside a sharded run: sent per rank on a ring, from torch's own calls (FSDP:
    # (p-1)/p of each all-gather's output and reduce-scatter's input; DDP: 2(p-1)/p of every
    # parameter's bytes, all-reduced once), never the buffers summed across ops
    import statistics

    metrics = figures[1]
    assert metrics.layout.annotations[1].text == "sent per rank on a ring, per step (MiB)"
    bars = next(t for t in metrics.data if t.name == "MiB per step")
    fsdp_ring = statistics.median(sum(n for _, n in r0["seen"][step]) / 2 for step in (1, 2, 3))
    ddp_ring = sum(p.numel() * p.element_size() for p in _net().parameters()) * 2 / 2
    assert list(bars.x) == ["ddp (torch DDP)", "fsdp (torch fully_shard)"]
    assert list(bars.y) == pytest.approx([ddp_ring / 2**20, fsdp_ring / 2**20])


def record_without(name):
    """record() when torch's FSDPParamGroup lacks ``name`` (as a later torch might): the error,
    and whether anything was patched before it."""
    import torch

    import ddplab
    from ddplab.measure.recording_fsdp import param_groups

    model = _sharded()
    group = param_groups(model)[0]
    kept = getattr(group, name)
    delattr(group, name)  # an instance attribute in torch 2.13 (FSDPParamGroup.__init__)
    try:
        ddplab.record(model, steps=range(0, 1))
    except RuntimeError as e:
        said = str(e)
    else:
        said = None
    finally:
        setattr(group, name, kept)
    untouched = all(type(g._all_gather_comm).__name__ == "DefaultAllGather" for g in param_groups(model))
    return {"said": said, "version": torch.__version__, "untouched": untouched}


def test_a_missing_private_torch_name_is_a_clear_error_naming_the_torch_version(cluster2):
    for r in cluster2.run(record_without, "_reduce_scatter_comm"):
        assert r["said"] is not None and f"torch {r['version']}" in r["said"], r
        assert "FSDPParamGroup._reduce_scatter_comm is not there" in r["said"] and "\n" not in r["said"]
        assert r["untouched"]  # refused before anything was patched


def train_accumulating():
    """On every rank: a recorded and an unrecorded replica, 4 optimizer steps, steps 0-2 recorded
    (step 0's micro-steps come before any optimizer step): 2 micro-steps in step 0, 3 in step 1
    (the first two with ``set_requires_gradient_sync(False)``) after a validation forward WITH
    gradients on (no backward follows it), 2 in step 2. torch.distributed's all-gather and
    reduce-scatter functions are wrapped while the recorded replica runs, counting per micro-step."""
    import torch
    import torch.distributed as dist

    import ddplab

    rank = dist.get_rank()
    plain, recorded = _sharded(), _sharded()
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, recorded)]
    rec = ddplab.record(recorded, steps=range(0, 3))
    seen, counting = {}, [None]  # (step, micro-step or "val") -> [(op, bytes)]
    real = dist.all_gather_single, dist.reduce_scatter_single

    def all_gather_single(output_tensor, input_tensor, *args, **kwargs):
        if counting[0] is not None:
            seen.setdefault(counting[0], []).append((AG, output_tensor.numel() * output_tensor.element_size()))
        return real[0](output_tensor, input_tensor, *args, **kwargs)

    def reduce_scatter_single(output, input, *args, **kwargs):
        if counting[0] is not None:
            seen.setdefault(counting[0], []).append((RS, input.numel() * input.element_size()))
        return real[1](output, input, *args, **kwargs)

    micro = {0: 2, 1: 3, 2: 2, 3: 1}
    g = torch.Generator().manual_seed(200 + rank)
    dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
    try:
        for step in range(4):
            xs = [torch.randn(8, 12, generator=g) for _ in range(micro[step] + 1)]
            for model, opt in zip((plain, recorded), opts):
                mine = model is recorded
                if step == 1:  # validation with gradients on: a forward, no backward
                    counting[0] = (step, "val") if mine else None
                    model.eval()
                    model(xs[-1])
                    model.train()
                for m in range(micro[step]):
                    counting[0] = (step, m) if mine else None
                    if step == 1:
                        model.set_requires_gradient_sync(m == micro[step] - 1)
                    model(xs[m]).square().mean().backward()
                counting[0] = None
                opt.step()
                opt.zero_grad()
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = real
    tl = rec.timeline
    same = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(plain.parameters(), recorded.parameters()))
    return {"timeline": None if tl is None else tl.to_dict(), "seen": {str(k): v for k, v in seen.items()},
            "same": same, "micro": micro}


def test_accumulation_micro_steps_are_one_step_and_a_forward_without_backward_is_left_out(cluster2):
    from ddplab.timeline import Timeline

    r0, r1 = cluster2.run(train_accumulating)
    assert r0["same"] and r1["same"], "recording changed training (the shards differ bitwise)"
    tl = Timeline.from_dict(r0["timeline"])
    micro = {int(k): v for k, v in r0["micro"].items()}
    # steps are optimizer steps, step 0 (before any optimizer step) included; micro-steps counted
    assert sorted((it.rank, it.iteration) for it in tl.iterations) == [(r, i) for r in (0, 1) for i in (0, 1, 2)]
    assert tl.meta["micro_steps"] == {str(s): micro[s] for s in (0, 1, 2)}
    # the forward with gradients on and no backward: listed, its all-gathers counted, not in step 1
    (step, start, end, gathers), = tl.meta["forwards_without_backward"]
    assert step == 1 and gathers == sum(op == AG for op, _ in r0["seen"][str((1, "val"))]) > 0
    for rank, r in ((0, r0), (1, r1)):
        for step in (0, 1, 2):
            per_micro = [r["seen"][str((step, m))] for m in range(micro[step])]
            calls = tl.buckets_of(rank, step)
            # every micro-step's collectives, call by call, and nothing else
            assert [(b.params[0], b.nbytes) for b in calls] == [tuple(c) for cs in per_micro for c in cs], (rank, step)
            it = tl.iteration(rank, step)
            earlier, last = len(calls) - len(per_micro[-1]), it.phases
            # the micro-steps before the last are one phase, drawn as DDP's no_sync; the last one's
            # collectives lie in the step's forward and backward
            lo, hi = it.phases["no_sync"]
            assert it.start <= lo and hi <= it.phases["forward"][0], (rank, step)
            for b in calls[:earlier]:
                assert lo - 1e-6 <= b.launch and b.comm_end <= hi + 1e-6, (b, lo, hi)
            for b in calls[earlier:]:
                inside = last["forward"] if b.params[1] == "forward" else last["backward"]
                assert inside[0] - 1e-6 <= b.launch and b.comm_end <= inside[1] + 1e-6, (b, inside)
            # no gradient is ready for an all-gather: only reduce-scatters say when theirs were
            assert all((b.grads_ready is None) == (b.params[0] == AG) for b in calls), (rank, step)
        # under set_requires_gradient_sync(False) the first two micro-steps of step 1 reduce-scatter nothing
        assert [sum(op == RS for op, _ in r["seen"][str((1, m))]) for m in range(3)] == [0, 0, 3]


CASES = {"a unit under the root": "not the root of its model: .* pass the FSDPNet that holds it as its submodule 'b'",
         "the model, not sharded itself": "Net that is not fully_shard-ed itself, while 2 of its submodules "
                                          "are \\(a, b\\)",
         "one of several roots": "one of several fully_shard roots: .* 1 other root\\(s\\) \\(b\\)"}


def record_what():
    """ddplab.record handed a module that is not the root of a fully_shard-ed model: the errors, and
    whether anything was patched."""
    from torch.distributed.fsdp import fully_shard

    import ddplab
    from ddplab.measure.recording_fsdp import param_groups

    out = {}
    for case in CASES:
        if case == "a unit under the root":
            net = _sharded()
            given = net.b
        else:  # only the blocks sharded: each is a root of its own
            net = _net()
            fully_shard(net.a)
            fully_shard(net.b)
            given = net if case == "the model, not sharded itself" else net.a
        try:
            ddplab.record(given, steps=range(0, 1))
        except TypeError as e:
            said = str(e)
        else:
            said = None
        kinds = {type(g._all_gather_comm).__name__ for g in param_groups(net)}
        out[case] = {"said": said, "untouched": kinds == {"DefaultAllGather"}}
    return out


def test_a_module_that_is_not_the_root_is_refused_naming_the_root(cluster2):
    import re

    for r in cluster2.run(record_what):
        for case, says in CASES.items():
            assert r[case]["said"] is not None and re.search(says, r[case]["said"]), (case, r[case])
            assert "DistributedDataParallel" not in r[case]["said"] and r[case]["untouched"], (case, r[case])
