"""Lab 00's warm-up (a send/recv pair) and lab 09's exercise (predict torch DDP's buckets):
correct answers written several ways pass, each planted slip is named; gloo's blocking send
waits for its receiver. Budget: ~40 s (3 ranks for lab 00, 2 for lab 09).
"""

import pytest
import torch
import torch.distributed as dist

from ddplab.checks import CheckFailed, check_pass_right
from ddplab.checks import firstgroup as W
from ddplab.checks import reducer_map as B
from ddplab.lessons import ring

pytestmark = pytest.mark.timeout(300)


# -- lab 09: torch's bucket rule -----------------------------------------------------------------
def rule_by_hand(params, bucket_cap_mb=None):
    """A learner's version: one open bucket per dtype, add then close at the limit."""
    mib = 1024 * 1024
    limits = [1 * mib, 25 * mib] if bucket_cap_mb is None else [bucket_cap_mb * mib]
    buckets, open_ = [], {}
    for i in reversed(range(len(params))):
        p = params[i]
        idx, size, k = open_.get(p.dtype, ([], 0, 0))
        idx, size = idx + [i], size + p.numel() * p.element_size()
        if size >= limits[k]:
            buckets.append(idx)
            idx, size, k = [], 0, min(k + 1, len(limits) - 1)
        open_[p.dtype] = (idx, size, k)
    return buckets + [idx for idx, _, _ in open_.values() if idx]


def rule_with_torch(params, bucket_cap_mb=None):
    """Another: torch's own helper, given the parameters in gradient-ready order."""
    limits = ([dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2 ** 20] if bucket_cap_mb is None
              else [int(bucket_cap_mb * 2 ** 20)])
    order = list(reversed(range(len(params))))
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], limits, [False] * len(params), order)
    return [list(b) for b in buckets]


def rule_as_tuples(params, bucket_cap_mb=None):
    """And one returning tuples of numpy-style ints: any sequence of indices is an answer."""
    return tuple(tuple(torch.tensor(b).tolist()) for b in rule_by_hand(params, bucket_cap_mb))


def test_every_slip_changes_the_layout_of_some_case():
    for mistake, switches in B.SLIPS.items():
        differs = [cap for layers, cap in B.CASES
                   if B.layout(list(B.case_model(layers).parameters()), cap, **switches)
                   != B.layout(list(B.case_model(layers).parameters()), cap)]
        assert differs, mistake


@pytest.fixture(scope="module")
def live_buckets(session_cluster2):
    session_cluster2.ensure_ready()
    return session_cluster2.run(B.rebuilt_buckets_on_rank, B.CASES)[0]


@pytest.mark.slow
def test_the_rule_predicts_torchs_live_reducer_and_correct_answers_pass(live_buckets):
    for (layers, cap), want in zip(B.CASES, live_buckets):
        assert B.layout(list(B.case_model(layers).parameters()), cap) == want
    for fn in (rule_by_hand, rule_with_torch, rule_as_tuples):
        B.judge(fn, live_buckets)


@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(B.SLIPS))
def test_each_slip_is_named(live_buckets, mistake):
    def slipped(params, bucket_cap_mb):
        return B.layout(params, bucket_cap_mb, **B.SLIPS[mistake])
    with pytest.raises(CheckFailed) as err:
        B.judge(slipped, live_buckets)
    assert err.value.mistake == mistake


@pytest.mark.slow
def test_a_stub_a_crash_and_a_non_answer_are_verdicts_in_words(live_buckets):
    def stub(params, bucket_cap_mb):
        raise NotImplementedError

    def crash(params, bucket_cap_mb):
        return params[99]

    for fn, mistake in ((stub, "not implemented yet"), (crash, "your code raised an exception"),
                        (lambda params, cap: None, B.NOT_BUCKETS),
                        (lambda params, cap: [list(range(len(params)))], B.WRONG_LAYOUT)):
        with pytest.raises(CheckFailed) as err:
            B.judge(fn, live_buckets)
        assert err.value.mistake == mistake


# -- lab 00: the warm-up pair, and what a blocking send waits for --------------------------------
def pass_isend_first(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    req = dist.isend(t, (rank + 1) % p)
    dist.recv(buf, (rank - 1) % p)
    req.wait()
    return buf


def pass_even_odd(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    if rank % 2 == 0:
        dist.send(t, (rank + 1) % p)
        dist.recv(buf, (rank - 1) % p)
    else:
        dist.recv(buf, (rank - 1) % p)
        dist.send(t, (rank + 1) % p)
    return buf


def pass_irecv_first(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.zeros_like(t)
    req = dist.irecv(buf, (rank - 1) % p)
    dist.send(t, (rank + 1) % p)
    req.wait()
    return buf


def everyone_sends_first(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    dist.send(t, (rank + 1) % p)
    dist.recv(buf, (rank - 1) % p)
    return buf


def from_the_right(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    req = dist.isend(t, (rank - 1) % p)
    dist.recv(buf, (rank + 1) % p)
    req.wait()
    return buf


def returns_nothing(t):
    pass_isend_first(t)


@pytest.fixture
def three(cluster3):
    return cluster3  # shared for the session (conftest.py)


@pytest.mark.slow
def test_warm_up_passes_written_three_ways(three):
    for fn in (pass_isend_first, pass_even_odd, pass_irecv_first):
        check_pass_right(three, fn)


def pass_batched(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, (rank + 1) % p),
                                        dist.P2POp(dist.irecv, buf, (rank - 1) % p)]):
        work.wait()
    return buf


def test_warm_up_judged_for_nccl_takes_only_the_batched_pair(three):
    # lab 00 judges the warm-up as plain torch on NCCL needs it, on these gloo ranks too
    check_pass_right(three, pass_batched, backend="nccl")
    check_pass_right(three, pass_isend_first)  # gloo pairs the ops as they come
    for fn, mistake, note in [
            (pass_isend_first, W.UNBATCHED, "rank 0 called dist.isend to rank 1 outside dist.batch_isend_irecv"),
            (pass_even_odd, W.UNGROUPED, "rank 0 waited for its send to rank 1 before posting its recv")]:
        with pytest.raises(CheckFailed) as err:
            check_pass_right(three, fn, backend="nccl")
        assert err.value.mistake == mistake
        assert note in str(err.value)
    # the rule needs only the backend's name: the same reports, judged for gloo, name another slip
    reports = [{"rank": r, "p": 3, "got": None, "log": {"unbatched": "called dist.isend"}} for r in range(3)]
    for backend, mistake in (("cpu:gloo,cuda:nccl", W.UNBATCHED), ("gloo", W.NOTHING_RETURNED)):
        with pytest.raises(CheckFailed) as err:
            W.diagnose(reports, 7, backend)
        assert err.value.mistake == mistake


@pytest.mark.slow
@pytest.mark.parametrize("fn,mistake", [(everyone_sends_first, W.DEADLOCK),
                                        (from_the_right, W.FROM_THE_RIGHT),
                                        (returns_nothing, W.NOTHING_RETURNED)])
def test_warm_up_names_the_slip_and_leaves_usable_ranks(three, fn, mistake):
    with pytest.raises(CheckFailed) as err:
        check_pass_right(three, fn, timeout=2.0)
    assert err.value.mistake == mistake
    check_pass_right(three, pass_isend_first)


@pytest.mark.slow
def test_a_blocking_gloo_send_returns_only_once_the_receiver_posts_its_recv(three):
    for numel in (1, 1_000_000):  # no size at which gloo buffers the message instead
        r = three.run(ring.send_waits_on_rank, 0.5, numel)[0]
        assert r["backend"] == "gloo"
        assert r["send_s"] >= 0.4, r


def test_a_stall_after_a_rank_returned_with_its_isend_unwaited_is_named_the_missing_wait():
    """Seen in the catalogue under load: a rank returns with its isend still posted, and its
    neighbour then stalls. The cause is the missing wait, not an unpaired exchange."""
    log = {"collectives": [], "unfinished": 0}
    returned = {"rank": 0, "p": 3, "got": None, "log": dict(log, unfinished=1)}
    stalled = {"rank": 1, "p": 3, "stalled": ("recv", 0), "log": log}
    with pytest.raises(CheckFailed) as caught:
        W.diagnose([returned, stalled, dict(stalled, rank=2)], 4)
    assert caught.value.mistake == W.MISSING_WAIT
    # every rank stalled, none returned: the exchange did not pair up
    with pytest.raises(CheckFailed) as caught:
        W.diagnose([dict(stalled, rank=r, log=dict(log, unfinished=1)) for r in range(3)], 4)
    assert caught.value.mistake == W.UNPAIRED
