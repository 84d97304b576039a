"""Lab 05: the sampler and batch-statistics graders name each planted mistake (two spellings
each); the lessons' claims hold both ways on live ranks (resume, buffers, DCP). Budget ~60 s."""
import math

import pytest
import torch
import torch.distributed as dist

from ddplab import checks
from ddplab.checks import data as D
from ddplab.lessons import checkpoints as ckpt
from ddplab.lessons import data

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster(cluster2):
    return cluster2  # shared for the session (conftest.py)


# -- sampler ------------------------------------------------------------------------------
def sampler_ok(n, world, rank, drop_last=False):
    idx = list(range(n))
    total = (n // world) * world if drop_last else math.ceil(n / world) * world
    idx = (idx * math.ceil(total / n))[:total] if total > n else idx[:total]
    return idx[rank::world]


def sampler_no_pad(n, world, rank, drop_last=False):
    return list(range(n))[rank::world]


def sampler_no_pad_blocks(n, world, rank, drop_last=False):
    size = math.ceil(n / world)
    return list(range(n))[rank * size:(rank + 1) * size]


def sampler_pad_end(n, world, rank, drop_last=False):
    idx = list(range(n))
    if drop_last:
        idx = idx[:(n // world) * world]
    while len(idx) % world:
        idx.append(n - 1)  # repeats the LAST index
    return idx[rank::world]


def sampler_pad_reversed(n, world, rank, drop_last=False):
    idx = list(range(n))
    if drop_last:
        idx = idx[:(n // world) * world]
    total = math.ceil(len(idx) / world) * world
    idx += list(reversed(idx))[: total - len(idx)]
    return idx[rank::world]


def sampler_blocks(n, world, rank, drop_last=False):
    total = (n // world) * world if drop_last else math.ceil(n / world) * world
    idx = (list(range(n)) * math.ceil(total / n))[:total]
    size = total // world
    return idx[rank * size:(rank + 1) * size]


def sampler_blocks_numpy_style(n, world, rank, drop_last=False):
    total = (n // world) * world if drop_last else math.ceil(n / world) * world
    idx = torch.arange(total) % n
    return idx.view(world, -1)[rank].tolist()


def sampler_ignores_drop_last(n, world, rank, drop_last=False):
    return sampler_ok(n, world, rank, False)


def sampler_ignores_drop_last_kw(n, world, rank, **kw):
    return sampler_ok(n, world, rank)


def test_sampler_solution_passes():
    checks.check_sampler_indices(sampler_ok)
    assert checks.graders.passed["sampler"]


@pytest.mark.parametrize("fn,name", [
    (sampler_no_pad, D.NO_PADDING), (sampler_no_pad_blocks, D.NO_PADDING),
    (sampler_pad_end, D.PAD_FROM_END), (sampler_pad_reversed, D.PAD_FROM_END),
    (sampler_blocks, D.BLOCKS), (sampler_blocks_numpy_style, D.BLOCKS),
    (sampler_ignores_drop_last, D.DROP_LAST_IGNORED), (lambda n, w, r, d: sampler_ok(n, w, r), D.DROP_LAST_IGNORED),
])
def test_sampler_mistakes_are_named(fn, name):
    with pytest.raises(checks.CheckFailed) as info:
        checks.check_sampler_indices(fn)
    assert info.value.mistake == name
    assert not checks.graders.passed["sampler"]


# -- batch statistics ---------------------------------------------------------------------
def stats_ok(x):
    packed = torch.cat([x.sum(0), (x * x).sum(0), torch.tensor([float(len(x))], dtype=x.dtype)])
    dist.all_reduce(packed)
    c = x.shape[1]
    mean = packed[:c] / packed[-1]
    return mean, packed[c:2 * c] / packed[-1] - mean ** 2


def stats_two_pass(x):
    n = torch.tensor([float(len(x))], dtype=x.dtype)
    s = x.sum(0)
    dist.all_reduce(n)
    dist.all_reduce(s)
    mean = s / n
    sq = ((x - mean) ** 2).sum(0)
    dist.all_reduce(sq)
    return mean, sq / n


def stats_local(x):
    return x.mean(0), x.var(0, unbiased=False)


def stats_local_computed(x):
    mean = x.sum(0) / x.shape[0]
    return mean, ((x - mean) ** 2).mean(0)


def stats_mean_of_means(x):
    m, v = x.mean(0), x.var(0, unbiased=False)
    dist.all_reduce(m)
    dist.all_reduce(v)
    return m / dist.get_world_size(), v / dist.get_world_size()


def stats_mean_of_means_packed(x):
    both = torch.cat([x.mean(0), x.var(0, unbiased=False)])
    dist.all_reduce(both)
    both /= dist.get_world_size()
    return both[:3], both[3:]


def stats_mean_of_vars(x):
    mean, _ = stats_ok(x)
    sq = ((x - x.mean(0)) ** 2).sum(0)  # squares around this rank's OWN mean
    n = torch.tensor([float(len(x))], dtype=x.dtype)
    dist.all_reduce(sq)
    dist.all_reduce(n)
    return mean, sq / n


def _weighted_mean_of_vars(x):
    v = x.var(0, unbiased=False)
    dist.all_reduce(v)
    return v / dist.get_world_size()


def stats_mean_of_vars_simple(x):
    mean, _ = stats_ok(x)
    return mean, _weighted_mean_of_vars(x)


def stats_unbiased(x):
    mean, var = stats_ok(x)
    n = torch.tensor([float(len(x))], dtype=x.dtype)
    dist.all_reduce(n)
    return mean, var * n / (n - 1)


def stats_unbiased_two_pass(x):
    n = torch.tensor([float(len(x))], dtype=x.dtype)
    s = x.sum(0)
    dist.all_reduce(n)
    dist.all_reduce(s)
    mean = s / n
    sq = ((x - mean) ** 2).sum(0)
    dist.all_reduce(sq)
    return mean, sq / (n - 1)


def stats_stub(x):
    raise NotImplementedError  # your code here


@pytest.mark.parametrize("fn", [stats_ok, stats_two_pass])
def test_batch_stats_solutions_pass(cluster, fn):
    checks.check_batch_stats(cluster, fn)
    assert checks.graders.passed["batch_stats"]


@pytest.mark.parametrize("fn,name", [
    (stats_stub, "not implemented yet"),
    (stats_local, D.LOCAL_STATS), (stats_local_computed, D.LOCAL_STATS),
    (stats_mean_of_means, D.MEAN_OF_MEANS), (stats_mean_of_means_packed, D.MEAN_OF_MEANS),
    (stats_mean_of_vars, D.MEAN_OF_VARS), (stats_mean_of_vars_simple, D.MEAN_OF_VARS),
    (stats_unbiased, D.UNBIASED), (stats_unbiased_two_pass, D.UNBIASED),
])
def test_batch_stats_mistakes_are_named(cluster, fn, name):
    with pytest.raises(checks.CheckFailed) as info:
        checks.check_batch_stats(cluster, fn)
    assert info.value.mistake == name
    assert not checks.graders.passed["batch_stats"]


# -- the lessons' claims, both ways ------------------------------------------------------
def test_resume_equals_uninterrupted_only_with_the_optimizer_state(cluster, tmp_path):
    full = cluster.run(ckpt.resume_on_rank, str(tmp_path / "a.pt"), save_optimizer=True)
    bare = cluster.run(ckpt.resume_on_rank, str(tmp_path / "b.pt"), save_optimizer=False)
    assert all(r["gap"] < 1e-12 for r in full)
    assert all(r["gap"] > 1e-6 for r in bare)
    assert full[0]["keys_wrapper"] == ["module." + k for k in full[0]["keys_module"]]


def test_buffers_are_rank0s_only_when_synced(cluster):
    on = cluster.run(ckpt.bn_buffers_on_rank, True)
    off = cluster.run(ckpt.bn_buffers_on_rank, False)
    assert torch.equal(on[0]["running_mean"], on[1]["running_mean"])
    assert float((off[0]["running_mean"] - off[1]["running_mean"]).abs().max()) > 0.1
    assert list(ckpt.sync_buffers_kwarg(True)) == ["forward_sync_buffers"]  # torch 2.13's name


def test_dcp_writes_one_file_per_rank_and_loads_back(cluster, tmp_path):
    out = cluster.run(ckpt.dcp_on_rank, str(tmp_path / "dcp"))
    assert sorted(out[0]["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert all(o["equal"] for o in out)


def test_set_epoch_changes_the_order_and_its_absence_repeats_it(cluster):
    without = cluster.run(data.shards_on_rank, 16, 2, set_epoch=False)
    with_it = cluster.run(data.shards_on_rank, 16, 2, set_epoch=True)
    assert all(e[0] == e[1] for e in without) and all(e[0] != e[1] for e in with_it)
    assert sorted(without[0][0] + without[1][0]) == list(range(16))


def test_syncbn_refuses_cpu_tensors_in_training_and_is_a_batchnorm_in_eval(cluster):
    assert "GPU" in cluster.run(ckpt.syncbn_refusal)[0]
    assert cluster.run(ckpt.syncbn_eval_gap)[0] == 0.0


def test_a_ddp_step_is_a_step_on_the_global_batch(cluster):
    ranks = cluster.run(data.ddp_step_on_rank, 4, 0.1)
    assert data.max_gap(ranks[0], ranks[1]) == 0.0
    assert data.max_gap(ranks[0], data.one_process_step(8, 0.1)) < 1e-12
    assert data.max_gap(ranks[0], data.one_process_step(4, 0.1)) > 1e-6
