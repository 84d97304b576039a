"""Labs 06 and 08's graders name each planted mistake (two spellings where a learner has two); solutions pass.

Lab 06: ``checks.hangs.check_agreed_steps`` (a loop that hangs on uneven data).
Lab 08: ``checks.pipeline.check_pipeline_step`` (send/recv between two stages).
Plus the pieces of ``lessons.hangs`` / ``lessons.pipeline`` the labs lean on
that can be checked without the notebooks. Budget: ~1-2 min on 2 ranks (two
planted hangs each wait out a 3 s collective timeout and a rank replacement).
"""

import pytest
import torch
import torch.distributed as dist

import ddplab
from ddplab.checks import CheckFailed
from ddplab.checks import hangs as uneven
from ddplab.checks import mistakes as M
from ddplab.checks import pipeline as PC
from ddplab.lessons import hangs
from ddplab.lessons import pipeline as P

pytestmark = [pytest.mark.timeout(400), pytest.mark.more]


@pytest.fixture
def cluster(cluster2_short):
    return cluster2_short  # shared for the session (conftest.py)


def mistake(check, cluster, fn, **kw):
    if check is PC.check_pipeline_step:
        kw.setdefault("timeout", 2.0)  # a planted recv without its send waits this long
    with pytest.raises(CheckFailed) as info:
        check(cluster, fn, **kw)
    return info.value.mistake


# -- lab 06: agreed_steps -------------------------------------------------------------------
def steps_min(n):
    t = torch.tensor([n])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t)


def steps_gather_min(n):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, n)
    return torch.tensor(min(everyone))  # a one-element tensor is accepted


def steps_own(n):
    return n


def steps_own_reduced_copy(n):
    t = torch.tensor([n])
    dist.all_reduce(t.clone(), op=dist.ReduceOp.MIN)  # reduced a copy, kept its own count
    return int(t)


def steps_max(n):
    t = torch.tensor([n])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def steps_gather_max(n):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, n)
    return max(everyone)


def steps_sum(n):
    t = torch.tensor([n])
    dist.all_reduce(t)
    return t


def steps_sum_gathered(n):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, n)
    return sum(everyone)


def steps_mean(n):
    t = torch.tensor([float(n)])
    dist.all_reduce(t)
    return round(float(t) / dist.get_world_size())


def steps_text(n):
    return f"{n} steps"


def steps_only_rank0(n):
    t = torch.tensor([n])
    if dist.get_rank() == 0:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t)


def steps_stub(n):
    raise NotImplementedError


@pytest.mark.parametrize("fn", [steps_min, steps_gather_min])
def test_agreed_steps_solutions_pass_and_training_ends(cluster, fn):
    out = uneven.check_agreed_steps(cluster, fn)
    assert out["answers"][0] == [5, 9, 4] and out["weights_equal"] and out["skipped"] == [0, 2]
    assert uneven.passed["agreed_steps"] is True


@pytest.mark.parametrize("fn,named", [
    (steps_own, uneven.OWN_COUNT), (steps_own_reduced_copy, uneven.OWN_COUNT),
    (steps_max, uneven.MAXIMUM), (steps_gather_max, uneven.MAXIMUM),
    (steps_sum, uneven.SUMMED), (steps_sum_gathered, uneven.SUMMED),
    (steps_mean, uneven.NOT_MIN), (steps_text, uneven.NOT_A_NUMBER),
    (steps_stub, M.NOT_IMPLEMENTED)])
def test_agreed_steps_mistakes_are_named(cluster, fn, named):
    assert mistake(uneven.check_agreed_steps, cluster, fn) == named
    assert uneven.passed["agreed_steps"] is False


@pytest.mark.slow
def test_agreed_steps_collective_on_one_rank_is_a_hang_and_the_cluster_recovers(cluster):
    assert mistake(uneven.check_agreed_steps, cluster, steps_only_rank0) == M.HUNG
    assert cluster.run(steps_min, 3) == [3, 3]


@pytest.mark.slow
def test_uneven_loop_hangs_and_join_does_not(cluster):
    counts = uneven.counts_for(2)[0]
    with pytest.raises(ddplab.CollectiveTimeout):
        cluster.run(uneven.train_all_batches_on_rank, counts)
    assert [r["steps"] for r in cluster.run(hangs.join_on_rank, counts)] == counts


# -- lab 08: the pipeline step --------------------------------------------------------------
def _rank1_tail(stage, y, act_shape, grad_of=lambda h: h.grad, scale_loss=1.0, detach_input=False,
                needs_grad=True):
    h = torch.empty(act_shape, dtype=y.dtype)
    dist.recv(h, src=0)
    if needs_grad:
        h.requires_grad_()
    loss = P.loss_fn(stage(h.detach() if detach_input else h), y)
    loss.backward()
    dist.send(grad_of(h), dst=0)
    return loss.detach() * scale_loss


def _rank0(stage, x, backward=lambda h, g: h.backward(g), after=None):
    h = stage(x)
    dist.send(h.detach(), dst=1)
    grad_h = torch.empty_like(h)
    dist.recv(grad_h, src=1)
    backward(h, grad_h)
    if after:
        after(stage)


def pipe_good(stage, x, y, act_shape):
    if dist.get_rank() == 0:
        return _rank0(stage, x)
    return _rank1_tail(stage, y, act_shape)


def pipe_isend(stage, x, y, act_shape):  # the async spelling
    if dist.get_rank() == 0:
        h = stage(x)
        dist.isend(h.detach(), 1).wait()
        g = torch.empty_like(h)
        dist.irecv(g, 1).wait()
        h.backward(g)
        return None
    h = torch.empty(act_shape, dtype=y.dtype, requires_grad=False)
    dist.irecv(h, 0).wait()
    h.requires_grad_(True)
    loss = P.loss_fn(stage(h), y)
    loss.backward()
    dist.isend(h.grad, 0).wait()
    return loss.item()


def pipe_no_requires_grad(stage, x, y, act_shape):
    if dist.get_rank() == 0:
        return _rank0(stage, x)
    return _rank1_tail(stage, y, act_shape, needs_grad=False)


def pipe_detached_input(stage, x, y, act_shape):
    if dist.get_rank() == 0:
        return _rank0(stage, x)
    return _rank1_tail(stage, y, act_shape, detach_input=True)


def pipe_no_backward0(stage, x, y, act_shape):
    if dist.get_rank() == 0:
        return _rank0(stage, x, backward=lambda h, g: None)
    return _rank1_tail(stage, y, act_shape)


def pipe_grads_cleared0(stage, x, y, act_shape):
    if dist.get_rank() == 0:
        return _rank0(stage, x, after=lambda s: s.zero_grad())
    return _rank1_tail(stage, y, act_shape)


def pipe_own_loss0(stage, x, y, act_shape):
    if dist.get_rank() == 0:
        return _rank0(stage, x, backward=lambda h, g: h.sum().backward())
    return _rank1_tail(stage, y, act_shape)


def pipe_doubled_grad(stage, x, y, act_shape):
    if dist.get_rank() == 0:
        return _rank0(stage, x, backward=lambda h, g: h.backward(2 * g))
    return _rank1_tail(stage, y, act_shape)


def pipe_sent_twice(stage, x, y, act_shape):
    if dist.get_rank() == 0:
        h = stage(x)
        dist.send(h.detach(), dst=1)
        dist.send(h.detach(), dst=1)  # "to be safe"
        g = torch.empty_like(h)
        dist.recv(g, src=1)
        h.backward(g)
        return None
    spare = torch.empty(act_shape, dtype=y.dtype)
    dist.recv(spare, src=0)
    return _rank1_tail(stage, y, act_shape)


def pipe_grad_in_float32(stage, x, y, act_shape):
    if dist.get_rank() == 0:
        h = stage(x)
        dist.send(h.detach(), dst=1)
        g = torch.empty(h.shape, dtype=torch.float32)
        dist.recv(g, src=1)
        h.backward(g.to(h.dtype))
        return None
    return _rank1_tail(stage, y, act_shape, grad_of=lambda h: h.grad.float())


def pipe_no_loss(stage, x, y, act_shape):
    if dist.get_rank() == 0:
        return _rank0(stage, x)
    _rank1_tail(stage, y, act_shape)
    return None


def pipe_loss_times_two(stage, x, y, act_shape):
    if dist.get_rank() == 0:
        return _rank0(stage, x)
    return _rank1_tail(stage, y, act_shape, scale_loss=2.0)


def pipe_never_sends_back(stage, x, y, act_shape):
    if dist.get_rank() == 0:
        return _rank0(stage, x)
    h = torch.empty(act_shape, dtype=y.dtype)
    dist.recv(h, src=0)
    return P.loss_fn(stage(h), y).detach()


def pipe_stub(stage, x, y, act_shape):
    raise NotImplementedError


@pytest.mark.parametrize("fn", [pipe_good, pipe_isend, P.pipeline_step])
def test_pipeline_solutions_pass(cluster, fn):
    per_rank = PC.check_pipeline_step(cluster, fn)
    assert per_rank[0]["sent"] == per_rank[1]["sent"] == 6 * P.HIDDEN * 4  # the last round: float32
    assert PC.passed["pipeline"] is True


@pytest.mark.parametrize("fn,named", [
    pytest.param(pipe_no_requires_grad, PC.NO_REQUIRES_GRAD, marks=pytest.mark.slow),
    pytest.param(pipe_detached_input, PC.NO_REQUIRES_GRAD, marks=pytest.mark.slow),
    (pipe_no_backward0, PC.NO_STAGE0_BACKWARD), (pipe_grads_cleared0, PC.NO_STAGE0_BACKWARD),
    (pipe_own_loss0, PC.WRONG_GRADIENTS), (pipe_doubled_grad, PC.WRONG_GRADIENTS),
    (pipe_sent_twice, PC.WRONG_BYTES), (pipe_grad_in_float32, PC.DTYPE_MISMATCH),
    (pipe_no_loss, PC.NO_LOSS), (pipe_loss_times_two, PC.NO_LOSS),
    (pipe_stub, M.NOT_IMPLEMENTED)])
def test_pipeline_mistakes_are_named(cluster, fn, named):
    assert mistake(PC.check_pipeline_step, cluster, fn) == named
    assert PC.passed["pipeline"] is False


@pytest.mark.slow
def test_pipeline_recv_without_send_is_a_hang(cluster):
    assert mistake(PC.check_pipeline_step, cluster, pipe_never_sends_back, timeout=2.0) == M.HUNG
    assert cluster.run(steps_min, 2) == [2, 2]


# -- the experiments behind the labs --------------------------------------------------------
def _counted_without_patching():
    import torch
    from torch.distributed import irecv, isend  # bound before the block: nothing to patch

    before = (dist.send, dist.recv, dist.isend, dist.irecv)
    peer = 1 - dist.get_rank()
    with P.p2p_counting() as counted:
        same = (dist.send, dist.recv, dist.isend, dist.irecv) == before
        works = [isend(torch.ones(4), peer), irecv(torch.empty(4), peer)]
        in_flight = counted.unwaited
        for w in works:
            w.wait()
        ops = [dist.P2POp(dist.isend, torch.ones(4), peer),
               dist.P2POp(dist.irecv, torch.empty(4), peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return same, in_flight, counted.as_dict()


def test_p2p_counting_sees_imported_names_and_batched_ops_with_nothing_patched(cluster):
    # Before: p2p_counting replaced dist.send/recv/isend/irecv, so names bound earlier and
    # batch_isend_irecv went uncounted. Now the observing process group counts every op.
    for same, in_flight, c in cluster.run(_counted_without_patching):
        assert same and in_flight == 2
        assert c["sends"] == c["recvs"] == 2 and c["sent"] == c["received"] == 32, c
        assert c["unwaited"] == 0


def test_crossover_from_two_points_and_refuses_flat_traffic():
    assert P.crossover_batch(1000, 100, 10, 1000, 100) == pytest.approx(100)
    with pytest.raises(ValueError, match="did not grow"):
        P.crossover_batch(1000, 500, 10, 500, 100)


def test_nccl_aliases_read_from_the_installed_header():
    aliases = hangs.nccl_env_aliases()
    if not aliases:
        pytest.skip("this torch wheel ships no ProcessGroupNCCL.hpp")
    assert aliases["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == ["NCCL_ASYNC_ERROR_HANDLING"]
    assert aliases["TORCH_NCCL_BLOCKING_WAIT"] == ["NCCL_BLOCKING_WAIT"]
    assert all(name.startswith("TORCH_NCCL_") for name in aliases)


def test_bad_options_say_what_to_do():
    with pytest.raises(ValueError, match="option must be one of"):
        hangs.unused_branch_on_rank("find_unused")
    with pytest.raises(TypeError):
        uneven.check_agreed_steps(None, 3)
    with pytest.raises(TypeError):
        PC.check_pipeline_step(None, "step")
