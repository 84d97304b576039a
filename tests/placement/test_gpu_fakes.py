"""GPU paths that cannot run here, run against fakes of what a GPU machine does.

No GPU is needed: an NCCL rank is faked by telling ddplab's strict device check
that the group's gradients go through nccl (``make test-gpu`` sets
DDPLAB_REQUIRE_DEVICE_GRADS=1, which then refuses CPU gradient tensors).
"""
import pytest

import ddplab


def _as_nccl_rank():
    """On this rank, make the strict check believe gradients travel over NCCL."""
    from ddplab.pg import backend
    from ddplab.sync import comm

    assert comm.REQUIRE_DEVICE_GRADS
    backend.backend_name = lambda group=None: "nccl"


def _cpu_models_made_on_purpose():
    import torch

    from ddplab.checks import workload
    from ddplab.lessons import hangs, pipeline
    from ddplab.sync import comm

    _as_nccl_rank()
    with pytest.raises(RuntimeError, match="stayed on the CPU"):  # the check itself still bites
        comm.all_reduce(torch.ones(2))
    out = {"grader": len(workload.references(2)["torch_ddp"]),
           "traffic": pipeline.ddp_traffic_on_rank(4, steps=1)["calls"],
           "straggler": hangs.straggler_no_sync_on_rank(True, micro_batches=2, delay_s=0.001,
                                                        steps=1, n_params=2e3)["step_ms"] > 0}
    return out


@pytest.mark.slow
@pytest.mark.more
def test_cpu_models_built_on_purpose_pass_the_strict_device_check_of_an_nccl_rank():
    # These build CPU models on purpose and a 1-GPU machine runs them: the graders' float64
    # torch-DDP reference, lab 08's traffic count, lab 06's straggler. torch DDP is drawn from
    # the process group now (not through ddplab.sync.comm), and none of them may raise.
    with ddplab.Cluster(1, env={"DDPLAB_REQUIRE_DEVICE_GRADS": "1"}) as c:
        (out,) = c.run(_cpu_models_made_on_purpose)
    assert out == {"grader": 2, "traffic": 1, "straggler": True}


def _gpu_marks(node) -> list[int]:
    """GPUs asked for by ``pytest.mark.gpu`` / ``gpu(N)`` decorators on ``node`` (a def)."""
    import ast

    need = []
    for dec in node.decorator_list:
        call = dec if isinstance(dec, ast.Call) else None
        target = call.func if call else dec
        if isinstance(target, ast.Attribute) and target.attr == "gpu":
            args = call.args if call else []
            need.append(args[0].value if args and isinstance(args[0], ast.Constant) else 1)
    return need


def test_every_gpu_test_asks_for_as_many_gpus_as_ranks_it_launches():
    # A test marked for one GPU that starts 2 NCCL ranks fails on every 1-GPU machine
    # (NCCL refuses two ranks on one GPU), so make test-gpu could never pass there.
    import ast
    import pathlib
    import re

    wrong = []
    for path in sorted(pathlib.Path(__file__).parents[1].rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or not _gpu_marks(node):
                continue
            launched = [int(m) for c in ast.walk(node) if isinstance(c, ast.Constant)
                        and isinstance(c.value, str)
                        for m in re.findall(r"--nproc[-_]per[-_]node[= ](\d+)", c.value)]
            if launched and max(launched) > min(_gpu_marks(node)):
                wrong.append(f"{path.name}::{node.name} launches {max(launched)} per node, "
                             f"marked gpu({min(_gpu_marks(node))})")
    assert not wrong, wrong


class _QueuedWork:
    """What NCCL hands back for a device tensor: its future is complete once the collective
    is queued on the GPU (torch's CUDA futures), long before the transfer has run."""

    def __init__(self):
        import torch

        self.future = torch.futures.Future()
        self.future.set_result([None])

    def get_future(self):
        return self.future

    def wait(self, timeout=None):
        return True


def test_a_device_tensors_host_completion_stamp_is_called_enqueued_not_done(monkeypatch):
    import torch
    import torch.distributed as dist

    from ddplab.sync import comm

    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None, async_op=False: _QueuedWork())
    rec = comm.ListRecorder()
    comm.all_reduce(torch.empty(4, device="meta"), bucket=0, recorder=rec)  # a device tensor
    comm.all_reduce(torch.empty(4), bucket=1, recorder=rec)  # a CPU tensor (gloo): a real end
    stamps = [(e, info["bucket"]) for e, _, info in rec.events if e in ("done", "enqueued")]
    assert stamps == [("enqueued", 0), ("done", 1)]


def _sparse_on_a_group_that_refuses_sparse():
    import torch
    import torch.distributed as dist
    from torch import nn

    import ddplab
    from ddplab.pg import backend
    from ddplab.sync import comm

    backend.backend_name = lambda group=None: "nccl"
    real = dist.all_reduce

    def nccl_like(tensor, *args, **kwargs):  # the error ProcessGroupNCCL raises
        if tensor.is_sparse:
            raise RuntimeError("NCCL does not support all_reduce with sparse tensors. "
                               "Please use dense tensors instead.")
        return real(tensor, *args, **kwargs)

    dist.all_reduce = nccl_like
    rank = dist.get_rank()
    rows = torch.tensor([[rank, 3, 3 + rank]])  # row 3 on both ranks, twice on rank 0
    t = torch.sparse_coo_tensor(rows, torch.tensor([1.0, 2.0, 4.0]) * (rank + 1), (6,))
    comm.all_reduce(t)
    out = {"sum": t.to_dense().tolist()}
    for wrap in ("bucketed", "manual"):
        torch.manual_seed(0)
        emb = nn.Embedding(6, 2, sparse=True)
        model = ddplab.BucketedDDP(emb) if wrap == "bucketed" else emb
        x = torch.tensor([rank, 4]) if rank == 0 else torch.tensor([1, 1, 5])
        model(x).pow(2).sum().backward()
        if wrap == "manual":
            ddplab.average_gradients(emb)
        want = torch.zeros(6, 2)
        want.index_add_(0, x, 2 * emb.weight.detach()[x])  # this rank's dense gradient
        real(want)
        out[wrap] = torch.allclose(emb.weight.grad.to_dense(), want / 2)
    return out


@pytest.mark.slow
def test_sparse_gradients_are_reduced_on_a_group_that_has_no_sparse_all_reduce():
    with ddplab.Cluster(2, backend="gloo") as c:
        results = c.run(_sparse_on_a_group_that_refuses_sparse)
    # rank 0 sends rows 0, 3, 3 (1, 2, 4); rank 1 rows 1, 3, 4 (2, 4, 8)
    assert results[0]["sum"] == results[1]["sum"] == [1.0, 2.0, 0.0, 10.0, 8.0, 0.0]
    assert all(r["bucketed"] and r["manual"] for r in results), results


# -- host syncs torch's reducer does not make ---------------------------------------------------
class _NoHostReads:
    """Within the block, ``Tensor.tolist`` and ``Tensor.item`` raise: on a GPU each would make
    the host wait for the GPU's queued work (the fake: reading a tensor at all)."""

    def __enter__(self):
        import torch

        self.saved = torch.Tensor.tolist, torch.Tensor.item

        def refuse(t, *a, **k):
            raise AssertionError("a host read of a tensor inside backward")
        torch.Tensor.tolist = torch.Tensor.item = refuse

    def __exit__(self, *exc):
        import torch

        torch.Tensor.tolist, torch.Tensor.item = self.saved


def _find_unused_reads_the_map_only_when_needed():
    import torch
    from torch import nn

    import ddplab

    class Maybe(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x, use_b):
            x = self.a(x)
            return self.b(x) if use_b else x

    torch.manual_seed(0)
    model = ddplab.BucketedDDP(Maybe(), find_unused_parameters=True, bucket_cap_mb=1e-5)
    x = torch.ones(2, 3)
    with _NoHostReads():  # every parameter used: nothing to read back
        model(x, True).sum().backward()
    try:
        with _NoHostReads():  # "b" sat out here: torch reads its map back too
            model(x, False).sum().backward()
        return "no read"
    except AssertionError:
        return "read"


def _overlap_order_read_late():
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddplab.sync.overlap import OverlapDDP

    class Either(nn.Module):  # the data decides which layer runs first
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x, first):
            for name in (("a", "b") if first == "a" else ("b", "a")):
                x = getattr(self, name)(x)
            return x

    OverlapDDP._read_later = staticmethod(lambda check: True)  # the GPU path, on the CPU
    torch.manual_seed(0)
    model = OverlapDDP(Either())
    first = "a" if dist.get_rank() == 0 else "b"
    with _NoHostReads():  # step 0: the orders differ, and nothing is read on the host
        model(torch.ones(2, 3), first).sum().backward()
    try:
        model(torch.ones(2, 3), "a").sum().backward()  # step 1: same order, step 0's answer
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_host_reads_that_torch_does_not_make_are_gone_from_the_reducers():
    with ddplab.Cluster(2, backend="gloo") as c:
        assert c.run(_find_unused_reads_the_map_only_when_needed) == ["read", "read"]
        errors = c.run(_overlap_order_read_late)
    for e in errors:
        assert "different orders in the previous backward" in e and "PREVIOUS step" in e, e


# -- the simulated link on a GPU ------------------------------------------------------------------
def test_on_a_gpu_the_simulated_link_makes_the_stream_wait_for_the_real_transfer():
    import threading
    import time

    import torch

    from ddplab.netsim import LinkModel
    from ddplab.netsim.simulated import SimulatedLink

    class Queued(_QueuedWork):  # NCCL-like: the future is done at once; wait() is a stream wait
        waited_on = None

        def wait(self, timeout=None):
            self.waited_on = threading.current_thread().name
            return True

    # 1 MB takes ~0.8 s; 100 kB ~80 ms (1 kB's 0.8 ms was over before the assert on a busy machine)
    slow = LinkModel(bandwidth_gbps=0.01, latency_us=0.0)
    with SimulatedLink(slow, world_size=2) as link:
        work = Queued()
        linked = link.wrap(work, 100_000, device=torch.device("meta"))  # a device tensor's work
        assert not linked.get_future().done()  # the model holds it back
        linked.get_future().wait()
        assert work.waited_on == "ddplab-simulated-link"  # before completing: the stream waits
        # the host stamp of a device work is enqueue time: never "the real transfer ended"
        time.sleep(0.002)
        late = Queued()
        fast = link.wrap(late, 1, device=torch.device("meta"))
        fast.get_future().wait()
        assert linked.done_stamp()["source"] == fast.done_stamp()["source"] == "simulated"
        cpu_work = link.wrap(_QueuedWork(), 1)  # gloo: the real end is known on the host
        cpu_work.get_future().wait()
        assert cpu_work.done_stamp()["source"] in ("cpu", "simulated")


# -- smaller GPU facts ------------------------------------------------------------------------------
def test_status_names_the_gpu_each_rank_holds_not_its_rank_number():
    import types

    from ddplab.cluster.status import cluster_status

    learner_b = types.SimpleNamespace(  # a learner whose Cluster got GPUs 2 and 3
        _gens=types.SimpleNamespace(ranks=None, closed=True), running=None, pids=[],
        world_size=2, backend="nccl", gpus=(2, 3), timeout=60.0, generation=0)
    assert [r["device"] for r in cluster_status(learner_b).ranks] == ["cuda:2", "cuda:3"]


def _socket_interfaces():
    import os

    return os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")


@pytest.mark.slow
def test_nccls_bootstrap_is_told_to_listen_on_loopback_like_gloo():
    with ddplab.Cluster(1) as c:
        ((gloo, nccl),) = c.run(_socket_interfaces)
    assert gloo and nccl == gloo  # the loopback interface's name, e.g. "lo"


def test_results_reach_the_kernel_without_device_tensors_in_any_torch_container(monkeypatch):
    import collections

    import torch
    from torch import nn

    from ddplab.cluster import results

    moved = []
    real_cpu = torch.Tensor.cpu

    def cpu(t, *a, **k):  # the fake: every tensor counts as a device tensor until moved
        moved.append(t.shape)
        return real_cpu(t, *a, **k)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    Pair = collections.namedtuple("Pair", "loss grad")
    state = nn.Linear(2, 3).state_dict()
    out = results.to_cpu({"state": state, "max": torch.max(torch.ones(2, 3), dim=0),
                          "pair": Pair(torch.zeros(1), torch.ones(4)), "plain": [torch.ones(5)]})
    assert sorted(moved, key=str) == sorted([torch.Size([3, 2]), torch.Size([3]), torch.Size([3]),
                                             torch.Size([3]), torch.Size([1]), torch.Size([4]),
                                             torch.Size([5])], key=str)
    assert type(out["state"]) is type(state) and list(out["state"]) == ["weight", "bias"]
    assert out["state"]._metadata == state._metadata  # load_state_dict still reads it
    assert type(out["max"]).__name__ == "max" and out["max"].indices.shape == (3,)
    assert isinstance(out["pair"], Pair) and out["pair"].grad.shape == (4,)


def _ring_grouped_as_on_nccl():
    import torch
    import torch.distributed as dist

    from ddplab.lessons import ring

    calls = []
    real_batch = dist.batch_isend_irecv

    def batch(ops):
        calls.append(len(ops))
        return real_batch(ops)

    dist.batch_isend_irecv = batch  # every device takes the grouped path now
    try:
        t = torch.arange(10.0) * (dist.get_rank() + 1)
        want = t.clone()
        dist.all_reduce(want)
        ring.ring_all_reduce(t)
    finally:
        dist.batch_isend_irecv = real_batch
    return torch.equal(t, want), calls


@pytest.mark.slow
def test_the_reference_ring_groups_each_send_with_its_receive_for_nccl():
    with ddplab.Cluster(3, backend="gloo") as c:
        for equal, calls in c.run(_ring_grouped_as_on_nccl):
            assert equal and calls == [2] * 4  # 2(p-1) steps, each one send + one receive


def test_a_torchrun_rank_about_to_take_a_gpu_someone_holds_says_so(monkeypatch, capsys):
    from ddplab.launchers.torchrun import warn_if_taken
    from ddplab.placement import gpus
    from ddplab.placement.gpu_facts import GPU

    monkeypatch.setattr(gpus, "discover", lambda: [GPU(0, "H100", "GPU-0", 81559, 9000, (4242,)),
                                                   GPU(1, "H100", "GPU-1", 81559, 3, ())])
    assert warn_if_taken(1, rank=1) is None
    assert "pid(s) 4242" in warn_if_taken(0, rank=0)
    assert "CUDA_VISIBLE_DEVICES naming free GPUs" in capsys.readouterr().err
